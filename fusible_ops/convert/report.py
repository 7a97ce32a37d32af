"""The report of a conversion: every module converted (its name, what it was, what it became) and
every candidate left alone (with the reason). ``fo.convert`` attaches it to the model as
``model.fusible_ops_report`` and prints it with ``verbose=True``."""

from __future__ import annotations

import dataclasses
from collections import Counter


@dataclasses.dataclass(frozen=True)
class Entry:
    """One module: ``name`` (its path in the model, ``""`` for the model itself), ``source`` (its
    class), ``into`` (what replaced it; ``""`` when left alone) and ``reason`` (why it was left alone)."""

    name: str
    source: str
    into: str = ""
    reason: str = ""

    @property
    def converted(self) -> bool:
        return not self.reason


@dataclasses.dataclass
class ConversionReport:
    """What :func:`fusible_ops.convert` did. ``converted`` and ``left_alone`` are lists of
    :class:`Entry`; ``str(report)`` is the text ``verbose=True`` prints."""

    converted: list = dataclasses.field(default_factory=list)
    left_alone: list = dataclasses.field(default_factory=list)
    recipe: object = None

    def add(self, name: str, source: str, into: str = "", reason: str = "") -> None:
        (self.left_alone if reason else self.converted).append(Entry(name, source, into, reason))

    def names(self, converted: bool = True) -> list:
        """The names of the converted modules (``converted=False``: of those left alone)."""
        return [e.name for e in (self.converted if converted else self.left_alone)]

    def __str__(self) -> str:
        lines = [f"fusible_ops.convert: {len(self.converted)} module(s) converted, {len(self.left_alone)} "
                 f"candidate(s) left alone" + (f"; FP8 recipe {type(self.recipe).__name__}" if self.recipe else "")]
        if self.converted:
            lines.append("converted:")
            by_what = Counter((e.source, e.into) for e in self.converted)
            for (source, into), n in by_what.items():
                names = [e.name or "(the model)" for e in self.converted if (e.source, e.into) == (source, into)]
                lines.append(f"  {source} -> {into}: {', '.join(collapse(names))}")
        if self.left_alone:
            lines.append("left alone:")
            for e in self.left_alone:
                lines.append(f"  {e.name or '(the model)'} ({e.source}): {e.reason}")
        return "\n".join(lines)


def collapse(names: list) -> list:
    """Names that differ in one number only, as one pattern: ``model.layers.{0-31}.mlp``
    (``{0,2,5}`` where the numbers are not a run), in first-seen order."""
    groups: dict = {}
    for name in names:
        parts = name.split(".")
        nums = [i for i, p in enumerate(parts) if p.isdigit()]
        key = (tuple(parts[:nums[-1]]) + ("#",) + tuple(parts[nums[-1] + 1:])) if nums else (name,)
        groups.setdefault(key, []).append(int(parts[nums[-1]]) if nums else None)
    out = []
    for key, nums in groups.items():
        if nums == [None] or len(nums) == 1:
            out.append(".".join(str(nums[0]) if p == "#" else p for p in key))
            continue
        run = nums == list(range(nums[0], nums[0] + len(nums)))
        label = "{" + (f"{nums[0]}-{nums[-1]}" if run else ",".join(map(str, nums))) + "}"
        out.append(".".join(label if p == "#" else p for p in key))
    return out


__all__ = ["ConversionReport", "Entry", "collapse"]
