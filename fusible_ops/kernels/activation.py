"""Bias + activation (+ counter-based dropout) and scaled SwiGLU kernels.

Math, all in fp32 (fp64 on the ref path for fp64 inputs); ``z = x + bias`` (or ``x``). The
activations (``relu``, ``gelu`` exact, ``gelu_tanh``, ``silu``) and their gradients come from the
one table, :mod:`fusible_ops.kernels.act_table`; gated kinds ``swiglu`` / ``geglu`` /
``geglu_tanh`` / ``reglu`` split the last dim of z (size 2H) into ``a = z[..., :H]``,
``b = z[..., H:]`` and give ``y = act(a) * b``.

* dropout (optional): ``y = dropout(act(z))`` with the mask contract of
  :mod:`fusible_ops.kernels.dropout` applied to y's contiguous ``[rows, cols]`` view
  (counter ``r * ceil(cols / 8) + c // 8``, 16-bit half ``c % 8`` of ``tl.randint4x``), key = seed;
  every kernel gets it from the shared ``keep_tile`` helper (column tiles start at multiples
  of a power-of-two ``BLOCK_C >= 8``).

NaN / Inf: both paths give what torch's activations (and dropout) give, forward and backward;
the table is in :mod:`fusible_ops.kernels.activation_ref`, which holds the pure-torch ``*_ref``
twins (re-exported here) and the checks both paths share.

Layout: Triton kernels, launchers + custom ops, public functions.
One forward kernel serves ``bias_act_fwd`` and ``scaled_swiglu_fwd``; one backward
kernel computes the input gradient and, in the same pass, the bias column sums
(per-program fp32 partials, reduced deterministically afterwards) or the per-row
``dscales`` dot products.
"""

from typing import Optional

import torch

from fusible_ops.kernels import HAS_TRITON, interpreter_enabled, use_triton
from fusible_ops.kernels.act_table import ACT_IDS
from fusible_ops.kernels.activation_ref import (  # noqa: F401  (re-exported: one module to import)
    ACTIVATIONS,
    GATED,
    bias_act_bwd_ref,
    bias_act_fwd_ref,
    check_bias_act,
    check_kind,
    check_scales,
    out_cols,
    scaled_swiglu_bwd_ref,
    scaled_swiglu_fwd_ref,
)
from fusible_ops.kernels.dropout import drop_threshold, keep_scale, kernel_seed
from fusible_ops.kernels.fp8_cast import FP8_MAX_OF, fp8_epilogue_ref
from fusible_ops.kernels.partials import partials_buffer, sum_partials
from fusible_ops.kernels.launch import (MIN_BLOCK_C, DirectKernel, as_rows, cdiv, contiguous_or, elementwise_config,
                                        geometry_cache, kernel_op, needs_int64, next_pow2, num_sms, placeholder,
                                        remember)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from fusible_ops.kernels.act_table import act_and_grad, dact
    from fusible_ops.kernels.dropout import keep_tile
    from fusible_ops.kernels.fp8_cast import fp8_epilogue

    @triton.jit
    def _act_fwd_kernel(
        X,  # [n_rows, (2 if GATED else 1) * n_out], row stride stride_xr, column stride 1
        B,  # [(2 if GATED else 1) * n_out] bias (any float dtype) or dummy
        S,  # [n_rows] per-row scales or dummy
        Y,  # [n_rows, n_out] contiguous
        n_rows,
        n_out,
        stride_xr,
        drop_t,  # fp32 dropout.drop_threshold(p)
        scale,  # fp32 1 / (1 - p)
        SEED,  # [1] int64 dropout seed (read on the device) or dummy
        Q, QSCALE, AMAX,  # FP8 output (OUT_MODE 2), fp32 [1] scale, fp32 [1] amax
        ACT: tl.constexpr,
        GATED: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_SCALES: tl.constexpr,
        DROPOUT: tl.constexpr,
        OFF64: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
        OUT_MODE: tl.constexpr,  # fp8_epilogue's: 0 plain, 1 plain + amax, 2 FP8 (+ amax)
        FMAX: tl.constexpr,
        SOFT_ROUND: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        col0 = tl.program_id(1) * BLOCK_C
        cols = col0 + tl.arange(0, BLOCK_C)
        rmask = rows < n_rows
        cmask = cols < n_out
        mask = rmask[:, None] & cmask[None, :]
        rows64 = rows.to(tl.int64)
        x_ptrs = X + rows64[:, None] * stride_xr + cols[None, :]
        a = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            a += tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        y, _ = act_and_grad(a, ACT)
        if GATED:
            b = tl.load(x_ptrs + n_out, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                b += tl.load(B + n_out + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
            y = y * b
        if DROPOUT:  # a product (like torch's dropout): NaN/Inf stay NaN where dropped
            keep = keep_tile(tl.load(SEED), rows, col0, n_out, drop_t, BLOCK_R, BLOCK_C, OFF64)
            y = y * tl.where(keep, scale, 0.0)
        if HAS_SCALES:
            y = y * tl.load(S + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
        fp8_epilogue(y, mask, rows64, cols.to(tl.int64), n_rows, n_out, Y, Q, QSCALE, AMAX, OUT_MODE, FMAX, SOFT_ROUND)

    @triton.jit
    def _bwd_tile_loads(DY, X, rows, row_end, cols, cmask, n_out, stride_dyr, stride_xr, GATED: tl.constexpr):
        # dy and x's halves a, b (b = a unless GATED) of the rows x cols tile as stored, 0 outside
        # rows < row_end
        mask = (rows < row_end)[:, None] & cmask[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        dy = tl.load(DY + rows64 * stride_dyr + cols[None, :], mask=mask, other=0.0)
        x_ptrs = X + rows64 * stride_xr + cols[None, :]
        a = tl.load(x_ptrs, mask=mask, other=0.0)
        b = tl.load(x_ptrs + n_out, mask=mask, other=0.0) if GATED else a
        return dy, a, b

    @triton.jit
    def _act_bwd_kernel(
        DY,  # [n_rows, n_out], row stride stride_dyr, column stride 1
        X,  # [n_rows, (2 if GATED else 1) * n_out], row stride stride_xr, column stride 1
        B,  # [(2 if GATED else 1) * n_out] bias or dummy
        S,  # [n_rows] per-row scales or dummy
        DX,  # [n_rows, (2 if GATED else 1) * n_out] contiguous
        DBP,  # [n_row_progs, (2 if GATED else 1) * n_out] fp32 partial column sums of DX
        DSP,  # [n_col_blocks, n_rows] fp32 partial row sums of dy * y_unscaled
        n_rows,
        n_out,
        stride_dyr,
        stride_xr,
        rows_per_prog,  # multiple of BLOCK_R
        drop_t,
        scale,
        SEED,  # [1] int64 dropout seed or dummy
        AMAX,  # fp32 [1]: raised to max|dx| (HAS_AMAX: an FP8 cast of dx follows, it needs no reduction)
        ACT: tl.constexpr,
        GATED: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_SCALES: tl.constexpr,
        NEED_DBIAS: tl.constexpr,
        NEED_DSCALES: tl.constexpr,
        DROPOUT: tl.constexpr,
        OFF64: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
        HAS_AMAX: tl.constexpr,
        PREFETCH: tl.constexpr,
    ):
        pid_r = tl.program_id(0)
        pid_c = tl.program_id(1)
        n_in = 2 * n_out if GATED else n_out
        col0 = pid_c * BLOCK_C
        cols = col0 + tl.arange(0, BLOCK_C)
        cmask = cols < n_out
        if HAS_BIAS:
            bias_a = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
            if GATED:
                bias_b = tl.load(B + n_out + cols, mask=cmask, other=0.0).to(tl.float32)
        if DROPOUT:
            seed = tl.load(SEED)
        acc_a = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
        amax = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
        row_start = pid_r * rows_per_prog
        row_end = tl.minimum(row_start + rows_per_prog, n_rows)
        if PREFETCH:  # each tile's loads go out one iteration early, before the previous tile's math
            dy_n, a_n, b_n = _bwd_tile_loads(DY, X, row_start + tl.arange(0, BLOCK_R), row_end, cols, cmask, n_out,
                                             stride_dyr, stride_xr, GATED)
        for r0 in range(row_start, row_end, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            rmask = rows < row_end
            mask = rmask[:, None] & cmask[None, :]
            rows64 = rows.to(tl.int64)
            if PREFETCH:
                dy_t, a_t, b_t = dy_n, a_n, b_n
                dy_n, a_n, b_n = _bwd_tile_loads(DY, X, rows + BLOCK_R, row_end, cols, cmask, n_out, stride_dyr,
                                                 stride_xr, GATED)
            else:
                dy_t, a_t, b_t = _bwd_tile_loads(DY, X, rows, row_end, cols, cmask, n_out, stride_dyr, stride_xr, GATED)
            dy = dy_t.to(tl.float32)
            if HAS_SCALES:
                s = tl.load(S + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
                g = dy * s
            else:
                g = dy
            if DROPOUT:
                m = tl.where(keep_tile(seed, rows, col0, n_out, drop_t, BLOCK_R, BLOCK_C, OFF64), scale, 0.0)
                g = g * m
            a = a_t.to(tl.float32)
            if HAS_BIAS:
                a += bias_a[None, :]
            act_a, dact_a = act_and_grad(a, ACT)
            dx_ptrs = DX + rows64[:, None] * n_in + cols[None, :]
            if GATED:
                b = b_t.to(tl.float32)
                if HAS_BIAS:
                    b += bias_b[None, :]
                da = dact(g * b, a, dact_a, ACT)
                db = g * act_a
                tl.store(dx_ptrs + n_out, db.to(DX.dtype.element_ty), mask=mask)
                if HAS_AMAX:  # of the stored (rounded) values, as a cast of dx would see them
                    amax = tl.maximum(amax, tl.where(mask, tl.abs(db.to(DX.dtype.element_ty).to(tl.float32)), 0.0))
                h = act_a * b
                if NEED_DBIAS:
                    acc_b += tl.where(mask, db, 0.0)
            else:
                da = dact(g, a, dact_a, ACT)
                h = act_a
            tl.store(dx_ptrs, da.to(DX.dtype.element_ty), mask=mask)
            if HAS_AMAX:
                amax = tl.maximum(amax, tl.where(mask, tl.abs(da.to(DX.dtype.element_ty).to(tl.float32)), 0.0))
            if NEED_DBIAS:
                acc_a += tl.where(mask, da, 0.0)
            if NEED_DSCALES:
                if DROPOUT:
                    h = h * m
                part = tl.sum(tl.where(mask, dy * h, 0.0), axis=1)
                tl.store(DSP + pid_c.to(tl.int64) * n_rows + rows, part, mask=rmask)
        if HAS_AMAX:
            tl.atomic_max(AMAX, tl.max(tl.max(amax, axis=1), axis=0))
        if NEED_DBIAS:
            dbp = DBP + pid_r.to(tl.int64) * n_in + cols
            tl.store(dbp, tl.sum(acc_a, axis=0), mask=cmask)
            if GATED:
                tl.store(dbp + n_out, tl.sum(acc_b, axis=0), mask=cmask)


# ----------------------------------------------------------------------------- launchers


# backward tiling: [BLOCK_R, BLOCK_C] tiles (8 elements per thread at 8 warps: sm_90 builds use
# 40-80 registers, vs 110-255 with 16x256 tiles), each program looping over a contiguous row range;
# ~24 programs per SM keep the partial-sum buffer ~1% of the traffic and the last wave short.
_BWD_MAX_BLOCK_C = 512
_BWD_TILE = 2048
# Prefetch in the backward (each row tile's loads issued one iteration early) with dbias, no
# dropout and an activation costlier than ReLU. H200, bf16, kernel alone, us without -> with
# (2026-11-26 09:55-10:15): bias + GELU with dbias 569.0 -> 534.5 at [16384, 16384], 151.2 -> 137.7
# at [16384, 2816], 86.0 -> 81.5 at [4096, 4096] (end to end, Bias -> GELU: 915.4 -> 879.4);
# tanh-GELU / SiLU 515.0 -> 455.8 / 494.1 -> 434.0; GEGLU 530.5 -> 480.4, SwiGLU 462.1 -> 462.1 at
# [16384, 16384]. ReLU 421.8 -> 427.3 and ReGLU 405.9 -> 442.5 (the cheap activation is
# memory-bound: no prefetch); with dropout 0.7-2.1% slower; without dbias within 2% either way.
_BWD_PREFETCH = True
_PROGS_PER_SM = 24
_ONE_PROG_ROW_TILES = 4  # up to this many row tiles: one row program (host-bound sizes)
if HAS_TRITON:
    _FWD = DirectKernel(_act_fwd_kernel)
    _BWD = DirectKernel(_act_bwd_kernel)


_GEOMETRY = geometry_cache()  # launch geometry per (direction, shapes, strides, dtypes, flags, device)


def _remember(key, geo):
    return remember(_GEOMETRY, key, geo)


def _rows_of(x: torch.Tensor, asis: bool) -> torch.Tensor:
    return x if asis else as_rows(x)


_PLAIN = (0, None)  # fp8 output spec (OUT_MODE, fp8 dtype) of a plain call


def _fwd_geometry(key, x, bias, scales, kind, drop, fp8=_PLAIN):
    """Checks and launch geometry of the forward, once per key: (y shape, asis, grid, meta)."""
    check_bias_act(x, bias, kind, 0.0, None)
    if scales is not None:
        check_scales(x, scales)
    act, gated = check_kind(kind)
    n_out = out_cols(x, gated)
    out_shape = (*x.shape[:-1], n_out)
    n_rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if n_rows * n_out == 0:
        return _remember(key, (out_shape, True, None, None))
    block_r, block_c, num_warps = elementwise_config(n_rows, n_out)
    grid = (cdiv(n_rows, block_r), cdiv(n_out, block_c))
    mode, qdtype = fp8
    meta = dict(ACT=act, GATED=gated, HAS_BIAS=bias is not None, HAS_SCALES=scales is not None, DROPOUT=drop,
                OFF64=needs_int64(n_rows, n_out), BLOCK_R=block_r, BLOCK_C=block_c, OUT_MODE=mode,
                FMAX=FP8_MAX_OF.get(qdtype, 448.0), SOFT_ROUND=interpreter_enabled(),
                num_warps=num_warps)
    asis = x.dim() == 2 and (x.stride(1) == 1 or x.shape[1] <= 1)
    return _remember(key, (out_shape, asis, grid, meta))


def _act_fwd_launch(x, bias, scales, kind, dropout_p, seed, fp8=_PLAIN, qscale=None, amax=None):
    """seed: [1] int64 tensor on x's device when dropout_p > 0, else None. ``fp8``: (OUT_MODE,
    fp8 dtype) of :func:`fusible_ops.kernels.fp8_cast.fp8_epilogue`; mode 2 returns the FP8 bytes
    q [rows, n_out], modes 0 and 1 return y."""
    drop = dropout_p > 0.0
    key = ("fwd", x.shape, x.stride(), x.dtype, x.device, kind, None if bias is None else (bias.shape, bias.dtype),
           None if scales is None else (scales.shape, scales.dtype), drop, fp8)
    geo = _GEOMETRY.get(key) or _fwd_geometry(key, x, bias, scales, kind, drop, fp8)
    out_shape, asis, grid, meta = geo
    mode, qdtype = fp8
    n_rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if mode == 2:
        y = torch.empty(n_rows, out_shape[-1], dtype=qdtype, device=x.device)
    elif grid is not None and not meta["GATED"]:  # (empty_like: a shape argument costs more host time)
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        y = x.new_empty(out_shape)
    if grid is not None:
        x2 = _rows_of(x, asis)  # a view when possible (column stride must be 1), else a copy
        bias_c = contiguous_or(bias, x2)
        scales_c = scales.reshape(-1).contiguous() if scales is not None else x2
        outs = (x2, y, qscale, amax) if mode == 2 else (y, y, x2, amax if mode == 1 else x2)
        _FWD(grid, key, (x2, bias_c, scales_c, outs[0], x2.shape[0], out_shape[-1], x2.stride(0),
                         float(drop_threshold(dropout_p)),
                         keep_scale(dropout_p), seed if drop else x2, *outs[1:]), meta)
    return y


def _bwd_geometry(key, dy, x, bias, scales, kind, need_dbias, need_dscales, drop, has_amax=False):
    """Checks and launch geometry of the backward, once per key."""
    check_bias_act(x, bias, kind, 0.0, None)
    if scales is not None:
        check_scales(x, scales)
    act, gated = check_kind(kind)
    n_out = out_cols(x, gated)
    n_in = x.shape[-1]
    n_rows = x.numel() // n_in if n_in else 0
    if tuple(dy.shape) != (*x.shape[:-1], n_out) and dy.numel() != n_rows * n_out:
        raise ValueError(f"bias_act_bwd: dy shape {tuple(dy.shape)} does not match the forward output "
                         f"{(*x.shape[:-1], n_out)}")
    if x.numel() == 0:
        return _remember(key, (None,) * 8 + (n_in,))
    block_c = max(MIN_BLOCK_C, min(next_pow2(n_out), _BWD_MAX_BLOCK_C))  # >= 8: keep_tile
    block_r = max(1, min(next_pow2(n_rows), _BWD_TILE // block_c))
    num_warps = 8 if block_r * block_c >= 2048 else 4
    n_col_blocks = cdiv(n_out, block_c)
    # enough programs to fill the GPU, each looping over a contiguous range of rows; a small
    # problem takes one row program, which writes dbias itself (no partial-sum reduction)
    n_row_tiles = cdiv(n_rows, block_r)
    n_row_progs = 1 if n_row_tiles <= _ONE_PROG_ROW_TILES else max(
        1, min(n_row_tiles, (_PROGS_PER_SM * num_sms(x.device)) // n_col_blocks))
    rows_per_prog = cdiv(cdiv(n_rows, n_row_progs), block_r) * block_r
    n_row_progs = cdiv(n_rows, rows_per_prog)
    meta = dict(ACT=act, GATED=gated, HAS_BIAS=bias is not None, HAS_SCALES=scales is not None,
                NEED_DBIAS=need_dbias, NEED_DSCALES=need_dscales, DROPOUT=drop, OFF64=needs_int64(n_rows, n_out),
                BLOCK_R=block_r, BLOCK_C=block_c, HAS_AMAX=has_amax,
                PREFETCH=_BWD_PREFETCH and need_dbias and not drop and act != ACT_IDS["relu"],
                num_warps=num_warps)
    asis_x = x.dim() == 2 and (x.stride(1) == 1 or n_in <= 1)
    asis_dy = dy.dim() == 2 and tuple(dy.shape) == (n_rows, n_out) and (dy.stride(1) == 1 or n_out <= 1)
    return _remember(key, (asis_x, asis_dy, (n_row_progs, n_col_blocks), meta, n_rows, n_out, rows_per_prog,
                           n_col_blocks, n_in))


def _act_bwd_launch(dy, x, bias, scales, kind, need_dbias, need_dscales, dropout_p, seed, amax=None):
    """Returns (dx, dbias or None, dscales or None); dbias/dscales in bias/scales dtype. ``amax``
    (fp32 [1]) or None: raised to max|dx| in the same pass."""
    need_dbias = need_dbias and bias is not None
    need_dscales = need_dscales and scales is not None
    drop = dropout_p > 0.0
    key = ("bwd", dy.shape, dy.stride(), x.shape, x.stride(), x.dtype, dy.dtype, x.device, kind,
           None if bias is None else (bias.shape, bias.dtype), None if scales is None else (scales.shape, scales.dtype),
           need_dbias, need_dscales, drop, amax is not None)
    geo = _GEOMETRY.get(key) or _bwd_geometry(key, dy, x, bias, scales, kind, need_dbias, need_dscales, drop,
                                              amax is not None)
    asis_x, asis_dy, grid, meta, n_rows, n_out, rows_per_prog, n_col_blocks, n_in = geo
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    if grid is None:  # no elements: the sums over no rows are zeros
        dbias = torch.zeros(n_in, dtype=bias.dtype, device=x.device) if need_dbias else None
        dscales = torch.zeros(scales.shape, dtype=scales.dtype, device=x.device) if need_dscales else None
        return dx, dbias, dscales
    x2 = _rows_of(x, asis_x)
    dy2 = dy if asis_dy else as_rows(dy.reshape(*x.shape[:-1], n_out))
    one_prog, one_block = grid[0] == 1, n_col_blocks == 1
    # one row program (column block) writes the column (row) sums straight in the output dtype
    # (several programs: fp32 partials summed right after, in a buffer reused on the default stream)
    if need_dbias:
        dbp = x2.new_empty((1, n_in), dtype=bias.dtype) if one_prog else partials_buffer(x2, grid[0], n_in, 0)
    else:
        dbp = x2
    if need_dscales:
        dsp = (x2.new_empty((1, n_rows), dtype=scales.dtype) if one_block
               else partials_buffer(x2, n_col_blocks, n_rows, 1))
    else:
        dsp = x2
    bias_c = contiguous_or(bias, x2)
    scales_c = scales.reshape(-1).contiguous() if scales is not None else x2
    _BWD(grid, key, (dy2, x2, bias_c, scales_c, dx, dbp, dsp, n_rows, n_out, dy2.stride(0), x2.stride(0),
                     rows_per_prog, float(drop_threshold(dropout_p)), keep_scale(dropout_p), seed if drop else x2,
                     amax if amax is not None else x2), meta)
    dbias = dscales = None
    if need_dbias:
        dbias = dbp[0] if one_prog else sum_partials(dbp, bias.dtype)
    if need_dscales:
        dscales = (dsp[0] if one_block else sum_partials(dsp, scales.dtype)).reshape(scales.shape)
    return dx, dbias, dscales


@kernel_op("fusible_ops::bias_act_fwd", mutates_args=())
def _bias_act_fwd_op(
    x: torch.Tensor, bias: Optional[torch.Tensor], kind: str, dropout_p: float, seed: Optional[torch.Tensor]
) -> torch.Tensor:
    return _act_fwd_launch(x, bias, None, kind, dropout_p, seed)


@_bias_act_fwd_op.register_fake
def _(x, bias, kind, dropout_p, seed):
    check_bias_act(x, bias, kind, dropout_p, seed)
    _, gated = check_kind(kind)
    return x.new_empty((*x.shape[:-1], out_cols(x, gated)))


def _bias_act_bwd_eager(dy, x, bias, kind, need_dbias, dropout_p, seed):
    """(dz, dbias or None): the op's eager call, no placeholder for a dbias not needed."""
    dz, dbias, _ = _act_bwd_launch(dy, x, bias, None, kind, need_dbias, False, dropout_p, seed)
    return dz, dbias


@kernel_op("fusible_ops::bias_act_bwd", mutates_args=(), eager=_bias_act_bwd_eager)
def _bias_act_bwd_op(
    dy: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor], kind: str, need_dbias: bool,
    dropout_p: float, seed: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dz, dbias); dbias is an empty tensor when not needed (custom ops return no None)."""
    dz, dbias = _bias_act_bwd_eager(dy, x, bias, kind, need_dbias, dropout_p, seed)
    return dz, placeholder(dbias, x)


@_bias_act_bwd_op.register_fake
def _(dy, x, bias, kind, need_dbias, dropout_p, seed):
    check_bias_act(x, bias, kind, dropout_p, seed)
    dbias = bias.new_empty(x.shape[-1]) if need_dbias and bias is not None else placeholder(None, x)
    return x.new_empty(x.shape), dbias


@kernel_op("fusible_ops::scaled_swiglu_fwd", mutates_args=())
def _scaled_swiglu_fwd_op(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return _act_fwd_launch(x, None, scales, "swiglu", 0.0, None)


@_scaled_swiglu_fwd_op.register_fake
def _(x, scales):
    check_scales(x, scales)
    return x.new_empty((*x.shape[:-1], out_cols(x, True)))


@kernel_op("fusible_ops::scaled_swiglu_bwd", mutates_args=())
def _scaled_swiglu_bwd_op(
    dy: torch.Tensor, x: torch.Tensor, scales: torch.Tensor, need_dscales: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dx, dscales); dscales is an empty tensor when not needed."""
    dx, _, dscales = _act_bwd_launch(dy, x, None, scales, "swiglu", False, need_dscales, 0.0, None)
    return dx, placeholder(dscales, x)


@_scaled_swiglu_bwd_op.register_fake
def _(dy, x, scales, need_dscales):
    check_scales(x, scales)
    return x.new_empty(x.shape), (scales.new_empty(scales.shape) if need_dscales else placeholder(None, x))


# ----------------------------------------------------------------------------- public API


def bias_act_fwd(
    x: torch.Tensor, bias: Optional[torch.Tensor], kind: str, *, dropout_p: float = 0.0,
    seed: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``y = dropout(act(x + bias))``.

    x: ``[..., N]`` any leading dims and strides, fp16/bf16/fp32 (fp64 on the ref path).
    bias: ``[N]`` or None, any float dtype (e.g. fp32 with bf16 x). kind: one of
    :data:`ACTIVATIONS`. Returns y ``[..., N]`` (``[..., N/2]`` for :data:`GATED` kinds,
    act on the first half times the second half), contiguous, x's dtype. Math in fp32.
    With ``dropout_p > 0``, ``seed`` (an int64 tensor with one element, read on the device; see
    :mod:`fusible_ops.kernels.dropout`) is required and the mask is
    ``dropout_keep_mask(y.shape, dropout_p, seed)`` (the contract on y's ``[rows, cols]`` view);
    y is multiplied by ``1 / (1 - dropout_p)`` where kept and by 0 where dropped. NaN/Inf in z
    give what torch's activation (and dropout) give, forward and backward.
    """
    if seed is not None or dropout_p != 0.0:  # (no dropout: nothing to check; shapes and kind: checked
        seed = kernel_seed(dropout_p, seed, x.device)  # once per shape by the launcher)
    if use_triton(x, bias):
        return _bias_act_fwd_op(x, bias, kind, float(dropout_p), seed)
    return bias_act_fwd_ref(x, bias, kind, dropout_p=dropout_p, seed=seed)


def bias_act_fwd_fp8(
    x: torch.Tensor, bias: Optional[torch.Tensor], kind: str, *, amax: torch.Tensor, dropout_p: float = 0.0,
    seed: Optional[torch.Tensor] = None, scale: Optional[torch.Tensor] = None,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
):
    """:func:`bias_act_fwd` whose one pass also serves an FP8 consumer (eager calls; see
    :func:`fusible_ops.kernels.fp8_cast.fp8_epilogue`). ``amax`` (fp32 [1]) is raised to ``max|y|``.
    Without ``scale`` (current scaling) returns y as :func:`bias_act_fwd` does: the cast that
    follows needs no reduction pass. With ``scale`` (fp32 [1], delayed scaling) returns the FP8
    bytes q [rows, n_out] of y (rounded to x's dtype first, exactly as a cast of
    :func:`bias_act_fwd`'s y); y itself is never written."""
    seed = kernel_seed(dropout_p, seed, x.device)
    if use_triton(x, bias):
        fp8 = (2, fp8_dtype) if scale is not None else (1, None)
        return _act_fwd_launch(x, bias, None, kind, float(dropout_p), seed, fp8, scale, amax)
    y = bias_act_fwd_ref(x, bias, kind, dropout_p=dropout_p, seed=seed)
    return fp8_epilogue_ref(y, amax, scale, fp8_dtype)


def bias_act_bwd(
    dy: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor], kind: str, need_dbias: bool,
    *, dropout_p: float = 0.0, seed: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gradient of :func:`bias_act_fwd` w.r.t. ``z = x + bias`` (= dL/dx) and bias.

    dy: shape of the forward's y (any strides); x: the SAVED pre-bias input; z and the
    dropout mask are recomputed from (bias, dropout_p, seed). Returns ``(dz, dbias)``:
    dz has x's shape and dtype (contiguous); dbias = dz summed over all leading dims with
    fp32 accumulation (of the unrounded fp32 dz), in bias.dtype, or None when
    ``need_dbias`` is False or bias is None. The Triton path computes dz and the bias
    column sums in one pass (deterministic, no atomics).
    """
    if seed is not None or dropout_p != 0.0:  # (no dropout: nothing to check)
        seed = kernel_seed(dropout_p, seed, x.device)
    need_dbias = bool(need_dbias) and bias is not None
    if use_triton(dy, x, bias):
        dz, dbias = _bias_act_bwd_op(dy, x, bias, kind, need_dbias, float(dropout_p), seed)
        return dz, (dbias if need_dbias else None)
    return bias_act_bwd_ref(dy, x, bias, kind, need_dbias, dropout_p=dropout_p, seed=seed)


def bias_act_bwd_amax(
    dy: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor], kind: str, need_dbias: bool,
    *, amax: torch.Tensor, dropout_p: float = 0.0, seed: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`bias_act_bwd` (eager calls) whose pass also raises ``amax`` (fp32 [1]) to ``max|dz|``
    of the stored dz: an FP8 cast of dz for the preceding linear then needs no reduction pass."""
    seed = kernel_seed(dropout_p, seed, x.device)
    need_dbias = bool(need_dbias) and bias is not None
    if use_triton(dy, x, bias):
        dz, dbias, _ = _act_bwd_launch(dy, x, bias, None, kind, need_dbias, False, float(dropout_p), seed, amax)
        return dz, dbias
    dz, dbias = bias_act_bwd_ref(dy, x, bias, kind, need_dbias, dropout_p=dropout_p, seed=seed)
    fp8_epilogue_ref(dz, amax)
    return dz, dbias


def scaled_swiglu_fwd(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``y = swiglu(x) * scales[..., None]`` (e.g. MoE router weights folded in).

    x: ``[..., 2H]`` any strides, fp16/bf16/fp32; scales: ``x.shape[:-1]``, any float
    dtype. Returns y ``[..., H]`` contiguous in x's dtype; math in fp32.
    """
    if use_triton(x, scales):  # (shapes: checked once per shape by the launcher)
        return _scaled_swiglu_fwd_op(x, scales)
    return scaled_swiglu_fwd_ref(x, scales)


def scaled_swiglu_bwd(
    dy: torch.Tensor, x: torch.Tensor, scales: torch.Tensor, need_dscales: bool
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gradient of :func:`scaled_swiglu_fwd`.

    dy: ``[..., H]``; returns ``(dx, dscales)``: dx ``[..., 2H]`` in x's dtype;
    ``dscales[r] = sum_j dy[r, j] * swiglu(x)[r, j]`` accumulated in fp32, in
    scales.dtype with scales' shape, or None when ``need_dscales`` is False.
    """
    if use_triton(dy, x, scales):
        dx, dscales = _scaled_swiglu_bwd_op(dy, x, scales, bool(need_dscales))
        return dx, (dscales if need_dscales else None)
    return scaled_swiglu_bwd_ref(dy, x, scales, need_dscales)


__all__ = [
    "ACTIVATIONS",
    "GATED",
    "bias_act_bwd",
    "bias_act_bwd_ref",
    "bias_act_fwd",
    "bias_act_bwd_amax",
    "bias_act_fwd_fp8",
    "bias_act_fwd_ref",
    "scaled_swiglu_bwd",
    "scaled_swiglu_bwd_ref",
    "scaled_swiglu_fwd",
    "scaled_swiglu_fwd_ref",
]
