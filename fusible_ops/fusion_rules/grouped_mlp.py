"""Fused grouped MLP (MoE experts): ``GroupedLinear -> SwiGLU | GEGLU | ScaledSwiGLU -> GroupedLinear``.

Joint rule (forward and backward only equivalent as a pair):

* forward: FC1 with the activation in its epilogue (one launch writes the FC1 output ``h`` and
  the activation ``y``), then FC2 (one launch). ``h`` is kept for backward; ``y`` is not (the
  backward recomputes it in an epilogue, where it is nearly free).
* backward: FC2's input gradient with the activation gradient in its epilogue (gives ``dh`` and
  ``y``; the FC2 input gradient itself is never written), then FC2's weight gradient from ``y``,
  FC1's input and weight gradients from ``dh``: one grouped-GEMM launch each.

Weight gradients follow the gradient contract exactly (:func:`fusible_ops.grad.deliver_weight_grad`):
main_grad, overwrite, dummy-or-None, delayed, and no work at all for a frozen expert weight.
Without grad (inference) the forward-only rule ``grouped_mlp_forward`` applies.
"""

from __future__ import annotations

import torch

from ..errors import assert_mode, device_check
from ..grad import deliver_weight_grad
from ..op import FusedOperation
from ..ops.activation import GEGLU, ScaledSwiGLU, SwiGLU
from ..ops.fp8_grouped import grouped_recipe
from ..quantization.recipes import Float8BlockScaling
from ..kernels import use_triton
from ..kernels.persistent import splits_equal_assert
from ..ops.grouped_linear import GroupedLinear, check_split_shape, check_split_sizes
from ..ops.validation import check_input
from .fp8_grouped_mlp import fp8_mlp_backward, fp8_mlp_forward
from ..rules import match, rule


def _mlp():
    from ..kernels import grouped_gemm, grouped_glu

    return grouped_gemm, grouped_glu


class FusedGroupedMLP(FusedOperation):
    """Forward and backward of ``GroupedLinear -> GLU -> GroupedLinear`` (in FP8 under a
    per-tensor autocast recipe: :mod:`fusible_ops.fusion_rules.fp8_grouped_mlp`)."""

    accepts_fp8 = False  # (casts its own FP8 operands: a Float8Tensor input or output gradient is dequantized)

    replayable = True  # (see FusibleOperation.replayable)

    def fuser_forward(self, ctxs, x, *, extra_inputs, gather=None, **kwargs):
        """``gather`` (from :class:`~fusible_ops.fusion_rules.moe_mlp.DispatchGroupedMLP`): [M]
        int64, row r of FC1's input is ``x[gather[r]]`` (x: the tokens), read inside FC1's forward
        kernel; the tokens, not the rows, are kept for FC1's weight gradient, which gathers them
        again (under FP8: the tokens are cast once, :func:`fp8_mlp_forward`). Without it ``x`` is
        FC1's input."""
        gg, gm = _mlp()
        fc1, act, fc2 = self.basic_ops
        c1, ca, c2 = ctxs
        scaled = isinstance(act, ScaledSwiGLU)
        if gather is None:
            x2d, splits = fc1.prepare(x, extra_inputs[0][0])
            lead = x.shape[:-1]
        else:  # x: the tokens; FC1's rows are x[gather]
            check_input(fc1, x, features=fc1.in_features, like=fc1.weight)
            x2d = x.reshape(-1, fc1.in_features)
            lead = gather.shape
            splits = check_split_sizes(fc1, extra_inputs[0][0], fc1.num_groups, gather.shape[0], x.device)
        rows, in_shape = lead.numel(), torch.Size((*lead, fc1.in_features))  # FC1's input (rows), as given
        s2 = extra_inputs[2][0]
        if not _same_tensor(s2, extra_inputs[0][0]):
            _check_fc2_splits(fc2, s2, splits, rows, x.device)
        scales = None
        if scaled:
            given = extra_inputs[1][0]
            act.check_scales(x.new_empty(()).expand(*lead, 2 * fc2.in_features), given)  # no alloc
            scales = given.reshape(rows)
            ca.scales_shape = given.shape
        recipe = grouped_recipe()
        if recipe is not None:
            out = fp8_mlp_forward(self, ctxs, x2d, splits, scales, recipe, gather)
            c1.input_shape = in_shape
            return _shaped(out, (*lead, fc2.out_features)), [(), (), ()]
        c1.fp8 = None
        y, h = gm.grouped_glu_fwd(x2d, fc1.weight, splits, fc1.bias, act.kind, scales, gather)
        out = gg.grouped_gemm_fwd(y, fc2.weight, splits, fc2.bias)
        if c1.requires_grad:
            fc1.save_ctx(c1, x2d, splits, in_shape)  # (with gather: the tokens, not a gathered copy)
            c1.gather = gather
            ca.save_for_backward(h, scales)
            ca.scales_grad = scaled and scales.requires_grad
            fc2.save_ctx(c2, None, splits, y.shape)  # FC2's input y is recomputed in backward
        return _shaped(out, (*lead, fc2.out_features)), [(), (), ()]

    def fuser_backward(self, ctxs, dy, *, grad_extra_outputs, **kwargs):
        fc1, act, fc2 = self.basic_ops
        c1, ca, c2 = ctxs
        if getattr(c1, "fp8", None) is not None:
            dx, g1, g2, dscales = fp8_mlp_backward(self, ctxs, _shaped(dy, (-1, fc2.out_features)))
        else:
            dx, g1, g2, dscales = self._backward_bf16(ctxs, dy)
        if dx is not None:
            dx = _shaped(dx, c1.input_shape)
        if dscales is not None:
            dscales = dscales.to(ca.saved_tensors[1].dtype).reshape(ca.scales_shape)
        extra_act = (dscales,) if isinstance(act, ScaledSwiGLU) else ()
        return dx, [g1, (), g2], [(None,), extra_act, (None,)]

    def _backward_bf16(self, ctxs, dy):
        gg, gm = _mlp()
        fc1, act, fc2 = self.basic_ops
        c1, ca, c2 = ctxs
        x2d, w1, splits = c1.saved_tensors
        h, scales = ca.saved_tensors
        _, w2, _ = c2.saved_tensors
        dy2 = _shaped(dy, (-1, fc2.out_features))
        need_dh = c1.input_requires_grad or c1.weight_grad or c1.bias_grad or ca.scales_grad
        dh = dscales = None
        if need_dh or c2.weight_grad:
            dh, y, dscales = gm.grouped_dglu(dy2, w2 if w2 is not None else fc2.weight, splits, h, act.kind,
                                              scales, ca.scales_grad)
        dw2 = None
        if c2.weight_grad:
            dw2 = deliver_weight_grad(fc2, fc2.weight,
                                      lambda out, acc: gg.grouped_gemm_wgrad(dy2, y, splits, out=out, accumulate=acc))
        db2 = gg.grouped_bias_grad(dy2, splits) if c2.bias_grad else None
        dx = None
        if c1.input_requires_grad:
            dx = gg.grouped_gemm_dgrad(dh, w1, splits)
        dw1 = None
        if c1.weight_grad:
            if c1.gather is not None:  # the token copies, gathered again just for this GEMM (see moe_mlp)
                x2d = x2d.index_select(0, c1.gather)
            dw1 = deliver_weight_grad(fc1, fc1.weight,
                                      lambda out, acc: gg.grouped_gemm_wgrad(dh, x2d, splits, out=out, accumulate=acc))
        db1 = gg.grouped_bias_grad(dh, splits) if c1.bias_grad else None
        g1 = (dw1, db1) if fc1.bias is not None else (dw1,)
        g2 = (dw2, db2) if fc2.bias is not None else (dw2,)
        return dx, g1, g2, dscales


def _shaped(t: torch.Tensor, shape) -> torch.Tensor:
    """``t.reshape(shape)``, or ``t`` itself when it has that shape already (a reshape costs host
    time). ``shape`` may hold one -1 in front (rows)."""
    if len(shape) == t.dim() and (t.shape == shape or (shape[0] == -1 and t.shape[1:] == shape[1:])):
        return t
    return t.reshape(shape)


def _check_fc2_splits(fc2, s2, splits, rows: int, device) -> None:
    """FC2's split sizes ``s2`` (a tensor other than FC1's) must equal FC1's validated ``splits``.
    Default device checks on CUDA: one kernel asserts the equality (sizes equal to valid sizes are
    valid); otherwise ``s2`` is validated as FC1's were, then compared (host, or device flag)."""
    if (splits.is_cuda and isinstance(s2, torch.Tensor) and s2.dtype == torch.int64 and s2.device == splits.device
            and assert_mode() and not torch.compiler.is_compiling() and use_triton(s2)):
        check_split_shape(fc2, s2, fc2.num_groups)
        splits_equal_assert(s2, splits)
        return
    splits2 = check_split_sizes(fc2, s2, fc2.num_groups, rows, device)
    if splits2.is_cuda or torch.compiler.is_compiling():
        device_check(fc2, (splits2 == splits).all(), splits2, "FC2 split sizes must equal FC1's (fused grouped MLP)")
    elif not torch.equal(splits2, splits):
        raise ValueError("fused grouped MLP: FC1 and FC2 split sizes differ")


def _same_tensor(a, b) -> bool:
    """``a`` and ``b`` are the same tensor, or views with the same storage, offset, shape and
    strides (the fuser hands a tensor passed twice to autograd as an alias view)."""
    if a is b:
        return True
    if torch.compiler.is_compiling():  # (no data pointers under tracing: validate both)
        return False
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.device == b.device
            and a.dtype == b.dtype and a.data_ptr() == b.data_ptr() and a.shape == b.shape
            and a.stride() == b.stride())


def check_grouped_mlp(ops, ctx):
    """The rule's checker: None, or why ``GroupedLinear -> GLU -> GroupedLinear`` does not fuse."""
    fc1, act, fc2 = ops
    if fc1.out_features != 2 * fc2.in_features:
        return f"FC1 out_features {fc1.out_features} != 2 x FC2 in_features {fc2.in_features}"
    if fc1.num_groups != fc2.num_groups:
        return f"FC1 has {fc1.num_groups} groups, FC2 {fc2.num_groups}"
    if ctx.device is not None and ctx.device.type == "cuda" and ctx.dtype == torch.float64:
        return "float64 on CUDA: the Triton kernels serve fp32/fp16/bf16"
    if isinstance(ctx.recipe, Float8BlockScaling):
        return ("FP8 block scaling: the GLU-epilogue kernels take per-tensor scales; the grouped linears run "
                "block-scaled FP8 grouped GEMMs with the GLU as its own kernel")
    return None


FP8_WIDE_FFN = 1024
"""Expert width (FC2's in_features) from which the fused FP8 grouped MLP measured slower than its
unfused ops (see :func:`grouped_glu_cost`)."""


def grouped_glu_cost(ops, ctx):
    """Cost hint of the joint grouped-MLP rules (``grouped_mlp``, ``moe_dispatch_mlp``): where the
    GLU-epilogue kernels measured slower than the same ops unfused in training on CUDA. H200,
    2026-11-27, harness cases ``moe_layer`` (3 shapes), ``grouped_mlp_8e`` and ``grouped_mlp_64e``
    (2 routings each), 16384-32768 token rows, forward + backward, two runs:

    * bf16: fused 0.9-5.7% slower on all 7 configurations in the second run (1.5-3.3% slower on 6,
      0.5% faster on E=8, F=14336 in the first), with a higher peak memory on the MoE layer (the
      kept activations are smaller, the transient buffers larger). The GLU-epilogue kernels reach
      ~500 TFLOP/s (FC1 forward) and ~380 (FC2 dgrad with dGLU) against ~690 for the plain grouped
      GEMM (profile of the E=128, F=768 layer).
    * FP8 current scaling: fused 9% faster at F=256 (E=128), 1-2% faster at F=768, 2-6% slower from
      F=1408 (:data:`FP8_WIDE_FFN`).

    CPU runs the reference math either way (no hint). ``fo.tune(..., prefer="memory")`` or
    ``fusion_rules.disabled("cost hints")`` takes the fused plan anyway."""
    if not ctx.requires_grad or ctx.device is None or ctx.device.type != "cuda":
        return None
    width = ops[-1].in_features
    if ctx.recipe is None:
        return ("training in 16/32-bit: the GLU-epilogue grouped kernels measured 1-6% slower than the "
                "unfused grouped GEMMs (H200)")
    if width >= FP8_WIDE_FFN:
        return f"FP8 with expert width {width} >= {FP8_WIDE_FFN}: measured 2-6% slower than unfused (H200)"
    return None


def _check_forward_only(ops, ctx):
    if ctx.requires_grad:
        return "a backward will run: the joint rule 'grouped_mlp' covers training"
    return check_grouped_mlp(ops, ctx)


_PATTERN = [GroupedLinear, match((SwiGLU, GEGLU, ScaledSwiGLU)), GroupedLinear]
RULES = [  # the built-in rules of this family (installed by fusible_ops/__init__.py)
    rule("grouped_mlp", _PATTERN, pass_="joint", build=FusedGroupedMLP, check=check_grouped_mlp, cost=grouped_glu_cost),
    rule("grouped_mlp_forward", _PATTERN, pass_="forward", build=FusedGroupedMLP, check=_check_forward_only),
]
