"""Launch configuration of the norm kernels (:mod:`.norm`): the tunables and the config choice.

Explicit and small; tests shrink the thresholds (``monkeypatch.setattr(norm_config, ...)``) to run
the wide-row variants on small N. Register use of each config checked with ptxas for sm_90.
"""

from __future__ import annotations

from .launch import next_pow2

_TILE = 2048  # elements per program tile when N is small (rows per program = _TILE // BLOCK_N)
_FWD_MAX_FUSED_N = 16384  # forward: widest row held in registers as one block (32 warps)
_FWD_NORES_MAX_FUSED_N = 8192  # forward without residual: wider rows loop (H200 16384^2: 0.39 vs 0.66 ms)
_FWD_LOOP_BLOCK_N = 8192  # forward, wider rows: column block of the two-pass loop variant
_BWD_MAX_FUSED_N = 16384  # backward: widest row held in registers with its dweight/dbias partials
_BWD_SLICE_N = 8192  # backward, wider rows: column slice per program of the sliced variant
_FWD_WARPS_CAP = 32  # forward: most warps per program of the fused variant
_FWD_LOOP_WARPS = 16  # forward loop variant warps (0: BLOCK_N // 256, at least 4)
_BWD_WARPS_CAP = 16  # backward: most warps per program of the fused variant
_BWD_SLICE_WARPS = 16  # backward sliced variant: most warps per program
_BWD_RELOAD_MIN_N = 8193  # backward fused: re-load xsum/dy for dx (H200 LayerNorm 16384^2: 0.97 vs 2.56 ms)
_BWD_PROGS_PER_SM = 0  # backward fused: persistent programs per SM (0: 32 // num_warps)
_BWD_HALVES_MIN_N = 8193  # LayerNorm backward, n >= this (and <= _BWD_MAX_FUSED_N): halves variant
_BWD_HALVES_WARPS = 16  # backward halves variant: warps per program
_BWD_DB_COLSUM_MIN_N = 8193  # n >= this: dbias is a separate fp32 column sum of dy (torch), the kernel keeps
# only dweight partials live. H200 LayerNorm bwd 16384^2: fused RELOAD 0.983 ms -> colsum + halves 0.816 ms;
# RMSNorm keeps fused RELOAD (0.600 ms vs 0.643 ms with halves)


def _fused_config(n: int, rows: int, fwd: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for whole rows held in registers, ~``_TILE`` elements per
    program. Warps by tile size (checked with ptxas for sm_90: <= 128 registers per thread):
    tile <= 1024: 4, 2048: 8, 4096: 16, 8192: 32 fwd / 16 bwd (16 elements per thread, which
    still fits the bwd's dweight/dbias partials), 16384: 32."""
    block_n = max(16, next_pow2(n))
    block_m = max(1, min(_TILE // block_n, next_pow2(rows)))
    tile = block_m * block_n
    warps = min(32, max(4, tile // 256))
    if not fwd and tile == 8192:
        warps = 16
    warps = min(warps, _FWD_WARPS_CAP if fwd else _BWD_WARPS_CAP)
    return block_m, block_n, warps


def _fwd_config(n: int, rows: int, has_res: bool = True) -> tuple[bool, int, int, int]:
    """(loop, BLOCK_M, BLOCK_N, num_warps) of the forward for rows of n columns."""
    if n > _FWD_MAX_FUSED_N or (not has_res and n > _FWD_NORES_MAX_FUSED_N):
        return True, 1, _FWD_LOOP_BLOCK_N, _FWD_LOOP_WARPS or max(4, _FWD_LOOP_BLOCK_N // 256)
    return (False,) + _fused_config(n, rows, fwd=True)


def _bwd_config(n: int, rows: int) -> tuple[bool, int, int, int]:
    """(sliced, BLOCK_M, BLOCK_N, num_warps) of the backward for rows of n columns."""
    if n > _BWD_MAX_FUSED_N:
        return True, 1, _BWD_SLICE_N, max(4, min(_BWD_SLICE_WARPS, _BWD_SLICE_N // 256))
    return (False,) + _fused_config(n, rows, fwd=False)
