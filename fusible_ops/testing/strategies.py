"""Hypothesis strategies for property tests of op chains, for the built-in ops and users' own.

* :class:`OpSpec`: one entry of an op catalogue (how to make the op for an input width, what
  extra inputs it needs, which widths it accepts). :data:`BUILTIN_OPS` is the built-in catalogue.
* :func:`chains` draws a :class:`Chain` from a catalogue (default :data:`BUILTIN_OPS`; pass
  ``BUILTIN_OPS + [your specs]`` to mix in your own ops). ``Chain.build(dtype, device, seed,
  rules)`` returns a fresh ``fusible_ops.Sequential`` and ``Chain.inputs(lead, dtype, device)``
  its inputs.
* :func:`fusion_settings`: ready hypothesis settings for such tests (no deadline, bounded and
  derandomized examples), so a test works the same in any project.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Optional, Union

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import fusible_ops as fo

__all__ = [
    "BUILTIN_OPS", "DTYPES", "Chain", "OpSpec", "Step", "chains", "dtypes", "fusion_settings", "leading_shapes",
]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------- settings
_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large]


def fusion_settings(max_examples: Optional[int] = None, *, derandomize: bool = True, **overrides: Any) -> settings:
    """Hypothesis settings for op-chain property tests, usable as a decorator above ``@given``.

    ``deadline=None`` (the first example of a shape pays one-time costs: imports, kernel
    compilation, plan building), ``max_examples`` bounded (default 25, or the environment
    variable ``FUSIBLE_OPS_MAX_EXAMPLES``), ``derandomize=True`` (the same examples every run:
    reproducible in CI), the ``too_slow`` / ``data_too_large`` health checks off. Any other
    hypothesis setting can be passed through ``overrides``.
    """
    if max_examples is None:
        max_examples = int(os.environ.get("FUSIBLE_OPS_MAX_EXAMPLES", "25"))
    kw = dict(
        deadline=None,
        max_examples=max_examples,
        derandomize=derandomize,
        print_blob=True,
        suppress_health_check=_SUPPRESS,
    )
    kw.update(overrides)
    return settings(**kw)


def dtypes(include_float64: bool = False):
    """Floating dtypes the ops support (float64 is the reference precision)."""
    return st.sampled_from(DTYPES + ((torch.float64,) if include_float64 else ()))


def leading_shapes(max_rows: int = 9):
    """Leading dims of an input: [rows] or [a, b] (odd sizes such as 3 and 5 are common)."""
    return st.one_of(
        st.tuples(st.integers(1, max_rows)),
        st.tuples(st.integers(1, 3), st.integers(1, 5)),
    )


# --------------------------------------------------------------------------- catalogue
ArgsLike = Union[None, dict, st.SearchStrategy, Callable[[int], Any]]


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One op a chain can draw.

    * ``name``: shown in the chain's repr (and usable to pick specs from a catalogue).
    * ``make(n_in, **args, **factory) -> (module, n_out)`` (or just ``module`` when
      ``n_out == n_in``): a fresh ``torch.nn.Module`` (usually a fusible op) for input width
      ``n_in``. ``factory`` is ``dtype=..., device=...``: pass them to parameters you create.
      It must be deterministic given its arguments (it is called once at draw time to learn
      ``n_out`` and again by ``Chain.build``); initial parameter values do not matter
      (``Chain.build`` redraws them).
    * ``args``: random choices for ``make`` drawn with the chain: a dict of strategies, a strategy
      of dicts, or ``n_in -> either``. Default: none.
    * ``extra(lead, n_in, dtype, device, generator, **args) -> list of tensors``: the op's extra
      inputs (``lead``: the input's leading shape; use ``generator`` for randomness). Required
      iff the op has extra inputs.
    * ``accepts(n_in) -> bool``: widths the op takes (e.g. even for gated activations). When the
      current width is not accepted, the chain first projects it with a ``BasicLinear`` to
      ``2 * n_in`` (or another accepted width in 1..24).
    * ``extra_outputs``: the op has extra outputs (checked against the module at draw time);
      ``chains(allow_extra=False)`` skips specs with extra inputs or outputs.
    """

    name: str
    make: Callable[..., Any]
    args: ArgsLike = None
    extra: Optional[Callable[..., list]] = None
    accepts: Optional[Callable[[int], bool]] = None
    extra_outputs: bool = False

    @property
    def has_extra_io(self) -> bool:
        return self.extra is not None or self.extra_outputs

    def args_strategy(self, n_in: int) -> st.SearchStrategy:
        a = self.args
        if callable(a) and not isinstance(a, st.SearchStrategy):
            a = a(n_in)
        if a is None:
            return st.just({})
        if isinstance(a, dict):
            return st.fixed_dictionaries(a)
        return a

    def build(self, n_in: int, args: dict, **factory) -> tuple[torch.nn.Module, int]:
        out = self.make(n_in, **args, **factory)
        module, n_out = out if isinstance(out, tuple) else (out, n_in)
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"OpSpec {self.name!r}: make() must return a torch.nn.Module or (module, n_out)")
        return module, int(n_out)


def _extra_io(module) -> tuple[int, int]:
    if isinstance(module, fo.FusibleOperation):
        ops = module.basic_ops
        return sum(op.num_extra_inputs for op in ops), sum(op.num_extra_outputs for op in ops)
    return 0, 0


def _rows(lead) -> int:
    rows = 1
    for s in lead:
        rows *= s
    return rows


def _rand_splits(rows: int, groups: int, g: torch.Generator) -> torch.Tensor:
    if rows == 0:
        return torch.zeros(groups, dtype=torch.int64)
    cuts = torch.randint(0, rows + 1, (groups - 1,), generator=g).sort().values
    edges = torch.cat([torch.tensor([0]), cuts, torch.tensor([rows])])
    return (edges[1:] - edges[:-1]).to(torch.int64)


def _extra_like(lead, n, dtype, device, g, **args):
    """One extra input shaped like the op's input (a residual)."""
    return [torch.randn(*lead, n, generator=g).to(device, dtype).requires_grad_(True)]


def _split_sizes(lead, n, dtype, device, g, *, groups, **args):
    """Rows per expert. GroupedLinears with the same group count in one chain share the split
    sizes (one routing, as in a mixture-of-experts MLP; the fused grouped MLP requires it)."""
    shared = torch.Generator().manual_seed(g.initial_seed() * 1009 + groups)
    return [_rand_splits(_rows(lead), groups, shared).to(device)]


def _row_scales(lead, n, dtype, device, g, **args):
    return [torch.rand(*lead, generator=g).to(device, dtype).requires_grad_(True)]


def _even(n: int) -> bool:
    return n % 2 == 0


_SIZES = st.integers(1, 12)
_ACTIVATIONS = {
    "relu": lambda: fo.ReLU(),
    "gelu": lambda: fo.GELU(),
    "gelu_tanh": lambda: fo.GELU(approximate="tanh"),
    "silu": lambda: fo.SiLU(),
}
_GATED = {
    "swiglu": lambda: fo.SwiGLU(),
    "geglu": lambda: fo.GEGLU(),
    "geglu_tanh": lambda: fo.GEGLU(approximate="tanh"),
    "reglu": lambda: fo.ReGLU(),
}

#: The projection inserted before an op that does not accept the current width.
ADAPTER = OpSpec(
    "BasicLinear", lambda n, out, **f: (fo.BasicLinear(n, out, **f), out), args={"out": _SIZES}
)

#: The built-in catalogue (each entry equally likely; variants are drawn inside an entry).
BUILTIN_OPS: list[OpSpec] = [
    OpSpec("Linear", lambda n, out, bias, **f: (fo.Linear(n, out, bias, **f), out),
           args={"out": _SIZES, "bias": st.booleans()}),
    ADAPTER,
    OpSpec("Bias", lambda n, **f: fo.Bias(n, **f)),
    OpSpec("activation", lambda n, kind, **f: _ACTIVATIONS[kind](), args={"kind": st.sampled_from(list(_ACTIVATIONS))}),
    OpSpec("gated", lambda n, kind, **f: (_GATED[kind](), n // 2), args={"kind": st.sampled_from(list(_GATED))},
           accepts=_even),
    OpSpec("norm", lambda n, kind, **f: (fo.LayerNorm if kind == "layernorm" else fo.RMSNorm)(n, **f),
           args={"kind": st.sampled_from(["layernorm", "rmsnorm"])}),
    OpSpec("ConstantScale", lambda n, **f: fo.ConstantScale(0.5)),
    OpSpec("Dropout", lambda n, p, **f: fo.Dropout(p), args={"p": st.sampled_from([0.0, 0.25])}),
    OpSpec("Identity", lambda n, **f: fo.Identity()),
    OpSpec("AddExtraInput", lambda n, **f: fo.AddExtraInput(), extra=_extra_like),
    OpSpec("MakeExtraOutput", lambda n, **f: fo.MakeExtraOutput(), extra_outputs=True),
    OpSpec("GroupedLinear", lambda n, out, groups, bias, **f: (fo.GroupedLinear(groups, n, out, bias, **f), out),
           args={"out": _SIZES, "groups": st.integers(1, 4), "bias": st.booleans()}, extra=_split_sizes),
    OpSpec("ScaledSwiGLU", lambda n, **f: (fo.ScaledSwiGLU(), n // 2), extra=_row_scales, accepts=_even),
]


# --------------------------------------------------------------------------- chains
@dataclasses.dataclass
class Step:
    """One drawn op: its spec, input/output widths and drawn ``make`` arguments."""

    spec: OpSpec
    n_in: int
    n_out: int
    args: dict

    @property
    def name(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self.args.items())
        return f"{self.spec.name}({self.n_in}->{self.n_out}{extra})"

    def make(self, **factory) -> torch.nn.Module:
        return self.spec.build(self.n_in, self.args, **factory)[0]


@dataclasses.dataclass
class Chain:
    steps: list
    features: int  # input features

    @property
    def features_out(self) -> int:
        return self.steps[-1].n_out if self.steps else self.features

    def build(
        self, dtype=torch.float32, device="cpu", seed: int = 0, rules: Optional["fo.RuleSet"] = None
    ) -> "fo.Sequential":
        """A fresh ``fo.Sequential(..., rules=rules)`` of the chain's modules (parameters in
        ``dtype`` on ``device``, values redrawn from ``seed``: weights in [-1, 1], 1-D
        parameters in [0.5, 1.5], so values stay O(1)). ``rules``: the RuleSet to plan with
        (default: the global rules)."""
        torch.manual_seed(seed)
        mods = [s.make(dtype=dtype, device=device) for s in self.steps]
        seq = fo.Sequential(*mods, rules=rules)
        with torch.no_grad():
            for p in seq.parameters():
                p.uniform_(-1.0, 1.0) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        return seq

    def inputs(self, lead: tuple, dtype=torch.float32, device="cpu", seed: int = 0, x_requires_grad=True):
        """``(x, *extra_inputs)`` for a call: ``x`` of shape ``[*lead, features]``."""
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(*lead, self.features, generator=g).to(device, dtype).requires_grad_(x_requires_grad)
        extras = []
        for s in self.steps:
            if s.spec.extra is not None:
                extras.extend(s.spec.extra(lead, s.n_in, dtype, device, g, **s.args))
        return (x, *extras)

    def __repr__(self) -> str:
        return f"Chain(features={self.features}, steps={[s.name for s in self.steps]})"

    def _repr_pretty_(self, p, cycle) -> None:  # hypothesis' falsifying-example printer
        p.text(repr(self))


def _draw_step(draw, spec: OpSpec, n: int) -> Step:
    args = draw(spec.args_strategy(n))
    with torch.random.fork_rng(devices=[]):  # a probe build: leave torch's RNG as it was
        module, n_out = spec.build(n, args)
    n_ex_in, n_ex_out = _extra_io(module)
    if n_ex_in and spec.extra is None:
        raise ValueError(f"OpSpec {spec.name!r} makes an op with {n_ex_in} extra input(s) but has no extra=")
    if bool(n_ex_out) != spec.extra_outputs:
        raise ValueError(
            f"OpSpec {spec.name!r}: the op has {n_ex_out} extra output(s) but extra_outputs={spec.extra_outputs}"
        )
    if n_out < 1:
        raise ValueError(f"OpSpec {spec.name!r}: output width {n_out} for input width {n}")
    return Step(spec, n, n_out, args)


@st.composite
def chains(
    draw,
    ops: Optional[list] = None,
    max_len: int = 5,
    features=st.integers(1, 12),
    allow_extra: bool = True,
    min_len: int = 1,
) -> Chain:
    """A random chain of ops with compatible feature sizes, drawn from the catalogue ``ops``
    (a list of :class:`OpSpec`; default :data:`BUILTIN_OPS`; repeat an entry to draw it more
    often). ``features``: the input width; ``allow_extra=False`` skips ops with extra inputs or
    outputs. Ops whose ``accepts`` rejects the current width get a ``BasicLinear`` projection
    before them."""
    catalogue = list(BUILTIN_OPS if ops is None else ops)
    if not allow_extra:
        catalogue = [s for s in catalogue if not s.has_extra_io]
    if not catalogue:
        raise ValueError("chains(): empty op catalogue")
    n = draw(features)
    start, steps = n, []
    for _ in range(draw(st.integers(min_len, max_len))):
        spec = draw(st.sampled_from(catalogue))
        if spec.accepts is not None and not spec.accepts(n):
            if spec.accepts(2 * n):
                m = 2 * n
            else:
                widths = [k for k in range(1, 25) if spec.accepts(k)]
                if not widths:
                    raise ValueError(f"OpSpec {spec.name!r} accepts no width in 1..24")
                m = draw(st.sampled_from(widths))
            steps.append(Step(ADAPTER, n, m, {"out": m}))
            n = m
        step = _draw_step(draw, spec, n)
        steps.append(step)
        n = step.n_out
    return Chain(steps, start)
