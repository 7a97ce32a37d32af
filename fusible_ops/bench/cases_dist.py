"""Distributed cases, run under torchrun (NCCL, one process per GPU):
``torchrun --nproc-per-node 2 -m fusible_ops.bench tp_mlp ep_moe --out DIR``.

Every rank runs the same variants in the same order (each call holds collectives; the timer's
iteration counts are agreed over the ranks); rank 0 writes the rows, with its own times. Outside
torchrun (or on one rank) these cases yield nothing.

* ``tp_mlp``: a sequence-parallel tensor-parallel MLP (``tensor_parallel_mlp``: AllGather ->
  Linear -> SwiGLU -> BasicLinear -> ReduceScatter -> Bias), ``fused`` with the comm-overlap
  rules opted in against ``no_overlap`` (the same block with them disabled: collective, then
  GEMM). Work: the whole block's GEMM flops over the ranks (per-GPU TFLOP/s).
* ``ep_moe``: the MoE layer with ``Dispatch(ep_group=WORLD)`` (``E / ranks`` experts per GPU), each
  rank routing its own tokens, against ``single_gpu``: the same layer with all ``E`` experts on
  each GPU (the same weights: the EP ranks hold slices of them), which is what one GPU does for
  those tokens. Their outputs and input gradients agree, so ``fused`` is checked against it.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

import fusible_ops as fo

from .cases import CASES, Bench, BenchContext, Case
from .cases_moe import moe_sequential

TP_SHAPE = (16384, 8192, 28672)  # (tokens of the whole sequence, hidden, ffn)
EP_SHAPE = (24576, 1536, 256, 128, 8)  # per-rank tokens, hidden, expert ffn, experts, top_k


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def tp_mlp(ctx: BenchContext) -> Iterator[Bench]:
    if not distributed():
        return
    from fusible_ops.fusion_rules import comm_overlap
    from fusible_ops.parallel import tensor_parallel_mlp

    world = dist.get_world_size()
    T, H, Fd = (ctx.size(n, 64) for n in TP_SHAPE)
    torch.manual_seed(0)
    block = tensor_parallel_mlp(H, Fd, dist.group.WORLD, activation=fo.SwiGLU(), device=ctx.device, dtype=ctx.dtype)
    for op in block:
        if isinstance(op, (fo.AllGather, fo.ReduceScatter)):
            op.overlap = True  # opt in; no_overlap disables the rules
    rules = tuple(r.name for r in comm_overlap.RULES)

    def no_overlap(x):
        with fo.fusion_rules.disabled(*rules):
            return block(x)

    def new_copy():
        return (ctx.randn(T // world, H, requires_grad=True),), ctx.randn(T // world, H)

    yield Bench(
        case="tp_mlp", config=f"tp{world}", shape=f"T={T} H={H} F={Fd}, sequence parallel", dtype=ctx.dtype,
        metric="flops", work=3 * 2 * T * H * Fd * 3 / world, new_copy=new_copy,
        params=[p for p in block.parameters() if p.requires_grad], variants={"fused": block, "no_overlap": no_overlap},
        fused_module=block, plan_args=lambda inp: inp, expected_rules=("all_gather_linear",), baseline="no_overlap",
        notes={"fused": "comm-overlap rules opted in", "no_overlap": "the overlap rules disabled"},
    )


def ep_moe(ctx: BenchContext) -> Iterator[Bench]:
    if not distributed():
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    T, H, Fd, E, k = EP_SHAPE
    T, H, Fd = ctx.size(T, 32), ctx.size(H, 32), ctx.size(Fd, 32)
    factory = dict(device=ctx.device, dtype=ctx.dtype)
    torch.manual_seed(0)  # the same full layer on every rank
    full = moe_sequential(H, Fd, E, k, **factory)
    local = E // world
    ep = moe_sequential(H, Fd, E, k, ep_group=dist.group.WORLD, local=local, **factory)
    mine = slice(rank * local, (rank + 1) * local)
    with torch.no_grad():
        ep[0].weight.copy_(full[0].weight)
        for i in (2, 4):
            ep[i].weight.copy_(full[i].weight[mine])
    torch.manual_seed(1 + rank)  # each rank its own tokens

    def new_copy():
        return (ctx.randn(T, H, requires_grad=True),), ctx.randn(T, H)

    yield Bench(
        case="ep_moe", config=f"ep{world}", shape=f"T={T} per GPU, H={H} F={Fd} E={E} k={k}", dtype=ctx.dtype,
        metric="flops", work=18 * T * k * H * Fd, new_copy=new_copy, params=[],
        variants={"fused": lambda x: ep(x)[0], "single_gpu": lambda x: full(x)[0]}, fused_module=ep,
        plan_args=lambda inp: inp, expected_rules=(), baseline="single_gpu",
        notes={"fused": f"expert parallel, {local} experts per GPU", "single_gpu": f"all {E} experts on each GPU"},
    )


DIST_CASES = ("tp_mlp", "ep_moe")
CASES.update({  # (registered into the harness's catalogue when fusible_ops.bench is imported)
    "tp_mlp": Case("torchrun only: tensor-parallel MLP, comm-overlap rules vs none; "
                   "T=%d H=%d F=%d" % TP_SHAPE, tp_mlp),
    "ep_moe": Case("torchrun only: expert-parallel MoE layer vs all experts on each GPU; "
                   "T=%d per GPU H=%d F=%d E=%d k=%d" % EP_SHAPE, ep_moe),
})
