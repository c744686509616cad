"""Scheduler settings: one frozen record, built once by ServerArgs or the offline Engine."""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULE_POLICIES = ("fcfs", "lpm", "lof", "random", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    page_size: int = 16
    chunked_prefill_size: int = 512  # tokens of one request per prefill batch (page aligned); <= 0 disables chunking
    max_prefill_tokens: int = 4096  # tokens of all requests in one prefill batch
    max_running_requests: int = 64
    schedule_policy: str = "lpm"
    schedule_conservativeness: float = 1.0
    enable_overlap: bool = True
    enable_mixed_chunk: bool = False
    disable_radix_cache: bool = False
    context_length: int = 2048
    # new_token_ratio (DESIGN.md §4)
    init_new_token_ratio: float = 0.7
    min_new_token_ratio_factor: float = 0.14
    new_token_ratio_decay_steps: int = 600
    retract_decode_steps: int = 20
    clip_max_new_tokens_estimation: int = 4096
    lpm_fcfs_fallback_queue_len: int = 128
    random_seed: int = 0

    def __post_init__(self) -> None:
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"--schedule-policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        if self.page_size < 1:
            raise ValueError("--page-size must be >= 1")
        if 0 < self.chunked_prefill_size < self.page_size:
            raise ValueError("--chunked-prefill-size must be >= --page-size")
        if self.max_running_requests < 1:
            raise ValueError("--max-running-requests must be >= 1")

    @property
    def chunk_tokens(self) -> int | None:
        """Chunk size rounded down to whole pages, None when chunking is off."""
        if self.chunked_prefill_size <= 0:
            return None
        return self.chunked_prefill_size // self.page_size * self.page_size
