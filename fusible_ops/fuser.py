"""OperationFuser: runs a run of basic ops as ONE ``torch.autograd.Function``.

Forward and backward are planned separately by the shared matcher in :mod:`fusible_ops.rules`:
joint rules first (they fix a span in both plans), then forward rules and backward rules on
what is left. Every plan is verified to expand back to exactly the basic ops, in order.

Plans are cached under a key of everything a rule may depend on: grad mode, each op's
``state_version`` (bumped by any attribute assignment: flags, ``train()``/``eval()``) and
``plan_key()``, which parameters and inputs require grad, dtype, device, the quantization
recipe, the rule set's version (registrations) and the set of ``disabled(...)`` rules. A
steady-state call computes the key and finds its plan: no pattern matching happens.

Parameters are resolved by name on every call (``getattr(owner, name)``), so
``torch.func.functional_call``, parametrizations and reassigned parameters are what the ops
compute with, and autograd routes their gradients.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
from torch.nn.utils import parametrize

from .grad import check_flagged_ops
from .op import BasicOperation, OperationContext
from .quantization.recipes import current_recipe
from .quantization.tensor import Float8Tensor
from .rules import Decline, FusionContext, Group, RuleSet, disabled_key, global_rules, plan_pass


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

    def __post_init__(self) -> None:
        # What every call reads, computed once per plan (the host path stays short).
        self.ctx_flags = [(self.requires_grad, i, w) for i, w in zip(self.input_requires_grad,
                                                                      self.weight_requires_grad)]
        self.forward_steps = [(g.op, g.indices, [self.op_kwargs[i] for i in g.indices]) for g in self.forward]
        self.backward_steps = [(g.op, g.indices, self.op_kwargs[g.indices[0]]["prev_op_grad_output_quantizer"])
                               for g in reversed(self.backward) if g.indices[-1] >= self.backward_stop]
        self.backward_complete = all(g.indices[-1] >= self.backward_stop for g in self.backward)


def _verify(ops: Sequence[BasicOperation], groups: list[Group], pass_: str) -> None:
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


def _routing_layout(ops):
    """The MoE routing layout of ``ops`` (:class:`fusible_ops.ops.moe.RoutingLayout`), or None
    when no op has a ``routing_role`` (the common case: nothing is imported or built)."""
    if not any(getattr(op, "routing_role", None) for op in ops):
        return None
    from .ops.moe import RoutingLayout  # local import: the ops import this module's package

    return RoutingLayout(ops)


class _RoutedSteps:
    """A fuser's whole plan as ONE step, for fusers holding MoE routing ops.

    ``install()`` replaces the plan's forward and backward steps by this object, so the fuser's
    autograd function (untouched, as for every chain) calls it once per pass. It runs the plan's
    real steps (the groups ``fusion_plan()`` reports) with a fresh :class:`Routing` per MoE layer
    per pass: routing ops get it as ``routing=``, routed ops (``GroupedLinear`` between Dispatch
    and Combine) get its fields as their extra inputs (``RoutingLayout.feeds``). Forward routings
    live only during the forward (each op saves what its backward reads in its own ctx, through
    autograd); backward ones carry the probabilities' gradient from Combine to Router.
    """

    def __init__(self, plan: "Plan", ops, layout) -> None:
        self.plan, self.ops, self.layout = plan, ops, layout

        def step_region(idx):
            regions = [layout.region[i] for i in idx if getattr(ops[i], "routing_role", None)]
            return regions[0] if regions else None

        def sources(idx):  # per op of a step: (its index, its MoE layer, the routing fields it is fed)
            return tuple([(i, layout.region[i], layout.feeds[i]) for i in idx])

        self.fwd = [(op, idx, kw, step_region(idx), sources(idx)) for op, idx, kw in plan.forward_steps]
        self.bwd = [(op, idx, gq, step_region(idx)) for op, idx, gq in plan.backward_steps]
        self.complete = plan.backward_complete
        self.all = tuple(range(len(ops)))

    def install(self) -> None:
        plan = self.plan
        plan.forward_steps = [(self, self.all, plan.op_kwargs)]
        plan.backward_steps = [(self, self.all, None)] if plan.backward_steps else []
        plan.backward_complete = True  # this step returns None for dx itself when incomplete

    def fuser_forward(self, ctxs, x, *, extra_inputs, basic_op_kwargs):
        ops = self.ops
        routings = self.layout.new_routings()
        extra_outputs = [()] * len(ops)
        y = x
        for op, idx, kwargs, region, sources in self.fwd:
            if type(y) is Float8Tensor and not getattr(ops[idx[0]], "accepts_fp8", False):
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
        param_grads = [(None,) * c for c in self.plan.param_counts]
        grad_extra_in = [None] * len(ops)
        for op, idx, gq, region in self.bwd:
            if type(dy) is Float8Tensor and not getattr(ops[idx[-1]], "accepts_fp8", False):
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


class OperationFuser:
    """Runs ``ops`` (basic ops, in order) as one autograd node with fused forward/backward."""

    def __init__(self, ops: Sequence[BasicOperation], rules: Optional[RuleSet] = None) -> None:
        ops = list(ops)
        for op in ops:
            if not isinstance(op, BasicOperation):
                raise TypeError(f"OperationFuser takes basic ops, got {type(op).__name__}")
        self.ops = ops
        self.rules = rules
        # MoE routing (Router -> Dispatch -> routed GroupedLinears -> Combine): found once, here.
        # None for every other chain: then nothing on the per-call path differs.
        self._routing = _routing_layout(ops)
        if self._routing is None:
            self._num_extra_inputs = [op.num_extra_inputs for op in ops]
        else:  # routed ops get their extra inputs (split sizes) from the routing, not the caller
            self._num_extra_inputs = self._routing.extra_input_counts(ops)
        self._num_extra_outputs = [op.num_extra_outputs for op in ops]
        self.num_extra_inputs = sum(self._num_extra_inputs)
        self.num_extra_outputs = sum(self._num_extra_outputs)
        self._plans: dict[tuple, Plan] = {}
        self.num_plans_made = 0
        self._no_extras = [()] * len(ops)
        self._none_extra_grads = [(None,) * m for m in self._num_extra_inputs]
        self._versions: Optional[tuple] = None  # op state versions the slots below were made for
        self._slots: list[tuple[torch.nn.Module, str]] = []  # (owner module, name) per parameter
        self._param_counts: list[int] = []
        self._parametrized = False
        self._wgrad_flagged = False
        self.last_key: Optional[tuple] = None  # key of the last call (fusion_plan() reports it)

    # -- planning ----------------------------------------------------------------------
    def _rule_set(self) -> RuleSet:
        return self.rules if self.rules is not None else global_rules()

    def _refresh(self, versions: tuple) -> None:
        """Recompute what depends only on the ops' state (run when a state version changed)."""
        self._slots = [(op.param_owner(n), n) for op in self.ops for n in op.param_names()]
        self._param_counts = [len(op.param_names()) for op in self.ops]
        self._keyed_ops = [op for op in self.ops if type(op).plan_key is not BasicOperation.plan_key]
        self._parametrized = any(parametrize.is_parametrized(m, n) for m, n in self._slots)
        self._wgrad_flagged = any(
            getattr(op, "accumulate_into_main_grad", False) or getattr(op, "delay_wgrad_compute", False)
            for op in self.ops
        )
        self._versions = versions

    def _params(self) -> list[torch.Tensor]:
        """The tensors the ops compute with for this call, ``param_names()`` order, op by op."""
        versions = tuple([op.state_version for op in self.ops])
        if versions != self._versions:
            self._refresh(versions)
        return [getattr(m, n) for m, n in self._slots]

    def _key(self, x: torch.Tensor, extra_inputs: Sequence, params: Sequence[torch.Tensor]) -> tuple:
        rs = self._rule_set()
        return (
            torch.is_grad_enabled(),
            x.dtype,
            x.device,
            x.requires_grad,
            tuple([p.requires_grad for p in params]),
            tuple([isinstance(e, torch.Tensor) and e.requires_grad for e in extra_inputs]),
            self._versions,
            tuple([op.plan_key() for op in self._keyed_ops]),
            current_recipe(),
            rs.version,
            disabled_key(),
        )

    def plan_for(self, x: torch.Tensor, extra_inputs: Sequence = (), params: Optional[Sequence] = None) -> Plan:
        """The (cached) plan for a call with these inputs."""
        if params is None:
            params = self._params()
        key = self._key(x, extra_inputs, params)
        return self._plans.get(key) or self._new_plan(key, x, extra_inputs, params)

    def _new_plan(self, key: tuple, x: torch.Tensor, extra_inputs: Sequence, params: Sequence) -> Plan:
        plan = self._make_plan(x, extra_inputs, params)
        self._plans[key] = plan
        # A rule's builder may have assigned op attributes: file the plan under the key of the
        # state it leaves too, so the next call finds it.
        self._plans.setdefault(self._key(x, extra_inputs, self._params()), plan)
        return plan

    def last_call_inputs(self) -> Optional[tuple]:
        """Stand-ins ``(grad_enabled, x, extra_inputs)`` with the planning-relevant properties
        (dtype, device, requires_grad) of the last call, or None before the first call."""
        key = self.last_key
        if key is None:
            return None
        grad_on, dtype, device, x_rg, _, extra_rg = key[:6]
        x = torch.empty(0, dtype=dtype, device=device, requires_grad=x_rg)
        extras = tuple(torch.empty(0, requires_grad=True) if rg else None for rg in extra_rg)
        return grad_on, x, extras

    def _make_plan(self, x: torch.Tensor, extra_inputs: Sequence, params: Sequence[torch.Tensor]) -> Plan:
        self.num_plans_made += 1
        ops = self.ops
        grad_on = torch.is_grad_enabled()
        extras = self._split_extra(extra_inputs)
        op_trainable, k = [], 0
        for count in self._param_counts:
            op_trainable.append(any(p.requires_grad for p in params[k : k + count]))
            k += count
        op_extra_grad = [any(isinstance(e, torch.Tensor) and e.requires_grad for e in ex) for ex in extras]
        requires_grad = grad_on and (x.requires_grad or any(op_trainable) or any(op_extra_grad))
        input_rg, need = [], x.requires_grad
        for i in range(len(ops)):
            input_rg.append(requires_grad and need)
            need = need or op_trainable[i] or op_extra_grad[i]
        # Backward must run group g only if some op at or before g's last index needs a grad.
        needs_grad_at = [input_rg[i] or op_trainable[i] or op_extra_grad[i] for i in range(len(ops))]
        backward_stop = next((i for i, n in enumerate(needs_grad_at) if n), len(ops))

        rs = self._rule_set()
        base = dict(
            dtype=x.dtype,
            device=x.device,
            recipe=current_recipe(),
            requires_grad=requires_grad,
            training=any(op.training for op in ops),
        )
        joint, joint_declines = [], []
        if requires_grad:
            joint, joint_declines = plan_pass(ops, rs.rules("joint"), FusionContext(pass_="joint", **base))
            joint = [g for g in joint if g.rule is not None]
        taken = {g.indices[0]: g for g in joint}
        fwd, fwd_declines = plan_pass(ops, rs.rules("forward"), FusionContext(pass_="forward", **base), taken)
        if requires_grad:
            bwd, bwd_declines = plan_pass(ops, rs.rules("backward"), FusionContext(pass_="backward", **base), taken)
        else:
            bwd, bwd_declines = [], []
        _verify(ops, fwd, "forward")
        if requires_grad:
            _verify(ops, bwd, "backward")
        plan = Plan(
            forward=fwd,
            backward=bwd,
            declines={"joint": joint_declines, "forward": fwd_declines, "backward": bwd_declines},
            requires_grad=requires_grad,
            input_requires_grad=input_rg,
            weight_requires_grad=[requires_grad and t for t in op_trainable],
            backward_stop=backward_stop,
            param_counts=list(self._param_counts),
            extra_keep=tuple([requires_grad and isinstance(e, torch.Tensor) and e.requires_grad
                              for e in extra_inputs]),
            param_keep=tuple([requires_grad and p.requires_grad for p in params]),
            op_kwargs=[
                {
                    "next_op_input_quantizer": (_input_quantizer(ops[i + 1], requires_grad and op_trainable[i + 1])
                                                if i + 1 < len(ops) else None),
                    "prev_op_grad_output_quantizer": (
                        _grad_quantizer(ops[i - 1], requires_grad and op_trainable[i - 1]) if i > 0 else None),
                }
                for i in range(len(ops))
            ],
        )
        if self._routing is not None:
            _RoutedSteps(plan, ops, self._routing).install()
        return plan

    def _split_extra(self, extra_inputs: Sequence) -> list[tuple]:
        out, k = [], 0
        for n in self._num_extra_inputs:
            out.append(tuple(extra_inputs[k : k + n]))
            k += n
        return out

    # -- running -----------------------------------------------------------------------
    def __call__(self, x: torch.Tensor, *extra_inputs):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"fuser input must be a tensor, got {type(x).__name__}")
        if len(extra_inputs) != self.num_extra_inputs:
            names = [type(op).__name__ for op, n in zip(self.ops, self._num_extra_inputs) if n]
            raise TypeError(
                f"expected {self.num_extra_inputs} extra input(s) (for {names}), got {len(extra_inputs)}"
            )
        versions = tuple([op.state_version for op in self.ops])
        if versions != self._versions:
            self._refresh(versions)
        if self._parametrized:  # one evaluation of each parametrization per call, with grad
            with parametrize.cached():
                return self._run(x, extra_inputs)
        return self._run(x, extra_inputs)

    def _run(self, x: torch.Tensor, extra_inputs: tuple):
        params = [getattr(m, n) for m, n in self._slots]  # __call__ refreshed the slots
        key = self._key(x, extra_inputs, params)
        plan = self._plans.get(key) or self._new_plan(key, x, extra_inputs, params)
        self.last_key = key
        if self._wgrad_flagged and plan.requires_grad:
            check_flagged_ops(self.ops, params, plan.param_counts)
        args = [*extra_inputs, *params]
        seen = {id(x)}
        for i, t in enumerate(args):  # the same tensor twice (x as residual, tied weights):
            if isinstance(t, torch.Tensor):
                if id(t) in seen:
                    args[i] = t.view_as(t)  # give autograd.Function distinct inputs (an alias)
                else:
                    seen.add(id(t))
        if _eager_apply_ok():  # autograd.Function.apply's Python preamble, minus what eager does not need
            outs = _RAW_APPLY(_unwrap(x), self, plan, len(extra_inputs), *[
                _unwrap(a) if isinstance(a, torch.Tensor) else a for a in args])
        else:
            outs = _FuserFunction.apply(x, self, plan, len(extra_inputs), *args)
        if self.num_extra_outputs == 0:
            return outs[0]
        return tuple(outs)


def _input_quantizer(op: BasicOperation, weight_grad: bool):
    """``op.input_quantizer()``, told whether the op computes a weight gradient in this plan."""
    return _told(op.input_quantizer(), weight_grad)


def _grad_quantizer(op: BasicOperation, weight_grad: bool):
    """``op.grad_output_quantizer()``, told whether the op computes a weight gradient."""
    return _told(op.grad_output_quantizer(), weight_grad)


def _told(q, weight_grad: bool):
    if q is not None and hasattr(q, "colwise"):
        q.colwise = weight_grad
    return q


class _BackwardContext:
    """An :class:`OperationContext` as backward sees it: a copy of the forward ctx's attributes,
    with the saved tensors handed back by autograd. Attributes set in backward stay on this view
    (nothing created in forward is mutated, so torch.compile can trace the backward too)."""

    def __init__(self, base: OperationContext, saved: tuple) -> None:
        if not _is_compiling():  # (eager: attribute reads then skip __getattr__; dynamo reads through it)
            self.__dict__.update(base.__dict__)
        self._base = base
        self._saved = saved

    @property
    def saved_tensors(self) -> tuple:
        return self._saved

    def release(self) -> None:
        self._saved = ()

    def __getattr__(self, name: str):  # (under torch.compile; class attributes of the ctx's type)
        return getattr(self._base, name)


class _FuserFunction(torch.autograd.Function):
    @staticmethod
    def forward(func_ctx, x, fuser: OperationFuser, plan: Plan, num_extra: int, *args):
        n = len(fuser.ops)
        extra_inputs = fuser._split_extra(args[:num_extra]) if num_extra else fuser._no_extras
        ctxs = [OperationContext(rg, irg, wrg) for rg, irg, wrg in plan.ctx_flags]
        has_extra_out = fuser.num_extra_outputs != 0
        extra_outputs: list[tuple] = [()] * n
        y = x
        for op, idx, kwargs in plan.forward_steps:
            if type(y) is Float8Tensor and not getattr(fuser.ops[idx[0]], "accepts_fp8", False):
                y = y.dequantize()  # an op that reads plain tensors
            if len(idx) == 1:
                i = idx[0]
                y, ex = op.fuser_forward([ctxs[i]], y, extra_inputs=[extra_inputs[i]], basic_op_kwargs=kwargs)
            else:
                y, ex = op.fuser_forward([ctxs[i] for i in idx], y, extra_inputs=[extra_inputs[i] for i in idx],
                                         basic_op_kwargs=kwargs)
            if has_extra_out:
                for i, e in zip(idx, ex):
                    extra_outputs[i] = tuple(e)
        if plan.requires_grad:
            # Route every op's saved tensors through autograd (saved-tensor hooks, offloading,
            # in-place modification checks all see them); ctxs get them back in backward.
            counts, flat = [], []
            for c in ctxs:
                counts.append(len(c._saved))
                flat.extend(c._saved)
                c._saved = ()
            func_ctx.save_for_backward(*flat)
            func_ctx.saved_counts = counts
        func_ctx.fuser = fuser
        func_ctx.plan = plan
        func_ctx.op_ctxs = ctxs
        func_ctx.x_requires_grad = x.requires_grad
        # An output that is an input (or another output) gets its own alias so autograd can
        # attach a distinct grad_fn to it.
        if not has_extra_out:  # the common case: one output
            alias = y is x
            for a in args:
                alias = alias or y is a
            if alias:
                y = y.view_as(y)
            if not y.is_floating_point():
                func_ctx.mark_non_differentiable(y)
            return (y,)
        flat_extra_out = [t for e in extra_outputs for t in e]
        inputs = (x, *args)
        outs = []
        for t in (y, *flat_extra_out):
            if any(t is a for a in inputs) or any(t is o for o in outs):
                t = t.view_as(t)
            outs.append(t)
        non_diff = [t for t in outs if not t.is_floating_point()]
        if non_diff:
            func_ctx.mark_non_differentiable(*non_diff)
        return tuple(outs)

    @staticmethod
    def backward(func_ctx, dy, *grad_extra_outputs_flat):
        fuser: OperationFuser = func_ctx.fuser
        plan: Plan = func_ctx.plan
        ctxs = func_ctx.op_ctxs
        ops = fuser.ops
        if fuser.num_extra_outputs:
            grad_extra_out: list[tuple] = []
            k = 0
            for m in fuser._num_extra_outputs:
                grad_extra_out.append(tuple(grad_extra_outputs_flat[k : k + m]))
                k += m
        else:
            grad_extra_out = fuser._no_extras
        # Views of the forward ctxs that carry the saved tensors: nothing created in forward is
        # mutated, so torch.compile can trace the backward too.
        saved, k, views = func_ctx.saved_tensors, 0, []
        for c, m in zip(ctxs, func_ctx.saved_counts):
            views.append(_BackwardContext(c, tuple(saved[k : k + m])))
            k += m
        ctxs = views
        param_grads: list[tuple] = [(None,) * c for c in plan.param_counts]
        grad_extra_in: list[tuple] = list(fuser._none_extra_grads)
        for op, idx, gq in plan.backward_steps:
            if type(dy) is Float8Tensor and not getattr(ops[idx[-1]], "accepts_fp8", False):
                dy = dy.dequantize()
            if gq is None:
                dy, pg, ge = op.fuser_backward(
                    [ctxs[i] for i in idx], dy, grad_extra_outputs=[grad_extra_out[i] for i in idx]
                )
            else:  # the op before this group is an FP8 linear: its output gradient may be written in FP8
                dy, pg, ge = op.fuser_backward(
                    [ctxs[i] for i in idx], dy, grad_extra_outputs=[grad_extra_out[i] for i in idx],
                    prev_op_grad_output_quantizer=gq,
                )
            for j, i in enumerate(idx):
                pg_i = tuple(pg[j])
                if len(pg_i) != len(param_grads[i]):
                    raise RuntimeError(
                        f"{type(op).__name__}.fuser_backward returned {len(pg_i)} param grads for "
                        f"{type(ops[i]).__name__}, which has {len(param_grads[i])} parameters"
                    )
                param_grads[i] = pg_i
                if ge[j] is not None:
                    grad_extra_in[i] = tuple(ge[j])
                ctxs[i].release()
        if not plan.backward_complete:
            dy = None
        elif type(dy) is Float8Tensor:  # autograd gets plain gradients
            dy = dy.dequantize()
        dx = dy if func_ctx.x_requires_grad else None
        flat_ge = [t if k else None for k, t in zip(plan.extra_keep, [t for e in grad_extra_in for t in e])]
        flat_pg = [t if k else None for k, t in zip(plan.param_keep, [t for p in param_grads for t in p])]
        return (dx, None, None, None, *flat_ge, *flat_pg)


# ``_FuserFunction.apply`` is a Python classmethod that, when no functorch transform is active,
# unwraps dead functorch wrappers and calls the C++ apply. Eager calls do exactly that here without
# its other per-call work; traced calls (torch.compile) and functorch transforms go through it.
_RAW_APPLY = torch._C._FunctionBase.__dict__["apply"].__get__(None, _FuserFunction)
_unwrap = torch._C._functorch.unwrap_if_dead
_transforms_active = torch._C._are_functorch_transforms_active
_is_compiling = torch.compiler.is_compiling


def _eager_apply_ok() -> bool:
    return not _is_compiling() and not _transforms_active()
