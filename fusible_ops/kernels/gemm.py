"""The dense GEMM seam: every dense linear's forward, input gradient and weight gradient.

Dense linears (:class:`~fusible_ops.BasicLinear` and the fused ops that contain one) call these
three functions and nothing else, so a new GEMM backend (FP8 in a later issue) changes one file.

* :func:`linear_fprop`: ``y = x @ w.T (+ bias)`` (cuBLAS through ``torch.nn.functional.linear``;
  the bias in the GEMM epilogue).
* :func:`linear_dgrad`: ``dx = dy @ w``.
* :func:`linear_wgrad`: ``dw = dy.T @ x``, returned, or written / added straight into a buffer
  (``main_grad``) by the GEMM: never a temporary full-size gradient plus a copy. A float32 buffer
  with 16-bit inputs takes cuBLAS's mixed-precision GEMM (``torch.addmm(..., out_dtype=float32)``,
  fp32 accumulate, ``beta`` 1 to accumulate, 0 to overwrite) on CUDA; on CPU (no such kernel) the
  inputs are upcast first. All operands are 2-D.

These are plain torch calls (they trace under ``torch.compile`` and capture in CUDA graphs); on
CPU they are their own reference.
"""

from __future__ import annotations

from typing import Optional

import torch


def linear_fprop(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for x [..., K], w [N, K], bias [N] or None."""
    return torch.nn.functional.linear(x, w, bias)


def linear_dgrad(dy2d: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``dy2d @ w`` ([M, N] @ [N, K] -> [M, K])."""
    return torch.mm(dy2d, w)  # (``@`` adds a Python wrapper's host time)


def _mixed_addmm(out, a, b, beta):
    """``out = beta * out + a @ b`` with 16-bit a, b and an fp32 ``out`` (CUDA only)."""
    return torch.addmm(out, a, b, out_dtype=out.dtype, beta=beta, out=out)


def linear_wgrad(dy2d: torch.Tensor, x2d: torch.Tensor, out: Optional[torch.Tensor] = None,
                 accumulate: bool = False) -> torch.Tensor:
    """``dy2d.T @ x2d`` ([M, N], [M, K] -> [N, K]).

    ``out`` None: a new tensor in the inputs' dtype. ``out`` given ([N, K], the inputs' dtype or
    float32): ``accumulate=True`` adds into it, else overwrites it; returns ``out``.
    """
    if out is None:
        return torch.mm(dy2d.t(), x2d)
    if tuple(out.shape) != (dy2d.shape[1], x2d.shape[1]):
        raise ValueError(f"linear_wgrad: out must be {(dy2d.shape[1], x2d.shape[1])}, got {tuple(out.shape)}")
    beta = 1.0 if accumulate else 0.0
    if out.dtype == dy2d.dtype == x2d.dtype:
        return torch.addmm(out, dy2d.t(), x2d, beta=beta, out=out)
    if out.is_cuda and out.dtype == torch.float32 and dy2d.dtype == x2d.dtype:
        return _mixed_addmm(out, dy2d.t(), x2d, beta)
    return torch.addmm(out, dy2d.t().to(out.dtype), x2d.to(out.dtype), beta=beta, out=out)


__all__ = ["linear_dgrad", "linear_fprop", "linear_wgrad"]
