"""The plan a fuser runs (:class:`Plan`): the forward and backward groups chosen by the matcher,
with what every call reads derived once per plan, and the check that a plan expands back to the
basic ops in order (:func:`verify`). Built by :class:`fusible_ops.fuser.OperationFuser`."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional, Sequence

from .op import BasicOperation, reads_fp8
from .rules import Decline, Group

if TYPE_CHECKING:
    from .replay import Replayer


@dataclasses.dataclass
class Plan:
    forward: list[Group]
    backward: list[Group]
    declines: dict[str, list[Decline]]
    # bookkeeping derived once per plan
    requires_grad: bool
    input_requires_grad: list[bool]
    weight_requires_grad: list[bool]
    backward_stop: int  # backward groups whose last op index < backward_stop are skipped
    param_counts: list[int]  # parameters per basic op (param_names() of each)
    # per-op keyword arguments for op_forward (quantizer hand-off); fixed per plan because the
    # quantization recipe is part of the plan key
    op_kwargs: list[dict]
    # which flat extra inputs / parameters autograd wants a gradient for (they require grad: part
    # of the plan key); backward returns None for the others
    extra_keep: tuple
    param_keep: tuple
    # training call (CPU, or CUDA up to NATIVE_MAX_NUMEL input elements) whose forward steps are all
    # ``cpu_autograd`` ops: runs under PyTorch's autograd (see CPU_AUTOGRAD), the contract weights of flagged ops through grad.gate_weights
    # (``gated``: its arguments), every trainable contract weight's when delayed_wgrad() is active
    # at forward (``gated_all``); None for every other plan and when there is no such weight
    cpu_autograd: bool = False
    gated: Optional[tuple] = None
    gated_all: Optional[tuple] = None
    device_type: str = "cpu"  # of the calls this plan serves (part of the key)
    # CUDA training plan whose steps are all ``replayable`` (no flagged weights, no delayed FP8, no extra
    # outputs): its calls are replayed from C++ (fusible_ops.replay.Replayer, set by replay's plan
    # extension), else None
    replay: Optional[Replayer] = None
    unwatched: bool = False  # made while tracing: its first eager native call watches the weights
    # per basic op: a training call (grad mode on at the call, the op in training mode; both part
    # of the key): the ctxs' ``training`` (state kept between steps changes only then)
    training: Optional[list] = None
    # the Float8DelayedScaling recipe of an eager training plan under it (its calls batch the
    # delayed-scaling updates: fusible_ops.quantization.delayed), else None
    fp8_delayed: Optional[object] = None

    def __post_init__(self) -> None:
        self._drop_unread_quantizers()
        # What every call reads, computed once per plan (the host path stays short).
        if self.training is None:
            self.training = [False] * len(self.input_requires_grad)
        self.ctx_flags = [(self.requires_grad, i, w, t) for i, w, t in zip(self.input_requires_grad,
                                                                            self.weight_requires_grad, self.training)]
        self.forward_steps = [(g.op, g.indices, [self.op_kwargs[i] for i in g.indices]) for g in self.forward]
        self.backward_steps = [(g.op, g.indices, self.op_kwargs[g.indices[0]]["prev_op_grad_output_quantizer"])
                               for g in reversed(self.backward) if g.indices[-1] >= self.backward_stop]
        self.backward_complete = all(g.indices[-1] >= self.backward_stop for g in self.backward)
        self.no_param_grads = [(None,) * c for c in self.param_counts]
        self.keep_all = all(self.extra_keep) and all(self.param_keep)  # (backward returns every gradient as is)

    def _drop_unread_quantizers(self) -> None:
        """A producer writes FP8 for the op after it (or, in backward, for the op before it) only
        where that op's step reads FP8 as is (:func:`~fusible_ops.op.reads_fp8`): a fused step
        that would dequantize it again gets the producer's plain output."""
        n = len(self.op_kwargs)
        for g in self.forward:
            i = g.indices[0]
            if i > 0 and not reads_fp8(g.op, g.op.basic_ops[0]):
                self.op_kwargs[i - 1]["next_op_input_quantizer"] = None
        for g in self.backward:
            j = g.indices[-1] + 1
            if j < n and not reads_fp8(g.op, g.op.basic_ops[-1]):
                self.op_kwargs[j]["prev_op_grad_output_quantizer"] = None

    def compile_steps(self, ops: Sequence[BasicOperation]) -> None:
        """The steps as the fuser's autograd function runs them (rebuilt when the steps change).

        Forward: ``(op, indices, kwargs, direct, plain_in)``; backward: ``(op, indices, gq,
        direct, plain_in)``. ``direct``: one basic op with no extra inputs or outputs that keeps
        :class:`BasicOperation`'s ``fuser_forward`` / ``fuser_backward``, so the step calls its
        ``op_forward`` (with the non-None kwargs, found here once) / ``op_backward`` itself.
        ``plain_in``: the step reads plain tensors (:func:`~fusible_ops.op.reads_fp8` is false),
        so a Float8Tensor is dequantized for it."""
        def direct(op, idx, hook):
            return (len(idx) == 1 and isinstance(op, BasicOperation) and not op.num_extra_inputs
                    and not op.num_extra_outputs and getattr(type(op), hook) is getattr(BasicOperation, hook))

        def plain_in(op, i):
            return not reads_fp8(op, ops[i])

        fwd = []
        for op, idx, kws in self.forward_steps:
            if direct(op, idx, "fuser_forward"):
                fwd.append((op, idx[0], {k: v for k, v in kws[0].items() if v is not None}, True,
                            plain_in(op, idx[0])))
            else:
                fwd.append((op, idx, kws, False, plain_in(op, idx[0])))
        bwd = []
        for op, idx, gq in self.backward_steps:
            # (a basic op that writes a preceding FP8 linear's gradient overrides fuser_backward
            # only for that: without a quantizer its op_backward is the step)
            ok = gq is None and (direct(op, idx, "fuser_backward") or (
                len(idx) == 1 and isinstance(op, BasicOperation) and not op.num_extra_inputs
                and not op.num_extra_outputs and getattr(op, "writes_fp8_grad", False)))
            bwd.append((op, idx[0] if ok else idx, gq, ok, plain_in(op, idx[-1])))
        self.forward_program, self.backward_program = fwd, bwd


def verify(ops: Sequence[BasicOperation], groups: list[Group], pass_: str) -> None:
    expanded = [op for g in groups for op in g.op.basic_ops]
    indices = [i for g in groups for i in g.indices]
    ok = indices == list(range(len(ops))) and len(expanded) == len(ops)
    ok = ok and all(a is b for a, b in zip(expanded, ops))
    if not ok:
        raise RuntimeError(
            f"fusion plan ({pass_}) does not expand to the basic ops in order:\n"
            f"  basic ops: {[type(op).__name__ for op in ops]}\n"
            f"  plan:      {[(g.label, [type(o).__name__ for o in g.op.basic_ops]) for g in groups]}"
        )
