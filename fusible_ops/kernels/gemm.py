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

from fusible_ops.kernels.launch import kernel_op


def linear_fprop(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for x [..., K], w [N, K], bias [N] or None."""
    return torch.nn.functional.linear(x, w, bias)


def linear_fprop_again(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """:func:`linear_fprop` (no bias) of operands whose product an earlier pass made and dropped on
    purpose (the chunked head's logits, recomputed in backward). Under ``torch.compile`` an opaque
    custom op: traced as the same ``mm`` as the forward's, AOT autograd merges the two (CSE) and saves
    the forward's result for backward, every chunk's logits (the whole ``[T, V]``) kept between the
    passes."""
    return _fprop_again_op(x, w)


@kernel_op("fusible_ops::linear_fprop_again", mutates_args=())
def _fprop_again_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, w)


@_fprop_again_op.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0])


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
    _wgrad_into(dy2d, x2d, out, accumulate)
    return out


def linear_wgrad_chain(dy2d: torch.Tensor, x2d: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    """:func:`linear_wgrad` into ``out`` for a loop that adds many GEMMs into one buffer (the chunked
    head): under ``torch.compile`` one opaque custom op that mutates ``out``, which inductor runs in
    place. (Traced as a functional ``addmm``, each step's result is a new buffer: inductor then
    alternates two ``out``-sized buffers through the loop, one more weight gradient at the peak.)"""
    _wgrad_into_op(dy2d, x2d, out, accumulate)


def _wgrad_into(dy2d: torch.Tensor, x2d: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    beta = 1.0 if accumulate else 0.0
    if out.dtype == dy2d.dtype == x2d.dtype:
        torch.addmm(out, dy2d.t(), x2d, beta=beta, out=out)
    elif out.is_cuda and out.dtype == torch.float32 and dy2d.dtype == x2d.dtype:
        _mixed_addmm(out, dy2d.t(), x2d, beta)
    else:
        torch.addmm(out, dy2d.t().to(out.dtype), x2d.to(out.dtype), beta=beta, out=out)


@kernel_op("fusible_ops::wgrad_into_", mutates_args=("out",))
def _wgrad_into_op(dy2d: torch.Tensor, x2d: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    _wgrad_into(dy2d, x2d, out, accumulate)


@_wgrad_into_op.register_fake
def _(dy2d, x2d, out, accumulate):
    return None


__all__ = ["linear_dgrad", "linear_fprop", "linear_fprop_again", "linear_wgrad", "linear_wgrad_chain"]
