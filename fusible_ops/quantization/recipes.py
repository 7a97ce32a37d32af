"""FP8 recipes and ``autocast``: which tensors are quantized, how their scales are chosen.

A recipe is a frozen (hashable) dataclass: it is part of every fuser's plan key, so entering or
leaving an ``autocast`` block with another recipe replans once and then runs from the cache.

Formats. ``fp8_format="hybrid"`` (the default) quantizes forward tensors (inputs, weights) to
E4M3 and gradients to E5M2; ``"e4m3"`` uses E4M3 for everything. :class:`Float8BlockScaling`
is E4M3 throughout.

Roles. Every quantized tensor has a role: ``"input"`` (an FP8 GEMM's activation operand),
``"weight"`` and ``"grad_output"`` (the gradient entering a linear's backward).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional

import torch

FP8_FORMATS = ("hybrid", "e4m3")
ROLES = ("input", "weight", "grad_output")
E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}


def _check_format(name: str, fmt: str) -> None:
    if fmt not in FP8_FORMATS:
        raise ValueError(f"{name}: fp8_format must be one of {FP8_FORMATS}, got {fmt!r}")


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling:
    """One scale per tensor from its current absolute maximum: ``scale = fp8_max / amax``
    (amax 0 gives scale 1). Needs one reduction over the tensor before its cast."""

    fp8_format: str = "hybrid"

    def __post_init__(self) -> None:
        _check_format("Float8CurrentScaling", self.fp8_format)


@dataclasses.dataclass(frozen=True)
class Float8DelayedScaling:
    """Scales from a history of absolute maxima, kept per op and role on the device.

    Each quantization of a role first turns the history into the scale it uses
    (``amax = max(history)`` for ``amax_compute_algo="max"``, or the latest entry for
    ``"most_recent"``; ``scale = fp8_max / amax / 2**margin``; an empty history gives scale 1),
    then records the tensor's own amax as the newest entry (the oldest falls out after
    ``amax_history_len`` entries). Everything runs on the device: no host sync. Weights are cast
    once per change of the weight (the weight cache), so their scale comes from their current
    amax, written as the newest entry of the weight column without rolling it (the recorded
    state is a function of the weight alone). The state is in the state dict of the module
    owning the weight (buffers ``fp8_amax_history`` [history_len, 3] and ``fp8_scale`` [3];
    columns input, weight, grad_output).

    Only training calls record: a call made with grad mode off (``torch.no_grad()``) or with the
    op in eval mode (``model.eval()``) casts with the current ``fp8_scale`` (weights: their
    current amax) and changes no state, so evaluating does not change the training run.
    """

    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    margin: int = 0
    fp8_format: str = "hybrid"

    def __post_init__(self) -> None:
        _check_format("Float8DelayedScaling", self.fp8_format)
        if int(self.amax_history_len) < 1:
            raise ValueError(f"Float8DelayedScaling: amax_history_len must be >= 1, got {self.amax_history_len}")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(
                f"Float8DelayedScaling: amax_compute_algo must be 'max' or 'most_recent', got {self.amax_compute_algo!r}"
            )
        if int(self.margin) < 0:
            raise ValueError(f"Float8DelayedScaling: margin must be >= 0, got {self.margin}")


@dataclasses.dataclass(frozen=True)
class Float8BlockScaling:
    """The DeepSeek-V3 recipe: E4M3 throughout, one scale per 1x128 tile of activations and
    gradients (along the GEMM's reduction dim) and per 128x128 block of weights, each from that
    tile's own amax. ``power_of_two_scales=True`` rounds every scale down to a power of two."""

    power_of_two_scales: bool = False
    fp8_format: str = "e4m3"

    def __post_init__(self) -> None:
        if self.fp8_format != "e4m3":
            raise ValueError("Float8BlockScaling: the block recipe is E4M3 throughout (fp8_format='e4m3')")


RECIPES = (Float8CurrentScaling, Float8DelayedScaling, Float8BlockScaling)


def fp8_dtype(recipe, role: str) -> torch.dtype:
    """The FP8 dtype of ``role`` under ``recipe``: E5M2 for gradients under ``"hybrid"``."""
    return E5M2 if (role == "grad_output" and recipe.fp8_format == "hybrid") else E4M3


# ---- autocast

_STACK: list = [(None, None)]  # (recipe, amax_reduction_group); the innermost block is last


@contextlib.contextmanager
def autocast(recipe: Any = None, *, amax_reduction_group: Optional[Any] = None):
    """Turn FP8 on (``recipe`` one of :data:`RECIPES`) or off (``recipe=None``) for every
    :class:`~fusible_ops.Sequential` / fuser called inside the block. Blocks nest: the innermost
    wins, and leaving a block restores the outer setting.

    ``amax_reduction_group``: a ``torch.distributed`` process group over which amaxes are reduced
    (max), so every rank of it uses the same scales: delayed scaling's as soon as a cast records
    them (inputs and output gradients: the state is the same on every rank); current scaling's for every per-tensor cast (inputs, weights,
    output gradients: the backward of a call made inside the block reduces too), so the ranks cast
    as one process holding all their rows would, e.g. the expert-parallel group of a MoE layer.
    Each reduction is a collective: every rank must run the same casts in the same order.

    Raises ``TypeError`` for anything that is not a recipe instance.
    """
    if recipe is not None and not isinstance(recipe, RECIPES):
        names = ", ".join(c.__name__ for c in RECIPES)
        raise TypeError(f"fusible_ops.autocast: recipe must be None or an instance of {names}; got {recipe!r}")
    _STACK.append((recipe, amax_reduction_group))
    try:
        yield recipe
    finally:
        _STACK.pop()


@contextlib.contextmanager
def scope(state: tuple):
    """Re-enter a ``(recipe, amax_reduction_group)`` state saved from :func:`state` (the fuser's
    backward runs in its forward's amax reduction group)."""
    _STACK.append(state)
    try:
        yield
    finally:
        _STACK.pop()


def state() -> tuple:
    """The innermost ``(recipe, amax_reduction_group)``."""
    return _STACK[-1]


def current_recipe() -> Any:
    """The recipe of the innermost active :func:`autocast` block (``None``: FP8 off)."""
    return _STACK[-1][0]


def amax_reduction_group() -> Any:
    """The ``amax_reduction_group`` of the innermost active :func:`autocast` block."""
    return _STACK[-1][1]


__all__ = [
    "E4M3", "E5M2", "FP8_FORMATS", "FP8_MAX", "Float8BlockScaling", "Float8CurrentScaling", "Float8DelayedScaling",
    "RECIPES", "ROLES", "amax_reduction_group", "autocast", "current_recipe", "fp8_dtype",
]
