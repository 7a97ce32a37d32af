"""Harness case ``grouped_gemm``: the three GEMMs of a grouped linear alone (issue 44's per-GEMM
view), forward-only benches, bf16: ``fwd`` (``y_g = x_g @ W[g].T``), ``dgrad`` (``dx_g = dy_g @
W[g]``) and ``wgrad`` (``dW[g] = dy_g.T @ x_g``).

Shapes: FC1 of the 8-expert MLP (T=16384 tokens, in 4096, out 2 x 7168, E=8, uniform routing) and
of the fine-grained MoE layer (T*k = 196608 rows, in 1536, out 2 x 256, E=128). Variants: ``fused``
(ours: :mod:`fusible_ops.kernels.grouped_gemm`, one persistent Triton launch) and ``grouped_mm``
(``torch._grouped_mm``, the baseline). Work: ``2 M N K`` FLOPs against the dense bf16 matmul
ceiling of the run. FP8 variants (ours, ``torch._scaled_grouped_mm``) are not here yet.
"""

from __future__ import annotations

from typing import Iterator

import torch

from ..kernels import grouped_gemm as gg
from .cases import CASES, Bench, BenchContext, Case, _init_, routing_splits

SHAPES = {"fc1_8e": (16384, 4096, 2 * 7168, 8), "fc1_128e": (196608, 1536, 2 * 256, 128)}


def grouped_gemm(ctx: BenchContext) -> Iterator[Bench]:
    for name, (M, K, N, E) in SHAPES.items():
        M, K, N = ctx.size(M, 64), ctx.size(K, 32), ctx.size(N, 32)
        sizes = routing_splits(E, M, "uniform")
        splits = torch.tensor(sizes, dtype=torch.int64, device=ctx.device)
        offs = torch.cumsum(splits, 0).to(torch.int32)
        w = torch.empty(E, N, K, device=ctx.device, dtype=ctx.dtype)
        _init_(w)

        def operands(rows_dim: int, cols_dim: int):
            return lambda: ((ctx.randn(M, rows_dim), ctx.randn(M, cols_dim)), None)

        gemms = {  # config -> (inputs (a, b) of M rows, ours, torch._grouped_mm)
            "fwd": (operands(K, N), lambda x, _: gg.grouped_gemm_fwd(x, w, splits),
                    lambda x, _: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)),
            "dgrad": (operands(N, K), lambda dy, _: gg.grouped_gemm_dgrad(dy, w, splits),
                      lambda dy, _: torch._grouped_mm(dy, w, offs=offs)),
            "wgrad": (operands(N, K), lambda dy, x: gg.grouped_gemm_wgrad(dy, x, splits),
                      lambda dy, x: torch._grouped_mm(dy.t(), x, offs=offs)),
        }
        for kind, (new_copy, ours, peer) in gemms.items():
            yield Bench(
                case="grouped_gemm", config=f"{name}_{kind}", shape=f"M={M} K={K} N={N} E={E}", dtype=ctx.dtype,
                metric="flops", work=2.0 * M * N * K, new_copy=new_copy, params=[],
                variants={"fused": ours, "grouped_mm": peer}, fused_module=None, plan_args=lambda inp: inp,
                baseline="grouped_mm", notes={"fused": "fusible_ops.kernels.grouped_gemm (persistent Triton)",
                                              "grouped_mm": "torch._grouped_mm"})


CASES.update({  # (registered into the harness's catalogue when fusible_ops.bench is imported)
    "grouped_gemm": Case("the forward, input-gradient and weight-gradient GEMMs of a grouped linear alone "
                         "(FC1 of the 8-expert MLP and of the 128-expert MoE layer) vs torch._grouped_mm",
                         grouped_gemm),
})
