"""Channels: a value carried forward inside one fused run of ops.

``MakeExtraOutput(channel="h")`` hands its input to the later ``AddExtraInput(channel="h")`` of the
same run instead of returning it as an extra output, so a block whose residual is made mid-chain
is one Sequential called with its input alone::

    fo.Sequential(fo.AddExtraInput(), fo.MakeExtraOutput(channel="h"), fo.RMSNorm(d),
                  fo.Linear(d, 2 * f), fo.SwiGLU(), fo.Linear(f, d), fo.AddExtraInput(channel="h"))

is ``h = x + r; h + mlp(norm(h))`` (``seq(x, r)``), with ``residual_extra_norm`` and ``linear_add``
applied as usual. The fuser fills the consumer's extra input with the producer's value in forward
and hands the consumer's extra-input gradient to the producer's extra-output gradient in backward
(:class:`Channels`). Neither shows in the Sequential's signature: the producer returns no extra
output, the consumer takes no extra input.

What must hold (checked when the run is built, each a ``ValueError`` naming the op): every
consumer's producer comes earlier in the same run of fusible ops (a non-fusible module or a module
with hooks between them splits the run), one producer per name. A fused group may not hold both
ends of one channel (no built-in rule does; the fuser raises naming the rule).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .quantization.tensor import is_float8


class Channels:
    """The channel links of one run of basic ops: ``source[c]`` is the producer index of consumer
    ``c``; ``producers`` the indices that feed one."""

    __slots__ = ("source", "producers")

    def __init__(self, source: dict) -> None:
        self.source = source
        self.producers = frozenset(source.values())

    def check_plan(self, plan) -> None:
        """No fused group of ``plan`` may hold a consumer and its producer (the consumer's extra
        input must exist when the group starts; its gradient must reach the producer's group)."""
        for g in [*plan.forward, *plan.backward]:
            inside = set(g.indices) if g.rule is not None else ()
            for c in inside:
                if self.source.get(c) in inside:
                    raise RuntimeError(f"fusion rule {g.rule!r} fuses both ends of a channel (basic ops "
                                       f"{self.source[c]} and {c}): the consumer's value is made inside the same "
                                       f"fused op; disable the rule or move the channel")

    def run_forward(self, fuser, plan, ctxs: list, x: torch.Tensor, extra: Sequence) -> tuple:
        """The fuser's forward steps (``fusible_ops.fuser._run_forward``) for a run with channels:
        each consumer's extra input is its producer's value, and producers return no extra
        output. Returns ``(y, extra_outputs)``."""
        extra_inputs = fuser._split_extra(extra)
        extra_outputs: list[tuple] = [()] * len(ctxs)
        values: dict = {}
        y = x
        for op, idx, kwargs, direct, plain_in in plan.forward_program:
            if plain_in and is_float8(y):
                y = y.dequantize()
            if direct:
                y = op.op_forward(ctxs[idx], y, **kwargs)
                continue
            for i in idx:
                if i in self.source:
                    extra_inputs[i] = (values[self.source[i]],)
            y, ex = op.fuser_forward([ctxs[i] for i in idx], y, extra_inputs=[extra_inputs[i] for i in idx],
                                     basic_op_kwargs=kwargs)
            for i, e in zip(idx, ex):
                if i in self.producers:
                    values[i] = e[0]
                else:
                    extra_outputs[i] = tuple(e)
        return y, extra_outputs


def find_channels(ops: Sequence) -> Optional[Channels]:
    """The links of ``ops`` (None when no op uses a channel). ``op.channel_out``: the name an op
    produces; ``op.channel_in``: the name it consumes."""
    made: dict = {}
    source: dict = {}
    for i, op in enumerate(ops):
        name = getattr(op, "channel_in", None)
        if name is not None:
            if name not in made:
                raise ValueError(f"{type(op).__name__}(channel={name!r}) (basic op {i}): no MakeExtraOutput(channel="
                                 f"{name!r}) before it in the same run of fusible ops (a non-fusible module, or "
                                 f"a module with hooks, between them splits the run)")
            source[i] = made[name]
        name = getattr(op, "channel_out", None)
        if name is not None:
            if name in made:
                raise ValueError(f"{type(op).__name__}(channel={name!r}) (basic op {i}): basic op {made[name]} already "
                                 f"makes channel {name!r}; give each producer its own name")
            made[name] = i
    unused = sorted(set(made.values()) - set(source.values()))
    if unused:
        op = ops[unused[0]]
        raise ValueError(f"{type(op).__name__}(channel={op.channel_out!r}) (basic op {unused[0]}): no later "
                         f"AddExtraInput(channel={op.channel_out!r}) in the same run of fusible ops uses it (a "
                         f"non-fusible module, or a module with hooks, after it splits the run)")
    return Channels(source) if made else None


__all__ = ["Channels", "find_channels"]
