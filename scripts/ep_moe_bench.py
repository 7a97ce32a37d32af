"""Expert-parallel MoE layer on NCCL (issue 15): ``Router -> Dispatch(ep_group) -> GroupedLinear ->
SwiGLU -> GroupedLinear -> Combine`` with E / N experts per rank, against the same layer with all E
experts on one GPU, and against the exchange's communication alone; forward + backward, bf16.

Run on 2+ GPUs: ``torchrun --nproc-per-node N scripts/ep_moe_bench.py [--t 24576 --h 1536 --f 256
--e 128 --k 8]`` (issue 13's first MoE shape). Every rank routes its own T tokens (data parallel
over tokens, expert parallel over experts), so each GPU does the FLOPs of the one-GPU layer on T
tokens: ``vs 1 GPU`` is the one-GPU time over the EP time per step (1.0 means EP costs nothing;
the EP job processes N times the tokens). Rank 0 prints a markdown table: the slowest rank's
median ms (CUDA events after warm-up), TFLOP/s per GPU (expert GEMMs, 18 * T * k * H * F per
step), and:

* ``comm alone``: one step's four token exchanges (forward Dispatch and Combine, backward their
  adjoints), each an ``all_to_all_single`` of [T * k, H] bf16 rows with even splits, back to back
  with no compute; the layer's plan exchange and host sync are not in it;
* ``hidden = 1 - (EP - 1 GPU) / comm alone``: the share of the communication time the EP step does
  not add on top of the one-GPU step (0: fully exposed; the exchange is not overlapped today).
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from _timing import ms  # noqa: E402
from moe_layer_bench import BF, ours as layer  # noqa: E402


def step_fn(seq, x, dy):
    def step():
        y, aux = seq(x)
        torch.autograd.backward((y, aux), (dy, torch.ones_like(aux)))
    return step


def slowest(t: float) -> float:
    v = torch.tensor([t], device="cuda")
    dist.all_reduce(v, op=dist.ReduceOp.MAX)
    return v.item()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--t", type=int, default=24576)
    p.add_argument("--h", type=int, default=1536)
    p.add_argument("--f", type=int, default=256)
    p.add_argument("--e", type=int, default=128)
    p.add_argument("--k", type=int, default=8)
    a = p.parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    flops = 18 * a.t * a.k * a.h * a.f
    torch.manual_seed(rank)  # each rank its own tokens and expert weights
    x = torch.randn(a.t, a.h, **BF, requires_grad=True)
    dy = torch.randn(a.t, a.h, **BF)
    ep = layer(a.h, a.f, a.e, a.k, group, a.e // world)
    t_ep = slowest(ms(step_fn(ep, x, dy), n=10))
    rows_sent = a.t * a.k
    send = torch.randn(rows_sent - rows_sent % world, a.h, **BF)
    recv = torch.empty_like(send)

    def exchanges():
        for _ in range(4):
            dist.all_to_all_single(recv, send, group=group)
    t_comm = slowest(ms(exchanges, n=10))
    del ep, send, recv
    torch.cuda.empty_cache()
    dist.barrier()
    if rank == 0:
        one = ms(step_fn(layer(a.h, a.f, a.e, a.k), x, dy), n=10)
        print(f"MoE layer T={a.t} tokens per GPU, H={a.h} F={a.f} E={a.e} top-{a.k}, bf16, fwd+bwd, "
              f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
        print("| run | ms (slowest rank) | TFLOP/s per GPU | vs 1 GPU | comm hidden |\n|---|---:|---:|---:|---:|")
        print(f"| EP={world} ({a.e // world} experts per GPU) | {t_ep:.3f} | {flops / t_ep / 1e9:.0f} | "
              f"{one / t_ep:.2f}x | {1 - (t_ep - one) / t_comm:.0%} |")
        print(f"| 1 GPU, all {a.e} experts | {one:.3f} | {flops / one / 1e9:.0f} | 1.00x | |")
        print(f"| EP={world}, comm alone (4 all-to-alls of [{rows_sent}, {a.h}]) | {t_comm:.3f} | | | |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
