"""Residual add + norm: ``AddExtraInput [MakeExtraOutput] LayerNorm|RMSNorm``.

Forward: one kernel reads x and the residual, writes their sum (kept for backward, and
returned when a ``MakeExtraOutput`` sits between) and the normalized output. Backward mirror:
one kernel gives the gradient of the sum (plus the extra output's gradient), which is the
gradient of both x and the residual.
"""

from __future__ import annotations

import torch

from ..op import FusedOperation
from ..ops.validation import check_same
from ..ops.misc import AddExtraInput, MakeExtraOutput
from ..ops.norm import NORM_CLASSES
from ..quantization.recipes import current_recipe
from ..rules import rule


class ForwardAddNorm(FusedOperation):
    """Residual add + norm in one kernel (which also writes a following FP8 linear's input)."""

    writes_fp8_output = True
    cpu_autograd = True  # (see FusibleOperation.cpu_autograd)
    replayable = True  # (see FusibleOperation.replayable)

    def __init__(self, ops) -> None:
        super().__init__(ops)
        self._no_extras = [()] * len(ops)

    def fuser_forward(self, ctxs, x, *, extra_inputs, **kwargs):
        add, norm = self.basic_ops[0], self.basic_ops[-1]
        (residual,) = extra_inputs[0]
        check_same(add, "the extra input", residual, x)  # (norm_forward checks x)
        if not ctxs[-1].requires_grad and len(ctxs) == 2 and current_recipe() is None:
            # no ctx to fill, no FP8 output, no extra output: the norm's own native-or-kernel choice
            return norm.norm_forward(ctxs[-1], x, residual=residual)[0], self._no_extras
        per_op = kwargs.get("basic_op_kwargs")
        quant = per_op[-1].get("next_op_input_quantizer") if per_op else None
        y, xsum = norm.norm_forward(ctxs[-1], x, residual=residual, quant=quant)
        extra = [()] * len(ctxs)
        if len(self.basic_ops) == 3:  # MakeExtraOutput returns the sum
            extra[1] = (xsum,)
        return y, extra


class BackwardAddNorm(FusedOperation):
    replayable = True  # (see FusibleOperation.replayable)

    def fuser_backward(self, ctxs, dy, *, grad_extra_outputs, **kwargs):
        norm = self.basic_ops[-1]
        dextra = grad_extra_outputs[1][0] if len(self.basic_ops) == 3 else None
        dx, pgrads = norm.norm_backward(ctxs[-1], dy, dextra)
        grads = [()] * (len(ctxs) - 1) + [pgrads]
        extra = [(dx,)] + [()] * (len(ctxs) - 1)
        return dx, grads, extra


def _check(ops, ctx):
    if ctx.device is not None and ctx.device.type == "cuda" and ctx.dtype == torch.float64:
        return "float64 on CUDA: the Triton kernels serve fp32/fp16/bf16"
    return None


_NORM = NORM_CLASSES
RULES = [  # the built-in rules of this family (installed by fusible_ops/__init__.py)
    rule("residual_norm", [AddExtraInput, _NORM], pass_="forward", build=ForwardAddNorm, check=_check),
    rule("residual_extra_norm", [AddExtraInput, MakeExtraOutput, _NORM],
         pass_="forward", build=ForwardAddNorm, check=_check),
    rule("residual_norm_backward", [AddExtraInput, _NORM],
         pass_="backward", build=BackwardAddNorm, check=_check),
    rule("residual_extra_norm_backward", [AddExtraInput, MakeExtraOutput, _NORM],
         pass_="backward", build=BackwardAddNorm, check=_check),
]
