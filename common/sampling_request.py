"""`sampling_params` as a client sends it: every key SGLang documents, on the router and every instance.

The one wire type for sampling parameters (the OpenAPI schemas are generated from it). Policy:
- keys this engine honours are mapped onto SamplingParams (`sampling_seed` is SGLang's name of
  `seed`; JSON null means "the default", as in SGLang);
- keys it cannot honour are accepted at their default value and refused with a ValueError
  naming the key otherwise (e.g. `sampling_params.stop_regex`);
- unknown keys are refused by name (msgspec's forbid_unknown_fields).
"""

from __future__ import annotations

from typing import Any

import msgspec

from common.sampling_params import SamplingParams

# key -> the values that mean "feature off" (anything else asks for what this engine lacks)
UNSUPPORTED_UNLESS: dict[str, tuple[Any, ...]] = {
    "stop_regex": (None, "", []),
    "min_new_tokens": (None, 0),
    "n": (None, 1),
    "beam_width": (None, 1),
    "structural_tag": (None,),
    "spaces_between_special_tokens": (None, True),
    "logit_bias": (None, {}),
    "custom_params": (None, {}),
    "watermark": (None,),
}
IGNORED = ("stream_interval",)  # output cadence hint: every token is streamed as soon as it exists


class SamplingParamsRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """SGLang's sampling_params keys (docs/generate_api.md)."""

    max_new_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    seed: int | None = None
    sampling_seed: int | None = None
    stream_interval: int | None = None
    stop_regex: str | list[str] | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    beam_width: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    grammar_prefix_len: int | None = None  # not SGLang's: set by the router on a migrated request
    structural_tag: str | None = None
    spaces_between_special_tokens: bool | None = None
    logit_bias: dict[str, float] | None = None
    custom_params: dict[str, Any] | None = None
    watermark: Any = None

    def to_sampling_params(self) -> SamplingParams:
        """The engine's SamplingParams; ValueError naming the key for what cannot be honoured."""
        refuse_unsupported(self, UNSUPPORTED_UNLESS, "sampling_params.")
        if self.seed is not None and self.sampling_seed is not None and self.seed != self.sampling_seed:
            raise ValueError("sampling_params.seed and sampling_params.sampling_seed disagree")
        given: dict[str, Any] = {}
        for key in SamplingParams.__struct_fields__:
            value = getattr(self, key)
            if value is not None:
                given[key] = value
        if self.sampling_seed is not None:
            given["seed"] = self.sampling_seed
        if isinstance(given.get("stop"), str):
            given["stop"] = [given["stop"]]
        try:
            params = msgspec.convert(given, SamplingParams, strict=False)
        except msgspec.ValidationError as e:
            raise ValueError(f"invalid sampling_params: {e}") from None
        params.validate()
        return params


def parse_sampling_params(raw: Any) -> SamplingParams:
    """A decoded JSON value (dict or None) -> SamplingParams, or ValueError naming the key."""
    if raw is None:
        raw = {}
    if isinstance(raw, SamplingParamsRequest):
        return raw.to_sampling_params()
    if not isinstance(raw, dict):
        raise ValueError("sampling_params must be an object")
    try:
        request = msgspec.convert(raw, SamplingParamsRequest, strict=True)
    except msgspec.ValidationError as e:
        message = str(e).replace("`$.", "`sampling_params.").replace("`$`", "`sampling_params`")
        if message.startswith("Object contains unknown field"):
            raise ValueError("unknown sampling parameter(s): " + message.split("`", 2)[1]) from None
        raise ValueError(f"invalid sampling_params: {message}") from None
    return request.to_sampling_params()


def refuse_unsupported(record: Any, table: dict[str, tuple[Any, ...]], prefix: str = "") -> None:
    """ValueError naming the first field of `record` whose value asks for an unsupported feature."""
    for key, off in table.items():
        value = getattr(record, key)
        if not any(value == v and type(value) is type(v) for v in off):
            raise ValueError(f"{prefix}{key}={_short(value)} is not supported by this server")


def _short(value: Any) -> str:
    text = msgspec.json.encode(value).decode()
    return text if len(text) <= 60 else text[:57] + "..."
