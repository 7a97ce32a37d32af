"""Kernel layer: Triton kernels, each beside a pure-torch ``*_ref`` twin.

Dispatch rule (one place, used by every kernel family):

* ``"auto"`` (default): CUDA tensors run Triton, CPU tensors run the ``*_ref``.
* ``"reference"``: always run the ``*_ref`` (useful to debug a fused op).
* ``"triton"``: always run Triton (except float64, the reference precision, which always
  runs the ``*_ref``). On CPU tensors this needs Triton's interpreter,
  i.e. ``TRITON_INTERPRET=1`` in the environment *before* ``triton`` is imported.
  CI uses it to exercise every kernel's indexing and masking on small shapes.

The mode is set with :func:`use` (a context manager) or, process-wide, with the
environment variable ``FUSIBLE_OPS_KERNELS`` (``auto`` | ``triton`` | ``reference``), read
when ``fusible_ops`` is imported.

This is a subpackage (``fusible_ops.kernels``), not a top-level ``kernels`` package,
so it never shadows the PyPI distribution named ``kernels``.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

_MODES = ("auto", "triton", "reference")
_F64 = torch.float64


class _State(threading.local):
    mode = None  # (a class default: reading it in a thread that never set it raises nothing)


_state = _State()

try:  # Triton is optional on platforms without it (macOS, Windows).
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    HAS_TRITON = False


def interpreter_enabled() -> bool:
    """True when Triton's CPU interpreter is on (``TRITON_INTERPRET=1``, which Triton itself
    reads when it is imported)."""
    return _INTERPRET


def _env_mode() -> str:
    mode = os.environ.get("FUSIBLE_OPS_KERNELS", "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"FUSIBLE_OPS_KERNELS={mode!r}; expected one of {_MODES}")
    return mode


# Read once at import (this sits on every kernel call's path); use() changes the mode at run time.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_ENV_MODE = _env_mode()


def current_mode() -> str:
    """The active dispatch mode: ``"auto"``, ``"triton"`` or ``"reference"``."""
    return _state.mode or _ENV_MODE


@contextlib.contextmanager
def use(mode: str):
    """Force a kernel backend inside the ``with`` block.

    ``use("triton")`` on CPU tensors requires ``TRITON_INTERPRET=1`` set before
    ``triton`` was imported; otherwise a clear ``RuntimeError`` is raised at the
    first kernel call.
    """
    if mode not in _MODES:
        raise ValueError(f"kernels.use({mode!r}): expected one of {_MODES}")
    previous = set_mode(mode)
    try:
        yield
    finally:
        _state.mode = previous


def set_process_mode(mode: str) -> str:
    """Set the process-wide default mode (what ``FUSIBLE_OPS_KERNELS`` set at import) and return
    the previous one. Unlike :func:`use`, which sets the calling thread's mode, this also reaches
    the threads autograd runs CUDA backwards in (a whole training run on one backend)."""
    global _ENV_MODE
    if mode not in _MODES:
        raise ValueError(f"kernels.set_process_mode({mode!r}): expected one of {_MODES}")
    previous, _ENV_MODE = _ENV_MODE, mode
    return previous


def set_mode(mode) -> object:
    """Set this thread's dispatch mode (``None``: back to the environment's) and return the previous
    setting, for a caller that restores it in a ``finally`` (:func:`use` without its context
    manager's host time; used on the fuser's per-call path)."""
    previous = _state.mode
    _state.mode = mode
    return previous


class InterpreterRequired(RuntimeError):
    """``kernels.use("triton")`` met CPU tensors while Triton's interpreter is off (it needs
    ``TRITON_INTERPRET=1`` set before triton is imported)."""


def use_triton(*tensors: torch.Tensor | None) -> bool:
    """Decide whether a kernel call on ``tensors`` runs Triton (True) or the ``*_ref``.

    All non-None tensors must be on one device (callers check that first). float64 is the
    reference precision: it always runs the ``*_ref`` (the kernels serve fp32/fp16/bf16).
    """
    mode = _state.mode or _ENV_MODE
    if mode == "reference":
        return False
    cuda = None
    for t in tensors:  # (a loop, not any(): this runs on every kernel call)
        if t is not None:
            if t.dtype is _F64:
                return False
            if cuda is None:
                cuda = t.is_cuda
    if mode == "auto":
        return HAS_TRITON and cuda is True
    # mode == "triton"
    if not HAS_TRITON:
        raise RuntimeError("fusible_ops.kernels.use('triton'): triton is not installed")
    if not cuda and not interpreter_enabled():
        raise InterpreterRequired(
            "fusible_ops.kernels.use('triton') on CPU tensors needs Triton's interpreter: "
            "set TRITON_INTERPRET=1 before importing triton"
        )
    return True


# Launch utilities live in one module (re-exported here for the kernel families and users).
from fusible_ops.kernels.launch import TRITON_DTYPES, kernel_op, num_sms  # noqa: E402

__all__ = ["HAS_TRITON", "InterpreterRequired", "TRITON_DTYPES", "current_mode", "interpreter_enabled", "kernel_op", "num_sms", "set_mode",
           "set_process_mode", "use", "use_triton"]
