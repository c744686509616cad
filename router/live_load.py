"""One worker's live load: its last report (GET /get_load) and what this router sent it since.

Kept on each Worker (`worker.live`), filled by router/load.py's LoadMonitor, read by the
load_aware policy and the admission queue. `report` None: the worker never reported.
"""

from __future__ import annotations

import time

import msgspec

from common.server.generate_response import LoadReport

RATE_SMOOTHING = 0.3  # weight of a new prefill-rate sample
MIN_BUSY_SAMPLE_S = 0.02  # busy time a rate sample needs (shorter ones are noise)


class LiveLoad:
    """One worker's reported load plus this router's dispatches since the report was asked for."""

    def __init__(self) -> None:
        self.report: LoadReport | None = None
        self.asked_at = 0.0
        self.sent_tokens = 0  # prompt (prefill) or reservation (decode) tokens sent since asked_at
        self.sent_reqs = 0
        self.prefill_rate: float | None = None  # prompt tokens per second of busy engine time
        self.stale = False  # the last round's report failed: free KV unknown until the next one

    def fail(self) -> None:
        """This round's report did not arrive (error, timeout, bad body)."""
        self.stale = True

    def on_dispatch(self, tokens: int) -> None:
        self.sent_tokens += tokens
        self.sent_reqs += 1

    def apply(self, report: LoadReport, asked_at: float, sent_tokens: int = 0, sent_reqs: int = 0) -> None:
        prev = self.report
        if prev is not None:
            busy = report.step_seconds_total - prev.step_seconds_total
            done = report.prompt_tokens_total - prev.prompt_tokens_total
            if busy >= MIN_BUSY_SAMPLE_S and done > 0:
                sample = done / busy
                r = self.prefill_rate
                self.prefill_rate = sample if r is None else (1 - RATE_SMOOTHING) * r + RATE_SMOOTHING * sample
        self.report = report
        self.stale = False
        self.asked_at = asked_at
        self.sent_tokens = sent_tokens
        self.sent_reqs = sent_reqs

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens waiting on the worker now, as predicted (report + sent since)."""
        return (self.report.num_queued_tokens if self.report is not None else 0) + self.sent_tokens

    @property
    def free_kv_tokens(self) -> int | None:
        """KV tokens free for new reservations, as predicted; None: unknown (no report, or stale)."""
        if self.report is None or self.stale:
            return None
        return self.report.kv_free_tokens - self.sent_tokens

    def describe(self) -> dict[str, object] | None:
        if self.report is None:
            return None
        return {**msgspec.structs.asdict(self.report), "age_s": round(time.monotonic() - self.asked_at, 3),
                "sent_since": self.sent_reqs, "prefill_rate": self.prefill_rate, "stale": self.stale}
