"""What the flashinfer backend settles at startup: kernel choice, refusals, warm-up, default,
the pinned release, and its exact calls against the release's signatures."""

from __future__ import annotations

import importlib.util
import inspect
import logging
from pathlib import Path
from typing import Any

import pytest
import tomllib
import torch

from common.model.attention import AttentionShape, create_attention_backend
from common.model.attention.flashinfer_support import flashinfer_shape_problem, resolve_attention_backend
from common.model.forward_batch import ForwardMode
from common.server.server_args import ServerArgs
from tests.model import flashinfer_reference
from tests.model.attention_cases import CASES, gqa_shape, make_case

REPO_ROOT = Path(__file__).resolve().parents[2]
CUDA = torch.device("cuda", 0)


def build(shape: AttentionShape, dtype: torch.dtype = torch.bfloat16, case: str = "decode") -> Any:
    mode, lens = CASES[case]
    pool, r2t, batch, _ = make_case(shape, mode, lens, 16, "cpu", dtype)
    return create_attention_backend("flashinfer", shape=shape, kv_pool=pool, req_to_token=r2t), batch


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8])
def test_decode_uses_tensor_cores_from_group_four(monkeypatch: pytest.MonkeyPatch, group: int) -> None:
    flashinfer_reference.install(monkeypatch)
    backend, batch = build(gqa_shape(128, group))
    assert backend._decode.use_tensor_cores == (group >= 4)
    backend.init_forward_metadata(batch)  # plans the decode kernel: a group of 5 or 7 no longer raises


def test_startup_refuses_what_the_kernels_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    flashinfer_reference.install(monkeypatch)
    with pytest.raises(ValueError, match="flashinfer runs float16/bfloat16 attention, not float32"):
        build(gqa_shape(64, 2), torch.float32)
    with pytest.raises(ValueError, match="flashinfer supports head_dim 64, 128, 256, 512, the model has 96"):
        build(gqa_shape(96, 2))
    assert flashinfer_shape_problem(gqa_shape(128, 7), torch.float16) is None


def test_both_kernels_are_planned_and_run_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    flashinfer_reference.install(monkeypatch)
    build(gqa_shape(64, 1))
    called = [name for name, _, _ in flashinfer_reference.CALLS]
    for wrapper in ("BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper"):
        assert [c for c in called if c.startswith(wrapper)] == [f"{wrapper}.{m}" for m in ("__init__", "plan", "run")]


def test_auto_is_flashinfer_on_cuda_when_installed(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    shape = gqa_shape(128, 4)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "flashinfer" else None)
    assert resolve_attention_backend("auto", shape, CUDA, torch.bfloat16) == "flashinfer"
    assert resolve_attention_backend("auto", shape, torch.device("cpu"), torch.bfloat16) == "torch"
    assert resolve_attention_backend("torch", shape, CUDA, torch.bfloat16) == "torch"
    with caplog.at_level(logging.WARNING):
        assert resolve_attention_backend("auto", shape, CUDA, torch.float32) == "torch"
        monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
        assert resolve_attention_backend("auto", shape, CUDA, torch.bfloat16) == "torch"
    assert "not float32" in caplog.text and "flashinfer is not installed" in caplog.text


def test_server_args_default_to_auto_and_refuse_flashinfer_in_float32() -> None:
    assert ServerArgs().attention_backend == "auto"
    with pytest.raises(ValueError, match="flashinfer runs float16/bfloat16 only"):
        ServerArgs(attention_backend="flashinfer", device="cuda", dtype="float32")


def test_cuda_extra_pins_the_release_the_reference_mirrors() -> None:
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"flashinfer-python=={flashinfer_reference.PINNED_VERSION}" in extras["cuda"]


def real_method(module: Any, qualname: str) -> Any:
    """The real wrapper method; plan() that only forwards **kwargs is read through _plan_impl."""
    cls_name, method = qualname.split(".")
    cls = getattr(module, cls_name)
    fn = getattr(cls, method)
    params = inspect.signature(fn).parameters.values()
    if method == "plan" and any(p.kind is p.VAR_KEYWORD for p in params) and hasattr(cls, "_plan_impl"):
        fn = cls._plan_impl
    return fn


def backend_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
    """Every flashinfer call the backend makes: construction (with warm-up), a decode and an extend step."""
    flashinfer_reference.install(monkeypatch)
    for mode, case in ((ForwardMode.DECODE, "decode"), (ForwardMode.EXTEND, "extend")):
        backend, batch = build(gqa_shape(128, 4), case=case)
        assert batch.mode == mode
        backend.init_forward_metadata(batch)
        backend.forward(torch.zeros(batch.num_tokens, 8, 128, dtype=torch.bfloat16), None, None, 0, batch)
    return list(flashinfer_reference.CALLS)


def test_backend_calls_bind_to_the_reference_signatures(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = backend_calls(monkeypatch)
    assert {name.split(".")[1] for name, _, _ in calls} == {"__init__", "plan", "run"}
    for name, args, kwargs in calls:
        inspect.signature(real_method(flashinfer_reference, name)).bind(None, *args, **kwargs)


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer (pip install '.[cuda]')")
def test_backend_calls_bind_to_the_real_signatures(monkeypatch: pytest.MonkeyPatch) -> None:
    import flashinfer as real

    calls = backend_calls(monkeypatch)
    for name, args, kwargs in calls:
        inspect.signature(real_method(real, name)).bind(None, *args, **kwargs)
    for cls_name in ("BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper"):
        for method in ("__init__", "plan", "run"):
            mine = inspect.signature(real_method(flashinfer_reference, f"{cls_name}.{method}")).parameters
            theirs = inspect.signature(real_method(real, f"{cls_name}.{method}")).parameters
            for p in mine.values():
                assert p.name in theirs and theirs[p.name].default == p.default, (cls_name, method, p.name)


class _LoggedEvent:
    def __init__(self, log: list[tuple[str, int]], number: int) -> None:
        self.log, self.number = log, number

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.log.append(("wait", self.number))


def test_a_wrapper_waits_for_its_last_plan_copy_before_planning_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """plan() rewrites the wrapper's one pinned plan buffer: in the one-thread overlap loop step
    N+1 is planned while step N is queued, so the backend first waits for the event recorded
    after that wrapper's previous plan (the buffer's copy to the device)."""
    from common.model.device_streams import HostStreams, StepEvent

    flashinfer_reference.install(monkeypatch)
    log: list[tuple[str, int]] = []

    class LoggedStreams(HostStreams):
        def record(self) -> StepEvent:
            number = sum(1 for what, _ in log if what == "record")
            log.append(("record", number))
            return _LoggedEvent(log, number)

    shape = gqa_shape(128, 4)
    decode_pool, r2t, decode_batch, _ = make_case(shape, *CASES["decode"], 16, "cpu", torch.bfloat16)
    backend = create_attention_backend("flashinfer", shape=shape, kv_pool=decode_pool, req_to_token=r2t,
                                       streams=LoggedStreams(decode_pool.device))
    for wrapper in (backend._decode, backend._prefill):
        plan, name = wrapper.plan, "decode" if wrapper is backend._decode else "prefill"
        monkeypatch.setattr(wrapper, "plan", lambda *a, _plan=plan, _n=name, **k: (log.append((_n, 0)), _plan(*a, **k)))
    _, _, extend_batch, _ = make_case(shape, *CASES["extend"], 16, "cpu", torch.bfloat16)
    for batch in (decode_batch, decode_batch, extend_batch, decode_batch):
        backend.init_forward_metadata(batch)

    last_record: dict[str, int] = {"decode": 0, "prefill": 1}  # the warm-up planned decode, then prefill
    for i, (what, _) in enumerate(log):
        if what in last_record:
            assert log[i - 1] == ("wait", last_record[what]), (what, log)
            assert log[i + 1][0] == "record"
            last_record[what] = log[i + 1][1]
    assert [w for w, _ in log if w in last_record] == ["decode", "decode", "prefill", "decode"]
