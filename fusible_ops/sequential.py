"""Sequential: a drop-in for ``torch.nn.Sequential`` that fuses adjacent fusible ops."""

from __future__ import annotations

from typing import Iterator, Optional, Union

import torch

from .fuser import OperationFuser
from .op import BasicOperation, FusibleOperation
from .rules import RuleSet


def _basic_ops_of(module: torch.nn.Module) -> Optional[list[BasicOperation]]:
    """The basic ops a module contributes to a fuser, or None if it is not fusible."""
    if isinstance(module, FusibleOperation):
        return list(module.basic_ops)
    return None


class Sequential(torch.nn.Module):
    """Runs modules in order; consecutive fusible ops run as one fused
    :class:`~fusible_ops.fuser.OperationFuser`, other modules run as-is between fusers.

    Call: ``seq(x, *extra_inputs)``: extra inputs are passed positionally after ``x`` in op
    order (e.g. ``seq(x, split_sizes, residual)``). If any op has extra outputs the call
    returns ``(y, *extra_outputs)``, else ``y``.

    ``rules``: the :class:`~fusible_ops.RuleSet` to plan with (default: the global set).
    ``state_dict`` keys are the modules' parameter names under their index, as in
    ``torch.nn.Sequential``.
    """

    def __init__(self, *modules: torch.nn.Module, rules: Optional[RuleSet] = None) -> None:
        super().__init__()
        self.rules = rules
        for i, m in enumerate(modules):
            self._check_module(m)
            self.add_module(str(i), m)
        self._stages: Optional[list] = None

    # -- container protocol --------------------------------------------------------------
    @staticmethod
    def _check_module(m) -> None:
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"Sequential takes torch.nn.Module objects, got {type(m).__name__}")

    def _invalidate(self) -> None:
        self._stages = None

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
        self.add_module(str(len(self)), module)
        self._invalidate()
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
    def _get_stages(self) -> list:
        """Consecutive fusible modules grouped into fusers: list of (fuser | module, module indices)."""
        if self._stages is None:
            stages, run, run_idx = [], [], []
            for i, m in enumerate(self._modules.values()):
                basic = _basic_ops_of(m)
                if basic is None:
                    if run:
                        stages.append((OperationFuser(run, rules=self.rules), run_idx))
                        run, run_idx = [], []
                    stages.append((m, [i]))
                else:
                    run.extend(basic)
                    run_idx.append(i)
            if run:
                stages.append((OperationFuser(run, rules=self.rules), run_idx))
            self._stages = stages
        return self._stages

    def forward(self, x: torch.Tensor, *extra_inputs):
        stages = self._get_stages()
        needed = sum(s.num_extra_inputs for s, _ in stages if isinstance(s, OperationFuser))
        if len(extra_inputs) != needed:
            raise TypeError(f"Sequential expected {needed} extra input(s) after x, got {len(extra_inputs)}")
        extra_outputs, k = [], 0
        for stage, _ in stages:
            if isinstance(stage, OperationFuser):
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

    # -- introspection -----------------------------------------------------------------------
    def _plans(self, x: Optional[torch.Tensor], extra_inputs):
        """(stage, plan, global basic-op offset) for every fuser, planned for input ``x``."""
        stages = self._get_stages()
        out, offset, k = [], 0, 0
        for stage, _ in stages:
            if not isinstance(stage, OperationFuser):
                continue
            n = stage.num_extra_inputs
            if x is None:
                sample = self._sample_input(stage)
                ex = extra_inputs[k : k + n] if extra_inputs else tuple(None for _ in range(n))
            else:
                sample, ex = x, extra_inputs[k : k + n]
            k += n
            out.append((stage, stage.plan_for(sample, ex), offset))
            offset += len(stage.ops)
        return out

    @staticmethod
    def _sample_input(fuser: OperationFuser) -> torch.Tensor:
        """A tiny stand-in input with the dtype/device of the first op's parameters."""
        for op in fuser.ops:
            for p in op.parameters():
                return torch.empty(0, dtype=p.dtype, device=p.device, requires_grad=torch.is_grad_enabled())
        return torch.empty(0, requires_grad=torch.is_grad_enabled())

    def basic_ops(self) -> list[BasicOperation]:
        """All basic ops in order (the indices that plans refer to)."""
        return [op for s, _ in self._get_stages() if isinstance(s, OperationFuser) for op in s.ops]

    def fusion_plan(self, pass_: str = "forward", x: Optional[torch.Tensor] = None, *extra_inputs) -> list[dict]:
        """The plan as data: one dict per group, ``{"rule": name or None, "op": class name,
        "indices": basic-op indices (global over this Sequential's basic ops)}``.

        ``pass_`` is ``"forward"`` or ``"backward"`` (joint fusions appear in both). Without
        ``x`` the plan is made for a training call with an input of the parameters' dtype and
        device that requires grad; pass ``x`` (and extra inputs) to see the plan for that call.
        """
        if pass_ not in ("forward", "backward"):
            raise ValueError(f"pass_ must be 'forward' or 'backward', got {pass_!r}")
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

    def explain(self, x: Optional[torch.Tensor] = None, *extra_inputs) -> str:
        """Both plans as text, and each rule that matched structurally but was declined, with the
        checker's reason."""
        lines = []
        ops = self.basic_ops()
        lines.append("basic ops: " + ", ".join(f"[{i}] {type(op).__name__}" for i, op in enumerate(ops)))
        plans = self._plans(x, extra_inputs)
        for pass_ in ("forward", "backward"):
            lines.append(f"{pass_} plan:")
            for _, plan, offset in plans:
                groups = getattr(plan, pass_)
                if pass_ == "backward" and not plan.requires_grad:
                    lines.append("  (no backward: nothing requires grad)")
                    continue
                for g in groups:
                    idx = [i + offset for i in g.indices]
                    what = f"rule {g.rule!r} -> {type(g.op).__name__}" if g.rule else "unfused"
                    names = ", ".join(type(o).__name__ for o in g.op.basic_ops)
                    lines.append(f"  ops {idx}: {what} ({names})")
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
        return "\n".join(lines)

    def backward_dw(self) -> None:
        """Compute every delayed weight gradient pending in this Sequential's ops."""
        for op in self.basic_ops():
            if hasattr(op, "backward_dw"):
                op.backward_dw()
