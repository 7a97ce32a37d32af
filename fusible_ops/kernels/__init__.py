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
_state = threading.local()

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
    return getattr(_state, "mode", None) or _ENV_MODE


@contextlib.contextmanager
def use(mode: str):
    """Force a kernel backend inside the ``with`` block.

    ``use("triton")`` on CPU tensors requires ``TRITON_INTERPRET=1`` set before
    ``triton`` was imported; otherwise a clear ``RuntimeError`` is raised at the
    first kernel call.
    """
    if mode not in _MODES:
        raise ValueError(f"kernels.use({mode!r}): expected one of {_MODES}")
    previous = getattr(_state, "mode", None)
    _state.mode = mode
    try:
        yield
    finally:
        _state.mode = previous


def use_triton(*tensors: torch.Tensor | None) -> bool:
    """Decide whether a kernel call on ``tensors`` runs Triton (True) or the ``*_ref``.

    All non-None tensors must be on one device (callers check that first). float64 is the
    reference precision: it always runs the ``*_ref`` (the kernels serve fp32/fp16/bf16).
    """
    mode = current_mode()
    if mode == "reference":
        return False
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return False
    device = next((t.device for t in tensors if t is not None), torch.device("cpu"))
    if mode == "auto":
        return HAS_TRITON and device.type == "cuda"
    # mode == "triton"
    if not HAS_TRITON:
        raise RuntimeError("fusible_ops.kernels.use('triton'): triton is not installed")
    if device.type != "cuda" and not interpreter_enabled():
        raise RuntimeError(
            "fusible_ops.kernels.use('triton') on CPU tensors needs Triton's interpreter: "
            "set TRITON_INTERPRET=1 before importing triton"
        )
    return True


TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Dtypes the Triton kernels serve (float64, the reference precision, always runs the ``*_ref``)."""

_SM_COUNT: dict[int, int] = {}


def num_sms(device: torch.device, interpreter_programs: int = 2) -> int:
    """Multiprocessors of ``device`` (the tensor's own device; the current device when it has no
    index), cached per device. On CPU (Triton's interpreter) ``interpreter_programs``: a few
    programs, so persistent loops really loop on tiny test shapes."""
    if device.type != "cuda":
        return interpreter_programs
    idx = device.index if device.index is not None else torch.cuda.current_device()
    n = _SM_COUNT.get(idx)
    if n is None:
        n = _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return n


def kernel_op(name: str, *, mutates_args=()):
    """Register a launcher as the ``torch.library`` custom op ``name`` (so ``torch.compile``
    traces it through its fake implementation), and return a callable that runs the launcher
    DIRECTLY in eager mode: eager calls skip the custom-op dispatch (its Python wrapper costs
    far more host time than a Triton launch), traced calls go through the op.

    The returned callable has ``register_fake`` (decorator, as on the op) and ``op``.
    """

    def wrap(fn):
        op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
        is_compiling = torch.compiler.is_compiling

        def call(*args):
            return op(*args) if is_compiling() else fn(*args)

        call.op = op
        call.register_fake = op.register_fake
        call.__name__ = fn.__name__
        call.__doc__ = fn.__doc__
        return call

    return wrap


__all__ = ["HAS_TRITON", "TRITON_DTYPES", "current_mode", "interpreter_enabled", "kernel_op", "num_sms", "use",
           "use_triton"]
