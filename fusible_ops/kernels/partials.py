"""Sum of per-program fp32 partials: ``out[n] = sum_p part[p, n]``, rounded once to ``out``'s dtype.

Kernels that reduce over rows without atomics (norm dweight/dbias, activation dbias / dscales)
write one fp32 row of partial sums per program; this one launch adds them up in a fixed order
(deterministic) and writes the parameter's dtype, where torch would take two (``sum`` then a
cast); :func:`sum_partials_pair` sums two partials of one shape (a norm's dweight and dbias) in
one launch. :func:`sum_partials_ref` / :func:`sum_partials_pair_ref` are the pure-torch twins.
"""

from __future__ import annotations

import threading

import torch

from . import HAS_TRITON
from .launch import RECORDER, DirectKernel, cdiv, geometry_cache, next_pow2, num_sms, remember

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _sum_partials_kernel(PART, OUT, PART2, OUT2, P, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
        # grid (cdiv(N, BLOCK_N), 1 or 2); PART [P, N] fp32 contiguous, OUT [N]; the programs of
        # axis-1 index 1 sum PART2 into OUT2 instead (same P, N and dtypes: a pair in one launch)
        if tl.program_id(1) == 1:
            PART = PART2
            OUT = OUT2
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
        for p0 in range(0, P, BLOCK_P):
            rows = p0 + tl.arange(0, BLOCK_P)
            ptrs = PART + rows.to(tl.int64)[:, None] * N + cols[None, :]
            acc += tl.load(ptrs, mask=(rows < P)[:, None] & col_mask[None, :], other=0.0)
        tl.store(OUT + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=col_mask)

    _SUM = DirectKernel(_sum_partials_kernel)

_TILE = 4096  # fp32 elements per program per step
_INTERP_PROGS = 4  # "SMs" under Triton's interpreter (tiny tiles there)
_TILES = geometry_cache()


def sum_partials(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``part.sum(0).to(dtype)`` for fp32 partials ``part`` [P, N] (contiguous, P >= 1) on a Triton
    device (launchers call this after their kernel): one launch, fixed summation order."""
    part = part if part.is_contiguous() else part.contiguous()
    out = part.new_empty(part.shape[1], dtype=dtype)
    _launch_sum(part, out, part, out, 1)
    return out


def sum_partials_pair(part: torch.Tensor, part2: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sum_partials` of two partials of one shape (e.g. a norm's dweight and dbias), both
    in ``dtype``, in one launch; the same values as two :func:`sum_partials` calls."""
    if part.shape != part2.shape:
        raise ValueError(f"sum_partials_pair: shapes {tuple(part.shape)} and {tuple(part2.shape)} differ")
    part = part if part.is_contiguous() else part.contiguous()
    part2 = part2 if part2.is_contiguous() else part2.contiguous()
    out, out2 = part.new_empty(part.shape[1], dtype=dtype), part2.new_empty(part.shape[1], dtype=dtype)
    _launch_sum(part, out, part2, out2, 2)
    return out, out2


def _launch_sum(part, out, part2, out2, n_parts: int) -> None:
    p, n = part.shape
    if n:
        block_n, block_p = _tile(n, part.device)
        _SUM((cdiv(n, block_n), n_parts), (p, n, part.dtype, out.dtype, part.device),
             (part, out, part2, out2, p, n), {"BLOCK_P": block_p, "BLOCK_N": block_n, "num_warps": 4})


def _tile(n: int, device) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_P): column blocks for about two programs per SM (32 to 256 columns), each
    loading 4096-element tiles per step (cached per (n, device))."""
    tile = _TILES.get((n, device))
    if tile is None:
        block_n = max(32, min(256, next_pow2(cdiv(n, 2 * num_sms(device, _INTERP_PROGS)))))
        tile = remember(_TILES, (n, device), (block_n, _TILE // block_n))
    return tile


class _Workspaces(threading.local):
    """This thread's partials buffers: ``bufs[(device index, slot)]`` a flat fp32 tensor, and
    ``views[(device index, slot, P, N)]`` its first ``P * N`` elements as [P, N]."""

    def __init__(self) -> None:
        self.bufs: dict = {}
        self.views: dict = {}


_WS = _Workspaces()


def partials_buffer(like: torch.Tensor, p: int, n: int, slot: int = 0) -> torch.Tensor:
    """An fp32 [p, n] buffer for a kernel's row partials that :func:`sum_partials` reads right after
    (``like``: a tensor of the call). A fresh tensor, except on a CUDA device's default stream:
    there each thread reuses one buffer per device and ``slot`` (callers needing two buffers at
    once use slots 0 and 1), grown when a call needs more (one allocation fewer per backward).

    Why reuse is safe there: the partials are written by one launch and read by the next, both
    issued by this thread on the default stream, and every later launch that writes the buffer
    again is issued by this thread on that stream after them (so runs after them). Other threads
    have their own buffers; other streams, and graph capture (never on the default stream), get
    fresh tensors. The buffer holds the largest ``p * n`` asked for (the norm backward's p is 2 to
    4 programs per SM: 17 MB of fp32 at hidden 16384 on a 132-SM GPU)."""
    dev = like.get_device()  # (-1 off CUDA: Triton's interpreter)
    if dev < 0 or torch._C._cuda_getCurrentRawStream(dev) != 0 or RECORDER[0] is not None:
        # (a call being recorded for replay allocates its partials: the replay allocates them too)
        return like.new_empty((p, n), dtype=torch.float32)
    views = _WS.views
    key = (dev, slot, p, n)
    view = views.get(key)
    if view is None:
        buf = _WS.bufs.get((dev, slot))
        if buf is None or buf.numel() < p * n:
            # (the old buffer goes back to the allocator, stream-ordered: reused after the launches queued on it)
            buf = _WS.bufs[(dev, slot)] = like.new_empty(max(p * n, 1 << 16), dtype=torch.float32)
            for k in [k for k in views if k[:2] == (dev, slot)]:
                del views[k]
        if len(views) >= 64:  # (bounded: row counts that vary from call to call give new p)
            views.clear()
        view = views[key] = buf[: p * n].view(p, n)
    return view


def sum_partials_ref(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Pure-torch :func:`sum_partials`."""
    return part.sum(0, dtype=torch.float32).to(dtype)


def sum_partials_pair_ref(part: torch.Tensor, part2: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch :func:`sum_partials_pair`."""
    return sum_partials_ref(part, dtype), sum_partials_ref(part2, dtype)


__all__ = ["partials_buffer", "sum_partials", "sum_partials_pair", "sum_partials_pair_ref", "sum_partials_ref"]
