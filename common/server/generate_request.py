"""The native /generate request body: every field of SGLang's GenerateReqInput.

One msgspec type for the router and every instance (and the source of the OpenAPI schema).
Same policy as sampling_params (common/sampling_request.py):
- honoured: text, input_ids, sampling_params, stream, rid, return_logprob, logprob_start_len,
  top_logprobs_num, return_text_in_logprobs, priority, the PD bootstrap fields; and ours,
  `incremental_stream` (deltas instead of SGLang's cumulative stream; default: the server's
  --incremental-streaming-output);
- accepted and ignored, at any value: hints about logging, tracing, routing and caching
  (IGNORED below);
- accepted at their default only, 400 naming the field otherwise: features this engine lacks
  (UNSUPPORTED_UNLESS below: multimodal inputs, LoRA, sessions, custom logit processors, ...);
- unknown fields: 400 naming them.
"""

from __future__ import annotations

from typing import Any

import msgspec

from common.sampling_request import SamplingParamsRequest, refuse_unsupported

IGNORED = (
    "log_metrics", "no_logs", "custom_labels", "external_trace_header", "received_time", "routing_key",
    "conversation_id", "extra_key", "http_worker_ipc", "routed_dp_rank", "data_parallel_rank",
    "disagg_prefill_dp_rank", "decode_tp_size", "bootstrap_pair_key", "kv_hints",
)
UNSUPPORTED_UNLESS: dict[str, tuple[Any, ...]] = {
    "cache_salt": (None,),  # per-tenant prefix-cache isolation: not implemented, so refused rather than ignored
    "input_embeds": (None,), "image_data": (None, []), "video_data": (None, []), "audio_data": (None, []),
    "mm_hashes": (None,), "mm_content_hashes": (None,), "use_audio_in_video": (False,), "video_config": (None,),
    "watermark": (None,), "token_ids_logprob": (None,), "return_sampling_mask": (None, False),
    "sampling_logprobs_mode": (None,), "return_flat_raw_top_logprobs": (False,),
    "return_flat_raw_output_top_logprobs": (False,), "return_hidden_states": (False,),
    "return_routed_experts": (False,), "routed_experts_start_len": (0,), "return_indexer_topk": (False,),
    "modalities": (None, [], ["text"]), "session_id": (None,), "session_params": (None,), "lora_path": (None,),
    "lora_id": (None,), "custom_logit_processor": (None,), "positional_embed_overrides": (None,),
    "background": (False,), "require_reasoning": (False,), "max_thinking_tokens": (None,),
    "return_bytes": (False,), "return_entropy": (False,), "return_prompt_token_ids": (False,),
    "need_wait_for_mm_inputs": (None, False), "num_items_assigned": (None,), "encoder_urls": (None,),
    "max_dynamic_patch": (None,), "min_dynamic_patch": (None,), "image_max_dynamic_patch": (None,),
    "video_max_dynamic_patch": (None,), "images_config": (None,), "mm_processor_kwargs": (None,),
    "multi_item_delimiter_indices": (None,), "token_indices_to_pool": (None,),
}


class GenerateRequestBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # honoured
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParamsRequest | None = None
    stream: bool = False
    incremental_stream: bool | None = None
    rid: str | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None  # -1 (default): no prompt logprobs; k: prompt tokens k.. too
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool = False
    priority: int | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    # ignored (hints)
    log_metrics: Any = None
    no_logs: Any = None
    custom_labels: Any = None
    external_trace_header: Any = None
    received_time: Any = None
    routing_key: Any = None
    conversation_id: Any = None
    extra_key: Any = None
    cache_salt: Any = None
    http_worker_ipc: Any = None
    routed_dp_rank: Any = None
    data_parallel_rank: Any = None
    disagg_prefill_dp_rank: Any = None
    decode_tp_size: Any = None
    bootstrap_pair_key: Any = None
    kv_hints: Any = None
    # refused unless at their default
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    mm_hashes: Any = None
    mm_content_hashes: Any = None
    use_audio_in_video: Any = False
    video_config: Any = None
    watermark: Any = None
    token_ids_logprob: Any = None
    return_sampling_mask: Any = None
    sampling_logprobs_mode: Any = None
    return_flat_raw_top_logprobs: Any = False
    return_flat_raw_output_top_logprobs: Any = False
    return_hidden_states: Any = False
    return_routed_experts: Any = False
    routed_experts_start_len: Any = 0
    return_indexer_topk: Any = False
    modalities: Any = None
    session_id: Any = None
    session_params: Any = None
    lora_path: Any = None
    lora_id: Any = None
    custom_logit_processor: Any = None
    positional_embed_overrides: Any = None
    background: Any = False
    require_reasoning: Any = False
    max_thinking_tokens: Any = None
    return_bytes: Any = False
    return_entropy: Any = False
    return_prompt_token_ids: Any = False
    need_wait_for_mm_inputs: Any = None
    num_items_assigned: Any = None
    encoder_urls: Any = None
    max_dynamic_patch: Any = None
    min_dynamic_patch: Any = None
    image_max_dynamic_patch: Any = None
    video_max_dynamic_patch: Any = None
    images_config: Any = None
    mm_processor_kwargs: Any = None
    multi_item_delimiter_indices: Any = None
    token_indices_to_pool: Any = None

    @property
    def wants_logprob(self) -> bool:
        return bool(self.return_logprob)

    @property
    def prompt_logprob_start(self) -> int:
        """-1: no prompt logprobs; else the first prompt position reported (SGLang's logprob_start_len)."""
        if not self.return_logprob or self.logprob_start_len is None:
            return -1
        return self.logprob_start_len

    @property
    def num_top_logprobs(self) -> int:
        return self.top_logprobs_num or 0

    @property
    def priority_value(self) -> int:
        return self.priority or 0

    def check_supported(self) -> None:
        """ValueError naming the first field that asks for what this engine cannot do."""
        refuse_unsupported(self, UNSUPPORTED_UNLESS)
