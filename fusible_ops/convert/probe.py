"""Numerical probes: what a module computes, told by running it on small random inputs.

:func:`fusible_ops.convert` recognizes modules by structure (their parameters and children), then
confirms the math by running the module, under ``torch.func.functional_call`` with random
parameters of the real shapes (so the model's own weights are neither read nor copied, and a
zero-initialised projection cannot hide which input is which), against the math of the fusible
ops that would replace it. Each probe returns what it found, or a reason (a string) saying why
the module is not that. Probes run in float32 on the parameters' device (CPU for ``meta``
parameters) under ``torch.no_grad()``, and never change the module.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

from ..testing.tolerances import TOLERANCES

PROBE_ROWS = 6
"""Rows of the random probe inputs (shape ``[2, PROBE_ROWS // 2, features]``)."""

EPS_ATTRS = ("variance_epsilon", "eps", "epsilon")
"""Attribute names a norm's epsilon is read from, in order."""

# The activations the fused ops implement: name -> (plain math, gated fusible op's kind, plain op's kind)
ACTIVATIONS: dict[str, Callable] = {
    "silu": F.silu,
    "gelu": lambda x: F.gelu(x),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": torch.relu,
}


def probe_device(module: torch.nn.Module) -> torch.device:
    """Where probes of ``module`` run: its first parameter's device, CPU for ``meta`` (or none)."""
    for p in module.parameters():
        return torch.device("cpu") if p.device.type == "meta" else p.device
    return torch.device("cpu")


def _gen(device: torch.device, seed: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def rand(shape, device, seed: int, low: Optional[float] = None, high: Optional[float] = None) -> torch.Tensor:
    """A float32 random tensor (normal, or uniform in [low, high)) from a fixed seed."""
    g = _gen(device, seed)
    if low is None:
        return torch.randn(*shape, generator=g, device=device)
    return torch.rand(*shape, generator=g, device=device) * (high - low) + low


def close(actual, expected, dtype=torch.float32) -> bool:
    """``actual`` matches ``expected`` within the tolerance table's entry for ``dtype`` (False for
    anything that is not a tensor of the expected shape)."""
    if not isinstance(actual, torch.Tensor) or actual.shape != expected.shape:
        return False
    rtol, atol = TOLERANCES[dtype]
    return bool(torch.allclose(actual.detach().double(), expected.detach().double(), rtol=rtol, atol=atol))


def max_err(actual, expected) -> str:
    if not isinstance(actual, torch.Tensor) or actual.shape != expected.shape:
        got = f"shape {list(actual.shape)}" if isinstance(actual, torch.Tensor) else type(actual).__name__
        return f"returned {got}, expected shape {list(expected.shape)}"
    return f"max error {(actual.double() - expected.double()).abs().max().item():.2e}"


def run(module: torch.nn.Module, params: dict, x: torch.Tensor):
    """``module(x)`` with ``params`` in place of its parameters (``functional_call``), no grad.
    Returns the output or the exception raised."""
    try:
        with torch.no_grad():
            return torch.func.functional_call(module, params, (x,))
    except Exception as e:  # (a probe that fails is an answer: the module is not what was tested)
        return e


# -- activations -------------------------------------------------------------------------------
def identify_activation(fn: Callable) -> Union[str, tuple]:
    """The name in :data:`ACTIVATIONS` of what ``fn`` (a module or function) computes elementwise,
    or ``(None, reason)``. Probed in float64 (float32 if ``fn`` refuses it) on a grid over [-6, 6]
    and random points, where the exact and tanh GELUs differ by up to 5e-4."""
    for dtype in (torch.float64, torch.float32):
        x = torch.cat([torch.linspace(-6, 6, 97, dtype=dtype), rand((64,), "cpu", 7).to(dtype) * 3])
        try:
            with torch.no_grad():
                y = fn(x)
        except Exception as e:
            reason = f"the activation raised {type(e).__name__}: {e}"
            continue
        for name, ref in ACTIVATIONS.items():
            if close(y, ref(x), dtype):
                return name
        return None, "the activation is none of silu, gelu, gelu(tanh), relu"
    return None, reason


def find_activation(module: torch.nn.Module, free: list) -> Union[tuple, str]:
    """``(attribute name, callable)`` of ``module``'s activation, or a reason: its one
    parameter-free child (``free``: the ``(name, child)`` pairs of its parameter-free children),
    else its one public function attribute (``self.act = F.silu``)."""
    if len(free) == 1:
        return free[0]
    if free:
        return f"more than one parameter-free child ({', '.join(n for n, _ in free)})"
    fns = [(k, v) for k, v in module.__dict__.items()
           if callable(v) and not isinstance(v, (type, torch.Tensor, torch.nn.Module)) and not k.startswith("_")]
    if len(fns) == 1:
        return fns[0]
    return "no activation (a parameter-free child module or one function attribute)"


# -- linear layers -------------------------------------------------------------------------------
_CONV1D = "a Conv1D-style layer (weight [in, out], x @ weight + bias) is not converted"


def linear_spec(module: torch.nn.Module) -> Union[tuple, str]:
    """``(in_features, out_features, has_bias)`` when ``module`` is a leaf computing
    ``x @ weight.T + bias`` (``torch.nn.Linear``'s layout, weight [out, in]); else a reason."""
    if module._modules:
        return "has child modules"
    params = dict(module.named_parameters(recurse=False))
    w, b = params.get("weight"), params.get("bias")
    if w is None or w.dim() != 2 or set(params) - {"weight", "bias"}:
        return "parameters are not a 2-D weight and an optional bias"
    out_f, in_f = w.shape
    if b is not None and tuple(b.shape) != (out_f,):
        if tuple(b.shape) == (in_f,):
            return f"weight {list(w.shape)} with bias {list(b.shape)}: {_CONV1D}"
        return f"bias shape {list(b.shape)} does not match the weight's {out_f} outputs"
    dev = probe_device(module)
    pw = {"weight": rand(w.shape, dev, 1)}
    if b is not None:
        pw["bias"] = rand(b.shape, dev, 2)
    x = rand((2, PROBE_ROWS // 2, in_f), dev, 3)
    y = run(module, pw, x)
    if isinstance(y, Exception) or not close(y, F.linear(x, pw["weight"], pw.get("bias"))):
        why = f"raised {type(y).__name__}" if isinstance(y, Exception) else max_err(y, F.linear(x, pw["weight"], pw.get("bias")))
        return f"does not compute x @ weight.T + bias with weight [out, in] ({why}; {_CONV1D})"
    return in_f, out_f, b is not None


# -- norms ---------------------------------------------------------------------------------------
def norm_eps(module: torch.nn.Module) -> Union[float, str]:
    """The module's epsilon (the first of :data:`EPS_ATTRS` it has), or a reason."""
    for name in EPS_ATTRS:
        v = getattr(module, name, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
        if name in module.__dict__ and v is None:
            return f"{name}=None (an epsilon that depends on the input dtype)"
    return "no epsilon attribute (" + ", ".join(EPS_ATTRS) + ")"


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _layer_norm(x, w, b, eps):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def probe_norm(module: torch.nn.Module, eps: float, has_bias: bool) -> Union[tuple, str]:
    """``(kind, out_dtype_rule)`` when ``module`` computes fusible_ops' ``RMSNorm`` (no bias) or
    ``LayerNorm`` (bias) math with epsilon ``eps`` inside the square root; else a reason.

    Two inputs: one at unit scale and one whose mean square is about ``eps`` (where the place of
    epsilon changes the result). ``out_dtype_rule``: ``"promote"`` when a bf16 input with float32
    weights gives a float32 output (Hugging Face's ``weight * x.to(input_dtype)``), ``"input"``
    when it gives bf16 (``torch.nn.RMSNorm``), None when the module refuses that mix."""
    w = next(p for n, p in module.named_parameters(recurse=False) if n == "weight")
    size = w.shape[0]
    dev = probe_device(module)
    params = {"weight": rand((size,), dev, 11, 0.5, 1.5)}
    if has_bias:
        params["bias"] = rand((size,), dev, 12, -0.5, 0.5)
    kind = "LayerNorm" if has_bias else "RMSNorm"
    for scale_seed, scale in ((21, 1.0), (22, math.sqrt(max(eps, 1e-30)))):
        x = rand((2, PROBE_ROWS // 2, size), dev, scale_seed) * scale + (0.3 * scale if has_bias else 0.0)
        y = run(module, params, x)
        if isinstance(y, Exception):
            return f"raised {type(y).__name__} on a probe input: {y}"
        ref = _layer_norm(x, params["weight"], params["bias"], eps) if has_bias else _rms(x, params["weight"], eps)
        if not close(y, ref):
            if not has_bias and close(y, _rms(x, 1.0 + params["weight"], eps)):
                return "computes x_normed * (1 + weight) (a Gemma-style offset weight): no fused op has that form"
            if not has_bias and close(y, _layer_norm(x, params["weight"], None, eps)):
                return "subtracts the mean (a LayerNorm without bias): fusible_ops' LayerNorm has a bias"
            what = "the LayerNorm" if has_bias else "x / sqrt(mean(x^2) + eps) * weight"
            return f"does not compute {what} with eps={eps:g} ({max_err(y, ref)} at input scale {scale:.2g})"
    x16 = rand((2, 2, size), dev, 23).to(torch.bfloat16)
    y = run(module, params, x16)
    rule = None if isinstance(y, Exception) else ("promote" if y.dtype == torch.float32 else "input")
    return kind, rule


# -- MLPs ----------------------------------------------------------------------------------------
def probe_mlp(module: torch.nn.Module, linears: dict, act: Callable, gated: Optional[tuple], seed: int = 31):
    """Whether ``module`` computes the MLP described: ``linears`` maps child names to
    ``(in, out, has_bias)``; ``gated`` is ``(gate, up, down)`` (names; ``up`` None for one fused
    ``[2f, d]`` projection whose first half is the gate) or None for ``fc2(act(fc1(x)))`` with the
    names in call order. Returns None when it does, else a reason."""
    dev = probe_device(module)
    params, k = {}, seed
    for name, (i, o, b) in linears.items():
        params[f"{name}.weight"] = rand((o, i), dev, k) / math.sqrt(i)
        if b:
            params[f"{name}.bias"] = rand((o,), dev, k + 1)
        k += 2

    def lin(name, x):
        return F.linear(x, params[f"{name}.weight"], params.get(f"{name}.bias"))

    first = next(iter(linears.values()))
    x = rand((2, PROBE_ROWS // 2, first[0]), dev, seed - 1)
    if gated is None:
        a, b = linears
        ref = lin(b, act(lin(a, x)))
    else:
        g, u, d = gated
        h = lin(g, x)
        gate, up = (h.chunk(2, dim=-1) if u is None else (h, lin(u, x)))
        ref = lin(d, act(gate) * up)
    y = run(module, params, x)
    if isinstance(y, Exception):
        return f"raised {type(y).__name__} on a probe input: {y}"
    if close(y, ref):
        return None
    return max_err(y, ref)


__all__ = ["ACTIVATIONS", "EPS_ATTRS", "close", "find_activation", "identify_activation", "linear_spec", "norm_eps",
           "probe_mlp", "probe_norm", "rand", "run"]
