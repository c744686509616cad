"""Paged KV storage: ONE page-major tensor per pool; a page holds every layer's K and V.

    kv: [num_pages, num_layers, 2 (K, V), page_size, num_kv_heads, head_dim]   (contiguous)
    token slot s = page * page_size + offset_in_page (as before: req_to_token holds slots)

Why this order: a page is one contiguous block of page_bytes = 2 * L * page_size * token_bytes,
so a run of consecutive pages is ONE byte range for NIXL, every layer included (a per-layer
pool needs a descriptor per layer buffer per run: 437 per 1,024-token request on a 16-layer
model). Inside a page, layer-major then K/V: one layer's K and V of a page sit side by side,
and kv[:, layer] is flashinfer's own paged layout [pages, 2, page_size, Hkv, D] (NHD) with a
page stride of L * 2 * page_size * Hkv * D elements; flashinfer 0.6.17 takes the page stride
from the tensor (paged_kv_t's kv_strides, include/flashinfer/page.cuh; K and V strides must be
equal, they are) so attention reads the pool in place. A page must hold < 2**32 elements
(flashinfer keeps the page stride in a uint32).

Row addressing for plain torch (2-D views index fast on CPU, 3-D advanced indexing does not):

    rows:   kv viewed as [num_pages * L * 2 * page_size, Hkv * D]
            row(slot, layer, kind) = slot_base(slot) + (2 * layer + kind) * page_size
            slot_base(slot)        = (slot // page_size) * 2 * L * page_size + slot % page_size
    blocks: kv viewed as [num_pages * L * 2, page_size * Hkv * D]: one layer's K (or V) of a page
            block(page, layer, kind) = page * 2 * L + 2 * layer + kind

Page 0 is reserved: it is never handed out by the PageAllocator and serves as a
scratch target for padded or discarded writes. So `num_pages` counts the reserved
page too and the allocator manages pages 1 .. num_pages - 1.

Who owns what: the KVPool owns the tensor (the model runner writes and reads it, kv_transfer
registers it with NIXL once); which pages are free, cached or in use is the PageAllocator's
and RadixCache's business, not the pool's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.cache.host_arena import alloc_host_buffers, shared_host_buffers
from common.model.device_streams import DeviceStreams, HostStreams

PAGE_MAJOR = "page,layer,kv,token,head,dim"


@dataclass(frozen=True)
class KVLayout:
    """What a transfer peer must agree on (exchanged at bootstrap)."""

    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # e.g. "bfloat16"
    order: str = PAGE_MAJOR  # the pool's dimension order (peers with another order refuse each other)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def token_bytes(self) -> int:
        return self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one layer's K (or V) of one page: page_size tokens, contiguous."""
        return self.page_size * self.token_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: every layer's K and V (the unit a transfer moves)."""
        return 2 * self.num_layers * self.block_bytes

    def compatible_with(self, other: KVLayout) -> str | None:
        """None when KV pages can be copied between the two pools, else the reason."""
        for name in ("order", "num_layers", "page_size", "num_kv_heads", "head_dim", "dtype"):
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
        shape = (num_pages, num_layers, 2, page_size, num_kv_heads, head_dim)
        # Other TP ranks' pools as this process maps them (rank 0 of a TP instance on CPU): decode
        # retraction's host copies cover every rank's heads through them (KV transfers do not: each
        # rank's own NIXL agent moves its heads, kv_transfer/rank_agent.py).
        self.rank_views: list[KVPool] = []
        if shared_path is not None:
            self.kv = shared_host_buffers(shared_path, [shape], dtype, create=not attach)[0]
        elif self.device.type == "cpu":
            self.kv = alloc_host_buffers([shape], dtype)[0]
        else:
            self.kv = torch.zeros(shape, dtype=dtype, device=self.device)
        self.rows = self.kv.view(-1, num_kv_heads * head_dim)
        self.blocks = self.kv.view(num_pages * num_layers * 2, -1)
        self._page_skip = (2 * num_layers - 1) * page_size  # slot_base: extra rows per page before a slot

    @property
    def layout(self) -> KVLayout:
        return KVLayout(
            num_layers=self.num_layers,
            num_pages=self.num_pages,
            page_size=self.page_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=str(self.dtype).removeprefix("torch."),
            order=PAGE_MAJOR,
        )

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def total_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def layer_cache(self, layer: int) -> torch.Tensor:
        """Layer `layer` as flashinfer's NHD paged cache [num_pages, 2, page_size, Hkv, D] (a strided view)."""
        return self.kv[:, layer]

    def slot_base(self, slots: torch.Tensor) -> torch.Tensor:
        """Row of each slot's layer-0 K in `rows` (add layer_row(layer, kind) for another)."""
        return slots + torch.div(slots, self.page_size, rounding_mode="floor") * self._page_skip

    def layer_row(self, layer: int, kind: int) -> int:
        """Offset from slot_base to layer `layer`'s K (kind 0) or V (kind 1) row."""
        return (2 * layer + kind) * self.page_size

    def layer_block(self, layer: int, kind: int) -> int:
        """Offset from page * 2 * num_layers to layer `layer`'s K / V block in `blocks`."""
        return 2 * layer + kind

    def set_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new tokens' K/V ([n, num_kv_heads, head_dim]) to `slots` ([n]) of `layer`."""
        n = slots.shape[0]
        base = self.slot_base(slots)
        self.rows.index_copy_(0, base + self.layer_row(layer, 0), k.reshape(n, -1).to(self.dtype))
        self.rows.index_copy_(0, base + self.layer_row(layer, 1), v.reshape(n, -1).to(self.dtype))

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
        return ranks * 2 * self.num_layers * num_tokens * self.layout.token_bytes

    def _all_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """[L, 2, n] rows of every layer's K and V at `slots`."""
        offsets = torch.arange(2 * self.num_layers, device=slots.device) * self.page_size
        return (self.slot_base(slots)[None, :] + offsets[:, None]).view(self.num_layers, 2, -1)

    def copy_slots_to_host(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[layers, n, ranks * heads * dim] host copies of K and V at `slots` (decode retraction)."""
        self.streams.scheduler_waits_for_worker()
        rows = self._all_rows(slots.to(self.device, torch.int64))
        parts = [p.rows.index_select(0, rows.view(-1)).view(*rows.shape, -1).cpu() for p in (self, *self.rank_views)]
        both = torch.cat(parts, dim=-1)  # [L, 2, n, ranks * H * D]
        return both[:, 0].contiguous(), both[:, 1].contiguous()

    def restore_slots_from_host(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The inverse of copy_slots_to_host; the worker's next step waits for it."""
        self.streams.scheduler_waits_for_worker()
        rows = self._all_rows(slots.to(self.device, torch.int64)).reshape(-1)
        pools = [self, *self.rank_views]
        for pool, pk, pv in zip(pools, k.chunk(len(pools), dim=-1), v.chunk(len(pools), dim=-1), strict=True):
            both = torch.stack([pk, pv], dim=1).reshape(rows.shape[0], -1)  # [L * 2 * n, H * D]
            pool.rows.index_copy_(0, rows, both.to(self.device, self.dtype))

    @staticmethod
    def pages_for_budget(
        budget_bytes: int, *, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        per_page = 2 * num_layers * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        return max(2, budget_bytes // per_page)
