"""Distributed cases, run under torchrun (NCCL, one process per GPU):
``torchrun --nproc-per-node 2 -m fusible_ops.bench tp_mlp ep_moe --out DIR``.

Every rank runs the same variants in the same order (each call holds collectives; the timer's
iteration counts are agreed over the ranks); rank 0 writes the rows, with its own times. Outside
torchrun (or on one rank) these cases yield nothing. With ``--device cpu`` the ranks join over gloo.
``fsdp_layers`` (:mod:`.cases_fsdp`, FSDP2 training steps) is launched the same way and runs at
one rank too.

* ``tp_mlp``: a sequence-parallel tensor-parallel MLP (``tensor_parallel_mlp``: AllGather ->
  Linear -> SwiGLU -> BasicLinear -> ReduceScatter -> Bias), ``fused`` with the comm-overlap
  rules opted in against ``no_overlap`` (the same block with them disabled: collective, then
  GEMM). Work: the whole block's GEMM flops over the ranks (per-GPU TFLOP/s).
* ``ep_moe``: the MoE layer with ``Dispatch(ep_group=WORLD)`` (``E / ranks`` experts per GPU), each
  rank routing its own tokens, against ``single_gpu``: the same layer with all ``E`` experts on
  each GPU (the same weights: the EP ranks hold slices of them), which is what one GPU does for
  those tokens. Their outputs and input gradients agree, so ``fused`` is checked against it.
  ``fused`` overlaps the all-to-alls with the experts (rule ``moe_ep_overlap``, the default
  ``ep_chunks``), ``no_overlap`` disables that rule, ``chunks_N`` sets ``ep_chunks=N``. Config
  ``ep{N}_comm`` times the step's four all-to-alls alone (``comm_alone``): the hidden fraction is
  ``(no_overlap - fused) / comm_alone`` (BENCHMARKS.md's Targets table). ``padded`` runs the
  exchange with no host read (``Dispatch(ep_exchange="padded")``), ``padded_graphed`` the same
  layer captured in a CUDA graph (GPUs only).
"""

from __future__ import annotations

import copy
from typing import Iterator

import torch
import torch.distributed as dist

import fusible_ops as fo

from .cases import CASES, Bench, BenchContext, Case, graphed
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
    from fusible_ops.ops.moe_ep import ExpertExchange

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
    default_chunks = ep[1].ep_chunks

    def new_copy():
        return (ctx.randn(T, H, requires_grad=True),), ctx.randn(T, H)

    def chunked(n):
        def call(x):
            ep[1].ep_chunks = n
            try:
                return ep(x)[0]
            finally:
                ep[1].ep_chunks = default_chunks
        return call

    def no_overlap(x):
        with fo.fusion_rules.disabled("moe_ep_overlap"):
            return ep(x)[0]

    variants = {"fused": lambda x: ep(x)[0], "no_overlap": no_overlap, "single_gpu": lambda x: full(x)[0]}
    variants.update({f"chunks_{n}": chunked(n) for n in (2, 4, 8) if n != default_chunks})
    padded = copy.deepcopy(ep, {id(p): p for p in ep.parameters()})  # (the same weights)
    padded[1].ep_exchange, padded[1].ep_chunks = "padded", 1
    variants["padded"] = lambda x: padded(x)[0]
    variants.update({f"padded_{name}": fn for name, fn in graphed(ctx, padded, lambda inp: inp).items()})
    notes = {"fused": f"expert parallel, {local} experts per GPU, all-to-alls overlapped in {default_chunks} chunks",
             "no_overlap": "the same, rule moe_ep_overlap disabled (exchange, then the experts)",
             "single_gpu": f"all {E} experts on each GPU"}
    notes.update({f"chunks_{n}": f"overlapped in {n} chunks" for n in (2, 4, 8)})
    notes.update({"padded": "ep_exchange='padded': no host read, every peer sent a full capacity of rows, one chunk",
                  "padded_graphed": "the padded layer captured by fo.make_graphed_callables"})
    yield Bench(
        case="ep_moe", config=f"ep{world}", shape=f"T={T} per GPU, H={H} F={Fd} E={E} k={k}", dtype=ctx.dtype,
        metric="flops", work=18 * T * k * H * Fd, new_copy=new_copy, params=[], variants=variants, fused_module=ep,
        plan_args=lambda inp: inp, expected_rules=("moe_ep_overlap",), baseline="single_gpu", notes=notes,
    )

    # the exchange alone: the step's four all-to-alls (dispatch and combine, forward and backward)
    # with this layer's split sizes, for the hidden fraction (no_overlap - fused) / comm_alone
    x0 = ctx.randn(T, H)
    with torch.no_grad():
        ids = (x0.float() @ ep[0].weight.float().t()).topk(k, dim=-1).indices
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    ex = ExpertExchange.plan("ep_moe", ep[1].ep, counts, H, ctx.dtype)
    rows = ctx.randn(T * k, H)

    def comm_alone(_x):
        for _ in range(2):
            back = ex.to_experts(rows)
            out = ex.from_experts(back)
        return out

    yield Bench(
        case="ep_moe", config=f"ep{world}_comm", shape=f"{T * k} token copies x H={H} per GPU, 4 all-to-alls",
        dtype=ctx.dtype, metric="bytes", work=4 * T * k * H * rows.element_size(),
        new_copy=lambda: ((ctx.randn(T, H),), ctx.randn(T * k, H)), params=[], variants={"comm_alone": comm_alone},
        fused_module=None, plan_args=lambda inp: inp, baseline="comm_alone",
        notes={"comm_alone": "the four all-to-alls of one step with the layer's split sizes (bytes: rows sent per GPU)"},
    )


DIST_CASES = ("tp_mlp", "ep_moe", "fsdp_layers")  # (what a torchrun run without case names runs)
CASES.update({  # (registered into the harness's catalogue when fusible_ops.bench is imported)
    "tp_mlp": Case("torchrun only: tensor-parallel MLP, comm-overlap rules vs none; "
                   "T=%d H=%d F=%d" % TP_SHAPE, tp_mlp),
    "ep_moe": Case("torchrun only: expert-parallel MoE layer vs all experts on each GPU; "
                   "T=%d per GPU H=%d F=%d E=%d k=%d" % EP_SHAPE, ep_moe),
})
