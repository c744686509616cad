"""Validation and the context-length policy of the frontend, without processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from common.model.testing import build_tiny_tokenizer
from common.server.input_processor import InputProcessor, ModelInfo
from common.server.io_struct import BootstrapInfo
from common.server.protocol import ApiError, GenerateRequestBody, decode_generate_body
from common.server.server_args import ServerArgs


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tiny_tokenizer()


def processor(tok: Any, mode: str = "null", context: int = 256) -> InputProcessor:
    return InputProcessor(
        tok, ModelInfo(context_length=context, vocab_size=len(tok)), ServerArgs(disaggregation_mode=mode)
    )


def test_text_is_tokenized_and_params_carried(tok: Any) -> None:
    body = decode_generate_body(
        b'{"text": "Hello world", "sampling_params": {"stop": "x", "temperature": 0}}'
    )
    req = processor(tok).process(body, "r")
    assert req.input_ids == tok.encode("Hello world")
    assert req.sampling_params.stop == ["x"] and req.sampling_params.is_greedy
    assert req.bootstrap is None


def test_max_new_tokens_is_clipped_to_the_room_left_in_the_context(tok: Any) -> None:
    p = processor(tok, context=256)
    fits = p.process(GenerateRequestBody(input_ids=[5] * 250, sampling_params={"max_new_tokens": 6}), "a")
    assert fits.sampling_params.max_new_tokens == 6
    clipped = p.process(GenerateRequestBody(input_ids=[5] * 250, sampling_params={"max_new_tokens": 30}), "b")
    assert clipped.sampling_params.max_new_tokens == 6
    default = p.process(GenerateRequestBody(input_ids=[5] * 200), "c")
    assert default.sampling_params.max_new_tokens == 56  # the default 128, clipped
    for ids, params, message in [
        ([5] * 256, {}, "at most 255 prompt tokens fit"),
        ([5] * 3, {"max_new_tokens": 257}, "exceeds the context length 256"),
    ]:
        with pytest.raises(ApiError, match=message) as err:
            p.process(GenerateRequestBody(input_ids=ids, sampling_params=params), "d")
        assert err.value.status == 400


def test_bootstrap_is_required_in_pd_mode_and_dropped_when_colocated(tok: Any) -> None:
    boot: dict[str, Any] = {"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 42}
    body = GenerateRequestBody(input_ids=[1, 2], **boot)
    assert processor(tok, "decode").process(body, "r").bootstrap == BootstrapInfo("10.0.0.1", 8998, 42)
    assert processor(tok, "null").process(body, "r").bootstrap is None
    with pytest.raises(ApiError, match="required in PD mode"):
        processor(tok, "prefill").process(GenerateRequestBody(input_ids=[1]), "r")
    with pytest.raises(ApiError, match="bootstrap_room must be in"):
        processor(tok, "decode").process(
            GenerateRequestBody(input_ids=[1], **{**boot, "bootstrap_room": 2**63}), "r"
        )


@pytest.mark.parametrize(
    ("body", "rid", "message"),
    [
        ({"input_ids": [1]}, "", "rid must be"),
        ({"input_ids": [1]}, "x" * 300, "rid must be"),
        ({"input_ids": [1], "priority": 2**40}, "r", "priority"),
        ({"input_ids": [1], "top_logprobs_num": 3}, "r", "needs return_logprob"),
        ({"input_ids": [1], "sampling_params": "greedy"}, "r", "Expected `object | null`"),
    ],
)
def test_rejections(tok: Any, body: dict[str, Any], rid: str, message: str) -> None:
    with pytest.raises(ApiError, match=message):
        processor(tok).process(decode_generate_body(json.dumps(body).encode()), rid)


def test_model_info_prefers_engine_stats_then_flags_then_config(tmp_path: Path, tok: Any) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048, "vocab_size": 500}))
    args = ServerArgs(model_path=str(tmp_path))
    assert ModelInfo.resolve(args, tok, {}) == ModelInfo(2048, 500)
    flagged = ServerArgs(model_path=str(tmp_path), context_length=100)
    assert ModelInfo.resolve(flagged, tok, {}) == ModelInfo(100, 500)
    assert ModelInfo.resolve(flagged, tok, {"context_length": 77.0, "vocab_size": 600.0}) == ModelInfo(
        77, 600
    )
    with pytest.raises(RuntimeError, match="--context-length"):
        ModelInfo.resolve(ServerArgs(model_path=str(tmp_path / "none")), tok, {})
