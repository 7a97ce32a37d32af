"""``Quantize``: quantize the tensor passing through (and/or its gradient) with the active recipe."""

from __future__ import annotations

from ..op import BasicOperation
from ..quantization.casting import FP8StateMixin, quantize
from ..quantization.recipes import current_recipe
from ..quantization.tensor import is_float8
from .validation import check_input


class Quantize(FP8StateMixin, BasicOperation):
    """Quantize the input (``forward=True``) and/or the output's gradient (``backward=True``) with
    the recipe of the active :func:`fusible_ops.autocast` block; outside one it is the identity.

    The forward output is a :class:`~fusible_ops.quantization.Float8Tensor` (role ``"input"``,
    with its column-wise copy when a gradient will flow): a following linear uses its FP8 data as
    it is, and any torch op sees the dequantized values. As the last op of a ``Sequential`` it
    hands the FP8 tensor to the next ``Sequential``. The gradient is the straight-through one:
    ``dx = dy`` (quantized to the ``"grad_output"`` format when ``backward=True``, as the
    preceding linear's backward would quantize it). Delayed scaling keeps its amax history on
    this op (its state dict).
    """

    accepts_fp8 = True

    def __init__(self, forward: bool = True, backward: bool = False) -> None:
        super().__init__()
        self.quantize_forward = bool(forward)
        self.quantize_backward = bool(backward)

    def extra_repr(self) -> str:
        return f"forward={self.quantize_forward}, backward={self.quantize_backward}"

    @classmethod
    def _example(cls, n: int, **factory):
        return cls(), n

    def op_forward(self, ctx, x, **kwargs):
        check_input(self, x)
        recipe = current_recipe()
        ctx.recipe = recipe
        if recipe is None or not self.quantize_forward or is_float8(x):
            return x
        return quantize(x, recipe, "input", transposed=ctx.requires_grad, owner=self, record=ctx.training)

    def op_backward(self, ctx, dy):
        if not ctx.input_requires_grad:
            return None, ()
        recipe = ctx.recipe
        if recipe is None or not self.quantize_backward or is_float8(dy):
            return dy, ()
        return quantize(dy, recipe, "grad_output", transposed=True, owner=self, record=ctx.training), ()

    def reference_forward(self, x):
        return x
