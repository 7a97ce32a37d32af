"""Does ours' host time depend on which calls run between two of ours? (CUDA)

SwiGLU forward + backward, ours against the plain-PyTorch forms, timed in turns in different
sets (``host_times_interleaved``: one call of each per round, the order rotating), the process
pinned to one CPU core. On the H100 host of 2026-11-25 ours / torch.nn was 1.14x timed with
torch.nn alone and 1.30-1.37x in ``host_overhead``'s three-way order (see BENCHMARKS.md).

    PYTHONPATH=. python3 scripts/host_order_bench.py
"""
import os

import torch
import torch.nn.functional as F

import fusible_ops as fo
from fusible_ops.bench.host import _SwiGLU, host_times_interleaved
from host_floor_bench import Swi as _Floor  # (scripts/: the bare autograd Function issuing our SwiGLU kernels)


def _functional(x):
    a, b = x.chunk(2, -1)
    return F.silu(a) * b


def main() -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    dev = torch.device("cuda")
    for m, n in ((16384, 16384), (4096, 4096)):
        x = torch.randn(m, n, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n // 2, device=dev, dtype=torch.bfloat16)
        seq, mod = fo.Sequential(fo.SwiGLU()), _SwiGLU()
        calls = {"ours": lambda: seq(x).backward(dy), "nn": lambda: mod(x).backward(dy),
                 "fn": lambda: _functional(x).backward(dy), "floor": lambda: _Floor.apply(x).backward(dy)}
        for combo in (("ours", "nn"), ("ours", "fn"), ("ours", "floor"), ("ours", "nn", "fn"),
                      ("ours", "nn", "fn", "floor"), ("ours", "floor", "fn")):
            for _ in range(2):
                ts = host_times_interleaved([calls[c] for c in combo], dev, 20, 200)
                print(f"[{m}, {n}] " + "  ".join(f"{c} {t[0]:.0f}" for c, t in zip(combo, ts)) + "  " +
                      "  ".join(f"ours/{c} {ts[0][0] / t[0]:.2f}" for c, t in zip(combo[1:], ts[1:])), flush=True)


if __name__ == "__main__":
    main()
