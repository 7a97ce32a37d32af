"""Expert parallelism for the MoE layer: the all-to-all exchange of token copies between the ranks
of an expert-parallel (EP) group, used by :class:`~fusible_ops.ops.moe.Dispatch` (built with
``ep_group=``) and its :class:`~fusible_ops.ops.moe.Combine`.

With an EP group of ``ep`` ranks and ``E`` experts, rank ``r`` owns the experts
``[r * E / ep, (r + 1) * E / ep)`` (contiguous; its routed ``GroupedLinear``\\ s hold only those
``E / ep`` experts' weights). Each rank routes its own tokens; :class:`ExpertExchange` then moves
every token copy to the rank owning its expert and back:

* ``plan``: one ``all_to_all_single`` of a fixed-size int64 tensor: per destination rank, this
  rank's copies per expert of that rank (and its hidden size and dtype, checked on every rank).
  Then ONE host sync (``.tolist()``): ``all_to_all_single`` with uneven splits takes the split
  sizes as Python ints. Backward reuses the splits (no further sync).
* ``to_experts`` (Dispatch forward, Combine backward): the copies, sorted by (global) expert,
  go to their experts' ranks; they arrive source-major and are reordered on the device (a stable
  sort of block keys) to local-expert-major: expert 0 of this rank from every source rank in rank
  order, then expert 1, ... (``local_counts`` [E / ep] rows each: the routed ops' split sizes).
* ``from_experts`` (Combine forward, Dispatch backward): its adjoint (and inverse): the reorder
  undone, the reverse all-to-all.

What must hold: every rank of the group runs the same layers in the same order, with the same
``requires_grad`` of their inputs (each exchange is a collective); the number of tokens may differ
per rank (zero too). Not graph-capturable (the host sync): a capturing CUDA stream is an error.
With NCCL, ``torch.ops.symm_mem.all_to_all_vdev`` (device-side counts) could lift that later.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .comm import GroupRef
from .validation import FLOAT_DTYPES

_DTYPE_CODE = {d: i for i, d in enumerate(FLOAT_DTYPES)}


class RoutingError(ValueError):
    """Routing ops placed so that the routing cannot reach every op that needs it (or, expert
    parallel, so that the ranks of the group cannot exchange the copies)."""


def check_layout(owner: str, ref: GroupRef, experts: int, error: Optional[str], device: torch.device) -> None:
    """Every rank of the expert-parallel group compares its MoE layer with the others' (collective,
    one small all-gather and a host sync; the Dispatch runs it on its first call, and on every call
    while a rank has an error): the number of experts, and the layout error this rank found, if
    any (:class:`~fusible_ops.ops.moe.RoutingLayout`'s ``ep_errors``). Raises the same
    :class:`RoutingError` on every rank when any rank has an error or the ranks disagree, so no
    rank is left waiting in an exchange its peers never join."""
    mine = torch.tensor([experts, 0 if error is None else 1], dtype=torch.int64, device=device)
    every = torch.empty(ref.size * 2, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(every, mine, group=ref.group)
    rows = every.view(ref.size, 2).tolist()  # the host sync (first call only, when all is well)
    if not any(flag for _, flag in rows) and len({e for e, _ in rows}) == 1:
        return
    messages = [None] * ref.size
    dist.all_gather_object(messages, error, group=ref.group)
    said = "; ".join(f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None)
    counts = ", ".join(f"rank {r}: {e}" for r, (e, _) in enumerate(rows))
    raise RoutingError(f"{owner}: the expert-parallel group ({ref.size} ranks) cannot run this MoE layer: "
                       + (said if said else f"the ranks' Routers have different numbers of experts ({counts})"))


def check_not_capturing(owner: str, ref: GroupRef) -> None:
    """Expert-parallel exchanges sync with the host: refuse a CUDA graph capture clearly."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{owner}: expert parallel (ep_group of {ref.size} ranks) is not graph-capturable: its all-to-all needs "
            f"the split sizes on the host (one sync per MoE layer per forward). Run the MoE layer eagerly (capture "
            f"the layers around it), or use ep_group=None")


def _all_to_all(x: torch.Tensor, ref: GroupRef, out_splits: list, in_splits: list) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=ref.group)
    return out


class ExpertExchange:
    """The all-to-all plan of one MoE layer call on one rank (see the module doc). Built by
    :meth:`plan`; ``send_splits[d]`` / ``recv_splits[s]``: rows sent to / received from rank d / s
    (Python ints), ``local_counts``: rows per local expert [E / ep] int64 on the device,
    ``order``: received (source-major) row of each local-expert-major row, ``inv_order`` its
    inverse."""

    __slots__ = ("owner", "ref", "send_splits", "recv_splits", "local_counts", "order", "inv_order")

    @classmethod
    def plan(cls, owner: str, ref: GroupRef, counts: torch.Tensor, hidden: int, dtype: torch.dtype) -> "ExpertExchange":
        """Exchange the per-expert counts (``counts`` [E] int64: this rank's copies per global
        expert) and build the plan. Collective over ``ref``'s group; one host sync. Raises the same
        ``ValueError`` on every rank when ranks disagree on the hidden size or dtype."""
        check_not_capturing(owner, ref)
        ep, experts = ref.size, counts.numel()
        local = experts // ep
        mine = counts.view(ep, local)
        send = torch.empty(ep, local + 2, dtype=torch.int64, device=counts.device)
        send[:, :local] = mine
        send[:, local] = hidden
        send[:, local + 1] = _DTYPE_CODE.get(dtype, -1)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=ref.group)  # row s of recv: rank s's counts of my experts
        host = torch.cat([mine.sum(1), recv.reshape(-1)]).tolist()  # the host sync
        rows = [host[ep + s * (local + 2):ep + (s + 1) * (local + 2)] for s in range(ep)]
        if any(r[local:] != [hidden, _DTYPE_CODE.get(dtype, -1)] for r in rows):
            names = {i: d for d, i in _DTYPE_CODE.items()}
            seen = "; ".join(f"rank {s}: hidden {r[local]} {names.get(r[local + 1], 'non-float')}"
                             for s, r in enumerate(rows))
            raise ValueError(f"{owner}: the ranks of the expert-parallel group (size {ep}) passed different token "
                             f"rows ({seen}); every rank must pass the same hidden size and dtype")
        self = cls()
        self.owner, self.ref = owner, ref
        self.send_splits, self.recv_splits = host[:ep], [sum(r[:local]) for r in rows]
        blocks = recv[:, :local]  # [source, local expert] rows received
        self.local_counts = blocks.sum(0)
        total = sum(self.recv_splits)
        dev = counts.device
        key = torch.arange(local, device=dev) * ep + torch.arange(ep, device=dev).unsqueeze(1)  # (l, s) order
        row_key = torch.repeat_interleave(key.reshape(-1), blocks.reshape(-1), output_size=total)
        self.order = torch.argsort(row_key, stable=True)
        self.inv_order = torch.empty_like(self.order).scatter_(0, self.order, torch.arange(total, device=dev))
        return self

    def to_experts(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's copies [sum(send_splits), H], sorted by global expert -> the copies of its
        local experts [sum(recv_splits), H], local-expert-major."""
        check_not_capturing(self.owner, self.ref)
        return _all_to_all(rows, self.ref, self.recv_splits, self.send_splits).index_select(0, self.order)

    def from_experts(self, rows: torch.Tensor, owner: str = None) -> torch.Tensor:
        """The adjoint (and inverse) of :meth:`to_experts`: local-expert-major rows back to the
        ranks their tokens came from, in this rank's global-expert order."""
        owner = owner or self.owner
        if rows.shape[0] != self.inv_order.numel():
            raise ValueError(f"{owner}: the input has {rows.shape[0]} rows; the expert-parallel Dispatch delivered "
                             f"{self.inv_order.numel()} token copies to this rank's experts")
        check_not_capturing(owner, self.ref)
        return _all_to_all(rows.index_select(0, self.inv_order), self.ref, self.send_splits, self.recv_splits)


class _ToExperts(torch.autograd.Function):
    """Plain-autograd form of :meth:`ExpertExchange.to_experts` (reference runs); backward its adjoint."""

    @staticmethod
    def forward(ctx, x, exchange):
        ctx.exchange = exchange
        return exchange.to_experts(x)

    @staticmethod
    def backward(ctx, dy):
        return ctx.exchange.from_experts(dy), None


class _FromExperts(torch.autograd.Function):
    """Plain-autograd form of :meth:`ExpertExchange.from_experts`; backward its adjoint."""

    @staticmethod
    def forward(ctx, x, exchange, owner):
        ctx.exchange = exchange
        return exchange.from_experts(x, owner)

    @staticmethod
    def backward(ctx, dy):
        return ctx.exchange.to_experts(dy), None, None


def to_experts_autograd(x: torch.Tensor, exchange: ExpertExchange) -> torch.Tensor:
    return _ToExperts.apply(x, exchange)


def from_experts_autograd(x: torch.Tensor, exchange: ExpertExchange, owner: str) -> torch.Tensor:
    return _FromExperts.apply(x, exchange, owner)
