"""The routing record of a MoE layer and where it flows in a fuser: :class:`Routing` (one layer,
one call: expert ids, probabilities, counts, the sort permutation; in backward the channel of the
probabilities' gradient), :class:`RoutingLayout` (which ops of a fuser each layer's routing reaches,
checked when the fuser is built) and :func:`record_routing` (test helpers' log of the expert ids).
The ops that fill and read it are in :mod:`fusible_ops.ops.moe`."""

from __future__ import annotations

import contextlib
import math
from typing import Optional

from .grouped_linear import GroupedLinear
from .moe_ep import RoutingError


class Routing:
    """The routing of one MoE layer for one call (forward), or the channel of its gradient
    (backward: ``dprobs``). Filled by :class:`~fusible_ops.ops.moe.Router` (``token_shape``,
    ``expert_ids`` [T, k] int64, ``probs`` [T, k] float32, ``split_sizes`` [E] int64 on the device,
    ``probs_grad``) and :class:`~fusible_ops.ops.moe.Dispatch` (``perm``: token-copy positions
    ``t * k + j`` sorted by expert, stably; ``inv_perm`` its inverse; with an expert-parallel group
    also ``exchange``, the :class:`~fusible_ops.ops.moe_ep.ExpertExchange`, and
    ``local_split_sizes`` [E / ep], the routed ops' split sizes). Backward: ``fresh_dx``, Dispatch's
    input gradient, which Dispatch allocated and no one else holds, so the Router adds its own
    gradient into it in place."""

    __slots__ = ("num_experts", "top_k", "token_shape", "expert_ids", "probs", "split_sizes", "perm",
                 "inv_perm", "probs_grad", "dprobs", "selection_tol", "exchange", "local_split_sizes", "ep_error",
                 "fresh_dx")

    def __init__(self, num_experts: int, top_k: int) -> None:
        self.num_experts, self.top_k = num_experts, top_k
        self.token_shape = self.expert_ids = self.probs = self.split_sizes = None
        self.perm = self.inv_perm = self.dprobs = self.exchange = self.local_split_sizes = self.fresh_dx = None
        self.probs_grad = False
        self.selection_tol = None  # (rtol, atol) when expert_ids are given to a reference run
        self.ep_error = None  # an expert-parallel layout error, raised on every rank by the Dispatch

    @property
    def num_tokens(self) -> int:
        return math.prod(self.token_shape)


class RoutingLayout:
    """Where routing flows in a run of basic ops (one fuser); built once, when the fuser is.

    ``region[i]``: index of the MoE layer op ``i`` belongs to (every op from a Router to its
    Combine), else ``None``. ``feeds[i]``: names of :class:`Routing` fields the fuser passes as op ``i``'s extra
    inputs (``("split_sizes",)`` for a routed ``GroupedLinear``; ``("local_split_sizes",)`` when
    the Dispatch is expert parallel), else ``()``. ``ep_sizes[r]``: layer r's expert-parallel
    group size. Raises :class:`RoutingError` naming the ops when a Router, Dispatch or Combine
    lacks its partners in this run, the experts do not split evenly over the Dispatch's EP group,
    or a routed ``GroupedLinear`` has a number of groups other than ``num_experts / ep_size``. With
    an expert-parallel group (2+ ranks) the last two are kept in ``ep_errors[r]`` instead: a rank
    that raised alone would leave its peers waiting in the exchange, so the Dispatch raises them on
    every rank of the group (:func:`~fusible_ops.ops.moe_ep.check_layout`).
    """

    def __init__(self, ops) -> None:
        n = len(ops)
        self.region: list[Optional[int]] = [None] * n
        self.feeds: list[tuple] = [()] * n
        self.layers: list[tuple[int, int]] = []  # (num_experts, top_k) per region
        self.ep_sizes: list[int] = []  # expert-parallel group size per region
        self.ep_errors: list[Optional[str]] = []  # per region: a layout error the EP group raises together
        name = [f"{type(op).__name__} (basic op {i} of the fuser)" for i, op in enumerate(ops)]
        state, router = "out", None
        for i, op in enumerate(ops):
            role = getattr(op, "routing_role", None)
            if role == "router":
                if state != "out":
                    raise RoutingError(f"{name[i]} comes before the Combine of {name[router]}: MoE layers do not nest")
                state, router = "routed", i
                self.layers.append((op.num_experts, op.top_k))
                self.ep_errors.append(None)
            elif role == "dispatch" and state != "routed":
                raise RoutingError(f"{name[i]} has no Router before it in the same fuser" if state == "out" else
                                   f"{name[i]}: a second Dispatch after the one of {name[router]}")
            elif role == "dispatch":
                state, ep = "dispatched", getattr(op, "ep_size", 1)
                self.ep_sizes.append(ep)
                if ops[router].num_experts % ep:
                    self._ep_error(f"{name[i]}: the {ops[router].num_experts} experts of {name[router]} do not "
                                   f"split evenly over its expert-parallel group of {ep} ranks")
            elif role == "combine" and state != "dispatched":
                raise RoutingError(f"{name[i]} has no Dispatch (after a Router) before it in the same fuser")
            elif role == "combine":
                state = "out"
            elif role is not None:
                raise RoutingError(f"{name[i]}: unknown routing_role {role!r}")
            if state == "dispatched" and isinstance(op, GroupedLinear):
                experts, ep = ops[router].num_experts, self.ep_sizes[-1]
                if op.num_groups != experts // ep:
                    where = f" over an expert-parallel group of {ep} ranks ({experts // ep} local)" if ep > 1 else ""
                    self._ep_error(f"{name[i]} is routed by {name[router]} but has {op.num_groups} groups "
                                   f"for {experts} experts{where}")
                self.feeds[i] = ("split_sizes",) if ep == 1 else ("local_split_sizes",)
            if role is not None or state != "out":
                self.region[i] = len(self.layers) - 1
        if state != "out":
            what = "Dispatch and Combine" if state == "routed" else "Combine"
            raise RoutingError(f"{name[router]} has no {what} after it in the same fuser: Router, Dispatch and "
                               f"Combine must run in one fuser (a module with hooks or a non-fusible module "
                               f"between them splits it)")

    def _ep_error(self, message: str) -> None:
        """Raise now, or with an expert-parallel group keep the first error for the Dispatch."""
        if self.ep_sizes[-1] == 1:
            raise RoutingError(message)
        if self.ep_errors[-1] is None:
            self.ep_errors[-1] = message

    def extra_input_counts(self, ops) -> list[int]:
        """Each op's user-given extra inputs (routed ops get theirs from the routing)."""
        return [0 if f else op.num_extra_inputs for op, f in zip(ops, self.feeds)]

    def new_routings(self) -> list[Routing]:
        """One empty :class:`Routing` per MoE layer (per call, per pass)."""
        routings = [Routing(e, k) for e, k in self.layers]
        for r, error in zip(routings, self.ep_errors):
            r.ep_error = error
        return routings


def routing_layout(ops) -> Optional[RoutingLayout]:
    """The :class:`RoutingLayout` of ``ops``, or ``None`` when no op has a routing role."""
    if not any(getattr(op, "routing_role", None) for op in ops):
        return None
    return RoutingLayout(ops)


_RECORDS: list[list] = []  # open record_routing() blocks


@contextlib.contextmanager
def record_routing():
    """Inside the block every :class:`~fusible_ops.ops.moe.Router` forward appends its expert ids
    [T, k] to the yielded list, in call order (test helpers replay a run's routing in its float64
    reference, where upstream rounding could otherwise flip a near-tied top-k choice)."""
    log: list = []
    _RECORDS.append(log)
    try:
        yield log
    finally:
        _RECORDS.remove(log)
