"""Timing of ``python -m fusible_ops.bench``: :class:`Timer` (CUDA events per call after warm-up,
optionally each call queued behind a GPU spin so the events time device work alone; host
``perf_counter`` on CPU), :class:`Timing` (median, p20, p80, host issue time) and the L2-rotation
count :func:`n_copies_for`. See :mod:`fusible_ops.bench.harness` for how cases use them.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Optional, Sequence

import torch

DEFAULT_L2_BYTES = 50 * 2**20  # H100: 50 MB
MAX_COPIES = 64
MIN_REP_ITERS_CUDA = 10
MIN_REP_ITERS_CPU = 3
MAX_ITERS = 10000


def percentile(sorted_vals: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` in [0, 100] of an ascending sequence."""
    if not sorted_vals:
        return float("nan")
    pos = (len(sorted_vals) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


@dataclasses.dataclass
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    n_iters: int
    host_ms: Optional[float] = None  # median host time to issue one call

    @classmethod
    def from_times(cls, times_ms: Sequence[float], host_ms: Optional[Sequence[float]] = None) -> "Timing":
        s = sorted(times_ms)
        host = percentile(sorted(host_ms), 50) if host_ms else None
        return cls(percentile(s, 50), percentile(s, 20), percentile(s, 80), len(s), host)


def n_copies_for(copy_bytes: int, device: torch.device, l2_bytes: Optional[int] = None) -> int:
    """Copies to rotate among: the rotated set exceeds 2x L2 (at least 2, at most MAX_COPIES)."""
    if device.type != "cuda":
        return 2
    l2 = l2_bytes if l2_bytes is not None else l2_cache_bytes(device)
    return int(min(MAX_COPIES, max(2, math.ceil(2 * l2 / max(copy_bytes, 1)))))


def l2_cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        l2 = getattr(props, "L2_cache_size", 0) or getattr(props, "l2_cache_size", 0)
        if l2:
            return int(l2)
    return DEFAULT_L2_BYTES


SPIN_MARGIN_MS = 0.05  # added to the spin of --queue-ahead beyond 3x the host issue time


class Timer:
    """Times ``fn(i)`` (``i`` = a running call counter, for rotating inputs). ``queue_ahead``
    (CUDA): each timed call waits on the device behind a spin that outlasts its host issue time,
    so the events time the device work alone."""

    def __init__(self, device: torch.device, warmup_ms: float, rep_ms: float, queue_ahead: bool = False,
                 agree: Optional[Callable[[int, int], tuple[int, int]]] = None) -> None:
        """``agree(n_warm, n_rep)``: the counts every rank of a distributed run uses (their maximum),
        so that calls holding collectives stay matched across ranks."""
        self.device = device
        self.agree = agree
        self.warmup_ms = float(warmup_ms)
        self.rep_ms = float(rep_ms)
        self.queue_ahead = bool(queue_ahead) and device.type == "cuda"
        self._i = 0
        self._cycles_per_ms: Optional[float] = None

    def spin_cycles_per_ms(self) -> float:
        """GPU clock cycles of ``torch.cuda._sleep`` per millisecond, measured once."""
        if self._cycles_per_ms is None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            cycles = 10**7
            torch.cuda._sleep(cycles)  # (warm: clocks up, module loaded)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            self.sync()
            self._cycles_per_ms = cycles / max(start.elapsed_time(end), 1e-3)
        return self._cycles_per_ms

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _call(self, fn: Callable[[int], Any]) -> None:
        fn(self._i)
        self._i += 1

    def time(self, fn: Callable[[int], Any]) -> Timing:
        if self.device.type == "cuda":
            return self._time_cuda(fn)
        return self._time_cpu(fn)

    def _counts(self, est_ms: float, min_rep: int) -> tuple[int, int]:
        est_ms = max(est_ms, 1e-4)
        n_warm = int(min(MAX_ITERS, max(1, round(self.warmup_ms / est_ms))))
        n_rep = int(min(MAX_ITERS, max(min_rep, round(self.rep_ms / est_ms))))
        return n_warm, n_rep

    def _time_cuda(self, fn) -> Timing:
        self._call(fn)  # JIT / autotune / compile already happened in the check; one more to be sure
        self.sync()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        n_est = 3
        start.record()
        t0 = time.perf_counter()
        for _ in range(n_est):
            self._call(fn)
        host_est = (time.perf_counter() - t0) * 1e3 / n_est
        end.record()
        self.sync()
        est = start.elapsed_time(end) / n_est
        spin = 0
        if self.queue_ahead:  # the spin covers the issue of the events and the call
            spin_ms = 3 * host_est + SPIN_MARGIN_MS
            spin = int(spin_ms * self.spin_cycles_per_ms())
            est += spin_ms
        n_warm, n_rep = self._counts(est, MIN_REP_ITERS_CUDA)
        if self.agree is not None:
            n_warm, n_rep = self.agree(n_warm, n_rep)
        for _ in range(n_warm):
            self._call(fn)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
        host = [0.0] * n_rep
        clock = time.perf_counter
        for k in range(n_rep):
            if spin:
                torch.cuda._sleep(spin)
            starts[k].record()
            t0 = clock()
            self._call(fn)
            host[k] = (clock() - t0) * 1e3
            ends[k].record()
        self.sync()
        return Timing.from_times([s.elapsed_time(e) for s, e in zip(starts, ends)], host)

    def _time_cpu(self, fn) -> Timing:
        t0 = time.perf_counter()
        self._call(fn)
        est = (time.perf_counter() - t0) * 1e3
        n_warm, n_rep = self._counts(est, MIN_REP_ITERS_CPU)
        if self.agree is not None:
            n_warm, n_rep = self.agree(n_warm, n_rep)
        for _ in range(n_warm):
            self._call(fn)
        times = []
        for _ in range(n_rep):
            t0 = time.perf_counter()
            self._call(fn)
            times.append((time.perf_counter() - t0) * 1e3)
        return Timing.from_times(times, times)


__all__ = ["MAX_COPIES", "SPIN_MARGIN_MS", "Timer", "Timing", "l2_cache_bytes", "n_copies_for", "percentile"]
