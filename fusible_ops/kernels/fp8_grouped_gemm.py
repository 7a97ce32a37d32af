"""FP8 grouped GEMMs for MoE experts (Triton, Hopper), beside pure-torch ``*_ref`` twins.

Grouping contract, no-host-sync guarantee and persistent tile space: those of
:mod:`fusible_ops.kernels.persistent` (split sizes read on the device; empty groups and zero
rows valid; graph-capturable with other split values of the same total).

Operands are FP8 bytes (``float8_e4m3fn`` / ``float8_e5m2``) with one fp32 ``scale_inv`` each
(per-tensor scaling; value = byte * scale_inv). Hopper's FP8 MMA reads both operands K-major
(the reduction dim contiguous), so every operand comes in that layout:

* :func:`fp8_grouped_mm` ``c[rows of g] = a_g @ b[g].T``, a [M, K], b [G, N, K]: forward
  (b = the weight [G, out, in]) and input gradient (b = the weight's per-group transposed copy
  [G, in, out], made once per weight change by the weight cache).
* :func:`fp8_grouped_wgrad` ``out[g] (+)= a_t[:, rows of g] @ b_t[:, rows of g].T``, a_t [N, M],
  b_t [K, M]: the weight gradient from the column-wise copies of the output gradient and the
  input (written by their casts in the same pass as the row-wise bytes).

The fp32 accumulator is multiplied by ``scale_inv_a * scale_inv_b`` (then + bias) and stored in
the output dtype, or added into an fp32 buffer (``main_grad``).

Block scaling (DeepSeek-V3): ``a`` in 1x128 tiles along K (scale_inv [M, K/128]), ``b`` in
128x128 blocks per group (scale_inv [G, N/128, K/128]); each 128-wide K step's partial product
is scaled by its tile's and block's scales before it joins the fp32 accumulator. The weight
gradient reduces over tokens, so its operands' 1x128 tiles run along M and must not span two
groups: :func:`pad_groups` copies a [M, C] operand into a zero-padded [Mp, C] layout in which
every group starts on a multiple of 128 rows (``Mp`` = :func:`padded_rows`, a bound that depends
only on M and G, so CUDA graphs can replay other split sizes); its column-wise cast then has
tiles inside one group, and the kernel walks each group's padded rows in 128-row chunks. Under Triton's interpreter the
operands may be fp16/fp32 tensors holding FP8 values (FP8 ``tl.dot`` is not emulated there); FP8
tensors on the CPU run the ``*_ref`` (fp32 math on the dequantized values).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import HAS_TRITON, use_triton
from .fp8_cast import cast_block_mapped
from .fp8_gemm import fp8_capable
from .grouped_gemm import grouped_gemm_fwd_ref, grouped_gemm_wgrad_ref
from .launch import DirectKernel, TunedKernel, cdiv, dot_precision, generic_key, kernel_op
from .persistent import (INTERP_MN, INTERP_WG, check_splits, group_p2, persistent_grid, tma_ok, wgrad_grid,
                         wgrad_tma_out)

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_CARRIERS = (torch.float16, torch.float32)  # interpreter stand-ins for FP8 bytes

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .persistent import (group_table, mainloop, mn_config, operand_descs, pick, tile_coords, tile_space,
                             wgrad_config, wgrad_epilogue, wgrad_out_desc, wgrad_schedule, wgrad_tile)

    @triton.jit
    def _fp8_ggemm_kernel(
        a_ptr,  # [M, K] FP8, K contiguous
        b_ptr,  # [G, N, K] FP8, K contiguous
        c_ptr,  # [M, N] output
        sa_ptr, sb_ptr,  # fp32 scale_inv of a and b (one element each; BLOCK: [M, KB] and [G, NB, KB])
        bias_ptr,  # [G, N] or a dummy pointer
        split_ptr,  # [G] int64
        M, N, K, G, s_am, s_bg, s_bn, s_cm, s_biasg,
        s_sam, s_sak, s_sbg, s_sbn, s_sbk,  # BLOCK: strides of the scale_inv tensors (else 0)
        HAS_BIAS: tl.constexpr, USE_TMA: tl.constexpr, PREC: tl.constexpr, G_P2: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
        FLATTEN: tl.constexpr = False, PPS: tl.constexpr = 1, BLOCK: tl.constexpr = False,
    ):
        """c[rows of g] = (a_g @ b_g.T) * sa * sb (+ bias[g]); persistent over all groups' tiles.
        ``BLOCK``: 1x128 / 128x128 scales applied per 128-wide K step (BK divides 128)."""
        gi, start, m, tiles, tile_end, total, TILES_N = tile_space(split_ptr, G, M, N, G_P2, BM, BN)
        a_desc, b_desc = operand_descs(a_ptr, b_ptr, M, K, N, G, s_am, s_bg, 1, s_bn, True, USE_TMA, BM, BN, BK)
        if not BLOCK:
            scale = tl.load(sa_ptr).to(tl.float32) * tl.load(sb_ptr).to(tl.float32)
        for t in tl.range(tl.program_id(0), total, tl.num_programs(0), flatten=FLATTEN):
            g, row0, rows, rmask, n0, offs_n, nmask = tile_coords(t, gi, start, m, tile_end, tiles, TILES_N, N,
                                                                  BM, BN, GROUP_M)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            if BLOCK:
                acc = _block_mainloop(acc, a_ptr, a_desc, b_ptr, b_desc, sa_ptr, sb_ptr, g, row0, rows, rmask, n0,
                                      offs_n, nmask, K, s_am, s_bg, s_bn, s_sam, s_sak, s_sbg, s_sbn, s_sbk,
                                      USE_TMA, PREC, BN, BK)
            else:
                acc = mainloop(acc, a_ptr, a_desc, b_ptr, b_desc, g, row0, rows, rmask, n0, offs_n, nmask,
                               K, s_am, 1, s_bg, 1, s_bn, True, USE_TMA, PREC, BN, BK)
                acc = acc * scale
            if HAS_BIAS:
                bias = tl.load(bias_ptr + g.to(tl.int64) * s_biasg + offs_n, mask=nmask, other=0.0)
                acc += bias.to(tl.float32)[None, :]
            c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * s_cm + offs_n[None, :]
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])

    @triton.jit
    def _block_mainloop(acc, a_ptr, a_desc, b_ptr, b_desc, sa_ptr, sb_ptr, g, row0, rows, rmask, n0, offs_n, nmask,
                        K, s_am, s_bg, s_bn, s_sam, s_sak, s_sbg, s_sbn, s_sbk,
                        USE_TMA: tl.constexpr, PREC: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """acc += sum over K steps of (A[rows, k] @ B_g[n, k].T) * sa[rows, k // 128] * sb[g, n // 128, k // 128]:
        each step's product scaled by its 1x128 tile (rows of A) and 128x128 block (columns) scales.

        BN divides 128, so a tile's columns lie in one 128-wide block of B: its scale is one number
        per K step, and the promotion is one FMA per accumulator element (``acc + p * s[:, None]``
        with ``s = sa * sb``). Two multiplies per element (``p * sa * sb[None, :]``) measured 13-16%
        slower on the 8-expert shapes (H200), the promotion's vector work being on the MMA's path."""
        tl.static_assert(128 % BN == 0, "block-scaled tiles must not span two 128-wide blocks of B")
        sa_rows = sa_ptr + rows.to(tl.int64) * s_sam
        sb_tile = sb_ptr + g.to(tl.int64) * s_sbg + (n0 // 128).to(tl.int64) * s_sbn
        a_row = a_ptr + rows.to(tl.int64)[:, None] * s_am
        b_base = b_ptr + g.to(tl.int64) * s_bg + offs_n.to(tl.int64)[None, :] * s_bn
        for k0 in range(0, K, BK):
            if USE_TMA:
                a = a_desc.load([row0, k0])
                b = tl.trans(tl.reshape(b_desc.load([g, n0, k0]), (BN, BK)))
            else:
                offs_k = k0 + tl.arange(0, BK)
                kmask = offs_k < K
                a = tl.load(a_row + offs_k.to(tl.int64)[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
                b = tl.load(b_base + offs_k.to(tl.int64)[:, None], mask=kmask[:, None] & nmask[None, :], other=0.0)
            kb = k0 // 128
            s = tl.load(sa_rows + kb * s_sak, mask=rmask, other=0.0) * tl.load(sb_tile + kb * s_sbk)
            acc = acc + tl.dot(a, b, input_precision=PREC) * s[:, None]
        return acc

    @triton.jit
    def _padded_group_table(split_ptr, G, MP, G_P2: tl.constexpr):
        """:func:`group_table` of the layout of :func:`pad_groups` (each group starts on a multiple
        of 128 rows): per-group (index, row start, rows) as [G_P2] int32 vectors, clamped to the
        MP rows there are (bad split sizes read nothing out of bounds; they are reported by the
        device-side split check)."""
        gi = tl.arange(0, G_P2)
        m = tl.maximum(tl.load(split_ptr + gi, mask=gi < G, other=0), 0)
        padded = (m + 127) // 128 * 128
        start = tl.minimum(tl.cumsum(padded, 0) - padded, MP)
        return gi, start.to(tl.int32), tl.minimum(m, MP - start).to(tl.int32)

    @triton.jit
    def _padded_rowmap_kernel(split_ptr, out_ptr, G, M, MP, G_P2: tl.constexpr):
        """:func:`padded_rowmap`: program p fills rows [128 p, 128 p + 128) of the padded layout,
        which lie in one group's padded rows (each starts on a multiple of 128) or past them all."""
        p0 = tl.program_id(0) * 128
        gi, start, m = group_table(split_ptr, G, M, G_P2)
        padded = (m + 127) // 128 * 128
        pstart = tl.cumsum(padded, 0) - padded
        sel = (gi < G) & (pstart <= p0) & (p0 < pstart + padded)
        found = tl.sum(sel.to(tl.int32), 0) > 0
        local = p0 - pick(pstart, sel) + tl.arange(0, 128)
        src = tl.where(found & (local < pick(m, sel)), pick(start, sel) + local, -1)
        p = p0 + tl.arange(0, 128)
        tl.store(out_ptr + p, src, mask=p < MP)

    @triton.jit
    def _wgrad_block_loop(acc, at_ptr, bt_ptr, a_desc, b_desc, sat_ptr, sbt_ptr, r0, mg, n0, k0, offs_n, offs_k,
                          nmask, kmask, s_at, s_bt, s_san, s_sar, s_sbk, s_sbr,
                          USE_TMA: tl.constexpr, PREC: tl.constexpr, BR: tl.constexpr):
        """acc += sum over the group's padded 128-row chunks c of (a_t[n, c] @ b_t[k, c].T) * sat[n, c] * sbt[k, c]
        (padding rows are zeros: no row mask; chunks never leave the padded buffer)."""
        a_rows = at_ptr + offs_n.to(tl.int64)[:, None] * s_at
        b_rows = bt_ptr + offs_k.to(tl.int64)[:, None] * s_bt
        sa_base = sat_ptr + offs_n.to(tl.int64) * s_san
        sb_base = sbt_ptr + offs_k.to(tl.int64) * s_sbk
        for r in range(0, mg, BR):
            if USE_TMA:
                a = a_desc.load([n0, r0 + r])
                b = b_desc.load([k0, r0 + r])
            else:
                cols = (r0 + r + tl.arange(0, BR)).to(tl.int64)[None, :]
                a = tl.load(a_rows + cols, mask=nmask[:, None], other=0.0)
                b = tl.load(b_rows + cols, mask=kmask[:, None], other=0.0)
            c = (r0 + r) // 128
            sa = tl.load(sa_base + c * s_sar, mask=nmask, other=0.0)
            sb = tl.load(sb_base + c * s_sbr, mask=kmask, other=0.0)
            acc += tl.dot(a, tl.trans(b), input_precision=PREC) * sa[:, None] * sb[None, :]
        return acc

    @triton.jit
    def _wgrad_ptr_loop(acc, at_ptr, bt_ptr, r0, mg, offs_n, offs_k, nmask, kmask, s_at, s_bt,
                        PREC: tl.constexpr, BR: tl.constexpr):
        """acc += a_t[n tile, rows of g] @ b_t[k tile, rows of g].T through masked pointer loads."""
        a_base = at_ptr + offs_n.to(tl.int64)[:, None] * s_at
        b_base = bt_ptr + offs_k.to(tl.int64)[:, None] * s_bt
        for r in tl.range(0, mg, BR, num_stages=1):  # (not pipelined: no shared-memory ring of its own)
            lr = r + tl.arange(0, BR)
            cols = (r0 + lr).to(tl.int64)[None, :]
            rmask = (lr < mg)[None, :]
            a = tl.load(a_base + cols, mask=nmask[:, None] & rmask, other=0.0)
            b = tl.load(b_base + cols, mask=kmask[:, None] & rmask, other=0.0)
            acc = tl.dot(a, tl.trans(b), acc, input_precision=PREC)
        return acc

    @triton.jit
    def _fp8_ggemm_wgrad_kernel(
        at_ptr,  # [N, M] FP8 (the output gradient's column-wise copy), M contiguous
        bt_ptr,  # [K, M] FP8 (the input's column-wise copy), M contiguous
        out_ptr,  # [G, N, K] (strided): fp32 main_grad or the weight's dtype
        sa_ptr, sb_ptr, split_ptr,
        M, N, K, G, s_at, s_bt, s_og, s_on, s_ok,
        s_san, s_sar, s_sbk, s_sbr,  # BLOCK: strides of the scale_inv tensors [N, Mp/128], [K, Mp/128]
        ACCUMULATE: tl.constexpr, USE_TMA: tl.constexpr, OUT_TMA: tl.constexpr, PREC: tl.constexpr,
        G_P2: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, GROUP_N: tl.constexpr,
        BLOCK: tl.constexpr = False, PPS: tl.constexpr = 0, TMA_STORE: tl.constexpr = False,
    ):
        """out[g] (+)= (a_t[:, rows of g] @ b_t[:, rows of g].T) * sa * sb over [BN, BK] tiles
        (:func:`wgrad_schedule`: one per program, or persistent). ``BLOCK``: a_t, b_t in the padded
        layout of :func:`pad_groups` (M = Mp) with 1x128 scales along it, applied per 128-row chunk.
        TMA descriptors span all M columns and are made once per program."""
        first, total, step = wgrad_schedule(N, K, G, BN, BK, PPS)
        if USE_TMA:
            a_desc = tl.make_tensor_descriptor(at_ptr, shape=[N, M], strides=[s_at, 1], block_shape=[BN, BR])
            b_desc = tl.make_tensor_descriptor(bt_ptr, shape=[K, M], strides=[s_bt, 1], block_shape=[BK, BR])
            ae_desc = tl.make_tensor_descriptor(at_ptr, shape=[N, M], strides=[s_at, 1], block_shape=[BN, 32])
            be_desc = tl.make_tensor_descriptor(bt_ptr, shape=[K, M], strides=[s_bt, 1], block_shape=[BK, 32])
        else:
            a_desc = at_ptr
            b_desc = bt_ptr
            ae_desc = at_ptr
            be_desc = bt_ptr
        o_desc = wgrad_out_desc(out_ptr, G, N, K, s_og, s_on, OUT_TMA, TMA_STORE, BN, BK)
        if BLOCK:
            gi, start, m = _padded_group_table(split_ptr, G, M, G_P2)
        else:
            gi, start, m = group_table(split_ptr, G, M, G_P2)
            scale = tl.load(sa_ptr).to(tl.float32) * tl.load(sb_ptr).to(tl.float32)
        for t in range(first, total, step):
            g, r0, mg, n0, k0, offs_n, offs_k, nmask, kmask = wgrad_tile(t, gi, start, m, N, K, BN, BK, GROUP_N)
            acc = tl.zeros((BN, BK), dtype=tl.float32)
            if BLOCK:
                acc = _wgrad_block_loop(acc, at_ptr, bt_ptr, a_desc, b_desc, sa_ptr, sb_ptr, r0, mg, n0, k0, offs_n,
                                        offs_k, nmask, kmask, s_at, s_bt, s_san, s_sar, s_sbk, s_sbr, USE_TMA, PREC, BR)
            else:
                acc = _wgrad_tensor_loop(acc, at_ptr, bt_ptr, a_desc, b_desc, ae_desc, be_desc, r0, mg, n0, k0, offs_n,
                                         offs_k, nmask, kmask, s_at, s_bt, USE_TMA, PREC, BR)
                acc = acc * scale
            wgrad_epilogue(acc, out_ptr, o_desc, g, s_og, n0, offs_n, nmask, k0, K, mg, s_on, s_ok, ACCUMULATE,
                           OUT_TMA, TMA_STORE, BN, BK)

    @triton.jit
    def _wgrad_edge(acc, ae_desc, be_desc, n0, k0, c0, lo, hi, PREC: tl.constexpr):
        """acc += a_t[n tile, c] @ b_t[k tile, c].T over the columns c of [c0, c0 + 32) inside
        [lo, hi): one 32-wide TMA chunk (c0 16-aligned; TMA zero-fills past M), the columns
        outside zeroed in registers on both operands (no pointer tensors: masked pointer loads
        along the contiguous dim made the kernel spill)."""
        cols = c0 + tl.arange(0, 32)
        keep = ((cols >= lo) & (cols < hi))[None, :]
        a = ae_desc.load([n0, c0])
        b = be_desc.load([k0, c0])
        a = tl.where(keep, a, tl.zeros_like(a))
        b = tl.where(keep, b, tl.zeros_like(b))
        return tl.dot(a, tl.trans(b), acc, input_precision=PREC)

    @triton.jit
    def _wgrad_tensor_loop(acc, at_ptr, bt_ptr, a_desc, b_desc, ae_desc, be_desc, r0, mg, n0, k0, offs_n, offs_k,
                           nmask, kmask, s_at, s_bt, USE_TMA: tl.constexpr, PREC: tl.constexpr, BR: tl.constexpr):
        """acc += a_t[n tile, rows of g] @ b_t[k tile, rows of g].T (per-tensor operands).

        TMA reads whole BR-column chunks from the group's first 16-aligned column h (loads start on
        16-byte boundaries: an unaligned start faulted on the H200). The < 16 columns before h and
        the last partial chunk are 32-wide TMA chunks from 16-aligned columns with the columns
        outside the group zeroed in registers (:func:`_wgrad_edge`), so no other group's column
        counts. (Sending every group with an unaligned start or size to the pointer loop made the
        whole weight gradient ~50x slower under real routing's split sizes: H200, 2026-11-25.)"""
        if USE_TMA:
            end = r0 + mg
            h = tl.minimum((r0 + 15) // 16 * 16, end)
            full = (end - h) // BR * BR
            if h > r0:
                acc = _wgrad_edge(acc, ae_desc, be_desc, n0, k0, r0 // 16 * 16, r0, h, PREC)
            for r in range(h, h + full, BR):
                acc = tl.dot(a_desc.load([n0, r]), tl.trans(b_desc.load([k0, r])), acc, input_precision=PREC)
            for c in range(h + full, end, 32):
                acc = _wgrad_edge(acc, ae_desc, be_desc, n0, k0, c, c, end, PREC)
        else:
            acc = _wgrad_ptr_loop(acc, at_ptr, bt_ptr, r0, mg, offs_n, offs_k, nmask, kmask, s_at, s_bt, PREC, BR)
        return acc

    # Hopper FP8 tiles: BK = 128 (one 128-byte swizzle row per operand row).
    _MM_CONFIGS = [mn_config(128, 256, 128, 8, 3), mn_config(128, 256, 128, 8, 4),
                   mn_config(128, 256, 128, 8, 3, flat=True), mn_config(128, 128, 128, 8, 4),
                   mn_config(128, 128, 128, 4, 4, pps=2), mn_config(64, 128, 128, 4, 4, pps=2)]
    # Short per-group reductions (few rows per expert): persistent, two programs per SM, TMA-store
    # epilogue. H200, 64 experts of 256 rows, FC1 (N=2816, K=2048), bf16 out, harness: 0.350 ms
    # (1040 us with only the first six: one CTA per SM at 4 stages). The group edges as masked TMA
    # chunks (_wgrad_edge) keep these configs from spilling; with masked pointer loads at the edges
    # the same configs spilled (offline compiles: 304-708 B in 8 of 11 with Triton 3.6, 290-1460 B
    # in 9 with 3.9) and took 0.52-0.67 ms.
    _WG_CONFIGS = [wgrad_config(128, 256, 128, 8, 3), wgrad_config(128, 256, 64, 8, 4),
                   wgrad_config(128, 128, 128, 8, 4), wgrad_config(128, 128, 128, 4, 4),
                   wgrad_config(128, 128, 64, 4, 4), wgrad_config(64, 64, 64, 4, 3),
                   wgrad_config(128, 128, 128, 4, 3), wgrad_config(128, 128, 128, 4, 2, pps=2, tma_out=True),
                   wgrad_config(128, 128, 128, 4, 3, pps=2), wgrad_config(128, 128, 128, 8, 3, pps=2),
                   wgrad_config(128, 256, 128, 8, 3, pps=1, tma_out=True)]
    # Block scaling keeps a second fp32 tile (each K step's partial product) live: smaller tiles.
    _MM_BLOCK_CONFIGS = [mn_config(128, 128, 128, 8, 3), mn_config(128, 128, 128, 8, 4), mn_config(128, 128, 128, 8, 5),
                         mn_config(128, 64, 128, 4, 4), mn_config(64, 128, 128, 4, 4, pps=2),
                         mn_config(64, 128, 128, 4, 3, pps=2),
                         mn_config(64, 64, 128, 4, 3, pps=2)]
    _WG_BLOCK_CONFIGS = [wgrad_config(128, 128, 128, 8, 3), wgrad_config(128, 128, 64, 8, 4),
                         wgrad_config(64, 128, 128, 4, 3), wgrad_config(128, 64, 128, 4, 4),
                         wgrad_config(64, 64, 64, 4, 3)]
    _MM_KEY = ["N", "K", "USE_TMA", "HAS_BIAS"]
    _WG_KEY = ["N", "K", "USE_TMA", "OUT_TMA", "ACCUMULATE"]
    MM_KERNEL = TunedKernel(_fp8_ggemm_kernel, _MM_CONFIGS, _MM_KEY, (_MM_CONFIGS[0], _MM_CONFIGS[5]), INTERP_MN,
                            fit={"N": "BN", "K": "BK"})
    WGRAD_KERNEL = TunedKernel(_fp8_ggemm_wgrad_kernel, _WG_CONFIGS, _WG_KEY, (_WG_CONFIGS[0], _WG_CONFIGS[5]),
                               INTERP_WG, restore_value=["out_ptr"], fit={"N": "BN", "K": "BK"})
    MM_BLOCK_KERNEL = TunedKernel(_fp8_ggemm_kernel, _MM_BLOCK_CONFIGS, _MM_KEY,
                                  (_MM_BLOCK_CONFIGS[0], _MM_BLOCK_CONFIGS[0]), INTERP_MN)
    WGRAD_BLOCK_KERNEL = TunedKernel(_fp8_ggemm_wgrad_kernel, _WG_BLOCK_CONFIGS, _WG_KEY,
                                     (_WG_BLOCK_CONFIGS[0], _WG_BLOCK_CONFIGS[0]), INTERP_WG, restore_value=["out_ptr"])
    _ROWMAP = DirectKernel(_padded_rowmap_kernel)


# ----------------------------------------------------------------------------- launchers
def _launch_mm(a, sa, b, sb, bias, split, out_dtype):
    M, K = a.shape
    G, N = b.shape[0], b.shape[1]
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    has_bias = bias is not None
    bias_arg = bias if has_bias else c
    block = sa.dim() == 2  # 1x128 tiles [M, KB] (and 128x128 blocks [G, NB, KB])
    # everything build() reads but the pointers (launch_cached: later calls skip build)
    key = (a.shape, a.stride(), b.shape, b.stride(), c.stride(), sa.shape, sa.stride(), sb.shape, sb.stride(),
           bias.stride() if has_bias else None, a.dtype, b.dtype, c.dtype, sa.dtype, sb.dtype, bias_arg.dtype,
           split.dtype, a.device)

    def build():
        sstrides = (*sa.stride(), *sb.stride()) if block else (0,) * 5
        args = (a, b, c, sa, sb, bias_arg, split, M, N, K, G, a.stride(0), b.stride(0), b.stride(1), c.stride(0),
                bias.stride(0) if has_bias else 0, *sstrides)
        const = dict(HAS_BIAS=has_bias, USE_TMA=K > 0 and tma_ok(a, b), PREC=dot_precision(a.dtype),
                     G_P2=group_p2(G), BLOCK=block)
        return args, const, persistent_grid(M, G, N, a.device)
    (MM_BLOCK_KERNEL if block else MM_KERNEL).launch_cached(key, (a, b, c, sa, sb, bias_arg, split), build, a.dtype,
                                                            a.device)
    return c


def _launch_wgrad(at, sa, bt, sb, split, out, accumulate):
    N, M = at.shape
    K, G = bt.shape[0], out.shape[0]
    if G == 0 or N == 0 or K == 0:
        return out
    block = sa.dim() == 2  # padded layout, 1x128 tiles along M: [N, Mp/128], [K, Mp/128]
    key = (at.shape, at.stride(), bt.shape, bt.stride(), out.shape, out.stride(), sa.shape, sa.stride(), sb.shape,
           sb.stride(), at.dtype, bt.dtype, out.dtype, sa.dtype, sb.dtype, split.dtype, at.device, accumulate)

    def build():
        sstrides = (*sa.stride(), *sb.stride()) if block else (0,) * 4
        args = (at, bt, out, sa, sb, split, M, N, K, G, at.stride(0), bt.stride(0), out.stride(0), out.stride(1),
                out.stride(2), *sstrides)
        const = dict(ACCUMULATE=accumulate, USE_TMA=M > 0 and tma_ok(at, bt), OUT_TMA=wgrad_tma_out(out, accumulate),
                     PREC=dot_precision(at.dtype), G_P2=group_p2(G), BLOCK=block)
        return args, const, wgrad_grid(G, N, K, at.device)
    (WGRAD_BLOCK_KERNEL if block else WGRAD_KERNEL).launch_cached(key, (at, bt, out, sa, sb, split), build, at.dtype,
                                                                  at.device)
    return out


@kernel_op("fusible_ops::fp8_grouped_mm", mutates_args=())
def _fp8_grouped_mm_op(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                       bias: Optional[torch.Tensor], split_sizes: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return _launch_mm(a, sa, b, sb, bias, split_sizes, out_dtype)


@_fp8_grouped_mm_op.register_fake
def _(a, sa, b, sb, bias, split_sizes, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@kernel_op("fusible_ops::fp8_grouped_wgrad_out", mutates_args=("out",))
def _fp8_grouped_wgrad_op(at: torch.Tensor, sa: torch.Tensor, bt: torch.Tensor, sb: torch.Tensor,
                          split_sizes: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    _launch_wgrad(at, sa, bt, sb, split_sizes, out, accumulate)


@_fp8_grouped_wgrad_op.register_fake
def _(at, sa, bt, sb, split_sizes, out, accumulate):
    return None


# ----------------------------------------------------------------------------- padded layout
def padded_rows(M: int, G: int) -> int:
    """Rows of :func:`pad_groups`' layout for M rows in G groups: a bound on sum_g ceil(m_g/128)*128
    that depends only on M and G (a multiple of 128)."""
    return cdiv(M + 127 * G, 128) * 128


def padded_index(split_sizes: torch.Tensor, M: int) -> torch.Tensor:
    """[M] int64: the row of :func:`pad_groups`' layout that row i goes to (group g's rows start at
    sum_{h<g} ceil(m_h/128)*128). Device ops only: no host sync. Split sizes that are negative or
    do not sum to M (reported by the device-side split check) give clamped indices, never one
    outside the layout."""
    G = split_sizes.shape[0]
    ends = torch.cumsum(split_sizes, 0)
    padded = (split_sizes + 127) // 128 * 128
    shift = (torch.cumsum(padded, 0) - padded) - (ends - split_sizes)  # padded start - start, per group
    rows = torch.arange(M, device=split_sizes.device)
    group = torch.searchsorted(ends, rows, right=True).clamp_(max=max(G - 1, 0))
    return (rows + shift[group]).clamp_(0, padded_rows(M, G) - 1)


def pad_groups(x: torch.Tensor, split_sizes: torch.Tensor) -> torch.Tensor:
    """``x`` [M, C] copied into a zero-filled [padded_rows(M, G), C] in which every group starts on a
    multiple of 128 rows: the column-wise 1x128 cast of the result has no tile spanning two groups
    (the block-scaled weight gradient's operands). No row is lost: row i lands at
    ``padded_index(split_sizes, M)[i]``, distinct rows at distinct places."""
    M = x.shape[0]
    out = x.new_zeros((padded_rows(M, split_sizes.shape[0]), x.shape[1]))
    if M:
        out.index_copy_(0, padded_index(split_sizes, M), x)
    return out


def padded_rowmap(split_sizes: torch.Tensor, M: int) -> torch.Tensor:
    """int32 [padded_rows(M, G)]: the row of the M-row input at each row of :func:`pad_groups`'
    layout, -1 for a padding row (the inverse of :func:`padded_index`). One launch (Triton), or
    the torch ops of :func:`padded_rowmap_ref`; no host sync either way. Split sizes that are
    negative or do not sum to M (reported by the device-side split check) never map a row
    outside [0, M). Traced by torch.compile: the torch ops."""
    G = split_sizes.shape[0]
    if not (HAS_TRITON and use_triton(split_sizes)) or M == 0 or torch.compiler.is_compiling():
        return padded_rowmap_ref(split_sizes, M)
    MP = padded_rows(M, G)
    rowmap = torch.empty(MP, dtype=torch.int32, device=split_sizes.device)
    args, meta = (split_sizes, rowmap, G, M, MP), dict(G_P2=group_p2(G), num_warps=1)
    _ROWMAP((MP // 128,), generic_key(args, meta), args, meta)
    return rowmap


def padded_rowmap_ref(split_sizes: torch.Tensor, M: int) -> torch.Tensor:
    """Pure-torch twin of :func:`padded_rowmap` (built from :func:`padded_index`)."""
    rowmap = torch.full((padded_rows(M, split_sizes.shape[0]),), -1, dtype=torch.int32, device=split_sizes.device)
    if M:
        rowmap[padded_index(split_sizes, M)] = torch.arange(M, dtype=torch.int32, device=split_sizes.device)
    return rowmap


def cast_block_padded(x: torch.Tensor, split_sizes: torch.Tensor, pow2: bool = False):
    """``x`` [M, K] cast in 1x128 tiles, row-wise as is and column-wise in :func:`pad_groups`'
    layout (the block-scaled weight gradient's operand), from one read of ``x``: ``(q, scale_inv,
    qt [K, Mp], scale_inv_t)``, bit-identical to ``cast_block(x)`` and the transposed
    ``cast_block(pad_groups(x, split_sizes), transposed=True)`` (no padded copy is made)."""
    return cast_block_mapped(x, padded_rowmap(split_sizes, x.shape[0]), pow2)


# ----------------------------------------------------------------------------- refs
def _deq(data: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """fp32 values of an operand: one scale, 1x128 tiles along the last dim ([R, C] with scales
    [R, C/128]) or 128x128 blocks of each group ([G, N, K] with scales [G, N/128, K/128])."""
    x = data.float()
    if scale_inv.dim() <= 1:  # per tensor
        return x * scale_inv.float().reshape(())
    s = scale_inv.float().repeat_interleave(128, dim=-1)[..., : x.shape[-1]]
    if data.dim() == 3:
        s = s.repeat_interleave(128, dim=1)[:, : x.shape[1]]
    return x * s


def fp8_grouped_mm_ref(a, b, split_sizes: torch.Tensor, out_dtype: torch.dtype,
                       bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Pure-torch twin of :func:`fp8_grouped_mm`: fp32 math on the dequantized operands."""
    y = grouped_gemm_fwd_ref(_deq(*a), _deq(*b), split_sizes, None if bias is None else bias.float())
    return y.to(out_dtype)


def fp8_grouped_wgrad_ref(a_t, b_t, split_sizes: torch.Tensor, out: Optional[torch.Tensor] = None,
                          accumulate: bool = False, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Pure-torch twin of :func:`fp8_grouped_wgrad` (block-scaled operands: back from the padded
    layout first)."""
    a, b = _deq(*a_t), _deq(*b_t)
    if a_t[1].dim() == 2:
        M = int(split_sizes.sum())
        rows = padded_index(split_sizes.to(a.device), M)
        a, b = a[:, rows], b[:, rows]
    r = grouped_gemm_wgrad_ref(a.t(), b.t(), split_sizes)
    if out is None:
        return r.to(out_dtype)
    out.copy_(r + out.float() if accumulate else r)
    return out


# ----------------------------------------------------------------------------- public API
def fp8_triton_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Triton on CUDA for FP8 operands (sm89+), under the interpreter for fp16/fp32 stand-ins."""
    if not (HAS_TRITON and use_triton(a, b)):
        return False
    if a.is_cuda:
        if not fp8_capable(a.device):
            raise RuntimeError("FP8 grouped GEMM needs a GPU with FP8 tensor cores (compute capability 8.9+: Ada, "
                               "Hopper)")
        return a.dtype in FP8_DTYPES and b.dtype in FP8_DTYPES
    return a.dtype == b.dtype and a.dtype in _CARRIERS


def _check(name, split_sizes, G, *pairs, block_scales=None):
    """Layouts, and the scaling of the operands: per tensor (one scale_inv each) or, where
    ``block_scales`` gives the expected scale shapes, block scaling. Returns whether block."""
    for data, inv in pairs:
        if data.dim() < 2 or data.stride(-1) != 1:
            raise ValueError(f"{name}: operands must have a contiguous last dim, got strides {tuple(data.stride())}")
    check_splits(split_sizes, G, *(d for d, _ in pairs))
    if all(inv.numel() == 1 and inv.dim() <= 1 for _, inv in pairs):
        return False
    got = [tuple(inv.shape) for _, inv in pairs]
    if block_scales is None or got != [tuple(s) for s in block_scales]:
        raise ValueError(f"{name}: scale_inv shapes {got}: expected one scale per operand, or block scales "
                         f"{block_scales}")
    return True


def fp8_grouped_mm(a, b, split_sizes: torch.Tensor, out_dtype: torch.dtype,
                   bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``c[rows of g] = a_g @ b[g].T * sa * sb (+ bias[g])``, one launch, no host sync.

    ``a`` = (data [M, K], scale_inv), ``b`` = (data [G, N, K], scale_inv): FP8 with a contiguous
    K and one fp32 scale_inv each; ``bias`` [G, N] or None; ``split_sizes`` [G] int64 on the
    operands' device. Returns [M, N] in ``out_dtype`` (fp32 accumulate). Block scaling: a's
    scale_inv [M, K/128] (1x128 tiles), b's [G, N/128, K/128] (128x128 blocks of each group)."""
    (ad, sa), (bd, sb) = a, b
    if ad.dim() != 2 or bd.dim() != 3 or ad.shape[1] != bd.shape[2]:
        raise ValueError(f"fp8_grouped_mm: a is {tuple(ad.shape)} but b is {tuple(bd.shape)} (a [M, K] and "
                         f"b [G, N, K]: K must agree)")
    (M, K), (G, N) = ad.shape, bd.shape[:2]
    block = _check("fp8_grouped_mm", split_sizes, G, a, b,
                   block_scales=((M, cdiv(K, 128)), (G, cdiv(N, 128), cdiv(K, 128))))
    if not fp8_triton_ok(ad, bd):
        return fp8_grouped_mm_ref(a, b, split_sizes, out_dtype, bias)
    bias = bias.contiguous() if bias is not None else None
    sa, sb = (sa.float(), sb.float()) if block else (sa.reshape(1).float(), sb.reshape(1).float())
    return _fp8_grouped_mm_op(ad, sa, bd, sb, bias, split_sizes, out_dtype)


def fp8_grouped_wgrad(a_t, b_t, split_sizes: torch.Tensor, out: Optional[torch.Tensor] = None,
                      accumulate: bool = False, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``out[g] (+)= a_t[:, rows of g] @ b_t[:, rows of g].T * sa * sb``, one launch, no host sync.

    ``a_t`` = (data [N, M], scale_inv), ``b_t`` = (data [K, M], scale_inv): the column-wise FP8
    copies of the output gradient and the input. ``out`` [G, N, K] (e.g. fp32 ``main_grad``) is
    written, or added into with ``accumulate``; None: a new [G, N, K] tensor in ``out_dtype``.
    Groups with no rows give zeros (or leave ``out[g]`` untouched when accumulating).
    Block scaling: the copies are in :func:`pad_groups`' layout (data [N, Mp], [K, Mp]) with 1x128
    scale_inv [N, Mp/128], [K, Mp/128] (their column-wise casts after padding)."""
    (ad, sa), (bd, sb) = a_t, b_t
    G = split_sizes.shape[0]
    if ad.shape[1] != bd.shape[1]:
        raise ValueError(f"fp8_grouped_wgrad: a_t is {tuple(ad.shape)} but b_t is {tuple(bd.shape)} (M must agree)")
    (N, M), K = ad.shape, bd.shape[0]
    block = _check("fp8_grouped_wgrad", split_sizes, G, a_t, b_t,
                   block_scales=((N, cdiv(M, 128)), (K, cdiv(M, 128))))
    if block and M % 128:
        raise ValueError(f"fp8_grouped_wgrad: block-scaled operands come in pad_groups' layout (rows a multiple of "
                         f"128), got {M} rows")
    if out is None:
        out = torch.empty((G, N, K), dtype=out_dtype, device=ad.device)
        accumulate = False
    if not fp8_triton_ok(ad, bd):
        return fp8_grouped_wgrad_ref(a_t, b_t, split_sizes, out, accumulate)
    sa, sb = (sa.float(), sb.float()) if block else (sa.reshape(1).float(), sb.reshape(1).float())
    _fp8_grouped_wgrad_op(ad, sa, bd, sb, split_sizes, out, accumulate)
    return out


__all__ = ["FP8_DTYPES", "cast_block_padded", "fp8_triton_ok", "fp8_grouped_mm", "fp8_grouped_mm_ref", "fp8_grouped_wgrad",
           "fp8_grouped_wgrad_ref", "pad_groups", "padded_index", "padded_rowmap", "padded_rowmap_ref", "padded_rows"]
