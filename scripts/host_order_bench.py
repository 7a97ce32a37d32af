"""Does ours' host time depend on which calls run between two of ours? (CUDA)

SwiGLU forward + backward, ours against the plain-PyTorch forms, timed in turns in different
sets (``host_times_interleaved``: one call of each per round, the order rotating), the process
pinned to one CPU core. On the H100 host of 2026-11-25 ours / torch.nn was 1.14x timed with
torch.nn alone and 1.30-1.37x in ``host_overhead``'s three-way order (see BENCHMARKS.md). Also
each alone (a single call timed in turns with itself), and each with cold caches (other Python
work before every call).

    PYTHONPATH=. python3 scripts/host_order_bench.py
"""
import os
import statistics
import time

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
        for combo in (("ours",), ("nn",), ("ours", "nn"), ("ours", "fn"), ("ours", "floor"), ("ours", "nn", "fn"),
                      ("ours", "nn", "fn", "floor"), ("ours", "floor", "fn")):
            for _ in range(2):
                ts = host_times_interleaved([calls[c] for c in combo], dev, 20, 200)
                print(f"[{m}, {n}] " + "  ".join(f"{c} {t[0]:.0f}" for c, t in zip(combo, ts)) + "  " +
                      "  ".join(f"ours/{c} {ts[0][0] / t[0]:.2f}" for c, t in zip(combo[1:], ts[1:])), flush=True)
        for _ in range(2):  # cold caches: other Python work (a model's other layers) before every call
            ts = [_cold_us(calls[c], dev) for c in ("ours", "nn")]
            print(f"[{m}, {n}] cold: ours {ts[0]:.0f}  nn {ts[1]:.0f}  ours/nn {ts[0] / ts[1]:.2f}", flush=True)


_OTHER = [str(i) for i in range(200_000)]  # ~12 MB of Python objects: more than the core's L2


def _cold_us(fn, dev, warmup: int = 20, rep: int = 200) -> float:
    """Median host us of ``fn()`` when the CPU's caches hold other work: before each call the device
    is synchronized and the process walks ``_OTHER`` (not timed)."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(rep):
        torch.cuda.synchronize(dev)
        sum(map(len, _OTHER))
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize(dev)
    return statistics.median(ts)


if __name__ == "__main__":
    main()
