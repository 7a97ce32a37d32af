"""Tensor-parallel MLP on NCCL (issue 14): the comm-overlap rules against the same block with them
disabled (collective, then GEMM), forward + backward, same run. Decides whether the rules should
stay on by default.

Run on 2+ GPUs: ``torchrun --nproc-per-node N scripts/tp_overlap_bench.py [--t 16384 --h 4096
--f 16384 --act gelu|swiglu]`` (T = tokens of the whole sequence; each rank holds T / N). Rank 0
prints a markdown table: the slowest rank's median ms (CUDA events after warm-up) and the largest
difference of the outputs of the two plans.
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--t", type=int, default=16384)
    p.add_argument("--h", type=int, default=4096)
    p.add_argument("--f", type=int, default=16384)
    p.add_argument("--act", choices=["gelu", "swiglu"], default="gelu")
    a = p.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    torch.manual_seed(0)
    act = fo.GELU() if a.act == "gelu" else fo.SwiGLU()
    block = tensor_parallel_mlp(a.h, a.f, group, activation=act, device="cuda", dtype=torch.bfloat16)
    for op in block:
        if isinstance(op, (fo.AllGather, fo.ReduceScatter)):
            op.overlap = True  # opt in (the "no overlap" row disables the rules instead)
    x = torch.randn(a.t // world, a.h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    plans = {}

    def step():
        block(x).backward(dy)

    rows = []
    for name in ("overlap", "no overlap"):
        ctx = fo.fusion_rules.disabled(*OVERLAP_RULES) if name == "no overlap" else torch.enable_grad()
        with ctx:
            plans[name] = [g["rule"] for g in block.fusion_plan("forward", x)]
            y = block(x).detach()
            t = torch.tensor([ms(step)], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        rows.append((name, t.item(), y))
    diff = (rows[0][2].float() - rows[1][2].float()).abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"TP MLP ({a.act}), T={a.t} H={a.h} F={a.f}, {world} ranks, bf16, fwd+bwd, "
              f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
        print("| plan | ms (slowest rank) | vs no overlap |\n|---|---:|---:|")
        for name, t, _ in rows:
            print(f"| {name} | {t:.3f} | {rows[1][1] / t:.2f}x |")
        print(f"forward plans: {plans}\nmax |output difference|: {diff.item():.3e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
