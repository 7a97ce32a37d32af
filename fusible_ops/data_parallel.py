"""The gradient contract under torch's data-parallel wrappers: ``DistributedDataParallel`` (DDP)
and FSDP2 (``torch.distributed.fsdp.fully_shard``). :mod:`fusible_ops.grad` asks
:func:`wrapper_of` about each weight whose gradient goes to ``main_grad`` or is delayed; plain
immediate gradients go through autograd, where the wrappers see them anyway.

Under a wrapper the reduced gradient is the wrapper's, in ``weight.grad`` (DDP: the parameter;
FSDP2: the sharded DTensor parameter), after the synced backward (and its ``backward_dw()``):

* ``accumulate_into_main_grad=True``: the GEMMs add into a float32 accumulator that fusible_ops
  keeps (the trainer attaches no ``main_grad``; one attached is refused). FSDP2: the accumulator
  is FSDP2's own unsharded one (``unsharded_accumulated_grad``, in ``MixedPrecisionPolicy``'s
  ``reduce_dtype`` when set): kept across ``set_requires_gradient_sync(False)`` backwards and
  reduce-scattered, with the group's other gradients, by FSDP2 at the synced backward. DDP: kept
  across ``no_sync()`` backwards; at the synced backward it is handed to autograd as the weight's
  gradient (cast to the weight's dtype), so DDP's bucket reduces it, and released.
* Delayed weight gradients: FSDP2 defers the post-backward (accumulate, reshard, reduce-scatter)
  of each group with delayed work pending, except its reshard, and runs it when ``backward_dw()``
  has computed the group's last pending op, in one reduce-scatter with the group's other
  gradients as the undelayed backward would. The unsharded weight is freed as usual: a weight
  gradient reads only the saved input and output gradient. DDP: autograd gets no gradient for
  the weight at backward, so DDP's bucket carries zeros for it (DDP marks a parameter whose
  gradient is undefined ready with zeros, and cannot be made to wait past its backward); the
  computed gradients are kept across ``no_sync()`` backwards, and after the synced backward's
  ``backward_dw()`` fusible_ops all-reduces them itself (the mean over DDP's process group, as
  DDP's own reduction; the main_grad accumulator in float32) and adds them to ``.grad``.
* Frozen weights: no gradient work and no reduction (FSDP2 and DDP skip parameters without a
  gradient).
* ``optimizer.step()`` while an op under a wrapper still has delayed work pending raises a
  ``RuntimeError`` naming the op: its gradient is neither computed nor reduced.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch.nn.parallel import DistributedDataParallel as _DDP_CLASS

from . import fsdp2_internals

FSDP2 = "FSDP2 (torch.distributed.fsdp.fully_shard)"
DDP = "torch.nn.parallel.DistributedDataParallel"


class _ParamMap:
    """``id(tensor) -> value`` for live tensors (an entry goes with its tensor)."""

    def __init__(self) -> None:
        self._d: dict[int, tuple] = {}

    def get(self, t: torch.Tensor, default=None):
        hit = self._d.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else default

    def set(self, t: torch.Tensor, value) -> None:
        key, d = id(t), self._d

        def gone(ref, key=key, d=d):
            if d.get(key, (None,))[0] is ref:
                del d[key]

        d[key] = (weakref.ref(t, gone), value)

    def pop(self, t: torch.Tensor) -> None:
        if self.get(t, _MISS) is not _MISS:
            del self._d[id(t)]


_MISS = object()


# --------------------------------------------------------------------------------------------
# The two bindings: what a weight's delivery does under each wrapper
# --------------------------------------------------------------------------------------------
def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class _DDPBinding:
    """A weight of a DDP module. ``sync``: whether its last forward ran with DDP's gradient sync
    on (outside ``no_sync()``); ``group``: DDP's process group."""

    wrapper = DDP
    keeps_delayed = True  # delayed gradients wait in ``out`` / ``acc`` until reduced

    def __init__(self) -> None:
        self.sync, self.group = True, None
        self.acc: Optional[torch.Tensor] = None  # the main_grad accumulator
        self.out: Optional[torch.Tensor] = None  # delayed plain gradients not yet reduced

    def main_grad(self, op, param: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(the accumulator, whether it was just allocated: uninitialized, to be overwritten)."""
        if self.acc is None:
            self.acc = torch.empty(param.shape, dtype=_acc_dtype(param.dtype), device=param.device)
            return self.acc, True
        return self.acc, False

    def take(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """At a synced backward: the accumulator, in the weight's dtype, as the gradient autograd
        gets (DDP's bucket reduces it), released. Else None."""
        if not self.sync or self.acc is None:
            return None
        acc, self.acc = self.acc, None
        return acc.to(param.dtype)

    def finish(self, param: torch.Tensor) -> None:
        """After ``backward_dw()``, at a synced backward: DDP's bucket carried no gradient for the
        weight (autograd got None from the op), so reduce what was computed here (the mean over
        DDP's group, as DDP's own reduction; the accumulator in float32) and add it to
        ``weight.grad``."""
        if not self.sync:
            return
        with torch.no_grad():
            for buf in (self.acc, self.out):
                if buf is None:
                    continue
                buf.div_(torch.distributed.get_world_size(self.group))
                torch.distributed.all_reduce(buf, group=self.group)
                g = buf.to(param.dtype)
                if param.grad is None:
                    param.grad = g
                else:
                    param.grad.add_(g)
        self.acc = self.out = None


class _FSDPBinding:
    """An unsharded weight of an FSDP2 group."""

    wrapper = FSDP2
    keeps_delayed = False  # delayed plain gradients go to the unsharded weight's .grad

    def __init__(self, fsdp_param, group) -> None:
        # (weak: the FSDPParam holds the unsharded weight, this binding's key)
        self._fsdp_param, self._group = weakref.ref(fsdp_param), weakref.ref(group)

    @property
    def fsdp_param(self):
        return self._fsdp_param()

    @property
    def group(self):
        return self._group()

    def main_grad(self, op, param: torch.Tensor) -> tuple[torch.Tensor, bool]:
        fsdp2_internals.group_state(self.group)  # (its post-backward gives the group one gradient dtype)
        return fsdp2_internals.accumulator(self.fsdp_param, param)

    def take(self, param: torch.Tensor) -> None:
        return None  # FSDP2 reduce-scatters the accumulator (or .grad) itself


_ddp_bound = _ParamMap()  # weight -> _DDPBinding (set at forward inside DDP)
_fsdp_bound = _ParamMap()  # unsharded weight -> _FSDPBinding, or None: not FSDP2's


def wrapper_of(param: torch.Tensor):
    """The weight's binding to a data-parallel wrapper (see the module doc), or None."""
    b = _ddp_bound.get(param)
    if b is not None:
        return b
    b = _fsdp_bound.get(param, _MISS)
    if b is _MISS:
        _index_fsdp2()
        b = _fsdp_bound.get(param, _MISS)
        if b is _MISS:
            b = None
            _fsdp_bound.set(param, None)
    return b


_unsharded_of = _ParamMap()  # sharded FSDP2 parameter -> its unsharded one


def computed_with(param: torch.Tensor) -> torch.Tensor:
    """The tensor the ops compute with for module parameter ``param``: under FSDP2 (``param`` a
    sharded parameter, unsharded once), its unsharded parameter; else ``param``."""
    u = _unsharded_of.get(param, _MISS)
    if u is _MISS:
        if type(param).__name__ != "DTensor":
            return param
        _index_fsdp2()
        u = _unsharded_of.get(param)
    return param if u is None else u


def _index_fsdp2() -> None:
    for unsharded, fsdp_param, group in fsdp2_internals.managed_params():
        if unsharded is not None:
            if _fsdp_bound.get(unsharded, _MISS) is _MISS:
                _fsdp_bound.set(unsharded, _FSDPBinding(fsdp_param, group))
            _unsharded_of.set(fsdp2_internals.sharded_param(fsdp_param), unsharded)


# --------------------------------------------------------------------------------------------
# Forward: DDP bindings, and attached main_grad buffers refused under a wrapper
# --------------------------------------------------------------------------------------------
_ddp_members: dict[int, tuple] = {}  # id(DDP module) -> (weakref to it, ids of its parameters)


def active_ddp():
    """The DDP module whose forward is running, or None."""
    return _DDP_CLASS._active_ddp_module


def _ddp_param_ids(ddp) -> set:
    hit = _ddp_members.get(id(ddp))
    if hit is None or hit[0]() is not ddp:
        key = id(ddp)
        ref = weakref.ref(ddp, lambda r, key=key: _ddp_members.pop(key, None) if _ddp_members.get(key, (None,))[0] is r else None)
        hit = _ddp_members[key] = (ref, {id(p) for p in ddp.module.parameters()})
    return hit[1]


def on_forward(ops, weights) -> bool:
    """At a training forward of a chain with main_grad / delayed ops, inside a DDP forward, or of
    a chain bound to DDP before: ``weights`` are the trainable contract weights of ``ops`` (one
    each). Binds them to the DDP module running (its gradient-sync setting now), unbinds those it
    no longer runs, and refuses a ``main_grad`` attached by the trainer under a wrapper. Returns
    whether one is bound to DDP now."""
    ddp = active_ddp()
    ids = _ddp_param_ids(ddp) if ddp is not None else ()
    bound = False
    for op, w in zip(ops, weights):
        b = _ddp_bound.get(w)
        if id(w) in ids:
            if b is None:
                b = _DDPBinding()
                _ddp_bound.set(w, b)
            b.sync, b.group = bool(ddp.require_backward_grad_sync), ddp.process_group
            bound = True
        elif b is not None:
            if b.acc is not None or b.out is not None:
                raise RuntimeError(
                    f"{type(op).__name__}: its weight holds gradients accumulated under {DDP}'s no_sync() that "
                    f"were never reduced, and this forward runs outside the DDP module; run the synced "
                    f"micro-batch through the DDP module first"
                )
            _ddp_bound.pop(w)
            b = None
        if getattr(op, "accumulate_into_main_grad", False):
            if b is None:
                b = wrapper_of(w)
            attached = w if b is None or b.wrapper == DDP else fsdp2_internals.sharded_param(b.fsdp_param)
            if b is not None and getattr(attached, "main_grad", None) is not None:
                raise RuntimeError(
                    f"{type(op).__name__}: accumulate_into_main_grad=True under {b.wrapper}: fusible_ops keeps the "
                    f"float32 accumulator itself and the reduced gradient goes to weight.grad after the synced "
                    f"backward; do not attach weight.main_grad (remove it)"
                )
    return bound


# --------------------------------------------------------------------------------------------
# Delayed work: the forgotten backward_dw() check, FSDP2's deferred post-backward
# --------------------------------------------------------------------------------------------
_pending: dict[int, tuple] = {}  # id(op) -> (weakref to op, wrapper name): delayed work under a wrapper
_hook = []


def queued(op, binding) -> None:
    """Delayed work for one of ``op``'s weights, bound to a wrapper, was queued."""
    _pending[id(op)] = (weakref.ref(op), binding.wrapper)
    if isinstance(binding, _FSDPBinding):
        fsdp2_internals.group_state(binding.group).pending[id(op)] = op
    if not _hook:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _hook.append(register_optimizer_step_pre_hook(_check_step))


def computed(op, params) -> None:
    """``op.backward_dw()`` computed everything queued for ``params``: DDP: reduce them (a synced
    backward); FSDP2: run the post-backward of each group left with no pending op."""
    if _pending.pop(id(op), None) is None:
        return
    groups = []
    for p in params:
        b = _ddp_bound.get(p)
        if b is not None:
            b.finish(p)
        b = _fsdp_bound.get(p)
        if b is not None and not any(g is b.group for g in groups):
            groups.append(b.group)
    for group in groups:
        fsdp2_internals.group_state(group).pending.pop(id(op), None)
        fsdp2_internals.run_deferred(group)


def _check_step(optimizer, args, kwargs) -> None:
    if not _pending:
        return
    names = set()
    for key, (ref, wrapper) in list(_pending.items()):
        op = ref()
        if op is None or not op.__dict__.get("_pending_wgrads"):  # (gone, or its queue dropped)
            del _pending[key]
        else:
            names.add(f"{type(op).__name__} (under {wrapper})")
    if not names:
        return
    names = ", ".join(sorted(names))
    raise RuntimeError(
        f"{names}: delayed weight gradients are still pending at optimizer.step(): call backward_dw() on the op "
        f"(or seq.backward_dw(), fo.flush_wgrad()) after each backward; until then its weight gradient is "
        f"neither computed nor reduced over the data-parallel group"
    )
