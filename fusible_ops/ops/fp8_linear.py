"""FP8 forward and backward of a dense linear (``BasicLinear`` and the fused ops that contain one).

Under an active recipe (:func:`fusible_ops.autocast`):

* forward: the input is quantized (role ``"input"``; an input that already is a
  :class:`~fusible_ops.quantization.Float8Tensor`, e.g. from ``Quantize`` or a producer that
  wrote FP8, is used as it is), the weight comes from the weight cache (quantized once per
  change of the weight), and ``y = x @ w.T`` runs as one FP8 GEMM with fp32 accumulation; ``y``
  is in the input's high-precision dtype. The column-wise input copy is made in the same pass,
  only when the weight gradient is needed; the weight's column-wise copy only when the input
  gradient is.
* backward: the output gradient is quantized (role ``"grad_output"``: E5M2 under ``"hybrid"``),
  then dgrad ``dy @ w`` and wgrad ``dy.T @ x`` run as FP8 GEMMs. The weight gradient goes through
  the gradient contract unchanged (``main_grad`` accumulation in fp32, delayed wgrad keeps the
  FP8 operands until ``backward_dw()``, a frozen weight costs nothing and saves no input copy).

Dims: FP8 GEMMs need the reduction and output dims to be multiples of 16 (per-tensor scaling)
or 128 (block scaling); the token count is a reduction dim of the weight gradient.
"""

from __future__ import annotations

import torch

from ..grad import deliver_weight_grad
from ..kernels.fp8_gemm import fp8_gemm
from ..quantization.casting import cached_weight, quantize, weight_for_backward, weight_in_backward, with_colwise
from ..quantization.recipes import Float8BlockScaling
from ..quantization.tensor import is_float8


def check_dims(op, recipe, m: int, n: int, k: int, wgrad: bool) -> None:
    """Raise a clear error when the GEMM dims do not fit the recipe."""
    mult = 128 if isinstance(recipe, Float8BlockScaling) else 16
    bad = [f"{name}={v}" for name, v in (("in_features", k), ("out_features", n)) if v % mult]
    if wgrad and m % mult:
        bad.append(f"tokens={m} (the weight gradient's reduction dim)")
    if bad:
        raise ValueError(
            f"{type(op).__name__}: FP8 ({type(recipe).__name__}) needs dims divisible by {mult}; got "
            f"{', '.join(bad)}. Pad the dims, or run this op outside fusible_ops.autocast."
        )


def fp8_forward(lin, ctx, x: torch.Tensor, recipe) -> torch.Tensor:
    """FP8 ``x @ lin.weight.T``; fills ``ctx`` as ``BasicLinear.save_ctx`` does (plus the FP8
    operands). Returns y [..., out_features] in x's dtype."""
    w = lin.weight
    wg = ctx.weight_requires_grad and w.requires_grad
    dg = ctx.input_requires_grad
    k, n = lin.in_features, lin.out_features
    m = x.numel() // k
    check_dims(lin, recipe, m, n, k, wg and ctx.requires_grad)
    owner = lin.param_owner("weight")
    if is_float8(x):
        xq = with_colwise(x) if (wg and ctx.requires_grad) else x
    else:
        xq = quantize(x.reshape(m, k), recipe, "input", transposed=wg and ctx.requires_grad, owner=owner,
                      record=ctx.training)
    wq = cached_weight(owner, w, recipe, transposed=dg, record=ctx.training)
    y = fp8_gemm(xq.rowwise, wq.rowwise, xq.scaling, wq.scaling, x.dtype)
    if ctx.requires_grad:
        ctx.weight_grad = wg
        ctx.fp8 = (recipe, xq.scaling, wq.scaling)
        xt = xq.colwise if wg else (None, None)
        wt = weight_for_backward(owner, w, wq) if dg else (None, None)
        ctx.save_for_backward(*xt, *wt)
        ctx.input_shape = x.shape
    return y.reshape(*x.shape[:-1], n)


def fp8_backward(lin, ctx, dy: torch.Tensor):
    """``(dx, (dw,))`` of :func:`fp8_forward`."""
    recipe, x_scaling, w_scaling = ctx.fp8
    xt_data, xt_scale, wt_data, wt_scale = ctx.saved_tensors
    n = lin.out_features
    wg = ctx.weight_grad
    if is_float8(dy):
        dyq = with_colwise(dy) if wg else dy
    else:
        dyq = quantize(dy.reshape(-1, n), recipe, "grad_output", transposed=wg, owner=lin.param_owner("weight"),
                       record=ctx.training)
    dx = None
    if ctx.input_requires_grad:
        wt = weight_in_backward(lin.param_owner("weight"), (wt_data, wt_scale), recipe, False, ctx.training)
        dx = fp8_gemm(dyq.rowwise, wt, dyq.scaling, w_scaling, dy.dtype)
        dx = dx.reshape(ctx.input_shape)
    dw = None
    if wg:
        w = lin.weight
        dy_t = dyq.colwise

        def compute(out, acc):
            if out is None:
                return fp8_gemm(dy_t, (xt_data, xt_scale), dyq.scaling, x_scaling, w.dtype)
            return fp8_gemm(dy_t, (xt_data, xt_scale), dyq.scaling, x_scaling, out.dtype, out=out, accumulate=acc)

        dw = deliver_weight_grad(lin, w, compute)
    return dx, (dw,)


__all__ = ["check_dims", "fp8_backward", "fp8_forward"]
