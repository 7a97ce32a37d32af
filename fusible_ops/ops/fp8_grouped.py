"""FP8 forward and backward of :class:`~fusible_ops.GroupedLinear` (per-tensor recipes).

Under :func:`fusible_ops.autocast` with :class:`~fusible_ops.Float8CurrentScaling` or
:class:`~fusible_ops.Float8DelayedScaling`, the three grouped GEMMs run in FP8 with fp32
accumulation (:mod:`fusible_ops.kernels.fp8_grouped_gemm`), each operand in the K-major layout
Hopper's FP8 MMA reads:

* forward ``y = x_g @ w_g.T``: x cast row-wise (plus its column-wise copy [K, M] in the same pass
  when the weight needs a gradient), the experts' weights from the weight cache (one cast of all
  groups per weight change; with the per-group transposed copy [G, K, N] when the input needs a
  gradient);
* input gradient ``dx = dy_g @ w_g``: dy cast row-wise, the weight's transposed copy;
* weight gradient ``dw_g = dy_g.T @ x_g``: the column-wise copies of dy and x, written or added
  into ``main_grad`` under the gradient contract (delayed wgrad keeps those copies until
  ``backward_dw()``; a frozen weight keeps no copy of x).

One scale per tensor (all experts' weights share one). Block scaling is not implemented for
grouped linears: they run in high precision there (``explain()`` says so).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..grad import deliver_weight_grad
from ..kernels.fp8_grouped_gemm import fp8_grouped_mm, fp8_grouped_wgrad
from ..kernels.grouped_gemm import grouped_bias_grad
from ..quantization.casting import cached_weight, quantize
from ..quantization.recipes import Float8BlockScaling, current_recipe


def grouped_recipe():
    """The active recipe if grouped linears run it in FP8 (per-tensor recipes), else None."""
    recipe = current_recipe()
    return None if recipe is None or isinstance(recipe, Float8BlockScaling) else recipe


def fp8_grouped_forward(op, ctx, x2d: torch.Tensor, splits: torch.Tensor, recipe) -> torch.Tensor:
    """FP8 ``y[rows of g] = x_g @ w_g.T (+ b_g)`` for ``op`` (a GroupedLinear); fills ``ctx`` as
    ``GroupedLinear.save_ctx`` does, with the FP8 operands backward needs."""
    w = op.weight
    owner = op.param_owner("weight")
    train = ctx.requires_grad
    wg = train and ctx.weight_requires_grad and w.requires_grad
    dg = train and ctx.input_requires_grad
    xq = quantize(x2d, recipe, "input", transposed=wg, owner=owner)
    wq = cached_weight(owner, w, recipe, transposed=dg, grouped=True)
    y = fp8_grouped_mm(xq.rowwise, wq.rowwise, splits, x2d.dtype, op.bias)
    if train:
        ctx.weight_grad = wg
        ctx.bias_grad = op.bias is not None and op.bias.requires_grad
        ctx.fp8 = recipe
        xt = xq.colwise if wg else (None, None)
        wt = wq.colwise if dg else (None, None)
        ctx.save_for_backward(*xt, *wt, splits)
    return y


def fp8_grouped_backward(op, ctx, dy2d: torch.Tensor) -> tuple:
    """``(dx2d or None, (dweight, dbias))`` of :func:`fp8_grouped_forward`."""
    xt, xt_inv, wt, wt_inv, splits = ctx.saved_tensors
    wg = ctx.weight_grad
    w = op.weight
    dyq = quantize(dy2d, ctx.fp8, "grad_output", transposed=wg, owner=op.param_owner("weight"))
    dx = fp8_grouped_mm(dyq.rowwise, (wt, wt_inv), splits, dy2d.dtype) if ctx.input_requires_grad else None
    dw: Optional[torch.Tensor] = None
    if wg:
        dy_t = dyq.colwise

        def compute(out, acc):
            return fp8_grouped_wgrad(dy_t, (xt, xt_inv), splits, out=out, accumulate=acc, out_dtype=w.dtype)

        dw = deliver_weight_grad(op, w, compute)
    db = grouped_bias_grad(dy2d, splits) if ctx.bias_grad else None
    return dx, ((dw, db) if op.bias is not None else (dw,))


__all__ = ["fp8_grouped_backward", "fp8_grouped_forward", "grouped_recipe"]
