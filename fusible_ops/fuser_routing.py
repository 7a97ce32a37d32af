"""MoE routing inside a fuser: the whole plan run as one step (see :class:`RoutedSteps`).

Built on the fuser and the MoE ops, which :mod:`fusible_ops.fuser` does not import: this module
registers a plan extension (:mod:`fusible_ops.fuser_extensions`) when it is imported (``import
fusible_ops`` imports it). Through it a fuser calls :func:`routing_layout` once, when it is built,
and, for a fuser holding routing ops, :meth:`RoutedSteps.install` once per plan.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .fuser_extensions import PlanExtension, register_plan_extension
from .op import reads_fp8
from .ops.moe_routing import routing_layout
from .quantization.tensor import is_float8

if TYPE_CHECKING:
    from .fuser_plan import Plan


class RoutedSteps:
    """A fuser's whole plan as ONE step, for fusers holding MoE routing ops.

    ``install(plan)`` replaces the plan's forward and backward steps by this object, so the fuser's
    autograd function (untouched, as for every chain) calls it once per pass. It runs the plan's
    real steps (the groups ``fusion_plan()`` reports) with a fresh :class:`Routing` per MoE layer
    per pass: routing ops get it as ``routing=``, routed ops (``GroupedLinear`` between Dispatch
    and Combine) get its fields as their extra inputs (``RoutingLayout.feeds``). Forward routings
    live only during the forward (each op saves what its backward reads in its own ctx, through
    autograd); backward ones carry the probabilities' gradient from Combine to Router.
    """

    def __init__(self, plan: "Plan", ops, layout) -> None:
        # (not the plan itself: the plan holds this object as its step, and a reference back would
        # be a cycle that keeps the parameters alive after ``del model`` until the cyclic GC runs)
        self.ops, self.layout, self.param_counts = ops, layout, plan.param_counts

        def step_region(idx):
            regions = [layout.region[i] for i in idx if getattr(ops[i], "routing_role", None)]
            return regions[0] if regions else None

        def sources(idx):  # per op of a step: (its index, its MoE layer, the routing fields it is fed)
            return tuple([(i, layout.region[i], layout.feeds[i]) for i in idx])

        self.fwd = [(op, idx, kw, step_region(idx), sources(idx)) for op, idx, kw in plan.forward_steps]
        self.bwd = [(op, idx, gq, step_region(idx)) for op, idx, gq in plan.backward_steps]
        self.complete = plan.backward_complete
        self.all = tuple(range(len(ops)))

    def install(self, plan: "Plan") -> None:
        plan.forward_steps = [(self, self.all, plan.op_kwargs)]
        plan.backward_steps = [(self, self.all, None)] if plan.backward_steps else []
        plan.backward_complete = True  # this step returns None for dx itself when incomplete
        plan.compile_steps(self.ops)

    def fuser_forward(self, ctxs, x, *, extra_inputs, basic_op_kwargs):
        ops = self.ops
        routings = self.layout.new_routings()
        extra_outputs = [()] * len(ops)
        y = x
        for op, idx, kwargs, region, sources in self.fwd:
            if is_float8(y) and not reads_fp8(op, ops[idx[0]]):
                y = y.dequantize()
            ex = [tuple([getattr(routings[r], f) for f in fed]) if fed else extra_inputs[i] for i, r, fed in sources]
            extra = {} if region is None else {"routing": routings[region]}
            y, outs = op.fuser_forward([ctxs[i] for i in idx], y, extra_inputs=ex, basic_op_kwargs=kwargs, **extra)
            for i, e in zip(idx, outs):
                extra_outputs[i] = tuple(e)
        return y, extra_outputs

    def fuser_backward(self, ctxs, dy, *, grad_extra_outputs):
        ops, feeds = self.ops, self.layout.feeds
        routings = self.layout.new_routings()
        param_grads = [(None,) * c for c in self.param_counts]
        grad_extra_in = [None] * len(ops)
        for op, idx, gq, region in self.bwd:
            if is_float8(dy) and not reads_fp8(op, ops[idx[-1]]):
                dy = dy.dequantize()
            extra = {} if region is None else {"routing": routings[region]}
            if gq is not None:
                extra["prev_op_grad_output_quantizer"] = gq
            dy, pg, ge = op.fuser_backward([ctxs[i] for i in idx], dy,
                                           grad_extra_outputs=[grad_extra_outputs[i] for i in idx], **extra)
            for j, i in enumerate(idx):
                param_grads[i] = pg[j]
                grad_extra_in[i] = () if feeds[i] else ge[j]  # routed ops' extra inputs are not the caller's
                ctxs[i].release()
        return (dy if self.complete else None), param_grads, grad_extra_in


def _install(fuser, plan: "Plan", layout, n_extra: int, recipe) -> None:
    """The plan extension's hook: a routed fuser's new plan runs as one :class:`RoutedSteps`."""
    RoutedSteps(plan, fuser.ops, layout).install(plan)


# routing_layout (:func:`fusible_ops.ops.moe_routing.routing_layout`): the MoE routing layout of a fuser's
# ops, or None when no op has a ``routing_role`` (then the fuser's plans are not routed).
register_plan_extension(PlanExtension("moe_routing", _install, layout=routing_layout, runs_steps=True))

__all__ = ["RoutedSteps", "routing_layout"]
