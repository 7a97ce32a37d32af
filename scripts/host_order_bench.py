"""Does ours' host time depend on what runs between two of ours? (CUDA)

Per ``host_overhead`` workload (forward + backward, host us to issue one call, the device synced
before each call, the process pinned to one CPU core), ours against plain PyTorch (torch.nn; the
grouped MLP: the ``torch._grouped_mm`` composition) timed

* alone: each function in a loop of its own calls;
* in turns with the other (``host_times_interleaved``: one call of each per round, the order
  rotating), and with the bare functional form as a third (``host_overhead``'s order);
* cold: other Python work (a walk over ~12 MB of objects, standing in for a model's other layers)
  before every call, not timed.

On the H100 host of 2026-11-25 SwiGLU's ours / torch.nn was 1.14x timed in turns with torch.nn
alone and 1.30-1.37x in ``host_overhead``'s three-way order (see BENCHMARKS.md).

    PYTHONPATH=. python3 scripts/host_order_bench.py [--rep 200]
"""
import argparse
import os
import statistics
import time

import torch

from fusible_ops.bench.host import _workloads, host_times_interleaved

_OTHER = [str(i) for i in range(200_000)]  # ~12 MB of Python objects: more than a core's L2


def _cold_us(fn, dev, warmup: int, rep: int) -> float:
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rep", type=int, default=200)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    dev = torch.device("cuda")
    torch.manual_seed(0)
    print("workload | alone: ours, peer, ratio | in turns: ratio | three-way: ratio | cold: ours, peer, ratio")
    for name, _, ours, oargs, peer, pargs, dy, functional in _workloads(dev, torch.bfloat16, False):
        o = lambda: ours(*oargs).backward(dy)  # noqa: E731
        p = lambda: peer(*pargs).backward(dy)  # noqa: E731
        f = lambda: functional(*pargs).backward(dy)  # noqa: E731
        for _ in range(2):
            (ao,), (ap_,) = (host_times_interleaved([o], dev, 20, args.rep),
                             host_times_interleaved([p], dev, 20, args.rep))
            pair = host_times_interleaved([o, p], dev, 20, args.rep)
            three = host_times_interleaved([o, p, f], dev, 20, args.rep) if functional is not peer else None
            co, cp = _cold_us(o, dev, 20, args.rep), _cold_us(p, dev, 20, args.rep)
            r3 = f"{three[0][0] / three[1][0]:.2f}x" if three else "-"
            print(f"{name} | {ao[0]:.0f}, {ap_[0]:.0f}, {ao[0] / ap_[0]:.2f}x | {pair[0][0] / pair[1][0]:.2f}x | {r3} | "
                  f"{co:.0f}, {cp:.0f}, {co / cp:.2f}x", flush=True)
        del o, p, f, ours, peer, functional, oargs, pargs, dy


if __name__ == "__main__":
    main()
