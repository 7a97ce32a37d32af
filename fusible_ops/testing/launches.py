"""Count the kernel launches a block of code issues, on any device (CPU included), and the Python
calls the host makes to issue them: per-step launch counts a test can hold without a GPU.

:func:`count_launches` counts, inside its block:

* **ATen ops** that launch device work: every op the dispatcher runs except views, allocations
  (``empty*``: no kernel) and metadata-only ops (``detach``, ``alias``, ``set_``, ...). On CUDA
  each of these is about one kernel launch; on CPU it is what the same call would issue there.
* **Triton launches**: every launch of a ``@triton.jit`` kernel, through Triton (compile, Triton's
  interpreter under ``TRITON_INTERPRET=1``) or directly from a cached binary
  (:class:`~fusible_ops.kernels.launch.DirectKernel`). ATen ops made inside a launch (the
  interpreter copies its arguments) are not counted.
* **Emulated ops**: functions that run as many ATen ops on CPU but as one launch on CUDA, counted
  as one launch each (default: ``fp8_gemm_ref``, the CPU emulation of ``torch._scaled_mm``).

To count what a CUDA step launches on a CPU machine, run the block under
``fusible_ops.kernels.use("triton")`` with Triton's interpreter on (``TRITON_INTERPRET=1`` before
triton is imported): the fused ops then take their Triton kernels as on CUDA, not their ``*_ref``
twins. :func:`count_python_calls` counts the Python function calls a block makes outside
launches and emulated ops: a deterministic proxy for host time.

Usage::

    with count_launches() as n:
        model(x).sum().backward()
    print(n.launches, n.summary())
"""

from __future__ import annotations

import collections
import contextlib
import sys
import traceback
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
_ALLOC = {_aten.empty.memory_format, _aten.empty_like.default, _aten.new_empty.default,
          _aten.empty_strided.default, _aten.new_empty_strided.default}
_NO_LAUNCH = _ALLOC | {_aten.detach.default, _aten.alias.default, _aten.lift_fresh.default, _aten.set_.source_Storage_storage_offset,
              _aten.set_.source_Tensor, _aten.set_.source_Storage, _aten._local_scalar_dense.default,
              _aten.is_same_size.default, _aten.is_nonzero.default}


class LaunchCounts:
    """What :func:`count_launches` saw. ``launches``: the total (ATen + Triton + emulated);
    ``aten``, ``triton``, ``emulated``: per-name counters; ``views`` and ``allocations``: the ATen
    views and allocations made (no launch, but host time: each goes through the dispatcher); ``sites`` (with ``where=True``): per
    ``(name, innermost fusible_ops frame)``; ``python_calls`` and, with ``where``, ``python_sites``
(per function): from :func:`count_python_calls`."""

    def __init__(self) -> None:
        self.aten: collections.Counter = collections.Counter()
        self.triton: collections.Counter = collections.Counter()
        self.emulated: collections.Counter = collections.Counter()
        self.views = 0
        self.allocations = 0
        self.sites: collections.Counter = collections.Counter()
        self.python_sites: collections.Counter = collections.Counter()
        self.python_calls = 0
        self._quiet = 0  # >0 inside a counted launch or emulated op: its own ATen ops are not counted
        self._where = False

    @property
    def launches(self) -> int:
        return sum(self.aten.values()) + sum(self.triton.values()) + sum(self.emulated.values())

    def _add(self, counter: collections.Counter, name: str) -> None:
        counter[name] += 1
        if self._where:
            self.sites[(name, _site())] += 1

    def summary(self, top: int = 12) -> str:
        """One line per kind, the most frequent names first."""
        def fmt(c):
            return ", ".join(f"{k} x{v}" for k, v in c.most_common(top)) or "-"
        return (f"{self.launches} launches: aten {sum(self.aten.values())} [{fmt(self.aten)}]; "
                f"triton {sum(self.triton.values())} [{fmt(self.triton)}]; "
                f"emulated {sum(self.emulated.values())} [{fmt(self.emulated)}]; "
                f"{self.views} views, {self.allocations} allocations")


def _site() -> str:
    """The innermost frame in fusible_ops (outside this module), as ``file:function``."""
    for f in reversed(traceback.extract_stack()[:-3]):
        if "fusible_ops" in f.filename and not f.filename.endswith(("launches.py", "launch.py")):
            return f"{f.filename.rsplit('fusible_ops/', 1)[-1]}:{f.name}"
    return "?"


class _Mode(TorchDispatchMode):
    def __init__(self, counts: LaunchCounts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        c = self.counts
        if not c._quiet:
            if getattr(func, "is_view", False):
                c.views += 1
            elif func in _ALLOC:
                c.allocations += 1
            elif func not in _NO_LAUNCH:
                c._add(c.aten, func.__name__ if func.namespace == "aten" else str(func))
        return func(*args, **(kwargs or {}))


def _counted(counts: LaunchCounts, counter: collections.Counter, name, fn):
    def wrapper(*args, **kwargs):
        if not counts._quiet:
            counts._add(counter, name(args) if callable(name) else name)
        counts._quiet += 1
        try:
            return fn(*args, **kwargs)
        finally:
            counts._quiet -= 1
    return wrapper


def _patches(counts: LaunchCounts, emulated: dict) -> list:
    """(owner, attribute, replacement) of each function wrapped while counting."""
    from ..kernels import HAS_TRITON
    from ..kernels import launch as _launch

    out = []
    for (owner, attr), label in emulated.items():
        out.append((owner, attr, _counted(counts, counts.emulated, label, getattr(owner, attr))))
    # direct launches of cached binaries (CUDA): entry[4] is the compiled kernel
    out.append((_launch, "_run_binary", _counted(
        counts, counts.triton, lambda a: str(getattr(a[0][4], "name", "?")),
        _launch._run_binary)))
    if HAS_TRITON:
        from triton.runtime import jit as _jit

        out.append((_jit.JITFunction, "run", _counted(counts, counts.triton, lambda a: a[0].fn.__name__,
                                                      _jit.JITFunction.run)))
        try:
            from triton.runtime import interpreter as _interp

            out.append((_interp.InterpretedFunction, "run", _counted(
                counts, counts.triton, lambda a: a[0].fn.__name__, _interp.InterpretedFunction.run)))
        except ImportError:  # pragma: no cover - older Triton
            pass
    return out


def _default_emulated() -> dict:
    from ..kernels import fp8_gemm

    return {(fp8_gemm, "fp8_gemm_ref"): "fp8_gemm (emulated _scaled_mm)"}


@contextlib.contextmanager
def _patched(counts: LaunchCounts, emulated: Optional[dict]):
    patches = _patches(counts, _default_emulated() if emulated is None else emulated)
    saved = [(owner, attr, owner.__dict__[attr]) for owner, attr, _ in patches]
    for owner, attr, fn in patches:
        setattr(owner, attr, fn)
    try:
        yield
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


@contextlib.contextmanager
def count_launches(*, where: bool = False, emulated: Optional[dict] = None):
    """Count the launches made inside the block (module doc); yields a :class:`LaunchCounts`.

    ``where``: also count per innermost fusible_ops frame (``counts.sites``: slower).
    ``emulated``: ``{(module_or_class, attribute): label}`` of functions counted as one launch each
    (their own ops not counted); default: the CPU FP8 GEMM emulation."""
    counts = LaunchCounts()
    counts._where = where
    with _patched(counts, emulated), _Mode(counts):
        yield counts


@contextlib.contextmanager
def count_python_calls(*, where: bool = False, emulated: Optional[dict] = None):
    """Count the Python function calls made inside the block, outside Triton launches and
    emulated ops (:func:`count_launches`' sense): a deterministic proxy for the host time of the
    block's Python path. Yields a :class:`LaunchCounts` whose ``python_calls`` holds the count
    (and ``triton`` / ``emulated`` the launches; ATen ops are not counted here: a dispatch mode
    would add Python calls of its own). ``where``: per function in ``python_sites``."""
    counts = LaunchCounts()
    profile = sys.getprofile()

    def tally(frame, event, arg):
        if event == "call" and not counts._quiet:
            code = frame.f_code
            if code.co_filename == __file__:  # (the counting wrappers' own frames)
                return
            counts.python_calls += 1
            if where:
                counts.python_sites[f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_name}"] += 1

    with _patched(counts, emulated):
        sys.setprofile(tally)
        try:
            yield counts
        finally:
            sys.setprofile(profile)


__all__ = ["LaunchCounts", "count_launches", "count_python_calls"]
