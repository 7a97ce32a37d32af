"""Tensor-parallel building blocks made of the basic ops (no op of their own).

* :func:`tensor_parallel_mlp`: ``Linear -> activation -> Linear`` split over a tensor-parallel
  group, column-parallel then row-parallel, with sequence parallelism (``AllGather`` in,
  ``ReduceScatter`` out: activations sharded by tokens outside the block) or without it
  (``AllReduceGrad`` in, ``AllReduce`` out: activations replicated).
* :func:`load_full_state_dict`: loads a checkpoint of the unsharded block into the shards.
* :func:`mark_sequence_parallel`: parameters applied to token-sharded activations get a partial
  gradient on each rank; this sums it over the group in backward.
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

import torch
import torch.distributed as dist

from .ops import AllGather, AllReduce, AllReduceGrad, BasicLinear, Bias, GELU, Identity, Linear, ReduceScatter
from .ops.activation import Activation
from .ops.comm import GroupRef, all_reduce_sum
from .sequential import Sequential

__all__ = ["load_full_state_dict", "mark_sequence_parallel", "tensor_parallel_mlp"]


def tensor_parallel_mlp(
    hidden: int,
    ffn: int,
    process_group=None,
    *,
    activation: Optional[Activation] = None,
    sequence_parallel: bool = True,
    bias: bool = True,
    device=None,
    dtype=None,
    accumulate_into_main_grad: bool = False,
    delay_wgrad_compute: bool = False,
) -> Sequential:
    """An MLP block ``fc1 -> activation -> fc2`` (hidden -> ffn -> hidden) sharded over
    ``process_group`` (size ``tp``), as a :class:`~fusible_ops.Sequential` of basic ops:

    * ``sequence_parallel=True``: ``AllGather, Linear(hidden, ffn_in / tp), activation,
      BasicLinear(ffn / tp, hidden), ReduceScatter, Bias(hidden)``. Input and output are this
      rank's token shard [n / tp, ..., hidden] (token blocks in group order); the output bias gets
      a hook that sums its gradient over the group (:func:`mark_sequence_parallel`).
    * ``sequence_parallel=False``: ``AllReduceGrad, Linear, activation, BasicLinear, AllReduce,
      Bias``: input and output replicated [n, ..., hidden] on every rank.

    ``ffn_in`` is ``ffn``, or ``2 * ffn`` for a gated activation (``fo.SwiGLU()``...: each rank
    holds the matching rows of both halves). ``activation``: an activation op (default
    ``fo.GELU()``). ``process_group=None`` builds the unsharded block (``fo.Identity()`` in place
    of the comm ops, the same keys), also inside a multi-rank job: its ``state_dict()`` is the
    full checkpoint that :func:`load_full_state_dict` shards. Each rank initializes its shards on
    its own; load a full checkpoint to train the model a single process would. Raises
    ``ValueError`` if ``tp`` does not divide ``ffn``. The gradient-contract flags go to both
    linears.
    """
    ref = GroupRef("tensor_parallel_mlp", process_group, none_ok=True)
    tp = ref.size
    if hidden <= 0 or ffn <= 0:
        raise ValueError(f"tensor_parallel_mlp: sizes must be positive, got hidden={hidden}, ffn={ffn}")
    if ffn % tp:
        raise ValueError(f"tensor_parallel_mlp: ffn={ffn} is not divisible by the tensor-parallel group size {tp}")
    act = GELU() if activation is None else activation
    if not isinstance(act, Activation):
        raise TypeError(f"tensor_parallel_mlp: activation must be an activation op (fo.GELU(), fo.SwiGLU()...), "
                        f"got {type(act).__name__}")
    gated = bool(act.gated)
    factory = dict(device=device, dtype=dtype)
    flags = dict(accumulate_into_main_grad=accumulate_into_main_grad, delay_wgrad_compute=delay_wgrad_compute)
    local = ffn // tp
    fc1 = Linear(hidden, local * (2 if gated else 1), bias=bias, **factory, **flags)
    fc2 = BasicLinear(local, hidden, **factory, **flags)
    if process_group is None:  # the unsharded block: same layout and keys, no communication
        enter, leave = Identity(), Identity()
    elif sequence_parallel:
        enter, leave = AllGather(process_group), ReduceScatter(process_group)
    else:
        enter, leave = AllReduceGrad(process_group), AllReduce(process_group)
    mods = [enter, fc1, act, fc2, leave]
    if bias:
        mods.append(Bias(hidden, **factory))
    block = Sequential(*mods)
    if bias and sequence_parallel and tp > 1:
        mark_sequence_parallel([mods[-1].bias], process_group)
    # how each parameter is split: key -> (dim, gated)
    block.tp_shards = {"1.weight": (0, gated), "3.weight": (1, False), **({"1.bias": (0, gated)} if bias else {})}
    block.tp_group = ref
    return block


def load_full_state_dict(block: Sequential, full_state_dict: dict, process_group=None) -> None:
    """Copy each rank's shard of ``full_state_dict`` (the ``state_dict()`` of the unsharded block,
    ``tensor_parallel_mlp(hidden, ffn, None, ...)`` with the same other arguments) into ``block``,
    a :func:`tensor_parallel_mlp` block.

    ``process_group`` (default: the block's own) must have the size and rank of the block's group.
    Raises ``ValueError`` naming the parameter and sizes where a shard does not fit (a group whose
    size does not match the weight shards, a checkpoint of another size) and ``KeyError`` for
    missing or unexpected keys. Nothing is copied unless every key fits.
    """
    shards = getattr(block, "tp_shards", None)
    ref: GroupRef = getattr(block, "tp_group", None)
    if shards is None or ref is None:
        raise TypeError("load_full_state_dict: the block was not built by fusible_ops.parallel.tensor_parallel_mlp")
    if process_group is not None and process_group is not ref.group:
        size, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        if (size, rank) != (ref.size, ref.rank):
            raise ValueError(f"load_full_state_dict: the process group has {size} ranks (this is rank {rank}) but the "
                             f"block was built for a group of {ref.size} (rank {ref.rank})")
    mine = block.state_dict()
    missing = sorted(set(mine) - set(full_state_dict))
    extra = sorted(set(full_state_dict) - set(mine))
    if missing or extra:
        raise KeyError(f"load_full_state_dict: missing keys {missing}, unexpected keys {extra}")
    pieces = {k: _shard(k, full_state_dict[k], mine[k].shape, shards.get(k), ref) for k in mine}
    with torch.no_grad():
        for k, t in mine.items():
            t.copy_(pieces[k])


def _shard(key: str, full: torch.Tensor, local_shape, spec, ref: GroupRef) -> torch.Tensor:
    full_shape, local_shape = tuple(full.shape), tuple(local_shape)
    if spec is None:
        if full_shape != local_shape:
            raise ValueError(f"load_full_state_dict: {key!r} is replicated with shape {list(local_shape)}, the "
                             f"checkpoint has {list(full_shape)}")
        return full
    dim, gated = spec
    want = list(local_shape)
    want[dim] *= ref.size
    if list(full_shape) != want:
        raise ValueError(
            f"load_full_state_dict: {key!r} has shape {list(full_shape)} in the checkpoint; a group of {ref.size} "
            f"rank(s) holding shards of {list(local_shape)} (split along dim {dim}) needs {want}: the process group "
            f"does not match the weight shards (or the checkpoint is of another size)")
    if not gated:
        return full.chunk(ref.size, dim)[ref.rank]
    a, b = full.chunk(2, dim)  # gated: this rank's rows of the activated half and of the other half
    return torch.cat([a.chunk(ref.size, dim)[ref.rank], b.chunk(ref.size, dim)[ref.rank]], dim)


def mark_sequence_parallel(params: Union[torch.nn.Module, Iterable[torch.Tensor]], process_group) -> list:
    """Sum the gradient of each parameter over ``process_group`` in backward (a tensor hook, so
    ``.grad`` accumulates the sum; on every rank, in the same order). For parameters applied to
    token-sharded activations in sequence parallelism (a norm before ``AllGather``, a bias after
    ``ReduceScatter``): each rank's gradient covers only its tokens. Sets
    ``param.sequence_parallel = True``. Returns the hook handles (``handle.remove()`` undoes one).
    Such parameters must have ``requires_grad`` and receive their gradient through autograd
    (biases and norm weights always do)."""
    ref = GroupRef("mark_sequence_parallel", process_group)
    items = list(params.parameters()) if isinstance(params, torch.nn.Module) else list(params)
    handles = []
    for p in items:
        p.sequence_parallel = True
        if ref.size > 1:
            handles.append(p.register_hook(lambda g, ref=ref: all_reduce_sum(g, ref)))
    return handles
