"""LayerNorm and RMSNorm over the last dimension, with an optional fused residual add.

Layout: one forward and one backward ``@triton.jit`` kernel (constexpr flags select the variants
below; built from the small jit helpers in :mod:`.norm_jit`), launchers, custom ops ``fusible_ops::{layernorm,rmsnorm}_{fwd,bwd}``
with fakes, the ``*_ref`` twins (in :mod:`.norm_ref`, re-exported), public functions.

Math (fp32 inside the kernels for every input dtype; results cast back):

* forward: ``xsum = x + residual`` (rounded to ``x.dtype`` and written) or ``xsum = x``;
  LayerNorm ``y = (xsum - mean) * rstd * weight + bias`` with ``rstd = 1/sqrt(var + eps)``
  (biased variance); RMSNorm ``y = xsum * rstd * weight`` with ``rstd = 1/sqrt(mean(xsum^2) + eps)``.
  The normalization reads the *rounded* ``xsum``, so ``y`` is exactly the norm of the returned sum.
* backward: ``xhat = (xsum - mean) * rstd``, ``g = dy * weight``;
  LayerNorm ``dx = rstd * (g - xhat * mean(g * xhat) - mean(g))``,
  RMSNorm ``dx = rstd * (g - xhat * mean(g * xhat))``;
  ``dweight = sum_rows(dy * xhat)``, ``dbias = sum_rows(dy)``. Row partials of ``dweight``/``dbias``
  go to a ``[num_programs, N]`` fp32 buffer that one more kernel sums in a fixed order (and casts to
  the parameter's dtype): deterministic, no atomics.

Configs (explicit, in :mod:`.norm_config`; register use checked for
sm_90): rows of up to ``_FWD_MAX_FUSED_N`` / ``_BWD_MAX_FUSED_N`` columns are held in registers
(several rows per program when N is small). Forward variants: whole rows, or ``LOOP`` (wider
rows, or rows wider than ``_FWD_NORES_MAX_FUSED_N`` without residual: statistics pass, then
output pass). Backward variants (``VARIANT``): ``"fused"`` (a persistent loop over row tiles;
narrower rows ``PREFETCH`` each tile's loads one iteration early where the config chooses it, see
``norm_config._bwd_choice``; rows >= ``_BWD_RELOAD_MIN_N`` re-load xsum/dy for dx, ``RELOAD``; rows
>= ``_BWD_DB_COLSUM_MIN_N``: dbias a separate fp32 column sum of dy) and ``"sliced"`` (wider rows:
column slices x row programs). Row lengths and strides that are multiples of 8 but not 16 reach
the kernels as such (``ALIGN``, :func:`~.launch.row_align`). Inputs need a unit stride on the
last dim (else copied); outputs are fresh and contiguous.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import HAS_TRITON, interpreter_enabled, use_triton
from .fp8_cast import FP8_MAX_OF, fp8_epilogue_ref
from . import norm_config as cfg
from .launch import (TRITON_DTYPES, DirectKernel, as_rows, cast_to, cdiv, contiguous_or, geometry_cache, kernel_op,
                     num_sms, placeholder, remember, row_align)
from .partials import partials_buffer, sum_partials, sum_partials_pair
from .norm_ref import (  # noqa: F401  (re-exported: one module to import)
    layernorm_bwd_ref,
    layernorm_fwd_ref,
    rmsnorm_bwd_ref,
    rmsnorm_fwd_ref,
)


if HAS_TRITON:
    import triton
    import triton.language as tl

    from .fp8_cast import fp8_epilogue

    from .norm_jit import (acc_partials, affine, aligned, load_tile, load_xhat, load_xsum, row_ptrs, row_sums, store_dx,
                           store_partials, store_y, sum_pair, to_xhat)

    # ---- kernels

    @triton.jit
    def _norm_fwd_kernel(
        X, R,  # [n_rows, N] in: x, residual (HAS_RES); row strides stride_x/_r, unit column stride
        XS, Y,  # [n_rows, N] out: x + residual in x's dtype (HAS_RES), y; row strides stride_xs/_y
        W, B,  # [N]: weight (HAS_W), bias (HAS_B)
        MEAN, RSTD,  # [n_rows] fp32 out (MEAN written only when not IS_RMS)
        n_rows, N, stride_x, stride_r, stride_xs, stride_y, eps,
        Q, QSCALE, AMAX,  # FP8 output (see fp8_cast.fp8_epilogue; OUT_MODE 0: unused)
        IS_RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
        LOOP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        OUT_MODE: tl.constexpr, FMAX: tl.constexpr, SOFT_ROUND: tl.constexpr, ALIGN: tl.constexpr,
    ):
        N = aligned(N, ALIGN)  # (N and the row strides are multiples of ALIGN: row_align)
        stride_x = aligned(stride_x, ALIGN)
        stride_r = aligned(stride_r, ALIGN)
        stride_xs = aligned(stride_xs, ALIGN)
        stride_y = aligned(stride_y, ALIGN)
        if not LOOP:
            # One [BLOCK_M, BLOCK_N] tile per program: BLOCK_M whole rows (BLOCK_N >= N).
            rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = tl.arange(0, BLOCK_N)
            row_mask = rows < n_rows
            col_mask = cols < N
            mask = row_mask[:, None] & col_mask[None, :]
            rows64 = rows.to(tl.int64)[:, None]
            x = load_xsum(X, R, XS, rows64, cols[None, :], mask, stride_x, stride_r, stride_xs, HAS_RES, True)
            if IS_RMS:
                xc = x
            else:
                mean = tl.sum(x, axis=1) / N
                tl.store(MEAN + rows, mean, mask=row_mask)
                xc = tl.where(mask, x - mean[:, None], 0.0)
            var = tl.sum(xc * xc, axis=1) / N
            rstd = 1.0 / tl.sqrt(var + eps)
            tl.store(RSTD + rows, rstd, mask=row_mask)
            if OUT_MODE == 0:
                store_y(xc * rstd[:, None], W, B, Y, rows64, cols, mask, col_mask, stride_y, HAS_W, HAS_B, True)
            else:
                y = affine(xc * rstd[:, None], W, B, cols, col_mask, HAS_W, HAS_B, True)
                fp8_epilogue(y, mask, rows.to(tl.int64), cols.to(tl.int64), n_rows, N, Y, Q, QSCALE, AMAX,
                             OUT_MODE, FMAX, SOFT_ROUND)
        else:
            # One row per program, N > BLOCK_N: pass 1 accumulates the statistics block by block
            # (Chan's parallel mean/M2 combination for LayerNorm), pass 2 re-reads x (and residual;
            # mostly L2 hits) and writes xsum and y. xsum is never read back (no RAW hazard).
            row = tl.program_id(0)
            row64 = row.to(tl.int64)
            mean = 0.0
            m2 = 0.0
            count = 0.0
            for off in range(0, N, BLOCK_N):
                cols = off + tl.arange(0, BLOCK_N)
                mask = cols < N
                x = load_xsum(X, R, XS, row64, cols, mask, stride_x, stride_r, stride_xs, HAS_RES, False)
                if IS_RMS:
                    m2 += tl.sum(x * x, axis=0)
                else:
                    nb = tl.minimum(N - off, BLOCK_N).to(tl.float32)
                    mb = tl.sum(x, axis=0) / nb
                    d = tl.where(mask, x - mb, 0.0)
                    m2b = tl.sum(d * d, axis=0)
                    tot = count + nb
                    delta = mb - mean
                    mean += delta * (nb / tot)
                    m2 += m2b + delta * delta * (count * nb / tot)
                    count = tot
            rstd = 1.0 / tl.sqrt(m2 / N + eps)
            tl.store(RSTD + row, rstd)
            if not IS_RMS:
                tl.store(MEAN + row, mean)
            for off in range(0, N, BLOCK_N):
                cols = off + tl.arange(0, BLOCK_N)
                mask = cols < N
                x = load_xsum(X, R, XS, row64, cols, mask, stride_x, stride_r, stride_xs, HAS_RES, True)
                y = x * rstd if IS_RMS else (x - mean) * rstd
                if OUT_MODE == 0:
                    store_y(y, W, B, Y, row64, cols, mask, mask, stride_y, HAS_W, HAS_B, False)
                else:  # as a [1, BLOCK_N] tile
                    y = affine(y, W, B, cols, mask, HAS_W, HAS_B, False)
                    fp8_epilogue(y[None, :], mask[None, :], tl.zeros([1], tl.int64) + row64, cols.to(tl.int64),
                                 n_rows, N, Y, Q, QSCALE, AMAX, OUT_MODE, FMAX, SOFT_ROUND)

    @triton.jit
    def _norm_bwd_kernel(
        DY, XS,  # [n_rows, N] in: dy, xsum (the normalized input); row strides, unit column stride
        W,  # [N] weight (HAS_W)
        MEAN, RSTD,  # [n_rows] fp32 (MEAN read only when not IS_RMS)
        DXE, DX,  # [n_rows, N]: extra gradient of xsum (HAS_DXE), out dx
        DW_PART, DB_PART,  # [num_(row_)programs, N] fp32 out: partial dweight (NEED_DW), dbias (NEED_DB)
        n_rows, N, stride_dy, stride_xs, stride_dxe, stride_dx,
        IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_DXE: tl.constexpr,
        NEED_DW: tl.constexpr, NEED_DB: tl.constexpr,
        VARIANT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RELOAD: tl.constexpr,
        ALIGN: tl.constexpr, PREFETCH: tl.constexpr,
    ):
        N = aligned(N, ALIGN)  # (as in the forward)
        stride_dy = aligned(stride_dy, ALIGN)
        stride_xs = aligned(stride_xs, ALIGN)
        stride_dxe = aligned(stride_dxe, ALIGN)
        stride_dx = aligned(stride_dx, ALIGN)
        if VARIANT == "fused":
            # Persistent: program pid walks [BLOCK_M, BLOCK_N] row tiles pid, pid + P, ... and keeps
            # its dweight/dbias partials in registers, written once at the end (every program owns
            # >= 1 tile). RELOAD (wide rows): the row sums are taken from a first load of xsum/dy
            # whose values then die; dx and the partials use a second load (an L1/L2 hit), so that
            # only the dweight/dbias accumulators stay live across the row loop (no spills).
            pid = tl.program_id(0)
            nprog = tl.num_programs(0)
            cols = tl.arange(0, BLOCK_N)
            col_mask = cols < N
            if HAS_W and not RELOAD:
                w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
            dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            step = nprog * BLOCK_M
            if PREFETCH:  # each tile's loads go out one iteration early, before the previous tile's math
                xs_n, dy_n, mean_n, rstd_n = load_tile(XS, DY, MEAN, RSTD, pid * BLOCK_M + tl.arange(0, BLOCK_M), cols,
                                                       col_mask, n_rows, stride_xs, stride_dy, IS_RMS)
            for start in range(pid * BLOCK_M, n_rows, step):
                rows = start + tl.arange(0, BLOCK_M)
                row_mask = rows < n_rows
                mask = row_mask[:, None] & col_mask[None, :]
                rows64 = rows.to(tl.int64)[:, None]
                xs_p = XS + rows64 * stride_xs + cols[None, :]
                dy_p = DY + rows64 * stride_dy + cols[None, :]
                if PREFETCH:
                    xs_t, dy_t, mean, rstd = xs_n, dy_n, mean_n, rstd_n
                    xs_n, dy_n, mean_n, rstd_n = load_tile(XS, DY, MEAN, RSTD, rows + step, cols, col_mask, n_rows,
                                                           stride_xs, stride_dy, IS_RMS)
                else:
                    xs_t, dy_t, mean, rstd = load_tile(XS, DY, MEAN, RSTD, rows, cols, col_mask, n_rows, stride_xs,
                                                       stride_dy, IS_RMS)
                dy, xhat = to_xhat(xs_t, dy_t, mask, mean[:, None], rstd[:, None], IS_RMS)
                if HAS_W and RELOAD:
                    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
                g = dy * w[None, :] if HAS_W else dy
                if IS_RMS:
                    c1 = tl.sum(g * xhat, axis=1) / N
                    c2 = c1  # (unused)
                else:  # both row sums in one reduction (H200 LayerNorm [16384, 2048]: 100.5 -> 92.9 us)
                    c1, c2 = sum_pair(g * xhat, g, 1)
                    c1 = c1 / N
                    c2 = c2 / N
                if RELOAD:  # second load: a different cache hint keeps it from being merged with the first
                    dy, xhat = load_xhat(xs_p, dy_p, mask, mean[:, None], rstd[:, None], IS_RMS, "evict_first")
                    if HAS_W:
                        w = tl.load(W + cols, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
                    g = dy * w[None, :] if HAS_W else dy
                store_dx(g, xhat, c1[:, None], c2[:, None], rstd[:, None], DXE, DX, rows64, cols[None, :], mask,
                          stride_dxe, stride_dx, IS_RMS, HAS_DXE)
                dw_acc, db_acc = acc_partials(dw_acc, db_acc, dy, xhat, NEED_DW, NEED_DB)
            part = pid.to(tl.int64) * N + cols
            store_partials(DW_PART, DB_PART, part, dw_acc, db_acc, col_mask, NEED_DW, NEED_DB, True)
        else:  # "sliced"
            # Wide rows (N > BLOCK_N): grid (num_slices, num_row_programs). Program (s, p) walks rows
            # p, p + P, ...; per row it sums g*xhat and g over the WHOLE row in BLOCK_N chunks (the
            # num_slices programs of one row group run side by side, so these reads mostly hit L2),
            # then writes dx for its own column slice s and accumulates that slice's dweight/dbias
            # in registers. Every program computes the row sums in the same order: identical values.
            sl = tl.program_id(0)
            pid = tl.program_id(1)
            nprog = tl.num_programs(1)
            cols = sl * BLOCK_N + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            if HAS_W:
                w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
            dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for row in range(pid, n_rows, nprog):
                row64, xs_r, dy_r, mean, rstd = row_ptrs(DY, XS, MEAN, RSTD, row, stride_dy, stride_xs, IS_RMS)
                c1 = 0.0
                c2 = 0.0
                for off in range(0, N, BLOCK_N):
                    c1, c2 = row_sums(xs_r, dy_r, W, off + tl.arange(0, BLOCK_N), N, mean, rstd, c1, c2, HAS_W, "")
                c1 = c1 / N
                c2 = c2 / N
                dy, xhat = load_xhat(xs_r + cols, dy_r + cols, col_mask, mean, rstd, False, "evict_first")
                g = dy * w if HAS_W else dy
                store_dx(g, xhat, c1, c2, rstd, DXE, DX, row64, cols, col_mask, stride_dxe, stride_dx, IS_RMS, HAS_DXE)
                dw_acc, db_acc = acc_partials(dw_acc, db_acc, dy, xhat, NEED_DW, NEED_DB)
            part = pid.to(tl.int64) * N + cols
            store_partials(DW_PART, DB_PART, part, dw_acc, db_acc, col_mask, NEED_DW, NEED_DB, False)


# ---- launchers


def _fwd_outputs(x: torch.Tensor, residual: Optional[torch.Tensor], is_rms: bool, with_y: bool = True,
                 placeholder: bool = True):
    """Fresh (y, mean, rstd, xsum) of the forward (real or fake tensors): mean and rstd fp32 [rows]
    (RMSNorm: mean is rstd itself, a dtype carrier its callers drop); without residual, xsum is a
    [0] placeholder (the custom ops' results) or None (``placeholder=False``: eager calls); y
    None without ``with_y``."""
    rows = math.prod(x.shape[:-1])
    # (empty_like: a shape argument costs twice the host time of the allocation itself)
    y = torch.empty_like(x, memory_format=torch.contiguous_format) if with_y else None
    rstd = x.new_empty(rows, dtype=torch.float32)
    mean = rstd if is_rms else rstd.new_empty(rows)  # (RMSNorm: no mean; its callers drop this slot)
    if residual is not None:
        xsum = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        xsum = x.new_empty(0) if placeholder else None
    return y, mean, rstd, xsum


_GEOMETRY = geometry_cache()  # launch geometry per (direction, shapes, strides, dtypes, flags, device)


def _fwd_geometry(key, x, weight, bias, residual, is_rms, fp8):
    n = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    loop, block_m, block_n, warps = cfg._fwd_config(n, rows, residual is not None)
    meta = dict(IS_RMS=is_rms, HAS_RES=residual is not None, HAS_W=weight is not None, HAS_B=bias is not None,
                LOOP=loop, BLOCK_M=block_m, BLOCK_N=block_n, OUT_MODE=fp8[0],
                FMAX=FP8_MAX_OF.get(fp8[1], 448.0), SOFT_ROUND=interpreter_enabled(), ALIGN=row_align(n, x, residual),
                num_warps=warps)
    return remember(_GEOMETRY, key, (rows, n, (cdiv(rows, block_m),), meta))


_PLAIN = (0, None)  # fp8 output spec (OUT_MODE, fp8 dtype) of a plain call


def _norm_fwd_launch(x, weight, bias, eps, residual, is_rms, fp8=_PLAIN, qscale=None, amax=None):
    """Triton forward. Returns (y, mean, rstd, xsum): mean is rstd under RMSNorm, xsum None
    without residual.
    ``fp8``: as in :func:`fusible_ops.kernels.activation._act_fwd_launch`; OUT_MODE 2 returns the
    FP8 bytes q [rows, N] in place of y."""
    key = ("fwd", x.shape, x.stride(), x.dtype, x.device, _meta_of(weight), _meta_of(bias),
           None if residual is None else (residual.stride(), residual.dtype), is_rms, fp8)
    rows, n, grid, meta = _GEOMETRY.get(key) or _fwd_geometry(key, x, weight, bias, residual, is_rms, fp8)
    y, mean, rstd, xsum = _fwd_outputs(x, residual, is_rms, fp8[0] != 2, placeholder=False)
    mode, qdtype = fp8
    if mode == 2:
        y = torch.empty(rows, n, dtype=qdtype, device=x.device)
    if rows == 0:
        return y, mean, rstd, xsum
    if n == 0:  # statistics of an empty row, as torch computes them
        rstd.fill_(float("nan"))
        mean.fill_(float("nan"))
        return y, mean, rstd, xsum
    x2 = as_rows(x)
    r2 = as_rows(residual) if residual is not None else x2
    xs2 = (xsum if xsum.dim() == 2 else xsum.view(rows, n)) if residual is not None else x2
    y2 = (y if y.dim() == 2 else y.view(rows, n)) if mode != 2 else x2  # (mode 2: a dtype carrier)
    fp8_args = (y, qscale, amax) if mode == 2 else (y2, x2, amax if mode else x2)
    _FWD(grid, key, (x2, r2, xs2, y2, contiguous_or(weight, x2), contiguous_or(bias, x2),
                     mean if not is_rms else rstd, rstd,
                     rows, n, x2.stride(0), r2.stride(0), xs2.stride(0), y2.stride(0), float(eps), *fp8_args), meta)
    return y, mean, rstd, xsum


def _bwd_geometry(key, dy, xsum, is_rms, need_dweight, need_dbias, has_w, dxsum_extra):
    has_dxe = dxsum_extra is not None
    n = xsum.shape[-1]
    rows = math.prod(xsum.shape[:-1])
    if rows == 0 or n == 0:
        return remember(_GEOMETRY, key, (rows, n, None, None, 0, False, False))
    variant, block_m, block_n, warps, per_sm, prefetch = cfg._bwd_config(n, rows, is_rms, has_dxe)
    sliced = variant == "sliced"
    sms = num_sms(xsum.device)
    if sliced:  # grid (slices, row programs); the slices of one row group run side by side
        n_slices = cdiv(n, block_n)
        nprog = min(rows, max(1, 2 * sms // n_slices))
        grid = (n_slices, nprog)
    else:
        nprog = min(cdiv(rows, block_m), sms * per_sm)
        grid = (nprog,)
    db_colsum = need_dbias and not sliced and n >= cfg._BWD_DB_COLSUM_MIN_N
    meta = dict(IS_RMS=is_rms, HAS_W=has_w, HAS_DXE=has_dxe, NEED_DW=need_dweight, NEED_DB=need_dbias and not db_colsum,
                VARIANT=variant, BLOCK_M=block_m, BLOCK_N=block_n, RELOAD=n >= cfg._BWD_RELOAD_MIN_N,
                ALIGN=row_align(n, dy, xsum, dxsum_extra),
                PREFETCH=prefetch, num_warps=warps)
    return remember(_GEOMETRY, key, (rows, n, grid, meta, nprog, db_colsum, meta["NEED_DB"]))


def _pdtype(xsum: torch.Tensor, weight: Optional[torch.Tensor]) -> torch.dtype:
    """The dtype of dweight / dbias: the weight's (xsum's without a weight)."""
    return weight.dtype if weight is not None else xsum.dtype


def _norm_bwd_launch(dy, xsum, weight, mean, rstd, need_dweight, need_dbias, dxsum_extra, is_rms):
    """Triton backward. Returns (dx, dweight, dbias), None for what is not needed (the custom ops
    put [0] placeholders there)."""
    pdtype = _pdtype(xsum, weight)
    need_dweight = bool(need_dweight) and weight is not None
    need_dbias = bool(need_dbias)
    key = ("bwd", dy.stride(), xsum.shape, xsum.stride(), xsum.dtype, dy.dtype, xsum.device, _meta_of(weight),
           None if dxsum_extra is None else (dxsum_extra.stride(), dxsum_extra.dtype), is_rms, need_dweight, need_dbias)
    geo = _GEOMETRY.get(key) or _bwd_geometry(key, dy, xsum, is_rms, need_dweight, need_dbias, weight is not None,
                                              dxsum_extra)
    rows, n, grid, meta, nprog, db_colsum, need_db_kernel = geo
    dx = torch.empty_like(xsum, memory_format=torch.contiguous_format)
    if grid is None:
        dw = xsum.new_zeros(n, dtype=pdtype) if need_dweight else None
        db = xsum.new_zeros(n, dtype=pdtype) if need_dbias else None
        return dx, dw, db  # dx is empty; the sums over no rows are zeros
    dy2 = as_rows(dy)
    xs2 = as_rows(xsum)
    dxe2 = as_rows(dxsum_extra) if dxsum_extra is not None else dy2
    dx2 = dx if dx.dim() == 2 else dx.view(rows, n)
    dw_part = partials_buffer(xs2, nprog, n, 0) if need_dweight else dx2
    db_part = partials_buffer(xs2, nprog, n, 1) if need_db_kernel else dx2
    rstd = contiguous_or(rstd, rstd)
    mean = rstd if is_rms else contiguous_or(mean, mean)
    _BWD(grid, key, (dy2, xs2, contiguous_or(weight, xs2), mean, rstd, dxe2, dx2, dw_part, db_part, rows, n,
                     dy2.stride(0), xs2.stride(0), dxe2.stride(0), dx2.stride(0)), meta)
    if need_dweight and need_db_kernel:  # both partial sums in one launch
        dw, db = sum_partials_pair(dw_part, db_part, pdtype)
    else:
        dw = sum_partials(dw_part, pdtype) if need_dweight else None
        db = sum_partials(db_part, pdtype) if need_db_kernel else None
    if db_colsum:  # fp32 accumulation, deterministic (torch reductions use no atomics)
        db = cast_to(dy2.sum(0, dtype=torch.float32), pdtype)
    return dx, dw, db


def _meta_of(t: Optional[torch.Tensor]):
    return None if t is None else (t.shape, t.dtype, t.is_contiguous())


if HAS_TRITON:
    _FWD = DirectKernel(_norm_fwd_kernel)
    _BWD = DirectKernel(_norm_bwd_kernel)


if HAS_TRITON:

    def _layernorm_fwd_eager(x, weight, bias, eps, residual):
        return _norm_fwd_launch(x, weight, bias, eps, residual, False)

    @kernel_op("fusible_ops::layernorm_fwd", mutates_args=(), eager=_layernorm_fwd_eager)
    def _layernorm_fwd_op(
        x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float,
        residual: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        y, mean, rstd, xsum = _norm_fwd_launch(x, weight, bias, eps, residual, False)
        return y, mean, rstd, placeholder(xsum, x)

    @_layernorm_fwd_op.register_fake
    def _(x, weight, bias, eps, residual):
        return _fwd_outputs(x, residual, False)

    def _rmsnorm_fwd_eager(x, weight, eps, residual):
        y, _, rstd, xsum = _norm_fwd_launch(x, weight, None, eps, residual, True)
        return y, rstd, xsum

    @kernel_op("fusible_ops::rmsnorm_fwd", mutates_args=(), eager=_rmsnorm_fwd_eager)
    def _rmsnorm_fwd_op(
        x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, residual: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y, rstd, xsum = _rmsnorm_fwd_eager(x, weight, eps, residual)
        return y, rstd, placeholder(xsum, x)

    @_rmsnorm_fwd_op.register_fake
    def _(x, weight, eps, residual):
        y, _, rstd, xsum = _fwd_outputs(x, residual, True)
        return y, rstd, xsum

    def _fake_bwd(xsum, weight, need_dweight, need_dbias):
        pdtype = _pdtype(xsum, weight)
        n = xsum.shape[-1]
        dw = xsum.new_empty(n if (need_dweight and weight is not None) else 0, dtype=pdtype)
        db = xsum.new_empty(n if need_dbias else 0, dtype=pdtype)
        return xsum.new_empty(xsum.shape), dw, db

    def _layernorm_bwd_eager(dy, xsum, weight, mean, rstd, need_dweight, need_dbias, dxsum_extra):
        return _norm_bwd_launch(dy, xsum, weight, mean, rstd, need_dweight, need_dbias, dxsum_extra, False)

    @kernel_op("fusible_ops::layernorm_bwd", mutates_args=(), eager=_layernorm_bwd_eager)
    def _layernorm_bwd_op(
        dy: torch.Tensor, xsum: torch.Tensor, weight: Optional[torch.Tensor], mean: torch.Tensor,
        rstd: torch.Tensor, need_dweight: bool, need_dbias: bool, dxsum_extra: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dx, dw, db = _layernorm_bwd_eager(dy, xsum, weight, mean, rstd, need_dweight, need_dbias, dxsum_extra)
        pdtype = _pdtype(xsum, weight)
        return dx, placeholder(dw, xsum, pdtype), placeholder(db, xsum, pdtype)

    @_layernorm_bwd_op.register_fake
    def _(dy, xsum, weight, mean, rstd, need_dweight, need_dbias, dxsum_extra):
        return _fake_bwd(xsum, weight, need_dweight, need_dbias)

    def _rmsnorm_bwd_eager(dy, xsum, weight, rstd, need_dweight, dxsum_extra):
        dx, dw, _ = _norm_bwd_launch(dy, xsum, weight, rstd, rstd, need_dweight, False, dxsum_extra, True)
        return dx, dw

    @kernel_op("fusible_ops::rmsnorm_bwd", mutates_args=(), eager=_rmsnorm_bwd_eager)
    def _rmsnorm_bwd_op(
        dy: torch.Tensor, xsum: torch.Tensor, weight: Optional[torch.Tensor], rstd: torch.Tensor,
        need_dweight: bool, dxsum_extra: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dx, dw = _rmsnorm_bwd_eager(dy, xsum, weight, rstd, need_dweight, dxsum_extra)
        return dx, placeholder(dw, xsum, _pdtype(xsum, weight))

    @_rmsnorm_bwd_op.register_fake
    def _(dy, xsum, weight, rstd, need_dweight, dxsum_extra):
        dx, dw, _ = _fake_bwd(xsum, weight, need_dweight, False)
        return dx, dw

# ---- the pure-torch ``*_ref`` twins live in norm_ref.py (imported at the top, re-exported)


# ---- public API


def _check(fn, x, residual=None, **params):
    if x.dim() == 0 or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"{fn}: x must be [..., N] and residual / dy (if given) of its shape")
    for name, p in params.items():
        if p is not None and tuple(p.shape) != (x.shape[-1],):
            raise ValueError(f"{fn}: {name} has shape {tuple(p.shape)}, expected ({x.shape[-1]},)")


def layernorm_fwd(x, weight, bias, eps, residual=None):
    """LayerNorm over the last dim, with an optional residual add fused in front.

    Args: ``x`` [..., N] fp32/fp16/bf16 (any strides); ``weight``, ``bias`` [N] or None, any float
    dtype (e.g. fp32 with bf16 x); ``eps`` float; ``residual`` None or the shape of ``x``.
    Returns ``(y, mean, rstd, xsum)``: ``xsum = x + residual`` rounded to ``x.dtype`` (a new
    contiguous tensor) or ``x`` itself (no copy) without residual; ``y = (xsum - mean) * rstd *
    weight + bias`` in ``x.dtype`` (contiguous, shape of x); ``mean``, ``rstd`` fp32 of shape
    [rows] (rows = numel / N), ``rstd = 1/sqrt(biased var + eps)``. All math in fp32.
    float64 inputs always take the reference path (float64 math and stats).
    """
    _check("layernorm_fwd", x, residual, weight=weight, bias=bias)
    return layernorm_fwd_unchecked(x, weight, bias, eps, residual)


def layernorm_fwd_unchecked(x, weight, bias, eps, residual=None):
    """:func:`layernorm_fwd` without its shape checks, for callers that made them (the norm ops)."""
    if x.dtype in TRITON_DTYPES and use_triton(x, weight, bias, residual):
        y, mean, rstd, xsum = _layernorm_fwd_op(x, weight, bias, float(eps), residual)
        return y, mean, rstd, (xsum if residual is not None else x)
    return layernorm_fwd_ref(x, weight, bias, eps, residual)


def layernorm_bwd(dy, xsum, weight, mean, rstd, need_dweight, need_dbias, dxsum_extra=None):
    """Backward of :func:`layernorm_fwd` with respect to ``xsum`` (hence x and residual).

    Args: ``dy``, ``xsum`` [..., N] (same shape); ``weight`` [N] or None; ``mean``, ``rstd`` [rows]
    from the forward; ``dxsum_extra`` None or a gradient of the shape of xsum that reaches xsum
    from elsewhere (added to dx, in fp32). Returns ``(dx, dweight, dbias)``: ``dx`` in
    ``xsum.dtype`` (contiguous), serving as gradient of both x and residual; ``dweight``/``dbias``
    [N] in the weight's dtype (``xsum.dtype`` when weight is None), reduced over rows in fp32 and
    deterministically, or None when not needed (then not computed; dweight is None if weight is).
    """
    _check("layernorm_bwd", xsum, dy, weight=weight)
    return layernorm_bwd_unchecked(dy, xsum, weight, mean, rstd, need_dweight, need_dbias, dxsum_extra)


def layernorm_bwd_unchecked(dy, xsum, weight, mean, rstd, need_dweight, need_dbias, dxsum_extra=None):
    """:func:`layernorm_bwd` without its shape checks, for callers whose ``dy`` has the forward
    output's shape (autograd checks that) and whose forward was checked (the norm ops)."""
    if xsum.dtype in TRITON_DTYPES and use_triton(dy, xsum, weight, mean, rstd, dxsum_extra):
        dx, dw, db = _layernorm_bwd_op(
            dy, xsum, weight, mean, rstd, bool(need_dweight), bool(need_dbias), dxsum_extra
        )
        return dx, (dw if need_dweight and weight is not None else None), (db if need_dbias else None)
    return layernorm_bwd_ref(dy, xsum, weight, mean, rstd, need_dweight, need_dbias, dxsum_extra)


def rmsnorm_fwd(x, weight, eps, residual=None):
    """RMSNorm over the last dim, with an optional residual add fused in front.

    Args as :func:`layernorm_fwd` (no bias). Returns ``(y, rstd, xsum)``: ``y = xsum * rstd *
    weight`` in ``x.dtype``; ``rstd = 1/sqrt(mean(xsum^2) + eps)`` fp32 [rows]; ``xsum`` as in
    :func:`layernorm_fwd` (``x`` itself without residual).
    """
    _check("rmsnorm_fwd", x, residual, weight=weight)
    return rmsnorm_fwd_unchecked(x, weight, eps, residual)


def rmsnorm_fwd_unchecked(x, weight, eps, residual=None):
    """:func:`rmsnorm_fwd` without its shape checks, for callers that made them (the norm ops)."""
    if x.dtype in TRITON_DTYPES and use_triton(x, weight, residual):
        y, rstd, xsum = _rmsnorm_fwd_op(x, weight, float(eps), residual)
        return y, rstd, (xsum if residual is not None else x)
    return rmsnorm_fwd_ref(x, weight, eps, residual)


def rmsnorm_bwd(dy, xsum, weight, rstd, need_dweight, dxsum_extra=None):
    """Backward of :func:`rmsnorm_fwd` with respect to ``xsum``; contract as :func:`layernorm_bwd`.

    Returns ``(dx, dweight)``: ``dx`` in ``xsum.dtype`` (plus ``dxsum_extra``), ``dweight`` [N] in
    the weight's dtype (fp32 accumulation, deterministic) or None when not needed.
    """
    _check("rmsnorm_bwd", xsum, dy, weight=weight)
    return rmsnorm_bwd_unchecked(dy, xsum, weight, rstd, need_dweight, dxsum_extra)


def rmsnorm_bwd_unchecked(dy, xsum, weight, rstd, need_dweight, dxsum_extra=None):
    """:func:`rmsnorm_bwd` without its shape checks (callers as :func:`layernorm_bwd_unchecked`)."""
    if xsum.dtype in TRITON_DTYPES and use_triton(dy, xsum, weight, rstd, dxsum_extra):
        dx, dw = _rmsnorm_bwd_op(dy, xsum, weight, rstd, bool(need_dweight), dxsum_extra)
        return dx, (dw if need_dweight and weight is not None else None)
    return rmsnorm_bwd_ref(dy, xsum, weight, rstd, need_dweight, dxsum_extra)


def norm_fwd_fp8(x, weight, bias, eps, residual=None, *, is_rms: bool, amax: torch.Tensor,
                 scale: Optional[torch.Tensor] = None, fp8_dtype: torch.dtype = torch.float8_e4m3fn):
    """:func:`layernorm_fwd` (``is_rms=False``) or :func:`rmsnorm_fwd` (``bias`` None) whose one pass
    also serves an FP8 consumer, as :func:`fusible_ops.kernels.activation.bias_act_fwd_fp8`:
    returns ``(out, mean, rstd, xsum)`` (mean None for RMSNorm) with ``out`` y (``amax`` raised to
    max|y|) without ``scale``, else the FP8 bytes q [rows, N] (y is never written)."""
    fn = "rmsnorm_fwd" if is_rms else "layernorm_fwd"
    _check(fn, x, residual, weight=weight, bias=bias)
    if x.dtype in TRITON_DTYPES and use_triton(x, weight, bias, residual):
        fp8 = (2, fp8_dtype) if scale is not None else (1, None)
        out, mean, rstd, xsum = _norm_fwd_launch(x, weight, bias, float(eps), residual, is_rms, fp8, scale, amax)
        return out, (None if is_rms else mean), rstd, (xsum if residual is not None else x)
    if is_rms:
        y, rstd, xsum = rmsnorm_fwd_ref(x, weight, eps, residual)
        mean = None
    else:
        y, mean, rstd, xsum = layernorm_fwd_ref(x, weight, bias, eps, residual)
    return fp8_epilogue_ref(y, amax, scale, fp8_dtype), mean, rstd, xsum


__all__ = [
    "layernorm_bwd", "layernorm_bwd_ref", "layernorm_bwd_unchecked", "layernorm_fwd", "layernorm_fwd_ref",
    "layernorm_fwd_unchecked", "norm_fwd_fp8", "rmsnorm_bwd", "rmsnorm_bwd_ref", "rmsnorm_bwd_unchecked",
    "rmsnorm_fwd", "rmsnorm_fwd_ref", "rmsnorm_fwd_unchecked",
]
