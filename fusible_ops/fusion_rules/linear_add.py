"""Linear + residual add: ``BasicLinear -> AddExtraInput`` (the residual add after an attention
output projection or an MLP down projection, e.g. in a Llama block).

Forward (``ForwardLinearAdd``, rule ``linear_add``): ``y = x @ weight.T + residual`` as ONE
``torch.addmm(residual_2d, x_2d, weight.T)`` (beta 1, alpha 1): the residual is the GEMM's
accumulate input, so no separate elementwise add pass reads the GEMM's output back. Leading dims
are flattened into 2-D views (no copy for contiguous inputs; a non-contiguous one is copied by
``reshape``, as the unfused linear does). The linear's ctx is filled exactly as
:meth:`~fusible_ops.BasicLinear.fprop` fills it (``check_input``, then ``save_ctx`` with the same
x and weight, ``gated_weight`` honoured); ``AddExtraInput`` keeps nothing. In 16 bits the sum is
rounded once (the GEMM's fp32 accumulator plus the residual) instead of twice.

What it saves, honestly: ATen's ``addmm`` with a 2-D accumulate input first copies that input into
the new output (CPU and CUDA; cuBLASLt, which reads C and writes D separately, is used by torch only
for a 1-D bias), then runs the GEMM with beta 1. So on CUDA the unfused ``GEMM + add kernel``
becomes ``device copy of the residual + GEMM``: the same number of launches, the memory-bound pass
reads 2 instead of 3 tensors of the output's size (the GEMM's read of C sits in a mostly
compute-bound kernel). Accumulating into the residual in place (TransformerEngine's in-place add)
would save the copy too, but changes ``AddExtraInput``'s out-of-place meaning (the residual is
typically saved for the previous norm's backward).

Backward: no rule. The unfused backward already does what a fused one would: ``AddExtraInput``
hands the output gradient ``dy`` on as the residual's gradient without a copy (the same tensor),
and ``BasicLinear.op_backward`` runs on the ctx filled above (dgrad, wgrad through
:func:`~fusible_ops.grad.deliver_weight_grad`: ``main_grad`` accumulation, delayed weight
gradients, a frozen weight costs nothing). On the CPU reference path (``cpu_autograd``) PyTorch's
autograd differentiates the ``addmm``; its gradient for the accumulate input is ``dy`` itself too.

Why no ``linear_bias_add`` (``BasicLinear -> Bias -> AddExtraInput``): torch has no GEMM that
takes both a bias vector and a 2-D accumulate input out of place. ``addmm(residual) + bias`` or
``addmm(residual + bias)`` each cost one more full pass, as much as the unfused add after
``linear_bias`` (bias in the GEMM's epilogue), so that chain stays ``linear_bias`` + add.

Declines: under an FP8 recipe (the FP8 GEMM, ``torch._scaled_mm``, has no accumulate input; the
unfused plan, or ``residual_norm``, writes the next FP8 linear's input). float64 on CUDA is
served (cuBLAS has it; no Triton kernel here). Under ``torch.autocast`` the call runs the unfused
math (``fprop``, then ``AddExtraInput``'s own forward), as the ``linear_bias`` rule does: autocast
casts the GEMM's output, and the residual's dtype is checked against that, exactly as unfused.

Priority -1, against ``residual_norm`` / ``residual_extra_norm`` (``AddExtraInput [MakeExtraOutput]
norm``): in ``Linear -> AddExtraInput -> RMSNorm`` the residual rules take the add, so the plan is
``BasicLinear`` alone + ``residual_norm``. Per output-sized tensor, memory-bound traffic is the
same either way (copy: 2, norm: 2, against the fused norm kernel's 4: reads the GEMM output and
the residual, writes the sum and the output), but ``linear_add`` would add the copy's launch, and
under FP8 the norm kernel writes the next linear's FP8 input. A priority below theirs makes this
choice independent of the lengths (``residual_extra_norm`` is longer, ``residual_norm`` is not)
and of position.
"""

from __future__ import annotations

import torch

from ..op import FusedOperation
from ..ops.linear import BasicLinear
from ..ops.misc import AddExtraInput
from ..ops.validation import check_input, check_same
from ..quantization.recipes import current_recipe
from ..quantization.tensor import is_float8
from ..rules import rule

_autocast_on = torch.is_autocast_enabled


class ForwardLinearAdd(FusedOperation):
    """Forward of ``BasicLinear -> AddExtraInput``: ``x @ weight.T + residual`` in one
    ``torch.addmm`` (the residual as the GEMM's accumulate input). Fills the linear's ctx as its
    own forward would, so the unfused backward runs after it (see the module docstring)."""

    cpu_autograd = True  # (see FusibleOperation.cpu_autograd: addmm, differentiable)
    replayable = True  # (see FusibleOperation.replayable: one ATen addmm and views)

    def __init__(self, ops) -> None:
        super().__init__(ops)
        self._no_extras = [()] * len(ops)

    def fuser_forward(self, ctxs, x, *, extra_inputs, **kwargs):
        linear, add = self.basic_ops
        lctx = ctxs[0]
        if current_recipe() is not None or _autocast_on("cuda" if x.is_cuda else x.device.type):
            # FP8 (the rule declines; a user rule set may not) or torch.autocast: the unfused math
            y = linear.fprop(lctx, x)
            return add.fuser_forward(ctxs[1:], y, extra_inputs=extra_inputs[1:])[0], self._no_extras
        (residual,) = extra_inputs[1]
        w = lctx.gated_weight  # (a CPU call under PyTorch's autograd: see ContractGate)
        if w is None:
            w = linear.weight
        check_input(linear, x, features=linear.in_features, like=w)
        if is_float8(x):
            x = x.dequantize()
        n = linear.out_features
        _check_residual(add, residual, x, n)
        if x.dim() == 2:
            y = torch.addmm(residual, x, w.t())
        else:
            lead = x.shape[:-1]
            y = torch.addmm(residual.reshape(-1, n), x.reshape(-1, linear.in_features), w.t()).view(*lead, n)
        lctx.fp8 = None
        if lctx.requires_grad:
            linear.save_ctx(lctx, x, w)
        return y, self._no_extras


def _check_residual(add, residual: torch.Tensor, x: torch.Tensor, n: int) -> None:
    """The error ``AddExtraInput`` itself raises for a residual that does not match the linear's
    output (x's dtype and device, shape ``[*x.shape[:-1], n]``), checked before the GEMM."""
    check_same(add, "the extra input", residual, x, shape=False)
    if residual.dim() != x.dim() or residual.shape[-1] != n or residual.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"{type(add).__name__}: the extra input shape {list(residual.shape)} does not match "
                         f"input shape {[*x.shape[:-1], n]}")


def _check(ops, ctx):
    if ctx.recipe is not None:
        return "an FP8 recipe is active: the FP8 GEMM (torch._scaled_mm) has no accumulate input for the residual"
    return None


RULES = [  # the built-in rules of this family (installed by fusible_ops/__init__.py)
    rule("linear_add", [BasicLinear, AddExtraInput], pass_="forward", build=ForwardLinearAdd, check=_check,
         priority=-1),
]
