"""Declarative, scoped, explainable fusion rules.

A rule is data: a name, a pattern (an ordered list of matchers), a pass (``"forward"``,
``"backward"`` or ``"joint"``), an optional checker that may decline with a reason, a builder
that returns the :class:`~fusible_ops.op.FusedOperation`, and a priority. One shared matcher
(:func:`plan_pass`) applies a whole set of rules deterministically: highest priority first, then
the longest match, then the leftmost.

Rules live in a :class:`RuleSet`. The global set (:func:`global_rules`) holds the built-in rules
(data in :mod:`fusible_ops.fusion_rules`, installed by the package's ``__init__``, so this module
imports no rule family) and whatever users add with
:func:`register_fusion`. A ``Sequential(..., rules=rs)`` uses only ``rs``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import itertools
from typing import Any, Callable, Optional, Sequence, Union

import torch

from .op import FusibleOperation

PASSES = ("forward", "backward", "joint")

_epoch = itertools.count(1)
_disabled: dict[str, int] = {}  # name -> nesting count, for fusion_rules.disabled
_disabled_now = [frozenset()]  # the names disabled right now (part of every plan key)
_known_names: set[str] = set()  # every rule name ever registered in any RuleSet


@dataclasses.dataclass(frozen=True)
class Matcher:
    """Matches one basic op: an instance of ``op_class`` for which ``where(op)`` is true."""

    op_class: Union[type, tuple]
    where: Optional[Callable[[Any], bool]] = None

    def matches(self, op) -> bool:
        return isinstance(op, self.op_class) and (self.where is None or bool(self.where(op)))

    def __repr__(self) -> str:
        cls = self.op_class
        names = "|".join(c.__name__ for c in cls) if isinstance(cls, tuple) else cls.__name__
        return f"{names}[where]" if self.where is not None else names


def match(op_class: Union[type, tuple], where: Optional[Callable[[Any], bool]] = None) -> Matcher:
    """A pattern element: an op of ``op_class`` (a class or tuple of classes) with ``where(op)`` true."""
    return Matcher(op_class, where)


@dataclasses.dataclass(frozen=True)
class FusionContext:
    """What a checker may look at besides the matched ops (all fixed for one cached plan)."""

    dtype: Optional[torch.dtype]
    device: Optional[torch.device]
    recipe: Any
    requires_grad: bool  # backward will run through the fuser
    training: bool
    pass_: str
    cost_hints: bool = True  # False: rules' cost hints are ignored (a tuning candidate)


COST_HINTS = "cost hints"
"""The name under which a tuned choice leaves the rules' cost hints out (fusible_ops.tuning);
``fusion_rules.disabled("cost hints")`` makes the static plan ignore them too."""
_known_names.add(COST_HINTS)


@dataclasses.dataclass(frozen=True)
class FusionRule:
    name: str
    pattern: tuple[Matcher, ...]
    pass_: str
    build: Callable[[list], Any]
    check: Optional[Callable[[list, FusionContext], Union[bool, str, None]]] = None
    priority: int = 0
    cost: Optional[Callable[[list, FusionContext], Optional[str]]] = None
    """A cost hint: ``cost(ops, ctx)`` returns a reason where the fused op is known to lose to
    the same ops unfused (the rule then declines: ``explain()`` shows "cost hint: <reason>"), else
    None. Unlike ``check`` it is about speed, not correctness: tuning also times the plan without
    the hints (:mod:`fusible_ops.tuning`)."""

    def structural_match(self, ops: Sequence, start: int) -> bool:
        n = len(self.pattern)
        if start + n > len(ops):
            return False
        return all(m.matches(ops[start + i]) for i, m in enumerate(self.pattern))

    def decline_reason(self, ops: list, ctx: FusionContext) -> Optional[str]:
        """``None`` if the checker (then the cost hint) accepts; else the reason given."""
        verdict = None if self.check is None else self.check(ops, ctx)
        if verdict is False:
            return "declined by checker"
        if verdict is not None and verdict is not True:
            return str(verdict)
        if self.cost is not None and ctx.cost_hints:
            why = self.cost(ops, ctx)
            if why:
                return f"cost hint: {why}"
        return None


def _as_matcher(m) -> Matcher:
    if isinstance(m, Matcher):
        return m
    if isinstance(m, type) or (isinstance(m, tuple) and all(isinstance(c, type) for c in m)):
        return Matcher(m)
    raise TypeError(f"pattern element {m!r}: expected an op class or fusible_ops.match(...)")


class RuleSet:
    """An ordered collection of fusion rules. ``RuleSet()`` is empty;
    ``RuleSet.builtin()`` is a copy of the built-in rules."""

    def __init__(self) -> None:
        self._rules: dict[str, FusionRule] = {}
        self.version = next(_epoch)

    @classmethod
    def builtin(cls) -> "RuleSet":
        rs = cls()
        rs._rules = {k: v for k, v in _BUILTIN._rules.items()}
        return rs

    def register(self, name: str, pattern=None, *, pass_: str, build: Callable = None, check=None, priority: int = 0,
                 cost=None):
        """Add a rule. Usable directly, or as a class decorator (``build`` defaults to the class).

        ``pattern`` is a list of op classes or :func:`match` objects; ``pass_`` is ``"forward"``,
        ``"backward"`` or ``"joint"``; ``build(ops)`` gets the matched basic ops as a list and
        returns a ``FusedOperation``; ``check(ops, ctx)`` returns ``None``/``True`` to accept,
        or a reason string (or ``False``) to decline; ``cost(ops, ctx)`` (a cost hint, optional)
        returns a reason where the fused op is known to be slower than the ops unfused, else None.
        Re-registering a name replaces the rule.
        """
        def add(builder):
            self.add(rule(name, pattern, pass_=pass_, build=builder, check=check, priority=priority, cost=cost))
            return builder

        if build is None:
            rule(name, pattern, pass_=pass_, build=lambda ops: None, check=check, priority=priority, cost=cost)  # validate
            return add  # decorator form
        add(build)
        return build

    def add(self, fusion_rule: "FusionRule") -> None:
        """Add a rule made by :func:`rule` (replacing one of the same name)."""
        if not isinstance(fusion_rule, FusionRule):
            raise TypeError(f"RuleSet.add takes a FusionRule (see fusible_ops.rules.rule), got {fusion_rule!r}")
        self._rules[fusion_rule.name] = fusion_rule
        _known_names.add(fusion_rule.name)
        self.version = next(_epoch)

    def unregister(self, name: str) -> None:
        del self._rules[name]
        self.version = next(_epoch)

    def rules(self, pass_: Optional[str] = None) -> list[FusionRule]:
        return [r for r in self._rules.values() if pass_ is None or r.pass_ == pass_]

    def names(self) -> list[str]:
        return list(self._rules)

    def __contains__(self, name: str) -> bool:
        return name in self._rules

    def __len__(self) -> int:
        return len(self._rules)

    def __repr__(self) -> str:
        return f"RuleSet({', '.join(self._rules)})"


_BUILTIN = RuleSet()  # filled by install_builtin
_GLOBAL = RuleSet()  # built-ins plus user registrations


def builtin_registry() -> RuleSet:
    return _BUILTIN


def global_rules() -> RuleSet:
    """The rule set used by a ``Sequential`` made without ``rules=``."""
    return _GLOBAL


def rule(name: str, pattern, *, pass_: str, build: Callable, check=None, priority: int = 0, cost=None) -> "FusionRule":
    """A fusion rule as data (validated; registers nothing). See :meth:`RuleSet.register`."""
    if pass_ not in PASSES:
        raise ValueError(f"rule {name!r}: pass_ must be one of {PASSES}, got {pass_!r}")
    if pattern is None or len(pattern) == 0:
        raise ValueError(f"rule {name!r}: empty pattern")
    if not callable(build):
        raise TypeError(f"rule {name!r}: build must be callable")
    if cost is not None and not callable(cost):
        raise TypeError(f"rule {name!r}: cost must be callable (ops, ctx) -> reason or None")
    return FusionRule(name, tuple(_as_matcher(m) for m in pattern), pass_, build, check, int(priority), cost)


def install_builtin(rules) -> None:
    """Install the built-in rules (``fusible_ops.fusion_rules.BUILTIN_RULES``) in the built-in
    and the global set. Called once by ``fusible_ops/__init__.py``."""
    for r in rules:
        _BUILTIN.add(r)
        _GLOBAL.add(r)


def register_fusion(name: str, pattern=None, *, pass_: str, build: Callable = None, check=None, priority: int = 0,
                    cost=None):
    """Register a fusion rule in the global set (see :meth:`RuleSet.register`)."""
    return _GLOBAL.register(name, pattern, pass_=pass_, build=build, check=check, priority=priority, cost=cost)


@contextlib.contextmanager
def disabled(*names: str):
    """Disable the named rules (in every rule set) inside the ``with`` block.

    Names must be registered rules (in any rule set); an unknown name raises ``ValueError``
    listing close matches. Plans are cached per set of disabled names, so using the same
    ``disabled(...)`` every step re-plans nothing and the plan caches stay bounded.
    """
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"fusion_rules.disabled: rule names are strings, got {n!r}")
        if n not in _known_names:
            close = difflib.get_close_matches(n, sorted(_known_names), n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ValueError(f"fusion_rules.disabled: no rule named {n!r}{hint} "
                             f"(built-in names: fusible_ops.RuleSet.builtin().names())")
    for n in names:
        _disabled[n] = _disabled.get(n, 0) + 1
    _disabled_now[0] = frozenset(_disabled)
    try:
        yield
    finally:
        for n in names:
            _disabled[n] -= 1
            if _disabled[n] == 0:
                del _disabled[n]
        _disabled_now[0] = frozenset(_disabled)


def disabled_key() -> frozenset:
    """The rule names disabled right now (part of every plan key)."""
    return _disabled_now[0]


# --------------------------------------------------------------------------------------
# The one matcher.
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Group:
    """One entry of a plan: a rule's fused op over ``indices``, or a lone basic op."""

    rule: Optional[str]
    indices: tuple[int, ...]
    op: Any  # the FusedOperation, or the BasicOperation itself

    @property
    def label(self) -> str:
        return self.rule if self.rule is not None else type(self.op).__name__


@dataclasses.dataclass(frozen=True)
class Decline:
    rule: str
    indices: tuple[int, ...]
    reason: str


MATCH_STATS = {"calls": 0}  # incremented on every pattern-matching pass (tests read it)


def plan_pass(
    ops: Sequence,
    rules: list[FusionRule],
    ctx: FusionContext,
    taken: Optional[dict[int, Group]] = None,
) -> tuple[list[Group], list[Decline]]:
    """Apply ``rules`` to ``ops``: repeatedly take the best accepted match among free positions
    (priority desc, length desc, start asc). ``taken`` maps start index -> pre-placed group
    (joint fusions) whose positions are not free. Returns the groups in order and the declines.
    """
    if not torch.compiler.is_compiling():  # (a counter read in a trace: dynamo would guard on it)
        MATCH_STATS["calls"] += 1
    n = len(ops)
    busy = [False] * n
    groups: dict[int, Group] = {}
    for start, g in (taken or {}).items():
        groups[start] = g
        for i in g.indices:
            busy[i] = True
    declines: dict[tuple[str, int], Decline] = {}
    rules = [r for r in rules if r.name not in _disabled]
    while True:
        best = None
        for rule in rules:
            length = len(rule.pattern)
            for start in range(n - length + 1):
                if any(busy[start : start + length]) or not rule.structural_match(ops, start):
                    continue
                key = (-rule.priority, -length, start, rule.name)
                matched = list(ops[start : start + length])
                reason = rule.decline_reason(matched, ctx)
                if reason is not None:
                    declines[(rule.name, start)] = Decline(rule.name, tuple(range(start, start + length)), reason)
                    continue
                if best is None or key < best[0]:
                    best = (key, rule, start, matched)
        if best is None:
            break
        _, rule, start, matched = best
        fused = rule.build(matched)
        if not isinstance(fused, FusibleOperation):
            raise TypeError(
                f"fusion rule {rule.name!r}: build({[type(op).__name__ for op in matched]}) returned "
                f"{type(fused).__name__}; it must return a fusible_ops.FusedOperation over exactly the "
                f"matched basic ops (e.g. MyFused(ops))"
            )
        idx = tuple(range(start, start + len(matched)))
        groups[start] = Group(rule.name, idx, fused)
        for i in idx:
            busy[i] = True
    for i in range(n):
        if not busy[i]:
            groups[i] = Group(None, (i,), ops[i])
    ordered = [groups[k] for k in sorted(groups)]
    accepted_spans = {(g.rule, g.indices[0]) for g in ordered if g.rule is not None}
    return ordered, [d for k, d in declines.items() if k not in accepted_spans]


# --------------------------------------------------------------------------------------
# Near misses (for explain()).
# --------------------------------------------------------------------------------------
def _needed(m: Matcher) -> str:
    """A pattern element as a noun phrase: 'a Bias', 'an AddExtraInput', 'one of ReLU/GELU'."""
    cls = m.op_class
    if isinstance(cls, tuple):
        text = "one of " + "/".join(c.__name__ for c in cls)
    else:
        text = ("an " if cls.__name__[:1] in "AEIOU" else "a ") + cls.__name__
    return text + (" meeting the rule's condition" if m.where is not None else "")


def _span(indices: Sequence[int]) -> str:
    return f"op {indices[0]}" if len(indices) == 1 else f"ops {indices[0]}-{indices[-1]}"


@dataclasses.dataclass(frozen=True)
class NearMiss:
    """A rule that matches nowhere in a chain but would match one op away (see :func:`near_misses`).

    ``kind``: ``"missing"`` (one pattern element is absent: ``indices`` are the ops that fit the
    rest of the pattern, ``at`` the position the absent one would take) or ``"wrong"`` (one op of
    the span does not fit its element: ``indices`` is the whole span, ``at`` the misfit, and
    ``class_ok`` says its class is right but the element's ``where`` condition is false).
    ``needed``: the pattern element that is absent or not met; ``names``: the class names of the
    ops at ``indices``."""

    rule: str
    pass_: str
    kind: str
    indices: tuple[int, ...]
    at: int
    needed: Matcher
    names: tuple[str, ...]
    class_ok: bool = False

    def what(self, offset: int = 0) -> str:
        """What is missing or wrong, e.g. 'needs a Bias between BasicLinear and SwiGLU'."""
        need = _needed(self.needed)
        if self.kind == "wrong":
            found = self.names[self.at - self.indices[0]]
            if self.class_ok:
                return f"op {self.at + offset} ({found}) fails the rule's condition"
            return f"op {self.at + offset} is {found}, needs {need}"
        k = self.at - self.indices[0]  # how many of the present ops come before the absent one
        if k == 0:
            return f"needs {need} before {self.names[0]}"
        if k == len(self.names):
            return f"needs {need} after {self.names[-1]}"
        return f"needs {need} between {self.names[k - 1]} and {self.names[k]}"


def _candidates(r: FusionRule, ops: Sequence):
    """Every way ``r`` is one op away from matching ``ops``, leftmost first (at one start: a misfit
    before an absent element, earlier pattern elements first)."""
    pat, n, names = r.pattern, len(r.pattern), [type(op).__name__ for op in ops]
    for s in range(len(ops)):
        if s + n <= len(ops):
            bad = [i for i, m in enumerate(pat) if not m.matches(ops[s + i])]
            if len(bad) == 1:
                j, idx = bad[0], tuple(range(s, s + n))
                yield NearMiss(r.name, r.pass_, "wrong", idx, s + j, pat[j], tuple(names[i] for i in idx),
                               isinstance(ops[s + j], pat[j].op_class))
        if s + n - 1 <= len(ops):
            for j in range(n):
                rest = pat[:j] + pat[j + 1:]
                if all(m.matches(ops[s + i]) for i, m in enumerate(rest)):
                    idx = tuple(range(s, s + n - 1))
                    yield NearMiss(r.name, r.pass_, "missing", idx, s + j, pat[j], tuple(names[i] for i in idx))


def _compatible(a: str, b: str) -> bool:
    return a == b or "joint" in (a, b)


def find_near_misses(rules: Union[RuleSet, Sequence[FusionRule]], ops: Sequence,
                     matched: Optional[set] = None) -> list[NearMiss]:
    """The near misses of ``rules`` on the chain ``ops`` (see :func:`near_misses`), as data, ordered
    by position then by rule order. Disabled rules (:func:`disabled`) are skipped.

    ``matched``: if given, the names of the rules that match structurally somewhere in ``ops`` are
    added to it (a caller looking at several chains skips those rules in every chain)."""
    rules = [r for r in (rules.rules() if isinstance(rules, RuleSet) else rules) if r.name not in _disabled]
    spans, hit = [], set()
    for r in rules:
        n = len(r.pattern)
        for s in range(len(ops) - n + 1):
            if r.structural_match(ops, s):
                spans.append((r.pass_, s, s + n))
                hit.add(r.name)
    if matched is not None:
        matched |= hit
    found = []
    for order, r in enumerate(rules):
        if r.name in hit or len(r.pattern) < 3:
            continue
        for c in _candidates(r, ops):
            fits = [i for i in c.indices if c.kind == "missing" or i != c.at]  # the ops that fit
            if not any(_compatible(p, r.pass_) and s <= fits[0] and fits[-1] < e for p, s, e in spans):
                found.append((c.indices[0], order, c))
                break
    return [c for _, _, c in sorted(found, key=lambda t: t[:2])]


def group_near_misses(misses: Sequence[NearMiss], offset: int = 0) -> list[tuple[tuple, str, tuple]]:
    """Near misses that say the same thing (e.g. a forward rule and its backward twin, or a rule and
    a longer one needing the same absent op) merged: ``(rule names, what, chain positions)`` in
    order of first appearance, the positions (shifted by ``offset``) spanning all of them."""
    merged: dict[str, list] = {}
    for m in misses:
        what = m.what(offset)
        entry = merged.setdefault(what, [[], m.indices[0], m.indices[-1]])
        entry[0].append(m.rule)
        entry[1], entry[2] = min(entry[1], m.indices[0]), max(entry[2], m.indices[-1])
    return [(tuple(rs), what, tuple(range(lo + offset, hi + offset + 1))) for what, (rs, lo, hi) in merged.items()]


def near_misses(rules: Union[RuleSet, Sequence[FusionRule]], ops: Sequence, offset: int = 0) -> list[str]:
    """Short lines on the rules of ``rules`` that match the chain ``ops`` nowhere but almost do.

    *Almost* means one op away: the pattern matches a span of ``ops`` once one element is inserted
    (``needs a Bias between BasicLinear and SwiGLU``), or it matches a span but for exactly one op,
    of the wrong class (``op 2 is BasicLinear, needs a GroupedLinear``) or of the right class with
    the element's ``where`` condition false. Kept short and deterministic:

    * only rules of three or more elements (so at least two ops of the chain fit the pattern: a
      single op in common is no evidence), not disabled, that match structurally nowhere in
      ``ops`` (a rule that matched but was declined by its checker is reported with its reason
      by ``explain()`` instead);
    * a near miss is skipped when the ops that fit it all lie inside a structural match of
      another rule of the same pass (or a joint rule): e.g. ``linear_bias_activation_dropout``
      is no near miss of a chain without Dropout whose ``linear_bias_activation`` matches;
    * for each rule, the leftmost near miss (at one start, a misfit before an absent element;
      earlier pattern elements first);
    * rules whose near misses say the same thing share one line (:func:`group_near_misses`);
      lines are ordered by position, then by rule order.

    Each line reads ``rules: what (at ops a-b)`` with positions shifted by ``offset``, e.g.
    ``linear_bias_activation: needs a Bias between BasicLinear and SwiGLU (at ops 1-2)``.
    """
    groups = group_near_misses(find_near_misses(rules, ops), offset)
    return [f"{', '.join(rs)}: {what} (at {_span(idx)})" for rs, what, idx in groups]
