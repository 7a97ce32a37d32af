"""Graph-safe grouped GEMM for MoE experts (Triton), beside pure-torch ``*_ref`` twins.

Rows of ``x`` ([M, K]) are split into G consecutive groups by ``split_sizes`` (1-D int64,
length G, on x's device); group g covers rows [off_g, off_g + m_g), off = exclusive cumsum.
Empty groups and M == 0 are valid. ``sum(split_sizes) == M`` is the caller's contract: the
kernels clamp groups to M (never read or write out of bounds) but rows past the sum stay
unwritten.

No host sync: split sizes are read on the device (one vector load + cumsum per program), the
launch grid depends only on M, N, K, G and the SM count, so forward + backward can be
captured in a ``torch.cuda.CUDAGraph`` and replayed with other split sizes of the same total.
fwd/dgrad use a persistent grid that walks the global tile space of all groups (per group
cdiv(m_g, BM) * cdiv(N, BN) tiles); wgrad has exactly G * cdiv(N, BN) * cdiv(K, BK) tiles.

Autotuning (GPU only) is keyed on N, K and the dtype (never on M or the split values). It runs
on the first call for a new (N, K, dtype): make one warm-up call before capturing a graph.
On Hopper (Triton >= 3.3 with ``tl.make_tensor_descriptor``) loads go through TMA
tensor descriptors (loads only; epilogues use masked pointer stores) when strides and pointers
are 16-byte aligned; else plain pointer loads
(always under the interpreter). ``FUSIBLE_OPS_GGEMM_TMA=0`` turns TMA off.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from fusible_ops.kernels import HAS_TRITON, TRITON_DTYPES, interpreter_enabled, kernel_op, num_sms, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _group_table(split_ptr, G, M, G_P2: tl.constexpr):
        """Per-group (row start, rows) as [G_P2] int32 vectors, clamped to [0, M]."""
        gi = tl.arange(0, G_P2)
        m = tl.load(split_ptr + gi, mask=gi < G, other=0).to(tl.int32)
        m = tl.maximum(m, 0)
        end_raw = tl.cumsum(m, 0)
        start = tl.minimum(end_raw - m, M)
        end = tl.minimum(end_raw, M)
        return gi, start, end - start

    @triton.jit
    def _pick(vec, sel):
        """The element of int vector ``vec`` where boolean vector ``sel`` is true (one place)."""
        return tl.sum(tl.where(sel, vec, 0), 0)

    @triton.jit
    def _locate_tile(t, gi, start, m, tile_end, tiles, TILES_N, BM: tl.constexpr, GROUP_M: tl.constexpr):
        """Global tile index t -> (group, group row start, group rows, m-tile, n-tile)."""
        g = tl.sum((tile_end <= t).to(tl.int32), 0)
        sel = gi == g
        r0 = _pick(start, sel)
        mg = _pick(m, sel)
        local = t - _pick(tile_end - tiles, sel)
        # GROUP_M swizzle inside the group: GROUP_M m-tiles share the weight tiles in L2.
        num_m = tl.cdiv(mg, BM)
        width = GROUP_M * TILES_N
        first_m = (local // width) * GROUP_M
        gsz = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (local % width) % gsz
        pid_n = (local % width) // gsz
        return g, r0, mg, pid_m, pid_n

    @triton.jit
    def _split_cols(acc, BM: tl.constexpr, BN: tl.constexpr):
        """[BM, BN] -> ([BM, BN/2] columns [0, BN/2), [BM, BN/2] columns [BN/2, BN))."""
        return tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))

    @triton.jit
    def _mainloop(acc, a_ptr, a_desc, b_ptr, b_desc, g, row0, rows, rmask, n0, offs_n, nmask,
                  KIN, s_am, s_ak, s_bg, s_bk, s_bn,
                  B_KMAJOR: tl.constexpr, USE_TMA: tl.constexpr, PREC: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr):
        """acc[BM, BN] += A[rows, :KIN] @ B_g[:KIN, n0:n0+BN] (fp32 accumulate)."""
        if USE_TMA:
            for k0 in range(0, KIN, BK):
                a = a_desc.load([row0, k0])
                if B_KMAJOR:
                    b = tl.trans(tl.reshape(b_desc.load([g, n0, k0]), (BN, BK)))
                else:
                    b = tl.reshape(b_desc.load([g, k0, n0]), (BK, BN))
                acc = tl.dot(a, b, acc, input_precision=PREC)
        else:
            a_row = a_ptr + rows.to(tl.int64)[:, None] * s_am
            b_base = b_ptr + g.to(tl.int64) * s_bg + offs_n.to(tl.int64)[None, :] * s_bn
            for k0 in range(0, KIN, BK):
                offs_k = k0 + tl.arange(0, BK)
                kmask = offs_k < KIN
                a = tl.load(a_row + offs_k.to(tl.int64)[None, :] * s_ak, mask=rmask[:, None] & kmask[None, :], other=0.0)
                b = tl.load(b_base + offs_k.to(tl.int64)[:, None] * s_bk, mask=kmask[:, None] & nmask[None, :],
                            other=0.0)
                acc = tl.dot(a, b, acc, input_precision=PREC)
        return acc

    @triton.jit
    def _ggemm_kernel(
        a_ptr,  # [M, KIN] rows grouped by split sizes (strided)
        b_ptr,  # [G, NOUT, KIN] if B_KMAJOR (fwd: w) else [G, KIN, NOUT] (dgrad: w)
        c_ptr,  # [M, NOUT] output (strided)
        bias_ptr,  # [G, NOUT] or a dummy pointer
        split_ptr,  # [G] int64 rows per group
        M, NOUT, KIN, G,
        s_am, s_ak, s_bg, s_bk, s_bn, s_cm, s_cn, s_biasg, s_biasn,
        HAS_BIAS: tl.constexpr, B_KMAJOR: tl.constexpr, USE_TMA: tl.constexpr, PREC: tl.constexpr,
        G_P2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
        FLATTEN: tl.constexpr = False, PPS: tl.constexpr = 1,  # PPS: programs per SM (read by the grid)
    ):
        """C[rows of g] = A[rows of g] @ B_g (+ bias[g]); persistent over all groups' tiles."""
        TILES_N = tl.cdiv(NOUT, BN)
        gi, start, m = _group_table(split_ptr, G, M, G_P2)
        tiles = tl.cdiv(m, BM) * TILES_N
        tile_end = tl.cumsum(tiles, 0)
        total = tl.sum(tiles, 0)
        if USE_TMA:
            a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, KIN], strides=[s_am, 1], block_shape=[BM, BK])
            if B_KMAJOR:
                b_desc = tl.make_tensor_descriptor(b_ptr, shape=[G, NOUT, KIN], strides=[s_bg, s_bn, 1],
                                                   block_shape=[1, BN, BK])
            else:
                b_desc = tl.make_tensor_descriptor(b_ptr, shape=[G, KIN, NOUT], strides=[s_bg, s_bk, 1],
                                                   block_shape=[1, BK, BN])
        else:
            a_desc = a_ptr
            b_desc = b_ptr
        for t in tl.range(tl.program_id(0), total, tl.num_programs(0), flatten=FLATTEN):
            g, r0, mg, pid_m, pid_n = _locate_tile(t, gi, start, m, tile_end, tiles, TILES_N, BM, GROUP_M)
            row0 = r0 + pid_m * BM
            local_m = pid_m * BM + tl.arange(0, BM)
            rmask = local_m < mg
            rows = r0 + local_m
            n0 = pid_n * BN
            offs_n = n0 + tl.arange(0, BN)
            nmask = offs_n < NOUT
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            acc = _mainloop(acc, a_ptr, a_desc, b_ptr, b_desc, g, row0, rows, rmask, n0, offs_n, nmask,
                            KIN, s_am, s_ak, s_bg, s_bk, s_bn, B_KMAJOR, USE_TMA, PREC, BN, BK)
            if HAS_BIAS:
                bias = tl.load(bias_ptr + g.to(tl.int64) * s_biasg + offs_n.to(tl.int64) * s_biasn, mask=nmask, other=0.0)
                acc += bias.to(tl.float32)[None, :]
            # masked pointer store (rows past the group end belong to the next group)
            c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * s_cm + offs_n[None, :] * s_cn  # c: ours, contiguous
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])

    @triton.jit
    def _wgrad_store(acc, o_base, offs_n, nmask, c0, K, mg, s_on, s_ok, ACCUMULATE: tl.constexpr, BC: tl.constexpr):
        """Store (or add into) out[g][n-tile, c0:c0+BC] from the fp32 tile ``acc``."""
        offs_k = c0 + tl.arange(0, BC)
        o_ptrs = o_base + offs_n.to(tl.int64)[:, None] * s_on + offs_k.to(tl.int64)[None, :] * s_ok
        if ACCUMULATE:
            K = tl.where(mg > 0, K, 0)  # empty groups stay untouched
        omask = nmask[:, None] & (offs_k < K)[None, :]
        if ACCUMULATE:
            acc += tl.load(o_ptrs, mask=omask, other=0.0).to(tl.float32)
        tl.store(o_ptrs, acc.to(o_base.dtype.element_ty), mask=omask)

    @triton.jit
    def _ggemm_wgrad_kernel(
        dy_ptr,  # [M, N] (strided)
        x_ptr,  # [M, K] (strided)
        out_ptr,  # [G, N, K] (strided); fp32 or the inputs' dtype
        split_ptr,  # [G] int64
        M, N, K, G,
        s_dym, s_dyn, s_xm, s_xk, s_og, s_on, s_ok,
        ACCUMULATE: tl.constexpr, USE_TMA: tl.constexpr, PREC: tl.constexpr, G_P2: tl.constexpr,
        BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, GROUP_N: tl.constexpr,
    ):
        """out[g] (+)= dy_g.T @ x_g, one [BN, BK] tile per program, grid G * tiles_n * tiles_k."""
        pid = tl.program_id(0)
        tiles_n = tl.cdiv(N, BN)
        tiles_k = tl.cdiv(K, BK)
        per_g = tiles_n * tiles_k
        g = pid // per_g
        local = pid % per_g
        width = GROUP_N * tiles_k
        first_n = (local // width) * GROUP_N
        gsz = tl.minimum(tiles_n - first_n, GROUP_N)
        pid_n = first_n + (local % width) % gsz
        pid_k = (local % width) // gsz
        gi, start, m = _group_table(split_ptr, G, M, G_P2)
        sel = gi == g
        r0 = _pick(start, sel)
        mg = _pick(m, sel)
        n0 = pid_n * BN
        k0 = pid_k * BK
        offs_n = n0 + tl.arange(0, BN)
        offs_k = k0 + tl.arange(0, BK)
        nmask = offs_n < N
        kmask = offs_k < K
        acc = tl.zeros((BN, BK), dtype=tl.float32)
        if USE_TMA:
            # row extent ends at the group's end: TMA zero-fills the next group's rows.
            rows_end = tl.maximum(r0 + mg, 1)  # (never a zero-size descriptor; unused when mg == 0)
            dy_desc = tl.make_tensor_descriptor(dy_ptr, shape=[rows_end, N], strides=[s_dym, 1], block_shape=[BR, BN])
            x_desc = tl.make_tensor_descriptor(x_ptr, shape=[rows_end, K], strides=[s_xm, 1], block_shape=[BR, BK])
            for r in range(0, mg, BR):
                a = tl.trans(dy_desc.load([r0 + r, n0]))
                b = x_desc.load([r0 + r, k0])
                acc = tl.dot(a, b, acc, input_precision=PREC)
        else:
            dy_base = dy_ptr + offs_n.to(tl.int64)[:, None] * s_dyn
            x_base = x_ptr + offs_k.to(tl.int64)[None, :] * s_xk
            for r in range(0, mg, BR):
                lr = r + tl.arange(0, BR)
                rmask = lr < mg
                rows = (r0 + lr).to(tl.int64)
                a = tl.load(dy_base + rows[None, :] * s_dym, mask=nmask[:, None] & rmask[None, :], other=0.0)
                b = tl.load(x_base + rows[:, None] * s_xm, mask=rmask[:, None] & kmask[None, :], other=0.0)
                acc = tl.dot(a, b, acc, input_precision=PREC)
        o_base = out_ptr + g.to(tl.int64) * s_og
        if ACCUMULATE and BK >= 128:  # read-modify-write in two column halves (register pressure)
            acc0, acc1 = _split_cols(acc, BN, BK)
            _wgrad_store(acc0, o_base, offs_n, nmask, k0, K, mg, s_on, s_ok, ACCUMULATE, BK // 2)
            _wgrad_store(acc1, o_base, offs_n, nmask, k0 + BK // 2, K, mg, s_on, s_ok, ACCUMULATE, BK // 2)
        else:
            _wgrad_store(acc, o_base, offs_n, nmask, k0, K, mg, s_on, s_ok, ACCUMULATE, BK)

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
        gi, start, m = _group_table(split_ptr, G, M, G_P2)
        sel = gi == g
        r0 = _pick(start, sel)
        mg = _pick(m, sel)
        offs_n = pid_n * BN + tl.arange(0, BN)
        nmask = offs_n < N
        acc = tl.zeros((BR, BN), dtype=tl.float32)
        for r in range(0, mg, BR):
            lr = r + tl.arange(0, BR)
            ptrs = dy_ptr + (r0 + lr).to(tl.int64)[:, None] * s_dym + offs_n.to(tl.int64)[None, :] * s_dyn
            acc += tl.load(ptrs, mask=(lr < mg)[:, None] & nmask[None, :], other=0.0).to(tl.float32)
        tl.store(db_ptr + g.to(tl.int64) * N + offs_n, tl.sum(acc, 0).to(db_ptr.dtype.element_ty), mask=nmask)

    def _cfg(bm, bn, bk, warps, stages, pps=1, flat=False):
        meta = {"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8, "PPS": pps}
        if flat:  # (kernels default FLATTEN=False; the GLU-fwd kernel has no FLATTEN)
            meta["FLATTEN"] = True
        return triton.Config(meta, num_warps=warps, num_stages=stages)

    def _wcfg(bn, bk, br, warps, stages):
        return triton.Config({"BN": bn, "BK": bk, "BR": br, "GROUP_N": 8}, num_warps=warps, num_stages=stages)

    # Small explicit lists (Hopper, bf16/fp16 first; the small ones serve fp32 "ieee").
    # PPS=2 where two programs fit on an SM (<= 4 warps, <= ~110 KB shared memory); flat: the
    # persistent tile loop is flattened with the K loop (loads of the next tile overlap the epilogue).
    _MN_CONFIGS = [_cfg(128, 256, 64, 8, 3), _cfg(128, 256, 64, 8, 4), _cfg(128, 256, 64, 8, 3, flat=True),
                   _cfg(128, 128, 64, 4, 3, pps=2), _cfg(64, 128, 64, 4, 4, pps=2), _cfg(64, 64, 32, 4, 3, pps=2)]
    # wgrad: long per-group reductions like big tiles; short ones (many small groups) like a small
    # BR and several CTAs per SM (pipeline fill and epilogue of one overlap the others' mainloop).
    _WG_CONFIGS = [_wcfg(128, 256, 64, 8, 3), _wcfg(128, 256, 32, 8, 4), _wcfg(128, 128, 64, 4, 3),
                   _wcfg(128, 128, 32, 4, 4), _wcfg(128, 128, 32, 4, 3), _wcfg(64, 64, 32, 4, 3)]
    _ggemm_tuned = triton.autotune(_MN_CONFIGS, key=["NOUT", "KIN", "USE_TMA", "B_KMAJOR", "HAS_BIAS"])(_ggemm_kernel)
    _wgrad_tuned = triton.autotune(_WG_CONFIGS, key=["N", "K", "USE_TMA", "ACCUMULATE"],
                                   restore_value=["out_ptr"])(_ggemm_wgrad_kernel)
    # Configs used when AUTOTUNE is off: {kernel: (16-bit config, fp32 config)}.
    FIXED_CONFIGS = {"mn": (_cfg(128, 128, 64, 8, 4), _MN_CONFIGS[5]), "wgrad": (_WG_CONFIGS[3], _WG_CONFIGS[5])}

# Autotune on GPU (keyed on N, K, dtype and flags only). FUSIBLE_OPS_GGEMM_AUTOTUNE=0 (or setting
# AUTOTUNE = False) uses FIXED_CONFIGS instead: no tuning pass, e.g. for tests.
AUTOTUNE = os.environ.get("FUSIBLE_OPS_GGEMM_AUTOTUNE", "1") != "0"
# Fixed tiny configs under the interpreter (no autotuning on CPU; persistent loop exercised).
_INTERP_MN = {"BM": 16, "BN": 16, "BK": 16, "GROUP_M": 2}
_INTERP_WG = {"BN": 16, "BK": 16, "BR": 16, "GROUP_N": 2}
_INTERP_PROGS = 3
_TRITON_DTYPES = TRITON_DTYPES


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _g_p2(G: int) -> int:
    return max(2, triton.next_power_of_2(max(G, 1)))


def _persistent_grid(M: int, G: int, n_cols: int, device: torch.device):
    """Persistent grid: min(#SMs, upper bound of the tile count over any split of M rows)."""
    progs = num_sms(device, _INTERP_PROGS)

    def grid(meta):
        max_tiles = (triton.cdiv(M, meta["BM"]) + G) * triton.cdiv(n_cols, meta["BN"])
        return (max(1, min(progs * meta.get("PPS", 1), max_tiles)),)
    return grid


def _run(name: str, tuned, raw, grid, args, const, dtype: torch.dtype, device: torch.device, interp_meta) -> None:
    """One launch: the interpreter's fixed tiny config, the autotuner, or FIXED_CONFIGS[name]."""
    if device.type != "cuda":
        raw[grid(interp_meta)](*args, **const, **interp_meta)
    elif AUTOTUNE:
        tuned[grid](*args, **const)
    else:
        cfg = FIXED_CONFIGS[name][1 if dtype == torch.float32 else 0]
        raw[grid(cfg.kwargs)](*args, **const, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)




def _tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA descriptors need CUDA sm90+, a contiguous last dim, 16-byte aligned base and strides."""
    if os.environ.get("FUSIBLE_OPS_GGEMM_TMA", "1") == "0" or interpreter_enabled():
        return False
    if not hasattr(tl, "make_tensor_descriptor") or not hasattr(triton, "set_allocator"):
        return False
    for t in tensors:
        if not t.is_cuda or t.numel() == 0 or t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if torch.cuda.get_device_capability(t.device)[0] < 9:
            return False
        if any((s * t.element_size()) % 16 for s in t.stride()[:-1]):
            return False
        if t.shape[-1] * t.element_size() < 16:
            return False
    # Device-side descriptors need a global scratch allocation (graph-capturable torch.empty).
    # Triton keeps the allocator per thread (a context variable), and autograd runs backward on
    # its own threads: set it on every call, not once per process.
    triton.set_allocator(_tma_scratch)
    return True


def _tma_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _check(split_sizes: torch.Tensor, G: int, *tensors: torch.Tensor) -> None:
    dev = tensors[0].device
    if split_sizes.dim() != 1 or split_sizes.shape[0] != G:
        raise ValueError(f"split_sizes must be 1-D of length G={G}, got {tuple(split_sizes.shape)}")
    if split_sizes.dtype != torch.int64:
        raise TypeError(f"split_sizes must be int64, got {split_sizes.dtype}")
    for t in (split_sizes, *tensors):
        if t.device != dev:
            raise ValueError(f"all tensors must be on {dev}; got one on {t.device}")


def _same_dtype(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"operands must share a dtype, got {a.dtype} and {b.dtype}")


def _launch_mn(a, b, c, bias, split, nout, kin, s_bk, s_bn, b_kmajor):
    """Launch _ggemm_kernel: c[M, nout] = grouped a[M, kin] @ B_g (+ bias). One launch."""
    M, G = a.shape[0], b.shape[0]
    if M == 0 or nout == 0:
        return c
    use_tma = kin > 0 and _tma_ok(a, b)
    has_bias = bias is not None
    bias_arg = bias if has_bias else c
    s_biasg, s_biasn = (bias.stride(0), bias.stride(1)) if has_bias else (0, 0)
    args = (a, b, c, bias_arg, split, M, nout, kin, G, a.stride(0), a.stride(1), b.stride(0), s_bk, s_bn,
            c.stride(0), c.stride(1), s_biasg, s_biasn)
    const = dict(HAS_BIAS=has_bias, B_KMAJOR=b_kmajor, USE_TMA=use_tma, PREC=_prec(a.dtype), G_P2=_g_p2(G))
    _run("mn", _ggemm_tuned, _ggemm_kernel, _persistent_grid(M, G, nout, a.device), args, const, a.dtype, a.device,
         _INTERP_MN)
    return c


def _launch_wgrad(dy, x, out, split, accumulate):
    M, N = dy.shape
    K, G = x.shape[1], out.shape[0]
    if G == 0 or N == 0 or K == 0:
        return out
    use_tma = M > 0 and _tma_ok(dy, x)
    args = (dy, x, out, split, M, N, K, G, dy.stride(0), dy.stride(1), x.stride(0), x.stride(1),
            out.stride(0), out.stride(1), out.stride(2))
    const = dict(ACCUMULATE=accumulate, USE_TMA=use_tma, PREC=_prec(x.dtype), G_P2=_g_p2(G))
    _run("wgrad", _wgrad_tuned, _ggemm_wgrad_kernel,
         lambda meta: (G * triton.cdiv(N, meta["BN"]) * triton.cdiv(K, meta["BK"]),), args, const, x.dtype, x.device,
         _INTERP_WG)
    return out


# ----------------------------------------------------------------------------- custom ops
@kernel_op("fusible_ops::grouped_gemm_fwd", mutates_args=())
def _grouped_gemm_fwd_op(x: torch.Tensor, w: torch.Tensor, split_sizes: torch.Tensor,
                         bias: Optional[torch.Tensor]) -> torch.Tensor:
    y = torch.empty((x.shape[0], w.shape[1]), dtype=x.dtype, device=x.device)
    return _launch_mn(x, w, y, bias, split_sizes, w.shape[1], x.shape[1], w.stride(2), w.stride(1), True)


@_grouped_gemm_fwd_op.register_fake
def _(x, w, split_sizes, bias):
    return x.new_empty((x.shape[0], w.shape[1]))


@kernel_op("fusible_ops::grouped_gemm_dgrad", mutates_args=())
def _grouped_gemm_dgrad_op(dy: torch.Tensor, w: torch.Tensor, split_sizes: torch.Tensor) -> torch.Tensor:
    dx = torch.empty((dy.shape[0], w.shape[2]), dtype=dy.dtype, device=dy.device)
    return _launch_mn(dy, w, dx, None, split_sizes, w.shape[2], w.shape[1], w.stride(1), w.stride(2), False)


@_grouped_gemm_dgrad_op.register_fake
def _(dy, w, split_sizes):
    return dy.new_empty((dy.shape[0], w.shape[2]))


@kernel_op("fusible_ops::grouped_gemm_wgrad", mutates_args=())
def _grouped_gemm_wgrad_op(dy: torch.Tensor, x: torch.Tensor, split_sizes: torch.Tensor) -> torch.Tensor:
    out = torch.empty((split_sizes.shape[0], dy.shape[1], x.shape[1]), dtype=x.dtype, device=x.device)
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
    db = torch.empty((G, N), dtype=dy.dtype, device=dy.device)
    if G == 0 or N == 0:
        return db
    BN = 16 if (interpreter_enabled() and not dy.is_cuda) else 64
    BR = 16 if BN == 16 else 32
    _group_colsum_kernel[(triton.cdiv(N, BN), G)](dy, db, split_sizes, M, N, G, dy.stride(0), dy.stride(1),
                                                   G_P2=_g_p2(G), BR=BR, BN=BN)
    return db


@_grouped_bias_grad_op.register_fake
def _(dy, split_sizes):
    return dy.new_empty((split_sizes.shape[0], dy.shape[1]))


# ----------------------------------------------------------------------------- public API
def grouped_gemm_fwd(x: torch.Tensor, w: torch.Tensor, split_sizes: torch.Tensor,
                     bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Grouped linear forward: ``y[rows of g] = x_g @ w[g].T (+ bias[g])``.

    x [M, K], w [G, N, K] (same dtype: bf16/fp16/fp32; float64 runs the ref), bias [G, N] or
    None, split_sizes [G] int64 on x's device. Returns y [M, N] in x's dtype (fp32 accumulate;
    fp32 inputs use IEEE fp32 dot). Any strides; sync-free; one launch.
    """
    G = w.shape[0]
    _check(split_sizes, G, x, w, *([bias] if bias is not None else []))
    _same_dtype(x, w)
    if use_triton(x, w, split_sizes, bias) and x.dtype in _TRITON_DTYPES:
        return _grouped_gemm_fwd_op(x, w, split_sizes, bias)
    return grouped_gemm_fwd_ref(x, w, split_sizes, bias)


def grouped_gemm_dgrad(dy: torch.Tensor, w: torch.Tensor, split_sizes: torch.Tensor) -> torch.Tensor:
    """Grouped linear input gradient: ``dx_g = dy_g @ w[g]``.

    dy [M, N], w [G, N, K], split_sizes [G] int64. Returns dx [M, K] in dy's dtype (fp32 accumulate).
    """
    _check(split_sizes, w.shape[0], dy, w)
    _same_dtype(dy, w)
    if use_triton(dy, w, split_sizes) and dy.dtype in _TRITON_DTYPES:
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
    _check(split_sizes, G, dy, x, *([out] if out is not None else []))
    _same_dtype(dy, x)
    if out is not None and tuple(out.shape) != (G, dy.shape[1], x.shape[1]):
        raise ValueError(f"out must be [G, N, K] = {(G, dy.shape[1], x.shape[1])}, got {tuple(out.shape)}")
    if use_triton(dy, x, split_sizes, out) and x.dtype in _TRITON_DTYPES and (
            out is None or out.dtype in _TRITON_DTYPES):
        if out is None:
            return _grouped_gemm_wgrad_op(dy, x, split_sizes)
        _grouped_gemm_wgrad_out_op(dy, x, split_sizes, out, accumulate)
        return out
    return grouped_gemm_wgrad_ref(dy, x, split_sizes, out, accumulate)


def grouped_bias_grad(dy: torch.Tensor, split_sizes: torch.Tensor) -> torch.Tensor:
    """Per-group column sums: ``db[g] = dy_g.sum(0)``, [G, N] in dy's dtype (fp32 accumulate).

    Deterministic (no atomics), sync-free; empty groups give zeros.
    """
    _check(split_sizes, split_sizes.shape[0], dy)
    if use_triton(dy, split_sizes) and dy.dtype in _TRITON_DTYPES:
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


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def grouped_gemm_fwd_ref(x: torch.Tensor, w: torch.Tensor, split_sizes: torch.Tensor,
                         bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Pure-torch twin of :func:`grouped_gemm_fwd` (per-group loop, fp32 math, syncs)."""
    acc = _acc_dtype(x.dtype)
    if torch.compiler.is_compiling():
        r = x.to(acc)[None] @ w.to(acc).transpose(1, 2)
        if bias is not None:
            r = r + bias.to(acc)[:, None, :]
        return torch.where(_group_mask(split_sizes, x.shape[0], x.device), r, 0).sum(0).to(x.dtype)
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
    acc = _acc_dtype(dy.dtype)
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
    acc = _acc_dtype(x.dtype)
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
    acc = _acc_dtype(dy.dtype)
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
