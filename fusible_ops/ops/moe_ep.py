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

:class:`PaddedLayout` (``Dispatch(ep_exchange="padded")``) is the exchange with no host read:
equal split sizes (each peer gets a fixed capacity of rows), the counts kept on the device;
graph-capturable, at ``ep`` times the traffic (docs/scaling-out.md has both measured).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..kernels.moe_combine import gather_rows
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
    any (:class:`~fusible_ops.ops.moe_routing.RoutingLayout`'s ``ep_errors``). Raises the same
    :class:`RoutingError` on every rank when any rank has an error or the ranks disagree, so no
    rank is left waiting in an exchange its peers never join."""
    rows = agree_on(owner, ref, (experts, 0 if error is None else 1), device)  # (first call only, when all is well)
    if not any(flag for _, flag in rows) and len({e for e, _ in rows}) == 1:
        return
    messages = [None] * ref.size
    dist.all_gather_object(messages, error, group=ref.group)
    said = "; ".join(f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None)
    counts = ", ".join(f"rank {r}: {e}" for r, (e, _) in enumerate(rows))
    raise RoutingError(f"{owner}: the expert-parallel group ({ref.size} ranks) cannot run this MoE layer: "
                       + (said if said else f"the ranks' Routers have different numbers of experts ({counts})"))


def check_not_capturing(owner: str, ref: GroupRef, why: Optional[str] = None) -> None:
    """The synced exchange reads its split sizes on the host: refuse a CUDA graph capture clearly
    (``why``: what the message adds, e.g. why a padded exchange did not run)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{owner}: expert parallel (ep_group of {ref.size} ranks) is not graph-capturable with "
            f"ep_exchange='sync': its all-to-all needs the split sizes on the host (one sync per MoE layer per "
            f"forward). " + (f"{why}. " if why else "Use Dispatch(ep_exchange='padded') in a fused MoE layer, ")
            + "run the MoE layer eagerly (capture the layers around it), or use ep_group=None")


def dtype_code(dtype: torch.dtype) -> int:
    """A float dtype as an int that ranks can exchange (-1: not a float dtype)."""
    return _DTYPE_CODE.get(dtype, -1)


def agree_on(owner: str, ref: GroupRef, key: tuple, device: torch.device) -> list:
    """Every rank's ``key`` (a tuple of ints), gathered over ``ref``'s group (collective; one host
    read). The caller compares them; every rank sees the same list, so all raise together."""
    mine = torch.tensor(key, dtype=torch.int64, device=device)
    every = torch.empty(ref.size * len(key), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(every, mine, group=ref.group)
    return [tuple(r) for r in every.view(ref.size, len(key)).tolist()]


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
    inverse (made on first use: the overlapped exchange, :meth:`chunked`, reorders per chunk)."""

    __slots__ = ("owner", "ref", "send_splits", "recv_splits", "local_counts", "counts", "blocks", "host_counts",
                 "host_blocks", "_orders")

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
        host = torch.cat([counts, recv.reshape(-1)]).tolist()  # the host sync
        rows = [host[experts + s * (local + 2):experts + (s + 1) * (local + 2)] for s in range(ep)]
        if any(r[local:] != [hidden, _DTYPE_CODE.get(dtype, -1)] for r in rows):
            names = {i: d for d, i in _DTYPE_CODE.items()}
            seen = "; ".join(f"rank {s}: hidden {r[local]} {names.get(r[local + 1], 'non-float')}"
                             for s, r in enumerate(rows))
            raise ValueError(f"{owner}: the ranks of the expert-parallel group (size {ep}) passed different token "
                             f"rows ({seen}); every rank must pass the same hidden size and dtype")
        self = cls()
        self.owner, self.ref = owner, ref
        self.host_counts, self.host_blocks = host[:experts], [r[:local] for r in rows]
        self.send_splits = [sum(host[d * local:(d + 1) * local]) for d in range(ep)]
        self.recv_splits = [sum(r) for r in self.host_blocks]
        blocks = recv[:, :local]  # [source, local expert] rows received
        self.counts, self.blocks, self._orders = counts, blocks, None
        self.local_counts = blocks.sum(0)
        return self

    def _reorder(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._orders is None:
            ep, local = self.blocks.shape
            dev = self.blocks.device
            key = torch.arange(local, device=dev) * ep + torch.arange(ep, device=dev).unsqueeze(1)  # (l, s) order
            total = sum(self.recv_splits)
            row_key = torch.repeat_interleave(key.reshape(-1), self.blocks.reshape(-1), output_size=total)
            order = torch.argsort(row_key, stable=True)
            self._orders = (order, _inverse(order))
        return self._orders

    @property
    def order(self) -> torch.Tensor:
        return self._reorder()[0]

    @property
    def inv_order(self) -> torch.Tensor:
        return self._reorder()[1]

    @classmethod
    def local(cls, owner: str, ref: GroupRef, counts: torch.Tensor) -> "ExpertExchange":
        """The exchange of a one-rank group (every expert local; nothing travels): what
        :class:`ChunkLayout` builds on when the overlap rule runs without an expert-parallel group
        (only where a test sets its checker aside). Reads the counts on the host."""
        self = cls()
        self.owner, self.ref = owner, ref
        self.host_counts = counts.tolist()
        self.host_blocks = [self.host_counts]
        self.send_splits = self.recv_splits = [sum(self.host_counts)]
        self.counts, self.blocks, self.local_counts, self._orders = counts, counts.view(1, -1), counts, None
        return self

    def chunked(self, chunks: int) -> "ChunkLayout":
        """This exchange split into ``chunks`` pipeline stages (:class:`ChunkLayout`; no host sync:
        the split sizes came with :meth:`plan`)."""
        return ChunkLayout(self, chunks)

    def to_experts(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's copies [sum(send_splits), H], sorted by global expert -> the copies of its
        local experts [sum(recv_splits), H], local-expert-major."""
        check_not_capturing(self.owner, self.ref)
        return gather_rows(_all_to_all(rows, self.ref, self.recv_splits, self.send_splits), self.order)

    def from_experts(self, rows: torch.Tensor, owner: str = None) -> torch.Tensor:
        """The adjoint (and inverse) of :meth:`to_experts`: local-expert-major rows back to the
        ranks their tokens came from, in this rank's global-expert order."""
        owner = owner or self.owner
        if rows.shape[0] != sum(self.recv_splits):
            raise ValueError(f"{owner}: the input has {rows.shape[0]} rows; the expert-parallel Dispatch delivered "
                             f"{sum(self.recv_splits)} token copies to this rank's experts")
        check_not_capturing(owner, self.ref)
        return _all_to_all(gather_rows(rows, self.inv_order), self.ref, self.send_splits, self.recv_splits)


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


_CHUNK_KEYS: dict = {}  # (device, experts, ep, n) -> (per-global-expert send key, recv block order, its keys)


def _chunk_keys(device, experts: int, ep: int, n: int) -> tuple:
    """Device index tensors that depend only on the layout (built once per layout)."""
    key = (device, experts, ep, n)
    hit = _CHUNK_KEYS.get(key)
    if hit is None:
        local = experts // ep
        chunk = [c for c in range(n) for _ in range(c * local // n, (c + 1) * local // n)]
        send_key = [chunk[g % local] * ep + g // local for g in range(experts)]
        blocks = [(s, l) for c in range(n) for s in range(ep) for l in range(c * local // n, (c + 1) * local // n)]
        hit = (torch.tensor(send_key, device=device), torch.tensor([s * local + l for s, l in blocks], device=device),
               torch.tensor([l * ep + s for s, l in blocks], device=device))
        _CHUNK_KEYS[key] = hit
    return hit


class ChunkLayout:
    """An :class:`ExpertExchange` in ``n`` pipeline stages (chunks): chunk ``c`` is this rank's local
    experts ``[c * L / n, (c + 1) * L / n)`` (``L = E / ep``) and, on every rank, the copies routed to
    the experts of chunk ``c`` on every rank. Each chunk is exchanged by its own all-to-all, so chunk
    ``c + 1`` can travel while chunk ``c``'s experts compute (:mod:`~fusible_ops.fusion_rules.moe_ep_overlap`).

    * Send side: this rank's copies are laid out chunk-major (chunk 0's copies for rank 0, for
      rank 1, ..., then chunk 1's ...), so every chunk is one contiguous slice ``send_rows[c]``:
      ``send_order`` [N]: the expert-sorted copy (Dispatch's order) at each chunk-major position;
      ``send_pos`` its inverse.
    * Receive side: chunk ``c`` arrives source-major in ``recv_rows[c]``; ``order[c]`` (absolute rows
      of the whole receive buffer) reads it local-expert-major, the layout the grouped GEMMs take
      (the same rows, in the same order, as :meth:`ExpertExchange.to_experts`); ``back[c]`` (rows of
      the chunk) undoes that for the return trip.
    * ``bounds[c]:bounds[c + 1]``: chunk ``c``'s local experts; ``counts[c]``: their rows (device).
    """

    __slots__ = ("ex", "n", "bounds", "send_splits", "recv_splits", "send_rows", "recv_rows", "send_order",
                 "send_pos", "order", "back", "counts")

    def __init__(self, ex: ExpertExchange, chunks: int) -> None:
        ep, local = ex.ref.size, ex.local_counts.numel()
        n = self.n = max(1, min(int(chunks), local))
        self.ex = ex
        self.bounds = b = [c * local // n for c in range(n + 1)]
        hc, hb = ex.host_counts, ex.host_blocks
        self.send_splits = [[sum(hc[d * local + b[c]:d * local + b[c + 1]]) for d in range(ep)] for c in range(n)]
        self.recv_splits = [[sum(hb[s][b[c]:b[c + 1]]) for s in range(ep)] for c in range(n)]
        self.send_rows = _slices([sum(x) for x in self.send_splits])
        self.recv_rows = _slices([sum(x) for x in self.recv_splits])
        dev = ex.counts.device
        send_key, block_index, block_key = _chunk_keys(dev, ex.counts.numel(), ep, n)
        n_send, n_recv = self.send_rows[-1].stop, self.recv_rows[-1].stop
        self.send_order = torch.argsort(torch.repeat_interleave(send_key, ex.counts, output_size=n_send), stable=True)
        self.send_pos = _inverse(self.send_order)
        block_rows = ex.blocks.reshape(-1).index_select(0, block_index)
        order = torch.argsort(torch.repeat_interleave(block_key, block_rows, output_size=n_recv), stable=True)
        inv = _inverse(order)
        self.order = [order[r] for r in self.recv_rows]
        self.back = [inv[r] - r.start for r in self.recv_rows]
        self.counts = [ex.local_counts[b[c]:b[c + 1]] for c in range(n)]

    def to_experts(self, out: torch.Tensor, rows: torch.Tensor, c: int):
        """Start chunk ``c``'s trip to the experts: ``rows`` (chunk-major send buffer) -> ``out``
        (the receive buffer). Returns the async work (``.wait()`` before reading ``out``'s chunk)."""
        return _start(out[self.recv_rows[c]], rows[self.send_rows[c]], self.ex.ref, self.recv_splits[c],
                      self.send_splits[c])

    def from_experts(self, out: torch.Tensor, rows: torch.Tensor, c: int):
        """Start chunk ``c``'s trip back: ``rows`` (the chunk's rows, source-major: ``x[back[c]]`` of
        local-expert-major ``x``) -> ``out``'s chunk ``c`` (chunk-major, as sent)."""
        return _start(out[self.send_rows[c]], rows, self.ex.ref, self.send_splits[c], self.recv_splits[c])


class PaddedLayout:
    """The exchange with no host sync (``Dispatch(ep_exchange="padded")``): every rank sends every
    peer a fixed ``capacity`` of rows, ``C = N``, this rank's number of token copies (the most it can
    send one peer; every rank of the group must have the same N, checked by the Dispatch whenever N
    changes). The all-to-alls then have equal splits known on the host, the counts travel on the
    device, and the rows past each peer's count are padding that no one reads. The local experts'
    rows are the first ``sum(local_counts)`` rows of a ``[ep * C, H]`` buffer (the grouped GEMMs
    walk only their groups' rows; the rows past them are left as they are). So the layer can be
    captured in a CUDA graph and replayed with other routings; it moves ``ep * C`` rows each way
    per rank where :class:`ExpertExchange` moves N: ``ep`` times the traffic and the memory of the
    received copies.

    Same interface as one-chunk :class:`ChunkLayout` (``n = 1``), plus :meth:`compact` /
    :meth:`expand` between the padded send buffer (``ep * C`` rows) and the copies in the
    Dispatch's expert order (N rows). All index tensors are built on the device from the counts.
    """

    __slots__ = ("ref", "n", "bounds", "capacity", "send_rows", "recv_rows", "send_order", "send_pos", "order", "back",
                 "counts")

    def __init__(self, ref: GroupRef, counts: torch.Tensor, rows: int) -> None:
        ep, experts = ref.size, counts.numel()
        local = experts // ep
        dev = counts.device
        self.ref, self.n, self.bounds, self.capacity = ref, 1, [0, local], rows
        size = ep * rows
        self.send_rows = self.recv_rows = [slice(0, size)]
        per_dest = counts.view(ep, local)
        blocks = torch.empty_like(per_dest)  # row s: rank s's copies of my experts
        _start(blocks, per_dest, ref, None, None).wait()
        # send side: peer d's rows are the Dispatch's rows [off_d, off_d + n_d), in slot d
        n_d = per_dest.sum(1)
        off_d = torch.cumsum(n_d, 0) - n_d
        j = torch.arange(rows, device=dev)  # (a slot's row; also a copy's index in the Dispatch's order)
        self.send_order = torch.where(j < n_d[:, None], off_d[:, None] + j, 0).reshape(-1)
        d = torch.searchsorted(torch.cumsum(n_d, 0), j, right=True).clamp_(max=ep - 1)
        self.send_pos = d * rows + j - off_d[d]
        # receive side: local expert l's rows from source s, in (l, s) order, from slot s
        sizes = blocks.t().reshape(-1)  # [(l, s)]
        ends = torch.cumsum(sizes, 0)
        r = torch.arange(size, device=dev)
        b = torch.searchsorted(ends, r, right=True)
        valid = b < sizes.numel()
        b = b.clamp_(max=max(sizes.numel() - 1, 0))
        l, s = torch.div(b, ep, rounding_mode="floor"), b % ep
        base = torch.cumsum(blocks, 1) - blocks  # [s, l]: first row of expert l in slot s
        src = s * rows + base[s, l] + r - (ends[b] - sizes[b])
        self.order = [torch.where(valid, src, 0)]
        back = torch.zeros(size + 1, dtype=torch.int64, device=dev)
        back.scatter_(0, torch.where(valid, src, size), r)
        self.back = [back[:size]]
        self.counts = [blocks.sum(0)]

    @classmethod
    def plan(cls, owner: str, ref: GroupRef, counts: torch.Tensor, rows: int, hidden: int, dtype: torch.dtype,
             agreed: Optional[tuple] = None) -> tuple["PaddedLayout", tuple]:
        """The layout of this call and the (copies, hidden, dtype) key the ranks agreed on. No host
        read unless the key differs from ``agreed`` (the last call's): then every rank compares
        them (collective), and a mismatch is the same ``ValueError`` on every rank."""
        key = (rows, hidden, dtype_code(dtype))
        if key != agreed:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"{owner}: ep_exchange='padded' met {rows} token copies of hidden size {hidden} "
                                   f"({dtype}) while a CUDA graph was being captured; the ranks compare them on the "
                                   f"first call of each shape: run one call of this shape before capturing")
            every = agree_on(owner, ref, key, counts.device)
            if len(set(every)) > 1:
                names = {dtype_code(d): d for d in _DTYPE_CODE}
                seen = "; ".join(f"rank {r}: {n} copies, hidden {h}, {names.get(c, 'not a float dtype')}"
                                 for r, (n, h, c) in enumerate(every))
                raise ValueError(f"{owner}: ep_exchange='padded' needs the same number of token copies, hidden size "
                                 f"and dtype on every rank of the expert-parallel group ({seen}); route the same "
                                 f"number of tokens everywhere, or use ep_exchange='sync'")
        return cls(ref, counts, rows), key

    def compact(self, padded: torch.Tensor) -> torch.Tensor:
        """The returned rows of the padded send buffer -> the N copies in the Dispatch's order."""
        return gather_rows(padded, self.send_pos)

    def expand(self, rows: torch.Tensor) -> torch.Tensor:
        """The N copies in the Dispatch's order -> the padded send buffer (padding rows repeat row 0)."""
        return gather_rows(rows, self.send_order)

    def to_experts(self, out: torch.Tensor, rows: torch.Tensor, c: int = 0):
        """Start the trip to the experts: padded send buffer -> padded receive buffer (async work)."""
        return _start(out, rows, self.ref, None, None)

    def from_experts(self, out: torch.Tensor, rows: torch.Tensor, c: int = 0):
        """Start the trip back: ``rows`` (``x[back[0]]`` of local-expert-major ``x``) -> ``out``."""
        return _start(out, rows, self.ref, None, None)


def _slices(sizes: list) -> list:
    out, start = [], 0
    for n in sizes:
        out.append(slice(start, start + n))
        start += n
    return out


def _inverse(order: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


class _Done:
    """The finished "work" of an exchange within one rank (a copy)."""

    @staticmethod
    def wait() -> bool:
        return True


def _start(out: torch.Tensor, x: torch.Tensor, ref: GroupRef, out_splits: list, in_splits: list):
    if ref.size == 1:
        out.copy_(x)
        return _Done
    return dist.all_to_all_single(out, x, out_splits, in_splits, group=ref.group, async_op=True)
