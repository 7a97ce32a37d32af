"""Launch configuration of the norm kernels (:mod:`.norm`): the tunables and the config choice.

Explicit and small; tests shrink the thresholds (``monkeypatch.setattr(norm_config, ...)``) to run
the wide-row variants on small N. Register use of each config checked on sm_90.
"""

from __future__ import annotations

from .launch import next_pow2

_TILE = 2048  # elements per program tile when N is small (rows per program = _TILE // BLOCK_N)
_FWD_MAX_FUSED_N = 16384  # forward: widest row held in registers as one block
_FWD_NORES_MAX_FUSED_N = 8192  # forward without residual: wider rows loop (H200 16384^2: 0.39 vs 0.66 ms)
_FWD_LOOP_BLOCK_N = 8192  # forward, wider rows: column block of the two-pass loop variant
_BWD_MAX_FUSED_N = 16384  # backward: widest row held in registers with its dweight/dbias partials
_BWD_SLICE_N = 8192  # backward, wider rows: column slice per program of the sliced variant
_FWD_WARPS_CAP = 32  # forward: most warps per program of the fused variant
_FWD_LOOP_WARPS = 16  # forward loop variant warps (0: BLOCK_N // 256, at least 4)
_BWD_WARPS_CAP = 16  # backward: most warps per program of the fused variant
_BWD_SLICE_WARPS = 16  # backward sliced variant: most warps per program
_BWD_RELOAD_MIN_N = 8193  # backward fused: re-load xsum/dy for dx (H200 LayerNorm 16384^2: 0.97 vs 2.56 ms)
_BWD_PROGS_PER_SM = 0  # backward fused: persistent programs per SM (0: the warps-per-SM target // num_warps)
# Fewer warps, more elements each (H200, [16384, N] bf16, 2026-11-26: the old 8 elements per thread
# and 32 warps per SM -> these, device us fwd / bwd): LayerNorm N=1024 24.7 -> 20.1 / 62.1 -> 39.5,
# 2048 42.3 -> 36.5 / 99.5 -> 68.7, 4096 87.2 -> 70.2 / 202.2 -> 129.0, 8192 180.8 -> 133.6 (fwd).
_FWD_THREAD_ELEMS = 32  # forward fused: tile elements per thread (sets num_warps)
_BWD_THREAD_ELEMS = 16  # backward fused: tile elements per thread (also keeps dweight/dbias partials live)
_BWD_WARPS_PER_SM = 16  # backward fused: resident warps per SM its persistent programs aim at
# The fused backward below _BWD_RELOAD_MIN_N: (elements per thread, resident warps per SM, prefetch)
# by kernel-alone sweeps confirmed end to end (H200, [16384, N] bf16, 2026-11-26; BENCHMARKS.md,
# "Norm backward: the next tile's loads one iteration early"). Prefetch issues each row tile's
# loads one iteration early; it costs 15-30 registers per thread, and the configs below keep
# occupancy with them. Kernel alone, us, the configs before prefetch -> these:
_BWD_FEW_WARPS = (32, 8)  # more elements per thread, fewer warps: registers to spare
_BWD_RMS_DXE_MIN_N = 4097  # RMSNorm with dxsum_extra from here: _BWD_FEW_WARPS (5120 264.6 -> 205.2,
# 8192 323.9 -> 261.3); otherwise RMSNorm takes the general 16 / 16 (1024 38.0 -> 34.2, with
# dxsum_extra 53.1 -> 41.2; 2048 65.2 -> 58.9 / 83.8 -> 72.5 against the 8 / 32 it ran before;
# 4096 123.2 -> 105.1 / 158.3 -> 132.5; 8192 255.9 -> 201.6)
_BWD_LN_NARROW_MAX_N = 512  # LayerNorm without dxsum_extra up to here: _BWD_FEW_WARPS (256 21.6 -> 15.0,
# 512 28.2 -> 24.7); wider, 16 / 16 (768 35.7 -> 32.1, 1024 39.5 -> 36.1, 8192 272.2 -> 241.6)
_BWD_LN_DXE_MIN_N = 1024  # LayerNorm with dxsum_extra from here
_BWD_LN_DXE_MID_MAX_N = 2048  # up to here _BWD_LN_DXE_MID (1024 54.2 -> 44.9,
_BWD_LN_DXE_MID = (16, 12)  # 2048 87.4 -> 79.3), then _BWD_FEW_WARPS (4096 163.8 -> 154.7, 6144 279.8 -> 260.3);
# narrower, _BWD_FEW_WARPS too (end to end: residual + extra output + LayerNorm, H100, 2026-11-26,
# against the 16 / 16 without prefetch it ran before: 256 41.5 -> 35.0, 512 67.6 -> 57.8, 768 93.5
# -> 85.1; 16 / 16 with prefetch was slower there: 50.3 / 66.8 / 96.0)
_BWD_DB_COLSUM_MIN_N = 8193  # n >= this: dbias is a separate fp32 column sum of dy (torch), the kernel keeps
# only dweight partials live (H200 LayerNorm bwd 8192 x 16384: 325 us, 345 with dbias partials). A
# "halves" variant (half a row at a time) served LayerNorm at 8193-16384 columns until 2026-11-26: the
# fused one with these configs beat it by 11-17% (16384 x 8200 / 12288 / 16384: 500 / 551 / 615 us
# against 560 / 665 / 725) and it was removed.


def _fused_config(n: int, rows: int, fwd: bool, per_thread: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for whole rows held in registers, ~``_TILE`` elements per
    program, ``per_thread`` of them per thread (at most ``_FWD_WARPS_CAP`` / ``_BWD_WARPS_CAP``
    warps). Register use checked on sm_90 (Triton 3.6), backward with prefetch: 118-128 per thread
    at 16 elements per thread (2 spilled at LayerNorm 768-1024 columns), 226-255 at 32 (no spills);
    16 / 12 with LayerNorm's dxsum_extra: 146-150."""
    block_n = max(16, next_pow2(n))
    block_m = max(1, min(_TILE // block_n, next_pow2(rows)))
    warps = max(1, min(block_m * block_n // (32 * per_thread), _FWD_WARPS_CAP if fwd else _BWD_WARPS_CAP))
    return block_m, block_n, warps


def _fwd_config(n: int, rows: int, has_res: bool = True) -> tuple[bool, int, int, int]:
    """(loop, BLOCK_M, BLOCK_N, num_warps) of the forward for rows of n columns."""
    if n > _FWD_MAX_FUSED_N or (not has_res and n > _FWD_NORES_MAX_FUSED_N):
        return True, 1, _FWD_LOOP_BLOCK_N, _FWD_LOOP_WARPS or max(4, _FWD_LOOP_BLOCK_N // 256)
    return (False,) + _fused_config(n, rows, True, _FWD_THREAD_ELEMS)


def _bwd_choice(n: int, is_rms: bool, has_dxe: bool) -> tuple[int, int, bool]:
    """(elements per thread, resident warps per SM, prefetch) of the fused backward (the table above)."""
    general = (_BWD_THREAD_ELEMS, _BWD_WARPS_PER_SM)
    if n >= _BWD_RELOAD_MIN_N:
        return (*general, False)
    if is_rms:
        return (*(_BWD_FEW_WARPS if has_dxe and n >= _BWD_RMS_DXE_MIN_N else general), True)
    if has_dxe:
        return (*(_BWD_LN_DXE_MID if _BWD_LN_DXE_MIN_N <= n <= _BWD_LN_DXE_MID_MAX_N else _BWD_FEW_WARPS), True)
    return (*(_BWD_FEW_WARPS if n <= _BWD_LN_NARROW_MAX_N else general), True)


def _bwd_config(n: int, rows: int, is_rms: bool = False, has_dxe: bool = False) -> tuple[str, int, int, int, int, bool]:
    """(variant, BLOCK_M, BLOCK_N, num_warps, programs per SM, prefetch) of the backward for rows
    of n columns (``has_dxe``: with a ``dxsum_extra`` gradient): variant ``"sliced"`` (programs
    per SM and prefetch unused) or ``"fused"``; ``prefetch``: the fused loop issues each tile's
    loads one iteration early."""
    if n > _BWD_MAX_FUSED_N:
        return "sliced", 1, _BWD_SLICE_N, max(4, min(_BWD_SLICE_WARPS, _BWD_SLICE_N // 256)), 0, False
    per_thread, warps_per_sm, prefetch = _bwd_choice(n, is_rms, has_dxe)
    block_m, block_n, warps = _fused_config(n, rows, False, per_thread)
    return "fused", block_m, block_n, warps, _BWD_PROGS_PER_SM or max(1, warps_per_sm // warps), prefetch
