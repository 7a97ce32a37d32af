"""What fusible_ops keeps between training steps, as checkpoint state (see docs/training.md).

Everything the library keeps between steps that changes results after a resume is a plain tensor
in the ``state_dict()`` of the module that owns it: FP8 delayed-scaling buffers
(``fp8_amax_history``, ``fp8_scale``), a router's ``expert_bias`` and ``expert_load``. No
``get_extra_state``, no pickled Python objects: a checkpoint loads with
``torch.load(weights_only=True)``, stores in safetensors and saves and loads with
``torch.distributed.checkpoint``.

Format version. A module holding such state has one more buffer, ``_fusible_ops_format``
(:data:`FORMAT_KEY`): an int64 scalar holding :data:`FORMAT_VERSION`, created with that state.
``load_state_dict`` checks the checkpoint's entry and raises a ``RuntimeError`` naming the module
for a version newer than this library reads; a checkpoint without the entry (``torch.nn.Linear``
checkpoints, checkpoints written before the entry existed) is read as it is. Modules that hold no
such state (a ``Linear`` that never ran delayed scaling) have no entry, so their keys are exactly
``torch.nn``'s.

Versions: 1: the first versioned format (a weight's ``fp8_amax_history`` column holds its amax
at its last cast as the newest entry, not rolled; its older entries are never read).

The RNG the ops draw from (``Dropout``'s seeds) is torch's default generators: :func:`rng_state`
and :func:`set_rng_state` save and restore them as plain tensors.
"""

from __future__ import annotations

from typing import Optional

import torch

FORMAT_VERSION = 1
"""The version of the library state this fusible_ops writes (and the newest it reads)."""

FORMAT_KEY = "_fusible_ops_format"
"""The state-dict entry (after the module's prefix) that holds a module's format version."""


def check_format(version: torch.Tensor, where: str) -> int:
    """The format version in ``version`` (a one-element tensor holding an integer: a state dict
    converted as a whole, e.g. ``{k: v.double()}``, may have made it floating point), checked: a
    version newer than :data:`FORMAT_VERSION` (or a malformed entry) raises a ``RuntimeError``
    naming ``where``."""
    value = version.item() if isinstance(version, torch.Tensor) and version.numel() == 1 else None
    if value is None or value != int(value):
        raise RuntimeError(f"{where}: {FORMAT_KEY} must be a one-element tensor holding an integer, got {version!r}")
    v = int(value)
    if v > FORMAT_VERSION:
        raise RuntimeError(
            f"{where}: the checkpoint's fusible_ops state has format version {v}, newer than this fusible_ops "
            f"reads (version {FORMAT_VERSION}); load it with a newer fusible_ops"
        )
    return v


class VersionedStateMixin:
    """For modules that may hold library state: :meth:`_add_format_entry` (called when that state
    is created) registers the :data:`FORMAT_KEY` buffer, an int64 scalar holding
    :data:`FORMAT_VERSION` (a buffer, so that every state-dict key is an attribute, as
    ``torch.distributed.checkpoint.state_dict`` requires). ``load_state_dict()`` checks the
    checkpoint's entry before anything is copied, reads a checkpoint without it as one written
    before it existed (not a missing key), and leaves the buffer at :data:`FORMAT_VERSION` (the
    state is this version's once loaded)."""

    def _add_format_entry(self, device=None) -> None:
        if self._buffers.get(FORMAT_KEY) is None:
            self.register_buffer(FORMAT_KEY, torch.tensor(FORMAT_VERSION, dtype=torch.int64, device=device))

    def _before_load(self, state_dict, prefix: str) -> None:
        """Called by ``load_state_dict`` after the version check, before the tensors are copied."""

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + FORMAT_KEY
        version = state_dict.get(key)
        if version is not None:
            check_format(version, f"{type(self).__name__} ({prefix.rstrip('.') or 'the root module'})")
        self._before_load(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if key in missing_keys:
            missing_keys.remove(key)
        mine = self._buffers.get(FORMAT_KEY)
        if mine is not None:
            with torch.no_grad():
                mine.fill_(FORMAT_VERSION)


def rng_state(cuda: Optional[bool] = None) -> dict[str, torch.Tensor]:
    """The default generators' states as plain uint8 tensors: ``"cpu"`` and, with ``cuda`` (None:
    when CUDA is initialized), ``"cuda:<i>"`` per device. Save it with the checkpoint; restore with
    :func:`set_rng_state`. (Python's and NumPy's generators, which fusible_ops does not use, are
    the caller's.)"""
    out = {"cpu": torch.get_rng_state()}
    if cuda is None:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"cuda:{i}"] = s
    return out


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    """Restore the generators saved by :func:`rng_state` (every device in ``state``)."""
    for name, s in state.items():
        if name == "cpu":
            torch.set_rng_state(s.cpu())
        elif name.startswith("cuda:"):
            torch.cuda.set_rng_state(s.cpu(), int(name.split(":", 1)[1]))
        else:
            raise KeyError(f"set_rng_state: unknown generator {name!r} (expected 'cpu' or 'cuda:<i>')")


__all__ = ["FORMAT_KEY", "FORMAT_VERSION", "VersionedStateMixin", "check_format", "rng_state", "set_rng_state"]
