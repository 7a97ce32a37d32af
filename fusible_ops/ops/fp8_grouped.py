"""FP8 forward and backward of :class:`~fusible_ops.GroupedLinear` (every recipe).

Under :func:`fusible_ops.autocast` with any recipe (:class:`~fusible_ops.Float8CurrentScaling`,
:class:`~fusible_ops.Float8DelayedScaling`, or :class:`~fusible_ops.Float8BlockScaling`: its
scales below), the three grouped GEMMs run in FP8 with fp32 accumulation
(:mod:`fusible_ops.kernels.fp8_grouped_gemm`), each operand in the K-major layout Hopper's FP8 MMA
reads:

* forward ``y = x_g @ w_g.T``: x cast row-wise (plus its column-wise copy [K, M] in the same pass
  when the weight needs a gradient), the experts' weights from the weight cache (one cast of all
  groups per weight change; with the per-group transposed copy [G, K, N] when the input needs a
  gradient);
* input gradient ``dx = dy_g @ w_g``: dy cast row-wise, the weight's transposed copy;
* weight gradient ``dw_g = dy_g.T @ x_g``: the column-wise copies of dy and x, written or added
  into ``main_grad`` under the gradient contract (delayed wgrad keeps those copies until
  ``backward_dw()``; a frozen weight keeps no copy of x).

Short reductions: with fewer than :data:`FP8_WGRAD_MIN_ROWS` rows per expert on average (a shape,
known on the host), per-tensor recipes compute the weight gradient in the input's precision
instead (the 16-bit grouped weight-gradient kernel, fp32 accumulation, from the saved input and
the output gradient), where the FP8 one measured slower; the GEMMs of the forward and the input
gradient stay in FP8.

Per-tensor recipes: one scale per tensor (all experts' weights share one). Block scaling
(:class:`~fusible_ops.Float8BlockScaling`): x and dy in 1x128 tiles along K, each expert's weight
in 128x128 blocks; the weight gradient reduces over tokens, so the column-wise copies of x and dy
are cast in :func:`~fusible_ops.kernels.fp8_grouped_gemm.pad_groups`' layout (every group starts
on a multiple of 128 rows): no 1x128 tile spans two experts, no row is lost. One pass over x (or
dy) writes both copies (:func:`~fusible_ops.kernels.fp8_grouped_gemm.cast_block_padded`); no
padded copy of the user's tensors is made. Feature sizes must be multiples of 128 there (any token count and split sizes).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..grad import deliver_weight_grad
from ..kernels.fp8_grouped_gemm import cast_block_padded, fp8_grouped_mm, fp8_grouped_wgrad
from ..kernels.grouped_gemm import grouped_bias_grad, grouped_gemm_wgrad
from ..quantization.casting import (GradOutputQuantizer, InputQuantizer, cached_weight, quantize, weight_for_backward,
                                   weight_in_backward, with_colwise)
from ..quantization.recipes import Float8BlockScaling, current_recipe
from ..quantization.tensor import float8, is_float8


FP8_WGRAD_MIN_ROWS = 0
"""Rows per expert (token rows / groups) below which a per-tensor FP8 GroupedLinear computes its
weight gradient in 16 bits (from the saved 16-bit input) instead of FP8. 0 (the default): always
FP8. The weight gradient reduces over an expert's rows, so few rows make each output tile's K loop
short. H200, 2026-11-28, harness ``grouped_mlp_64e`` (64 experts of 256 rows): the FP8 MLP step
took 1.482 ms with FP8 weight gradients and 1.624 ms with this switch at 512 (16-bit weight
gradients below 512 rows per expert). Raise it where a shape measures otherwise."""


def grouped_recipe():
    """The active FP8 recipe (grouped linears run every recipe in FP8), or None."""
    return current_recipe()


def grouped_quantizer(op, role: str):
    """The quantizer a producer next to ``op`` (a GroupedLinear) uses to write ``op``'s input
    (``role="input"``) or output gradient (``"grad_output"``) in FP8 itself, its amax taken in
    its own pass (see :class:`~fusible_ops.quantization.InputQuantizer`); None where ``op`` wants
    the 16-bit tensor: no per-tensor recipe (block scaling casts the weight gradient's copy from
    the group-padded layout), :data:`FP8_WGRAD_MIN_ROWS` > 0 (the 16-bit weight gradient may
    read it), or, for the output gradient, a bias (its gradient sums the 16-bit rows)."""
    recipe = grouped_recipe()
    if recipe is None or isinstance(recipe, Float8BlockScaling) or FP8_WGRAD_MIN_ROWS > 0:
        return None
    if role == "input":
        return InputQuantizer(recipe, op)
    return None if op.bias is not None else GradOutputQuantizer(recipe, op)


def _fp8_operand(t: torch.Tensor, block: bool):
    """``t`` as a per-tensor Float8Tensor the grouped kernels read as is, or None (then the
    16-bit values: a plain tensor, or a Float8Tensor of other scaling, dequantized)."""
    if is_float8(t):
        if not block and t.scaling == "tensor":
            return t
    return None


def _cast(x2d: torch.Tensor, splits: torch.Tensor, recipe, role: str, colwise: bool, owner, record: bool):
    """``x2d`` cast for the grouped GEMMs: ``(its row-wise Float8Tensor, the column-wise copy the
    weight gradient reads or (None, None))``. Per tensor: one cast writes both. Block scaling: the
    column-wise copy is cast in :func:`~fusible_ops.kernels.fp8_grouped_gemm.pad_groups`' layout
    (1x128 tiles inside one group), by the same single pass over ``x2d``
    (:func:`~fusible_ops.kernels.fp8_grouped_gemm.cast_block_padded`)."""
    if colwise and isinstance(recipe, Float8BlockScaling):
        q, s, qt, st = cast_block_padded(x2d, splits, recipe.power_of_two_scales)
        return float8(q, s, x2d.dtype, x2d.shape, scaling="1x128", recipe=recipe), (qt, st)
    q = quantize(x2d, recipe, role, transposed=colwise, owner=owner, record=record)
    return q, (q.colwise if colwise else (None, None))


def _check_block_dims(op, recipe) -> None:
    if isinstance(recipe, Float8BlockScaling) and (op.in_features % 128 or op.out_features % 128):
        raise ValueError(
            f"{type(op).__name__}: FP8 block scaling needs in_features and out_features divisible by 128; got "
            f"in_features={op.in_features}, out_features={op.out_features}. Pad the dims, or run this op outside "
            f"fusible_ops.autocast (any token count works)."
        )


def fp8_grouped_forward(op, ctx, x2d: torch.Tensor, splits: torch.Tensor, recipe) -> torch.Tensor:
    """FP8 ``y[rows of g] = x_g @ w_g.T (+ b_g)`` for ``op`` (a GroupedLinear); fills ``ctx`` as
    ``GroupedLinear.save_ctx`` does, with the FP8 operands backward needs."""
    w = op.weight
    owner = op.param_owner("weight")
    train = ctx.requires_grad
    wg = train and ctx.weight_requires_grad and w.requires_grad
    dg = train and ctx.input_requires_grad
    _check_block_dims(op, recipe)
    block = isinstance(recipe, Float8BlockScaling)
    xq = _fp8_operand(x2d, block)  # (an FP8 input from the producer before: its FP8 weight gradient)
    if xq is None and is_float8(x2d):
        x2d = x2d.dequantize()
    hp_wgrad = wg and not block and xq is None and x2d.shape[0] < FP8_WGRAD_MIN_ROWS * op.num_groups
    if xq is not None:
        xq = with_colwise(xq) if wg else xq
        xt = xq.colwise if wg else (None, None)
    else:
        xq, xt = _cast(x2d, splits, recipe, "input", wg and not hp_wgrad, owner, ctx.training)
    wq = cached_weight(owner, w, recipe, transposed=dg, grouped=True, record=ctx.training)
    y = fp8_grouped_mm(xq.rowwise, wq.rowwise, splits, x2d.dtype, op.bias)
    if train:
        ctx.weight_grad, ctx.hp_wgrad = wg, hp_wgrad
        ctx.bias_grad = op.bias is not None and op.bias.requires_grad
        ctx.fp8 = recipe
        if hp_wgrad:  # (the input itself; the second slot unused)
            xt = (x2d, None)
        wt = weight_for_backward(owner, w, wq) if dg else (None, None)
        ctx.save_for_backward(*xt, *wt, splits)
    return y


def fp8_grouped_backward(op, ctx, dy2d: torch.Tensor) -> tuple:
    """``(dx2d or None, (dweight, dbias))`` of :func:`fp8_grouped_forward`."""
    xt, xt_inv, wt, wt_inv, splits = ctx.saved_tensors
    wg = ctx.weight_grad
    w = op.weight
    owner = op.param_owner("weight")
    hp = wg and ctx.hp_wgrad
    dx = None
    block = isinstance(ctx.fp8, Float8BlockScaling)
    dyq = _fp8_operand(dy2d, block)  # (from the producer after: the activation's backward)
    if dyq is not None and (hp or ctx.bias_grad):  # (these read the 16-bit rows: not handed off so)
        dyq = None
    if is_float8(dy2d) and dyq is None:
        dy2d = dy2d.dequantize()
    if dyq is not None:
        dyq = with_colwise(dyq) if wg else dyq
        dy_t = dyq.colwise if wg else (None, None)
    elif ctx.input_requires_grad or (wg and not hp):  # (an FP8 output gradient serves them)
        dyq, dy_t = _cast(dy2d, splits, ctx.fp8, "grad_output", wg and not hp, owner, ctx.training)
    if ctx.input_requires_grad:
        wt = weight_in_backward(owner, (wt, wt_inv), ctx.fp8, True, ctx.training)
        dx = fp8_grouped_mm(dyq.rowwise, wt, splits, dy2d.dtype)
    dw: Optional[torch.Tensor] = None
    if hp:  # (16-bit weight gradient from the saved input: few rows per expert)
        dw = deliver_weight_grad(op, w, lambda out, acc: _hp_wgrad(dy2d, xt, splits, w, out, acc))
    elif wg:
        def compute(out, acc):
            return fp8_grouped_wgrad(dy_t, (xt, xt_inv), splits, out=out, accumulate=acc, out_dtype=w.dtype)

        dw = deliver_weight_grad(op, w, compute)
    db = grouped_bias_grad(dy2d, splits) if ctx.bias_grad else None
    return dx, ((dw, db) if op.bias is not None else (dw,))


def _hp_wgrad(dy2d, x2d, splits, w, out, accumulate):
    if out is None:
        return grouped_gemm_wgrad(dy2d, x2d.to(dy2d.dtype), splits).to(w.dtype)
    return grouped_gemm_wgrad(dy2d, x2d.to(dy2d.dtype), splits, out=out, accumulate=accumulate)


__all__ = ["FP8_WGRAD_MIN_ROWS", "fp8_grouped_backward", "fp8_grouped_forward", "grouped_quantizer", "grouped_recipe"]
