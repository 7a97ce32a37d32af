"""Plan extensions: how layers built on the fuser join in its planning without the fuser
importing them.

:class:`~fusible_ops.fuser.OperationFuser` imports none of the modules that build on it. Each such
module registers a :class:`PlanExtension` here when it is imported (``import fusible_ops`` imports
them all): MoE routing (:mod:`fusible_ops.fuser_routing`), which runs a routed fuser's whole plan
as one step, and C++ replay (:mod:`fusible_ops.replay`), which attaches a plan's ``replay``.

The hooks run when a fuser is built (:func:`extensions_for`: each extension's layout of the ops,
once) and when it makes a plan (each hook, once per plan), never per call. A fuser keeps the
extensions registered when it was built. This module imports nothing of the package.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional


@dataclasses.dataclass(frozen=True)
class PlanExtension:
    """A layer built on the fuser, joining in its planning.

    * ``plan_made(fuser, plan, layout, n_extra, recipe)``: once per new plan of a fuser (its
      ``layout``; ``n_extra``: the call's number of extra inputs; ``recipe``: the quantization
      recipe the plan was made under). It may change the plan (its steps, ``plan.replay``).
    * ``layout(ops)``: once per fuser, what the extension keeps about its basic ops; None: nothing
      to do for them (``plan_made`` is then not called for that fuser's plans). Without
      ``layout``, ``plan_made`` runs for every fuser's plans (with ``layout=None``).
    * ``runs_steps``: the extension runs the plans' steps itself (at most one per fuser). For a
      fuser it has a layout for, the fuser compiles no steps (its ``plan_made`` comes first, sets
      the plan's steps and compiles them), no plan runs under PyTorch's autograd, and the layout's
      ``extra_input_counts(ops)`` says how many extra inputs the caller passes per op.
    """

    name: str
    plan_made: Callable[..., None]
    layout: Optional[Callable[[list], Any]] = None
    runs_steps: bool = False

    def __post_init__(self) -> None:
        if self.runs_steps and self.layout is None:
            raise ValueError(f"plan extension {self.name!r}: runs_steps needs a layout")


_EXTENSIONS: list[PlanExtension] = []


def register_plan_extension(ext: PlanExtension) -> None:
    """Add ``ext`` (replacing one of the same name) for the fusers built from now on."""
    if not isinstance(ext, PlanExtension):
        raise TypeError(f"register_plan_extension takes a PlanExtension, got {type(ext).__name__}")
    names = [e.name for e in _EXTENSIONS]
    if ext.name in names:
        _EXTENSIONS[names.index(ext.name)] = ext
    else:
        _EXTENSIONS.append(ext)


def plan_extensions() -> tuple[PlanExtension, ...]:
    """The registered extensions, in registration order."""
    return tuple(_EXTENSIONS)


def extensions_for(ops: list) -> tuple[Any, tuple]:
    """``(steps_layout, hooks)`` for a fuser of ``ops`` (called once, when it is built).

    ``steps_layout``: the layout of the ``runs_steps`` extension that has one for these ops, else
    None. ``hooks``: ``(plan_made, layout)`` per extension that joins in this fuser's plans, the one
    that runs the steps first."""
    steps_layout, steps_owner, hooks = None, None, []
    for ext in _EXTENSIONS:
        layout = None
        if ext.layout is not None:
            layout = ext.layout(ops)
            if layout is None:
                continue
        if ext.runs_steps:
            if steps_owner is not None:
                raise RuntimeError(f"plan extensions {steps_owner!r} and {ext.name!r} both run the steps of "
                                   f"the fuser of {[type(op).__name__ for op in ops]}")
            steps_layout, steps_owner = layout, ext.name
            hooks.insert(0, (ext.plan_made, layout))
        else:
            hooks.append((ext.plan_made, layout))
    return steps_layout, tuple(hooks)


__all__ = ["PlanExtension", "extensions_for", "plan_extensions", "register_plan_extension"]
