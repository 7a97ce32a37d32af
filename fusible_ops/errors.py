"""Checks of device values that must not sync the host (CUDA-graph capturable).

Two modes, chosen with :func:`set_device_checks` or the :func:`device_checks` context manager:

* ``"assert"`` (default): ``torch._assert_async``, or a kernel's own device assert where it checks
  the values itself (:func:`assert_mode`). A bad value fails loudly at the next
  synchronization, but a device-side assert ends the CUDA context: the process cannot go on.
* ``"flag"``: the check ORs into a small error flag on the device (and keeps the offending
  values); nothing fails until :func:`check_errors` (one host sync, when the caller chooses)
  raises a ``ValueError`` that names the op and the bad values, and clears the flags. The CUDA
  context survives, so a training loop can skip the batch. Kernels never read or write out of
  bounds on bad values in either mode.

Host tensors are checked on the host as they come (``ValueError`` at the call); under
``torch.compile`` the assert form is used.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

_MODES = ("assert", "flag")
_mode = ["assert"]
_lock = threading.Lock()
# (owner id, device) -> [owner description, message, flag int32 [1], last bad values]
_flags: dict[tuple, list] = {}


def set_device_checks(mode: str) -> str:
    """Set how device-side checks report (``"assert"`` or ``"flag"``). Returns the previous mode."""
    if mode not in _MODES:
        raise ValueError(f"device checks: mode must be one of {_MODES}, got {mode!r}")
    previous, _mode[0] = _mode[0], mode
    return previous


@contextlib.contextmanager
def device_checks(mode: str) -> Iterator[None]:
    """Use ``mode`` (``"assert"`` or ``"flag"``) for device-side checks inside the block."""
    previous = set_device_checks(mode)
    try:
        yield
    finally:
        set_device_checks(previous)


def assert_mode() -> bool:
    """Whether device-side checks report as device asserts (the ``"assert"`` mode): then a kernel
    may assert itself instead of handing a bool to :func:`device_check`."""
    return _mode[0] == "assert"


def device_check(owner, ok: torch.Tensor, values: torch.Tensor, message: str) -> None:
    """Check the 0-dim bool tensor ``ok`` without a host sync; ``values`` are what was checked
    (kept for the error report in flag mode); ``message`` says what must hold."""
    if _mode[0] == "assert" or torch.compiler.is_compiling():
        torch._assert_async(ok, message)
        return
    key = (id(owner), ok.device)
    entry = _flags.get(key)
    if entry is None or entry[3].shape != values.shape:
        with _lock:
            desc = f"{type(owner).__name__}({owner.extra_repr()})" if hasattr(owner, "extra_repr") else repr(owner)
            entry = [desc, message, torch.zeros(1, dtype=torch.int32, device=ok.device),
                     torch.zeros_like(values)]
            _flags[key] = entry
    bad = torch.logical_not(ok)
    entry[2].bitwise_or_(bad.to(torch.int32))
    entry[3].copy_(torch.where(bad, values, entry[3]))


def check_errors() -> None:
    """Raise ``ValueError`` if a flag-mode device check failed since the last call (one host
    sync per flagged op), naming each op and its bad values; clears the flags."""
    with _lock:
        entries = list(_flags.values())
    errors = []
    for desc, message, flag, values in entries:
        if int(flag.item()):
            errors.append(f"{desc}: {message}; got {values.tolist()}")
            flag.zero_()
    if errors:
        raise ValueError("device-side check failed:\n  " + "\n  ".join(errors))
