"""FP8 casts: per-tensor (with an optional transposed copy and amax in the same pass) and
blockwise (1x128 tiles or 128x128 blocks, each scaled by its own amax, with an optional
transposed copy scaled along the other dim).

Layout: the jit kernels, their launchers, the ``*_ref`` twins and the public functions. The
Triton kernels and the refs agree bit for bit on the FP8 bytes and the scales (tests check it):
both compute ``scale = fp8_max / amax`` (1 when amax is 0, capped at fp32's max) with one
correctly rounded fp32 division, ``scale_inv = 1 / scale`` likewise, power-of-two scales by
clearing the mantissa bits, and ``q = fp8(clamp(x * scale, -fp8_max, fp8_max))`` (round to
nearest even: the GPU's saturating conversion instruction, which is the clamp; under the
interpreter a clamp and an exact fp32 rounding first, see ``_to_fp8``).

While ``torch.compile`` traces, the public functions run the refs (plain torch ops, which the
compiler fuses), not the launchers: a direct launch cannot be traced.

Scale layouts are the ones ``torch._scaled_mm`` reads on Hopper:

* per tensor: a 0-dim fp32 ``scale_inv``.
* ``"1x128"``: ``x`` [M, K] -> ``scale_inv`` [M, ceil(K/128)] with strides ``(1, M)``
  (column-major); the transposed copy [K, M] gets [K, ceil(M/128)] with strides ``(1, K)``.
* ``"128x128"``: ``scale_inv`` [ceil(M/128), ceil(K/128)] row-major; the transposed copy's scale
  is its transpose, made contiguous.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import HAS_TRITON, interpreter_enabled, use_triton
from .launch import TRITON_DTYPES, DirectKernel, cdiv, generic_key, geometry_cache, remember

FP32_MAX = torch.finfo(torch.float32).max
BLOCK = 128  # the block recipe's tile edge
# Launch configs (chosen from sweeps on H100/H200, see the git log): per-tensor cast, by ``transposed``:
# (BLOCK_M, BLOCK_N, num_warps); block cast, by (square, transposed): (rows per program, num_warps),
# rows 128 whenever a scale spans 128 rows.
TENSOR_CFG = {False: (64, 128, 8), True: (64, 128, 4)}
BLOCK_CFG = {(False, False): (64, 8), (False, True): (128, 4), (True, False): (128, 4), (True, True): (128, 4)}
_FMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _scale_of(amax, FMAX: tl.constexpr, POW2: tl.constexpr):
        # scale = FMAX / amax (1 for amax 0, at most fp32's max), optionally rounded down to 2^k
        pos = amax > 0.0
        scale = tl.where(pos, tl.math.div_rn(tl.full(amax.shape, FMAX, tl.float32), tl.where(pos, amax, 1.0)), 1.0)
        scale = tl.minimum(scale, 3.4028234663852886e38)
        if POW2:
            scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
        return scale

    @triton.jit
    def _to_fp8(x, scale, FMAX: tl.constexpr, dtype: tl.constexpr, SOFT_ROUND: tl.constexpr):
        # fp8(clamp(x * scale)), round to nearest even. On the GPU the conversion instruction
        # (cvt.rn.satfinite) rounds so and saturates to +-FMAX itself (infinities included), so the
        # clamp is left to it: 4 fewer instructions per element, and NaN stays NaN as in the ref.
        # SOFT_ROUND (Triton's interpreter, whose own fp8 conversion neither rounds to nearest even
        # nor saturates): clamp, then round in fp32 first, so the conversion is exact. Quantum of
        # |y|'s binade: 2^(exponent - mantissa bits), at least the fp8 subnormal step; adding and
        # subtracting quantum * 2^23 rounds to a multiple of it.
        if not SOFT_ROUND:
            return (x * scale).to(dtype)
        y = tl.minimum(tl.maximum(x * scale, -FMAX), FMAX)
        bits = y.to(tl.int32, bitcast=True)
        a = tl.abs(y)
        binade = (bits & 0x7F800000).to(tl.float32, bitcast=True)
        if FMAX == 448.0:  # E4M3: 3 mantissa bits, subnormal step 2^-9
            q = tl.maximum(binade * 0.125, 0.001953125)
        else:  # E5M2: 2 mantissa bits, subnormal step 2^-16
            q = tl.maximum(binade * 0.25, 1.52587890625e-05)
        big = q * 8388608.0
        r = (a + big) - big
        y = (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)  # y's sign
        return y.to(dtype)

    @triton.jit
    def _store_t(QT, X, x, scale, rows, cols, M, N, stride_x, xrows, xvalid, FMAX: tl.constexpr,
                 SOFT_ROUND: tl.constexpr):
        # The transposed copy of the fp32 tile x [R, C] at rows x cols of X [M, N]: fp8(x^T *
        # scale) to QT [N, M], ``scale`` a scalar or one per column as a [C, 1] tile. ``xrows``
        # (int64) / ``xvalid``: the rows of X the tile was loaded from (``rows`` unless mapped). 16-bit
        # inputs: the tile transposed in registers (Triton moves it through shared memory). fp32
        # inputs: the tile re-loaded transposed (an L1/L2 hit), because with Triton 3.6 on sm_90
        # fp32 tiles transposed in registers (tl.trans, or fp8 bytes through transposed pointers)
        # gave wrong FP8 bytes (H100 and H200, 2026-11-24 and 11-26; the GPU tests catch it).
        mask_t = (cols < N)[:, None] & (rows < M)[None, :]
        r64 = rows.to(tl.int64)
        c64 = cols.to(tl.int64)
        if X.dtype.element_ty == tl.float32:
            xt = tl.load(X + xrows[None, :] * stride_x + c64[:, None], mask=(cols < N)[:, None] & xvalid[None, :],
                         other=0.0)
        else:
            xt = tl.trans(x)
        tl.store(QT + c64[:, None] * M + r64[None, :], _to_fp8(xt, scale, FMAX, QT.dtype.element_ty, SOFT_ROUND),
                 mask=mask_t)

    @triton.jit
    def fp8_epilogue(y, mask, rows64, cols64, n_rows, n_cols, Y, Q, QSCALE, AMAX,
                     OUT_MODE: tl.constexpr, FMAX: tl.constexpr, SOFT_ROUND: tl.constexpr):
        # A producer kernel's output store (y: fp32 [R, C] tile at rows64 x cols64 of an [n_rows,
        # n_cols] output). OUT_MODE 0: y to Y in Y's dtype; 1: also max|y| into AMAX (current
        # scaling: the cast that follows needs no reduction pass); 2: y rounded to Y's dtype (as the
        # unfused path would store it), then fp8(. * QSCALE) to Q and max|y| into AMAX (delayed
        # scaling's history entry). Y is only a dtype carrier in mode 2. (No transposed copy here:
        # the consumer transposes the bytes.)
        yr = y.to(Y.dtype.element_ty)
        if OUT_MODE == 2:
            q = _to_fp8(yr.to(tl.float32), tl.load(QSCALE), FMAX, Q.dtype.element_ty, SOFT_ROUND)
            tl.store(Q + rows64[:, None] * n_cols + cols64[None, :], q, mask=mask)
        else:
            tl.store(Y + rows64[:, None] * n_cols + cols64[None, :], yr, mask=mask)
        if OUT_MODE >= 1:
            tl.atomic_max(AMAX, tl.max(tl.max(tl.where(mask, tl.abs(yr.to(tl.float32)), 0.0), axis=1), axis=0))

    @triton.jit
    def _cast_tensor_kernel(
        X, SCALE, Q, QT, AMAX,  # X [M, N] (row stride stride_x), SCALE fp32 [1], Q [M, N], QT [N, M], AMAX fp32 [1]
        INV,  # fp32 [1]: 1 / scale, written by program (0, 0) (or a dummy without HAS_INV)
        M, N, stride_x,
        FMAX: tl.constexpr, HAS_T: tl.constexpr, HAS_AMAX: tl.constexpr, SOFT_ROUND: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        FROM_AMAX: tl.constexpr = False,  # SCALE holds an amax: scale = FMAX / amax (current scaling)
        HAS_INV: tl.constexpr = False,
    ):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        r64 = rows.to(tl.int64)
        c64 = cols.to(tl.int64)
        x = tl.load(X + r64[:, None] * stride_x + c64[None, :], mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(SCALE)
        if FROM_AMAX:
            scale = _scale_of(scale, FMAX, False)
        if HAS_INV:
            if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
                tl.store(INV, _inv(scale))
        q = _to_fp8(x, scale, FMAX, Q.dtype.element_ty, SOFT_ROUND)
        tl.store(Q + r64[:, None] * N + c64[None, :], q, mask=mask)
        if HAS_T:
            _store_t(QT, X, x, scale, rows, cols, M, N, stride_x, r64, rows < M, FMAX, SOFT_ROUND)
        if HAS_AMAX:
            tl.atomic_max(AMAX, tl.max(tl.max(tl.abs(x), axis=1), axis=0))

    @triton.jit
    def _inv(scale):
        return tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)

    @triton.jit
    def _delayed_update_kernel(HIST, SCALE, AMAX, L, r, s_h,
                               FMAX: tl.constexpr, MAX_ALGO: tl.constexpr, WEIGHT: tl.constexpr,
                               BLOCK_L: tl.constexpr):
        # One role's delayed-scaling step on HIST [L, *] (column r, row stride s_h) and SCALE[r].
        # WEIGHT: the scale from AMAX (this cast's own amax), written with AMAX as the newest entry
        # in place: the column is not rolled (a weight's recorded state is a function of the
        # weight alone). Else: the scale from the history's max (MAX_ALGO) or newest entry, kept
        # where that is 0, then the column rolled down by one with a new newest entry 0 (for the
        # cast to raise). One program.
        if WEIGHT:
            amax = tl.load(AMAX)
            tl.store(SCALE + r, _scale_of(amax, FMAX, False))
            tl.store(HIST + r, amax)
        else:
            i = tl.arange(0, BLOCK_L)
            live = i < L
            col = tl.load(HIST + i * s_h + r, mask=live, other=0.0)
            amax = tl.max(col, 0) if MAX_ALGO else tl.load(HIST + r)
            tl.store(SCALE + r, tl.where(amax > 0.0, _scale_of(amax, FMAX, False), tl.load(SCALE + r)))
            tl.debug_barrier()  # every entry read before any is overwritten
            tl.store(HIST + (i + 1) * s_h + r, col, mask=(i + 1) < L)
            tl.store(HIST + r, 0.0)

    @triton.jit
    def _scale_once(P, stride, start, n, FMAX: tl.constexpr, POW2: tl.constexpr, BLOCK: tl.constexpr):
        # The amaxes at P + (start + i) * stride (i < BLOCK, start + i < n), stored by the caller,
        # re-read with one entry per thread: scale = FMAX / amax computed once each, 1 / scale
        # written over the amax. Returns the scales. The barriers order the caller's stores (the
        # threads holding a row's amax need not be the thread that reads it) and the reads before
        # the overwrite.
        idx = start + tl.arange(0, BLOCK)
        ptr = P + idx.to(tl.int64) * stride
        tl.debug_barrier()
        scale = _scale_of(tl.load(ptr, mask=idx < n, other=0.0), FMAX, POW2)
        tl.debug_barrier()
        tl.store(ptr, _inv(scale), mask=idx < n)
        return scale

    @triton.jit
    def _cast_block_kernel(
        X, Q, S, QT, ST,  # X [M, N]; Q [M, N]; S scale_inv; QT [N, M]; ST its scale_inv
        MAP,  # MAPPED: int32 [M], the row of X at each row of QT's layout (-1: a zero row)
        M, N, stride_x, stride_s0, stride_s1, stride_st0, stride_st1,
        FMAX: tl.constexpr, SQUARE: tl.constexpr, POW2: tl.constexpr, HAS_T: tl.constexpr, SOFT_ROUND: tl.constexpr,
        BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, MAPPED: tl.constexpr = False,
    ):
        # Program (bm, bn) loads rows bm*BLOCK_M.. and columns bn*BLOCK.. once (BLOCK_M == BLOCK
        # whenever a scale spans 128 rows: SQUARE or HAS_T). SQUARE: one scale for the tile (128x128
        # blocks), whose bytes QT takes transposed; else one scale per row (1x128), and for QT one
        # per column: a row-wise cast of the transposed tile.
        # MAPPED (1x128 with HAS_T): M counts the rows of QT's layout; row r there is X's row
        # MAP[r] (Q and S are written at that row) or zeros. Each 128-row block's mapped rows must
        # be a prefix of it and consecutive in X (fp8_grouped_gemm.cast_block_padded's layout).
        tl.static_assert(BLOCK_M == BLOCK or not (SQUARE or HAS_T), "a scale spanning 128 rows needs BLOCK_M == BLOCK")
        tl.static_assert(not MAPPED or (HAS_T and not SQUARE), "MAPPED is the 1x128 cast with its transposed copy")
        bm = tl.program_id(0)
        bn = tl.program_id(1)
        rows = bm * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = bn * BLOCK + tl.arange(0, BLOCK)
        r64 = rows.to(tl.int64)
        c64 = cols.to(tl.int64)
        if MAPPED:
            src = tl.load(MAP + r64, mask=rows < M, other=-1)
            valid = src >= 0
            xr64 = tl.where(valid, src, 0).to(tl.int64)
        else:
            valid = rows < M
            xr64 = r64
        mask = valid[:, None] & (cols < N)[None, :]
        x = tl.load(X + xr64[:, None] * stride_x + c64[None, :], mask=mask, other=0.0)
        if SQUARE:  # the amax in the input's dtype (exact; measured faster here than in fp32)
            scale = _scale_of(tl.max(tl.max(tl.abs(x), axis=1), axis=0).to(tl.float32), FMAX, POW2)
            x = x.to(tl.float32)
            tl.store(Q + r64[:, None] * N + c64[None, :], _to_fp8(x, scale, FMAX, Q.dtype.element_ty, SOFT_ROUND),
                     mask=mask)
            inv = _inv(scale)
            tl.store(S + bm * stride_s0 + bn * stride_s1, inv)
            if HAS_T:
                tl.store(ST + bn * stride_st0 + bm * stride_st1, inv)
                _store_t(QT, X, x, scale, rows, cols, M, N, stride_x, xr64, valid, FMAX, SOFT_ROUND)
        elif not HAS_T:
            x = x.to(tl.float32)
            scale = _scale_of(tl.max(tl.abs(x), axis=1), FMAX, POW2)
            tl.store(S + r64 * stride_s0 + bn * stride_s1, _inv(scale), mask=rows < M)
            tl.store(Q + r64[:, None] * N + c64[None, :], _to_fp8(x, scale[:, None], FMAX, Q.dtype.element_ty, SOFT_ROUND),
                     mask=mask)
        else:
            # One scale per row and, for QT, per column: the column amaxes as row amaxes of the
            # transposed tile, QT a row-wise cast of it. Every thread holding a row or column would
            # compute its scale (48 correctly rounded divisions per thread at 4 warps), so the
            # amaxes go to the scale outputs first and are re-read one per thread; each scale is
            # computed once and its inverse overwrites the amax. Q goes out before the column
            # amaxes are taken (measured 1-2% faster than both scale vectors first).
            x = x.to(tl.float32)
            tl.store(S + xr64 * stride_s0 + bn * stride_s1, tl.max(tl.abs(x), axis=1), mask=valid)
            if MAPPED:  # (the block's X rows: consecutive from its first row's, as many as are mapped)
                first = tl.load(MAP + bm * BLOCK_M)
                scale = _scale_once(S + bn * stride_s1, stride_s0, first, first + tl.sum(valid.to(tl.int32), axis=0),
                                    FMAX, POW2, BLOCK_M)
            else:
                scale = _scale_once(S + bn * stride_s1, stride_s0, bm * BLOCK_M, M, FMAX, POW2, BLOCK_M)
            tl.store(Q + xr64[:, None] * N + c64[None, :], _to_fp8(x, scale[:, None], FMAX, Q.dtype.element_ty, SOFT_ROUND),
                     mask=mask)
            tl.store(ST + c64 * stride_st0 + bm * stride_st1, tl.max(tl.abs(tl.trans(x)), axis=1), mask=cols < N)
            scale_t = _scale_once(ST + bm * stride_st1, stride_st0, bn * BLOCK, N, FMAX, POW2, BLOCK)
            _store_t(QT, X, x, scale_t[:, None], rows, cols, M, N, stride_x, xr64, valid, FMAX, SOFT_ROUND)


# ---- shared pieces of launchers and refs


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as [M, K] with a unit column stride (a copy only when needed)."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return x2 if x2.shape[1] <= 1 or x2.stride(1) == 1 else x2.contiguous()


def block_scale_buffers(m: int, k: int, square: bool, device, transposed: bool):
    """Fresh scale_inv tensors in ``torch._scaled_mm``'s layouts (see the module docstring) for an
    [m, k] operand and, with ``transposed``, its [k, m] copy: (s, st or None)."""
    mb, kb = cdiv(m, BLOCK), cdiv(k, BLOCK)
    if square:
        s = torch.empty(mb, kb, device=device, dtype=torch.float32)
        st = torch.empty(kb, mb, device=device, dtype=torch.float32) if transposed else None
    else:
        s = torch.empty(kb, m, device=device, dtype=torch.float32).t()
        st = torch.empty(mb, k, device=device, dtype=torch.float32).t() if transposed else None
    return s, st


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """``max|x|`` as an fp32 [1] device tensor (one reduction, no host sync; 0 for an empty x)."""
    if x.numel() == 0:
        return torch.zeros(1, dtype=torch.float32, device=x.device)
    return torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32).reshape(1)


# ---- references (pure torch; bit-exact twins of the kernels)


def scale_from_amax_ref(amax: torch.Tensor, fmax: float, pow2: bool = False) -> torch.Tensor:
    """``fmax / amax`` (1 where amax is 0, capped at fp32's max), fp32, optionally rounded down to a
    power of two; the kernels' ``_scale_of``."""
    amax = amax.float()
    scale = torch.where(amax > 0, torch.full_like(amax, fmax) / amax, 1.0)  # no host-to-device copy (graph capture)
    scale = torch.clamp(scale, max=FP32_MAX)
    if pow2:
        scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)
    return scale


def _to_fp8_ref(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fmax = _FMAX[dtype]
    return torch.clamp(x.float() * scale, -fmax, fmax).to(dtype)


def _scale_out_ref(scale: torch.Tensor, dtype: torch.dtype, from_amax: bool, inv: Optional[torch.Tensor]):
    """The scale a per-tensor cast uses (from an amax with ``from_amax``); ``inv`` gets 1 / scale."""
    if from_amax:
        scale = scale_from_amax_ref(scale, _FMAX[dtype])
    if inv is not None:
        inv.copy_((1.0 / scale).reshape(inv.shape))
    return scale


def cast_tensor_ref(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, transposed: bool = False,
                    amax: Optional[torch.Tensor] = None, from_amax: bool = False, inv: Optional[torch.Tensor] = None):
    """Per-tensor cast of ``x`` [..., K] (as [M, K]) with the fp32 device scalar ``scale``:
    returns ``(q [M, K], qt [K, M] or None)``; ``amax`` (fp32 [1], optional) becomes
    ``max(amax, max|x|)`` in place; ``from_amax`` and ``inv`` as in :func:`cast_tensor`."""
    scale = _scale_out_ref(scale, dtype, from_amax, inv)
    x2 = _rows(x)
    q = _fresh(_to_fp8_ref(x2, scale.reshape(()), dtype))
    if amax is not None and x2.numel():
        amax.copy_(torch.maximum(amax, x2.abs().amax().float().reshape(amax.shape)))
    return q, (_fresh(q.t()) if transposed else None)


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """A new row-major copy of ``t`` (strides as the kernels' outputs, also for size-1 dims)."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _tiles(x2: torch.Tensor) -> torch.Tensor:
    """[M, K] zero-padded to multiples of 128, as [MB, 128, KB, 128] fp32."""
    m, k = x2.shape
    mp, kp = cdiv(m, BLOCK) * BLOCK, cdiv(k, BLOCK) * BLOCK
    xp = torch.zeros(mp, kp, dtype=torch.float32, device=x2.device)
    xp[:m, :k] = x2.float()
    return xp.view(mp // BLOCK, BLOCK, kp // BLOCK, BLOCK)


def cast_block_ref(x: torch.Tensor, square: bool, pow2: bool = False, transposed: bool = False,
                   dtype: torch.dtype = torch.float8_e4m3fn):
    """Blockwise cast of ``x`` [..., K] (as [M, K]): ``(q, scale_inv, qt, scale_inv_t)`` (the last
    two None without ``transposed``) in the layouts of :func:`block_scale_buffers`."""
    x2 = _rows(x)
    m, k = x2.shape
    fmax = _FMAX[dtype]
    s, st = block_scale_buffers(m, k, square, x2.device, transposed)
    if m == 0 or k == 0:
        qt = torch.empty(k, m, dtype=dtype, device=x2.device) if transposed else None
        return torch.empty(m, k, dtype=dtype, device=x2.device), s, qt, st
    t = _tiles(x2)  # [MB, 128, KB, 128]
    mb, kb = t.shape[0], t.shape[2]
    if square:
        scale = scale_from_amax_ref(t.abs().amax(dim=(1, 3)), fmax, pow2)  # [MB, KB]
        q = _fresh(_to_fp8_ref(t, scale[:, None, :, None], dtype).reshape(mb * BLOCK, kb * BLOCK)[:m, :k])
        inv = 1.0 / scale
        s.copy_(inv)
        qt = None
        if transposed:
            qt = _fresh(q.t())
            st.copy_(inv.t())
        return q, s, qt, st
    scale = scale_from_amax_ref(t.abs().amax(dim=3), fmax, pow2)  # [MB, 128, KB] per row and k-block
    q = _fresh(_to_fp8_ref(t, scale[..., None], dtype).reshape(mb * BLOCK, kb * BLOCK)[:m, :k])
    s.copy_((1.0 / scale).reshape(mb * BLOCK, kb)[:m])
    qt = None
    if transposed:
        scale_t = scale_from_amax_ref(t.abs().amax(dim=1), fmax, pow2)  # [MB, KB, 128] per column and m-block
        qt = _fresh(_to_fp8_ref(t, scale_t[:, None], dtype).reshape(mb * BLOCK, kb * BLOCK)[:m, :k].t())
        st.copy_((1.0 / scale_t).permute(1, 2, 0).reshape(kb * BLOCK, mb)[:k])
    return q, s, qt, st


# ---- launchers

_CAST_TENSOR = DirectKernel(_cast_tensor_kernel) if HAS_TRITON else None
_DELAYED_UPDATE = DirectKernel(_delayed_update_kernel) if HAS_TRITON else None
_CAST_BLOCK = DirectKernel(_cast_block_kernel) if HAS_TRITON else None


def _cast_tensor_launch(x2, scale, dtype, transposed, amax, from_amax=False, inv=None):
    m, k = x2.shape
    q = torch.empty(m, k, dtype=dtype, device=x2.device)
    qt = torch.empty(k, m, dtype=dtype, device=x2.device) if transposed else None
    if m and k:
        bm, bn, warps = TENSOR_CFG[transposed]
        args = (x2, scale, q, qt if qt is not None else q, amax if amax is not None else scale,
                inv if inv is not None else scale, m, k, x2.stride(0))
        meta = dict(FMAX=_FMAX[dtype], HAS_T=transposed, HAS_AMAX=amax is not None, SOFT_ROUND=interpreter_enabled(),
                    BLOCK_M=bm, BLOCK_N=bn, FROM_AMAX=from_amax, HAS_INV=inv is not None, num_warps=warps)
        _CAST_TENSOR((cdiv(m, bm), cdiv(k, bn)), generic_key(args, meta), args, meta)
    elif inv is not None:  # nothing to cast: the scale still comes out
        _scale_out_ref(scale, dtype, from_amax, inv)
    return q, qt


def _cast_block_launch(x2, square, pow2, transposed, dtype):
    m, k = x2.shape
    geo = (m, k, x2.stride(0), square, pow2, transposed, x2.dtype, dtype, x2.device)
    rec = _BLOCK_LAUNCHES.get(geo)  # (what a launch of this geometry computes, computed once)
    if rec is None:
        rec = remember(_BLOCK_LAUNCHES, geo, _block_launch_record(x2, square, pow2, transposed, dtype))
    grid, key, meta, ints = rec
    q = torch.empty(m, k, dtype=dtype, device=x2.device)
    s, st = block_scale_buffers(m, k, square, x2.device, transposed)
    qt = torch.empty(k, m, dtype=dtype, device=x2.device) if transposed else None
    if key is not None:
        t_args = (qt, st) if transposed else (q, s)
        _CAST_BLOCK(grid, key, (x2, q, s, *t_args, x2, *ints), meta)
    return q, s, qt, st


_BLOCK_LAUNCHES = geometry_cache()


def _block_launch_record(x2, square, pow2, transposed, dtype) -> tuple:
    """(grid, DirectKernel key or None for an empty tensor, constexprs, integer arguments) of a
    block cast of ``x2``'s geometry."""
    m, k = x2.shape
    if not (m and k):
        return None, None, None, None
    s, st = block_scale_buffers(m, k, square, x2.device, transposed)
    t_s = st if transposed else s
    ints = (m, k, x2.stride(0), s.stride(0), s.stride(1), t_s.stride(0), t_s.stride(1))
    bm, warps = BLOCK_CFG[square, transposed]
    meta = dict(FMAX=_FMAX[dtype], SQUARE=square, POW2=pow2, HAS_T=transposed, SOFT_ROUND=interpreter_enabled(),
                BLOCK=BLOCK, BLOCK_M=bm, MAPPED=False, num_warps=warps)
    q = torch.empty(0, dtype=dtype, device=x2.device)
    return (cdiv(m, bm), cdiv(k, BLOCK)), generic_key((x2, q, s, q, s, x2, *ints), meta), meta, ints


def _cast_block_mapped_launch(x2, rowmap, pow2, dtype):
    m, k = x2.shape
    mp = rowmap.shape[0]
    q = torch.empty(m, k, dtype=dtype, device=x2.device)
    s, _ = block_scale_buffers(m, k, False, x2.device, False)
    qt = torch.empty(k, mp, dtype=dtype, device=x2.device)
    st = torch.empty(cdiv(mp, BLOCK), k, device=x2.device, dtype=torch.float32).t()
    if mp and k:
        args = (x2, q, s, qt, st, rowmap, mp, k, x2.stride(0), s.stride(0), s.stride(1), st.stride(0), st.stride(1))
        meta = dict(FMAX=_FMAX[dtype], SQUARE=False, POW2=pow2, HAS_T=True, SOFT_ROUND=interpreter_enabled(),
                    BLOCK=BLOCK, BLOCK_M=BLOCK, MAPPED=True, num_warps=BLOCK_CFG[False, True][1])
        _CAST_BLOCK((cdiv(mp, BLOCK), cdiv(k, BLOCK)), generic_key(args, meta), args, meta)
    return q, s, qt, st


def cast_block_mapped_ref(x: torch.Tensor, rowmap: torch.Tensor, pow2: bool = False,
                          dtype: torch.dtype = torch.float8_e4m3fn):
    """Pure-torch twin of :func:`cast_block_mapped`: the 1x128 cast of ``x`` row-wise, and the
    transposed copy of the [len(rowmap), K] layout whose row r is ``x[rowmap[r]]`` (zeros where
    ``rowmap[r] < 0``)."""
    x2 = _rows(x)
    q, s, _, _ = cast_block_ref(x2, False, pow2, False, dtype)
    if x2.shape[0] == 0:
        xp = x2.new_zeros(rowmap.shape[0], x2.shape[1])
    else:  # (a gather and a select, no boolean mask: static shapes, so torch.compile traces it)
        xp = torch.where((rowmap >= 0)[:, None], x2[rowmap.clamp(min=0).long()], x2.new_zeros(()))
    _, _, qt, st = cast_block_ref(xp, False, pow2, True, dtype)
    return q, s, qt, st


# ---- public API


def _dispatch(name, dtype, x, launch, ref, *args):
    """Check the FP8 dtype, view ``x`` as rows, run the launcher (Triton) or the ref."""
    if dtype not in _FMAX:
        raise TypeError(f"{name}: dtype must be float8_e4m3fn or float8_e5m2, got {dtype}")
    x2 = _rows(x)
    triton_ok = HAS_TRITON and x2.dtype in TRITON_DTYPES and use_triton(x2) and not torch.compiler.is_compiling()
    return (launch if triton_ok else ref)(x2, *args)


def cast_tensor(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, transposed: bool = False,
                amax: Optional[torch.Tensor] = None, *, from_amax: bool = False,
                inv: Optional[torch.Tensor] = None):
    """Per-tensor FP8 cast in one pass. Args: ``x`` [..., K] fp32/fp16/bf16 (any strides; seen as
    [M, K]); ``scale`` fp32 one-element device tensor (read on the device: no host sync);
    ``dtype`` ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``; ``transposed``: also write the
    [K, M] copy in the same pass; ``amax`` fp32 [1] or None: raised in place to ``max|x|``.
    ``from_amax``: ``scale`` holds an amax and the kernel derives the scale itself
    (:func:`scale_from_amax_ref`, current scaling: no separate scale computation). ``inv``: fp32
    [1] written with ``1 / scale`` (the ``scale_inv`` a GEMM reads). Returns ``(q [M, K],
    qt [K, M] or None)``."""
    return _dispatch("cast_tensor", dtype, x, _cast_tensor_launch, cast_tensor_ref, scale, dtype, transposed, amax,
                     from_amax, inv)


def delayed_update(hist: torch.Tensor, scale: torch.Tensor, r: int, fmax: float, max_algo: bool,
                   amax: Optional[torch.Tensor] = None) -> None:
    """One delayed-scaling step of role column ``r`` in place, in one launch (no host sync).

    With ``amax`` (fp32 [1], a weight's current amax): ``scale[r]`` from it (via
    :func:`scale_from_amax_ref` with ``fmax``) and ``hist[0, r] = amax``; the column is not rolled,
    so a weight's recorded state depends on the weight alone, not on how often it was cast (a
    resumed run re-casts a frozen weight once more than the uninterrupted run did).
    Without: ``scale[r]`` from the history's max (``max_algo``) or newest entry (unchanged where
    that is 0), then ``hist[:, r]`` rolled down by one with a new newest entry 0 (the cast that
    follows raises it to its tensor's amax)."""
    L = hist.shape[0]
    if HAS_TRITON and use_triton(hist) and not torch.compiler.is_compiling():
        args = (hist, scale, amax if amax is not None else scale, L, r, hist.stride(0))
        meta = dict(FMAX=float(fmax), MAX_ALGO=bool(max_algo), WEIGHT=amax is not None,
                    BLOCK_L=max(16, 1 << (L - 1).bit_length()), num_warps=4)
        _DELAYED_UPDATE((1,), generic_key(args, meta), args, meta)
        return
    delayed_update_ref(hist, scale, r, fmax, max_algo, amax)


def delayed_update_ref(hist, scale, r, fmax, max_algo, amax=None) -> None:
    """Pure-torch twin of :func:`delayed_update`."""
    col = hist[:, r]
    if amax is not None:
        scale[r : r + 1].copy_(scale_from_amax_ref(amax, fmax))
        col[0:1].copy_(amax)
        return
    a = col.amax() if max_algo else col[0]
    scale[r : r + 1].copy_(torch.where(a > 0, scale_from_amax_ref(a, fmax), scale[r]).reshape(1))
    col.copy_(torch.roll(col, 1))
    col[0:1].zero_()


def cast_block(x: torch.Tensor, square: bool, pow2: bool = False, transposed: bool = False,
               dtype: torch.dtype = torch.float8_e4m3fn):
    """Blockwise FP8 cast in one pass: ``square`` 128x128 blocks (weights) or 1x128 tiles along the
    last dim (activations, gradients); ``transposed`` also writes the [K, M] copy (1x128 tiles
    along M for the tile recipe). Returns ``(q, scale_inv, qt, scale_inv_t)``; layouts in the
    module docstring."""
    return _dispatch("cast_block", dtype, x, _cast_block_launch, cast_block_ref, square, pow2, transposed, dtype)


def cast_block_mapped(x: torch.Tensor, rowmap: torch.Tensor, pow2: bool = False,
                      dtype: torch.dtype = torch.float8_e4m3fn):
    """1x128 blockwise FP8 cast of ``x`` [M, K] in one pass, with the transposed copy of another
    row layout: ``rowmap`` (int32 [Mp]) gives the row of ``x`` at each of its rows, -1 for a
    zero row; each 128-row block's mapped rows must be a prefix of the block and consecutive in
    ``x`` (every row of ``x`` at most once). Returns ``(q [M, K], scale_inv, qt [K, Mp],
    scale_inv_t)`` in the layouts of :func:`block_scale_buffers` (``qt``'s as for an [Mp, K]
    input). Serves the block-scaled grouped weight gradient (groups padded to 128 rows)."""
    if rowmap.dtype != torch.int32 or rowmap.dim() != 1:
        raise TypeError(f"cast_block_mapped: rowmap must be a 1-D int32 tensor, got {rowmap.dtype} {list(rowmap.shape)}")
    return _dispatch("cast_block_mapped", dtype, x, _cast_block_mapped_launch, cast_block_mapped_ref, rowmap, pow2,
                     dtype)


FP8_MAX_OF = _FMAX  # fp8 dtype -> its largest finite value


def fp8_epilogue_ref(y: torch.Tensor, amax: torch.Tensor, scale: Optional[torch.Tensor] = None,
                     dtype: Optional[torch.dtype] = None):
    """The ``*_ref`` of ``fp8_epilogue`` applied to a producer's result ``y`` (in its output dtype):
    ``amax`` raised to ``max|y|``; with ``scale``, the bytes q of :func:`cast_tensor_ref`, else y."""
    if scale is None:
        if y.numel():
            amax.copy_(torch.maximum(amax, y.abs().amax().float().reshape(amax.shape)))
        return y
    return cast_tensor_ref(y, scale, dtype, False, amax)[0]


__all__ = ["BLOCK", "FP8_MAX_OF", "fp8_epilogue_ref", "block_scale_buffers", "cast_block", "cast_block_mapped",
           "cast_block_mapped_ref", "cast_block_ref", "cast_tensor", "cast_tensor_ref",
           "scale_from_amax_ref", "tensor_amax", "delayed_update", "delayed_update_ref"]
