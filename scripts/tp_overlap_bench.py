"""Tensor-parallel MLP on NCCL (issues 14 and 15): the comm-overlap rules against the same block with
them disabled (collective, then GEMM), against the communication alone and against the unsharded
block on one GPU, forward + backward, same run.

Run on 2+ GPUs: ``torchrun --nproc-per-node N scripts/tp_overlap_bench.py [--t 16384 --h 8192
--f 28672 --act swiglu|gelu]`` (T = tokens of the whole sequence; each rank holds T / N, sequence
parallel). Rank 0 prints a markdown table: the slowest rank's median ms (CUDA events after
warm-up), TFLOP/s per GPU, and the fraction of the communication hidden:

* ``comm alone``: the block's four collectives of one step run back to back with no GEMM (forward
  all-gather of x and reduce-scatter of y, backward all-gather of dy and reduce-scatter of dx, each
  [T, H] on the gathered side), on the default stream;
* ``hidden = (no overlap - overlap) / comm alone``: the share of the communication time the
  overlapped plan takes off the serial one (1.0: all of it hidden, 0: none, < 0: slower);
* ``1 GPU``: the unsharded block (``tensor_parallel_mlp(..., None)``, T tokens) on rank 0 alone.
  ``vs 1 GPU`` is its time over the row's time (N is ideal).

It also prints the fusion plans and the largest output difference of the two plans.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from _timing import ms  # noqa: E402

import fusible_ops as fo  # noqa: E402
from fusible_ops.fusion_rules import comm_overlap  # noqa: E402
from fusible_ops.parallel import tensor_parallel_mlp  # noqa: E402

OVERLAP_RULES = tuple(r.name for r in comm_overlap.RULES)
BF = dict(device="cuda", dtype=torch.bfloat16)


def _act(name):
    return fo.GELU() if name == "gelu" else fo.SwiGLU()


def _slowest(t: float) -> float:
    v = torch.tensor([t], device="cuda")
    dist.all_reduce(v, op=dist.ReduceOp.MAX)
    return v.item()


def comm_alone(t_local: int, h: int, group) -> float:
    """Median ms of one step's four collectives (see the module doc), no compute."""
    world = dist.get_world_size(group)
    shard = torch.randn(t_local, h, **BF)
    full = torch.randn(t_local * world, h, **BF)
    gathered = torch.empty_like(full)
    scattered = torch.empty_like(shard)

    def step():
        for _ in range(2):  # forward pair, backward pair
            dist.all_gather_into_tensor(gathered, shard, group=group)
            dist.reduce_scatter_tensor(scattered, full, group=group)
    return ms(step)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--t", type=int, default=16384)
    p.add_argument("--h", type=int, default=8192)
    p.add_argument("--f", type=int, default=28672)
    p.add_argument("--act", choices=["gelu", "swiglu"], default="swiglu")
    a = p.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    torch.manual_seed(0)
    block = tensor_parallel_mlp(a.h, a.f, group, activation=_act(a.act), **BF)
    for op in block:
        if isinstance(op, (fo.AllGather, fo.ReduceScatter)):
            op.overlap = True  # opt in (the "no overlap" row disables the rules instead)
    x = torch.randn(a.t // world, a.h, **BF, requires_grad=True)
    dy = torch.randn_like(x)
    # fwd + bwd FLOPs of the whole block: fc1 (h -> f or 2f), fc2 (f -> h), 3 GEMMs each
    flops = 3 * 2 * a.t * a.h * a.f * (3 if a.act == "swiglu" else 2)
    plans = {}

    def step():
        block(x).backward(dy)

    rows = []
    for name in ("overlap", "no overlap"):
        ctx = fo.fusion_rules.disabled(*OVERLAP_RULES) if name == "no overlap" else torch.enable_grad()
        with ctx:
            plans[name] = [g["rule"] for g in block.fusion_plan("forward", x)]
            y = block(x).detach()
            rows.append((name, _slowest(ms(step)), y))
    diff = (rows[0][2].float() - rows[1][2].float()).abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    t_comm = _slowest(comm_alone(a.t // world, a.h, group))
    rows = [(n, t) for n, t, _ in rows]
    del block, x, dy, y
    torch.cuda.empty_cache()
    dist.barrier()
    one = float("nan")
    if rank == 0:  # the unsharded block on one GPU, the whole sequence
        torch.manual_seed(0)
        full = tensor_parallel_mlp(a.h, a.f, None, activation=_act(a.act), **BF)
        xf = torch.randn(a.t, a.h, **BF, requires_grad=True)
        dyf = torch.randn_like(xf)
        one = ms(lambda: full(xf).backward(dyf))
        del full, xf, dyf
        torch.cuda.empty_cache()
    dist.barrier()
    if rank == 0:
        print(f"TP MLP ({a.act}), T={a.t} H={a.h} F={a.f}, {world} ranks, sequence parallel, bf16, fwd+bwd, "
              f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
        print("| plan | ms (slowest rank) | TFLOP/s per GPU | vs no overlap | vs 1 GPU | comm hidden |")
        print("|---|---:|---:|---:|---:|---:|")
        t_no = rows[1][1]
        for name, t in rows:
            print(f"| TP={world}, {name} | {t:.3f} | {flops / world / t / 1e9:.0f} | {t_no / t:.2f}x | "
                  f"{one / t:.2f}x | {(t_no - t) / t_comm:.0%} |")
        print(f"| 1 GPU, unsharded | {one:.3f} | {flops / one / 1e9:.0f} | | 1.00x | |")
        print(f"| TP={world}, comm alone (2 all-gathers + 2 reduce-scatters of [{a.t}, {a.h}]) | {t_comm:.3f} | | | | |")
        print(f"forward plans: {plans}\nmax |output difference|: {diff.item():.3e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
