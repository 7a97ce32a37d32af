"""Collective ops on the first (sequence / token) dimension, over a ``torch.distributed`` process
group: :class:`AllGather`, :class:`ReduceScatter`, :class:`AllReduce` and :class:`AllReduceGrad`.

Each op's backward is its adjoint: all-gather <-> reduce-scatter, all-reduce <-> identity (the
output of an all-reduce is replicated, and the replicas' downstream math is counted once, as in
Megatron's tensor parallelism), identity <-> all-reduce (:class:`AllReduceGrad`, the entry of a
tensor-parallel region whose input is replicated).

They hold the process group and no parameters. ``process_group=None`` means no communication:
the op is an identity (allowed only while ``torch.distributed`` is not initialized with more than
one rank, so a forgotten group never silently skips a reduction); a single-rank group is an
identity too. Collectives are torch's own (``all_gather_single`` / ``reduce_scatter_single`` /
``all_reduce``: NCCL on GPUs, gloo on CPU).

What is checked (every rank raises the same error, so no rank is left waiting in a collective):

* On the first ``check_calls`` forward calls of each op (default 1; every call with
  ``check_calls=None``, or for ops built while ``FUSIBLE_OPS_CHECK_COLLECTIVES=1``), one small
  all-gather of each rank's input shape and dtype: ranks passing different shapes or dtypes get a
  ``ValueError`` listing every rank's. A later call with a mismatch is not detected (the
  collective then fails, hangs until the group's timeout, or mixes rows); the count is the same on
  every rank, so the check itself never mismatches.
* :class:`ReduceScatter`: a first dim not divisible by the group size is a ``ValueError`` naming
  the op, the token count and the group size (pad the sequence).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

from ..op import BasicOperation
from .validation import FLOAT_DTYPES

if dist.is_available():
    import torch.distributed._functional_collectives as _funcol

    # torch 2.13 names them *_single (the *_tensor names are deprecated there); older torch has only those
    _all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    _reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    _gather_autograd = getattr(_funcol, "all_gather_single_autograd", None) or _funcol.all_gather_tensor_autograd
    _scatter_autograd = (getattr(_funcol, "reduce_scatter_single_autograd", None)
                         or _funcol.reduce_scatter_tensor_autograd)
else:  # pragma: no cover - torch built without distributed
    _funcol = _all_gather = _reduce_scatter = _gather_autograd = _scatter_autograd = None

_META = 10  # shape check: ndim, dtype, numel, the first 7 dims
_DTYPES = {d: i for i, d in enumerate(FLOAT_DTYPES)}


def _distributed_world() -> int:
    """World size of the default group, or 1 when torch.distributed is not initialized."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


class GroupRef:
    """A process group as the comm ops see it: the group, this rank's index in it, its size, and
    the global ranks of its ring neighbours. Deep copies share it (a ``ProcessGroup`` cannot be
    copied; ``copy.deepcopy`` of a block keeps talking to the same group)."""

    __slots__ = ("group", "size", "rank", "next_global", "prev_global", "backend")

    def __init__(self, owner: str, process_group, *, none_ok: bool = False) -> None:
        if process_group is None:
            world = 1 if none_ok else _distributed_world()
            if world > 1:
                raise ValueError(
                    f"{owner}: process_group=None means no communication (an identity), but torch.distributed is "
                    f"initialized with {world} ranks; pass the group explicitly (torch.distributed.group.WORLD "
                    f"for all ranks)")
            self.group, self.size, self.rank, self.backend = None, 1, 0, None
            self.next_global = self.prev_global = 0
            return
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"{owner}: a process group was given but torch.distributed is not initialized")
        rank = dist.get_rank(process_group)
        if rank < 0:
            raise ValueError(f"{owner}: this process (global rank {dist.get_rank()}) is not a member of the group")
        self.group = process_group
        self.size = dist.get_world_size(process_group)
        self.rank = rank
        self.backend = str(dist.get_backend(process_group))
        self.next_global = dist.get_global_rank(process_group, (rank + 1) % self.size)
        self.prev_global = dist.get_global_rank(process_group, (rank - 1) % self.size)

    def __deepcopy__(self, memo) -> "GroupRef":
        return self

    def __repr__(self) -> str:
        return f"GroupRef(size={self.size}, rank={self.rank}, backend={self.backend})"


class _Collective(BasicOperation):
    """Shared machinery: the group, input checks, the cross-rank shape check."""

    def __init__(self, process_group=None, *, check_calls: Optional[int] = 1) -> None:
        super().__init__()
        self.group_ref = GroupRef(type(self).__name__, process_group)
        if check_calls is not None and int(check_calls) < 0:
            raise ValueError(f"{type(self).__name__}: check_calls must be >= 0 or None, got {check_calls}")
        self.check_calls = None if check_calls is None or _check_all() else int(check_calls)
        # opt-in: the comm_overlap rules may fuse this op with its linear (CUDA + NCCL); off by default
        # until the ring is measured on a multi-GPU machine (it has run on gloo only)
        self.overlap = False
        self.__dict__["_calls"] = 0  # not an attribute assignment: no re-plan per call

    @classmethod
    def _example(cls, n: int, **factory):
        """A single-process example (no group: an identity) for the test helpers."""
        return cls(None), n

    @property
    def process_group(self):
        return self.group_ref.group

    @property
    def world_size(self) -> int:
        return self.group_ref.size

    @property
    def rank(self) -> int:
        """This process's index in the group."""
        return self.group_ref.rank

    def extra_repr(self) -> str:
        return f"world_size={self.world_size}, rank={self.rank}"

    # pieces protocol -------------------------------------------------------------------
    def check_input(self, x: torch.Tensor, shape=None) -> None:
        """Raise a clear error for a bad input (on every rank alike where the shape check runs:
        see the module docstring). ``shape``: checked in place of ``x.shape`` (an input a fused op
        has not computed yet, with x's dtype and device). Counts as one call of this op."""
        name = type(self).__name__
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: input must be a tensor, got {type(x).__name__}")
        shape = tuple(x.shape if shape is None else shape)
        calls = self.__dict__["_calls"]
        self.__dict__["_calls"] = calls + 1
        if self.group_ref.group is None:
            world = _distributed_world() if calls == 0 else 1
            if world > 1:
                raise ValueError(f"{name}: process_group=None (an identity) but torch.distributed now runs {world} "
                                 f"ranks; build the op with the process group")
        elif self.world_size > 1 and (self.check_calls is None or calls < self.check_calls):
            self._check_ranks_agree(x, shape)
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name}: input dtype {x.dtype} is not a floating-point dtype {FLOAT_DTYPES}")
        if len(shape) == 0:
            raise ValueError(f"{name}: input must have a first (sequence/token) dim, got a scalar")

    def _check_ranks_agree(self, x: torch.Tensor, shape: tuple) -> None:
        meta = [len(shape), _DTYPES.get(x.dtype, -1), _numel(shape), *shape[:_META - 3]]
        meta += [-1] * (_META - len(meta))
        mine = torch.tensor(meta, dtype=torch.int64, device=x.device)
        every = torch.empty(self.world_size * _META, dtype=torch.int64, device=x.device)
        _all_gather(every, mine, group=self.group_ref.group)
        rows = every.view(self.world_size, _META).tolist()
        if any(r != rows[0] for r in rows):
            inv = {i: d for d, i in _DTYPES.items()}
            seen = "; ".join(
                f"rank {i}: shape {r[3:3 + r[0]]}{'...' if r[0] > _META - 3 else ''} {inv.get(r[1], 'non-float')}"
                for i, r in enumerate(rows))
            raise ValueError(
                f"{type(self).__name__}: the ranks of the process group (size {self.world_size}) passed different "
                f"inputs ({seen}); every rank must pass the same shape and dtype")

    def reference_forward(self, x):  # overridden where the op communicates
        return x


def _check_all() -> bool:
    return os.environ.get("FUSIBLE_OPS_CHECK_COLLECTIVES", "0") not in ("", "0")


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def gather_rows(x: torch.Tensor, ref: GroupRef) -> torch.Tensor:
    """All-gather over ``ref``'s group along dim 0 (rank order), in one collective."""
    x = x.contiguous()
    out = x.new_empty((ref.size * x.shape[0], *x.shape[1:]))
    _all_gather(out, x, group=ref.group)
    return out


def reduce_scatter_rows(x: torch.Tensor, ref: GroupRef) -> torch.Tensor:
    """Sum over ``ref``'s group, then this rank's block of dim 0 (x.shape[0] divisible by the size)."""
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // ref.size, *x.shape[1:]))
    _reduce_scatter(out, x, group=ref.group)
    return out


def all_reduce_sum(x: torch.Tensor, ref: GroupRef) -> torch.Tensor:
    """A new tensor: the sum of ``x`` over ``ref``'s group (x is not modified)."""
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=ref.group)
    return out


class AllGather(_Collective):
    """All-gather on the first dim: ``x`` [n, ...] on each rank -> [world_size * n, ...], rank
    blocks in group order (the sequence/token shards of sequence parallelism). Backward:
    reduce-scatter of the gradient (each rank gets the sum over ranks of its block).

    ``process_group``: a ``torch.distributed`` group (``None`` or one rank: an identity). Every rank
    must pass the same shape (checked on the first ``check_calls`` calls, see the module doc)."""

    def op_forward(self, ctx, x, **kwargs):
        self.check_input(x)
        return x if self.world_size == 1 else gather_rows(x, self.group_ref)

    def op_backward(self, ctx, dy):
        if not ctx.input_requires_grad:
            return None, ()
        return (dy if self.world_size == 1 else reduce_scatter_rows(dy, self.group_ref)), ()

    def reference_forward(self, x):
        if self.world_size == 1:
            return x
        return _gather_autograd(x.contiguous(), 0, self.process_group)


class ReduceScatter(_Collective):
    """Reduce-scatter on the first dim: ``x`` [N, ...] on each rank (partial sums) -> this rank's
    block [N / world_size, ...] of their sum over ranks. Backward: all-gather of the gradient.

    ``N`` must be divisible by the group size (a ``ValueError`` names the op, ``N`` and the size
    otherwise: pad the sequence). Every rank must pass the same shape (see the module doc)."""

    def check_input(self, x: torch.Tensor, shape=None) -> None:
        super().check_input(x, shape)
        n = (x.shape if shape is None else tuple(shape))[0]
        if n % self.world_size:
            raise ValueError(
                f"ReduceScatter: the first (sequence/token) dim, {n}, is not divisible by the process group's "
                f"size {self.world_size}; pad the sequence to a multiple of {self.world_size}")

    def op_forward(self, ctx, x, **kwargs):
        self.check_input(x)
        return x if self.world_size == 1 else reduce_scatter_rows(x, self.group_ref)

    def op_backward(self, ctx, dy):
        if not ctx.input_requires_grad:
            return None, ()
        return (dy if self.world_size == 1 else gather_rows(dy, self.group_ref)), ()

    def reference_forward(self, x):
        if self.world_size == 1:
            return x
        return _scatter_autograd(x.contiguous(), "sum", 0, self.process_group)


class AllReduce(_Collective):
    """Sum over the group: every rank gets ``sum_r x_r`` (same shape). Backward: the identity (the
    output is replicated and what follows it runs as replicas whose loss counts once; pair with
    :class:`AllReduceGrad` at the entry of the tensor-parallel region)."""

    def op_forward(self, ctx, x, **kwargs):
        self.check_input(x)
        return x if self.world_size == 1 else all_reduce_sum(x, self.group_ref)

    def op_backward(self, ctx, dy):
        return (dy if ctx.input_requires_grad else None), ()

    def reference_forward(self, x):
        return x if self.world_size == 1 else _ReplicatedSum.apply(x, self.process_group)


class AllReduceGrad(_Collective):
    """Identity forward; backward: the sum of the gradient over the group. The entry of a tensor-
    parallel region whose input is replicated (``AllReduceGrad -> BasicLinear(in, out / tp)``):
    each rank's input gradient is a partial sum over its weight shard."""

    def op_forward(self, ctx, x, **kwargs):
        self.check_input(x)
        return x

    def op_backward(self, ctx, dy):
        if not ctx.input_requires_grad:
            return None, ()
        return (dy if self.world_size == 1 else all_reduce_sum(dy, self.group_ref)), ()

    def reference_forward(self, x):
        return x if self.world_size == 1 else _ReplicatedSum.apply(x, self.process_group, True)


class _ReplicatedSum(torch.autograd.Function):
    """Reference math of the all-reduce pair in plain autograd: ``backward=False``: sum forward,
    identity backward; ``backward=True``: identity forward, sum backward (functional collectives)."""

    @staticmethod
    def forward(ctx, x, group, backward=False):
        ctx.group, ctx.backward = group, backward
        return x.clone() if backward else _funcol.all_reduce(x.contiguous(), "sum", group).clone()

    @staticmethod
    def backward(ctx, dy):
        return (_funcol.all_reduce(dy.contiguous(), "sum", ctx.group).clone() if ctx.backward else dy), None, None


COMM_CLASSES = (AllGather, ReduceScatter, AllReduce, AllReduceGrad)
