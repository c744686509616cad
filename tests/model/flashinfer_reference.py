"""A CPU stand-in for the two flashinfer wrappers pdserve uses, in plain torch.

Same constructor / plan() / run() signatures as the pinned flashinfer-python release
(pyproject's `cuda` extra; plan()'s keyword arguments are those of its `_plan_impl` /
`plan`), same paged-KV conventions (NHD pages, indptr / indices / last_page_len, qo head h
reads KV head h // group, causal mask aligned to the END of each sequence), and the
restrictions of the real kernels that a CPU run should catch: the CUDA-core decode kernel's
GQA group sizes, fp16/bf16 only, the supported head dims, int32 index arrays,
1 <= last_page_len <= page_size, q and cache shapes matching the plan.

Tests install it as the `flashinfer` module (`install(monkeypatch)`); every call is recorded
in `CALLS` so a test can bind the backend's exact arguments to the real signatures.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch

PINNED_VERSION = "0.6.17"
PDSERVE_DEVICE_TYPES = ("cpu", "cuda")  # the backend accepts a CPU pool with this module

CUDA_CORE_DECODE_GROUP_SIZES = (1, 2, 3, 4, 8)  # DISPATCH_GQA_GROUP_SIZE, include/flashinfer/utils.cuh
HEAD_DIMS = (64, 128, 256, 512)
DTYPES = (torch.float16, torch.bfloat16)

CALLS: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []  # ("Class.method", args, kwargs) as called

F = TypeVar("F", bound=Callable[..., Any])


def _recorded(method: F) -> F:
    @functools.wraps(method)  # inspect.signature follows __wrapped__: the signature stays visible
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        CALLS.append((method.__qualname__, args, kwargs))
        return method(self, *args, **kwargs)

    return call  # type: ignore[return-value]


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `import flashinfer` return this module for the rest of the test."""
    CALLS.clear()
    monkeypatch.setitem(sys.modules, "flashinfer", sys.modules[__name__])


def _dtype(d: str | torch.dtype | None, default: torch.dtype) -> torch.dtype:
    if d is None:
        return default
    return getattr(torch, d) if isinstance(d, str) else d


class _Plan:
    def __init__(self, *, qo_indptr: list[int], kv_indptr: list[int], indices: torch.Tensor, last: list[int],
                 num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, causal: bool,
                 sm_scale: float | None, q_dtype: torch.dtype, kv_dtype: torch.dtype, o_dtype: torch.dtype) -> None:
        if indices.dtype != torch.int32:
            raise TypeError(f"indices must be int32, got {indices.dtype}")
        if num_qo_heads % num_kv_heads:
            raise ValueError("num_qo_heads must be a multiple of num_kv_heads")
        if head_dim not in HEAD_DIMS:
            raise RuntimeError(f"Unsupported head_dim: {head_dim}")
        if q_dtype not in DTYPES or kv_dtype not in DTYPES:
            raise RuntimeError(f"Unsupported dtype: q {q_dtype}, kv {kv_dtype}")
        if not 1 <= min(last, default=1) <= max(last, default=1) <= page_size:
            raise ValueError(f"last_page_len must be in [1, {page_size}], got {last}")
        if len(kv_indptr) != len(qo_indptr) or kv_indptr[-1] != indices.numel():
            raise ValueError("indptr arrays do not match the batch / the indices")
        self.qo_indptr, self.kv_indptr, self.indices, self.last = qo_indptr, kv_indptr, indices, last
        self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size = num_qo_heads, num_kv_heads, head_dim, page_size
        self.causal = causal
        self.sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
        self.q_dtype, self.kv_dtype, self.o_dtype = q_dtype, kv_dtype, o_dtype

    def run(self, q: torch.Tensor, paged_kv_cache: Any) -> torch.Tensor:
        k_cache, v_cache = _unpack_paged_kv_cache(paged_kv_cache)
        want_q = (self.qo_indptr[-1], self.num_qo_heads, self.head_dim)
        if tuple(q.shape) != want_q or q.dtype != self.q_dtype:
            raise ValueError(f"q is {tuple(q.shape)} {q.dtype}, the plan expects {want_q} {self.q_dtype}")
        for cache in (k_cache, v_cache):
            if cache.dim() != 4 or tuple(cache.shape[1:]) != (self.page_size, self.num_kv_heads, self.head_dim):
                raise ValueError(f"NHD cache must be [pages, {self.page_size}, {self.num_kv_heads}, {self.head_dim}]")
            if cache.dtype != self.kv_dtype:
                raise ValueError(f"cache dtype {cache.dtype} != planned {self.kv_dtype}")
        if self.indices.numel() and int(self.indices.max()) >= k_cache.shape[0]:
            raise IndexError("page index beyond the cache")
        group = self.num_qo_heads // self.num_kv_heads
        out = torch.empty(q.shape, dtype=self.o_dtype, device=q.device)
        for r in range(len(self.qo_indptr) - 1):
            q0, q1 = self.qo_indptr[r], self.qo_indptr[r + 1]
            pages = self.indices[self.kv_indptr[r] : self.kv_indptr[r + 1]].long()
            kv_len = (len(pages) - 1) * self.page_size + self.last[r]
            if self.causal and kv_len < q1 - q0:
                raise ValueError(f"request {r}: causal with {q1 - q0} queries over {kv_len} keys")
            k = k_cache[pages].reshape(-1, self.num_kv_heads, self.head_dim)[:kv_len].float()
            v = v_cache[pages].reshape(-1, self.num_kv_heads, self.head_dim)[:kv_len].float()
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # qo head h -> kv head h // group
            scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k) * self.sm_scale
            if self.causal:
                allowed = torch.arange(kv_len)[None, :] <= (kv_len - (q1 - q0) + torch.arange(q1 - q0))[:, None]
                scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
            out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(self.o_dtype)
        return out


def _unpack_paged_kv_cache(paged_kv_cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """flashinfer/utils.py _unpack_paged_kv_cache (NHD): a (K, V) tuple of [pages, page, H, D], or
    one [pages, 2, page, H, D] tensor unbound on dim 1; page_size 1 may drop the page dim. Then
    the kernels' stride rules (csrc/batch_decode.cu, batch_prefill.cu; paged_kv_t in
    include/flashinfer/page.cuh): any strides are taken from the tensors, K's and V's must be
    equal, the feature dim is contiguous, and each stride fits the uint32 it is kept in."""
    if isinstance(paged_kv_cache, tuple):
        k_cache, v_cache = (c.unsqueeze(-3) if c.dim() == 3 else c for c in paged_kv_cache)
    elif torch.is_tensor(paged_kv_cache):
        cache = paged_kv_cache.unsqueeze(-3) if paged_kv_cache.dim() == 4 else paged_kv_cache
        if cache.dim() != 5 or cache.shape[1] != 2:
            raise ValueError(f"a single paged KV tensor must be [pages, 2, page, H, D], got {tuple(cache.shape)}")
        k_cache, v_cache = cache.unbind(dim=1)
    else:
        raise KeyError(f"Unrecognized paged_kv_cache type {type(paged_kv_cache)}")
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"K/V strides differ: {k_cache.stride()} vs {v_cache.stride()}")
    if k_cache.stride(-1) != 1:
        raise ValueError("the head_dim axis of the paged KV cache must be contiguous")
    if any(st >= 2**32 for st in k_cache.stride()[:3]):
        raise ValueError(f"paged KV strides {k_cache.stride()} overflow flashinfer's uint32 strides")
    return k_cache, v_cache


def _run(plan: _Plan | None, q: torch.Tensor, cache: Any, args: tuple[Any, ...], options: tuple[Any, ...]) -> torch.Tensor:
    """The reference computes the plain case only: extra arguments or options set to anything
    but their defaults (None / False) are refused."""
    if args or any(v is not None and v is not False for v in options):
        raise NotImplementedError("the reference runs q against the cache, nothing else")
    if plan is None:
        raise RuntimeError("run() before plan()")
    return plan.run(q, cache)


def _host_list(t: torch.Tensor, name: str) -> list[int]:
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    return [int(x) for x in t.cpu().tolist()]


class BatchDecodeWithPagedKVCacheWrapper:
    @_recorded
    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: torch.Tensor | None = None,
        paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None,
        backend: str = "auto",
        jit_args: list[Any] | None = None,
    ) -> None:
        if kv_layout != "NHD" or jit_args is not None:
            raise NotImplementedError("the reference covers NHD, no custom JIT")
        self.use_tensor_cores = use_tensor_cores
        self._plan: _Plan | None = None
        # CUDA-graph mode: plan() copies into these fixed buffers, run() reads them
        self._graph_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if use_cuda_graph:
            buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
            if any(b is None or b.dtype != torch.int32 for b in buffers):
                raise ValueError("use_cuda_graph needs int32 indptr / indices / last_page_len buffers")
            self._graph_buffers = buffers  # type: ignore[assignment]

    @_recorded
    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        pos_encoding_mode: str = "NONE",
        window_left: int = -1,
        window_right: int = 0,
        logits_soft_cap: float | None = None,
        q_data_type: str | torch.dtype | None = "float16",
        kv_data_type: str | torch.dtype | None = None,
        o_data_type: str | torch.dtype | None = None,
        data_type: str | torch.dtype | None = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        non_blocking: bool = True,
        block_tables: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        fixed_split_size: int | None = None,
        disable_split_kv: bool = False,
        q_len_per_req: int = 1,
    ) -> None:
        if pos_encoding_mode != "NONE" or window_left != -1 or logits_soft_cap or q_len_per_req != 1:
            raise NotImplementedError("the reference covers plain causal-free decode only")
        group = num_qo_heads // num_kv_heads
        if not self.use_tensor_cores and group not in CUDA_CORE_DECODE_GROUP_SIZES:
            raise RuntimeError(f"Unsupported group_size: {group}")
        q_dtype = _dtype(data_type if q_data_type is None else q_data_type, torch.float16)
        kv_dtype = _dtype(kv_data_type if kv_data_type is not None else data_type, q_dtype)
        kv_indptr = _host_list(indptr, "indptr")
        last = _host_list(last_page_len, "last_page_len")
        if self._graph_buffers is not None:
            indptr_buf, indices_buf, last_buf = self._graph_buffers
            if len(last) != last_buf.numel():
                raise ValueError(f"batch size {len(last)} != the CUDA graph's fixed batch size {last_buf.numel()}")
            if indices.numel() > indices_buf.numel():
                raise ValueError("the page indices overflow the CUDA graph's indices buffer")
            indptr_buf.copy_(torch.tensor(kv_indptr, dtype=torch.int32))
            last_buf.copy_(torch.tensor(last, dtype=torch.int32))
            indices_buf[: indices.numel()].copy_(indices)
            indices = indices_buf[: indices.numel()]  # run() reads the buffer, as a replayed graph does
        self._plan = _Plan(
            qo_indptr=list(range(len(kv_indptr))), kv_indptr=kv_indptr, indices=indices,
            last=last, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, page_size=page_size, causal=False, sm_scale=sm_scale, q_dtype=q_dtype,
            kv_dtype=kv_dtype, o_dtype=_dtype(o_data_type, q_dtype),
        )

    @_recorded
    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: Any,
        *args: Any,
        q_scale: float | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        enable_pdl: bool | None = None,
        window_left: int | None = None,
        sinks: torch.Tensor | None = None,
        q_len_per_req: int | None = None,
        skip_softmax_threshold_scale_factor: float | None = None,
        kv_cache_sf: Any = None,
    ) -> torch.Tensor:
        options = (q_scale, k_scale, v_scale, out, lse, return_lse, enable_pdl, window_left, sinks, q_len_per_req,
                   skip_softmax_threshold_scale_factor, kv_cache_sf)
        return _run(self._plan, q, paged_kv_cache, args, options)


class BatchPrefillWithPagedKVCacheWrapper:
    @_recorded
    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: torch.Tensor | None = None,
        paged_kv_indptr_buf: torch.Tensor | None = None,
        paged_kv_indices_buf: torch.Tensor | None = None,
        paged_kv_last_page_len_buf: torch.Tensor | None = None,
        custom_mask_buf: torch.Tensor | None = None,
        mask_indptr_buf: torch.Tensor | None = None,
        backend: str = "auto",
        jit_args: list[Any] | None = None,
        jit_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if kv_layout != "NHD" or use_cuda_graph or jit_args is not None:
            raise NotImplementedError("the reference covers NHD, no CUDA graphs, no custom JIT")
        self._plan: _Plan | None = None

    @_recorded
    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        head_dim_vo: int | None = None,
        custom_mask: torch.Tensor | None = None,
        packed_custom_mask: torch.Tensor | None = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        sm_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        q_data_type: str | torch.dtype = "float16",
        kv_data_type: str | torch.dtype | None = None,
        o_data_type: str | torch.dtype | None = None,
        non_blocking: bool = True,
        prefix_len_ptr: torch.Tensor | None = None,
        token_pos_in_items_ptr: torch.Tensor | None = None,
        token_pos_in_items_len: int = 0,
        max_item_len_ptr: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        seq_lens_q: torch.Tensor | None = None,
        block_tables: torch.Tensor | None = None,
        max_token_per_sequence: int | None = None,
        max_sequence_kv: int | None = None,
        fixed_split_size: int | None = None,
        disable_split_kv: bool = False,
    ) -> None:
        if custom_mask is not None or packed_custom_mask is not None or pos_encoding_mode != "NONE":
            raise NotImplementedError("the reference covers causal / full masks only")
        if (head_dim_vo or head_dim_qk) != head_dim_qk or window_left != -1 or logits_soft_cap:
            raise NotImplementedError("the reference covers equal q/v head dims, no window, no soft cap")
        q_dtype = _dtype(q_data_type, torch.float16)
        self._plan = _Plan(
            qo_indptr=_host_list(qo_indptr, "qo_indptr"), kv_indptr=_host_list(paged_kv_indptr, "paged_kv_indptr"),
            indices=paged_kv_indices, last=_host_list(paged_kv_last_page_len, "paged_kv_last_page_len"),
            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim_qk, page_size=page_size,
            causal=causal, sm_scale=sm_scale, q_dtype=q_dtype, kv_dtype=_dtype(kv_data_type, q_dtype),
            o_dtype=_dtype(o_data_type, q_dtype),
        )

    @_recorded
    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: Any,
        *args: Any,
        q_scale: float | torch.Tensor | None = None,
        k_scale: float | torch.Tensor | None = None,
        v_scale: float | torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        enable_pdl: bool | None = None,
        window_left: int | None = None,
        sinks: torch.Tensor | None = None,
        kv_cache_sf: Any = None,
        skip_softmax_threshold_scale_factor: float | None = None,
    ) -> torch.Tensor:
        options = (q_scale, k_scale, v_scale, out, lse, return_lse, enable_pdl, window_left, sinks, kv_cache_sf,
                   skip_softmax_threshold_scale_factor)
        return _run(self._plan, q, paged_kv_cache, args, options)


# ---- the fused elementwise kernels (flashinfer.norm / flashinfer.activation, top-level names) ----


def _check_fused(x: torch.Tensor, name: str) -> None:
    if x.dtype not in DTYPES:
        raise RuntimeError(f"{name}: unsupported dtype {x.dtype}")
    if not x.is_contiguous():
        raise ValueError(f"{name}: input must be contiguous")


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 math, weight applied in fp32, one rounding at the end (as the kernels do)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None,
            enable_pdl: bool | None = None) -> torch.Tensor:
    CALLS.append(("rmsnorm", (input, weight), {"eps": eps}))
    _check_fused(input, "rmsnorm")
    if input.dim() != 2 or weight.shape != (input.shape[1],):
        raise ValueError(f"rmsnorm: input must be [tokens, hidden], weight [hidden]; got {tuple(input.shape)}")
    y = _rms(input, weight, eps)
    if out is None:
        return y
    out.copy_(y)
    return out


def fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                      enable_pdl: bool | None = None) -> None:
    """In place: residual += input; input = rmsnorm(residual) * weight."""
    CALLS.append(("fused_add_rmsnorm", (input, residual, weight), {"eps": eps}))
    _check_fused(input, "fused_add_rmsnorm")
    _check_fused(residual, "fused_add_rmsnorm")
    if input.dim() != 2 or input.shape != residual.shape or weight.shape != (input.shape[1],):
        raise ValueError("fused_add_rmsnorm: input and residual must be [tokens, hidden], weight [hidden]")
    residual.copy_((residual.float() + input.float()).to(residual.dtype))
    input.copy_(_rms(residual, weight, eps))


def silu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None, enable_pdl: bool | None = None) -> torch.Tensor:
    CALLS.append(("silu_and_mul", (input,), {}))
    _check_fused(input, "silu_and_mul")
    if input.shape[-1] % 2:
        raise ValueError("silu_and_mul: the last dimension must be even")
    gate, up = input.float().chunk(2, dim=-1)
    y = (torch.nn.functional.silu(gate) * up).to(input.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def apply_rope_with_cos_sin_cache_inplace(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                                          head_size: int, cos_sin_cache: torch.Tensor, is_neox: bool = True) -> None:
    """flashinfer.rope's documented contract: query [nnz, Hq * head_size] and key [nnz, Hk * head_size]
    (strided rows allowed: the kernel takes strides), cos_sin_cache [max_pos, rotary_dim] float32 with
    cos in the first half and sin in the second; is_neox rotates the two halves of each head."""
    CALLS.append(("apply_rope_with_cos_sin_cache_inplace", (positions, query, key), {"is_neox": is_neox}))
    if query.dtype not in DTYPES or cos_sin_cache.dtype != torch.float32:
        raise RuntimeError("apply_rope_with_cos_sin_cache_inplace: q/k fp16/bf16, cos_sin_cache float32")
    if query.dim() != 2 or key.dim() != 2 or query.stride(-1) != 1 or key.stride(-1) != 1:
        raise ValueError("apply_rope_with_cos_sin_cache_inplace: query and key must be [nnz, heads * head_size]")
    half = cos_sin_cache.shape[1] // 2
    cs = cos_sin_cache[positions.long()]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    for t in (query, key):
        x = t.view(t.shape[0], -1, head_size).float()
        if is_neox:
            x1, x2 = x[..., :half], x[..., half:]
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        t.view(t.shape[0], -1, head_size).copy_(out.to(t.dtype))
