"""Graph-safe grouped GEMM for MoE experts (Triton), beside pure-torch ``*_ref`` twins.

Rows of ``x`` ([M, K]) are split into G consecutive groups by ``split_sizes``; the grouping
contract, the no-host-sync guarantee and the persistent tile space are those of
:mod:`fusible_ops.kernels.persistent`, on which these kernels are built. fwd/dgrad walk the
global tile space of all groups; wgrad has exactly G * cdiv(N, BN) * cdiv(K, BK) tiles.

Autotuning (GPU only, :class:`~fusible_ops.kernels.launch.TunedKernel`) is keyed on N, K, the
dtype and flags (never on M or the split values); it runs on the first call of a key: make one
warm-up call before capturing a graph. On Hopper loads go through TMA tensor descriptors when
:func:`~fusible_ops.kernels.persistent.tma_ok` allows (epilogues use masked pointer stores).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import HAS_TRITON, interpreter_enabled, use_triton
from .launch import (TRITON_DTYPES, DirectKernel, TunedKernel, cast_to, cdiv, compute_dtype, dot_precision, generic_key,
                     kernel_op)
from .persistent import (INTERP_MN, INTERP_WG, check_splits, group_p2, persistent_grid, same_dtype,
                         tma_ok, wgrad_grid, wgrad_tma_out)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .persistent import (group_rows, group_table, mainloop, mn_config, operand_descs, tile_coords, tile_space,
                             wgrad_config, wgrad_epilogue, wgrad_out_desc, wgrad_schedule, wgrad_tile)

    @triton.jit
    def _ggemm_kernel(
        a_ptr,  # [M, KIN] rows grouped by split sizes (strided)
        b_ptr,  # [G, NOUT, KIN] if B_KMAJOR (fwd: w) else [G, KIN, NOUT] (dgrad: w)
        c_ptr,  # [M, NOUT] output (strided)
        bias_ptr,  # [G, NOUT] or a dummy pointer
        split_ptr,  # [G] int64 rows per group
        gidx_ptr,  # GATHER: [M] int64, the row of A each row of C reads (else a dummy)
        M, NOUT, KIN, G,
        s_am, s_ak, s_bg, s_bk, s_bn, s_cm, s_cn, s_biasg, s_biasn,
        HAS_BIAS: tl.constexpr, B_KMAJOR: tl.constexpr, USE_TMA: tl.constexpr, PREC: tl.constexpr,
        G_P2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
        FLATTEN: tl.constexpr = False, PPS: tl.constexpr = 1,  # PPS: programs per SM (read by the grid)
        GATHER: tl.constexpr = False,
    ):
        """C[rows of g] = A[rows of g] @ B_g (+ bias[g]); persistent over all groups' tiles.
        ``GATHER``: row r of C reads row gidx[r] of A (M counts C's rows), through the pointer
        path (the launcher sets USE_TMA False). Offline sm_90a PTX (Triton 3.6 and 3.9): pointer
        loads of both operands compile to a cp.async pipeline with the MMA one step in flight and
        no spills; :func:`mainloop`'s TMA branch with A's rows gathered instead loaded A into
        registers every K step and waited for each MMA (and spilled at 128x256)."""
        gi, start, m, tiles, tile_end, total, TILES_N = tile_space(split_ptr, G, M, NOUT, G_P2, BM, BN)
        a_desc, b_desc = operand_descs(a_ptr, b_ptr, M, KIN, NOUT, G, s_am, s_bg, s_bk, s_bn, B_KMAJOR, USE_TMA,
                                       BM, BN, BK)
        for t in tl.range(tl.program_id(0), total, tl.num_programs(0), flatten=FLATTEN):
            g, row0, rows, rmask, n0, offs_n, nmask = tile_coords(t, gi, start, m, tile_end, tiles, TILES_N, NOUT,
                                                                  BM, BN, GROUP_M)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            src = tl.load(gidx_ptr + rows.to(tl.int64), mask=rmask, other=0) if GATHER else rows
            acc = mainloop(acc, a_ptr, a_desc, b_ptr, b_desc, g, row0, src, rmask, n0, offs_n, nmask,
                            KIN, s_am, s_ak, s_bg, s_bk, s_bn, B_KMAJOR, USE_TMA, PREC, BN, BK)
            if HAS_BIAS:
                bias = tl.load(bias_ptr + g.to(tl.int64) * s_biasg + offs_n.to(tl.int64) * s_biasn, mask=nmask, other=0.0)
                acc += bias.to(tl.float32)[None, :]
            # masked pointer store (rows past the group end belong to the next group)
            c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * s_cm + offs_n[None, :] * s_cn  # c: ours, contiguous
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])

    @triton.jit
    def _wgrad_ptr_rows(acc, dy_ptr, x_ptr, r_first, n_rows, offs_n, offs_k, nmask, kmask, s_dym, s_dyn, s_xm, s_xk,
                        PREC: tl.constexpr, BR: tl.constexpr):
        """acc += dy[rows, n tile].T @ x[rows, k tile] over rows [r_first, r_first + n_rows),
        masked pointer loads."""
        dy_base = dy_ptr + offs_n.to(tl.int64)[:, None] * s_dyn
        x_base = x_ptr + offs_k.to(tl.int64)[None, :] * s_xk
        for r in tl.range(0, n_rows, BR, num_stages=1):  # (not pipelined: no shared-memory ring of its own)
            lr = r + tl.arange(0, BR)
            rmask = lr < n_rows
            rows = (r_first + lr).to(tl.int64)
            a = tl.load(dy_base + rows[None, :] * s_dym, mask=nmask[:, None] & rmask[None, :], other=0.0)
            b = tl.load(x_base + rows[:, None] * s_xm, mask=rmask[:, None] & kmask[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PREC)
        return acc

    @triton.jit
    def _ggemm_wgrad_kernel(
        dy_ptr,  # [M, N] (strided)
        x_ptr,  # [M, K] (strided)
        out_ptr,  # [G, N, K] (strided); fp32 or the inputs' dtype
        split_ptr,  # [G] int64
        M, N, K, G,
        s_dym, s_dyn, s_xm, s_xk, s_og, s_on, s_ok,
        ACCUMULATE: tl.constexpr, USE_TMA: tl.constexpr, OUT_TMA: tl.constexpr, PREC: tl.constexpr,
        G_P2: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, GROUP_N: tl.constexpr,
        PPS: tl.constexpr = 0, TMA_STORE: tl.constexpr = False,
    ):
        """out[g] (+)= dy_g.T @ x_g over [BN, BK] tiles (:func:`wgrad_schedule`: one per program, or
        persistent). TMA reads a group's whole BR-row chunks (descriptors over all M rows, made once
        per program); the last partial chunk takes masked pointer loads (never the next group's rows)."""
        first, total, step = wgrad_schedule(N, K, G, BN, BK, PPS)
        gi, start, m = group_table(split_ptr, G, M, G_P2)
        if USE_TMA:
            dy_desc = tl.make_tensor_descriptor(dy_ptr, shape=[M, N], strides=[s_dym, 1], block_shape=[BR, BN])
            x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[s_xm, 1], block_shape=[BR, BK])
        o_desc = wgrad_out_desc(out_ptr, G, N, K, s_og, s_on, OUT_TMA, TMA_STORE, BN, BK)
        for t in range(first, total, step):
            g, r0, mg, n0, k0, offs_n, offs_k, nmask, kmask = wgrad_tile(t, gi, start, m, N, K, BN, BK, GROUP_N)
            acc = tl.zeros((BN, BK), dtype=tl.float32)
            if USE_TMA:
                tail = mg // BR * BR
                for r in range(0, tail, BR):
                    a = tl.trans(dy_desc.load([r0 + r, n0]))
                    b = x_desc.load([r0 + r, k0])
                    acc = tl.dot(a, b, acc, input_precision=PREC)
                # the tail, 32 rows at a time (narrow pointer tensors spare the TMA loop's registers)
                acc = _wgrad_ptr_rows(acc, dy_ptr, x_ptr, r0 + tail, mg - tail, offs_n, offs_k, nmask, kmask,
                                      s_dym, s_dyn, s_xm, s_xk, PREC, 32)
            else:
                acc = _wgrad_ptr_rows(acc, dy_ptr, x_ptr, r0, mg, offs_n, offs_k, nmask, kmask,
                                      s_dym, s_dyn, s_xm, s_xk, PREC, BR)
            wgrad_epilogue(acc, out_ptr, o_desc, g, s_og, n0, offs_n, nmask, k0, K, mg, s_on, s_ok, ACCUMULATE,
                           OUT_TMA, TMA_STORE, BN, BK)

    @triton.jit
    def _group_colsum_kernel(
        dy_ptr,  # [M, N] (strided)
        db_ptr,  # [G, N] contiguous, dy's dtype
        split_ptr,  # [G] int64
        M, N, G, s_dym, s_dyn,
        G_P2: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
    ):
        """db[g, n-block] = sum of dy over the rows of group g (fp32), grid (tiles_n, G)."""
        pid_n = tl.program_id(0)
        g = tl.program_id(1)
        r0, mg = group_rows(split_ptr, g, G, M, G_P2)
        offs_n = pid_n * BN + tl.arange(0, BN)
        nmask = offs_n < N
        acc = tl.zeros((BR, BN), dtype=tl.float32)
        for r in range(0, mg, BR):
            lr = r + tl.arange(0, BR)
            ptrs = dy_ptr + (r0 + lr).to(tl.int64)[:, None] * s_dym + offs_n.to(tl.int64)[None, :] * s_dyn
            acc += tl.load(ptrs, mask=(lr < mg)[:, None] & nmask[None, :], other=0.0).to(tl.float32)
        tl.store(db_ptr + g.to(tl.int64) * N + offs_n, tl.sum(acc, 0).to(db_ptr.dtype.element_ty), mask=nmask)

    # Small explicit lists (Hopper, bf16/fp16 first; the small ones serve fp32 "ieee").
    # PPS=2 where two programs fit on an SM (<= 4 warps, <= ~110 KB shared memory); flat: the
    # persistent tile loop is flattened with the K loop (loads of the next tile overlap the epilogue).
    _MN_CONFIGS = [mn_config(128, 256, 64, 8, 3), mn_config(128, 256, 64, 8, 4),
                   mn_config(128, 256, 64, 8, 3, flat=True), mn_config(128, 128, 64, 4, 3, pps=2),
                   mn_config(64, 128, 64, 4, 4, pps=2), mn_config(64, 64, 32, 4, 3, pps=2)]
    # wgrad: long per-group reductions like big tiles; short ones (many small groups: each tile's
    # K loop is a few steps) like persistent programs, two per SM, with the TMA-store epilogue
    # (the epilogue and the next tile's loads overlap). H200, 64 experts of 256 rows, FC1
    # (N=2816, K=2048): 587 us tuned over the first six (one tile per program), 497 over all.
    _WG_CONFIGS = [wgrad_config(128, 256, 64, 8, 3), wgrad_config(128, 256, 32, 8, 4),
                   wgrad_config(128, 128, 64, 4, 3), wgrad_config(128, 128, 32, 4, 4),
                   wgrad_config(128, 128, 32, 4, 3), wgrad_config(64, 64, 32, 4, 3),
                   wgrad_config(128, 128, 64, 4, 2, pps=2, tma_out=True), wgrad_config(128, 128, 64, 4, 3, pps=2),
                   wgrad_config(128, 128, 64, 8, 3, pps=2), wgrad_config(128, 256, 64, 8, 3, pps=1, tma_out=True),
                   wgrad_config(128, 256, 64, 8, 3, pps=2, tma_out=True)]
    # fixed configs (autotuning off): (16-bit inputs, fp32 inputs)
    _COLSUM = DirectKernel(_group_colsum_kernel)
    MN_KERNEL = TunedKernel(_ggemm_kernel, _MN_CONFIGS, ["NOUT", "KIN", "USE_TMA", "B_KMAJOR", "HAS_BIAS"],
                            (mn_config(128, 128, 64, 8, 4), _MN_CONFIGS[5]), INTERP_MN,
                            fit={"NOUT": "BN", "KIN": "BK"})
    WGRAD_KERNEL = TunedKernel(_ggemm_wgrad_kernel, _WG_CONFIGS, ["N", "K", "USE_TMA", "OUT_TMA", "ACCUMULATE"],
                               (_WG_CONFIGS[3], _WG_CONFIGS[5]), INTERP_WG, restore_value=["out_ptr"],
                               fit={"N": "BN", "K": "BK"})


def _launch_mn(a, b, c, bias, split, nout, kin, s_bk, s_bn, b_kmajor, gather=None):
    """Launch _ggemm_kernel: c[M, nout] = grouped a[M, kin] @ B_g (+ bias), or with ``gather``
    ([M] int64) row r reading a[gather[r]]. One launch."""
    M, G = c.shape[0], b.shape[0]
    if M == 0 or nout == 0:
        return c
    has_bias = bias is not None
    bias_arg = bias if has_bias else c
    gidx = split if gather is None else gather
    # everything build() reads but the pointers (launch_cached: later calls skip build)
    key = (a.shape, a.stride(), b.shape, b.stride(), c.shape, c.stride(), bias.stride() if has_bias else None,
           a.dtype, b.dtype, c.dtype, bias_arg.dtype, split.dtype, a.device, nout, kin, s_bk, s_bn, b_kmajor,
           gather is not None)

    def build():
        use_tma = kin > 0 and tma_ok(a, b) and gather is None
        s_biasg, s_biasn = (bias.stride(0), bias.stride(1)) if has_bias else (0, 0)
        args = (a, b, c, bias_arg, split, gidx, M, nout, kin, G, a.stride(0), a.stride(1), b.stride(0), s_bk, s_bn,
                c.stride(0), c.stride(1), s_biasg, s_biasn)
        const = dict(HAS_BIAS=has_bias, B_KMAJOR=b_kmajor, USE_TMA=use_tma, PREC=dot_precision(a.dtype),
                     G_P2=group_p2(G), GATHER=gather is not None)
        return args, const, persistent_grid(M, G, nout, a.device)
    MN_KERNEL.launch_cached(key, (a, b, c, bias_arg, split, gidx), build, a.dtype, a.device)
    return c


def _launch_wgrad(dy, x, out, split, accumulate):
    M, N = dy.shape
    K, G = x.shape[1], out.shape[0]
    if G == 0 or N == 0 or K == 0:
        return out
    key = (dy.shape, dy.stride(), x.shape, x.stride(), out.shape, out.stride(), dy.dtype, x.dtype, out.dtype,
           split.dtype, x.device, accumulate)

    def build():
        use_tma = M > 0 and tma_ok(dy, x)
        args = (dy, x, out, split, M, N, K, G, dy.stride(0), dy.stride(1), x.stride(0), x.stride(1),
                out.stride(0), out.stride(1), out.stride(2))
        const = dict(ACCUMULATE=accumulate, USE_TMA=use_tma, OUT_TMA=wgrad_tma_out(out, accumulate),
                     PREC=dot_precision(x.dtype), G_P2=group_p2(G))
        return args, const, wgrad_grid(G, N, K, x.device)
    WGRAD_KERNEL.launch_cached(key, (dy, x, out, split), build, x.dtype, x.device)
    return out


# ----------------------------------------------------------------------------- custom ops
@kernel_op("fusible_ops::grouped_gemm_fwd", mutates_args=())
def _grouped_gemm_fwd_op(x: torch.Tensor, w: torch.Tensor, split_sizes: torch.Tensor,
                         bias: Optional[torch.Tensor]) -> torch.Tensor:
    y = x.new_empty((x.shape[0], w.shape[1]))  # (new_empty: less host time than torch.empty(dtype=, device=))
    return _launch_mn(x, w, y, bias, split_sizes, w.shape[1], x.shape[1], w.stride(2), w.stride(1), True)


@_grouped_gemm_fwd_op.register_fake
def _(x, w, split_sizes, bias):
    return x.new_empty((x.shape[0], w.shape[1]))


@kernel_op("fusible_ops::grouped_gemm_fwd_gather", mutates_args=())
def _grouped_gemm_fwd_gather_op(x: torch.Tensor, w: torch.Tensor, split_sizes: torch.Tensor,
                                bias: Optional[torch.Tensor], gather: torch.Tensor) -> torch.Tensor:
    y = x.new_empty((gather.shape[0], w.shape[1]))
    return _launch_mn(x, w, y, bias, split_sizes, w.shape[1], x.shape[1], w.stride(2), w.stride(1), True, gather)


@_grouped_gemm_fwd_gather_op.register_fake
def _(x, w, split_sizes, bias, gather):
    return x.new_empty((gather.shape[0], w.shape[1]))


@kernel_op("fusible_ops::grouped_gemm_dgrad", mutates_args=())
def _grouped_gemm_dgrad_op(dy: torch.Tensor, w: torch.Tensor, split_sizes: torch.Tensor) -> torch.Tensor:
    dx = dy.new_empty((dy.shape[0], w.shape[2]))
    return _launch_mn(dy, w, dx, None, split_sizes, w.shape[2], w.shape[1], w.stride(1), w.stride(2), False)


@_grouped_gemm_dgrad_op.register_fake
def _(dy, w, split_sizes):
    return dy.new_empty((dy.shape[0], w.shape[2]))


@kernel_op("fusible_ops::grouped_gemm_wgrad", mutates_args=())
def _grouped_gemm_wgrad_op(dy: torch.Tensor, x: torch.Tensor, split_sizes: torch.Tensor) -> torch.Tensor:
    out = x.new_empty((split_sizes.shape[0], dy.shape[1], x.shape[1]))
    return _launch_wgrad(dy, x, out, split_sizes, False)


@_grouped_gemm_wgrad_op.register_fake
def _(dy, x, split_sizes):
    return x.new_empty((split_sizes.shape[0], dy.shape[1], x.shape[1]))


@kernel_op("fusible_ops::grouped_gemm_wgrad_out", mutates_args=("out",))
def _grouped_gemm_wgrad_out_op(dy: torch.Tensor, x: torch.Tensor, split_sizes: torch.Tensor, out: torch.Tensor,
                               accumulate: bool) -> None:
    _launch_wgrad(dy, x, out, split_sizes, accumulate)


@_grouped_gemm_wgrad_out_op.register_fake
def _(dy, x, split_sizes, out, accumulate):
    return None


@kernel_op("fusible_ops::grouped_bias_grad", mutates_args=())
def _grouped_bias_grad_op(dy: torch.Tensor, split_sizes: torch.Tensor) -> torch.Tensor:
    M, N = dy.shape
    G = split_sizes.shape[0]
    db = dy.new_empty((G, N))
    if G == 0 or N == 0:
        return db
    BN = 16 if (interpreter_enabled() and not dy.is_cuda) else 64
    BR = 16 if BN == 16 else 32
    args = (dy, db, split_sizes, M, N, G, dy.stride(0), dy.stride(1))
    meta = dict(G_P2=group_p2(G), BR=BR, BN=BN)
    _COLSUM((cdiv(N, BN), G), generic_key(args, meta), args, meta)
    return db


@_grouped_bias_grad_op.register_fake
def _(dy, split_sizes):
    return dy.new_empty((split_sizes.shape[0], dy.shape[1]))


# ----------------------------------------------------------------------------- public API
def grouped_gemm_fwd(x: torch.Tensor, w: torch.Tensor, split_sizes: torch.Tensor,
                     bias: Optional[torch.Tensor] = None, gather: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Grouped linear forward: ``y[rows of g] = x_g @ w[g].T (+ bias[g])``.

    x [M, K], w [G, N, K] (same dtype: bf16/fp16/fp32; float64 runs the ref), bias [G, N] or
    None, split_sizes [G] int64 on x's device. Returns y [M, N] in x's dtype (fp32 accumulate;
    fp32 inputs use IEEE fp32 dot). Any strides; sync-free; one launch.

    ``gather`` ([R] int64, values in [0, M)): row r of y reads row ``gather[r]`` of x inside the
    kernel (a MoE layer's token copies, never written as an [R, K] tensor); y is [R, N] and the
    split sizes sum to R. Same as ``grouped_gemm_fwd(x[gather], ...)``.
    """
    G = w.shape[0]
    check_splits(split_sizes, G, x, w, *([bias] if bias is not None else []), *([gather] if gather is not None else []))
    same_dtype(x, w)
    if gather is not None and (gather.dim() != 1 or gather.dtype != torch.int64):
        raise TypeError(f"grouped_gemm_fwd: gather must be a 1-D int64 tensor, got {gather.dtype} {tuple(gather.shape)}")
    if use_triton(x, w, split_sizes, bias) and x.dtype in TRITON_DTYPES:
        if gather is not None:
            return _grouped_gemm_fwd_gather_op(x, w, split_sizes, bias, gather)
        return _grouped_gemm_fwd_op(x, w, split_sizes, bias)
    return grouped_gemm_fwd_ref(x if gather is None else x.index_select(0, gather), w, split_sizes, bias)


def grouped_gemm_dgrad(dy: torch.Tensor, w: torch.Tensor, split_sizes: torch.Tensor) -> torch.Tensor:
    """Grouped linear input gradient: ``dx_g = dy_g @ w[g]``.

    dy [M, N], w [G, N, K], split_sizes [G] int64. Returns dx [M, K] in dy's dtype (fp32 accumulate).
    """
    check_splits(split_sizes, w.shape[0], dy, w)
    same_dtype(dy, w)
    if use_triton(dy, w, split_sizes) and dy.dtype in TRITON_DTYPES:
        return _grouped_gemm_dgrad_op(dy, w, split_sizes)
    return grouped_gemm_dgrad_ref(dy, w, split_sizes)


def grouped_gemm_wgrad(dy: torch.Tensor, x: torch.Tensor, split_sizes: torch.Tensor,
                       out: Optional[torch.Tensor] = None, accumulate: bool = False) -> torch.Tensor:
    """Grouped linear weight gradient: ``dw[g] = dy_g.T @ x_g`` ([G, N, K], fp32 accumulation).

    dy [M, N], x [M, K], split_sizes [G] int64. ``out=None``: a new [G, N, K] tensor in x's dtype.
    ``out`` given ([G, N, K], e.g. an fp32 or bf16 main_grad): ``accumulate=True`` adds into it in
    the epilogue (no full-size temporary), else overwrites it. Empty groups give exact zeros
    (new / overwrite) or stay untouched (accumulate). Returns ``out`` or the new tensor.
    """
    G = split_sizes.shape[0]
    check_splits(split_sizes, G, dy, x, *([out] if out is not None else []))
    same_dtype(dy, x)
    if out is not None and tuple(out.shape) != (G, dy.shape[1], x.shape[1]):
        raise ValueError(f"out must be [G, N, K] = {(G, dy.shape[1], x.shape[1])}, got {tuple(out.shape)}")
    if use_triton(dy, x, split_sizes, out) and x.dtype in TRITON_DTYPES and (
            out is None or out.dtype in TRITON_DTYPES):
        if out is None:
            return _grouped_gemm_wgrad_op(dy, x, split_sizes)
        _grouped_gemm_wgrad_out_op(dy, x, split_sizes, out, accumulate)
        return out
    return grouped_gemm_wgrad_ref(dy, x, split_sizes, out, accumulate)


def grouped_bias_grad(dy: torch.Tensor, split_sizes: torch.Tensor) -> torch.Tensor:
    """Per-group column sums: ``db[g] = dy_g.sum(0)``, [G, N] in dy's dtype (fp32 accumulate).

    Deterministic (no atomics), sync-free; empty groups give zeros.
    """
    check_splits(split_sizes, split_sizes.shape[0], dy)
    if use_triton(dy, split_sizes) and dy.dtype in TRITON_DTYPES:
        return _grouped_bias_grad_op(dy, split_sizes)
    return grouped_bias_grad_ref(dy, split_sizes)


# ----------------------------------------------------------------------------- references
# Eager: a per-group loop over host-read bounds (memory-lean). Traced by torch.compile: the same
# math with a [G, rows] group mask and no host read (every group's product is computed over all
# rows, then selected; exact, since unselected entries contribute exact zeros).
def _bounds(split_sizes: torch.Tensor):
    """Host (start, end) per group (the eager refs may sync)."""
    ends = torch.cumsum(split_sizes.detach().to("cpu", torch.int64), 0).tolist()
    starts = [0] + ends[:-1]
    return list(zip(starts, ends))


def _group_mask(split_sizes: torch.Tensor, rows: int, device) -> torch.Tensor:
    """[G, rows, 1] bool: row r belongs to group g. Traceable (no host read)."""
    sizes = split_sizes.to(device, torch.int64)
    ends = torch.cumsum(sizes, 0)
    r = torch.arange(rows, device=device)
    return ((r >= (ends - sizes)[:, None]) & (r < ends[:, None]))[..., None]


def grouped_gemm_fwd_ref(x: torch.Tensor, w: torch.Tensor, split_sizes: torch.Tensor,
                         bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Pure-torch twin of :func:`grouped_gemm_fwd` (per-group loop, fp32 math, syncs)."""
    acc = compute_dtype(x.dtype)
    if torch.compiler.is_compiling():
        r = x.to(acc)[None] @ w.to(acc).transpose(1, 2)
        if bias is not None:
            r = r + bias.to(acc)[:, None, :]
        return cast_to(torch.where(_group_mask(split_sizes, x.shape[0], x.device), r, 0).sum(0), x.dtype)
    y = torch.zeros((x.shape[0], w.shape[1]), dtype=x.dtype, device=x.device)
    for g, (s, e) in enumerate(_bounds(split_sizes)):
        if e > s:
            r = x[s:e].to(acc) @ w[g].to(acc).T
            if bias is not None:
                r = r + bias[g].to(acc)
            y[s:e] = r.to(x.dtype)
    return y


def grouped_dgrad_acc_ref(dy: torch.Tensor, w: torch.Tensor, split_sizes: torch.Tensor) -> torch.Tensor:
    """``dx_g = dy_g @ w[g]`` in the accumulation dtype (fp32; fp64 for fp64), not cast back."""
    acc = compute_dtype(dy.dtype)
    if torch.compiler.is_compiling():
        r = dy.to(acc)[None] @ w.to(acc)
        return torch.where(_group_mask(split_sizes, dy.shape[0], dy.device), r, 0).sum(0)
    dx = torch.zeros((dy.shape[0], w.shape[2]), dtype=acc, device=dy.device)
    for g, (s, e) in enumerate(_bounds(split_sizes)):
        if e > s:
            dx[s:e] = dy[s:e].to(acc) @ w[g].to(acc)
    return dx


def grouped_gemm_dgrad_ref(dy: torch.Tensor, w: torch.Tensor, split_sizes: torch.Tensor) -> torch.Tensor:
    """Pure-torch twin of :func:`grouped_gemm_dgrad`."""
    return grouped_dgrad_acc_ref(dy, w, split_sizes).to(dy.dtype)


def grouped_gemm_wgrad_ref(dy: torch.Tensor, x: torch.Tensor, split_sizes: torch.Tensor,
                           out: Optional[torch.Tensor] = None, accumulate: bool = False) -> torch.Tensor:
    """Pure-torch twin of :func:`grouped_gemm_wgrad` (same out / accumulate semantics)."""
    acc = compute_dtype(x.dtype)
    G = split_sizes.shape[0]
    if out is None:
        out = torch.empty((G, dy.shape[1], x.shape[1]), dtype=x.dtype, device=x.device)
        accumulate = False
    if torch.compiler.is_compiling():
        dym = torch.where(_group_mask(split_sizes, dy.shape[0], dy.device), dy.to(acc)[None], 0)
        r = dym.transpose(1, 2) @ x.to(acc)[None]
        out.copy_((r + out.to(acc)) if accumulate else r)
        return out
    for g, (s, e) in enumerate(_bounds(split_sizes)):
        if e > s:
            r = dy[s:e].to(acc).T @ x[s:e].to(acc)
            if accumulate:
                r = r + out[g].to(acc)
            out[g] = r.to(out.dtype)
        elif not accumulate:
            out[g] = 0
    return out


def grouped_bias_grad_ref(dy: torch.Tensor, split_sizes: torch.Tensor) -> torch.Tensor:
    """Pure-torch twin of :func:`grouped_bias_grad`."""
    acc = compute_dtype(dy.dtype)
    G = split_sizes.shape[0]
    if torch.compiler.is_compiling():
        mask = _group_mask(split_sizes, dy.shape[0], dy.device)
        return torch.where(mask, dy.to(acc)[None], 0).sum(1).to(dy.dtype)
    db = torch.zeros((G, dy.shape[1]), dtype=dy.dtype, device=dy.device)
    for g, (s, e) in enumerate(_bounds(split_sizes)):
        if e > s:
            db[g] = dy[s:e].to(acc).sum(0).to(dy.dtype)
    return db


__all__ = [
    "grouped_gemm_fwd", "grouped_gemm_dgrad", "grouped_gemm_wgrad", "grouped_bias_grad",
    "grouped_gemm_fwd_ref", "grouped_gemm_dgrad_ref", "grouped_gemm_wgrad_ref", "grouped_bias_grad_ref",
]
