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

The layers built on the fuser (MoE routing: :mod:`fusible_ops.fuser_routing`; C++ replay:
:mod:`fusible_ops.replay`) join in its planning through the plan extensions they register when
imported (:mod:`fusible_ops.fuser_extensions`); this module imports neither them nor the ops.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional, Sequence

import torch
import torch.autograd.forward_ad as _forward_ad
from torch.nn.utils import parametrize

from .fuser_extensions import extensions_for
from .fuser_plan import Plan, verify as _verify
from .fuser_params import check_param_grads as _check_param_grads
from .fuser_params import as_views as _as_views
from .fuser_params import grad_quantizer as _grad_quantizer
from .fuser_params import input_quantizer as _input_quantizer
from .fuser_params import reader as _reader, training_call as _training_call
from .data_parallel import active_ddp
from .grad import check_flagged_ops, contract_weights, gate_weights, scheduler_active, watch_plain_weights
from .kernels import current_mode, set_mode
from .op import STATE_EPOCH as _STATE_EPOCH
from .op import BasicOperation, OperationContext, check_loss_last, set_fuser_factory
from .quantization.delayed import run_batched as _delayed_batched
from .quantization.recipes import Float8DelayedScaling, current_recipe
from .quantization.recipes import scope as fp8_scope
from .quantization.recipes import state as fp8_state
from .quantization.tensor import TracedFloat8, is_float8
from .rules import COST_HINTS, FusionContext, RuleSet, disabled_key, global_rules, plan_pass
from .channels import find_channels

CPU_AUTOGRAD = os.environ.get("FUSIBLE_OPS_CPU_AUTOGRAD", "1") != "0"
"""Run CPU training calls under PyTorch's own autograd where every forward step allows it
(:attr:`~fusible_ops.op.FusibleOperation.cpu_autograd`): the forward runs the plan's steps (their
``*_ref`` math) with autograd recording, and autograd differentiates that math, so the call costs
about what the same ops cost as ``torch.nn`` modules. Trainable weights of linears with
``accumulate_into_main_grad`` or ``delay_wgrad_compute`` (all of them inside :func:`~fusible_ops.grad.delayed_wgrad`)
pass through :class:`~fusible_ops.grad.ContractGate`; the others' gradients go to autograd's
``.grad`` accumulation, which :func:`~fusible_ops.grad.delayed_wgrad` hooks while it is active. So
gradients reach ``main_grad``, the delayed-wgrad queue or ``.grad`` as the gradient contract says. The plans are unchanged, but
the backward plan does not run. Not inside ``kernels.use("triton")`` (Triton's interpreter runs the
steps: nothing for autograd to record). ``FUSIBLE_OPS_CPU_AUTOGRAD=0`` (or setting this to False) sends
every call through the fuser's autograd function and the ops' own backward, as on CUDA (tests of
the ``*_ref`` backward math do; see :func:`cpu_autograd`)."""


NATIVE_MAX_NUMEL = int(os.environ.get("FUSIBLE_OPS_NATIVE_MAX_NUMEL", str(1 << 16)))
"""CUDA training calls whose input has at most this many elements take the same path as CPU calls
under :data:`CPU_AUTOGRAD`: their forward steps run the reference math (torch's own CUDA ops:
cuBLAS, and one ATen kernel per elementwise op or norm) with PyTorch's autograd recording. At
such sizes a call is bound by host time, not by the device, and PyTorch's own ops and autograd
cost the host the least; the Triton kernels serve larger inputs. Needs :data:`CPU_AUTOGRAD` (so
``cpu_autograd(False)`` also sends these calls through the fused kernels) and the ``"auto"``
kernel mode. :func:`fusible_ops.make_graphed_callables` captures the fused kernels whatever the
size. ``FUSIBLE_OPS_NATIVE_MAX_NUMEL=0`` (or setting this to 0) turns it off."""


@contextlib.contextmanager
def cpu_autograd(enabled: bool):
    """Set :data:`CPU_AUTOGRAD` inside the ``with`` block (process-wide; the calls' forwards
    decide). ``cpu_autograd(False)`` makes CPU calls run the ops' own backward, e.g. to check it."""
    global CPU_AUTOGRAD
    previous, CPU_AUTOGRAD = CPU_AUTOGRAD, bool(enabled)
    try:
        yield
    finally:
        CPU_AUTOGRAD = previous


class OperationFuser:
    """Runs ``ops`` (basic ops, in order) as one autograd node with fused forward/backward."""

    def __init__(self, ops: Sequence[BasicOperation], rules: Optional[RuleSet] = None) -> None:
        ops = list(ops)
        for op in ops:
            if not isinstance(op, BasicOperation):
                raise TypeError(f"OperationFuser takes basic ops, got {type(op).__name__}")
        check_loss_last(ops)
        self.ops = ops
        self.rules = rules
        # The plan extensions' layouts of these ops and their per-plan hooks, found once, here.
        # ``_routing``: the layout of the one that runs the steps itself, MoE routing (Router ->
        # Dispatch -> routed GroupedLinears -> Combine); None for every other chain: then nothing on
        # the per-call path differs.
        self._routing, self._plan_hooks = extensions_for(ops)
        if self._routing is None:
            self._num_extra_inputs = [op.num_extra_inputs for op in ops]
        else:  # routed ops get their extra inputs (split sizes) from the routing, not the caller
            self._num_extra_inputs = self._routing.extra_input_counts(ops)
        self._num_extra_outputs = [op.num_extra_outputs for op in ops]
        self._channels = find_channels(ops)  # (values carried forward inside the run: fusible_ops.channels)
        if self._channels is not None:
            if self._routing is not None:
                raise ValueError("channels (MakeExtraOutput / AddExtraInput with channel=) inside a MoE layer's run "
                                 "of ops are not supported")
            for c in self._channels.source:  # (filled by the fuser, not by the caller)
                self._num_extra_inputs[c] = 0
            for p in self._channels.producers:
                self._num_extra_outputs[p] = 0
        self.num_extra_inputs = sum(self._num_extra_inputs)
        self.num_extra_outputs = sum(self._num_extra_outputs)
        self._plans: dict[tuple, Plan] = {}
        self.num_plans_made = 0
        self._no_extras = [()] * len(ops)
        self._none_extra_grads = [(None,) * m for m in self._num_extra_inputs]
        self._versions: Optional[tuple] = None  # op state versions the slots below were made for
        self._epoch = -1  # op.STATE_EPOCH when the versions were last compared
        self._slots: list[tuple[torch.nn.Module, str]] = []  # (owner module, name) per parameter
        self._param_counts: list[int] = []
        self._parametrized = False
        self._wgrad_flagged = False
        self._ddp_bound = False  # a weight is bound to DDP (fusible_ops.data_parallel): refresh at each forward
        self.last_key: Optional[tuple] = None  # key of the last call (fusion_plan() reports it)
        self._choices: dict = {}  # geometry -> rule names a tuned plan leaves out (fusible_ops.tuning)
        self.tuning_notes: dict = {}  # geometry -> what tuning measured (explain() shows it)
        self.last_off: frozenset = frozenset()  # rules the last call's tuned plan left out
        self._refresh(tuple([op.state_version for op in ops]))  # (now: a first call traced by
        # torch.compile then finds it done, and dynamo guards on no attribute the trace wrote)

    def __setstate__(self, state: dict) -> None:
        # (copy.deepcopy of a module, unpickling: the copy's cached plans leave the same weights
        # to delayed_wgrad()'s hooks as the original's did, so it is watched as the original was)
        self.__dict__.update(state)
        if state.get("plain_watched"):
            watch_plain_weights(self)

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
        self._reads = [_reader(m, n) for m, n in self._slots]
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
            tuple([isinstance(e, torch.Tensor) and e.requires_grad for e in extra_inputs]) if extra_inputs else (),
            self._versions,
            tuple([op.plan_key() for op in self._keyed_ops]) if self._keyed_ops else (),
            current_recipe(),
            rs.version,
            disabled_key(),
        )

    def plan_for(self, x: torch.Tensor, extra_inputs: Sequence = (), params: Optional[Sequence] = None,
                 off: Optional[frozenset] = None) -> Plan:
        """The (cached) plan for a call with these inputs (``off``: the rules a tuned choice leaves
        out; None: the choice tuning made for this geometry, if any)."""
        if params is None:
            params = self._params()
        if off is None:
            key, off = self._chosen(self._key(x, extra_inputs, params), x, extra_inputs, params, tune=False)
        else:
            key = self._key(x, extra_inputs, params) + ((off,) if off else ())
        return self._plans.get(key) or self._new_plan(key, x, extra_inputs, params, off)

    def _new_plan(self, key: tuple, x: torch.Tensor, extra_inputs: Sequence, params: Sequence,
                  off: frozenset = frozenset()) -> Plan:
        plan = self._make_plan(x, extra_inputs, params, off)
        self._plans[key] = plan
        # A rule's builder may have assigned op attributes: file the plan under the key of the
        # state it leaves too, so the next call finds it. (Not a tuned plan: its key is the geometry's.)
        if not off:
            self._plans.setdefault(self._key(x, extra_inputs, self._params()), plan)
        return plan

    @staticmethod
    def geometry(key: tuple, x: torch.Tensor, extra_inputs: Sequence) -> tuple:
        """What a tuned choice is kept for: the plan key and the inputs' shapes."""
        return (key, tuple(x.shape), tuple([tuple(e.shape) if isinstance(e, torch.Tensor) else e
                                            for e in extra_inputs]))

    def _chosen(self, key: tuple, x: torch.Tensor, extra_inputs: Sequence, params: Sequence,
                tune: bool = True) -> tuple:
        """``(key, off)``: the plan key extended by the rules a tuned choice leaves out for this
        geometry, and those rules (``off``; empty: the rule set's static plan). With ``tune`` and
        :func:`fusible_ops.tuning.enable` on, a geometry met for the first time is tuned here (never
        while torch.compile traces or a CUDA graph captures: the static plan is used then)."""
        if not self._choices and _TUNER[0] is None:
            return key, frozenset()
        geo = self.geometry(key, x, extra_inputs)
        off = self._choices.get(geo)
        if off is None:
            tuner = _TUNER[0]
            if (not tune or tuner is None or _is_compiling()
                    or (x.is_cuda and torch.cuda.is_current_stream_capturing())):
                return key, frozenset()
            off = self._choices[geo] = tuner(self, geo, x, extra_inputs, params)
        return (key + (off,) if off else key), off

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

    def _make_plan(self, x: torch.Tensor, extra_inputs: Sequence, params: Sequence[torch.Tensor],
                   off: frozenset = frozenset()) -> Plan:
        """A new plan for these inputs; rules named in ``off`` are left out (a tuned choice)."""
        if not _is_compiling():
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

        def rules(pass_: str) -> list:
            found = rs.rules(pass_)
            return [r for r in found if r.name not in off] if off else found
        base = dict(
            dtype=x.dtype,
            device=x.device,
            recipe=current_recipe(),
            requires_grad=requires_grad,
            training=any(op.training for op in ops),
            cost_hints=COST_HINTS not in off and COST_HINTS not in disabled_key(),
        )
        joint, joint_declines = [], []
        if requires_grad:
            joint, joint_declines = plan_pass(ops, rules("joint"), FusionContext(pass_="joint", **base))
            joint = [g for g in joint if g.rule is not None]
        taken = {g.indices[0]: g for g in joint}
        fwd, fwd_declines = plan_pass(ops, rules("forward"), FusionContext(pass_="forward", **base), taken)
        if requires_grad:
            bwd, bwd_declines = plan_pass(ops, rules("backward"), FusionContext(pass_="backward", **base), taken)
        else:
            bwd, bwd_declines = [], []
        _verify(ops, fwd, "forward")
        if requires_grad:
            _verify(ops, bwd, "backward")
        native = (requires_grad and x.device.type in ("cpu", "cuda") and self._routing is None and base["recipe"] is None
                  and all(g.op.cpu_autograd for g in fwd))
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
            training=[_training_call(op, grad_on) for op in ops],
            fp8_delayed=(base["recipe"] if isinstance(base["recipe"], Float8DelayedScaling) and requires_grad
                         and not _is_compiling() else None),
            cpu_autograd=native,
            device_type=x.device.type,
            gated=contract_weights(ops, params, self._param_counts, flagged_only=True) if native else None,
            gated_all=contract_weights(ops, params, self._param_counts) if native else None,
            op_kwargs=[
                {
                    "next_op_input_quantizer": (
                        _input_quantizer(ops[i + 1], requires_grad and op_trainable[i + 1], grad_on)
                        if i + 1 < len(ops) else None),
                    "prev_op_grad_output_quantizer": (
                        _grad_quantizer(ops[i - 1], requires_grad and op_trainable[i - 1], grad_on) if i > 0 else None),
                }
                for i in range(len(ops))
            ],
        )
        if plan.gated_all is not None and (plan.gated is None or len(plan.gated[0]) < len(plan.gated_all[0])):
            if _is_compiling():  # (no global state changed in a trace: dynamo would guard on it)
                plan.unwatched = True
            else:
                watch_plain_weights(self)  # plain-mode weights left ungated: delayed_wgrad() hooks them
        if self._channels is not None:
            self._channels.check_plan(plan)
        if self._routing is None:  # (else the extension running the steps installs them: its hook comes first)
            plan.compile_steps(ops)
        for hook, layout in self._plan_hooks:  # (MoE routing's steps, C++ replay's plan.replay)
            hook(self, plan, layout, len(extra_inputs), base["recipe"])
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
        compiling = _is_compiling()  # (read once per call: _run takes it)
        if compiling:  # (traced: the ops' own versions, not the global epoch, which any op
            versions = tuple([op.state_version for op in self.ops])  # anywhere moves)
            if versions != self._versions:
                self._refresh(versions)
        elif _STATE_EPOCH[0] != self._epoch:  # some op's state changed since the last call
            self._epoch = _STATE_EPOCH[0]
            versions = tuple([op.state_version for op in self.ops])
            if versions != self._versions:
                self._refresh(versions)
        if self._parametrized:  # one evaluation of each parametrization per call, with grad
            with parametrize.cached():
                return self._run(x, extra_inputs, [getattr(m, n) for m, n in self._slots], compiling)
        try:
            params = [d[n] for d, n in self._reads]  # (a dict read per parameter: see _refresh)
        except KeyError:  # a parameter was removed from its module's dict without an assignment
            params = [getattr(m, n) for m, n in self._slots]
        return self._run(x, extra_inputs, params, compiling)

    def _run(self, x: torch.Tensor, extra_inputs: tuple, params: list, compiling: bool):
        key = self._key(x, extra_inputs, params)
        off = frozenset()
        if self._choices or _TUNER[0] is not None:  # (tuned plans: fusible_ops.tuning)
            key, off = self._chosen(key, x, extra_inputs, params)
            self.last_off = off
        if not compiling:
            plan = self._plans.get(key) or self._new_plan(key, x, extra_inputs, params, off)
        else:  # traced: planned afresh, the cache neither read nor written (dynamo would guard on
            plan = self._make_plan(x, extra_inputs, params, off)  # its contents: a recompile per new plan)
        self.last_key = key
        if plan.requires_grad and (self._wgrad_flagged or self._ddp_bound or active_ddp() is not None):
            self._ddp_bound = check_flagged_ops(self.ops, params, plan.param_counts)
        native = (plan.cpu_autograd and CPU_AUTOGRAD and not is_float8(x)
                  and (current_mode() != "triton" if not x.is_cuda else
                       x.numel() <= NATIVE_MAX_NUMEL and current_mode() == "auto"))
        if ((not plan.requires_grad or native)
                and _forward_ad._current_level < 0 and not compiling and not _transforms_active()):
            # No gradient anywhere (no_grad / inference, or nothing requires grad): the steps run
            # as they would inside the autograd function, without the function (no node to build).
            # A plan of plain differentiable steps runs the same way with autograd recording, on
            # CPU and for small CUDA inputs (not for an FP8 input: its dequantization is not
            # differentiable).
            # (Not under forward-mode AD: the kernels would drop the tangents; the function raises.)
            if plan.unwatched:
                plan.unwatched = False
                watch_plain_weights(self)
            ctxs = [OperationContext(False, False, False, t) for t in plan.training]
            gated = plan.gated
            if plan.gated_all is not None and scheduler_active():  # (only cpu_autograd plans have one)
                gated = plan.gated_all  # (inside delayed_wgrad(): every contract weight through the gate)
            if gated is not None:
                gate_weights(gated, ctxs, params)
            if native and x.is_cuda:  # the reference math (torch's ops) for autograd to record
                previous = set_mode("reference")
                try:
                    y, extra_outputs = _run_forward(self, plan, ctxs, x, extra_inputs)
                finally:
                    set_mode(previous)
            else:
                y, extra_outputs = _run_forward(self, plan, ctxs, x, extra_inputs)
            if self.num_extra_outputs == 0:
                return y
            return (y, *[t for e in extra_outputs for t in e])
        replay = plan.replay
        if (replay is not None and type(x) is torch.Tensor and _forward_ad._current_level < 0
                and not compiling and not _transforms_active()):
            y = replay.run(x, extra_inputs, params)  # (None: this call takes the Python path)
            if y is not None:
                return y
        args = [*extra_inputs, *params] if extra_inputs else params
        if not compiling and not _transforms_active():
            # autograd.Function.apply's Python preamble, minus what eager calls do not need. A
            # tensor passed twice (x as residual, one split-size tensor for two ops, tied weights)
            # goes in twice: eager autograd sums the gradients of both positions.
            outs = _RAW_APPLY(_unwrap(x), self, plan, len(extra_inputs), *[
                _unwrap(a) if isinstance(a, torch.Tensor) else a for a in args])
        else:  # traced: every tensor argument as a view, so none is x or another argument
            args = _as_views(args)
            outs = _FuserFunction.apply(x, self, plan, len(extra_inputs), *args)
        if self.num_extra_outputs == 0:
            return outs[0]
        return tuple(outs)


class _BackwardContext:
    """An :class:`OperationContext` as backward sees it: a copy of the forward ctx's attributes,
    with the saved tensors handed back by autograd. Attributes set in backward stay on this view
    (nothing created in forward is mutated, so torch.compile can trace the backward too)."""

    def __init__(self, base: OperationContext, saved: tuple) -> None:
        # (eager backward builds views without this constructor, with the attributes copied)
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
        ctxs = [OperationContext(rg, irg, wrg, t) for rg, irg, wrg, t in plan.ctx_flags]
        extra = args[:num_extra] if num_extra else ()
        if plan.fp8_delayed is None:
            y, extra_outputs = _run_forward(fuser, plan, ctxs, x, extra)
        else:  # (the delayed-scaling updates of the call's casts in one launch)
            y, extra_outputs = _delayed_batched(fuser, plan, 0, x, _run_forward, fuser, plan, ctxs, x, extra)
        if type(y) is TracedFloat8:  # (traced: an FP8 output, e.g. of a Quantize last, leaves as its values)
            y = y.dequantize()
        has_extra_out = fuser.num_extra_outputs != 0
        if plan.requires_grad:
            # Route every op's saved tensors through autograd (saved-tensor hooks, offloading,
            # in-place modification checks all see them); ctxs get them back in backward.
            counts, flat = [], []
            for c in ctxs:
                saved = c._saved
                counts.append(len(saved))
                if saved:
                    flat.extend(saved)
                    c._saved = ()
            func_ctx.save_for_backward(*flat)
            func_ctx.state = (fuser, plan, ctxs, counts, x.requires_grad)
            fp8 = fp8_state()  # (backward reduces its amaxes over the same group)
            func_ctx.fp8_scope = fp8 if fp8[1] is not None else None
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
        # (a delayed-scaling plan: the updates of the call's casts in one launch)
        run = _fuser_backward if func_ctx.state[1].fp8_delayed is None else _delayed_backward
        if func_ctx.fp8_scope is None:
            return run(func_ctx, dy, grad_extra_outputs_flat)
        with fp8_scope(func_ctx.fp8_scope):
            return run(func_ctx, dy, grad_extra_outputs_flat)


def _delayed_backward(func_ctx, dy, grad_extra_outputs_flat):
    fuser, plan = func_ctx.state[:2]
    return _delayed_batched(fuser, plan, 2, dy, _fuser_backward, func_ctx, dy, grad_extra_outputs_flat)


def _fuser_backward(func_ctx, dy, grad_extra_outputs_flat):
    """The body of :meth:`_FuserFunction.backward` (inside the forward's FP8 amax-reduction scope, if any)."""
    fuser, plan, fwd_ctxs, counts, x_requires_grad = func_ctx.state
    ops = fuser.ops
    if fuser.num_extra_outputs:
        grad_extra_out: list[tuple] = []
        k = 0
        for m in fuser._num_extra_outputs:
            grad_extra_out.append(tuple(grad_extra_outputs_flat[k : k + m]))
            k += m
    else:
        grad_extra_out = fuser._no_extras
    routes = fuser._channels
    if routes is not None:  # producers get their consumers' extra-input gradients (below)
        grad_extra_out = [(None,) if i in routes.producers else g for i, g in enumerate(grad_extra_out)]
    # Views of the forward ctxs that carry the saved tensors: nothing created in forward is
    # mutated, so torch.compile can trace the backward too.
    saved, k, ctxs = func_ctx.saved_tensors, 0, []
    eager = not _is_compiling()
    for c, m in zip(fwd_ctxs, counts):
        mine = saved[k : k + m] if m else ()
        k += m
        if eager:  # the view's attributes: a copy of the forward ctx's (reads then skip __getattr__)
            v = _new_object(_BackwardContext)
            v.__dict__ = d = c.__dict__.copy()
            d["_base"], d["_saved"] = c, mine
            ctxs.append(v)
        else:  # (dynamo traces the constructor; reads go through __getattr__)
            ctxs.append(_BackwardContext(c, mine))
    param_grads: list[tuple] = list(plan.no_param_grads)
    grad_extra_in: list[tuple] = list(fuser._none_extra_grads)
    for op, idx, gq, direct, plain_in in plan.backward_program:
        if plain_in and is_float8(dy):
            dy = dy.dequantize()
        if direct:  # one basic op, its own op_backward (idx: its index)
            c = ctxs[idx]
            dy, pg = op.op_backward(c, dy)
            pg = tuple(pg)
            if len(pg) != len(param_grads[idx]):
                _check_param_grads(op, ops[idx], pg, param_grads[idx])
            param_grads[idx] = pg
            c._saved = ()  # (release(), written out: this runs per op per call)
            continue
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
            pg_i = tuple(pg[j])  # (a tuple is returned as is)
            if len(pg_i) != len(param_grads[i]):
                _check_param_grads(op, ops[i], pg_i, param_grads[i])
            param_grads[i] = pg_i
            if ge[j] is not None:
                if routes is not None and i in routes.source:  # (a channel: to its producer)
                    p, g = routes.source[i], ge[j][0]
                    have = grad_extra_out[p][0]
                    grad_extra_out[p] = (g if have is None else have if g is None else have + g,)
                else:
                    grad_extra_in[i] = tuple(ge[j])
            ctxs[i]._saved = ()
    if not plan.backward_complete:
        dy = None
    elif is_float8(dy):  # autograd gets plain gradients
        dy = dy.dequantize()
    dx = dy if x_requires_grad else None
    if plan.keep_all:
        return (dx, None, None, None, *[t for e in grad_extra_in for t in e], *[t for p in param_grads for t in p])
    flat_ge = [t if k else None for k, t in zip(plan.extra_keep, [t for e in grad_extra_in for t in e])]
    flat_pg = [t if k else None for k, t in zip(plan.param_keep, [t for p in param_grads for t in p])]
    return (dx, None, None, None, *flat_ge, *flat_pg)


def _run_forward(fuser: OperationFuser, plan: Plan, ctxs: list, x: torch.Tensor, extra: Sequence) -> tuple:
    """The plan's forward steps on ``x`` with the flat extra inputs ``extra``, filling ``ctxs``.
    Returns ``(y, extra_outputs)``: one tuple of extra outputs per basic op."""
    if fuser._channels is not None:
        return fuser._channels.run_forward(fuser, plan, ctxs, x, extra)
    extra_inputs = fuser._split_extra(extra) if extra else fuser._no_extras
    has_extra_out = fuser.num_extra_outputs != 0
    extra_outputs: list[tuple] = [()] * len(ctxs)
    y = x
    for op, idx, kwargs, direct, plain_in in plan.forward_program:
        if plain_in and is_float8(y):
            y = y.dequantize()  # an op that reads plain tensors
        if direct:  # one basic op, its own op_forward (idx: its index)
            y = op.op_forward(ctxs[idx], y, **kwargs)
            continue
        y, ex = op.fuser_forward([ctxs[i] for i in idx], y, extra_inputs=[extra_inputs[i] for i in idx],
                                 basic_op_kwargs=kwargs)
        if has_extra_out:
            for i, e in zip(idx, ex):
                extra_outputs[i] = tuple(e)
    return y, extra_outputs


# ``_FuserFunction.apply`` is a Python classmethod that, when no functorch transform is active,
# unwraps dead functorch wrappers and calls the C++ apply. Eager calls do exactly that here without
# its other per-call work; traced calls (torch.compile) and functorch transforms go through it.
_RAW_APPLY = torch._C._FunctionBase.__dict__["apply"].__get__(None, _FuserFunction)
_TUNER: list = [None]  # tuner(fuser, geometry, x, extra_inputs, params) -> off; set by fusible_ops.tuning
_unwrap = torch._C._functorch.unwrap_if_dead
_transforms_active = torch._C._are_functorch_transforms_active
_is_compiling = torch.compiler.is_compiling
_new_object = object.__new__
set_fuser_factory(OperationFuser)  # (what FusibleOperation.own_fuser builds: op.py imports nothing above it)
