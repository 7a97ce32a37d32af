"""Every use fusible_ops makes of FSDP2's private internals (``torch.distributed.fsdp.fully_shard``),
in one place, for :mod:`fusible_ops.data_parallel`. FSDP2 offers no public way to find the
unsharded parameter an op computes with, to give a gradient its float32 accumulator, or to
reduce-scatter a group's gradients later than its backward; these do it:

* ``FSDPState._fsdp_param_groups`` (torch 2.13; ``_fsdp_param_group`` before), found through
  ``torch.distributed._composable_state._module_state_mapping``;
* ``FSDPParamGroup.fsdp_params``, ``.post_backward`` (wrapped per group, see
  :func:`group_state`), ``.reduce_grads`` (what ``set_requires_gradient_sync`` sets),
  ``.finalize_backward``, ``._training_state``;
* ``FSDPParam._unsharded_param``, ``.sharded_param``, ``.reduce_dtype`` and
  ``.unsharded_accumulated_grad`` (FSDP2's own unsharded gradient accumulator: what it keeps
  between backwards under ``set_requires_gradient_sync(False)`` and reduce-scatters at the next
  synced backward).

A torch whose FSDP2 lacks one of them gets a ``RuntimeError`` naming it at the first use (checked
on torch 2.13 on CPU and 2.11 on CUDA).
"""

from __future__ import annotations

import weakref
from typing import Iterator, Optional

import torch

_GROUP_ATTRS = ("fsdp_params", "post_backward", "reduce_grads", "finalize_backward", "_training_state")
_PARAM_ATTRS = ("sharded_param", "reduce_dtype", "unsharded_accumulated_grad")
_checked: set = set()


def _require(obj, names: tuple, what: str) -> None:
    if type(obj) in _checked:
        return
    missing = [n for n in names if not hasattr(obj, n)]
    if missing:
        raise RuntimeError(
            f"fusible_ops: this torch ({torch.__version__})'s FSDP2 {what} lacks {missing}, which main_grad and "
            f"delayed weight gradients under fully_shard use (fusible_ops.fsdp2_internals); use plain .grad mode "
            f"(accumulate_into_main_grad=False, no delayed weight gradients) under FSDP2 with this torch"
        )
    _checked.add(type(obj))


def _groups(state) -> list:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def managed_params() -> Iterator[tuple]:
    """(unsharded parameter, FSDPParam, FSDPParamGroup) for every parameter of every live FSDP2
    module; the unsharded parameter is None until the module's first unshard (then it is one
    object for the module's life: FSDP2 frees and refills its storage)."""
    if not torch.distributed.is_available():
        return
    from torch.distributed._composable_state import _module_state_mapping

    for state_ref in list(_module_state_mapping.values()):
        state = state_ref() if isinstance(state_ref, weakref.ref) else state_ref
        if state is None or type(state).__name__ != "FSDPState":
            continue
        for group in _groups(state):
            _require(group, _GROUP_ATTRS, "FSDPParamGroup")
            for fsdp_param in group.fsdp_params:
                _require(fsdp_param, _PARAM_ATTRS, "FSDPParam")
                yield fsdp_param.__dict__.get("_unsharded_param"), fsdp_param, group


def sharded_param(fsdp_param) -> torch.Tensor:
    return fsdp_param.sharded_param


def accumulator(fsdp_param, param: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The weight's unsharded gradient accumulator: FSDP2's ``unsharded_accumulated_grad``, in the
    group's reduce dtype (MixedPrecisionPolicy), else in float32 (float64 for float64 weights);
    and whether it was just allocated (uninitialized: the caller overwrites it)."""
    acc = fsdp_param.unsharded_accumulated_grad
    if acc is not None:
        return acc, False
    dtype = fsdp_param.reduce_dtype or torch.promote_types(param.dtype, torch.float32)
    acc = torch.empty(param.shape, dtype=dtype, device=param.device)
    fsdp_param.unsharded_accumulated_grad = acc
    return acc, True


class _GroupState:
    """What :func:`group_state` keeps on a group: its ops with delayed weight gradients pending
    (``id -> op``), and the ``reduce_grads`` of the backward whose post-backward was deferred
    (None: none deferred)."""

    __slots__ = ("post_backward", "pending", "deferred")

    def __init__(self, post_backward) -> None:
        self.post_backward = post_backward
        self.pending: dict[int, object] = {}
        self.deferred: Optional[bool] = None


def group_state(group) -> _GroupState:
    """The group's :class:`_GroupState`; on first use its ``post_backward`` (which FSDP2's
    autograd hooks and its end-of-backward callback call) is wrapped: while an op of the group
    has delayed weight gradients pending it only accumulates and reshards (``reduce_grads`` off
    for the call) and records whether it would have reduced; :func:`run_deferred` reduces later."""
    st = group.__dict__.get("_fusible_ops_state")
    if st is None:
        st = _GroupState(group.post_backward)

        def post_backward(*args):
            return _post_backward(group, st, args)

        group.post_backward = post_backward
        group._fusible_ops_state = st
    return st


def _post_backward(group, st: _GroupState, args: tuple):
    if st.pending:
        reduce = group.reduce_grads
        st.deferred = reduce
        group.reduce_grads = False
        try:
            return st.post_backward(*args)
        finally:
            group.reduce_grads = reduce
    if group.reduce_grads:
        _one_grad_dtype(group)
    return st.post_backward(*args)


def _one_grad_dtype(group) -> None:
    """FSDP2 reduce-scatters a group's gradients in one buffer and asserts they share a dtype. An
    accumulator (main_grad's float32 one; or a reduce-dtype one FSDP2 made at a deferred
    post-backward) beside a bf16 ``.grad`` (a bias; a delayed weight gradient) would fail that:
    move such ``.grad`` into an accumulator of the accumulators' dtype (what FSDP2 itself does
    between unsynced backwards; the reduce-scatter casts to that dtype anyway)."""
    dtypes = {fp.unsharded_accumulated_grad.dtype for fp in group.fsdp_params
              if fp.unsharded_accumulated_grad is not None}
    if len(dtypes) != 1:
        return
    dtype = dtypes.pop()
    for fp in group.fsdp_params:
        p = fp.__dict__.get("_unsharded_param")
        if fp.unsharded_accumulated_grad is None and p is not None and p.grad is not None and p.grad.dtype != dtype:
            fp.unsharded_accumulated_grad = p.grad.to(dtype)
            p.grad = None


def run_deferred(group) -> None:
    """Run the post-backward :func:`group_state` deferred, now that the group's delayed weight
    gradients are computed: it reduce-scatters them (if that backward was synced) with the group's
    other gradients, in one reduce-scatter, as the undelayed backward would have; then waits for
    it (``finalize_backward``), so the sharded ``.grad`` is ready for the optimizer."""
    st = group_state(group)
    if st.pending or st.deferred is None:
        return
    reduce, st.deferred = st.deferred, None
    saved, training_state = group.reduce_grads, group._training_state
    group.reduce_grads = reduce
    try:
        group.post_backward()
    finally:
        group.reduce_grads, group._training_state = saved, training_state
    if reduce:
        group.finalize_backward()
