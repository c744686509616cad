"""What CompileCapture generated per bucket, for tests that must show which GEMM kinds ran.

Tests time no GEMM choices: inductor's C++ GEMM template is max-autotune's only backend, so
where the template applies it is taken without compiling and timing aten's alternative (the
cost of a cold compile cache), and the generated code shows it."""

from __future__ import annotations

from unittest import mock

import pytest
import torch._inductor.config as inductor_config
from torch._inductor.graph import GraphLowering

from common.model import compiled_decode
from common.model.compiled_decode import CompileCapture
from common.model.decode_graphs import Step

TEMPLATE_MARK = "_micro_gemm"  # each C++ GEMM template kernel defines its micro-kernel so named
PACKED_MARK = "mkldnn._linear_pointwise"  # oneDNN's packed linear, called by the compiled step


def record_compiled_code(monkeypatch: pytest.MonkeyPatch) -> dict[int, str]:
    """Bucket size -> the output code inductor wrote for it (also on a cache hit), compiled
    with the template as the only GEMM backend and in this process (no compile workers)."""
    monkeypatch.setattr(compiled_decode, "GEMM_BACKENDS", "CPP")
    monkeypatch.setattr(inductor_config, "compile_threads", 1)
    codes: dict[int, str] = {}
    capture = CompileCapture.capture

    def recording(self: CompileCapture, size: int, step: Step) -> Step:
        sources: list[str] = []
        with mock.patch.object(GraphLowering, "save_output_code", sources.append):
            compiled = capture(self, size, step)
        codes[size] = "\n".join(sources)
        return compiled

    monkeypatch.setattr(CompileCapture, "capture", recording)
    return codes
