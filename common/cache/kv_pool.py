"""Paged KV storage: one K and one V tensor per layer.

    k_buffers[layer]: [num_pages * page_size, num_kv_heads, head_dim]   (contiguous)
    page p of layer l starts at byte p * page_bytes(l) of that tensor
    token slot s = page * page_size + offset_in_page

Page 0 is reserved: it is never handed out by the PageAllocator and serves as a
scratch target for padded or discarded writes. So `num_pages` counts the reserved
page too and the allocator manages pages 1 .. num_pages - 1.

Who owns what: the KVPool owns the tensors (the model runner writes and reads
them, kv_transfer registers them with NIXL once); which pages are free, cached
or in use is the PageAllocator's and RadixCache's business, not the pool's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.cache.host_arena import alloc_host_buffers, shared_host_buffers
from common.model.device_streams import DeviceStreams, HostStreams


@dataclass(frozen=True)
class KVLayout:
    """What a transfer peer must agree on (exchanged at bootstrap)."""

    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # e.g. "bfloat16"

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def token_bytes(self) -> int:
        return self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes of one page in ONE layer buffer (K or V)."""
        return self.page_size * self.token_bytes

    def compatible_with(self, other: KVLayout) -> str | None:
        """None when KV pages can be copied between the two pools, else the reason."""
        for name in ("num_layers", "page_size", "num_kv_heads", "head_dim", "dtype"):
            if getattr(self, name) != getattr(other, name):
                return f"KV layout mismatch: {name} {getattr(self, name)} != {getattr(other, name)}"
        return None


class KVPool:
    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        streams: DeviceStreams | None = None,
        shared_path: str | None = None,
        attach: bool = False,
        kv_head_start: int = 0,
    ) -> None:
        """streams: orders the host copies of retraction after the worker's queued steps.
        shared_path (CPU): the buffers live in that shared file mapping (a TP rank's slice, which
        rank 0 maps too); attach=True maps an existing one instead of creating it.
        kv_head_start: the model's first KV head held here (a TP rank's slice; 0 otherwise)."""
        assert num_pages >= 2, "need the reserved page 0 plus at least one usable page"
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kv_head_start = kv_head_start
        self.dtype = dtype
        self.device = torch.device(device)
        self.streams = streams or HostStreams(self.device)
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        # Other TP ranks' pools as this process maps them (rank 0 of a TP instance on CPU): decode
        # retraction's host copies cover every rank's heads through them (KV transfers do not: each
        # rank's own NIXL agent moves its heads, kv_transfer/rank_agent.py).
        self.rank_views: list[KVPool] = []
        if shared_path is not None:
            buffers = shared_host_buffers(shared_path, [shape] * (2 * num_layers), dtype, create=not attach)
            self.k_buffers, self.v_buffers = buffers[:num_layers], buffers[num_layers:]
        elif self.device.type == "cpu":
            buffers = alloc_host_buffers([shape] * (2 * num_layers), dtype)
            self.k_buffers, self.v_buffers = buffers[:num_layers], buffers[num_layers:]
        else:
            self.k_buffers = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
            self.v_buffers = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    @property
    def layout(self) -> KVLayout:
        return KVLayout(
            num_layers=self.num_layers,
            num_pages=self.num_pages,
            page_size=self.page_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=str(self.dtype).removeprefix("torch."),
        )

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def total_bytes(self) -> int:
        return 2 * self.num_layers * self.num_slots * self.layout.token_bytes

    # NOTE: index through 2-D [slots, heads * dim] views: 3-D advanced indexing is ~1000x
    # slower on CPU in bf16.
    @staticmethod
    def _flat(buf: torch.Tensor) -> torch.Tensor:
        return buf.view(buf.shape[0], -1)

    def set_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new tokens' K/V ([n, num_kv_heads, head_dim]) to `slots` ([n])."""
        n = slots.shape[0]
        self._flat(self.k_buffers[layer])[slots] = k.reshape(n, -1).to(self.dtype)
        self._flat(self.v_buffers[layer])[slots] = v.reshape(n, -1).to(self.dtype)

    def attach_rank_views(self, paths: list[str], kv_head_starts: list[int]) -> None:
        """Map the pools of the other TP ranks (same shape as this one) from their shared files."""
        self.rank_views = [
            KVPool(num_layers=self.num_layers, num_pages=self.num_pages, page_size=self.page_size,
                   num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.dtype,
                   shared_path=path, attach=True, kv_head_start=start)
            for path, start in zip(paths, kv_head_starts, strict=True)
        ]

    def host_copy_bytes(self, num_tokens: int) -> int:
        """Bytes copy_slots_to_host returns for `num_tokens` slots (K and V, every layer, every rank)."""
        ranks = 1 + len(self.rank_views)
        return ranks * 2 * self.num_layers * num_tokens * self.layout.page_bytes // self.layout.page_size

    def copy_slots_to_host(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[layers, n, ranks * heads * dim] host copies of K and V at `slots` (decode retraction)."""
        self.streams.scheduler_waits_for_worker()
        pools = [self, *self.rank_views]
        k = torch.cat([torch.stack([p._flat(buf)[slots] for buf in p.k_buffers]).cpu() for p in pools], dim=-1)
        v = torch.cat([torch.stack([p._flat(buf)[slots] for buf in p.v_buffers]).cpu() for p in pools], dim=-1)
        return k, v

    def restore_slots_from_host(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The inverse of copy_slots_to_host; the worker's next step waits for it."""
        self.streams.scheduler_waits_for_worker()
        pools = [self, *self.rank_views]
        for pool, pk, pv in zip(pools, k.chunk(len(pools), dim=-1), v.chunk(len(pools), dim=-1), strict=True):
            for layer in range(self.num_layers):
                pool._flat(pool.k_buffers[layer])[slots] = pk[layer].to(self.device)
                pool._flat(pool.v_buffers[layer])[slots] = pv[layer].to(self.device)

    @staticmethod
    def pages_for_budget(
        budget_bytes: int, *, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        per_page = 2 * num_layers * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        return max(2, budget_bytes // per_page)
