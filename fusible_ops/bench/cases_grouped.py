"""Harness case ``grouped_gemm``: the three GEMMs of a grouped linear alone (issue 44's per-GEMM
view), forward-only benches, bf16: ``fwd`` (``y_g = x_g @ W[g].T``), ``dgrad`` (``dx_g = dy_g @
W[g]``) and ``wgrad`` (``dW[g] = dy_g.T @ x_g``).

Shapes: FC1 of the 8-expert MLP (T=16384 tokens, in 4096, out 2 x 7168, E=8, uniform routing), of
the 64-expert MLP (16384 tokens, in 2048, out 2 x 1408, E=64: 256 rows per expert, a short
reduction for the weight gradient; see :data:`~fusible_ops.ops.fp8_grouped.FP8_WGRAD_MIN_ROWS`)
and of the fine-grained MoE layer (T*k = 196608 rows, in 1536, out 2 x 256, E=128). Variants:
``fused`` (ours: :mod:`fusible_ops.kernels.grouped_gemm`, one persistent Triton launch) and
``grouped_mm`` (``torch._grouped_mm``, the baseline). Work: ``2 M N K`` FLOPs against the dense bf16 matmul
ceiling of the run. ``fc1_128e_fwd_gather``: the same forward reading its M token copies from
M / 8 tokens through a gather index (:func:`_gather_fwd`): ours in the kernel, ``gather_then_fused``
(a gathered copy first, as ``Dispatch`` makes it) and ``index_select`` + ``torch._grouped_mm``.

FP8 variants (on GPUs with FP8 tensor cores), E4M3 operands cast before the timed call (the GEMM
alone), rated against the run's dense FP8 ceiling (``torch._scaled_mm``):

* ``fp8_current`` -- ours, per-tensor scales (:mod:`fusible_ops.kernels.fp8_grouped_gemm`: forward and
  dgrad read the weight and its per-group transposed copy, wgrad the column-wise copies);
* ``fp8_block`` -- ours, block scales (1x128 tiles of the activations, 128x128 blocks of each
  expert's weight), forward and dgrad;
* ``torch_scaled_grouped_mm`` -- ``torch._scaled_grouped_mm`` with row-wise scales (per token row
  and per weight row), forward and dgrad (its weight gradient takes scales per group of the
  reduction, which this case does not build).
"""

from __future__ import annotations

from typing import Iterator

import torch

from ..kernels import grouped_gemm as gg
from ..kernels.moe_combine import gather_rows
from ..kernels.fp8_gemm import fp8_capable
from ..kernels.fp8_grouped_gemm import fp8_grouped_mm, fp8_grouped_wgrad
from ..quantization.casting import _cast_weight, quantize
from ..quantization.recipes import Float8BlockScaling, Float8CurrentScaling
from .cases import CASES, FP8_REL_ERR, Bench, BenchContext, Case, _init_, routing_splits

SHAPES = {"fc1_8e": (16384, 4096, 2 * 7168, 8), "fc1_64e": (16384, 2048, 2 * 1408, 64),
          "fc1_128e": (196608, 1536, 2 * 256, 128)}


def grouped_gemm(ctx: BenchContext) -> Iterator[Bench]:
    for name, (M, K, N, E) in SHAPES.items():
        M, K, N = ctx.size(M, 64), ctx.size(K, 32), ctx.size(N, 32)
        sizes = routing_splits(E, M, "uniform")
        splits = torch.tensor(sizes, dtype=torch.int64, device=ctx.device)
        offs = torch.cumsum(splits, 0).to(torch.int32)
        w = torch.empty(E, N, K, device=ctx.device, dtype=ctx.dtype)
        _init_(w)

        fp8 = fp8_capable(ctx.device) and hasattr(torch, "_scaled_grouped_mm")
        if fp8:
            cur, blk = Float8CurrentScaling(), Float8BlockScaling()
            wq = _cast_weight(None, w, cur, transposed=True, grouped=True)  # [E, N, K] and [E, K, N]
            wb = _cast_weight(None, w, blk, transposed=True, grouped=True)
            w_rows = _rowwise(w)  # (torch's row-wise scales: per row of the weight's [E, N, K] and [E, K, N])
            wt_rows = _rowwise(w.transpose(1, 2).contiguous())

        def operands(rows_dim: int, cols_dim: int, kind: str):
            """(a [M, rows_dim], b [M, cols_dim]) and, for the FP8 variants, their casts."""
            def new_copy():
                a, b = ctx.randn(M, rows_dim), ctx.randn(M, cols_dim)
                if not fp8:
                    return (a, b), None
                role = "input" if kind == "fwd" else "grad_output"
                if kind == "wgrad":  # the column-wise copies of dy and x
                    extra = (*quantize(a, cur, role, transposed=True).colwise,
                             *quantize(b, cur, "input", transposed=True).colwise)
                else:
                    extra = (*quantize(a, cur, role).rowwise, *quantize(a, blk, role).rowwise, *_rowwise(a))
                return (a, b, *extra), None
            return new_copy

        def fp8_variants(kind: str) -> dict:
            if not fp8:
                return {}
            if kind == "wgrad":
                # (the gradient in the weights' dtype, as a GroupedLinear without main_grad gets it and
                # as the bf16 rows write it; an fp32 output doubled the bytes written)
                return {"fp8_current": lambda a, b, at, sat, bt, sbt: fp8_grouped_wgrad((at, sat), (bt, sbt), splits,
                                                                                   out_dtype=ctx.dtype)}
            weight, block, rows = (wq.rowwise, wb.rowwise, w_rows) if kind == "fwd" else \
                (wq.colwise, wb.colwise, wt_rows)
            return {
                "fp8_current": lambda a, b, q, s, *_: fp8_grouped_mm((q, s), weight, splits, ctx.dtype),
                "fp8_block": lambda a, b, q, s, qb, sb, *_: fp8_grouped_mm((qb, sb), block, splits, ctx.dtype),
                "torch_scaled_grouped_mm": lambda a, b, q, s, qb, sb, qr, sr: torch._scaled_grouped_mm(
                    qr, rows[0].transpose(-2, -1), sr, rows[1], offs=offs, out_dtype=ctx.dtype, use_fast_accum=True),
            }

        gemms = {  # config -> (inputs (a, b) of M rows, ours, torch._grouped_mm)
            "fwd": (operands(K, N, "fwd"), lambda x, *_: gg.grouped_gemm_fwd(x, w, splits),
                    lambda x, *_: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)),
            "dgrad": (operands(N, K, "dgrad"), lambda dy, *_: gg.grouped_gemm_dgrad(dy, w, splits),
                      lambda dy, *_: torch._grouped_mm(dy, w, offs=offs)),
            "wgrad": (operands(N, K, "wgrad"), lambda dy, x, *_: gg.grouped_gemm_wgrad(dy, x, splits),
                      lambda dy, x, *_: torch._grouped_mm(dy.t(), x, offs=offs)),
        }
        if name == "fc1_128e":  # the MoE layer's FC1 reading its token copies from the tokens (top-8)
            gemms["fwd_gather"] = _gather_fwd(ctx, M, K, E, w, offs)
        for kind, (new_copy, ours, peer, *then) in gemms.items():
            extra = fp8_variants(kind) if kind != "fwd_gather" else {"gather_then_fused": then[0]}
            yield Bench(
                case="grouped_gemm", config=f"{name}_{kind}", shape=f"M={M} K={K} N={N} E={E}", dtype=ctx.dtype,
                metric="flops", work=2.0 * M * N * K, new_copy=new_copy, params=[],
                variants={"fused": ours, "grouped_mm": peer, **extra}, fused_module=None, plan_args=lambda inp: inp,
                baseline="grouped_mm", tolerances={k: FP8_REL_ERR for k in extra if k.startswith(("fp8", "torch"))},
                notes={"fused": "fusible_ops.kernels.grouped_gemm (persistent Triton)",
                       "grouped_mm": "torch._grouped_mm", "fp8_current": "ours, per-tensor E4M3",
                       "fp8_block": "ours, 1x128 / 128x128 block scales",
                       "torch_scaled_grouped_mm": "torch._scaled_grouped_mm, row-wise scales, fast accumulation",
                       "gather_then_fused": "gather_rows (Dispatch's copy) then ours"})


def _gather_fwd(ctx: BenchContext, M: int, K: int, E: int, w: torch.Tensor, offs: torch.Tensor, top_k: int = 8):
    """``fwd_gather``: T = M / top_k tokens, each routed to top_k distinct experts by random scores,
    the copies in expert order; variants read the copies through the index: ``fused`` in the
    kernel (:func:`~fusible_ops.kernels.grouped_gemm.grouped_gemm_fwd` with ``gather``),
    ``gather_then_fused`` a gathered copy first (:func:`~fusible_ops.kernels.moe_combine.gather_rows`,
    as Dispatch does), ``grouped_mm`` ``index_select`` then ``torch._grouped_mm``. The routing is
    fixed per case (its split sizes, not the uniform ones of the other configs)."""
    T = max(M // top_k, 1)
    g = torch.Generator(device="cpu").manual_seed(0)
    experts = torch.rand(T, E, generator=g).topk(min(top_k, E), dim=1).indices.flatten()
    order = torch.sort(experts, stable=True).indices
    index = (order // min(top_k, E)).to(ctx.device)
    splits = torch.bincount(experts, minlength=E).to(ctx.device)
    offs_g = torch.cumsum(splits, 0).to(torch.int32)

    def new_copy():
        return (ctx.randn(T, K), ctx.randn(index.shape[0], w.shape[1])), None
    return (new_copy,
            lambda x, *_: gg.grouped_gemm_fwd(x, w, splits, gather=index),
            lambda x, *_: torch._grouped_mm(x.index_select(0, index), w.transpose(-2, -1), offs=offs_g),
            lambda x, *_: gg.grouped_gemm_fwd(gather_rows(x, index), w, splits))


def _rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 bytes of ``x`` [..., K] with one fp32 scale per row (what ``torch._scaled_grouped_mm``
    takes: ``scale_inv`` [...], value = byte * scale_inv)."""
    amax = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-12)
    scale = 448.0 / amax
    return (x.float() * scale).to(torch.float8_e4m3fn), (1.0 / scale).squeeze(-1).contiguous()


CASES.update({  # (registered into the harness's catalogue when fusible_ops.bench is imported)
    "grouped_gemm": Case("the forward, input-gradient and weight-gradient GEMMs of a grouped linear alone "
                         "(FC1 of the 8-expert MLP and of the 128-expert MoE layer) vs torch._grouped_mm",
                         grouped_gemm),
})
