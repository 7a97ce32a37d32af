"""Measured plan selection: time a fuser's candidate plans on real inputs and use the fastest.

The rule set's static plan is a good default, not always the fastest one: a fused MoE path can lose
to the same ops unfused at some shapes while keeping less activation memory. Tuning settles it by
measurement, per fuser and input geometry (the plan key: dtype, device, ``requires_grad`` flags,
FP8 recipe, ..., and the inputs' shapes):

* **candidates**: the static plan; the plan with the rules' cost hints ignored (where a hint
  declined a rule); for each rule the static plan applies, that plan with the rule left out; and
  every op unfused (plans that come out the same are timed once);
* **measured**: forward + backward (forward alone when nothing requires grad), after warm-up,
  on a deep copy of the fuser (its ops and parameters) and clones of the call's inputs, with the
  RNG state forked: the model's parameters, ``main_grad``, delayed weight-gradient queues, FP8
  amax histories and scales and the RNG are exactly as they would be without tuning;
* **chosen** by a memory policy: ``prefer="speed"`` (the fastest), ``"memory"`` (the fewest bytes
  kept for backward, ties by time) or a byte budget (the fastest whose kept bytes fit; the
  leanest when none does);
* **cached** per fuser in memory, and on disk (one JSON file, :func:`cache_path`) under a key of
  device, versions, the ops and the geometry, so another process reuses the choice without timing.

Two entry points, in the spirit of ``torch.backends.cudnn.benchmark`` and Triton's autotuner:
:func:`tune` (explicit: one forward of a model on sample inputs) and :func:`enable` (a setting:
every fuser tunes each new geometry on its first eager call). Nothing is timed while
``torch.compile`` traces or a CUDA graph captures: the static plan is used then (a choice made
before is used). Without tuning, planning is the rule set's static, deterministic choice.
``Sequential.explain()`` lists the candidates, their times and kept bytes, and the choice.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import statistics
import time
from typing import Callable, Optional, Union

import torch

from . import fuser as _fuser
from .rules import COST_HINTS

Policy = Union[str, int]
_SETTINGS: dict = {"prefer": "speed", "timer": None, "disk": True}


def cache_path() -> str:
    """The on-disk cache of choices: ``$FUSIBLE_OPS_TUNING_CACHE``, else
    ``~/.cache/fusible_ops/tuning.json``."""
    return os.environ.get("FUSIBLE_OPS_TUNING_CACHE",
                          os.path.join(os.path.expanduser("~"), ".cache", "fusible_ops", "tuning.json"))


def clear_cache(model: Optional[torch.nn.Module] = None, disk: bool = True) -> None:
    """Forget tuned choices: those of ``model``'s fusers (every fuser's when ``model`` is None, which
    only reaches fusers tuned since :func:`enable` or :func:`tune` ran in this process through their
    module), and with ``disk`` the on-disk cache file."""
    if model is not None:
        for f in _fusers(model):
            f._choices.clear()
            f.tuning_notes.clear()
            f._plans.clear()
            f.last_off = frozenset()
    if disk and os.path.exists(cache_path()):
        os.remove(cache_path())


def enable(prefer: Policy = "speed", timer: Optional[Callable] = None, disk: bool = True) -> None:
    """Tune every fuser's plan for each new geometry on its first eager call (the setting; see the
    module docstring). ``prefer``: ``"speed"``, ``"memory"`` or a byte budget for kept activations;
    ``timer(fn, label) -> ms``: replaces the default (CUDA events or ``perf_counter``, median of
    10 after 3 warm-up calls); ``disk``: read and write the on-disk cache."""
    _check_policy(prefer)
    _SETTINGS.update(prefer=prefer, timer=timer, disk=disk)
    _fuser._TUNER[0] = _tune_fuser


def disable() -> None:
    """Stop tuning new geometries (choices already made stay in use)."""
    _fuser._TUNER[0] = None


def enabled() -> bool:
    return _fuser._TUNER[0] is not None


def tune(model: torch.nn.Module, *args, prefer: Policy = "speed", timer: Optional[Callable] = None,
         disk: bool = True, **kwargs) -> list[str]:
    """Tune the plans of every fuser in ``model`` for the geometries of ``model(*args, **kwargs)``.

    Runs that forward once on a deep copy of ``model`` with tuning on (the model's own state is not
    touched; it holds a second copy of the parameters meanwhile), then gives each fuser of
    ``model`` the choices its copy made. Call it under the autocast / grad mode of training, with
    inputs that ``require_grad`` as in training. Returns :func:`report` lines."""
    _check_policy(prefer)
    twin = copy.deepcopy(model)
    _carry_main_grads(model.parameters(), twin.parameters())
    previous = dict(_SETTINGS), _fuser._TUNER[0]
    try:
        enable(prefer, timer, disk)
        args = [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]
        with torch.random.fork_rng(devices=_cuda_devices(args)):
            twin(*args, **kwargs)
    finally:
        _SETTINGS.clear()
        _SETTINGS.update(previous[0])
        _fuser._TUNER[0] = previous[1]
    for mine, theirs in zip(_fusers(model), _fusers(twin)):
        mine._choices.update(theirs._choices)
        mine.tuning_notes.update(theirs.tuning_notes)
    return report(model)


def report(model: torch.nn.Module) -> list[str]:
    """What tuning measured for ``model``'s fusers (the lines ``explain()`` shows)."""
    return [line for f in _fusers(model) for line in notes_lines(f)]


def notes_lines(fuser) -> list[str]:
    """``explain()``'s lines for one fuser's tuned geometries."""
    lines = []
    for geo, (policy, rows, chosen) in fuser.tuning_notes.items():
        shapes = ", ".join(str(list(s)) for s in [geo[1], *[e for e in geo[2] if isinstance(e, tuple)]])
        lines.append(f"tuned plans (prefer={policy!r}; inputs {shapes}):")
        for label, ms, kept in rows:
            mark = "  <- chosen" if label == chosen else ""
            kept_s = f"{_bytes(kept)} kept for backward"
            lines.append(f"  {label}: {ms:.3f} ms, {kept_s}{mark}")
    return lines


# -- internals --------------------------------------------------------------------------------
def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _check_policy(prefer) -> None:
    if not (prefer in ("speed", "memory") or (isinstance(prefer, int) and not isinstance(prefer, bool) and prefer >= 0)):
        raise ValueError(f"tuning: prefer must be 'speed', 'memory' or a byte budget (int >= 0), got {prefer!r}")


def _cuda_devices(tensors) -> list:
    return sorted({t.device.index or 0 for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda})


def _fusers(model: torch.nn.Module) -> list:
    """The fusers of ``model``'s Sequentials, in module order."""
    out = []
    for m in model.modules():
        stages = m.__dict__.get("_stages") or ()
        out += [s for s, _ in stages if isinstance(s, _fuser.OperationFuser)]
    return out


def _structure(plan) -> tuple:
    return tuple((g.rule, tuple(g.indices)) for g in [*plan.forward, *plan.backward])


def _candidates(fuser, x, extra, params) -> list[tuple[str, frozenset]]:
    """(label, rules left out) of each distinct candidate plan, the static plan first."""
    static = fuser._make_plan(x, extra, params)
    used = sorted({g.rule for g in [*static.forward, *static.backward] if g.rule})
    hinted = sorted({d.rule for ds in static.declines.values() for d in ds if d.reason.startswith("cost hint:")})
    options = [(f"static plan ({', '.join(used) or 'no rule applies'})", frozenset())]
    if hinted:  # rules a cost hint declined: the plan with them too
        options.append((f"without cost hints (+{', '.join(hinted)})", frozenset([COST_HINTS])))
    options += [(f"without {name}", frozenset([name])) for name in used] if len(used) > 1 else []
    if used:
        options.append(("unfused", frozenset(fuser._rule_set().names())))
    seen, out = set(), []
    for label, off in options:
        shape = _structure(fuser._make_plan(x, extra, params, off)) if off else _structure(static)
        if shape not in seen:
            seen.add(shape)
            out.append((label, off))
    return out


def _carry_main_grads(originals, copies) -> None:
    """Give the copies of parameters their own ``main_grad`` buffers (``copy.deepcopy`` of a
    ``Parameter`` drops its attributes): the copy accumulates into those, not the originals."""
    for p, q in zip(originals, copies):
        mg = getattr(p, "main_grad", None)
        if isinstance(mg, torch.Tensor) and q is not p:
            q.main_grad = mg.detach().clone()


def _clone_inputs(x, extra):
    def c(t):
        return t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
    return c(x), [c(e) for e in extra]


def _default_timer(fn: Callable, label: str, warmup: int = 3, reps: int = 10) -> float:
    for _ in range(warmup):
        fn()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _measure(fuser, geo, x, extra, off: frozenset, label: str, timer: Callable) -> tuple[float, int]:
    """(ms, kept bytes) of one candidate, on a copy of the fuser and clones of the inputs."""
    twin = copy.deepcopy(fuser)
    _carry_main_grads(fuser._params(), twin._params())
    twin._choices = {}
    twin.tuning_notes = {}
    xs, es = _clone_inputs(x, extra)
    key = twin._key(xs, es, twin._params())
    twin._choices[twin.geometry(key, xs, es)] = off
    params = {p.untyped_storage().data_ptr() for p in twin._params() if isinstance(p, torch.Tensor)}
    kept: dict = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            kept[ptr] = t.untyped_storage().nbytes()
        return t

    def differentiable(out) -> list:
        return [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor) and o.grad_fn]

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        grad = bool(differentiable(twin(xs, *es)))  # (a backward runs: time it too)

    def call():
        out = twin(xs, *es)
        if grad:
            outs = differentiable(out)
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
            for op in twin.ops:
                if getattr(op, "has_pending_wgrad", None) and op.has_pending_wgrad():
                    op.backward_dw()
        return out

    ms = timer(call, label)
    return ms, sum(kept.values())


MARGIN = 0.01
"""Under ``prefer="speed"`` the static plan (the first row) is kept unless another candidate is
faster by more than this fraction: timing noise does not move the choice off the default."""


def _choose(rows: list, prefer: Policy) -> str:
    if prefer == "speed":
        best = min(rows, key=lambda r: r[1])
        return rows[0][0] if rows[0][1] <= best[1] * (1 + MARGIN) else best[0]
    if prefer == "memory":
        return min(rows, key=lambda r: (r[2], r[1]))[0]
    fits = [r for r in rows if r[2] <= prefer]
    return (min(fits, key=lambda r: r[1]) if fits else min(rows, key=lambda r: (r[2], r[1])))[0]


def _disk_key(fuser, geo, x, extra, prefer) -> str:
    dev = torch.cuda.get_device_name(x.device) if x.is_cuda else "cpu"
    ops = [(type(op).__name__, op.extra_repr(), [tuple(p.shape) for p in op.parameters()]) for op in fuser.ops]
    text = repr((dev, torch.__version__, ops, geo[0][:6], str(geo[0][8]), geo[1], geo[2], prefer))
    return hashlib.sha1(text.encode()).hexdigest()


def _disk_read() -> dict:
    try:
        with open(cache_path()) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _disk_write(key: str, entry: dict) -> None:
    data = _disk_read()
    data[key] = entry
    path = cache_path()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)  # (atomic: another process reads the old file or the new one)


def _tune_fuser(fuser, geo, x, extra, params) -> frozenset:
    """The tuner the fuser calls for a new geometry (see :meth:`OperationFuser._chosen`)."""
    prefer, timer, disk = _SETTINGS["prefer"], _SETTINGS["timer"] or _default_timer, _SETTINGS["disk"]
    key = _disk_key(fuser, geo, x, extra, prefer) if disk else None
    if disk:
        hit = _disk_read().get(key)
        if hit is not None:
            fuser.tuning_notes[geo] = (prefer, [tuple(r) for r in hit["rows"]], hit["chosen"])
            return frozenset(hit["off"])
    cands = _candidates(fuser, x, extra, params)
    if len(cands) == 1:
        return frozenset()
    rows, offs = [], {}
    _fuser._TUNER[0] = None  # (the copies run their candidate plans; none tunes again)
    try:
        with torch.random.fork_rng(devices=_cuda_devices([x, *extra])):
            for label, off in cands:
                ms, kept = _measure(fuser, geo, x, extra, off, label, timer)
                rows.append((label, ms, kept))
                offs[label] = off
    finally:
        _fuser._TUNER[0] = _tune_fuser
    chosen = _choose(rows, prefer)
    fuser.tuning_notes[geo] = (prefer, rows, chosen)
    if disk:
        _disk_write(key, {"off": sorted(offs[chosen]), "rows": rows, "chosen": chosen})
    return offs[chosen]


__all__ = ["cache_path", "clear_cache", "disable", "enable", "enabled", "notes_lines", "report", "tune"]
