"""Small ops: AddExtraInput, MakeExtraOutput, ConstantScale, Dropout, Reshape, Identity."""

from __future__ import annotations

from typing import Optional

import torch

from ..op import BasicOperation
from .validation import check_input, check_same


class AddExtraInput(BasicOperation):
    """``y = x + extra`` (a residual add); ``extra`` is an extra input of x's shape and dtype.

    ``from_input=True``: ``extra`` is the input of the enclosing :class:`~fusible_ops.Sequential`,
    which passes it itself, so a whole residual block is one Sequential called with one tensor:
    ``fo.Sequential(fo.RMSNorm(d), ..., fo.Linear(f, d), fo.AddExtraInput(from_input=True))(h)``
    is ``h + mlp(norm(h))``, with the residual fusions (``linear_add``) applied. The Sequential
    then takes no extra input for this op (``extra_input_names`` leaves it out); the input's
    gradient sums both of its uses. Called alone, outside a Sequential, the op adds its own input.

    ``channel="name"``: ``extra`` is the value of the earlier ``MakeExtraOutput(channel="name")`` of
    the same run of fusible ops (:mod:`fusible_ops.channels`); the Sequential takes no extra input
    for it, and the value's gradient sums both of its uses.
    """

    num_extra_inputs = 1
    extra_input_names = ("residual",)  # (Sequential accepts it by this name: seq(x, residual=...))
    cpu_autograd = True  # (see FusibleOperation.cpu_autograd)
    replayable = True  # (see FusibleOperation.replayable: an ATen add; its backward passes dy on)

    def __init__(self, *, from_input: bool = False, channel: Optional[str] = None) -> None:
        super().__init__()
        if from_input and channel is not None:
            raise ValueError("AddExtraInput: from_input=True and channel= both name where the residual comes from; "
                             "give one")
        if channel is not None and not (isinstance(channel, str) and channel):
            raise TypeError(f"AddExtraInput: channel must be a non-empty string, got {channel!r}")
        self.from_input = bool(from_input)
        self.channel_in = channel

    def extra_repr(self) -> str:
        return "from_input=True" if self.from_input else f"channel={self.channel_in!r}" if self.channel_in else ""

    def forward(self, x: torch.Tensor, *extra_inputs):
        if self.from_input and not extra_inputs:  # (alone: its own input is the Sequential's)
            extra_inputs = (x,)
        return super().forward(x, *extra_inputs)

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
    """Passes ``x`` through and also returns it as an extra output (e.g. the residual stream).

    ``channel="name"``: the value goes to the later ``AddExtraInput(channel="name")`` of the same
    run of fusible ops instead of being returned (:mod:`fusible_ops.channels`)."""

    num_extra_outputs = 1
    cpu_autograd = True  # (see FusibleOperation.cpu_autograd)

    def __init__(self, *, channel: Optional[str] = None) -> None:
        super().__init__()
        if channel is not None and not (isinstance(channel, str) and channel):
            raise TypeError(f"MakeExtraOutput: channel must be a non-empty string, got {channel!r}")
        self.channel_out = channel

    def extra_repr(self) -> str:
        return f"channel={self.channel_out!r}" if self.channel_out else ""

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
    cpu_autograd = True  # (see FusibleOperation.cpu_autograd)

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
    """Dropout with probability ``p`` in training mode (identity in eval mode or with ``p == 0``).

    The mask comes from a counter-based RNG (Philox keyed by a seed, one counter per 8 elements,
    16-bit keep decisions: the drop probability is ``p`` rounded to a multiple of ``2**-16``; see
    :mod:`fusible_ops.kernels.dropout`), so backward regenerates it instead of storing it. The seed
    is a **tensor**: one int64 element drawn at each forward with ``torch.randint`` on the input's
    device from that device's default generator (no host sync). So under CUDA-graph capture every
    replay draws a new seed and a new mask (the generator's offset advances on the device), and
    ``torch.compile`` traces the draw (no data-dependent Python value). The same seed value gives
    the same mask on CPU and GPU. ``y = x * keep / (1 - p)``: a product, as in
    ``torch.nn.functional.dropout`` (a dropped NaN/Inf stays NaN).

    Fused ops use one protocol for the seed (never ctx attributes directly): :meth:`start` in
    forward (decides whether dropout is active, draws the seed, saves it in ctx) and
    :meth:`seed_of` in backward.
    """

    cpu_autograd = True  # (see FusibleOperation.cpu_autograd)

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

    def draw_seed(self, device) -> torch.Tensor:
        """A fresh seed: ``[1]`` int64 in ``[0, 2**31 - 1)`` on ``device``, drawn from that
        device's default generator (no host sync; CUDA-graph safe; traceable)."""
        return torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=device)

    def start(self, ctx, x: torch.Tensor) -> torch.Tensor | None:
        """Forward half of the seed protocol: sets ``ctx.dropout_active``; when active, draws a
        seed on ``x``'s device, saves it with ``ctx.save_for_backward`` (so it travels through
        autograd's saved tensors) and returns it; else returns None (no seed drawn). The ctx must
        be this op's own ctx (it saves nothing else)."""
        ctx.dropout_active = self.active
        if not ctx.dropout_active:
            return None
        seed = self.draw_seed(x.device)
        ctx.save_for_backward(seed)
        return seed

    def seed_of(self, ctx) -> torch.Tensor | None:
        """Backward half: the seed :meth:`start` saved in ``ctx``, or None when dropout was
        inactive in that forward."""
        if not ctx.dropout_active:
            return None
        return ctx.saved_tensors[0]

    def op_forward(self, ctx, x, **kwargs):
        check_input(self, x)
        seed = self.start(ctx, x)
        if seed is None:
            return x
        from ..kernels.dropout import dropout_fwd

        return dropout_fwd(x, self.p, seed)

    def op_backward(self, ctx, dy):
        seed = self.seed_of(ctx)
        if seed is None:
            return dy, ()
        from ..kernels.dropout import dropout_bwd

        return dropout_bwd(dy, self.p, seed), ()

    def reference_forward(self, x):
        """Plain differentiable PyTorch: ``x * keep * (1 / (1 - p))`` with the reference mask. In
        training with ``p > 0`` it draws its seed exactly as the op's forward does (same
        generator, same call), so after the same ``torch.manual_seed`` it applies the same mask;
        otherwise returns ``x``."""
        if not self.active:
            return x
        from ..kernels.dropout import dropout_keep_mask, keep_scale

        seed = self.draw_seed(x.device)
        keep = dropout_keep_mask(x.shape, self.p, seed, x.device)
        return x * keep.to(x.dtype) * keep_scale(self.p)


class Reshape(BasicOperation):
    """``y = x.reshape(shape)`` (``-1`` allowed)."""
    cpu_autograd = True  # (see FusibleOperation.cpu_autograd)

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
    cpu_autograd = True  # (see FusibleOperation.cpu_autograd)

    @classmethod
    def _example(cls, n: int, **factory):
        return cls(), n

    def op_forward(self, ctx, x, **kwargs):
        return x

    def op_backward(self, ctx, dy):
        return dy, ()

    def reference_forward(self, x):
        return x
