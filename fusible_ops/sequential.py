"""Sequential: a drop-in for ``torch.nn.Sequential`` that fuses adjacent fusible ops."""

from __future__ import annotations

from typing import Iterator, Optional, Union

import torch

from .quantization.recipes import current_recipe
from .quantization.report import fp8_lines
from . import fuser as _fuser
from .extra_inputs import NameTable
from .fuser import OperationFuser
from .op import BasicOperation, FusibleOperation, loss_not_last
from .rules import RuleSet, find_near_misses, group_near_misses
from .tuning import notes_lines


def _basic_ops_of(module: torch.nn.Module) -> Optional[list[BasicOperation]]:
    """The basic ops a module contributes to a fuser, or None if it is not fusible."""
    if isinstance(module, FusibleOperation):
        return list(module.basic_ops)
    return None


def _loss_at_end(m: torch.nn.Module) -> Optional[BasicOperation]:
    """The loss whose output is ``m``'s (a fusible op that ends with a loss, or a Sequential whose
    last module does), or None."""
    if isinstance(m, FusibleOperation):
        ops = m.basic_ops
        return ops[-1] if ops and ops[-1].is_loss else None
    if isinstance(m, Sequential) and len(m._modules):
        return _loss_at_end(next(reversed(m._modules.values())))
    return None


def _check_loss_last(mods: list) -> None:
    """A loss must be the last module: raise naming it if any module follows one."""
    for i, m in enumerate(mods[:-1]):
        loss = _loss_at_end(m)
        if loss is not None:
            where = "" if m is loss else f" (it ends module [{i}] {type(m).__name__})"
            raise loss_not_last(loss, f"module [{i + 1}] {type(mods[i + 1]).__name__}", where)


def _has_hooks(m: torch.nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


_HOOK_MODULE = torch.nn.modules.module  # (holds torch's global module-hook dicts)


def _global_hooks() -> bool:
    g = _HOOK_MODULE
    return bool(g._global_forward_hooks or g._global_forward_pre_hooks or g._global_backward_hooks
                or g._global_backward_pre_hooks)


def _span(idx) -> str:
    return f"op {idx[0]}" if len(idx) == 1 else f"ops {idx[0]}-{idx[-1]}"


def _modules_text(owners: list[int], idx) -> str:
    """The modules that basic ops ``idx`` belong to: 'module 3', 'modules 1-2'."""
    ms = sorted({owners[i] for i in idx})
    if len(ms) == 1:
        return f"module {ms[0]}"
    if ms == list(range(ms[0], ms[-1] + 1)):
        return f"modules {ms[0]}-{ms[-1]}"
    return "modules " + ", ".join(map(str, ms))


def _module_name(m: torch.nn.Module) -> str:
    cls = type(m)
    if getattr(torch.nn, cls.__name__, None) is cls:
        return f"torch.nn.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _op_extra_inputs(stages):
    """``(basic op, number of extra inputs its fuser gives it)`` for every op of the fusible stages,
    in order (routed grouped linears take none: their split sizes come from the routing)."""
    for stage, _ in stages:
        if isinstance(stage, (OperationFuser, _Alone)):
            fuser = stage if isinstance(stage, OperationFuser) else stage.fuser
            yield from zip(fuser.ops, fuser._num_extra_inputs)


def _input_positions(stages) -> tuple[int, ...]:
    """Positions, among all the extra inputs of ``stages`` in order, of those the Sequential fills
    with its own input (ops with ``from_input``: ``AddExtraInput(from_input=True)``)."""
    out, k = [], 0
    for op, n in _op_extra_inputs(stages):
        if getattr(op, "from_input", False):
            out.extend(range(k, k + n))
        k += n
    return tuple(out)


def _with_input(extra_inputs: tuple, positions: tuple, x) -> tuple:
    """``extra_inputs`` with ``x`` inserted at ``positions`` (ascending, in the full list)."""
    out, it = [], iter(extra_inputs)
    for i in range(len(extra_inputs) + len(positions)):
        out.append(x if i in positions else next(it))
    return tuple(out)


class _Alone:
    """A fusible module with module hooks: it runs through its own ``__call__`` (so its hooks
    see its inputs and outputs) and is a fusion boundary for its neighbours."""

    def __init__(self, module: FusibleOperation) -> None:
        self.module = module
        self.fuser = module.own_fuser()
        self.ops = self.fuser.ops
        self.num_extra_inputs = self.fuser.num_extra_inputs
        self.num_extra_outputs = self.fuser.num_extra_outputs

    def __call__(self, x, *extra_inputs):
        return self.module(x, *extra_inputs)


def _built(make, idx: list, seq: "Sequential"):
    """``make()`` (a stage over modules ``idx``); a MoE routing error names the modules and what
    ended the fuser (hooks, a non-fusible module) instead of only the fuser's op positions."""
    from .ops.moe import RoutingError

    try:
        return make()
    except RoutingError as e:
        mods = list(seq._modules.values())
        names = ", ".join(f"[{i}] {type(mods[i]).__name__}" for i in idx)
        ends = [j for j in (idx[0] - 1, idx[-1] + 1) if 0 <= j < len(mods)]
        why = []
        for j in ends:
            m = mods[j]
            if _basic_ops_of(m) is None:
                why.append(f"module [{j}] {type(m).__name__} is not a fusible op")
            elif _has_hooks(m) or _global_hooks():
                why.append(f"module [{j}] {type(m).__name__} has hooks (it runs on its own)")
        if _basic_ops_of(mods[idx[0]]) is not None and len(idx) == 1 and (_has_hooks(mods[idx[0]]) or _global_hooks()):
            why.append(f"module [{idx[0]}] {type(mods[idx[0]]).__name__} has hooks (it runs on its own)")
        detail = f" ({'; '.join(why)})" if why else ""
        raise RoutingError(f"{e}. In this Sequential the fuser holds modules {names}{detail}") from None


def _routing_lines(fuser: OperationFuser, offset: int) -> list[str]:
    """explain(): how MoE routing flows through a fuser's ops (none for other fusers)."""
    layout = fuser._routing
    if layout is None:
        return []
    lines = []
    for r, (experts, top_k) in enumerate(layout.layers):
        parts = []
        for i, op in enumerate(fuser.ops):
            if layout.region[i] == r and (layout.feeds[i] or getattr(op, "routing_role", None)):
                what = "routed " if layout.feeds[i] else ""
                parts.append(f"{what}{type(op).__name__} [{i + offset}]")
        ep = layout.ep_sizes[r]
        how = ("on the device (no host sync)" if ep == 1 else
               f"expert parallel over {ep} ranks ({experts // ep} local experts): all-to-all, one host sync "
               f"per forward")
        lines.append(f"MoE routing ({experts} experts, top_k={top_k}): " + " -> ".join(parts)
                     + f"; routed ops take the split sizes from the routing, {how}")
    return lines


def _near_miss_lines(plans, owners: list[int]) -> list[str]:
    """explain(): the near misses of each fuser's rules on its ops (:func:`fusible_ops.rules.near_misses`);
    a rule that matched structurally in any fuser has none, and each rule is reported once."""
    matched, found = set(), []
    for fuser, _, offset in plans:
        found.append((find_near_misses(fuser._rule_set(), fuser.ops, matched), offset))
    seen, out = set(matched), []
    for misses, offset in found:
        keep = [m for m in misses if m.rule not in seen]
        seen.update(m.rule for m in keep)
        for rules, what, idx in group_near_misses(keep, offset):
            out.append(f"  {', '.join(rules)}: {what} (at {_span(idx)}, {_modules_text(owners, idx)})")
    return ["near misses:", *out] if out else ["near misses: none"]


class Sequential(torch.nn.Module):
    """Runs modules in order; consecutive fusible ops run as one fused
    :class:`~fusible_ops.fuser.OperationFuser`, other modules run as-is between fusers.

    Call: ``seq(x, *extra_inputs, **named_extra_inputs)``: extra inputs are passed positionally
    after ``x`` in op order (e.g. ``seq(x, split_sizes, residual)``), or by the names of the ops
    that take them (``seq(x, split_sizes=s, residual=r)``; each op's ``extra_input_names``).
    :attr:`extra_input_names` lists the names this Sequential accepts, in order: a name that two
    ops share gets their occurrence index as a suffix (``residual_0``, ``residual_1``) and the
    plain name is refused as ambiguous. Positional extra inputs fill the first positions, names
    the rest. If any op has extra outputs the call returns ``(y, *extra_outputs)``, else ``y``.

    ``rules``: the :class:`~fusible_ops.RuleSet` to plan with (default: the global set).
    ``state_dict`` keys are the modules' parameter names under their index, as in
    ``torch.nn.Sequential``.
    """

    def __init__(self, *modules: torch.nn.Module, rules: Optional[RuleSet] = None) -> None:
        super().__init__()
        self._stages: Optional[list] = None
        self._hook_sig: object = None
        self._xnames: Optional[NameTable] = None  # the extra inputs' names (see _name_table)
        self.rules = rules
        for i, m in enumerate(modules):
            self._check_module(m)
            self.add_module(str(i), m)
        _check_loss_last(list(modules))  # (here, not at the first call: a chain that can never run)
        # Built now, so that a first call traced by torch.compile finds them made: dynamo guards on
        # what the trace reads, and a trace that built them would recompile on the next call. (An
        # invalid chain raises at the first call, as one built by append() does.)
        try:
            self._get_stages()
            self._name_table()
        except Exception:
            self._invalidate()

    @property
    def rules(self) -> Optional[RuleSet]:
        """The rule set this Sequential plans with (``None``: the global set). Assigning it
        re-plans from the next call."""
        return self.__dict__["_rules"]

    @rules.setter
    def rules(self, value: Optional[RuleSet]) -> None:
        if value is not None and not isinstance(value, RuleSet):
            raise TypeError(f"Sequential.rules must be a fusible_ops.RuleSet or None, got {type(value).__name__}")
        self.__dict__["_rules"] = value
        self._invalidate()

    # -- container protocol --------------------------------------------------------------
    @staticmethod
    def _check_module(m) -> None:
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"Sequential takes torch.nn.Module objects, got {type(m).__name__}")

    def _invalidate(self) -> None:
        self._stages = None
        self._xnames = None

    # torch.nn.Module's own ways of setting, swapping or removing a module replan too
    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if isinstance(value, torch.nn.Module) or name in self._modules:
            self._invalidate()

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        self._invalidate()

    def add_module(self, name: str, module: Optional[torch.nn.Module]) -> None:
        super().add_module(name, module)  # (``register_module`` goes through here too)
        self._invalidate()

    def _reindex(self, modules: list) -> None:
        for k in list(self._modules):
            del self._modules[k]
        for i, m in enumerate(modules):
            self._modules[str(i)] = m
        self._invalidate()

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[torch.nn.Module]:
        return iter(self._modules.values())

    def __getitem__(self, idx: Union[int, slice]):
        mods = list(self._modules.values())
        if isinstance(idx, slice):
            return Sequential(*mods[idx], rules=self.rules)
        return mods[idx]

    def __setitem__(self, idx: int, module: torch.nn.Module) -> None:
        self._check_module(module)
        mods = list(self._modules.values())
        mods[idx] = module
        self._reindex(mods)

    def __delitem__(self, idx: Union[int, slice]) -> None:
        mods = list(self._modules.values())
        del mods[idx]
        self._reindex(mods)

    def append(self, module: torch.nn.Module) -> "Sequential":
        self._check_module(module)
        self.add_module(str(len(self)), module)  # (replans)
        return self

    def extend(self, modules) -> "Sequential":
        for m in modules:
            self.append(m)
        return self

    def insert(self, index: int, module: torch.nn.Module) -> "Sequential":
        self._check_module(module)
        mods = list(self._modules.values())
        mods.insert(index, module)
        self._reindex(mods)
        return self

    # -- stages ----------------------------------------------------------------------------
    def _hook_signature(self):
        """Which modules have hooks now: ``True`` under global module hooks (all of them), ``False``
        when none has any (the common case: one pass over the modules, nothing built), else one
        flag per module. Checked on every call."""
        if _global_hooks():
            return True
        mods = self._modules.values()
        for m in mods:
            if _has_hooks(m):
                return tuple([_has_hooks(m) for m in mods])
        return False

    def _get_stages(self) -> list:
        """Consecutive fusible modules grouped into fusers: list of (stage, module indices), a
        stage being a fuser, a fusible module with hooks (:class:`_Alone`) or a plain module.
        Rebuilt when a module gains or loses hooks."""
        sig = self._hook_signature()
        if self._stages is None or sig != self._hook_sig:
            _check_loss_last(list(self._modules.values()))  # (after append(), insert()...)
            hooked = [sig] * len(self._modules) if type(sig) is bool else sig
            stages, run, run_idx = [], [], []

            def close_run():
                if run:
                    stages.append((_built(lambda: OperationFuser(list(run), rules=self.rules), run_idx, self),
                                   list(run_idx)))
                    run.clear()
                    run_idx.clear()

            for i, (m, has_hooks) in enumerate(zip(self._modules.values(), hooked)):
                basic = _basic_ops_of(m)
                if basic is None or has_hooks:
                    close_run()
                    stages.append((_built(lambda: _Alone(m), [i], self) if basic is not None else m, [i]))
                else:
                    run.extend(basic)
                    run_idx.append(i)
            close_run()
            self._stages, self._hook_sig, self._xnames = stages, sig, None
            self._auto = _input_positions(stages)  # extra inputs the Sequential fills with x itself
            self._needed = sum(s.num_extra_inputs for s, _ in stages
                               if isinstance(s, (OperationFuser, _Alone))) - len(self._auto)
            # one fuser and nothing else: calls go straight to it (the common case, host time)
            self._only = stages[0][0] if len(stages) == 1 and isinstance(stages[0][0], OperationFuser) else None
        return self._stages

    def forward(self, x: torch.Tensor, *extra_inputs, **named):
        stages = self._get_stages()
        if named:  # (extra inputs by name: placed by the cached name table; positional calls skip this)
            extra_inputs = self._name_table().place(extra_inputs, named)
        if len(extra_inputs) != self._needed:
            raise TypeError(self._name_table().count_error(len(extra_inputs)))
        if self._auto:  # AddExtraInput(from_input=True): x itself at those positions
            extra_inputs = _with_input(extra_inputs, self._auto, x)
        if self._only is not None:
            return self._only(x, *extra_inputs)
        extra_outputs, k = [], 0
        for stage, _ in stages:
            if isinstance(stage, (OperationFuser, _Alone)):
                n = stage.num_extra_inputs
                out = stage(x, *extra_inputs[k : k + n])
                k += n
                if stage.num_extra_outputs:
                    x, *ex = out
                    extra_outputs.extend(ex)
                else:
                    x = out
            else:
                x = stage(x)
        if extra_outputs:
            return (x, *extra_outputs)
        return x

    # -- extra inputs by name ----------------------------------------------------------------
    def _op_modules(self) -> list[int]:
        """The module index of every basic op, in :meth:`basic_ops` order."""
        mods = list(self._modules.values())
        return [i for s, idx in self._get_stages() if isinstance(s, (OperationFuser, _Alone))
                for i in idx for _ in _basic_ops_of(mods[i])]

    def _name_table(self) -> NameTable:
        """The names of the extra inputs (:class:`~fusible_ops.extra_inputs.NameTable`). Depends only
        on the modules: built on first use, kept until they change (``_invalidate``, or the stages
        are rebuilt)."""
        table = self._xnames
        if table is None:
            entries = [(op, 0 if getattr(op, "from_input", False) else n, module)  # (from_input: not the caller's)
                       for (op, n), module in zip(_op_extra_inputs(self._get_stages()), self._op_modules())]
            table = self._xnames = NameTable(entries)
        return table

    @property
    def extra_input_names(self) -> tuple[str, ...]:
        """The names of the extra inputs this Sequential takes, in positional order (``seq(x,
        **{name: tensor})``): each op's ``extra_input_names`` (``AddExtraInput``: ``residual``,
        ``GroupedLinear``: ``split_sizes``, ``ScaledSwiGLU``: ``scales``); a name that several ops
        share is suffixed with its occurrence index, ``residual_0``, ``residual_1``, ... (the plain
        name is then refused as ambiguous). Routed grouped linears (MoE) take none."""
        return self._name_table().names

    # -- introspection -----------------------------------------------------------------------
    def _plans(self, x: Optional[torch.Tensor], extra_inputs):
        """(fuser, plan, global basic-op offset) for every fuser, planned for input ``x``.

        Without ``x``: each fuser's plan for the inputs of its last call in the current grad mode
        (so the report is what runs, with the ops' current state), or before any call, a training call with an input
        of the parameters' dtype and device."""
        stages = self._get_stages()
        if x is not None and self._auto and len(extra_inputs) == self._needed:
            extra_inputs = _with_input(extra_inputs, self._auto, x)
        out, offset, k = [], 0, 0
        for stage, _ in stages:
            if not isinstance(stage, (OperationFuser, _Alone)):
                continue
            fuser = stage if isinstance(stage, OperationFuser) else stage.fuser
            n = stage.num_extra_inputs
            grad_on = torch.is_grad_enabled()
            if x is None:
                last = fuser.last_call_inputs()
                if last is not None:  # the caller's grad mode, the last call's inputs
                    _, sample, ex = last
                else:
                    sample = self._sample_input(fuser)
                    ex = extra_inputs[k : k + n] if extra_inputs else tuple(None for _ in range(n))
            else:
                sample, ex = x, extra_inputs[k : k + n]
            k += n
            with torch.set_grad_enabled(grad_on):  # (without x: the last call's tuned choice too)
                out.append((fuser, fuser.plan_for(sample, ex, off=fuser.last_off if x is None else None), offset))
            offset += len(fuser.ops)
        return out

    @staticmethod
    def _sample_input(fuser: OperationFuser) -> torch.Tensor:
        """A tiny stand-in input with the dtype/device of the first op's parameters."""
        for op in fuser.ops:
            for n in op.param_names():
                p = getattr(op, n)
                return torch.empty(0, dtype=p.dtype, device=p.device, requires_grad=torch.is_grad_enabled())
        return torch.empty(0, requires_grad=torch.is_grad_enabled())

    def basic_ops(self) -> list[BasicOperation]:
        """All basic ops in order (the indices that plans refer to)."""
        return [op for s, _ in self._get_stages() if isinstance(s, (OperationFuser, _Alone)) for op in s.ops]

    def fusion_plan(self, pass_: str = "forward", x: Optional[torch.Tensor] = None, *extra_inputs,
                    **named) -> list[dict]:
        """The plan as data: one dict per group, ``{"rule": name or None, "op": class name,
        "indices": basic-op indices (global over this Sequential's basic ops)}``
        (:meth:`explain` also names the modules they belong to).

        ``pass_`` is ``"forward"`` or ``"backward"`` (joint fusions appear in both). Without
        ``x`` it is the plan the last call's inputs (dtype, device, requires_grad) get in the
        current grad mode with the ops' current state (what the next such call runs), or before
        any call, the plan of a training call with an input of
        the parameters' dtype and device that requires grad; pass ``x`` (and extra inputs) to
        see the plan for that call (extra inputs positionally or by name, as in a call). A
        fusible module with hooks runs on its own (a fusion boundary), so its hooks see its inputs
        and outputs.
        """
        if pass_ not in ("forward", "backward"):
            raise ValueError(f"pass_ must be 'forward' or 'backward', got {pass_!r}")
        if named:
            extra_inputs = self._name_table().place(extra_inputs, named)
        rows = []
        for _, plan, offset in self._plans(x, extra_inputs):
            for g in getattr(plan, pass_):
                rows.append(
                    {
                        "rule": g.rule,
                        "op": type(g.op).__name__,
                        "indices": tuple(i + offset for i in g.indices),
                    }
                )
        return rows

    def explain(self, x: Optional[torch.Tensor] = None, *extra_inputs, **named) -> str:
        """Both plans as text, each rule that matched structurally but was declined (with the
        checker's reason), the rules' near misses and, inside :func:`fusible_ops.autocast`, where
        FP8 casts run (fused into a producer or standalone) and which ops fall back to high precision.

        Plan lines give the basic-op indices and the modules they belong to (``ops [1, 2]
        (modules 1-2): ...``); a module that is not a fusible op shows as a boundary line between
        the fusers around it (``-- module 3: torch.nn.Dropout (not fusible: a boundary) --``).
        ``near misses``: per rule that matched nowhere, what one op it lacks, e.g.
        ``linear_bias_activation: needs a Bias between BasicLinear and SwiGLU (at ops 1-2, modules
        1-2)`` (definition: :func:`fusible_ops.rules.near_misses`). ``x`` and extra inputs (by
        position or name) as for :meth:`fusion_plan`."""
        if named:
            extra_inputs = self._name_table().place(extra_inputs, named)
        lines = []
        ops, owners = self.basic_ops(), self._op_modules()
        lines.append("basic ops: " + ", ".join(f"[{i}] {type(op).__name__}" for i, op in enumerate(ops)))
        plans = self._plans(x, extra_inputs)
        stages = self._get_stages()
        for (stage, idx) in stages:
            if isinstance(stage, _Alone):
                lines.append(f"module [{idx[0]}] {type(stage.module).__name__} has hooks: runs on its own "
                             f"(a fusion boundary), so its hooks see its inputs and outputs")
        for fuser, _, offset in plans:
            lines.extend(_routing_lines(fuser, offset))
            chan = fuser._channels
            for c, p in sorted((chan.source.items() if chan is not None else ()), key=lambda cp: cp[1]):
                src, dst = ops[offset + p], ops[offset + c]
                lines.append(f"channel {dst.channel_in!r}: op [{offset + p}] {type(src).__name__} -> op [{offset + c}] "
                             f"{type(dst).__name__} (forward: its value; backward: the gradient back)")
        for pass_ in ("forward", "backward"):
            lines.append(f"{pass_} plan:")
            fusers = iter(plans)
            for stage, idx in stages:
                if not isinstance(stage, (OperationFuser, _Alone)):
                    lines.append(f"  -- module {idx[0]}: {_module_name(stage)} (not fusible: a boundary) --")
                    continue
                _, plan, offset = next(fusers)
                groups = getattr(plan, pass_)
                if pass_ == "backward" and not plan.requires_grad:
                    lines.append("  (no backward: nothing requires grad)")
                    continue
                if pass_ == "backward" and plan.cpu_autograd and _fuser.CPU_AUTOGRAD:
                    where = ("CPU" if plan.device_type != "cuda" else
                             f"CUDA inputs of at most {_fuser.NATIVE_MAX_NUMEL} elements")
                    lines.append(f"  ({where}: PyTorch's autograd differentiates the forward steps; the groups below "
                                 "run under fusible_ops.fuser.cpu_autograd(False))")
                for g in groups:
                    idx = [i + offset for i in g.indices]
                    what = f"rule {g.rule!r} -> {type(g.op).__name__}" if g.rule else "unfused"
                    note = getattr(g.op, "explain_note", None)  # (a fused op's input-dependent detail)
                    if note is not None and x is not None and offset == 0:
                        what += f"; {note(x)}"
                    names = ", ".join(type(o).__name__ for o in g.op.basic_ops)
                    lines.append(f"  ops {idx} ({_modules_text(owners, idx)}): {what} ({names})")
        declines = [
            (p, d, offset) for _, plan, offset in plans for p, ds in plan.declines.items() for d in ds
        ]
        if declines:
            lines.append("declined:")
            for p, d, offset in declines:
                idx = [i + offset for i in d.indices]
                lines.append(f"  rule {d.rule!r} ({p}) on ops {idx}: {d.reason}")
        else:
            lines.append("declined: none")
        lines.extend(_near_miss_lines(plans, owners))
        for fuser, _, _ in plans:  # (fusible_ops.tuning: the candidates measured and the choice)
            lines.extend(notes_lines(fuser))
        producers = {offset + g.indices[-1] for _, plan, offset in plans for g in plan.forward
                     if getattr(g.op, "writes_fp8_output", False)}
        grad_producers = {offset + g.indices[0] for _, plan, offset in plans for g in plan.backward
                          if getattr(g.op, "writes_fp8_grad", False)}
        lines.extend(fp8_lines(ops, current_recipe(), producers, grad_producers))
        return "\n".join(lines)

    def backward_dw(self) -> None:
        """Compute every delayed weight gradient pending in this Sequential's ops, nested
        Sequentials' too, in module order."""
        for stage, _ in self._get_stages():
            for op in stage.ops if isinstance(stage, (OperationFuser, _Alone)) else (stage,):
                if hasattr(op, "backward_dw"):
                    op.backward_dw()
