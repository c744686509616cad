"""Our logits == transformers' (fp32, 1e-4) for batches of extend, extend-on-prefix, decode and mixed steps."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from common.model.forward_batch import ForwardMode
from common.model.testing import build_tiny_checkpoint
from tests.model.harness import PagedHarness, hf_logits, load_hf

ATOL = 1e-4


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def parity_steps(rng: random.Random, vocab: int) -> list[tuple[ForwardMode, list[tuple[str, list[int]]]]]:
    """The batches of the parity schedule: (mode, [(request, new tokens)]) per step."""
    return [
        (ForwardMode.EXTEND, [("a", _ids(rng, 9, vocab)), ("b", _ids(rng, 7, vocab)), ("c", _ids(rng, 21, vocab))]),
        # a continues on its cached prefix, d is a one-token prompt, b grows by a chunk
        (ForwardMode.EXTEND, [("a", _ids(rng, 12, vocab)), ("d", _ids(rng, 1, vocab)), ("b", _ids(rng, 3, vocab))]),
        (ForwardMode.DECODE, [(n, _ids(rng, 1, vocab)) for n in ("a", "b", "c", "d")]),
        (ForwardMode.DECODE, [(n, _ids(rng, 1, vocab)) for n in ("d", "c", "a", "b")]),
        (ForwardMode.MIXED, [("c", _ids(rng, 5, vocab)), ("a", _ids(rng, 1, vocab)), ("d", _ids(rng, 1, vocab))]),
    ]


def run_schedule(path: str, page_size: int, seed: int = 0) -> None:
    """Four requests through EXTEND, EXTEND-on-prefix, DECODE and MIXED steps; every token's
    logits are checked against transformers run on the request's whole sequence."""
    h = PagedHarness(path, page_size=page_size, seed=seed)
    vocab = h.runner.vocab_size
    rng = random.Random(seed)
    seen: list[tuple[str, int, torch.Tensor]] = []  # (request, position, our logits)

    def step(mode: ForwardMode, steps: list[tuple[str, list[int]]]) -> None:
        before = {name: len(h.seqs[name].tokens) if name in h.seqs else 0 for name, _ in steps}
        logits = h.step(mode, steps)
        i = 0
        for name, new in steps:
            for j in range(len(new)):
                seen.append((name, before[name] + j, logits[i]))
                i += 1

    for mode, steps in parity_steps(rng, vocab):
        step(mode, steps)

    ref = load_hf(path)
    want = {name: hf_logits(ref, h.seq(name)) for name in h.seqs}
    for name, pos, ours in seen:
        err = (ours - want[name][pos]).abs().max().item()
        assert err < ATOL, f"request {name} position {pos}: max |diff| {err}"
    assert len(seen) == sum(len(h.seq(n)) for n in h.seqs)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_logits_match_transformers(tiny_checkpoint, arch: str, page_size: int) -> None:
    run_schedule(tiny_checkpoint(arch), page_size, seed=page_size)


def test_last_token_logits_equal_all_token_logits(tiny_qwen2_path: str) -> None:
    a = PagedHarness(tiny_qwen2_path, page_size=4, seed=1)
    b = PagedHarness(tiny_qwen2_path, page_size=4, seed=2)
    steps = [("x", [5, 6, 7, 8, 9]), ("y", [10, 11]), ("z", [12])]
    full = a.step(ForwardMode.EXTEND, steps)
    last = b.step_last(ForwardMode.EXTEND, steps)
    assert last.dtype == torch.float32 and last.shape == (3, b.runner.vocab_size)
    torch.testing.assert_close(last, full[[4, 6, 7]], rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    ],
    ids=lambda r: r["rope_type"],
)
def test_rope_scaling_matches_transformers(tmp_path: Path, rope: dict) -> None:
    path = build_tiny_checkpoint(tmp_path / "ckpt", "llama")
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 10000.0
    cfg["rope_scaling"] = rope  # the pre-transformers-5 spelling real checkpoints still use
    cfg_file.write_text(json.dumps(cfg))
    h = PagedHarness(str(path), page_size=16)
    assert h.runner.model_config.rope_type == rope["rope_type"]
    rng = random.Random(0)
    ids = _ids(rng, 150, h.runner.vocab_size)  # long enough for the scaled low frequencies to matter
    ours = torch.cat([h.step(ForwardMode.EXTEND, [("a", ids[:100])]), h.step(ForwardMode.DECODE, [("a", ids[100:101])])])
    want = hf_logits(load_hf(str(path)), ids[:101])
    assert (ours - want).abs().max().item() < ATOL
