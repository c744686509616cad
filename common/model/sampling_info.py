"""SamplingBatchInfo: the sampling parameters of one batch, as tensors on the sampler's device.

Built by the scheduler once per batch from its requests' SamplingParams (row i of
the batch = row i of the logits). `rows` are the requests' sampler rows (use the
request's req_to_token row), which key the penalty and seed state kept inside
the Sampler across steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.model.device_streams import DeviceStreams, HostStreams
from common.sampling_params import SamplingParams

# Top-p without top-k first looks at this many most likely tokens (falls back to a full sort
# when their mass is below top_p): a full-vocabulary sort costs far more on CPU.
TOP_P_CANDIDATES = 1024


@dataclass
class SamplingBatchInfo:
    rows: torch.Tensor  # [bs] int64 sampler rows (unique within a batch)
    rows_cpu: list[int]
    greedy: torch.Tensor  # [bs] bool: argmax (temperature 0 or top_k 1)
    temperatures: torch.Tensor  # [bs, 1] float32, 1.0 on greedy rows
    top_ks: torch.Tensor  # [bs] int64, vocab_size when disabled
    top_ps: torch.Tensor  # [bs] float32
    min_ps: torch.Tensor  # [bs] float32
    repetition_penalties: torch.Tensor  # [bs] float32
    frequency_penalties: torch.Tensor  # [bs] float32
    presence_penalties: torch.Tensor  # [bs] float32
    seeds: list[int | None]  # per request; seeded rows draw noise from (seed, step) only
    top_logprobs_nums: list[int]  # per request, 0 = none
    return_logprob: bool  # logprob of each chosen token
    is_all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    candidate_k: int  # tokens to rank for top-k/top-p (vocab_size = full sort)
    check_candidate_mass: bool  # rows without top-k rely on the candidates covering top_p
    has_penalties: bool
    has_repetition_penalty: bool

    @property
    def batch_size(self) -> int:
        return len(self.rows_cpu)

    @property
    def max_top_logprobs(self) -> int:
        return max(self.top_logprobs_nums, default=0)

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        rows: Sequence[int],
        *,
        vocab_size: int,
        device: torch.device | str = "cpu",
        return_logprob: bool = False,
        top_logprobs_nums: Sequence[int] | None = None,
        streams: DeviceStreams | None = None,
    ) -> SamplingBatchInfo:
        """streams: stages the per-row tensors (one async copy per dtype on CUDA)."""
        if len(params) != len(rows):
            raise ValueError(f"{len(params)} sampling params for {len(rows)} rows")
        if len(set(rows)) != len(rows):
            raise ValueError(f"sampler rows must be unique within a batch, got {list(rows)}")
        nums = list(top_logprobs_nums) if top_logprobs_nums is not None else [0] * len(rows)
        if len(nums) != len(rows) or any(n < 0 or n > vocab_size for n in nums):
            raise ValueError(f"bad top_logprobs_nums {nums}")
        greedy = [p.is_greedy for p in params]
        top_ks = [vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in params]

        sampled = [p for p, g in zip(params, greedy, strict=True) if not g]
        restricted = [p.top_k for p in sampled if 0 < p.top_k < vocab_size]
        free = [p for p in sampled if not 0 < p.top_k < vocab_size]
        candidate_k = max(restricted, default=0)
        if free:
            wide = TOP_P_CANDIDATES if all(p.top_p < 1.0 for p in free) else vocab_size
            candidate_k = max(candidate_k, wide)
        stage = (streams or HostStreams(torch.device(device))).stage
        rows_t, top_ks_t = stage([rows, top_ks], torch.int64)
        floats = stage(
            [
                [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
                [p.top_p for p in params],
                [p.min_p for p in params],
                [p.repetition_penalty for p in params],
                [p.frequency_penalty for p in params],
                [p.presence_penalty for p in params],
            ],
            torch.float32,
        )
        return cls(
            rows=rows_t,
            rows_cpu=list(rows),
            greedy=stage([greedy], torch.bool)[0],
            temperatures=floats[0][:, None],
            top_ks=top_ks_t,
            top_ps=floats[1],
            min_ps=floats[2],
            repetition_penalties=floats[3],
            frequency_penalties=floats[4],
            presence_penalties=floats[5],
            seeds=[p.seed for p in params],
            top_logprobs_nums=nums,
            return_logprob=return_logprob or any(nums),
            is_all_greedy=all(greedy),
            need_top_k=bool(restricted),
            need_top_p=any(p.top_p < 1.0 for p in sampled),
            candidate_k=min(candidate_k, vocab_size),
            check_candidate_mass=bool(free) and candidate_k < vocab_size,
            need_min_p=any(p.min_p > 0.0 for p in sampled),
            has_penalties=any(p.has_penalties for p in params),
            has_repetition_penalty=any(p.repetition_penalty != 1.0 for p in params),
        )
