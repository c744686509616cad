"""Prompt logprobs in bounded chunks: log_softmax of the logits at each prompt position, gathered
at the next prompt token (and the top-k alternatives), never more than `chunk_rows` positions'
[rows x vocab] fp32 logits at a time, whatever --chunked-prefill-size is (with -1 a whole
prompt's logits would be one tensor: prompt x vocab x 4 bytes, GPU OOM at long contexts).

Owned by the model worker; `compute_logits` is the runner's (a TP collective: every rank calls it
the same number of times, which the chunking, a function of the row count only, ensures).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.scheduler.executor import PromptLogprobs

LOGITS_CHUNK_BYTES = 128 << 20  # fp32 logits of one chunk (log_softmax makes one more of the same size)


def chunk_rows_for(vocab_size: int) -> int:
    return max(1, LOGITS_CHUNK_BYTES // (4 * max(1, vocab_size)))


def prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                    targets: list[int], top_k: int, chunk_rows: int) -> PromptLogprobs:
    """hidden: [len(targets), hidden] rows whose next tokens are `targets`."""
    chosen: list[float] = []
    top: list[list[tuple[int, float]]] | None = [] if top_k else None
    ids = torch.tensor(targets, dtype=torch.int64, device=hidden.device)
    for at in range(0, len(targets), chunk_rows):
        logprobs = torch.log_softmax(compute_logits(hidden[at : at + chunk_rows]), dim=-1)
        chosen += logprobs.gather(1, ids[at : at + chunk_rows, None]).squeeze(1).tolist()
        if top is not None:
            values, top_ids = logprobs.topk(top_k, dim=-1)
            top += [list(zip(t, v, strict=True)) for t, v in zip(top_ids.tolist(), values.tolist(), strict=True)]
        del logprobs
    return chosen, top
