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
# RMSNorm's backward is faster otherwise with the residual's extra gradient (dxsum_extra) and
# about equal without it (H200, [16384, N] bf16, 2026-11-26 07:57, device us with / without):
_BWD_RMS_WIDE_MIN_N = 1025  # RMSNorm backward, this <= n <= _BWD_RMS_WIDE_MAX_N: the two below instead
_BWD_RMS_WIDE_MAX_N = 4096  # of the two above (which are within 1.2% of them at 4097-8192 columns and,
# one program per SM where these run two, 2-4% faster at 8193-16384: 16384 x 16384 441.6 vs 450.3 us)
_BWD_RMS_WIDE_THREAD_ELEMS = 8  # (1536: 73.4 vs 83.2 / 56.6 vs 55.7 with 16/16; 2048: 84.4 vs 94.8
_BWD_RMS_WIDE_WARPS_PER_SM = 32  # / 65.4 vs 65.5; 4096: 159.1 vs 178.0 / 122.7 vs 122.9)
_BWD_RMS_DXE_MIN_N = 4097  # RMSNorm backward with dxsum_extra, this <= n <= _BWD_RMS_DXE_MAX_N: the
_BWD_RMS_DXE_MAX_N = 8192  # two below (5120: 264.2 vs 298.3 us with 8/32, 7168: 305.7 vs 339.6,
_BWD_RMS_DXE_THREAD_ELEMS = 32  # 8192: 326.9 vs 359.8; without dxsum_extra they are 1-3% slower
_BWD_RMS_DXE_WARPS_PER_SM = 8  # than 8/32 and 16/16)
# Prefetch in the fused backward below _BWD_RELOAD_MIN_N (H200, [16384, N] bf16, 2026-11-26 09:23,
# kernel alone, us without -> with): it wins where the extra registers (~15-30 per thread) keep the
# config's occupancy: RMSNorm 1024 38.0 -> 34.2 (with dxsum_extra 53.1 -> 41.2), 8192 255.9 -> 201.6
# (323.9 -> 261.3); LayerNorm 1024 39.5 -> 36.1, 4096 127.1 -> 114.2, 8192 272.2 -> 241.6. It loses
# in RMSNorm's 8 / 32 config (2048: 64.4 -> 74.4; 4096 with dxsum_extra 157.0 -> 173.4) and for
# LayerNorm past 128 registers: below 1024 columns (256: 22.7 -> 27.4) and with dxsum_extra
# (2048: 86.9 -> 101.6). So: RMSNorm but in its 8 / 32 config, LayerNorm from this width without
# dxsum_extra.
_BWD_PREFETCH_LN_MIN_N = 1024
_BWD_DB_COLSUM_MIN_N = 8193  # n >= this: dbias is a separate fp32 column sum of dy (torch), the kernel keeps
# only dweight partials live (H200 LayerNorm bwd 8192 x 16384: 325 us, 345 with dbias partials). A
# "halves" variant (half a row at a time) served LayerNorm at 8193-16384 columns until 2026-11-26: the
# fused one with these configs beat it by 11-17% (16384 x 8200 / 12288 / 16384: 500 / 551 / 615 us
# against 560 / 665 / 725) and it was removed.


def _fused_config(n: int, rows: int, fwd: bool, per_thread: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for whole rows held in registers, ~``_TILE`` elements per
    program, ``per_thread`` of them per thread (at most ``_FWD_WARPS_CAP`` / ``_BWD_WARPS_CAP``
    warps). Register use checked on sm_90 (Triton 3.6): no spills; at most 128 per thread but for
    RMSNorm's dxsum_extra config at 4097-8192 columns (213)."""
    block_n = max(16, next_pow2(n))
    block_m = max(1, min(_TILE // block_n, next_pow2(rows)))
    warps = max(1, min(block_m * block_n // (32 * per_thread), _FWD_WARPS_CAP if fwd else _BWD_WARPS_CAP))
    return block_m, block_n, warps


def _fwd_config(n: int, rows: int, has_res: bool = True) -> tuple[bool, int, int, int]:
    """(loop, BLOCK_M, BLOCK_N, num_warps) of the forward for rows of n columns."""
    if n > _FWD_MAX_FUSED_N or (not has_res and n > _FWD_NORES_MAX_FUSED_N):
        return True, 1, _FWD_LOOP_BLOCK_N, _FWD_LOOP_WARPS or max(4, _FWD_LOOP_BLOCK_N // 256)
    return (False,) + _fused_config(n, rows, True, _FWD_THREAD_ELEMS)


def _bwd_config(n: int, rows: int, is_rms: bool = False, has_dxe: bool = False) -> tuple[str, int, int, int, int, bool]:
    """(variant, BLOCK_M, BLOCK_N, num_warps, programs per SM, prefetch) of the backward for rows
    of n columns (``has_dxe``: with a ``dxsum_extra`` gradient): variant ``"sliced"`` (programs
    per SM and prefetch unused) or ``"fused"``; ``prefetch``: the fused loop issues each tile's
    loads one iteration early (see ``_BWD_PREFETCH_LN_MIN_N``)."""
    if n > _BWD_MAX_FUSED_N:
        return "sliced", 1, _BWD_SLICE_N, max(4, min(_BWD_SLICE_WARPS, _BWD_SLICE_N // 256)), 0, False
    prefetch = n < _BWD_RELOAD_MIN_N and (is_rms or (not has_dxe and n >= _BWD_PREFETCH_LN_MIN_N))
    if is_rms and has_dxe and _BWD_RMS_DXE_MIN_N <= n <= _BWD_RMS_DXE_MAX_N:
        per_thread, warps_per_sm = _BWD_RMS_DXE_THREAD_ELEMS, _BWD_RMS_DXE_WARPS_PER_SM
    elif is_rms and _BWD_RMS_WIDE_MIN_N <= n <= _BWD_RMS_WIDE_MAX_N:
        per_thread, warps_per_sm = _BWD_RMS_WIDE_THREAD_ELEMS, _BWD_RMS_WIDE_WARPS_PER_SM
        prefetch = False
    else:
        per_thread, warps_per_sm = _BWD_THREAD_ELEMS, _BWD_WARPS_PER_SM
    block_m, block_n, warps = _fused_config(n, rows, False, per_thread)
    return "fused", block_m, block_n, warps, _BWD_PROGS_PER_SM or max(1, warps_per_sm // warps), prefetch
