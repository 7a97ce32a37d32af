"""FP8 forward and backward of the fused grouped MLP (``GroupedLinear -> GLU -> GroupedLinear``)
under a per-tensor recipe (current or delayed scaling).

Forward: x cast (with its transposed copy when FC1's weight needs a gradient); FC1 + GLU in one
FP8 grouped kernel that also takes max|y| (:func:`~fusible_ops.kernels.grouped_glu.grouped_glu_fwd_fp8`);
one cast writes FC2's FP8 input (and its transposed copy for FC2's weight gradient) through
FC2's :class:`~fusible_ops.quantization.InputQuantizer`; FC2 as an FP8 grouped GEMM.

Backward: dy cast; FC2's input gradient + dGLU in one FP8 kernel that also takes max|dh|
(:func:`~fusible_ops.kernels.grouped_glu.grouped_dglu_fp8`); one cast writes FC1's FP8 output
gradient (both layouts when FC1's weight needs a gradient); FC1's input gradient and both weight
gradients as FP8 grouped GEMMs under the gradient contract. The experts' weights come from the
weight cache (their per-group transposes serve the input gradients).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..grad import deliver_weight_grad
from ..kernels.fp8_grouped_gemm import fp8_grouped_mm, fp8_grouped_wgrad
from ..kernels.grouped_gemm import grouped_bias_grad
from ..kernels.grouped_glu import grouped_dglu_fp8, grouped_glu_fwd_fp8
from ..kernels.moe_combine import gather_rows_t
from ..quantization.casting import (GradOutputQuantizer, InputQuantizer, cached_weight, quantize, weight_for_backward,
                                   weight_in_backward)


def _bias_grad(op, ctx) -> bool:
    return ctx.requires_grad and op.bias is not None and op.bias.requires_grad


def fp8_mlp_forward(fused, ctxs, x2d: torch.Tensor, splits: torch.Tensor, scales, recipe,
                    gather: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The fused grouped MLP's output [M, H] (x2d's dtype); fills the three ctxs.

    ``gather`` (a MoE layer's token copies, :mod:`~fusible_ops.fusion_rules.moe_mlp`): x2d holds
    the T tokens and FC1's row r is ``x2d[gather[r]]``. The tokens are cast once (T rows, not
    T * k) and FC1's FP8 kernel gathers the FP8 rows in its mainloop. What must hold: every token
    is gathered at least once (a dropless layer), so the tokens' amax is the copies' amax and the
    FP8 values are exactly those of casting the copies. Only the row-wise FP8 tokens are kept;
    FC1's weight gradient gathers and transposes them in backward (k times less kept memory than
    the column-wise copy of the copies)."""
    fc1, act, fc2 = fused.basic_ops
    c1, ca, c2 = ctxs
    train = c1.requires_grad
    wg1 = train and c1.weight_requires_grad and fc1.weight.requires_grad
    wg2 = train and c2.weight_requires_grad and fc2.weight.requires_grad
    o1, o2 = fc1.param_owner("weight"), fc2.param_owner("weight")
    xq = quantize(x2d, recipe, "input", transposed=wg1 and gather is None, owner=o1, record=c1.training)
    w1q = cached_weight(o1, fc1.weight, recipe, transposed=train and c1.input_requires_grad, grouped=True,
                        record=c1.training)
    w2q = cached_weight(o2, fc2.weight, recipe, transposed=train, grouped=True, record=c2.training)
    kept = {}

    def fc1_glu(amax=None, scale=None, fp8_dtype=None):
        if amax is None:  # (a standalone cast follows: the amax is not needed)
            amax = torch.zeros(1, dtype=torch.float32, device=x2d.device)
        y, kept["h"] = grouped_glu_fwd_fp8(xq.rowwise, w1q.rowwise, splits, fc1.bias, act.kind, scales, x2d.dtype,
                                           amax, gather)
        return y

    into_fc2 = InputQuantizer(recipe, fc2)
    into_fc2.colwise, into_fc2.training = wg2, c2.training
    yq = into_fc2.produce(fc1_glu, like=x2d, direct=False)
    out = fp8_grouped_mm(yq.rowwise, w2q.rowwise, splits, x2d.dtype, fc2.bias)
    if train:
        c1.fp8, c1.weight_grad, c1.bias_grad = recipe, wg1, _bias_grad(fc1, c1)
        c2.fp8, c2.weight_grad, c2.bias_grad = recipe, wg2, _bias_grad(fc2, c2)
        c1.gather = gather  # with it, the "colwise" slots hold the row-wise FP8 tokens
        c1.save_for_backward(*((xq.colwise if gather is None else xq.rowwise) if wg1 else (None, None)),
                             *(weight_for_backward(o1, fc1.weight, w1q) if c1.input_requires_grad else (None, None)),
                             splits)
        ca.save_for_backward(kept["h"], scales)
        ca.scales_grad = scales is not None and scales.requires_grad
        c2.save_for_backward(*(yq.colwise if wg2 else (None, None)), *weight_for_backward(o2, fc2.weight, w2q))
    return out


def fp8_mlp_backward(fused, ctxs, dy2: torch.Tensor):
    """``(dx2d or None, (fc1 grads), (fc2 grads), dscales or None)`` of :func:`fp8_mlp_forward`."""
    fc1, act, fc2 = fused.basic_ops
    c1, ca, c2 = ctxs
    recipe = c1.fp8
    xt, xt_inv, w1t, w1t_inv, splits = c1.saved_tensors
    h, scales = ca.saved_tensors
    yt, yt_inv, w2t, w2t_inv = c2.saved_tensors
    w2t, w2t_inv = weight_in_backward(fc2.param_owner("weight"), (w2t, w2t_inv), recipe, True, c2.training)
    dyq = quantize(dy2, recipe, "grad_output", transposed=c2.weight_grad, owner=fc2.param_owner("weight"),
                   record=c2.training)
    dw2 = None
    if c2.weight_grad:
        def wgrad2(out, acc):
            return fp8_grouped_wgrad(dyq.colwise, (yt, yt_inv), splits, out=out, accumulate=acc,
                                     out_dtype=fc2.weight.dtype)
        dw2 = deliver_weight_grad(fc2, fc2.weight, wgrad2)
    db2 = grouped_bias_grad(dy2, splits) if c2.bias_grad else None
    dx = dw1 = db1 = dscales = None
    if c1.input_requires_grad or c1.weight_grad or c1.bias_grad or ca.scales_grad:
        kept = {}

        def dglu(amax=None, scale=None, fp8_dtype=None):
            if amax is None:
                amax = torch.zeros(1, dtype=torch.float32, device=h.device)
            kept["dh"], kept["ds"] = grouped_dglu_fp8(dyq.rowwise, (w2t, w2t_inv), splits, h, act.kind, scales,
                                                      ca.scales_grad, amax)
            return kept["dh"]

        into_fc1 = GradOutputQuantizer(recipe, fc1)
        into_fc1.colwise, into_fc1.training = c1.weight_grad, c1.training
        dhq = into_fc1.produce(dglu, like=h, direct=False)
        dscales = kept["ds"]
        if c1.input_requires_grad:
            w1t = weight_in_backward(fc1.param_owner("weight"), (w1t, w1t_inv), recipe, True, c1.training)
            dx = fp8_grouped_mm(dhq.rowwise, w1t, splits, dy2.dtype)
        if c1.weight_grad:
            if c1.gather is not None:  # FP8 tokens -> the copies, column-wise (same per-tensor scale)
                xt = gather_rows_t(xt, c1.gather)

            def wgrad1(out, acc):
                return fp8_grouped_wgrad(dhq.colwise, (xt, xt_inv), splits, out=out, accumulate=acc,
                                         out_dtype=fc1.weight.dtype)
            dw1 = deliver_weight_grad(fc1, fc1.weight, wgrad1)
        if c1.bias_grad:
            db1 = grouped_bias_grad(kept["dh"], splits)
    g1 = (dw1, db1) if fc1.bias is not None else (dw1,)
    g2 = (dw2, db2) if fc2.bias is not None else (dw2,)
    return dx, g1, g2, dscales


__all__ = ["fp8_mlp_backward", "fp8_mlp_forward"]
