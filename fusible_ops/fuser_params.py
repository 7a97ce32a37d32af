"""Per-call helpers of :class:`~fusible_ops.fuser.OperationFuser` (kept apart so the fuser stays
one screenful of planning and running): how each parameter is read, how repeated tensors reach
the autograd function, the quantizer hand-off told about weight gradients, and the check of a
step's parameter gradients."""

from __future__ import annotations

import torch


def as_views(args: list) -> list:
    """Traced calls (torch.compile, functorch): every plain tensor of ``args`` as a view of itself.
    A tensor passed twice (x as residual, one split-size tensor for two ops, tied weights) must
    reach the autograd function as distinct inputs; viewing all of them does that without asking
    which ones repeat (``id()`` or ``is`` on the inputs would make dynamo guard on their identity
    and recompile for every new input tensor, or break the graph on an intermediate one). Views
    cost nothing in a traced graph."""
    return [a.view_as(a) if isinstance(a, torch.Tensor) and type(a) in _VIEWABLE else a for a in args]


_VIEWABLE = (torch.Tensor, torch.nn.Parameter)


def reader(module: torch.nn.Module, name: str) -> tuple:
    """``(dict, name)`` such that ``dict[name]`` is ``getattr(module, name)`` while the module's
    state is what it is now: its ``_parameters`` (the entry ``functional_call`` swaps), its
    ``_buffers`` or its ``__dict__``; for anything else (a property) a one-entry dict holding the
    value would go stale, so such a slot keeps ``getattr`` through :class:`_GetAttr`."""
    d = module.__dict__
    if name not in d:
        for store in (d.get("_parameters"), d.get("_buffers")):
            if store is not None and name in store:
                return store, name
    elif not hasattr(type(module), name):
        return d, name
    return _GetAttr(module), name


class _GetAttr:
    """``_GetAttr(m)[name]`` is ``getattr(m, name)`` (a slot with no dict to read)."""

    __slots__ = ("module",)

    def __init__(self, module) -> None:
        self.module = module

    def __getitem__(self, name: str):
        return getattr(self.module, name)


def training_call(op, grad_on: bool) -> bool:
    """Whether a call planned with grad mode ``grad_on`` is a training call for ``op``: grad mode
    on, the op in training mode and so every module owning one of its parameters (``fo.Linear``
    lends its weight to a ``BasicLinear`` that ``model.eval()`` does not reach; its ``eval()``
    bumps the borrower's state version, so the plan key follows)."""
    if not (grad_on and op.training):
        return False
    return all(op.param_owner(n).training for n in op.param_names())


def input_quantizer(op, weight_grad: bool, grad_on: bool):
    """``op.input_quantizer()``, told whether the op computes a weight gradient in this plan and
    whether its calls are training calls (:func:`training_call`)."""
    return _told(op.input_quantizer(), weight_grad, training_call(op, grad_on))


def grad_quantizer(op, weight_grad: bool, grad_on: bool):
    """``op.grad_output_quantizer()``, told as :func:`input_quantizer` tells."""
    return _told(op.grad_output_quantizer(), weight_grad, training_call(op, grad_on))


def _told(q, weight_grad: bool, training: bool):
    if q is not None and hasattr(q, "colwise"):
        q.colwise = weight_grad
        q.training = training
    return q


def check_param_grads(step, op, got, expected: tuple) -> None:
    """A step's parameter gradients for ``op`` have one entry per parameter of the op (the
    caller compares the lengths first: this raises)."""
    if len(got) != len(expected):
        raise RuntimeError(
            f"{type(step).__name__}'s backward returned {len(got)} param grads for "
            f"{type(op).__name__}, which has {len(expected)} parameters"
        )


__all__ = ["check_param_grads", "grad_quantizer", "input_quantizer", "reader", "training_call"]
