"""The one record the scheduler hands to the model runner per step.

The scheduler owns every field; the runner only reads them. All tensors are int64
on the runner's device. Tokens of all requests are packed back to back:

    request:        r0            r1        r2
    extend tokens:  [t t t t t]   [t]       [t t]        <- input_ids / positions / out_cache_loc
    prefix_lens:    3             9         0            <- tokens already in the KV cache
    extend_lens:    5             1         2
    seq_lens:       8             10        2            <- prefix + extend (KV length after the step)

The KV of token i of request r lives at slot req_to_token[req_pool_indices[r], i]
(slot = page * page_size + offset). The runner writes the new tokens' KV to
out_cache_loc before attention, so attention reads the whole sequence
[0, seq_len) through req_to_token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from common.model.device_streams import DeviceStreams, HostStreams


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill (possibly a chunk, possibly after a cached prefix)
    DECODE = "decode"  # one token per request
    MIXED = "mixed"  # extend chunks plus decode tokens in one batch (--enable-mixed-chunk)
    IDLE = "idle"  # nothing to run


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens]; negative ids are FutureMap placeholders (resolved by the worker)
    positions: torch.Tensor  # [num_tokens]
    out_cache_loc: torch.Tensor  # [num_tokens] KV slot where each new token's K/V is written
    req_pool_indices: torch.Tensor  # [batch_size] rows of req_to_token
    seq_lens: torch.Tensor  # [batch_size]
    prefix_lens: torch.Tensor  # [batch_size]
    extend_lens: torch.Tensor  # [batch_size] = seq_lens - prefix_lens
    # Host copies of the lengths (python ints) so backends never sync on a device tensor.
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    # Row of each request's last token in the packed tokens; None when that is every row (decode).
    last_index: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(
        cls,
        mode: ForwardMode,
        input_ids: list[int],
        positions: list[int],
        out_cache_loc: list[int],
        req_pool_indices: list[int],
        seq_lens: list[int],
        prefix_lens: list[int],
        device: torch.device | str = "cpu",
        streams: DeviceStreams | None = None,
    ) -> ForwardBatch:
        """The batch's tensors, staged by `streams` (one async host -> device copy on CUDA)."""
        extend_lens = [s - p for s, p in zip(seq_lens, prefix_lens, strict=True)]
        assert sum(extend_lens) == len(input_ids) == len(positions) == len(out_cache_loc), "inconsistent batch"
        ends, last = [], 0
        for n in extend_lens:
            last += n
            ends.append(last - 1)
        all_rows = ends == list(range(len(input_ids)))
        lists = [input_ids, positions, out_cache_loc, req_pool_indices, seq_lens, prefix_lens, extend_lens]
        staged = (streams or HostStreams(torch.device(device))).stage(lists if all_rows else [*lists, ends], torch.int64)
        return cls(
            mode=mode,
            input_ids=staged[0],
            positions=staged[1],
            out_cache_loc=staged[2],
            req_pool_indices=staged[3],
            seq_lens=staged[4],
            prefix_lens=staged[5],
            extend_lens=staged[6],
            last_index=None if all_rows else staged[7],
            seq_lens_cpu=list(seq_lens),
            prefix_lens_cpu=list(prefix_lens),
            extend_lens_cpu=extend_lens,
        )
