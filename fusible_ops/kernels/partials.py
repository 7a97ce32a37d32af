"""Sum of per-program fp32 partials: ``out[n] = sum_p part[p, n]``, rounded once to ``out``'s dtype.

Kernels that reduce over rows without atomics (norm dweight/dbias, activation dbias / dscales)
write one fp32 row of partial sums per program; this one launch adds them up in a fixed order
(deterministic) and writes the parameter's dtype, where torch would take two (``sum`` then a
cast). :func:`sum_partials_ref` is its pure-torch twin.
"""

from __future__ import annotations

import torch

from . import HAS_TRITON
from .launch import DirectKernel, cdiv, geometry_cache, next_pow2, num_sms, remember

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _sum_partials_kernel(PART, OUT, P, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
        # grid (cdiv(N, BLOCK_N),); PART [P, N] fp32 contiguous, OUT [N]
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
    p, n = part.shape
    part = part if part.is_contiguous() else part.contiguous()
    out = part.new_empty(n, dtype=dtype)
    if n:
        block_n, block_p = _tile(n, part.device)
        _SUM((cdiv(n, block_n),), (p, n, part.dtype, dtype, part.device), (part, out, p, n),
             {"BLOCK_P": block_p, "BLOCK_N": block_n, "num_warps": 4})
    return out


def _tile(n: int, device) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_P): column blocks for about two programs per SM (32 to 256 columns), each
    loading 4096-element tiles per step (cached per (n, device))."""
    tile = _TILES.get((n, device))
    if tile is None:
        block_n = max(32, min(256, next_pow2(cdiv(n, 2 * num_sms(device, _INTERP_PROGS)))))
        tile = remember(_TILES, (n, device), (block_n, _TILE // block_n))
    return tile


def sum_partials_ref(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Pure-torch :func:`sum_partials`."""
    return part.sum(0, dtype=torch.float32).to(dtype)


__all__ = ["sum_partials", "sum_partials_ref"]
