"""Offline API: one engine in this process, no HTTP.

    from common.engine import Engine
    engine = Engine(model_path=DIR, page_size=16, chunked_prefill_size=256, max_total_tokens=8192)
    out = engine.generate(prompt=["Hello", "Hi"], sampling_params={"max_new_tokens": 8, "temperature": 0})
    # out[i] = {"text", "output_ids", "meta_info": {"finish_reason", "prompt_tokens",
    #                                              "completion_tokens", "cached_tokens"}}
    engine.shutdown()

Bad input raises ValueError (the engine stays usable).
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from common.engine_core import build_engine_core
from common.sampling_params import SamplingParams
from common.scheduler.messages import FinishReason, TokenOut
from common.scheduler.req import Req
from common.server.detokenizer import RequestDetokenizer
from common.server.server_args import ServerArgs
from common.tokenizer_loading import load_tokenizer


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("device", "cpu")
        self.args = ServerArgs(model_path=model_path, **kwargs)
        self._outputs: dict[str, list[TokenOut]] = {}
        self.core = build_engine_core(self.args, self._collect)
        self.scheduler = self.core.scheduler
        self.tokenizer = load_tokenizer(self.args.tokenizer_path or self.core.model_path)
        self.eos_token_ids = frozenset(self.core.model_config.eos_token_ids)
        self.context_length = self.scheduler.cfg.context_length
        self.vocab_size = self.core.model_config.vocab_size

    def _collect(self, items: list[TokenOut]) -> None:
        for item in items:
            self._outputs.setdefault(item.rid, []).append(item)

    # ---- input handling ---------------------------------------------------------------------
    def _prompts(self, prompt: str | list[str] | None, input_ids: list[int] | list[list[int]] | None) -> tuple[list[list[int]], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt / input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            texts = [prompt] if isinstance(prompt, str) else list(prompt)
            if not all(isinstance(t, str) for t in texts):
                raise ValueError("prompt must be a string or a list of strings")
            return [self.tokenizer.encode(t, add_special_tokens=False) for t in texts], single
        assert input_ids is not None
        single = bool(input_ids) and isinstance(input_ids[0], int)
        batch = [input_ids] if single else list(input_ids)
        for ids in batch:
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError("input_ids must be a list of ints or a list of lists of ints")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"input_ids contain ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        return batch, single  # type: ignore[return-value]

    def _params(self, sampling_params: dict[str, Any] | list[dict[str, Any]] | None, n: int) -> list[SamplingParams]:
        raw = sampling_params if isinstance(sampling_params, list) else [sampling_params or {}] * n
        if len(raw) != n:
            raise ValueError(f"{len(raw)} sampling_params for {n} prompts")
        params = [SamplingParams.from_dict(p) for p in raw]
        for p in params:
            p.validate(self.vocab_size)
        return params

    # ---- generation -------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        *,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        prompts, single = self._prompts(prompt, input_ids)
        params = self._params(sampling_params, len(prompts))
        for ids in prompts:
            if not ids:
                raise ValueError("the prompt is empty")
            if len(ids) >= self.context_length:
                raise ValueError(f"the prompt has {len(ids)} tokens; the context length is {self.context_length}")
        rids = [uuid.uuid4().hex for _ in prompts]
        detoks: dict[str, RequestDetokenizer] = {}
        texts: dict[str, str] = {}
        stops: dict[str, FinishReason] = {}
        for rid, ids, p in zip(rids, prompts, params, strict=True):
            limit = min(p.max_new_tokens, self.context_length - len(ids))
            if limit != p.max_new_tokens:
                p = msgspec.structs.replace(p, max_new_tokens=limit)
            req = Req(
                rid=rid, origin_input_ids=list(ids), sampling_params=p, stream=True, return_logprob=return_logprob,
                top_logprobs_num=top_logprobs_num, eos_token_ids=self.eos_token_ids,
            )
            self.scheduler.add_request(req)
            detoks[rid] = RequestDetokenizer(self.tokenizer, ids, stops=p.stop, skip_special_tokens=p.skip_special_tokens)
            texts[rid] = ""
        live = set(rids)
        seen: dict[str, int] = dict.fromkeys(rids, 0)
        while live:
            self.scheduler.step()
            for rid in list(live):
                outs = self._outputs.get(rid, [])
                for item in outs[seen[rid] :]:
                    update = detoks[rid].step(item.new_token_ids, finished=item.finish_reason is not None)
                    texts[rid] += update.delta
                    if update.matched_stop is not None and rid not in stops:
                        stops[rid] = FinishReason("stop", message=update.matched_stop)
                        self.scheduler.abort(rid, "stop string")
                seen[rid] = len(outs)
                if outs and outs[-1].finish_reason is not None:
                    live.discard(rid)
            if not self.scheduler.has_work and live:
                raise RuntimeError(f"engine went idle with unfinished requests {sorted(live)}")
        while self.scheduler.has_work:
            self.scheduler.step()
        results = [self._result(rid, texts[rid], stops.get(rid)) for rid in rids]
        return results[0] if single else results

    def _result(self, rid: str, text: str, stop: FinishReason | None) -> dict[str, Any]:
        outs = self._outputs.pop(rid)
        ids = [t for o in outs for t in o.new_token_ids]
        last = outs[-1]
        reason = stop or last.finish_reason
        assert reason is not None
        finish: dict[str, Any] = {"type": reason.type}
        if reason.type == "stop":
            finish["matched"] = reason.message if stop is not None else reason.matched_token
        elif reason.type == "abort":
            finish["message"] = reason.message
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": last.prompt_tokens,
            "completion_tokens": len(ids),
            "cached_tokens": last.cached_tokens,
        }
        lps = [lp for o in outs for lp in (o.new_token_logprobs or [])]
        if lps:
            meta["output_token_logprobs"] = [[lp, t] for lp, t in zip(lps, ids, strict=False)]
        tops = [pos for o in outs for pos in (o.new_top_logprobs or [])]
        if tops:
            meta["output_top_logprobs"] = [[[lp, t] for t, lp in pos] for pos in tops]
        return {"text": text, "output_ids": ids, "meta_info": meta}

    def check_integrity(self) -> None:
        self.scheduler.kv.check_integrity()

    def shutdown(self) -> None:
        self.core.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
