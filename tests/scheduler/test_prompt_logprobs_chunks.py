"""Security review 2, L13: prompt logprobs never build one [prompt x vocab] logits tensor, whatever
--chunked-prefill-size is; the chunked answer equals the one-shot log_softmax."""

from __future__ import annotations

import torch

from common.scheduler.prompt_logprobs import LOGITS_CHUNK_BYTES, chunk_rows_for, prompt_logprobs


def test_chunks_are_bounded_and_exact() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(37, 16)
    targets = torch.randint(0, 50, (37,)).tolist()
    rows_seen: list[int] = []

    def compute_logits(h: torch.Tensor) -> torch.Tensor:
        rows_seen.append(h.shape[0])
        return head(h).float()

    with torch.no_grad():
        chosen, top = prompt_logprobs(compute_logits, hidden, targets, 3, chunk_rows=5)
        full = torch.log_softmax(head(hidden), dim=-1)
    assert max(rows_seen) == 5 and sum(rows_seen) == 37
    assert torch.allclose(torch.tensor(chosen), full.gather(1, torch.tensor(targets)[:, None]).squeeze(1), atol=1e-6)
    assert top is not None and len(top) == 37
    values, ids = full.topk(3, dim=-1)
    assert [[t for t, _ in pos] for pos in top] == ids.tolist()
    assert torch.allclose(torch.tensor([[v for _, v in pos] for pos in top]), values, atol=1e-6)
    assert prompt_logprobs(compute_logits, hidden[:4], targets[:4], 0, chunk_rows=5)[1] is None


def test_chunk_rows_fit_the_budget_for_real_vocabularies() -> None:
    for vocab in (32_000, 49_152, 128_256, 151_936, 262_144):
        rows = chunk_rows_for(vocab)
        assert rows >= 1 and rows * vocab * 4 <= LOGITS_CHUNK_BYTES
    assert chunk_rows_for(10**9) == 1
