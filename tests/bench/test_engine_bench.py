"""bench/engine.py's arguments and RESULT line (its runs take minutes on the default model)."""

from __future__ import annotations

import json

import bench_fakes  # noqa: F401  (puts bench/ on sys.path)
import engine as engine_bench
import pytest


def test_defaults_pick_the_dtype_from_the_cpu() -> None:
    args = engine_bench.parse_args([])
    assert (args.dtype, args.quick, args.decode_batch, args.torch_compile) == ("auto", False, 32, False)
    args = engine_bench.parse_args(["--quick", "--dtype", "bfloat16", "--torch-compile"])
    assert (args.dtype, args.quick, args.torch_compile) == ("bfloat16", True, True)


def test_result_line_carries_every_figure() -> None:
    result = {key: 1.0 for key in engine_bench.RESULT_KEYS} | {"cpu": {"flags": ["avx2"]}, "dtype": "float32"}
    line = engine_bench.result_line(result)
    assert line.startswith("RESULT ") and "\n" not in line
    assert json.loads(line.removeprefix("RESULT ")) == result
    del result["overlap_vs_normal"]
    with pytest.raises(ValueError, match="overlap_vs_normal"):
        engine_bench.result_line(result)
