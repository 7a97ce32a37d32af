"""Where the host time of a ``host_overhead`` workload goes (CUDA): per workload, the aten ops and
kernels one forward + backward issues (``torch.profiler``), ours and plain PyTorch; a cProfile of
ours (top functions by own time); and single-item host costs (allocation, a bare autograd
Function, each launcher alone), the process pinned to one CPU core.

    PYTHONPATH=. python3 scripts/host_profile.py [swiglu residual_rmsnorm ...]
"""
import cProfile
import itertools
import os
import pstats
import sys
import time

import torch

from fusible_ops.bench.host import _workloads


def _us(fn, n=200):
    """Median host us to issue one call (after 20 warm-up calls), the device synced before each."""
    for _ in range(20):
        fn()
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return sorted(ts)[n // 2] * 1e6


def _ops(fn, label, n=20):
    from torch.profiler import ProfilerActivity, profile
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
            torch.cuda.synchronize()
    ev = prof.key_averages()
    kernels = sum(e.count for e in ev if e.device_type == torch.autograd.DeviceType.CUDA) / n
    print(f"--- {label}: {kernels:.1f} device activities per call; CPU ops (calls per call, self CPU us per call):")
    rows = sorted((e for e in ev if e.device_type == torch.autograd.DeviceType.CPU),
                  key=lambda e: -e.self_cpu_time_total)
    for e in rows[:25]:
        print(f"    {e.key[:60]:60s} {e.count / n:5.1f} {e.self_cpu_time_total / n:8.1f}")


class _Id(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def _norms(dev, n=1024, m=16384):
    """Single LayerNorm / RMSNorm at [m, n] (the host-bound ``norm_sizes`` rows), the harness's
    call (``torch.autograd.grad``)."""
    import fusible_ops as fo
    kw = dict(device=dev, dtype=torch.bfloat16)
    x, dy = torch.randn(m, n, **kw, requires_grad=True), torch.randn(m, n, **kw)
    for kind in ("layernorm", "rmsnorm"):
        op = fo.LayerNorm(n, **kw) if kind == "layernorm" else fo.RMSNorm(n, **kw)
        ps = list(op.parameters())
        seq = fo.Sequential(op)
        peer = ((lambda x, w=op.weight, b=op.bias: torch.nn.functional.layer_norm(x, (n,), w, b, 1e-5))
                if kind == "layernorm" else (lambda x, w=op.weight: torch.nn.functional.rms_norm(x, (n,), w, 1e-5)))
        yield (f"{kind}_{n}", f"[{m}, {n}]", lambda s=seq, ps=ps: torch.autograd.grad(s(x), [x, *ps], dy),
               lambda f=peer, ps=ps: torch.autograd.grad(f(x), [x, *ps], dy))


def main() -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    names = sys.argv[1:] or ["swiglu", "residual_rmsnorm", "layernorm_1024", "rmsnorm_1024"]
    dev = torch.device("cuda")
    torch.manual_seed(0)
    # (a generator: each workload's modules and tensors are freed before the next one is made,
    # so each case is profiled inside the loop, while its workload is alive)
    cases = ((name, shape, (lambda ours=ours, a=oargs, dy=dy: ours(*a).backward(dy)),
              (lambda peer=peer, a=pargs, dy=dy: peer(*a).backward(dy)))
             for name, shape, ours, oargs, peer, pargs, dy, _ in _workloads(dev, torch.bfloat16, False))
    for name, shape, o, p in itertools.chain(cases, _norms(dev)):
        if name not in names:
            continue
        print(f"===== {name} {shape}: ours {_us(o):.0f} us, plain {_us(p):.0f} us (median host us per call, synced before each)")
        _ops(o, "ours")
        _ops(p, "plain")
        pr = cProfile.Profile()
        for _ in range(300):
            torch.cuda.synchronize()
            pr.enable()
            o()
            pr.disable()
        torch.cuda.synchronize()
        st = pstats.Stats(pr)
        st.sort_stats("tottime").print_stats(30)
    x = torch.randn(16384, 16384, device=dev, dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn_like(x, requires_grad=True)
    g = torch.randn_like(x)
    w = torch.ones(16384, device=dev, dtype=torch.bfloat16, requires_grad=True)
    from fusible_ops.kernels import norm as N
    items = {
        "empty_like [16384^2] bf16": lambda: torch.empty_like(x),
        "x.new_empty(16384, fp32)": lambda: x.new_empty(16384, dtype=torch.float32),
        "torch.empty(16384, dtype=fp32, device=x.device)": lambda: torch.empty(16384, dtype=torch.float32,
                                                                              device=x.device),
        "x.new_empty((4096, 2816))": lambda: x.new_empty((4096, 2816)),
        "torch.empty((4096, 2816), dtype=x.dtype, device=x.device)": lambda: torch.empty((4096, 2816), dtype=x.dtype,
                                                                                        device=x.device),
        "x + r (no grad)": lambda: x.detach() + r.detach(),
        "Function identity fwd+bwd": lambda: _Id.apply(x).backward(g),
        "x.view_as(x) fwd+bwd (C++ node)": lambda: x.view_as(x).backward(g),
        "_norm_fwd_launch (res)": lambda: N._norm_fwd_launch(x.detach(), w.detach(), None, 1e-5, r.detach(), True),
    }
    _, _, rstd, xsum = N._norm_fwd_launch(x.detach(), w.detach(), None, 1e-5, r.detach(), True)
    items["_norm_bwd_launch (dw)"] = lambda: N._norm_bwd_launch(g, xsum, w.detach(), rstd, rstd, True, False, None, True)
    items["F.rms_norm fwd (no grad)"] = lambda: torch.nn.functional.rms_norm(x.detach(), (16384,), w.detach(), 1e-5)
    for k, fn in items.items():
        fn()
        print(f"{k:58s} {_us(fn, n=200):8.1f} us")


if __name__ == "__main__":
    main()
