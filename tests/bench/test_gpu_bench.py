"""bench/gpu/: what the GPU bench computes without a GPU: the shapes' parameter counts, the
weight-streaming floor's bytes, and the UCX transport table parser (no processes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "gpu"))

import gen_model  # noqa: E402
import ucx_transports  # noqa: E402

# The UCX that nixl-cu13 1.5.1 bundles: config and operation on two header lines, a column-header
# row, then the protocol rows. Prefill's KV put table: cuda_copy for the short sizes, cuda_ipc
# from the 4th row on (beyond the old `grep -A4` window); then the aux row's host write.
PROTO_INFO_LOG = """\
2026-11-26 10:00:01,000 INFO pdserve-engine[9] common.engine_core: KV pool: 65536 tokens
[1795787626.320703] [gpu-1:9:1]   +--------+-------------+-----------------------------------+
[1795787626.320703] [gpu-1:9:1]   | prefill-gpu-1-9-d206a6a6 intra-node cfg#1                |
[1795787626.320703] [gpu-1:9:1]   | remote memory write by ucp_put* from cuda/GPU0 to cuda/G |
[1795787626.320703] [gpu-1:9:1]   +--------+-------------+-----------------------------------+
[1795787626.320703] [gpu-1:9:1]   | Range  | Description |              Config               |
[1795787626.320703] [gpu-1:9:1]   +--------+-------------+-----------------------------------+
[1795787626.320703] [gpu-1:9:1]   |   0..0 | short       | cuda_copy/cuda                    |
[1795787626.320703] [gpu-1:9:1]   | 1..8K  | copy-in     | cuda_copy/cuda                    |
[1795787626.320703] [gpu-1:9:1]   | 8K..inf| zero-copy   | cuda_ipc/cuda                     |
[1795787626.320703] [gpu-1:9:1]   +--------+-------------+-----------------------------------+
2026-11-26 10:00:02,000 INFO pdserve-engine[9] kv_transfer.manager: peer added
[1795787626.330529] [gpu-1:9:1]   +--------+-------------+-----------------------------------+
[1795787626.330529] [gpu-1:9:1]   | prefill-gpu-1-9-d206a6a6 intra-node cfg#2                |
[1795787626.330529] [gpu-1:9:1]   | remote memory write by ucp_put* from host memory to host |
[1795787626.330529] [gpu-1:9:1]   +--------+-------------+-----------------------------------+
[1795787626.330529] [gpu-1:9:1]   | Range  | Description |              Config               |
[1795787626.330529] [gpu-1:9:1]   +--------+-------------+-----------------------------------+
[1795787626.330529] [gpu-1:9:1]   | 0..inf | zero-copy   | cma/memory                        |
[1795787626.330529] [gpu-1:9:1]   +--------+-------------+-----------------------------------+
"""

# Older UCX (the table PR openucx/ucx#7950 shows): one header line, no column-header row.
ONE_LINE_HEADER_LOG = """\
[1645019897.519901] [h:13202:0]  proto_debug.c:406  UCX  INFO  +---------------+-------------------------------+
[1645019897.519920] [h:13202:0]  proto_debug.c:406  UCX  INFO  | ep_cfg[3] | remote memory write by ucp_put* from cuda/dev[0] to cuda/dev[0] |
[1645019897.519924] [h:13202:0]  proto_debug.c:406  UCX  INFO  +---------------+----------+-----------------+
[1645019897.519927] [h:13202:0]  proto_debug.c:406  UCX  INFO  |       0..inf | zero-copy | cuda_ipc/cuda |
[1645019897.519941] [h:13202:0]  proto_debug.c:406  UCX  INFO  +---------------+----------+-----------------+
"""


def test_shapes_have_the_published_parameter_counts() -> None:
    """With the real vocabulary (128,256) the shapes count exactly Llama-3.2-1B (tied embeddings:
    one table less) and Llama-3.1-8B; with ours (384) only the embedding tables shrink."""
    s1, s8 = gen_model.SHAPES["1b"], gen_model.SHAPES["8b"]
    assert gen_model.param_count(s1, vocab=128256) - 128256 * s1.hidden == 1_235_814_400
    assert gen_model.param_count(s8, vocab=128256) == 8_030_261_248
    assert gen_model.param_count(s8) == 8_030_261_248 - 2 * (128256 - 384) * 4096
    assert gen_model.layer_weight_bytes(s8) == 2 * (gen_model.param_count(s8, vocab=0) - 4096)
    assert 13.9e9 < gen_model.layer_weight_bytes(s8) < 14.0e9  # the 8B floor's bytes: every layer
    assert 1.94e9 < gen_model.layer_weight_bytes(s1) < 1.95e9


def test_param_count_matches_transformers_llama_on_the_meta_device() -> None:
    transformers = pytest.importorskip("transformers")
    from common.model.testing import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    for name in ("tiny", "8b"):
        shape = gen_model.SHAPES[name]
        with torch.device("meta"):  # shapes only: nothing allocated
            model = transformers.LlamaForCausalLM(gen_model.llama_config(shape, tok))
        assert sum(p.numel() for p in model.parameters()) == gen_model.param_count(shape, len(tok)), name
        attn = model.model.layers[0].self_attn
        assert tuple(attn.k_proj.weight.shape) == (shape.kv_heads * shape.head_dim, shape.hidden)


def test_streamed_weight_bytes_reads_safetensors_headers_and_skips_the_embedding(tmp_path: Path) -> None:
    import throughput
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(384, 64, dtype=torch.bfloat16),
               "model.layers.0.mlp.up_proj.weight": torch.zeros(128, 64, dtype=torch.bfloat16)},
              str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"lm_head.weight": torch.zeros(384, 64, dtype=torch.bfloat16),
               "model.norm.weight": torch.zeros(64, dtype=torch.float32)},
              str(tmp_path / "model-00002-of-00002.safetensors"))
    assert throughput.streamed_weight_bytes(str(tmp_path)) == 2 * 128 * 64 + 2 * 384 * 64 + 4 * 64


def test_transports_of_the_kv_put_table_include_rows_past_the_old_grep_window() -> None:
    tables = ucx_transports.parse_tables(PROTO_INFO_LOG)
    assert [(t.kv_write, t.transports) for t in tables] == [
        (True, ["cuda_copy", "cuda_copy", "cuda_ipc"]), (False, ["cma"])]
    # the old grep: the operation line and the 4 lines after it hold one protocol row only
    lines = PROTO_INFO_LOG.splitlines()
    at = next(i for i, line in enumerate(lines) if "from cuda/GPU0 to cuda" in line)
    assert "cuda_ipc" not in "\n".join(lines[at:at + 5])
    assert ucx_transports.summarize(tables) == "kv: cuda_copy x2,cuda_ipc x1 (cuda/GPU0 to cuda/G); other: cma x1"


def test_one_line_headers_of_older_ucx_and_an_empty_log() -> None:
    (table,) = ucx_transports.parse_tables(ONE_LINE_HEADER_LOG)
    assert table.config == "ep_cfg[3]" and table.kv_write and table.transports == ["cuda_ipc"]
    assert ucx_transports.summarize(ucx_transports.parse_tables("no tables\n")).startswith("none logged")
