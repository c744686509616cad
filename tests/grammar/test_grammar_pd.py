"""Constrained greedy decoding through prefill -> decode in this process (real role specs, real
NIXL transfer): prefill samples and accepts the first token under the grammar, decode replays it
into its own matcher and goes on. Tokens == the offline reference's, for each kind, page sizes 1
and 16, decode's normal and overlap loops, decode-side retraction (host copy: the matcher stays),
a local prefill on decode (conditional disaggregation) and decode's prefix cache."""

from __future__ import annotations

import pytest

from tests.grammar.reference import CONSTRAINTS, constrained_greedy
from tests.grammar.test_grammar_parity import prompts
from tests.pd.inproc import InProcessPD

MAX_NEW = 32


def check(pd: InProcessPD, path: str, rid: str, prompt: list[int], kind: str) -> list[int]:
    want = constrained_greedy(path, prompt, kind, CONSTRAINTS[kind], MAX_NEW)
    got = pd.tokens(rid)
    assert got == want, f"{rid} ({kind}) diverged"
    reason = pd.decode_out.outputs[rid][-1].finish_reason
    assert reason is not None and reason.type == ("stop" if want[-1] in pd.eos else "length")
    return got


@pytest.mark.parametrize(("page_size", "decode_overlap"), [(1, True), (16, False)])
def test_pd_constrained_parity(tiny_llama_path, page_size, decode_overlap):
    path = str(tiny_llama_path)
    pd = InProcessPD(path, prefill_args={"page_size": page_size},
                     decode_args={"page_size": page_size, "disable_overlap_schedule": not decode_overlap,
                                  "disaggregation_decode_enable_radix_cache": True})
    try:
        batch = prompts(pd.prefill.model_config.vocab_size, 6, seed=3, length=20)
        kinds = [list(CONSTRAINTS)[i % 3] for i in range(len(batch))]
        for i, (prompt, kind) in enumerate(zip(batch, kinds, strict=True)):
            pd.submit(f"r{i}", prompt, MAX_NEW, **{kind: CONSTRAINTS[kind]})
        pd.run_until_finished([f"r{i}" for i in range(len(batch))])
        outs = [check(pd, path, f"r{i}", p, k) for i, (p, k) in enumerate(zip(batch, kinds, strict=True))]
        pd.settle()
        # conditional disaggregation: the next turn of r0 is prefilled on decode, from its prefix cache
        turn = batch[0] + outs[0] + [7, 8]
        pd.submit_local("local", turn, MAX_NEW, regex=CONSTRAINTS["regex"])
        pd.run_until_finished(["local"])
        check(pd, path, "local", turn, "regex")
        assert pd.decode.scheduler.stats()["num_local_prefill_total"] == 1
        stats = [pd.prefill.scheduler.stats(), pd.decode.scheduler.stats()]
        assert all(s["grammar_compiles_total"] == 3 and s["grammar_rejections_total"] == 0 for s in stats)
    finally:
        pd.close()


def test_pd_constrained_parity_with_decode_retraction(tiny_llama_path):
    """Decode's pool holds fewer requests than it admitted: some are retracted to host memory and
    restored mid-grammar; their matchers are kept, the tokens stay exact."""
    path = str(tiny_llama_path)
    pd = InProcessPD(path, decode_args={"max_total_tokens": 160, "num_reserved_decode_tokens": 1})
    try:
        batch = prompts(pd.prefill.model_config.vocab_size, 6, seed=5, length=14)
        for i, prompt in enumerate(batch):
            pd.submit(f"r{i}", prompt, MAX_NEW, json_schema=CONSTRAINTS["json_schema"])
        pd.run_until_finished([f"r{i}" for i in range(len(batch))])
        for i, prompt in enumerate(batch):
            check(pd, path, f"r{i}", prompt, "json_schema")
        assert pd.decode.scheduler.num_retractions > 0
    finally:
        pd.close()
