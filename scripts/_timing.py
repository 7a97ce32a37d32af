"""Shared by the kernel scripts: CUDA-event median timing and the [16384, 16384] bf16 inputs."""
import statistics

import torch

M = N = 16384


def ms(f, n: int = 20) -> float:
    """Median device milliseconds of ``f()`` over ``n`` calls after 3 warm-up calls."""
    for _ in range(3):
        f()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = []
    for _ in range(n):
        s.record()
        f()
        e.record()
        e.synchronize()
        t.append(s.elapsed_time(e))
    return statistics.median(t)


def inputs():
    """(x, dy, bias, weight, out) at [M, N] bf16 on CUDA."""
    kw = dict(device="cuda", dtype=torch.bfloat16)
    x, dy = torch.randn(M, N, **kw), torch.randn(M, N, **kw)
    return x, dy, torch.randn(N, **kw), torch.rand(N, **kw) + 0.5, torch.empty_like(x)
