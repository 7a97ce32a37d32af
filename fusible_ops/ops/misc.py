"""Small ops: AddExtraInput, MakeExtraOutput, ConstantScale, Dropout, Reshape, Identity."""

from __future__ import annotations

import torch

from ..op import BasicOperation
from ._common import check_input, check_same


class AddExtraInput(BasicOperation):
    """``y = x + extra`` (a residual add); ``extra`` is an extra input of x's shape and dtype."""

    num_extra_inputs = 1

    @classmethod
    def _example(cls, n: int, **factory):
        return cls(), n

    def fuser_forward(self, ctxs, x, *, extra_inputs, **kwargs):
        (extra,) = extra_inputs[0]
        check_same(self, "the extra input", extra, x)
        return x + extra, [()]

    def fuser_backward(self, ctxs, dy, *, grad_extra_outputs, **kwargs):
        return dy, [()], [(dy,)]

    def reference_forward(self, x, extra):
        return x + extra


class MakeExtraOutput(BasicOperation):
    """Passes ``x`` through and also returns it as an extra output (e.g. the residual stream)."""

    num_extra_outputs = 1

    @classmethod
    def _example(cls, n: int, **factory):
        return cls(), n

    def fuser_forward(self, ctxs, x, *, extra_inputs, **kwargs):
        return x, [(x,)]

    def fuser_backward(self, ctxs, dy, *, grad_extra_outputs, **kwargs):
        (dextra,) = grad_extra_outputs[0]
        if dextra is not None:
            dy = dextra if dy is None else dy + dextra
        return dy, [()], [()]

    def reference_forward(self, x):
        return x, x


class ConstantScale(BasicOperation):
    """``y = x * scale`` for a Python number ``scale``."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = float(scale)

    def extra_repr(self) -> str:
        return f"scale={self.scale}"

    @classmethod
    def _example(cls, n: int, **factory):
        return cls(0.75), n

    def op_forward(self, ctx, x, **kwargs):
        check_input(self, x)
        return x * self.scale

    def op_backward(self, ctx, dy):
        return dy * self.scale, ()

    def reference_forward(self, x):
        return x * self.scale


class Dropout(BasicOperation):
    """Dropout with probability ``p`` in training mode (identity in eval mode).

    The mask comes from a counter-based RNG (Philox, keyed by a seed drawn from torch's CPU
    generator at each forward, counter = element index), so backward regenerates it instead of
    storing it, and CPU and GPU draw the same mask for the same seed. Under CUDA-graph capture the
    seed is drawn once at capture time, so replays reuse that mask.
    """

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"Dropout: p must be in [0, 1], got {p}")
        self.p = float(p)

    def extra_repr(self) -> str:
        return f"p={self.p}"

    @classmethod
    def _example(cls, n: int, **factory):
        return cls(0.25), n

    @property
    def active(self) -> bool:
        return self.training and self.p > 0.0

    def plan_key(self) -> tuple:
        return (self.p,)

    def draw_seed(self) -> int:
        """A fresh seed from torch's (CPU) default generator; no device sync."""
        return int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64))

    def op_forward(self, ctx, x, **kwargs):
        check_input(self, x)
        ctx.dropout_active = self.active
        if not self.active:
            return x
        from ..kernels.dropout import dropout_fwd

        ctx.seed = self.draw_seed()
        return dropout_fwd(x, self.p, ctx.seed)

    def op_backward(self, ctx, dy):
        if not ctx.dropout_active:
            return dy, ()
        from ..kernels.dropout import dropout_bwd

        return dropout_bwd(dy, self.p, ctx.seed), ()


class Reshape(BasicOperation):
    """``y = x.reshape(shape)`` (``-1`` allowed)."""

    def __init__(self, shape) -> None:
        super().__init__()
        self.shape = tuple(int(s) for s in shape)

    def extra_repr(self) -> str:
        return f"shape={self.shape}"

    def op_forward(self, ctx, x, **kwargs):
        ctx.input_shape = x.shape
        return x.reshape(self.shape)

    def op_backward(self, ctx, dy):
        return dy.reshape(ctx.input_shape), ()

    def reference_forward(self, x):
        return x.reshape(self.shape)


class Identity(BasicOperation):
    """``y = x``."""

    @classmethod
    def _example(cls, n: int, **factory):
        return cls(), n

    def op_forward(self, ctx, x, **kwargs):
        return x

    def op_backward(self, ctx, dy):
        return dy, ()

    def reference_forward(self, x):
        return x
