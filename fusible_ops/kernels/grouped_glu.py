"""Fused grouped-GLU epilogues for the MoE expert MLP (GroupedLinear -> GLU -> GroupedLinear).

Same grouping contract as :mod:`fusible_ops.kernels.grouped_gemm` (split_sizes [G] int64 on the
device, empty groups valid, no host sync, persistent grid sized from host-known values, one
launch per op, autotune keyed on the feature sizes only: warm up once before graph capture).

Built on :mod:`fusible_ops.kernels.persistent` (group table, tile space, mainloop, TMA check);
the activation comes from the one table, :mod:`fusible_ops.kernels.act_table` (the same formulas
as the elementwise kernels, e.g. the Chebyshev erfc for exact GELU).

GLU on h [.., 2F]: a = h[..., :F], b = h[..., F:], glu(h) = act(a) * b (the FIRST half goes
through the activation). kinds: ``"swiglu"`` (silu), ``"geglu"`` (exact gelu),
``"geglu_tanh"`` (tanh-approximated gelu) and ``"scaled_swiglu"`` (swiglu times a per-row scale,
e.g. routing probabilities; ``scales`` required). ``scales`` may also be given with other kinds.

* :func:`grouped_glu_fwd` = FC1 with the activation in its epilogue: one [BM, BN] output tile
  computes the matching a-tile (w1 rows j) and b-tile (w1 rows F + j) as two accumulators.
  y is computed from h rounded to its dtype, so it equals glu(h) recomputed in backward.
* :func:`grouped_dglu` = FC2's input gradient with the activation gradient in its epilogue; the
  FC2 dgrad result g is never written to memory. It also recomputes y (FC2's wgrad needs it)
  and, on request, dscales[r] = sum_j g[r, j] * glu(h)[r, j] (deterministic partial sums).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import HAS_TRITON, interpreter_enabled, use_triton
from .act_table import ACT_IDS, GLU_BASE, act_and_grad_ref, dact_ref
from .fp8_grouped_gemm import fp8_triton_ok
from .grouped_gemm import grouped_dgrad_acc_ref, grouped_gemm_fwd_ref
from .launch import TRITON_DTYPES, TunedKernel, cdiv, compute_dtype, dot_precision, kernel_op, placeholder
from .persistent import INTERP_MN, check_splits, group_p2, persistent_grid, same_dtype, tma_ok

KINDS = ("swiglu", "scaled_swiglu", "geglu", "geglu_tanh")
"""The GLU kinds of these kernels (the activation of each: :data:`~.act_table.GLU_BASE`)."""

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .act_table import act_and_grad, dact
    from .persistent import mainloop, mn_config, operand_descs, split_cols, tile_coords, tile_space

    @triton.jit
    def _glu_fwd_kernel(
        x_ptr,  # [M, K] (strided)
        w_ptr,  # [G, 2F, K] (strided)
        h_ptr,  # [M, 2F] out, x's dtype
        y_ptr,  # [M, F] out, x's dtype
        bias_ptr,  # [G, 2F] or dummy
        scale_ptr,  # [M] or dummy
        split_ptr,  # [G] int64
        gidx_ptr,  # GATHER: [M] int64, the row of x each row reads (or a dummy)
        sx_ptr, sw_ptr, amax_ptr,  # FP8: fp32 scale_inv of x and w1, fp32 [1] raised to max|y| (or dummies)
        M, F, K, G,
        s_xm, s_xk, s_wg, s_wn, s_wk, s_hm, s_hn, s_ym, s_yn, s_bg, s_bn, s_s,
        HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, ACT: tl.constexpr, USE_TMA: tl.constexpr,
        PREC: tl.constexpr, G_P2: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
        PPS: tl.constexpr = 1,  # programs per SM (read by the grid)
        FP8: tl.constexpr = False,  # x, w1 are FP8 with per-tensor scales; the amax of y is taken
        GATHER: tl.constexpr = False,  # row r reads x[gidx[r]] (pointer loads; the weights still use TMA)
    ):
        """h = x_g @ w1[g].T (+ b1[g]); y = act(h_a) * h_b (* scale); persistent over all tiles."""
        if FP8:
            deq = tl.load(sx_ptr).to(tl.float32) * tl.load(sw_ptr).to(tl.float32)
        gi, start, m, tiles, tile_end, total, TILES_N = tile_space(split_ptr, G, M, F, G_P2, BM, BN)
        if USE_TMA:
            if not GATHER:
                x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[s_xm, 1], block_shape=[BM, BK])
            w_desc = tl.make_tensor_descriptor(w_ptr, shape=[G, 2 * F, K], strides=[s_wg, s_wn, 1],
                                               block_shape=[1, BN, BK])
        # plain range: tl.range(flatten=False) costs 33 KB more shared memory here (Triton 3.6)
        for t in range(tl.program_id(0), total, tl.num_programs(0)):
            g, row0, rows, rmask, n0, offs_n, nmask = tile_coords(t, gi, start, m, tile_end, tiles, TILES_N, F,
                                                                  BM, BN, GROUP_M)
            rows = rows.to(tl.int64)
            src = tl.load(gidx_ptr + rows, mask=rmask, other=0) if GATHER else rows
            acc_a = tl.zeros((BM, BN), dtype=tl.float32)
            acc_b = tl.zeros((BM, BN), dtype=tl.float32)
            if USE_TMA:
                if GATHER:
                    x_row = x_ptr + src[:, None] * s_xm
                for k0 in range(0, K, BK):
                    if GATHER:
                        offs_k = k0 + tl.arange(0, BK)
                        a = tl.load(x_row + offs_k[None, :], mask=rmask[:, None] & (offs_k < K)[None, :], other=0.0)
                    else:
                        a = x_desc.load([row0, k0])
                    wa = tl.trans(tl.reshape(w_desc.load([g, n0, k0]), (BN, BK)))
                    wb = tl.trans(tl.reshape(w_desc.load([g, F + n0, k0]), (BN, BK)))
                    acc_a = tl.dot(a, wa, acc_a, input_precision=PREC)
                    acc_b = tl.dot(a, wb, acc_b, input_precision=PREC)
            else:
                x_row = x_ptr + src[:, None] * s_xm
                w_base = w_ptr + g.to(tl.int64) * s_wg + offs_n.to(tl.int64)[None, :] * s_wn
                for k0 in range(0, K, BK):
                    offs_k = k0 + tl.arange(0, BK)
                    kmask = offs_k < K
                    a = tl.load(x_row + offs_k.to(tl.int64)[None, :] * s_xk, mask=rmask[:, None] & kmask[None, :], other=0.0)
                    wmask = kmask[:, None] & nmask[None, :]
                    wp = w_base + offs_k.to(tl.int64)[:, None] * s_wk
                    wa = tl.load(wp, mask=wmask, other=0.0)
                    wb = tl.load(wp + tl.cast(F, tl.int64) * s_wn, mask=wmask, other=0.0)
                    acc_a = tl.dot(a, wa, acc_a, input_precision=PREC)
                    acc_b = tl.dot(a, wb, acc_b, input_precision=PREC)
            if FP8:
                acc_a = acc_a * deq
                acc_b = acc_b * deq
            if HAS_BIAS:
                bp = bias_ptr + g.to(tl.int64) * s_bg + offs_n.to(tl.int64) * s_bn
                acc_a += tl.load(bp, mask=nmask, other=0.0).to(tl.float32)[None, :]
                acc_b += tl.load(bp + tl.cast(F, tl.int64) * s_bn, mask=nmask, other=0.0).to(tl.float32)[None, :]
            mask = rmask[:, None] & nmask[None, :]
            ha = acc_a.to(h_ptr.dtype.element_ty)
            hb = acc_b.to(h_ptr.dtype.element_ty)
            hp = h_ptr + rows[:, None] * s_hm + offs_n[None, :] * s_hn  # h, y: ours, contiguous
            tl.store(hp, ha, mask=mask)
            tl.store(hp + F * s_hn, hb, mask=mask)
            act, _unused = act_and_grad(ha.to(tl.float32), ACT)
            y = act * hb.to(tl.float32)
            if HAS_SCALE:
                y = y * tl.load(scale_ptr + rows * s_s, mask=rmask, other=0.0).to(tl.float32)[:, None]
            y = y.to(y_ptr.dtype.element_ty)
            tl.store(y_ptr + rows[:, None] * s_ym + offs_n[None, :] * s_yn, y, mask=mask)
            if FP8:
                tl.atomic_max(amax_ptr, tl.max(tl.max(tl.where(mask, tl.abs(y.to(tl.float32)), 0.0), 1), 0))

    @triton.jit
    def _dglu_epi(acc, rows, rmask, c0, F, s, h_ptr, dh_ptr, y_ptr, s_hm, s_hn, s_dhm, s_dhn, s_ym, s_yn,
                  ACT: tl.constexpr, BC: tl.constexpr, FP8: tl.constexpr = False):
        """dGLU on one [BM, BC] column sub-tile at columns c0..: stores dh (both halves) and y (not
        under ``FP8``: FC2's weight gradient reads the forward's FP8 copy), returns the row partials
        of sum_j g * glu (unscaled) and max|dh| of the sub-tile."""
        offs = c0 + tl.arange(0, BC)
        mask = rmask[:, None] & (offs < F)[None, :]
        hp = h_ptr + rows[:, None] * s_hm + offs.to(tl.int64)[None, :] * s_hn
        a = tl.load(hp, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(hp + tl.cast(F, tl.int64) * s_hn, mask=mask, other=0.0).to(tl.float32)
        act, dact_a = act_and_grad(a, ACT)
        glu = act * b
        ds = tl.sum(tl.where(mask, acc * glu, 0.0), 1)
        gs = acc * s
        dhp = dh_ptr + rows[:, None] * s_dhm + offs[None, :] * s_dhn  # dh, y: ours, contiguous
        da = dact(gs * b, a, dact_a, ACT).to(dh_ptr.dtype.element_ty)
        db = (gs * act).to(dh_ptr.dtype.element_ty)
        tl.store(dhp, da, mask=mask)
        tl.store(dhp + F * s_dhn, db, mask=mask)
        if FP8:
            am = tl.max(tl.max(tl.where(mask, tl.maximum(tl.abs(da.to(tl.float32)), tl.abs(db.to(tl.float32))), 0.0),
                               1), 0)
        else:
            tl.store(y_ptr + rows[:, None] * s_ym + offs[None, :] * s_yn, (glu * s).to(y_ptr.dtype.element_ty),
                     mask=mask)
            am = 0.0
        return ds, am

    @triton.jit
    def _dglu_epi_halves(acc, rows, rmask, c0, F, s, h_ptr, dh_ptr, y_ptr, s_hm, s_hn, s_dhm, s_dhn, s_ym, s_yn,
                         ACT: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr, FP8: tl.constexpr = False):
        """:func:`_dglu_epi` on a [BM, BC] tile, in two column halves when BC >= 128 (bounds the
        epilogue's register pressure: sub-tiles of <= 64 columns)."""
        if BC >= 128:
            a0, a1 = split_cols(acc, BM, BC)
            ds, am = _dglu_epi(a0, rows, rmask, c0, F, s, h_ptr, dh_ptr, y_ptr, s_hm, s_hn, s_dhm, s_dhn, s_ym, s_yn,
                               ACT, BC // 2, FP8)
            ds1, am1 = _dglu_epi(a1, rows, rmask, c0 + BC // 2, F, s, h_ptr, dh_ptr, y_ptr, s_hm, s_hn, s_dhm, s_dhn,
                                 s_ym, s_yn, ACT, BC // 2, FP8)
            ds += ds1
            am = tl.maximum(am, am1)
        else:
            ds, am = _dglu_epi(acc, rows, rmask, c0, F, s, h_ptr, dh_ptr, y_ptr, s_hm, s_hn, s_dhm, s_dhn, s_ym, s_yn,
                               ACT, BC, FP8)
        return ds, am

    @triton.jit
    def _dglu_kernel(
        dy_ptr,  # [M, H] upstream gradient of FC2's output (strided)
        w_ptr,  # [G, H, F] FC2 weight (strided)
        h_ptr,  # [M, 2F] FC1 output kept from forward (strided)
        scale_ptr,  # [M] or dummy
        dh_ptr,  # [M, 2F] out, dy's dtype
        y_ptr,  # [M, F] out, h's dtype
        part_ptr,  # [P, M] fp32 partial dscales (every slot written), P = cdiv(F, BN_MIN); or dummy
        split_ptr,  # [G] int64
        sdy_ptr, sw_ptr, amax_ptr,  # FP8: fp32 scale_inv of dy and w2, fp32 [1] raised to max|dh| (or dummies)
        M, F, H, G,
        s_dym, s_dyh, s_wg, s_wh, s_wf, s_hm, s_hn, s_s, s_dhm, s_dhn, s_ym, s_yn,
        HAS_SCALE: tl.constexpr, NEED_DS: tl.constexpr, ACT: tl.constexpr, USE_TMA: tl.constexpr,
        PREC: tl.constexpr, G_P2: tl.constexpr, BN_MIN: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
        FLATTEN: tl.constexpr = False, PPS: tl.constexpr = 1,  # PPS: programs per SM (read by the grid)
        FP8: tl.constexpr = False,  # dy and w2 FP8 (w_ptr: w2's per-group transpose [G, F, H], K-major)
    ):
        """g = dy_g @ w2[g] (registers only); dh = dGLU(h; g * scale); y = glu(h) * scale (not
        under FP8, where the amax of dh is taken instead)."""
        gi, start, m, tiles, tile_end, total, TILES_N = tile_space(split_ptr, G, M, F, G_P2, BM, BN)
        a_desc, b_desc = operand_descs(dy_ptr, w_ptr, M, H, F, G, s_dym, s_wg, s_wh, s_wf, FP8, USE_TMA, BM, BN, BK)
        if FP8:
            deq = tl.load(sdy_ptr).to(tl.float32) * tl.load(sw_ptr).to(tl.float32)
        for t in tl.range(tl.program_id(0), total, tl.num_programs(0), flatten=FLATTEN):
            g, row0, rows, rmask, n0, offs_n, nmask = tile_coords(t, gi, start, m, tile_end, tiles, TILES_N, F,
                                                                  BM, BN, GROUP_M)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            acc = mainloop(acc, dy_ptr, a_desc, w_ptr, b_desc, g, row0, rows, rmask, n0, offs_n, nmask,
                            H, s_dym, s_dyh, s_wg, s_wh, s_wf, FP8, USE_TMA, PREC, BN, BK)
            if FP8:
                acc = acc * deq
            rows = rows.to(tl.int64)
            if HAS_SCALE:
                s = tl.load(scale_ptr + rows * s_s, mask=rmask, other=0.0).to(tl.float32)[:, None]
            else:
                s = 1.0
            # epilogue in column sub-tiles of <= 64 columns (register pressure)
            if BN >= 256:
                a0, a1 = split_cols(acc, BM, BN)
                ds, am = _dglu_epi_halves(a0, rows, rmask, n0, F, s, h_ptr, dh_ptr, y_ptr, s_hm, s_hn, s_dhm, s_dhn,
                                          s_ym, s_yn, ACT, BM, BN // 2, FP8)
                ds1, am1 = _dglu_epi_halves(a1, rows, rmask, n0 + BN // 2, F, s, h_ptr, dh_ptr, y_ptr, s_hm, s_hn,
                                            s_dhm, s_dhn, s_ym, s_yn, ACT, BM, BN // 2, FP8)
                ds += ds1
                am = tl.maximum(am, am1)
            else:
                ds, am = _dglu_epi_halves(acc, rows, rmask, n0, F, s, h_ptr, dh_ptr, y_ptr, s_hm, s_hn, s_dhm, s_dhn,
                                          s_ym, s_yn, ACT, BM, BN, FP8)
            if FP8:
                tl.atomic_max(amax_ptr, am)
            if NEED_DS:
                # this tile owns slots [slot0, slot0 + BN/BN_MIN): its sum in the first, zeros in the
                # rest, so the buffer needs no memset and any autotuned BN gives the same sum.
                slot0 = (n0 // BN) * (BN // BN_MIN)
                for j in tl.static_range(BN // BN_MIN):
                    pmask = rmask & ((rows * 0 + slot0 + j) < tl.cdiv(F, BN_MIN))
                    pptr = part_ptr + (slot0 + j).to(tl.int64) * M + rows
                    if j == 0:
                        tl.store(pptr, ds, mask=pmask)
                    else:
                        tl.store(pptr, tl.zeros_like(ds), mask=pmask)

    # GLU fwd: BN is per half, so the effective output tile is BM x 2BN.
    _GLU_CONFIGS = [mn_config(128, 128, 64, 8, 3), mn_config(128, 128, 64, 8, 4), mn_config(128, 64, 64, 8, 4),
                    mn_config(128, 64, 64, 4, 3, pps=2), mn_config(64, 128, 64, 4, 3, pps=2),
                    mn_config(64, 64, 32, 4, 3, pps=2)]
    _DGLU_CONFIGS = [mn_config(128, 256, 64, 8, 3), mn_config(128, 256, 64, 8, 3, flat=True),
                     mn_config(128, 128, 64, 8, 4), mn_config(128, 128, 64, 4, 3, pps=2),
                     mn_config(64, 128, 64, 4, 4, pps=2), mn_config(64, 64, 32, 4, 3, pps=2)]
    # FP8 operands: BK = 128, the same 128-byte operand rows as BK = 64 in 16 bits (Hopper's FP8 MMA
    # reads K-major tiles).
    _GLU_FP8_CONFIGS = [mn_config(128, 128, 128, 8, 3), mn_config(128, 128, 128, 8, 4),
                        mn_config(128, 64, 128, 8, 4), mn_config(128, 64, 128, 4, 3, pps=2),
                        mn_config(64, 128, 128, 4, 3, pps=2), mn_config(64, 64, 128, 4, 3, pps=2)]
    _DGLU_FP8_CONFIGS = [mn_config(128, 256, 128, 8, 3), mn_config(128, 256, 128, 8, 3, flat=True),
                         mn_config(128, 128, 128, 8, 4), mn_config(128, 128, 128, 4, 3, pps=2),
                         mn_config(64, 128, 128, 4, 4, pps=2), mn_config(64, 64, 128, 4, 3, pps=2)]
    _BN_MIN = min(c.kwargs["BN"] for c in _DGLU_CONFIGS + _DGLU_FP8_CONFIGS)  # partial-dscales slot width on GPU
    _GLU_KEY = ["F", "K", "USE_TMA", "ACT", "HAS_BIAS", "HAS_SCALE", "GATHER"]
    _DGLU_KEY = ["F", "H", "USE_TMA", "ACT", "HAS_SCALE", "NEED_DS"]
    _GLU_FIT = {"F": "BN", "K": "BK"}  # tiles over the F activated columns; the mainloop runs over K
    _DGLU_FIT = {"F": "BN", "H": "BK"}  # tiles over F; the mainloop runs over H (dy @ w2)
    GLU_FWD_KERNEL = TunedKernel(_glu_fwd_kernel, _GLU_CONFIGS, _GLU_KEY, (_GLU_CONFIGS[2], _GLU_CONFIGS[5]), INTERP_MN,
                                 fit=_GLU_FIT)
    DGLU_KERNEL = TunedKernel(_dglu_kernel, _DGLU_CONFIGS, _DGLU_KEY, (_DGLU_CONFIGS[2], _DGLU_CONFIGS[5]), INTERP_MN,
                              fit=_DGLU_FIT)
    GLU_FWD_FP8_KERNEL = TunedKernel(_glu_fwd_kernel, _GLU_FP8_CONFIGS, _GLU_KEY,
                                     (_GLU_FP8_CONFIGS[0], _GLU_FP8_CONFIGS[0]), INTERP_MN, fit=_GLU_FIT)
    DGLU_FP8_KERNEL = TunedKernel(_dglu_kernel, _DGLU_FP8_CONFIGS, _DGLU_KEY,
                                  (_DGLU_FP8_CONFIGS[0], _DGLU_FP8_CONFIGS[0]), INTERP_MN, fit=_DGLU_FIT)


def _act_id(kind: str, scales) -> int:
    """The ``ACT`` constexpr of a GLU kind (validated)."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; expected one of {sorted(KINDS)}")
    if kind == "scaled_swiglu" and scales is None:
        raise ValueError("kind='scaled_swiglu' needs scales")
    return ACT_IDS[GLU_BASE[kind]]


def _interp(t: torch.Tensor) -> bool:
    return interpreter_enabled() and not t.is_cuda


# ----------------------------------------------------------------------------- custom ops
def _glu_fwd_launch(x, w1, split_sizes, bias1, kind, scales, fp8=None, gather=None):
    """Launch _glu_fwd_kernel; ``fp8`` = (scale_inv of x, scale_inv of w1, amax [1], out dtype)
    for FP8 operands, else None (outputs in x's dtype); ``gather`` [M] int64: row r reads
    x[gather[r]]."""
    M, K = x.shape if gather is None else (gather.shape[0], x.shape[1])
    G, F = w1.shape[0], w1.shape[1] // 2
    out_dtype = x.dtype if fp8 is None else fp8[3]
    h = x.new_empty((M, 2 * F), dtype=out_dtype)  # (new_empty: less host time than torch.empty(dtype=, device=))
    y = x.new_empty((M, F), dtype=out_dtype)
    if M == 0 or F == 0:
        return y, h
    dummy = h
    fp8_args = fp8[:3] if fp8 is not None else (dummy, dummy, dummy)
    tensors = (x, w1, h, y, bias1 if bias1 is not None else dummy, scales if scales is not None else dummy,
               split_sizes, gather if gather is not None else split_sizes, *fp8_args)
    # everything build() reads but the pointers (launch_cached: later calls skip build)
    key = (x.shape, x.stride(), w1.shape, w1.stride(), M, out_dtype, None if bias1 is None else bias1.stride(),
           None if scales is None else scales.stride(), kind, fp8 is None, gather is None,
           *[t.dtype for t in tensors], x.device)

    def build():
        use_tma = K > 0 and tma_ok(x, w1)
        args = (*tensors, M, F, K, G, x.stride(0), x.stride(1), w1.stride(0), w1.stride(1), w1.stride(2),
                h.stride(0), h.stride(1), y.stride(0), y.stride(1),
                bias1.stride(0) if bias1 is not None else 0, bias1.stride(1) if bias1 is not None else 0,
                scales.stride(0) if scales is not None else 0)
        const = dict(HAS_BIAS=bias1 is not None, HAS_SCALE=scales is not None, ACT=_act_id(kind, scales),
                     USE_TMA=use_tma, PREC=dot_precision(x.dtype), G_P2=group_p2(G), FP8=fp8 is not None,
                     GATHER=gather is not None)
        return args, const, persistent_grid(M, G, F, x.device)
    kernel = GLU_FWD_KERNEL if fp8 is None else GLU_FWD_FP8_KERNEL
    kernel.launch_cached(key, tensors, build, x.dtype, x.device)
    return y, h


@kernel_op("fusible_ops::grouped_glu_fwd", mutates_args=())
def _grouped_glu_fwd_op(x: torch.Tensor, w1: torch.Tensor, split_sizes: torch.Tensor, bias1: Optional[torch.Tensor],
                        kind: str, scales: Optional[torch.Tensor], gather: Optional[torch.Tensor]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    return _glu_fwd_launch(x, w1, split_sizes, bias1, kind, scales, gather=gather)


@_grouped_glu_fwd_op.register_fake
def _(x, w1, split_sizes, bias1, kind, scales, gather):
    F = w1.shape[1] // 2
    m = x.shape[0] if gather is None else gather.shape[0]
    return x.new_empty((m, F)), x.new_empty((m, 2 * F))


def _dglu_launch(dy2, w2, split_sizes, h, kind, scales, need_dscales, fp8=None):
    """Launch _dglu_kernel; ``fp8`` = (scale_inv of dy2, scale_inv of w2, amax [1]) with dy2 FP8 and
    w2 its per-group transpose [G, F, H] (FP8), else None. Returns (dh, y, dscales)."""
    M, H = dy2.shape
    G, F = w2.shape[0], (w2.shape[1] if fp8 is not None else w2.shape[2])
    dh = dy2.new_empty((M, 2 * F), dtype=h.dtype if fp8 is not None else dy2.dtype)
    y = h.new_empty((M, F if fp8 is None else 0))
    need_ds = bool(need_dscales)
    bn_min = INTERP_MN["BN"] // 2 if _interp(dy2) else _BN_MIN  # (2 slots per tile in the interpreter)
    # (no [0, M] placeholder when the scales' gradient is not asked for: an allocation costs host time)
    parts = dy2.new_empty((cdiv(F, bn_min), M), dtype=torch.float32) if need_ds else None
    if M == 0 or F == 0:
        return dh, y, parts.sum(0) if need_ds else None
    fp8_args = fp8 if fp8 is not None else (dh, dh, dh)
    tensors = (dy2, w2, h, scales if scales is not None else h, dh, y if fp8 is None else dh, parts if need_ds else dh,
               split_sizes, *fp8_args)
    # everything build() reads but the pointers (launch_cached: later calls skip build)
    key = (dy2.shape, dy2.stride(), w2.shape, w2.stride(), h.shape, h.stride(),
           None if scales is None else scales.stride(), kind, need_ds, fp8 is None, *[t.dtype for t in tensors],
           dy2.device)

    def build():
        use_tma = H > 0 and tma_ok(dy2, w2)
        # strides of w2 as [G, H, F] (s_wg, s_wh, s_wf); under FP8 w2 is [G, F, H]
        s_wh, s_wf = (w2.stride(2), w2.stride(1)) if fp8 is not None else (w2.stride(1), w2.stride(2))
        args = (*tensors, M, F, H, G, dy2.stride(0), dy2.stride(1), w2.stride(0), s_wh, s_wf,
                h.stride(0), h.stride(1), scales.stride(0) if scales is not None else 0,
                dh.stride(0), dh.stride(1), y.stride(0) if fp8 is None else 0, y.stride(1) if fp8 is None else 0)
        const = dict(HAS_SCALE=scales is not None, NEED_DS=need_ds, ACT=_act_id(kind, scales), USE_TMA=use_tma,
                     PREC=dot_precision(dy2.dtype), G_P2=group_p2(G), BN_MIN=bn_min, FP8=fp8 is not None)
        return args, const, persistent_grid(M, G, F, dy2.device)
    kernel = DGLU_KERNEL if fp8 is None else DGLU_FP8_KERNEL
    kernel.launch_cached(key, tensors, build, dy2.dtype, dy2.device)
    return dh, y, parts.sum(0) if need_ds else None  # (eager calls allocate no placeholder)


@kernel_op("fusible_ops::grouped_dglu", mutates_args=(), eager=_dglu_launch)
def _grouped_dglu_op(dy2: torch.Tensor, w2: torch.Tensor, split_sizes: torch.Tensor, h: torch.Tensor, kind: str,
                     scales: Optional[torch.Tensor], need_dscales: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dh, y, ds = _dglu_launch(dy2, w2, split_sizes, h, kind, scales, need_dscales)
    return dh, y, placeholder(ds, dh, torch.float32)


@_grouped_dglu_op.register_fake
def _(dy2, w2, split_sizes, h, kind, scales, need_dscales):
    M, F = dy2.shape[0], w2.shape[2]
    ds = dy2.new_empty((M if need_dscales else 0,), dtype=torch.float32)
    return dy2.new_empty((M, 2 * F)), h.new_empty((M, F)), ds


@kernel_op("fusible_ops::grouped_glu_fwd_fp8", mutates_args=("amax",))
def _grouped_glu_fwd_fp8_op(x: torch.Tensor, sx: torch.Tensor, w1: torch.Tensor, sw: torch.Tensor,
                            split_sizes: torch.Tensor, bias1: Optional[torch.Tensor], kind: str,
                            scales: Optional[torch.Tensor], out_dtype: torch.dtype, amax: torch.Tensor,
                            gather: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return _glu_fwd_launch(x, w1, split_sizes, bias1, kind, scales, (sx, sw, amax, out_dtype), gather)


@_grouped_glu_fwd_fp8_op.register_fake
def _(x, sx, w1, sw, split_sizes, bias1, kind, scales, out_dtype, amax, gather):
    F = w1.shape[1] // 2
    m = x.shape[0] if gather is None else gather.shape[0]
    return x.new_empty((m, F), dtype=out_dtype), x.new_empty((m, 2 * F), dtype=out_dtype)


def _dglu_fp8_eager(dy2, sdy, w2t, sw, split_sizes, h, kind, scales, need_dscales, amax):
    dh, _, ds = _dglu_launch(dy2, w2t, split_sizes, h, kind, scales, need_dscales, (sdy, sw, amax))
    return dh, ds


@kernel_op("fusible_ops::grouped_dglu_fp8", mutates_args=("amax",), eager=_dglu_fp8_eager)
def _grouped_dglu_fp8_op(dy2: torch.Tensor, sdy: torch.Tensor, w2t: torch.Tensor, sw: torch.Tensor,
                         split_sizes: torch.Tensor, h: torch.Tensor, kind: str, scales: Optional[torch.Tensor],
                         need_dscales: bool, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dh, ds = _dglu_fp8_eager(dy2, sdy, w2t, sw, split_sizes, h, kind, scales, need_dscales, amax)
    return dh, placeholder(ds, dh, torch.float32)


@_grouped_dglu_fp8_op.register_fake
def _(dy2, sdy, w2t, sw, split_sizes, h, kind, scales, need_dscales, amax):
    M, F = dy2.shape[0], w2t.shape[1]
    return h.new_empty((M, 2 * F)), dy2.new_empty((M if need_dscales else 0,), dtype=torch.float32)


# ----------------------------------------------------------------------------- public API
def _check_glu(split_sizes, G, a, w, *tensors):
    check_splits(split_sizes, G, a, w, *tensors)
    same_dtype(a, w)


def _check_gather(gather: Optional[torch.Tensor]) -> None:
    if gather is not None and (gather.dim() != 1 or gather.dtype != torch.int64 or gather.stride(0) != 1):
        raise ValueError(f"gather must be a contiguous 1-D int64 tensor, got {list(gather.shape)} {gather.dtype}")


def grouped_glu_fwd(x: torch.Tensor, w1: torch.Tensor, split_sizes: torch.Tensor, bias1: Optional[torch.Tensor],
                    kind: str, scales: Optional[torch.Tensor] = None, gather: Optional[torch.Tensor] = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """FC1 + GLU in one grouped kernel (activation in the epilogue).

    x [M, K], w1 [G, 2F, K] (x's dtype), bias1 [G, 2F] or None, split_sizes [G] int64, scales [M]
    (any float dtype) or None. Returns (y, h): h = x_g @ w1[g].T (+ bias1[g]) [M, 2F] in x's dtype
    (kept for backward); y = act(h[:, :F]) * h[:, F:] (* scales[:, None]) [M, F] in x's dtype,
    computed in fp32 from h as rounded to x's dtype. Sync-free, one launch.

    ``gather`` [M] int64 (values in [0, rows of x), not checked: a check would sync): row r of the
    grouped operand is ``x[gather[r]]``, read inside the GEMM's mainloop (a MoE layer's token
    copies are never written); x is then [T, K] with any T.
    """
    _act_id(kind, scales)
    if w1.shape[1] % 2:
        raise ValueError(f"w1 must be [G, 2F, K]; got {tuple(w1.shape)}")
    _check_glu(split_sizes, w1.shape[0], x, w1, bias1, scales, gather)
    _check_gather(gather)
    if use_triton(x, w1, split_sizes, bias1, scales, gather) and x.dtype in TRITON_DTYPES:
        return _grouped_glu_fwd_op(x, w1, split_sizes, bias1, kind, scales, gather)
    if gather is not None:
        x = x.index_select(0, gather)
    return grouped_glu_fwd_ref(x, w1, split_sizes, bias1, kind, scales)


def grouped_dglu(dy2: torch.Tensor, w2: torch.Tensor, split_sizes: torch.Tensor, h: torch.Tensor, kind: str,
                 scales: Optional[torch.Tensor] = None, need_dscales: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """FC2 input gradient with the GLU backward in its epilogue.

    dy2 [M, H] (gradient of FC2's output), w2 [G, H, F], h [M, 2F] (FC1 output from forward),
    scales [M] or None. With g = dy2_g @ w2[g] (fp32, never stored) and glu = act(a) * b:
    returns (dh, y, dscales): dh [M, 2F] in dy2's dtype = d(glu * scales)/dh applied to g;
    y [M, F] in h's dtype = glu(h) (* scales), recomputed for FC2's wgrad; dscales [M] fp32 =
    sum_j g[r, j] * glu[r, j] if need_dscales (deterministic, no atomics) else None.
    """
    _act_id(kind, scales)
    F = w2.shape[2]
    if tuple(h.shape) != (dy2.shape[0], 2 * F):
        raise ValueError(f"h must be [M, 2F] = {(dy2.shape[0], 2 * F)}, got {tuple(h.shape)}")
    _check_glu(split_sizes, w2.shape[0], dy2, w2, h, scales)
    if use_triton(dy2, w2, split_sizes, h, scales) and dy2.dtype in TRITON_DTYPES:
        dh, y, ds = _grouped_dglu_op(dy2, w2, split_sizes, h, kind, scales, need_dscales)
        return dh, y, (ds if need_dscales else None)
    return grouped_dglu_ref(dy2, w2, split_sizes, h, kind, scales, need_dscales)


def _deq(pair) -> torch.Tensor:
    return pair[0].float() * pair[1].float().reshape(())


def _raise_amax(amax: torch.Tensor, t: torch.Tensor) -> None:
    if t.numel():
        amax.copy_(torch.maximum(amax, t.abs().amax().float().reshape(amax.shape)))


def grouped_glu_fwd_fp8(x, w1, split_sizes: torch.Tensor, bias1: Optional[torch.Tensor], kind: str,
                        scales: Optional[torch.Tensor], out_dtype: torch.dtype, amax: torch.Tensor,
                        gather: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`grouped_glu_fwd` on FP8 operands: ``x`` = (data [M, K], scale_inv), ``w1`` = (data
    [G, 2F, K], scale_inv), per-tensor scales. Returns (y, h) in ``out_dtype`` and raises ``amax``
    (fp32 [1]) to max|y| in the same pass, for the cast of FC2's FP8 input. ``gather`` as in
    :func:`grouped_glu_fwd` (rows of the FP8 data). Without Triton (FP8 on the CPU): fp32 math on
    the dequantized operands."""
    _act_id(kind, scales)
    check_splits(split_sizes, w1[0].shape[0], x[0], w1[0], bias1, scales, gather)
    _check_gather(gather)
    if fp8_triton_ok(x[0], w1[0]):
        return _grouped_glu_fwd_fp8_op(x[0], x[1].reshape(1).float(), w1[0], w1[1].reshape(1).float(), split_sizes,
                                       bias1, kind, scales, out_dtype, amax, gather)
    xd = _deq(x) if gather is None else _deq(x).index_select(0, gather)
    y, h = grouped_glu_fwd_ref(xd, _deq(w1), split_sizes, None if bias1 is None else bias1.float(), kind, scales)
    y, h = y.to(out_dtype), h.to(out_dtype)
    _raise_amax(amax, y)
    return y, h


def grouped_dglu_fp8(dy2, w2t, split_sizes: torch.Tensor, h: torch.Tensor, kind: str,
                     scales: Optional[torch.Tensor], need_dscales: bool, amax: torch.Tensor
                     ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`grouped_dglu` on FP8 operands: ``dy2`` = (data [M, H], scale_inv), ``w2t`` = (FC2's
    weight transposed per group, data [G, F, H], scale_inv). Returns (dh [M, 2F] in h's dtype,
    dscales or None) and raises ``amax`` to max|dh| in the same pass, for the cast of FC1's FP8
    output gradient. y is not recomputed (FC2's weight gradient reads the forward's FP8 copy)."""
    _act_id(kind, scales)
    check_splits(split_sizes, w2t[0].shape[0], dy2[0], w2t[0], h, scales)
    if fp8_triton_ok(dy2[0], w2t[0]):
        dh, ds = _grouped_dglu_fp8_op(dy2[0], dy2[1].reshape(1).float(), w2t[0], w2t[1].reshape(1).float(),
                                      split_sizes, h, kind, scales, need_dscales, amax)
        return dh, (ds if need_dscales else None)
    dh, _, ds = grouped_dglu_ref(_deq(dy2), _deq(w2t).transpose(1, 2), split_sizes, h.float(), kind, scales,
                                 need_dscales)
    dh = dh.to(h.dtype)
    _raise_amax(amax, dh)
    return dh, ds


# ----------------------------------------------------------------------------- references
def grouped_glu_fwd_ref(x: torch.Tensor, w1: torch.Tensor, split_sizes: torch.Tensor, bias1: Optional[torch.Tensor],
                        kind: str, scales: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch twin of :func:`grouped_glu_fwd` (per-group loop, fp32 math, syncs)."""
    _act_id(kind, scales)
    acc = compute_dtype(x.dtype)
    h = grouped_gemm_fwd_ref(x, w1, split_sizes, bias1)
    a, b = h.to(acc).chunk(2, dim=-1)
    y = act_and_grad_ref(a, GLU_BASE[kind], need_grad=False)[0] * b
    if scales is not None:
        y = y * scales.to(acc)[:, None]
    return y.to(x.dtype), h


def grouped_dglu_ref(dy2: torch.Tensor, w2: torch.Tensor, split_sizes: torch.Tensor, h: torch.Tensor, kind: str,
                     scales: Optional[torch.Tensor] = None, need_dscales: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Pure-torch twin of :func:`grouped_dglu` (g kept in fp32 like the kernel; fp64 for fp64)."""
    _act_id(kind, scales)
    acc = compute_dtype(dy2.dtype)
    g = grouped_dgrad_acc_ref(dy2, w2, split_sizes)
    a, b = h.to(acc).chunk(2, dim=-1)
    base = GLU_BASE[kind]
    act, dact_a = act_and_grad_ref(a, base)
    glu = act * b
    ds = (g * glu).sum(-1) if need_dscales else None
    if scales is not None:
        sc = scales.to(acc)[:, None]
        g, glu = g * sc, glu * sc
    dh = torch.cat([dact_ref(g * b, a, dact_a, base), g * act], dim=-1).to(dy2.dtype)
    return dh, glu.to(h.dtype), ds


__all__ = ["grouped_dglu", "grouped_dglu_fp8", "grouped_dglu_ref", "grouped_glu_fwd", "grouped_glu_fwd_fp8",
           "grouped_glu_fwd_ref"]
