"""LayerNorm and RMSNorm over the last dimension, with an optional fused residual add.

Layout: ``@triton.jit`` kernels, then launchers (registered as ``torch.library`` custom ops
``fusible_ops::{layernorm,rmsnorm}_{fwd,bwd}``), then the pure-torch ``*_ref`` twins, then the
public functions, which dispatch with :func:`fusible_ops.kernels.use_triton`.

Math (fp32 inside the kernels for every input dtype; results cast back):

* forward: ``xsum = x + residual`` (rounded to ``x.dtype`` and written) or ``xsum = x``;
  LayerNorm ``y = (xsum - mean) * rstd * weight + bias`` with ``rstd = 1/sqrt(var + eps)``
  (biased variance); RMSNorm ``y = xsum * rstd * weight`` with ``rstd = 1/sqrt(mean(xsum^2) + eps)``.
  The normalization reads the *rounded* ``xsum``, so ``y`` is exactly the norm of the returned sum.
* backward: ``xhat = (xsum - mean) * rstd``, ``g = dy * weight``;
  LayerNorm ``dx = rstd * (g - xhat * mean(g * xhat) - mean(g))``,
  RMSNorm ``dx = rstd * (g - xhat * mean(g * xhat))``;
  ``dweight = sum_rows(dy * xhat)``, ``dbias = sum_rows(dy)``. Row partials of ``dweight``/``dbias``
  go to a ``[num_programs, N]`` fp32 buffer that torch then sums: deterministic, no atomics.

Kernel configs (explicit, see ``_fwd_config`` / ``_bwd_config``; register use checked with ptxas
for sm_90 at <= 128 registers and no spills): rows of up to ``_FWD_MAX_FUSED_N`` (forward) /
``_BWD_MAX_FUSED_N`` (backward) columns are held in registers as one block, several rows per
program when N is small (~``_TILE`` elements per program). Wider forward rows (and, without a
residual, rows wider than ``_FWD_NORES_MAX_FUSED_N``) loop over column blocks (pass 1 statistics,
pass 2 output; the re-read mostly hits L2). Backward rows wider than ``_BWD_RELOAD_MIN_N`` load
xsum/dy twice (row sums, then dx and the partials) so only the partials stay live in registers;
for LayerNorm such rows (``>= _BWD_HALVES_MIN_N``) take the halves kernel (re-load half a row at a
time) and dbias is a separate fp32 column sum of dy (``>= _BWD_DB_COLSUM_MIN_N``), so only the
dweight partials stay live.
Wider backward rows use a
grid of (column slices x row programs): each program sums over the whole row, then writes dx and
accumulates dweight/dbias for its own slice only.
Inputs only need a unit stride on the last dimension; anything else is copied by ``.contiguous()``
in the launcher. Outputs are freshly allocated, contiguous.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch

from . import HAS_TRITON, use_triton

_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# ---- configuration (explicit and small; tests shrink the thresholds to exercise the wide-row kernels)
_TILE = 2048  # elements per program tile when N is small (rows per program = _TILE // BLOCK_N)
_FWD_MAX_FUSED_N = 16384  # forward: widest row held in registers as one block (32 warps)
_FWD_NORES_MAX_FUSED_N = 8192  # forward without residual: wider rows take the loop kernel (faster:
# H200, [16384, 16384] bf16: 0.39 ms loop vs 0.66 ms fused; with residual the fused one wins)
_FWD_LOOP_BLOCK_N = 8192  # forward, wider rows: column block of the two-pass loop kernel
_BWD_MAX_FUSED_N = 16384  # backward: widest row held in registers with its dweight/dbias partials
_BWD_SLICE_N = 8192  # backward, wider rows: column slice per program of the sliced kernel
_FWD_WARPS_CAP = 32  # forward: most warps per program of the fused kernel
_FWD_LOOP_WARPS = 16  # forward loop kernel warps (0: BLOCK_N // 256, at least 4)
_BWD_WARPS_CAP = 16  # backward: most warps per program of the fused kernel
_BWD_SLICE_WARPS = 16  # backward sliced kernel: most warps per program
_BWD_RELOAD_MIN_N = 8193  # backward fused: re-load xsum/dy (L1/L2 hit) for dx instead of keeping
# them live (H200, [16384, 16384] bf16 LayerNorm: 0.97 ms vs 2.56 ms for the old 4096-wide slices)
_BWD_PROGS_PER_SM = 0  # backward fused: persistent programs per SM (0: 32 // num_warps)
_BWD_HALVES_MIN_N = 8193  # LayerNorm backward, n >= this (and <= _BWD_MAX_FUSED_N): halves kernel
_BWD_HALVES_WARPS = 16  # backward halves kernel: warps per program
# H200, [16384, 16384] bf16 LayerNorm bwd: 0.983 ms fused RELOAD -> 0.838 colsum -> 0.816 ms colsum +
# halves (16 warps, 2/SM); RMSNorm keeps the fused RELOAD kernel (0.600 ms vs 0.643 ms with halves)
_BWD_DB_COLSUM_MIN_N = 8193  # backward fused, n >= this: dbias is a separate fp32 column sum of
# dy (torch), so the kernel keeps only the dweight partials live (LayerNorm then fits 2 programs/SM)

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _norm_fwd_fused_kernel(
        X, R,  # [n_rows, N] in: x, residual (HAS_RES); row strides stride_x/_r, unit column stride
        XS, Y,  # [n_rows, N] out: x + residual in x's dtype (HAS_RES), y; row strides stride_xs/_y
        W, B,  # [N]: weight (HAS_W), bias (HAS_B)
        MEAN, RSTD,  # [n_rows] fp32 out (MEAN written only when not IS_RMS)
        n_rows, N, stride_x, stride_r, stride_xs, stride_y, eps,
        IS_RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        # One [BLOCK_M, BLOCK_N] tile per program: BLOCK_M whole rows (BLOCK_N >= N).
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        row_mask = rows < n_rows
        col_mask = cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(R + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            xs = (x + r).to(XS.dtype.element_ty)
            tl.store(XS + rows64[:, None] * stride_xs + cols[None, :], xs, mask=mask)
            x = xs.to(tl.float32)
        if IS_RMS:
            xc = x
        else:
            mean = tl.sum(x, axis=1) / N
            tl.store(MEAN + rows, mean, mask=row_mask)
            xc = tl.where(mask, x - mean[:, None], 0.0)
        var = tl.sum(xc * xc, axis=1) / N
        rstd = 1.0 / tl.sqrt(var + eps)
        tl.store(RSTD + rows, rstd, mask=row_mask)
        y = xc * rstd[:, None]
        if HAS_W:
            y = y * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_B:
            y = y + tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _norm_fwd_loop_kernel(
        X, R,  # [n_rows, N] in: x, residual (HAS_RES); row strides stride_x/_r, unit column stride
        XS, Y,  # [n_rows, N] out: x + residual in x's dtype (HAS_RES), y; row strides stride_xs/_y
        W, B,  # [N]: weight (HAS_W), bias (HAS_B)
        MEAN, RSTD,  # [n_rows] fp32 out (MEAN written only when not IS_RMS)
        n_rows, N, stride_x, stride_r, stride_xs, stride_y, eps,
        IS_RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # One row per program, N > BLOCK_N: pass 1 accumulates the statistics block by block
        # (Chan's parallel mean/M2 combination for LayerNorm), pass 2 re-reads x (and residual;
        # mostly L2 hits) and writes xsum and y. xsum is never read back (no RAW hazard).
        row = tl.program_id(0)
        row64 = row.to(tl.int64)
        x_row = X + row64 * stride_x
        r_row = R + row64 * stride_r
        mean = 0.0
        m2 = 0.0
        count = 0.0
        for off in range(0, N, BLOCK_N):
            cols = off + tl.arange(0, BLOCK_N)
            mask = cols < N
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_RES:
                r = tl.load(r_row + cols, mask=mask, other=0.0).to(tl.float32)
                x = (x + r).to(XS.dtype.element_ty).to(tl.float32)
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
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_RES:
                r = tl.load(r_row + cols, mask=mask, other=0.0).to(tl.float32)
                xs = (x + r).to(XS.dtype.element_ty)
                tl.store(XS + row64 * stride_xs + cols, xs, mask=mask)
                x = xs.to(tl.float32)
            y = x * rstd if IS_RMS else (x - mean) * rstd
            if HAS_W:
                y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_B:
                y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(Y + row64 * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _norm_bwd_fused_kernel(
        DY, XS,  # [n_rows, N] in: dy, xsum (the normalized input); row strides, unit column stride
        W,  # [N] weight (HAS_W)
        MEAN, RSTD,  # [n_rows] fp32 (MEAN read only when not IS_RMS)
        DXE, DX,  # [n_rows, N]: extra gradient of xsum (HAS_DXE), out dx
        DW_PART, DB_PART,  # [num_programs, N] fp32 out: partial dweight (NEED_DW), dbias (NEED_DB)
        n_rows, N, stride_dy, stride_xs, stride_dxe, stride_dx,
        IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_DXE: tl.constexpr,
        NEED_DW: tl.constexpr, NEED_DB: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RELOAD: tl.constexpr,
    ):
        # RELOAD (wide rows): the row sums are taken from a first load of xsum/dy whose values then
        # die; dx and the partials use a second load (an L1/L2 hit), so that only the dweight/dbias
        # accumulators stay live across the row loop (fewer registers, no spills).
        # Persistent: program pid walks row tiles pid, pid + P, ... and keeps its dweight/dbias
        # partials in registers, written once at the end (every program owns >= 1 tile).
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        if HAS_W and not RELOAD:
            w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(pid * BLOCK_M, n_rows, nprog * BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            row_mask = rows < n_rows
            mask = row_mask[:, None] & col_mask[None, :]
            rows64 = rows.to(tl.int64)
            xs_p = XS + rows64[:, None] * stride_xs + cols[None, :]
            dy_p = DY + rows64[:, None] * stride_dy + cols[None, :]
            xs = tl.load(xs_p, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            dy = tl.load(dy_p, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            if IS_RMS:
                mean = tl.zeros([BLOCK_M], dtype=tl.float32)
                xhat = xs * rstd[:, None]
            else:
                mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
                xhat = tl.where(mask, (xs - mean[:, None]) * rstd[:, None], 0.0)
            if HAS_W and RELOAD:
                w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
            g = dy * w[None, :] if HAS_W else dy
            c1 = tl.sum(g * xhat, axis=1) / N
            c2 = tl.sum(g, axis=1) / N
            if RELOAD:  # second load: a different cache hint keeps it from being merged with the first
                xs = tl.load(xs_p, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
                dy = tl.load(dy_p, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
                if IS_RMS:
                    xhat = xs * rstd[:, None]
                else:
                    xhat = tl.where(mask, (xs - mean[:, None]) * rstd[:, None], 0.0)
                if HAS_W:
                    w = tl.load(W + cols, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
                g = dy * w[None, :] if HAS_W else dy
            dx = g - xhat * c1[:, None]
            if not IS_RMS:
                dx -= c2[:, None]
            dx = dx * rstd[:, None]
            if HAS_DXE:
                dx += tl.load(DXE + rows64[:, None] * stride_dxe + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
            if NEED_DW:
                dw_acc += dy * xhat
            if NEED_DB:
                db_acc += dy
        part = pid.to(tl.int64) * N + cols
        if NEED_DW:
            tl.store(DW_PART + part, tl.sum(dw_acc, axis=0), mask=col_mask)
        if NEED_DB:
            tl.store(DB_PART + part, tl.sum(db_acc, axis=0), mask=col_mask)

    @triton.jit
    def _norm_bwd_halves_kernel(
        DY, XS,  # [n_rows, N] in: dy, xsum (the normalized input); row strides, unit column stride
        W,  # [N] weight (HAS_W)
        MEAN, RSTD,  # [n_rows] fp32 (MEAN read only when not IS_RMS)
        DXE, DX,  # [n_rows, N]: extra gradient of xsum (HAS_DXE), out dx
        DW_PART, DB_PART,  # [num_programs, N] fp32 out: partial dweight (NEED_DW), dbias (NEED_DB)
        n_rows, N, stride_dy, stride_xs, stride_dxe, stride_dx,
        IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_DXE: tl.constexpr,
        NEED_DW: tl.constexpr, NEED_DB: tl.constexpr,
        HALF_N: tl.constexpr,
    ):
        # Persistent, one row at a time, N <= 2 * HALF_N: the row sums come from both halves
        # (values die), then each half is re-loaded (L1/L2 hit) for dx and its own partials, so
        # only the partials plus one half's loads are live (fewer registers than the fused RELOAD).
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        c0 = tl.arange(0, HALF_N)
        c1s = HALF_N + c0
        m0 = c0 < N
        m1 = c1s < N
        dw0 = tl.zeros([HALF_N], dtype=tl.float32)
        dw1 = tl.zeros([HALF_N], dtype=tl.float32)
        db0 = tl.zeros([HALF_N], dtype=tl.float32)
        db1 = tl.zeros([HALF_N], dtype=tl.float32)
        for row in range(pid, n_rows, nprog):
            row64 = tl.cast(row, tl.int64)
            xs_r = XS + row64 * stride_xs
            dy_r = DY + row64 * stride_dy
            rstd = tl.load(RSTD + row)
            if IS_RMS:
                mean = 0.0
            else:
                mean = tl.load(MEAN + row)
            c1 = 0.0
            c2 = 0.0
            for h in tl.static_range(2):
                cc = c0 + h * HALF_N
                cm = cc < N
                xs_c = tl.load(xs_r + cc, mask=cm, other=0.0, eviction_policy="evict_last").to(tl.float32)
                dy_c = tl.load(dy_r + cc, mask=cm, other=0.0, eviction_policy="evict_last").to(tl.float32)
                xhat_c = tl.where(cm, (xs_c - mean) * rstd, 0.0)
                g_c = dy_c * tl.load(W + cc, mask=cm, other=0.0).to(tl.float32) if HAS_W else dy_c
                c1 += tl.sum(g_c * xhat_c, axis=0)
                c2 += tl.sum(g_c, axis=0)
            c1 = c1 / N
            c2 = c2 / N
            for h in tl.static_range(2):
                cc = c0 + h * HALF_N
                cm = cc < N
                xs_c = tl.load(xs_r + cc, mask=cm, other=0.0, eviction_policy="evict_first").to(tl.float32)
                dy_c = tl.load(dy_r + cc, mask=cm, other=0.0, eviction_policy="evict_first").to(tl.float32)
                xhat_c = tl.where(cm, (xs_c - mean) * rstd, 0.0)
                if HAS_W:
                    g_c = dy_c * tl.load(W + cc, mask=cm, other=0.0, eviction_policy="evict_last").to(tl.float32)
                else:
                    g_c = dy_c
                dx = (g_c - xhat_c * c1 - c2) * rstd if not IS_RMS else (g_c - xhat_c * c1) * rstd
                if HAS_DXE:
                    dx += tl.load(DXE + row64 * stride_dxe + cc, mask=cm, other=0.0).to(tl.float32)
                tl.store(DX + row64 * stride_dx + cc, dx.to(DX.dtype.element_ty), mask=cm)
                if h == 0:
                    if NEED_DW:
                        dw0 += dy_c * xhat_c
                    if NEED_DB:
                        db0 += dy_c
                else:
                    if NEED_DW:
                        dw1 += dy_c * xhat_c
                    if NEED_DB:
                        db1 += dy_c
        part = pid.to(tl.int64) * N
        if NEED_DW:
            tl.store(DW_PART + part + c0, dw0, mask=m0)
            tl.store(DW_PART + part + c1s, dw1, mask=m1)
        if NEED_DB:
            tl.store(DB_PART + part + c0, db0, mask=m0)
            tl.store(DB_PART + part + c1s, db1, mask=m1)

    @triton.jit
    def _norm_bwd_sliced_kernel(
        DY, XS,  # [n_rows, N] in: dy, xsum (the normalized input); row strides, unit column stride
        W,  # [N] weight (HAS_W)
        MEAN, RSTD,  # [n_rows] fp32 (MEAN read only when not IS_RMS)
        DXE, DX,  # [n_rows, N]: extra gradient of xsum (HAS_DXE), out dx
        DW_PART, DB_PART,  # [num_row_programs, N] fp32 out: partial dweight (NEED_DW), dbias (NEED_DB)
        n_rows, N, stride_dy, stride_xs, stride_dxe, stride_dx,
        IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_DXE: tl.constexpr,
        NEED_DW: tl.constexpr, NEED_DB: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
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
            row64 = tl.cast(row, tl.int64)
            rstd = tl.load(RSTD + row)
            if IS_RMS:
                mean = 0.0
            else:
                mean = tl.load(MEAN + row)
            c1 = 0.0
            c2 = 0.0
            for off in range(0, N, BLOCK_N):
                cc = off + tl.arange(0, BLOCK_N)
                cm = cc < N
                xs_c = tl.load(XS + row64 * stride_xs + cc, mask=cm, other=0.0).to(tl.float32)
                dy_c = tl.load(DY + row64 * stride_dy + cc, mask=cm, other=0.0).to(tl.float32)
                xhat_c = tl.where(cm, (xs_c - mean) * rstd, 0.0)
                g_c = dy_c * tl.load(W + cc, mask=cm, other=0.0).to(tl.float32) if HAS_W else dy_c
                c1 += tl.sum(g_c * xhat_c, axis=0)
                c2 += tl.sum(g_c, axis=0)
            c1 = c1 / N
            c2 = c2 / N
            xs = tl.load(XS + row64 * stride_xs + cols, mask=col_mask, other=0.0, eviction_policy="evict_first")
            dy = tl.load(DY + row64 * stride_dy + cols, mask=col_mask, other=0.0, eviction_policy="evict_first")
            xs = xs.to(tl.float32)
            dy = dy.to(tl.float32)
            xhat = tl.where(col_mask, (xs - mean) * rstd, 0.0)
            g = dy * w if HAS_W else dy
            dx = (g - xhat * c1 - c2) * rstd if not IS_RMS else (g - xhat * c1) * rstd
            if HAS_DXE:
                dx += tl.load(DXE + row64 * stride_dxe + cols, mask=col_mask, other=0.0).to(tl.float32)
            tl.store(DX + row64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=col_mask)
            if NEED_DW:
                dw_acc += dy * xhat
            if NEED_DB:
                db_acc += dy
        part = pid.to(tl.int64) * N + cols
        if NEED_DW:
            tl.store(DW_PART + part, dw_acc, mask=col_mask)
        if NEED_DB:
            tl.store(DB_PART + part, db_acc, mask=col_mask)


# ---- launchers


def _fused_config(n: int, rows: int, fwd: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for whole rows held in registers, ~``_TILE`` elements per
    program. Warps by tile size (checked with ptxas for sm_90: <= 128 registers per thread):
    tile <= 1024: 4, 2048: 8, 4096: 16, 8192: 32 fwd / 16 bwd (16 elements per thread, which
    still fits the bwd's dweight/dbias partials), 16384: 32."""
    block_n = max(16, triton.next_power_of_2(n))
    block_m = max(1, min(_TILE // block_n, triton.next_power_of_2(rows)))
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


_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # interpreter: few programs, so the persistent loops really loop
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _rows2d(t: torch.Tensor, n: int) -> torch.Tensor:
    """[..., n] -> [rows, n] view (copy only if the last dim is strided or dims don't merge)."""
    t2 = t.reshape(-1, n)
    if n > 1 and t2.stride(1) != 1:
        t2 = t2.contiguous()
    return t2


def _device_guard(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _norm_fwd_launch(x, weight, bias, eps, residual, is_rms):
    """Triton forward. Returns (y, mean, rstd, xsum) with mean/xsum a [0] placeholder when unused."""
    n = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    mean = rstd.new_empty(0) if is_rms else torch.empty(rows, dtype=torch.float32, device=x.device)
    xsum = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else x.new_empty(0)
    if rows == 0:
        return y, mean, rstd, xsum
    if n == 0:  # statistics of an empty row, as torch computes them
        rstd.fill_(float("nan"))
        mean.fill_(float("nan"))
        return y, mean, rstd, xsum
    weight = weight.contiguous() if weight is not None else None
    bias = bias.contiguous() if bias is not None else None
    x2 = _rows2d(x, n)
    r2 = _rows2d(residual, n) if residual is not None else x2
    xs2 = xsum.view(rows, n) if residual is not None else x2
    y2 = y.view(rows, n)
    loop, block_m, block_n, warps = _fwd_config(n, rows, residual is not None)
    args = (
        x2, r2, xs2, y2,
        weight if weight is not None else x2, bias if bias is not None else x2,
        mean if not is_rms else rstd, rstd,
        rows, n, x2.stride(0), r2.stride(0), xs2.stride(0), y2.stride(0), float(eps),
    )
    flags = dict(IS_RMS=is_rms, HAS_RES=residual is not None, HAS_W=weight is not None, HAS_B=bias is not None)
    with _device_guard(x):
        if loop:
            _norm_fwd_loop_kernel[(rows,)](*args, **flags, BLOCK_N=block_n, num_warps=warps)
        else:
            grid = (triton.cdiv(rows, block_m),)
            _norm_fwd_fused_kernel[grid](*args, **flags, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
    return y, mean, rstd, xsum


def _norm_bwd_launch(dy, xsum, weight, mean, rstd, need_dweight, need_dbias, dxsum_extra, is_rms):
    """Triton backward. Returns (dx, dweight, dbias) with [0] placeholders for what is not needed."""
    n = xsum.shape[-1]
    rows = math.prod(xsum.shape[:-1])
    pdtype = weight.dtype if weight is not None else xsum.dtype
    need_dweight = bool(need_dweight) and weight is not None
    dx = torch.empty(xsum.shape, dtype=xsum.dtype, device=xsum.device)

    def empty():  # placeholder for an output not asked for (a fresh one each: returns may not alias)
        return torch.empty(0, dtype=pdtype, device=xsum.device)

    if rows == 0 or n == 0:
        dw = torch.zeros(n, dtype=pdtype, device=xsum.device) if need_dweight else empty()
        db = torch.zeros(n, dtype=pdtype, device=xsum.device) if need_dbias else empty()
        return dx, dw, db  # dx is empty; the sums over no rows are zeros
    weight = weight.contiguous() if weight is not None else None
    dy2 = _rows2d(dy, n)
    xs2 = _rows2d(xsum, n)
    dxe2 = _rows2d(dxsum_extra, n) if dxsum_extra is not None else dy2
    dx2 = dx.view(rows, n)
    sliced, block_m, block_n, warps = _bwd_config(n, rows)
    sms = _num_sms(xsum.device)
    if sliced:  # grid (slices, row programs); the slices of one row group run side by side
        n_slices = triton.cdiv(n, block_n)
        nprog = min(rows, max(1, 2 * sms // n_slices))
        grid = (n_slices, nprog)
    else:
        halves = n >= _BWD_HALVES_MIN_N and not is_rms
        if halves:
            block_m, warps = 1, _BWD_HALVES_WARPS
        nprog = min(triton.cdiv(rows, block_m), sms * (_BWD_PROGS_PER_SM or max(1, 32 // warps)))
        grid = (nprog,)
    db_colsum = bool(need_dbias) and not sliced and n >= _BWD_DB_COLSUM_MIN_N
    need_db_kernel = bool(need_dbias) and not db_colsum
    dw_part = torch.empty((nprog, n), dtype=torch.float32, device=xsum.device) if need_dweight else dx2
    db_part = torch.empty((nprog, n), dtype=torch.float32, device=xsum.device) if need_db_kernel else dx2
    rstd = rstd.contiguous()
    mean = rstd if is_rms else mean.contiguous()
    args = (
        dy2, xs2, weight if weight is not None else xs2, mean, rstd, dxe2, dx2, dw_part, db_part,
        rows, n, dy2.stride(0), xs2.stride(0), dxe2.stride(0), dx2.stride(0),
    )
    flags = dict(IS_RMS=is_rms, HAS_W=weight is not None, HAS_DXE=dxsum_extra is not None,
                 NEED_DW=need_dweight, NEED_DB=need_db_kernel)
    with _device_guard(xsum):
        if sliced:
            _norm_bwd_sliced_kernel[grid](*args, **flags, BLOCK_N=block_n, num_warps=warps)
        elif halves:
            _norm_bwd_halves_kernel[grid](*args, **flags, HALF_N=max(16, block_n // 2), num_warps=warps)
        else:
            _norm_bwd_fused_kernel[grid](*args, **flags, BLOCK_M=block_m, BLOCK_N=block_n,
                                         RELOAD=n >= _BWD_RELOAD_MIN_N, num_warps=warps)
    dw = dw_part.sum(0).to(pdtype) if need_dweight else empty()
    if db_colsum:  # fp32 accumulation, deterministic (torch reductions use no atomics)
        db = dy2.sum(0, dtype=torch.float32).to(pdtype)
    else:
        db = db_part.sum(0).to(pdtype) if need_dbias else empty()
    return dx, dw, db


if HAS_TRITON:

    @torch.library.custom_op("fusible_ops::layernorm_fwd", mutates_args=())
    def _layernorm_fwd_op(
        x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float,
        residual: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return _norm_fwd_launch(x, weight, bias, eps, residual, False)

    @_layernorm_fwd_op.register_fake
    def _(x, weight, bias, eps, residual):
        rows = math.prod(x.shape[:-1])
        xsum = x.new_empty(x.shape) if residual is not None else x.new_empty(0)
        stat = (x.new_empty(rows, dtype=torch.float32), x.new_empty(rows, dtype=torch.float32))
        return (x.new_empty(x.shape),) + stat + (xsum,)

    @torch.library.custom_op("fusible_ops::rmsnorm_fwd", mutates_args=())
    def _rmsnorm_fwd_op(
        x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, residual: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y, _, rstd, xsum = _norm_fwd_launch(x, weight, None, eps, residual, True)
        return y, rstd, xsum

    @_rmsnorm_fwd_op.register_fake
    def _(x, weight, eps, residual):
        xsum = x.new_empty(x.shape) if residual is not None else x.new_empty(0)
        return x.new_empty(x.shape), x.new_empty(math.prod(x.shape[:-1]), dtype=torch.float32), xsum

    def _fake_bwd(xsum, weight, need_dweight, need_dbias):
        pdtype = weight.dtype if weight is not None else xsum.dtype
        n = xsum.shape[-1]
        dw = xsum.new_empty(n if (need_dweight and weight is not None) else 0, dtype=pdtype)
        db = xsum.new_empty(n if need_dbias else 0, dtype=pdtype)
        return xsum.new_empty(xsum.shape), dw, db

    @torch.library.custom_op("fusible_ops::layernorm_bwd", mutates_args=())
    def _layernorm_bwd_op(
        dy: torch.Tensor, xsum: torch.Tensor, weight: Optional[torch.Tensor], mean: torch.Tensor,
        rstd: torch.Tensor, need_dweight: bool, need_dbias: bool, dxsum_extra: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _norm_bwd_launch(dy, xsum, weight, mean, rstd, need_dweight, need_dbias, dxsum_extra, False)

    @_layernorm_bwd_op.register_fake
    def _(dy, xsum, weight, mean, rstd, need_dweight, need_dbias, dxsum_extra):
        return _fake_bwd(xsum, weight, need_dweight, need_dbias)

    @torch.library.custom_op("fusible_ops::rmsnorm_bwd", mutates_args=())
    def _rmsnorm_bwd_op(
        dy: torch.Tensor, xsum: torch.Tensor, weight: Optional[torch.Tensor], rstd: torch.Tensor,
        need_dweight: bool, dxsum_extra: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dx, dw, _ = _norm_bwd_launch(dy, xsum, weight, rstd, rstd, need_dweight, False, dxsum_extra, True)
        return dx, dw

    @_rmsnorm_bwd_op.register_fake
    def _(dy, xsum, weight, rstd, need_dweight, dxsum_extra):
        dx, dw, _ = _fake_bwd(xsum, weight, need_dweight, False)
        return dx, dw


# ---- pure-torch references (fp32 math; float64 math for float64 inputs)


def _cdtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _ref_fwd(x, weight, bias, eps, residual, is_rms):
    ct = _cdtype(x)
    n = x.shape[-1]
    xsum = (x.to(ct) + residual.to(ct)).to(x.dtype) if residual is not None else x
    rows = math.prod(x.shape[:-1])
    xs = xsum.to(ct).reshape(rows, n)
    if is_rms:
        mean = None
        xc = xs
    else:
        mean = xs.mean(-1)
        xc = xs - mean[:, None]
    rstd = torch.rsqrt((xc * xc).mean(-1) + eps)
    y = xc * rstd[:, None]
    if weight is not None:
        y = y * weight.to(ct)
    if bias is not None:
        y = y + bias.to(ct)
    return y.to(x.dtype).reshape(x.shape), mean, rstd, xsum


def _ref_bwd(dy, xsum, weight, mean, rstd, need_dweight, need_dbias, dxsum_extra, is_rms):
    ct = _cdtype(xsum)
    n = xsum.shape[-1]
    pdtype = weight.dtype if weight is not None else xsum.dtype
    rows = math.prod(xsum.shape[:-1])
    xs = xsum.to(ct).reshape(rows, n)
    g0 = dy.to(ct).reshape(rows, n)
    r = rstd.to(ct)[:, None]
    xhat = xs * r if is_rms else (xs - mean.to(ct)[:, None]) * r
    g = g0 * weight.to(ct) if weight is not None else g0
    dx = g - xhat * (g * xhat).mean(-1, keepdim=True)
    if not is_rms:
        dx = dx - g.mean(-1, keepdim=True)
    dx = dx * r
    if dxsum_extra is not None:
        dx = dx + dxsum_extra.to(ct).reshape(rows, n)
    dw = (g0 * xhat).sum(0).to(pdtype) if (need_dweight and weight is not None) else None
    db = g0.sum(0).to(pdtype) if need_dbias else None
    return dx.to(xsum.dtype).reshape(xsum.shape), dw, db


def layernorm_fwd_ref(x, weight, bias, eps, residual=None):
    """Pure-torch twin of :func:`layernorm_fwd` (same contract; fp32 math, float64 for float64 x)."""
    return _ref_fwd(x, weight, bias, eps, residual, False)


def layernorm_bwd_ref(dy, xsum, weight, mean, rstd, need_dweight, need_dbias, dxsum_extra=None):
    """Pure-torch twin of :func:`layernorm_bwd` (same contract; fp32 math, float64 for float64 xsum)."""
    return _ref_bwd(dy, xsum, weight, mean, rstd, need_dweight, need_dbias, dxsum_extra, False)


def rmsnorm_fwd_ref(x, weight, eps, residual=None):
    """Pure-torch twin of :func:`rmsnorm_fwd` (same contract; fp32 math, float64 for float64 x)."""
    y, _, rstd, xsum = _ref_fwd(x, weight, None, eps, residual, True)
    return y, rstd, xsum


def rmsnorm_bwd_ref(dy, xsum, weight, rstd, need_dweight, dxsum_extra=None):
    """Pure-torch twin of :func:`rmsnorm_bwd` (same contract; fp32 math, float64 for float64 xsum)."""
    dx, dw, _ = _ref_bwd(dy, xsum, weight, None, rstd, need_dweight, False, dxsum_extra, True)
    return dx, dw


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
    if x.dtype in _TRITON_DTYPES and use_triton(x, weight, bias, residual):
        y, mean, rstd, xsum = torch.ops.fusible_ops.layernorm_fwd(x, weight, bias, float(eps), residual)
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
    if xsum.dtype in _TRITON_DTYPES and use_triton(dy, xsum, weight, mean, rstd, dxsum_extra):
        dx, dw, db = torch.ops.fusible_ops.layernorm_bwd(
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
    if x.dtype in _TRITON_DTYPES and use_triton(x, weight, residual):
        y, rstd, xsum = torch.ops.fusible_ops.rmsnorm_fwd(x, weight, float(eps), residual)
        return y, rstd, (xsum if residual is not None else x)
    return rmsnorm_fwd_ref(x, weight, eps, residual)


def rmsnorm_bwd(dy, xsum, weight, rstd, need_dweight, dxsum_extra=None):
    """Backward of :func:`rmsnorm_fwd` with respect to ``xsum``; contract as :func:`layernorm_bwd`.

    Returns ``(dx, dweight)``: ``dx`` in ``xsum.dtype`` (plus ``dxsum_extra``), ``dweight`` [N] in
    the weight's dtype (fp32 accumulation, deterministic) or None when not needed.
    """
    _check("rmsnorm_bwd", xsum, dy, weight=weight)
    if xsum.dtype in _TRITON_DTYPES and use_triton(dy, xsum, weight, rstd, dxsum_extra):
        dx, dw = torch.ops.fusible_ops.rmsnorm_bwd(dy, xsum, weight, rstd, bool(need_dweight), dxsum_extra)
        return dx, (dw if need_dweight and weight is not None else None)
    return rmsnorm_bwd_ref(dy, xsum, weight, rstd, need_dweight, dxsum_extra)


__all__ = [
    "layernorm_bwd", "layernorm_bwd_ref", "layernorm_fwd", "layernorm_fwd_ref",
    "rmsnorm_bwd", "rmsnorm_bwd_ref", "rmsnorm_fwd", "rmsnorm_fwd_ref",
]
