"""Extra inputs by name: how a :class:`~fusible_ops.Sequential` maps ``seq(x, residual=r)`` onto
positions.

Each basic op names its extra inputs (``BasicOperation.extra_input_names``; default
``extra_input`` / ``extra_input_0``, ...). A Sequential's :class:`NameTable` lists every extra input
it takes, in positional order, under that name; a name that several ops share is suffixed with its
occurrence index (``residual_0``, ``residual_1``) and the plain name is refused as ambiguous. The
table depends only on the modules: the Sequential builds it once and keeps it until they change.
"""

from __future__ import annotations

import difflib
from collections import Counter
from typing import Iterable, Optional

_MISSING = object()  # an extra input not given (yet), while placing named ones


def op_input_names(op, n: int) -> tuple[str, ...]:
    """The names of ``op``'s ``n`` extra inputs: its ``extra_input_names``, or when it names none
    ``extra_input`` (one) / ``extra_input_0``, ``extra_input_1``, ... (several)."""
    names = tuple(getattr(op, "extra_input_names", ()) or ())
    if not names:
        return ("extra_input",) if n == 1 else tuple(f"extra_input_{i}" for i in range(n))
    if len(names) != n:
        raise TypeError(f"{type(op).__name__}.extra_input_names has {len(names)} name(s) for its {n} extra "
                        f"input(s): {names}")
    return names


def _s(n: int) -> str:
    return "" if n == 1 else "s"


class NameTable:
    """The extra inputs of one Sequential: ``names`` (accepted names, positional order), ``pos``
    (name -> position), ``who`` (``"OpClass, module i"`` per position) and ``shared`` (a plain name
    several ops share -> its suffixed names)."""

    __slots__ = ("names", "pos", "who", "shared")

    def __init__(self, entries: Iterable[tuple]) -> None:
        """``entries``: ``(op, number of extra inputs the caller gives it, module index)`` per basic op."""
        base, who = [], []
        for op, n, module in entries:
            for name in op_input_names(op, n) if n else ():
                base.append(name)
                who.append(f"{type(op).__name__}, module {module}")
        counts, seen, names, shared = Counter(base), Counter(), [], {}
        for b in base:
            name = b
            if counts[b] > 1:
                name = f"{b}_{seen[b]}"
                seen[b] += 1
                shared.setdefault(b, []).append(name)
            names.append(name)
        if len(set(names)) != len(names):
            raise TypeError(f"Sequential: its ops' extra input names collide: {names} (rename one op's "
                            f"extra_input_names, or pass the extra inputs positionally)")
        self.names, self.who, self.shared = tuple(names), tuple(who), shared
        self.pos = {n: i for i, n in enumerate(names)}

    def listing(self, positions: Optional[Iterable[int]] = None) -> str:
        """``"residual (AddExtraInput, module 4), ..."`` for ``positions`` (default: all)."""
        positions = range(len(self.names)) if positions is None else positions
        return ", ".join(f"{self.names[i]} ({self.who[i]})" for i in positions)

    def count_error(self, got: int) -> str:
        """The message for a call with ``got`` extra inputs instead of ``len(names)``."""
        need = len(self.names)
        if need == 0:
            return f"Sequential expected 0 extra inputs after x, got {got}: none of its ops takes one"
        return (f"Sequential expected {need} extra input{_s(need)} after x, got {got}. It takes, in this order "
                f"(positionally or by name): {self.listing()}")

    def unknown(self, k: str) -> str:
        """The message for a keyword that names no extra input."""
        if k in self.shared:
            return (f"Sequential: extra input name {k!r} is shared by {len(self.shared[k])} ops "
                    f"({'; '.join(self.who[self.pos[n]] for n in self.shared[k])}): pass "
                    f"{', '.join(n + '=' for n in self.shared[k])} (in op order), or the extra inputs positionally")
        if not self.names:
            return f"Sequential got an unexpected keyword argument {k!r}: none of its ops takes an extra input"
        close = difflib.get_close_matches(k, self.names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"Sequential got an unexpected keyword argument {k!r}{hint}; it takes: {self.listing()}"

    def place(self, extra_inputs: tuple, named: dict) -> tuple:
        """The extra inputs in positional order: ``extra_inputs`` fill the first positions, ``named``
        the others by name. Raises ``TypeError`` (naming the ops and their inputs) for an unknown
        name, a value given both positionally and by name, too many or missing extra inputs."""
        names, pos = self.names, self.pos
        for k in named:
            if k not in pos:
                raise TypeError(self.unknown(k))
        if len(extra_inputs) > len(names):
            raise TypeError(self.count_error(len(extra_inputs) + len(named)))
        out = list(extra_inputs) + [_MISSING] * (len(names) - len(extra_inputs))
        for k, v in named.items():
            i = pos[k]
            if i < len(extra_inputs):
                raise TypeError(f"Sequential got two values for extra input {k!r} ({self.who[i]}): one "
                                f"positionally (extra input {i} after x) and one by name")
            out[i] = v
        missing = [i for i, v in enumerate(out) if v is _MISSING]
        if missing:
            raise TypeError(f"Sequential expected {len(names)} extra input{_s(len(names))} after x, got "
                            f"{len(extra_inputs) + len(named)}: missing {self.listing(missing)}")
        return tuple(out)
