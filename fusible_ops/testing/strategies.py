"""Hypothesis strategies for property tests of op chains (usable for users' own ops too).

``chains()`` draws a :class:`Chain`: a list of module factories with compatible feature sizes
plus what their extra inputs need. ``Chain.build(dtype, device)`` returns a fresh
``Sequential`` and ``Chain.inputs(rows, dtype, device)`` its inputs.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
from hypothesis import strategies as st

import fusible_ops as fo

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def dtypes(include_float64: bool = False):
    """Floating dtypes the ops support (float64 is the reference precision)."""
    return st.sampled_from(DTYPES + ((torch.float64,) if include_float64 else ()))


def leading_shapes(max_rows: int = 9):
    """Leading dims of an input: [rows] or [a, b] (odd sizes such as 3 and 5 are common)."""
    return st.one_of(
        st.tuples(st.integers(1, max_rows)),
        st.tuples(st.integers(1, 3), st.integers(1, 5)),
    )


@dataclasses.dataclass
class Step:
    """One module factory in a chain. ``extra`` makes its extra inputs from (lead shape, features
    in, dtype, device, generator); ``None`` for ops without extra inputs."""

    name: str
    make: Callable[..., torch.nn.Module]
    extra: Optional[Callable] = None
    features_in: int = 0


@dataclasses.dataclass
class Chain:
    steps: list
    features: int  # input features

    def build(self, dtype=torch.float32, device="cpu", seed: int = 0) -> "fo.Sequential":
        torch.manual_seed(seed)
        mods = [s.make(dtype=dtype, device=device) for s in self.steps]
        seq = fo.Sequential(*mods)
        with torch.no_grad():  # keep values O(1): random weights, not only the init
            for p in seq.parameters():
                p.uniform_(-1.0, 1.0) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        return seq

    def inputs(self, lead: tuple, dtype=torch.float32, device="cpu", seed: int = 0, x_requires_grad=True):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(*lead, self.features, generator=g).to(device, dtype).requires_grad_(x_requires_grad)
        extras = []
        for s in self.steps:
            if s.extra is not None:
                extras.extend(s.extra(lead, s.features_in, dtype, device, g))
        return (x, *extras)

    def __repr__(self) -> str:
        return f"Chain(features={self.features}, steps={[s.name for s in self.steps]})"


def _rand_splits(rows: int, groups: int, g: torch.Generator) -> torch.Tensor:
    if rows == 0:
        return torch.zeros(groups, dtype=torch.int64)
    cuts = torch.randint(0, rows + 1, (groups - 1,), generator=g).sort().values
    edges = torch.cat([torch.tensor([0]), cuts, torch.tensor([rows])])
    return (edges[1:] - edges[:-1]).to(torch.int64)


def _extra_like(lead, n, dtype, device, g):
    return [torch.randn(*lead, n, generator=g).to(device, dtype).requires_grad_(True)]


@st.composite
def chains(draw, max_len: int = 5, features=st.integers(1, 12), allow_extra: bool = True) -> Chain:
    """A random chain of basic ops (and ``Linear``) with compatible feature sizes."""
    n = draw(features)
    start = n
    steps = []
    length = draw(st.integers(1, max_len))
    kinds = ["linear", "basic_linear", "bias", "act", "gated", "norm", "scale", "dropout", "identity"]
    if allow_extra:
        kinds += ["add", "extra_out", "grouped", "scaled_swiglu"]
    for _ in range(length):
        kind = draw(st.sampled_from(kinds))
        n_in = n
        if kind == "linear":
            m = draw(st.integers(1, 12))
            bias = draw(st.booleans())
            steps.append(Step(f"Linear({n},{m},bias={bias})", lambda n=n, m=m, b=bias, **f: fo.Linear(n, m, b, **f)))
            n = m
        elif kind == "basic_linear":
            m = draw(st.integers(1, 12))
            steps.append(Step(f"BasicLinear({n},{m})", lambda n=n, m=m, **f: fo.BasicLinear(n, m, **f)))
            n = m
        elif kind == "bias":
            steps.append(Step(f"Bias({n})", lambda n=n, **f: fo.Bias(n, **f)))
        elif kind == "act":
            cls = draw(st.sampled_from(["relu", "gelu", "gelu_tanh", "silu"]))
            make = {
                "relu": lambda **f: fo.ReLU(),
                "gelu": lambda **f: fo.GELU(),
                "gelu_tanh": lambda **f: fo.GELU(approximate="tanh"),
                "silu": lambda **f: fo.SiLU(),
            }[cls]
            steps.append(Step(cls, make))
        elif kind == "gated":
            if n % 2:
                steps.append(Step(f"BasicLinear({n},{2 * n})", lambda n=n, **f: fo.BasicLinear(n, 2 * n, **f)))
                n = 2 * n
            cls = draw(st.sampled_from(["swiglu", "geglu", "geglu_tanh", "reglu"]))
            make = {
                "swiglu": lambda **f: fo.SwiGLU(),
                "geglu": lambda **f: fo.GEGLU(),
                "geglu_tanh": lambda **f: fo.GEGLU(approximate="tanh"),
                "reglu": lambda **f: fo.ReGLU(),
            }[cls]
            steps.append(Step(cls, make))
            n //= 2
        elif kind == "scaled_swiglu":
            if n % 2:
                steps.append(Step(f"BasicLinear({n},{2 * n})", lambda n=n, **f: fo.BasicLinear(n, 2 * n, **f)))
                n = 2 * n
            steps.append(
                Step(
                    "ScaledSwiGLU",
                    lambda **f: fo.ScaledSwiGLU(),
                    lambda lead, k, dt, dev, g: [torch.rand(*lead, generator=g).to(dev, dt).requires_grad_(True)],
                )
            )
            n //= 2
        elif kind == "norm":
            cls = draw(st.sampled_from(["layernorm", "rmsnorm"]))
            make = (lambda n=n, **f: fo.LayerNorm(n, **f)) if cls == "layernorm" else (lambda n=n, **f: fo.RMSNorm(n, **f))
            steps.append(Step(f"{cls}({n})", make))
        elif kind == "scale":
            steps.append(Step("ConstantScale", lambda **f: fo.ConstantScale(0.5)))
        elif kind == "dropout":
            p = draw(st.sampled_from([0.0, 0.25]))
            steps.append(Step(f"Dropout({p})", lambda p=p, **f: fo.Dropout(p)))
        elif kind == "identity":
            steps.append(Step("Identity", lambda **f: fo.Identity()))
        elif kind == "add":
            steps.append(Step("AddExtraInput", lambda **f: fo.AddExtraInput(), _extra_like, n))
        elif kind == "extra_out":
            steps.append(Step("MakeExtraOutput", lambda **f: fo.MakeExtraOutput()))
        elif kind == "grouped":
            m = draw(st.integers(1, 12))
            groups = draw(st.integers(1, 4))
            bias = draw(st.booleans())

            def extra(lead, k, dt, dev, g, groups=groups):
                rows = 1
                for s in lead:
                    rows *= s
                return [_rand_splits(rows, groups, g).to(dev)]

            steps.append(
                Step(
                    f"GroupedLinear({groups},{n},{m})",
                    lambda n=n, m=m, G=groups, b=bias, **f: fo.GroupedLinear(G, n, m, b, **f),
                    extra,
                    n,
                )
            )
            n = m
    return Chain(steps, start)
