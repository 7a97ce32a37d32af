"""``assert_matches_reference``: a fused Sequential against plain autograd, in float64, over
each basic op's ``reference_forward`` (its plain differentiable PyTorch math).

The reference never runs an op's own ``op_backward`` / ``fuser_backward`` (unless the caller
lists the op in ``unchecked_ops``), so a wrong hand-written backward is caught.
"""

from __future__ import annotations

import copy
import warnings
from typing import Iterable, Optional, Sequence, Union

import torch

from ..fuser import cpu_autograd
from ..ops.moe_routing import record_routing
from .tolerances import BASELINE_ATOL, BASELINE_FACTOR, BASELINE_SAMPLES, TOLERANCES

__all__ = [
    "MissingReferenceError", "UncheckedOpWarning", "assert_close_scaled", "assert_matches_reference",
    "run_reference", "run_unfused",
]


class MissingReferenceError(TypeError):
    """A basic op has no ``reference_forward``, so its math cannot be checked independently."""


class UncheckedOpWarning(UserWarning):
    """An op ran its own forward/backward in the reference (``unchecked_ops``): its backward was
    not checked independently."""


# --------------------------------------------------------------------------- comparison
def assert_close_scaled(
    actual: torch.Tensor,
    expected: torch.Tensor,
    dtype: torch.dtype,
    what: str = "",
    *,
    baseline: Union[None, torch.Tensor, Sequence[torch.Tensor]] = None,
    overflow: Optional[torch.Tensor] = None,
) -> None:
    """Elementwise ``|a - e| <= rtol |e| + atol * max(1, max|e|)`` with (rtol, atol) from the
    tolerance table for ``dtype``: error is judged against the tensor's own scale, which is how
    rounding of a ``dtype`` computation (GEMMs, reductions) behaves. NaN/inf never pass.

    ``baseline``: the same math computed at ``dtype`` by plain PyTorch (a tensor, or several
    runs: the largest error counts), i.e. the error the precision itself causes. With it, an
    element also passes if ``|a - e| <= BASELINE_FACTOR * max|baseline - e| + BASELINE_ATOL *
    max(1, max|e|)``: nothing is expected to be much more accurate than plain PyTorch at the same
    dtype (non-finite baseline elements are ignored).

    ``overflow``: elements where a non-finite result is accepted (and not compared) because
    ideal kernels at ``dtype`` overflow there too (the exact intermediate results do not fit).
    """
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.shape != e.shape:
        raise AssertionError(f"{what}: shape {list(a.shape)} != reference {list(e.shape)}")
    finite = torch.isfinite(a)
    skipped = ""
    if not finite.all():
        ok = torch.zeros_like(finite)
        if overflow is not None and overflow.shape == a.shape:
            ok = overflow.detach().to("cpu")
        if (~finite & ~ok).any():
            n = int((~finite & ~ok).sum())
            raise AssertionError(
                f"{what}: {n} non-finite values in result"
                + ("" if overflow is None
                   else f" where {dtype} ideal kernels (exact math, results rounded to {dtype}) are finite")
            )
        skipped = f"; {int((~finite).sum())} non-finite elements accepted (overflow at {dtype} in ideal kernels too)"
        a = torch.where(finite, a, e)
    if a.numel() == 0:
        return
    rtol, atol = TOLERANCES[dtype]
    scale = max(1.0, e.abs().max().item())
    err = (a - e).abs()
    bound = rtol * e.abs() + atol * scale
    note = ""
    if baseline is not None:
        runs = [baseline] if isinstance(baseline, torch.Tensor) else list(baseline)
        errs = []
        for b in runs:
            b = b.detach().to("cpu", torch.float64)
            if b.shape == e.shape:
                d = (b - e).abs()
                d = d[torch.isfinite(d)]
                if d.numel():
                    errs.append(d.max().item())
        if errs:
            base_err = max(errs)
            allowed = BASELINE_FACTOR * base_err + BASELINE_ATOL * scale
            bound = torch.clamp(bound, min=allowed)
            note = (f"; plain PyTorch at {dtype} has max |err| {base_err:.3e} ({len(errs)} runs), "
                    f"allowed {BASELINE_FACTOR:g}x that + {BASELINE_ATOL:g}*scale = {allowed:.3e}")
        else:
            note = "; plain-PyTorch baseline unusable (non-finite or shape mismatch)"
    note += skipped
    bad = err > bound
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{a.numel()} elements off (dtype {dtype}, rtol {rtol}, atol {atol}, "
            f"scale {scale:.3g}{note}); worst |err| {err.max().item():.3e}; first at flat index {i}: "
            f"{a.flatten()[i].item():.6g} vs reference {e.flatten()[i].item():.6g}"
        )


def _coarser(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The less precise of two dtypes: a float32 parameter's gradient computed from bf16
    activations carries bf16 rounding, so it is judged with bf16's tolerance."""
    return a if TOLERANCES[a][0] >= TOLERANCES[b][0] else b


def _to64(t):
    if isinstance(t, torch.Tensor) and t.is_floating_point():
        return t.detach().to(torch.float64).requires_grad_(t.requires_grad)
    return t


def _fresh(t):
    if isinstance(t, torch.Tensor) and t.is_floating_point():
        return t.detach().clone().requires_grad_(t.requires_grad)
    return t


# --------------------------------------------------------------------------- running
def _modules_of(seq) -> list:
    from ..op import FusibleOperation

    if isinstance(seq, FusibleOperation):
        return [seq]
    try:
        return list(seq)
    except TypeError:
        raise TypeError(
            f"expected a fusible_ops.Sequential, a torch.nn.Sequential or a fusible op, got {type(seq).__name__}"
        ) from None


def _basic_ops_in(seq) -> list:
    from ..op import FusibleOperation

    return [op for m in _modules_of(seq) if isinstance(m, FusibleOperation) for op in m.basic_ops]


def _unchecked_matcher(unchecked_ops):
    if unchecked_ops is None:
        return lambda op: False
    if isinstance(unchecked_ops, str):
        if unchecked_ops != "all":
            raise ValueError(
                f"unchecked_ops must be 'all', an op class or a tuple of op classes, got {unchecked_ops!r}"
            )
        return lambda op: True
    classes = (unchecked_ops,) if isinstance(unchecked_ops, type) else tuple(unchecked_ops)
    return lambda op: isinstance(op, classes)


def _missing_reference(seq, unchecked_ops) -> tuple[list, list]:
    """(ops lacking reference_forward that are not allowed to, unchecked ops that will run)."""
    allowed = _unchecked_matcher(unchecked_ops)
    missing, unchecked = [], []
    for i, op in enumerate(_basic_ops_in(seq)):
        if callable(getattr(op, "reference_forward", None)):
            continue
        (unchecked if allowed(op) else missing).append((i, op))
    return missing, unchecked


def _missing_message(missing) -> str:
    names = ", ".join(f"{type(op).__name__} (basic op {i})" for i, op in missing)
    first = type(missing[0][1]).__name__
    return (
        f"{names}: no reference_forward, so its math cannot be checked against plain autograd. "
        f"Fix: define `def reference_forward(self, x, *extra_inputs)` on {first} in plain differentiable "
        f"PyTorch (the same math as its forward, reading parameters as self.<name>; ops with extra "
        f"outputs return (y, *extra_outputs)). Or pass unchecked_ops=({first},) (or 'all') to "
        f"assert_matches_reference to run its own forward/backward in the reference instead: its "
        f"backward is then NOT checked."
    )


def run_reference(seq, *inputs, unchecked_ops: Union[None, str, type, Iterable[type]] = None, _boundary=None,
                  _routing=None):
    """Run ``seq``'s math by plain autograd: each basic op's ``reference_forward(x, *extras)`` in
    order (its share of the extra inputs, ``op.num_extra_inputs``), other torch modules called
    as they are. Returns ``y`` or ``(y, *extra_outputs)`` like ``Sequential``.

    Runs in whatever dtype ``seq`` and ``inputs`` have (the caller makes float64 copies for a
    reference). An op without ``reference_forward`` raises :class:`MissingReferenceError`
    unless ``unchecked_ops`` covers it (``"all"``, a class or a tuple of classes); such an op
    runs its own forward/backward (alone, unfused).

    ``_boundary`` (internal): applied to the input, every extra input and every op's outputs
    (models rounding at op boundaries). ``_routing`` (internal): ``(expert ids per MoE layer,
    (rtol, atol))`` recorded from a run: each Router uses those ids (checked to be a top-k of its
    own scores within the tolerance) instead of choosing again.
    """
    from ..fuser import OperationFuser
    from ..op import FusibleOperation
    from ..rules import RuleSet

    missing, _ = _missing_reference(seq, unchecked_ops)
    if missing:
        raise MissingReferenceError(_missing_message(missing))
    empty = RuleSet()
    bd = _boundary if _boundary is not None else (lambda t: t)
    x, extras = bd(inputs[0]), list(inputs[1:])
    extra_outputs = []
    layout, routings, k = _layout_of(seq)
    if _routing is not None and len(_routing[0]) == len(routings):
        for routing, ids in zip(routings, _routing[0]):
            routing.expert_ids, routing.selection_tol = ids, _routing[1]
    for module in _modules_of(seq):
        if not isinstance(module, FusibleOperation):
            x = bd(module(x))
            continue
        for op in module.basic_ops:
            region, feeds = (None, ()) if layout is None else (layout.region[k], layout.feeds[k])
            k += 1
            n = 0 if feeds else op.num_extra_inputs
            if len(extras) < n:
                raise TypeError(f"{type(op).__name__} needs {n} extra input(s); too few extra inputs given")
            mine, extras = [bd(e) for e in extras[:n]], extras[n:]
            if feeds:  # a routed op (MoE): its extra inputs come from the routing
                mine = [getattr(routings[region], f) for f in feeds]
            ref = getattr(op, "reference_forward", None)
            if callable(ref) and getattr(op, "routing_role", None):
                out = ref(x, *mine, routing=routings[region])
            else:
                out = ref(x, *mine) if callable(ref) else OperationFuser([op], rules=empty)(x, *mine)
            if op.num_extra_outputs:
                if not isinstance(out, (tuple, list)) or len(out) != 1 + op.num_extra_outputs:
                    raise TypeError(
                        f"{type(op).__name__}.reference_forward must return (y, *extra_outputs) with "
                        f"{op.num_extra_outputs} extra output(s)"
                    )
                x, *ex = (bd(t) for t in out)
                extra_outputs.extend(ex)
            else:
                x = bd(out)
    if extras:
        raise TypeError(f"{len(extras)} extra input(s) left over after the last op")
    return (x, *extra_outputs) if extra_outputs else x


def run_unfused(seq, *inputs):
    """Run ``seq``'s modules one by one; every basic op is its own one-op fuser with no rules
    (so each op's OWN forward and backward run: use :func:`run_reference` to check them). A MoE
    layer (Router .. Combine, whose routing must stay in one fuser) runs as one fuser with no
    rules."""
    from ..fuser import OperationFuser
    from ..op import FusibleOperation
    from ..rules import RuleSet

    empty = RuleSet()
    x, extras = inputs[0], list(inputs[1:])
    extra_outputs = []
    layout, _, k = _layout_of(seq)
    units, region = [], None  # each unit: a non-fusible module, or a list of basic ops run as one fuser
    for module in _modules_of(seq):
        if not isinstance(module, FusibleOperation):
            units.append(module)
            region = None
            continue
        for op in module.basic_ops:
            r = None if layout is None else layout.region[k]
            k += 1
            if r is not None and r == region:
                units[-1].append(op)
            else:
                units.append([op])
            region = r
    for unit in units:
        if not isinstance(unit, list):
            x = unit(x)
            continue
        fuser = OperationFuser(unit, rules=empty)
        n = fuser.num_extra_inputs
        mine, extras = extras[:n], extras[n:]
        out = fuser(x, *mine)
        if fuser.num_extra_outputs:
            x, *ex = out
            extra_outputs.extend(ex)
        else:
            x = out
    return (x, *extra_outputs) if extra_outputs else x


def _layout_of(seq):
    """(MoE routing layout of all of ``seq``'s basic ops or None, one empty Routing per MoE
    layer, 0: the running basic-op index)."""
    from ..ops.moe_routing import routing_layout

    layout = routing_layout(_basic_ops_in(seq))
    return layout, (layout.new_routings() if layout is not None else []), 0


def _plain_autograd_copy(seq, dtype: Optional[torch.dtype]):
    """A deep copy (optionally converted to ``dtype``) whose ops use plain autograd for weight
    gradients (matters only for ops run unchecked, with their own backward)."""
    ref = copy.deepcopy(seq)
    if dtype is not None:
        ref = ref.to(dtype)
    for p in ref.parameters():
        p.grad = None
    for op in _basic_ops_in(ref):
        if getattr(op, "accumulate_into_main_grad", False):
            op.accumulate_into_main_grad = False
        if getattr(op, "delay_wgrad_compute", False):
            op.delay_wgrad_compute = False
    return ref


def _as_list(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _main_grad_params(seq) -> set:
    """ids of the weights whose gradient the gradient contract puts into ``main_grad``."""
    ids = set()
    for op in _basic_ops_in(seq):
        if getattr(op, "accumulate_into_main_grad", False):
            w = getattr(op, "weight", None)
            if isinstance(w, torch.Tensor):
                ids.add(id(w))
    return ids


def _fused_grads(seq, before: dict, main_grad_ids: set) -> dict:
    """Gradient each parameter received from this run: ``main_grad`` for weights the op
    accumulates into it, else ``.grad``; minus what was there before (unless overwritten)."""
    out = {}
    for name, p in seq.named_parameters():
        use_main = id(p) in main_grad_ids and getattr(p, "main_grad", None) is not None
        g = p.main_grad if use_main else p.grad
        b = before[name][1 if use_main else 0]
        if g is None:
            out[name] = None
        elif b is None or (use_main and getattr(p, "overwrite_main_grad", False)):
            out[name] = g
        else:
            out[name] = g - b
    return out


def _clone(t):
    return None if t is None else t.detach().clone()


def assert_matches_reference(
    seq,
    *inputs,
    seed: int = 1234,
    grad_seed: Optional[int] = 4321,
    unchecked_ops: Union[None, str, type, Iterable[type]] = None,
    baseline: bool = True,
) -> None:
    """Run ``seq(*inputs)`` (fused, as a user would) and compare it against plain autograd over
    each basic op's ``reference_forward`` on float64 copies of the parameters and inputs.

    * Compared: the output(s), and the gradients (for one fixed random output gradient) of every
      floating-point input that requires grad and of every parameter. The reference gradients
      are plain autograd ``.grad`` of the float64 copy's parameters (same names). The fused
      run's gradient is ``weight.main_grad`` where the op accumulates into it
      (``accumulate_into_main_grad``; delayed weight gradients are flushed), else ``.grad``;
      minus what was there before. A frozen parameter must get no gradient.
    * Tolerance: the table for the fused run's dtype (:data:`~fusible_ops.testing.TOLERANCES`,
      elementwise, scaled by the tensor's magnitude; parameter gradients by the coarser of the
      parameter's and the run's dtype), never loosened. With ``baseline=True`` (default), a
      tensor that misses the table is judged again against what the run's precision itself
      does to the same math (the error a plain PyTorch implementation at that dtype makes):
      the ``reference_forward`` chain run in plain PyTorch on copies in the run's dtypes (same
      device, seeds and output gradient); a float64 run of it with every op's output and
      gradient rounded to nearest in the run's dtype (ideal kernels: exact math, results stored
      in that dtype); and ``BASELINE_SAMPLES`` (4) such runs with stochastic rounding (so one
      lucky rounding of a one-element tensor does not set the bar). An element then also passes if
      ``|err| <= BASELINE_FACTOR (2) * max baseline error of that tensor + BASELINE_ATOL (1e-6)
      * scale``, as quack's kernel tests do: a fused op need not be more accurate than plain
      PyTorch at its precision (e.g. a near-zero gradient that is a cancelling sum, LayerNorm
      over one row in fp16), but one much worse than it fails. A non-finite result fails,
      except where the ideal-kernel run is non-finite too (exact intermediate results that do
      not fit the dtype, e.g. fp16 overflow). ``baseline=False``: table only, no exception.
    * On CPU the run takes the ops' own backward (:func:`fusible_ops.fuser.cpu_autograd` off),
      not PyTorch's autograd of their forward: the fused backward is what gets checked.
    * Random ops (dropout) draw the same seeds (``torch.manual_seed(seed)``) in every run.
    * MoE routing: the reference's Routers take the experts the run chose (so rounding upstream
      of a Router cannot flip a near-tied top-k choice), after checking that they are a top-k of
      the reference's own selection scores within the tolerance of the run's dtype; probabilities,
      aux loss and every gradient are then compared as usual.
    * Every basic op must define ``reference_forward(x, *extra_inputs)``, else
      :class:`MissingReferenceError` (naming the op). ``unchecked_ops``: ``"all"``, an op class
      or a tuple of classes whose ops lacking ``reference_forward`` run their own forward and
      backward in the reference instead (with an :class:`UncheckedOpWarning`): their backward
      is then NOT checked independently. Other torch modules in the Sequential are just called.

    ``inputs`` are not modified; ``seq``'s gradients accumulate as by a normal backward.
    Raises ``AssertionError`` naming the first mismatching tensor.
    """
    missing, unchecked = _missing_reference(seq, unchecked_ops)
    if missing:
        raise MissingReferenceError(_missing_message(missing))
    if unchecked:
        names = sorted({type(op).__name__ for _, op in unchecked})
        warnings.warn(
            f"assert_matches_reference: {', '.join(names)} ran its own forward/backward in the reference "
            f"(unchecked_ops, no reference_forward): its backward is NOT independently checked",
            UncheckedOpWarning,
            stacklevel=2,
        )

    base_model = _plain_autograd_copy(seq, None) if baseline else None
    ref = _plain_autograd_copy(seq, torch.float64)
    run_in = [_fresh(t) for t in inputs]
    ref_in = [_to64(t) for t in inputs]
    main_grad_ids = _main_grad_params(seq)
    before = {
        name: (_clone(p.grad), _clone(getattr(p, "main_grad", None))) for name, p in seq.named_parameters()
    }

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with record_routing() as routing_log, cpu_autograd(False):  # (CPU: the ops' own backward)
            outs = _as_list(seq(*run_in))
    dtype = outs[0].dtype
    routing = (routing_log, TOLERANCES[dtype]) if routing_log else None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        ref_outs = _as_list(run_reference(ref, *ref_in, unchecked_ops=unchecked_ops, _routing=routing))
    if len(outs) != len(ref_outs):
        raise AssertionError(f"{len(outs)} outputs, reference has {len(ref_outs)}")
    diff = [i for i, o in enumerate(outs) if o.requires_grad]
    grads_out = None
    if diff:
        gen = torch.Generator().manual_seed(grad_seed if grad_seed is not None else 0)
        grads_out = {i: torch.randn(outs[i].shape, generator=gen, dtype=torch.float64) for i in diff}

    cache: dict = {}

    def baseline_of(key: str):
        """The baseline runs at the run's dtype for tensor ``key`` and the ideal kernels'
        non-finite mask (computed once, only when needed)."""
        if base_model is None:
            return None, None
        if "run" not in cache:
            cache["run"] = _baseline_run(base_model, inputs, seed, grads_out, unchecked_ops, dtype, routing)
        runs, ideal = cache["run"]
        i = ideal.get(key)
        return runs.get(key), (None if i is None else ~torch.isfinite(i))

    def check(actual, expected, dt, what):
        try:
            assert_close_scaled(actual, expected, dt, what)
        except AssertionError:
            b, overflow = baseline_of(what)
            if b is None:
                raise
            assert_close_scaled(actual, expected, dt, what, baseline=b, overflow=overflow)

    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        check(o, r, dtype, f"output {i}")
        if r.requires_grad and not o.requires_grad:
            raise AssertionError(
                f"output {i}: the reference is differentiable but the fused output does not require grad"
            )
    if not diff:
        return

    torch.autograd.backward([outs[i] for i in diff], [grads_out[i].to(outs[i].device, outs[i].dtype) for i in diff])
    rdiff = [i for i in diff if ref_outs[i].requires_grad]
    if rdiff:
        torch.autograd.backward([ref_outs[i] for i in rdiff], [grads_out[i].to(ref_outs[i].device) for i in rdiff])
    for op in _basic_ops_in(seq):  # flush delayed weight gradients (no-op when none are pending)
        if hasattr(op, "backward_dw"):
            op.backward_dw()

    for i, (a, b) in enumerate(zip(run_in, ref_in)):
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.requires_grad:
            if a.grad is None or b.grad is None:
                raise AssertionError(
                    f"grad of input {i}: missing (fused {a.grad is not None}, reference {b.grad is not None})"
                )
            check(a.grad, b.grad, dtype, f"grad of input {i}")
    ref_grads = {name: p.grad for name, p in ref.named_parameters()}
    got_grads = _fused_grads(seq, before, main_grad_ids)
    for name, p in seq.named_parameters():
        got, rg = got_grads[name], ref_grads.get(name)
        if not p.requires_grad:
            mg, mg_before = getattr(p, "main_grad", None), before[name][1]
            if (p.grad is not None and before[name][0] is None) or (
                mg is not None and mg_before is not None and not torch.equal(mg, mg_before)
            ):
                raise AssertionError(f"grad of parameter {name}: frozen but got a gradient")
            continue
        if got is None or rg is None:
            raise AssertionError(
                f"grad of parameter {name}: missing (fused {got is not None}, reference {rg is not None})"
            )
        check(got, rg, _coarser(p.dtype, dtype), f"grad of parameter {name}")


class _DitherRound(torch.autograd.Function):
    """Rounding to ``dtype`` of a value (forward) and of its gradient (backward): to nearest
    with ``gen=None``, else stochastic."""

    @staticmethod
    def forward(ctx, t, dtype, gen):
        ctx.dtype, ctx.gen = dtype, gen
        return _dither(t, dtype, gen)

    @staticmethod
    def backward(ctx, g):
        return _dither(g, ctx.dtype, ctx.gen), None, None


def _dither(t, dtype: torch.dtype, gen: torch.Generator):
    """``t`` rounded to ``dtype``, kept in ``t``'s dtype: to nearest (``gen=None``), else
    stochastically (uniform dither of one ulp, then nearest): one sample of the rounding error an
    op storing its result in ``dtype`` makes."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or dtype == torch.float64:
        return t
    if gen is None:
        return t.to(dtype).to(t.dtype)
    fi = torch.finfo(dtype)
    mag = t.detach().abs().to(torch.float64).clamp_min(fi.tiny)
    ulp = fi.eps * torch.pow(2.0, torch.floor(torch.log2(mag)))
    u = torch.rand(t.shape, generator=gen, dtype=torch.float64).to(t.device) - 0.5
    return (t + (u * ulp).to(t.dtype)).to(dtype).to(t.dtype)


def _run_and_grads(model, ins, seed, grads_out, unchecked_ops, boundary=None, routing=None) -> dict:
    """One run of the reference_forward chain and its backward: outputs and gradients keyed like
    the messages of :func:`assert_matches_reference`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        outs = _as_list(run_reference(model, *ins, unchecked_ops=unchecked_ops, _boundary=boundary, _routing=routing))
    res = {f"output {i}": o.detach() for i, o in enumerate(outs)}
    if grads_out:
        idx = [i for i in grads_out if i < len(outs) and outs[i].requires_grad]
        if idx:
            torch.autograd.backward(
                [outs[i] for i in idx], [grads_out[i].to(outs[i].device, outs[i].dtype) for i in idx]
            )
    for i, t in enumerate(ins):
        if isinstance(t, torch.Tensor) and t.grad is not None:
            res[f"grad of input {i}"] = t.grad
    for name, p in model.named_parameters():
        if p.grad is not None:
            res[f"grad of parameter {name}"] = p.grad
    return res


def _baseline_run(model, inputs, seed, grads_out, unchecked_ops, dtype, routing=None) -> tuple[dict, dict]:
    """What rounding to the run's dtype does to this math: key -> list of results, each to be
    compared with the float64 reference. (1) The reference_forward chain in plain PyTorch in the
    run's own dtypes (rounding after every primitive op); (2) the chain in float64 with the
    values and gradients at every op boundary (and the parameter gradients) rounded to nearest in
    the run's dtype: ops that compute exactly and store their results in that dtype, i.e. ideal
    kernels; (3) ``BASELINE_SAMPLES`` runs like (2) with stochastic rounding: independent samples
    of that rounding error, so a tensor of one element is not judged against a single, possibly
    lucky, rounding. A run that fails (e.g. no kernel for that dtype on this device) is left out.
    Returns (key -> list of results, key -> result of (2))."""
    res: dict = {}
    ideal: dict = {}

    def add(run: dict) -> None:
        for k, v in run.items():
            res.setdefault(k, []).append(v)

    param_dtypes = {name: p.dtype for name, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UncheckedOpWarning)
        try:
            add(_run_and_grads(copy.deepcopy(model), [_fresh(t) for t in inputs], seed, grads_out, unchecked_ops,
                               routing=routing))
        except (RuntimeError, NotImplementedError, TypeError):
            pass
        if dtype == torch.float64:
            return res, ideal
        base64 = copy.deepcopy(model).to(torch.float64)
        for j in range(-1, BASELINE_SAMPLES):
            gen = None if j < 0 else torch.Generator().manual_seed(1000 + j)
            for p in base64.parameters():
                p.grad = None
            try:
                run = _run_and_grads(base64, [_to64(t) for t in inputs], seed, grads_out, unchecked_ops,
                                     boundary=lambda t, gen=gen: _DitherRound.apply(t, dtype, gen)
                                     if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                                     routing=routing)
            except (RuntimeError, NotImplementedError, TypeError):
                continue
            for k in list(run):
                name = k[len("grad of parameter "):] if k.startswith("grad of parameter ") else None
                if name is not None:
                    run[k] = _dither(run[k], param_dtypes[name], gen)
            add(run)
            if gen is None:
                ideal = run
    return res, ideal
