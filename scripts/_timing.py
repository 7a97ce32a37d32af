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


def queued_ms(f, n: int = 20, rounds: int = 7) -> float:
    """Device milliseconds per call of ``f()``: ``n`` calls queued behind a GPU spin between two
    events (so the host's launch time is hidden), median over ``rounds``, after 3 warm-up calls.
    Use it for kernels of ~0.1 ms, whose :func:`ms` reading (one call, synced) includes the host's
    time to launch them."""
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = []
    for _ in range(rounds):
        torch.cuda._sleep(2_000_000)
        s.record()
        for _ in range(n):
            f()
        e.record()
        e.synchronize()
        t.append(s.elapsed_time(e) / n)
    return statistics.median(t)


def inputs():
    """(x, dy, bias, weight, out) at [M, N] bf16 on CUDA."""
    kw = dict(device="cuda", dtype=torch.bfloat16)
    x, dy = torch.randn(M, N, **kw), torch.randn(M, N, **kw)
    return x, dy, torch.randn(N, **kw), torch.rand(N, **kw) + 0.5, torch.empty_like(x)
