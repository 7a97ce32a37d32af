"""Pure-torch ``*_ref`` twins of :mod:`fusible_ops.kernels.activation`, and what both share:
the activation kinds, argument checks and the NaN/Inf contract.

NaN / Inf contract (both paths, forward and backward): what ``torch.relu``,
``torch.nn.functional.gelu(approximate=...)``, ``torch.nn.functional.silu`` and their autograd
gradients give in float32 / float64 (measured with torch 2.13 on CPU; ``g`` = act'(z), i.e. the
gradient for an upstream gradient of 1):

=============  ===============  ===============  ===============
act            z = NaN          z = +Inf         z = -Inf
=============  ===============  ===============  ===============
relu           y NaN, g 1       y +Inf, g 1      y 0, g 0
gelu (erf)     y NaN, g NaN     y +Inf, g NaN    y NaN, g NaN
gelu (tanh)    y NaN, g NaN     y +Inf, g NaN    y NaN, g NaN
silu           y NaN, g NaN     y +Inf, g NaN    y NaN, g NaN
=============  ===============  ===============  ===============

* relu's backward is a select (torch's ``threshold_backward``): ``dz = 0 where z <= 0 else
  dy``, so a NaN/Inf ``dy`` gives 0 where z <= 0, and ``dy`` passes at z = NaN. Every other
  gradient is a product (``dy * act'(z)``), so NaN/Inf ``dy`` propagate.
* gated kinds are ``act(a) * b`` under torch's autograd: ``da = (dy * b) act'(a)`` (relu: the
  select), ``db = dy * act(a)``; ``inf * 0`` is NaN as in torch.
* dropout multiplies (``y * keep / (1 - p)``, as ``torch.nn.functional.dropout``): a NaN/Inf
  value stays NaN where dropped; backward multiplies ``dy`` by the same factor.
* exception in torch itself: float32 ``gelu(+Inf)`` on CPU is NaN in torch's vectorized kernel
  (its scalar tail, float64 and CUDA give +Inf); we give +Inf everywhere.

The fast formulas stay (Chebyshev erfc for exact GELU, tanh via exp); each saturates to the
values above at +-Inf and propagates NaN, and relu selects on ``z <= 0`` (False for NaN).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from fusible_ops.kernels.act_table import ACT_IDS, GLU_BASE, act_and_grad_ref
from fusible_ops.kernels.dropout import check_p_seed, dropout_keep_mask, keep_scale
from fusible_ops.kernels.launch import cast_to, compute_dtype

ACTIVATIONS: tuple[str, ...] = ("relu", "gelu", "gelu_tanh", "silu", "swiglu", "geglu", "geglu_tanh", "reglu")
GATED: frozenset[str] = frozenset({"swiglu", "geglu", "geglu_tanh", "reglu"})


def _base(kind: str) -> str:
    """The activation of ``kind`` (its own name, or the GLU's activation)."""
    return GLU_BASE[kind] if kind in GATED else kind


# kind -> (ACT constexpr of the kernels, gated, base activation): one dict read per call
_KINDS: dict[str, tuple[int, bool, str]] = {k: (ACT_IDS[_base(k)], k in GATED, _base(k)) for k in ACTIVATIONS}


def _kind(kind: str) -> tuple[int, bool, str]:
    info = _KINDS.get(kind)
    if info is None:
        raise ValueError(f"unknown activation kind {kind!r}; expected one of {ACTIVATIONS}")
    return info


def check_kind(kind: str) -> tuple[int, bool]:
    """(``ACT`` constexpr of the kernels, gated) for an activation kind; ValueError if unknown."""
    return _kind(kind)[:2]


def out_cols(x: torch.Tensor, gated: bool) -> int:
    """Columns of the activation's output for input ``x`` (half of an even last dim if gated)."""
    n = x.shape[-1]
    if gated and n % 2:
        raise ValueError(f"gated activation needs an even last dim, got {n}")
    return n // 2 if gated else n


def check_bias_act(x, bias, kind, dropout_p, seed) -> tuple[int, bool, str]:
    """Argument checks of ``bias_act_fwd`` / ``bias_act_bwd`` (both paths); returns
    ``(ACT constexpr, gated, base activation)`` of ``kind``."""
    info = _kind(kind)
    if x.dim() < 1:
        raise ValueError("bias_act: x must have at least one dimension")
    out_cols(x, info[1])
    if bias is not None and tuple(bias.shape) != (x.shape[-1],):
        raise ValueError(f"bias_act: bias shape {tuple(bias.shape)} != ({x.shape[-1]},)")
    check_p_seed(dropout_p, seed)
    return info


def check_scales(x, scales) -> None:
    """Argument checks of the scaled SwiGLU (both paths)."""
    out_cols(x, True)
    if tuple(scales.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"scaled_swiglu: scales shape {tuple(scales.shape)} != {tuple(x.shape[:-1])}")



def _has_posinf(z: torch.Tensor) -> bool:
    """Whether CPU tensor ``z`` may hold +Inf: its maximum (one reduction, no sync on CPU; cheaper
    than ``isposinf(z).any()``) is +Inf, or NaN (which hides an Inf: then the exact test).
    Always True when traced (no data-dependent branch)."""
    if torch.compiler.is_compiling():
        return True
    if z.numel() == 0:
        return False
    m = z.detach().max().item()
    return m == _INF or (m != m and bool(torch.isposinf(z).any()))


_INF = float("inf")
_silu = torch._C._nn.silu


def act_ref(z: torch.Tensor, name: str) -> torch.Tensor:
    """act(z) with torch's own kernels (one op each on the host path; the kernels' formulas are
    :func:`~fusible_ops.kernels.act_table.act_and_grad_ref`). Exact GELU of +Inf is +Inf (torch's
    vectorized float32 CPU kernel gives NaN there)."""
    if name == "gelu":
        y = F.gelu(z)
        if z.dtype == torch.float32 and not z.is_cuda and _has_posinf(z):
            y = torch.where(torch.isposinf(z), z, y)
        return y
    if name == "silu":
        return _silu(z)  # (F.silu's body without its Python wrapper)
    if name == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    if name == "relu":
        return torch.relu(z)
    raise ValueError(f"unknown activation {name!r}; expected one of {sorted(ACT_IDS)}")


def act_native(x: torch.Tensor, kind: str) -> torch.Tensor:
    """``act(x)`` (gated kinds: act of the first half times the second) with torch's own ops in
    x's dtype, for callers that need neither the kernels' fp32 math nor a dropout: the
    :func:`bias_act_fwd_ref` math without its argument checks and casts, for float32/float64
    x already checked (an even last dim for gated kinds). Differentiable."""
    _, gated, base = _kind(kind)
    if gated:
        a, b = x.chunk(2, -1)
        return act_ref(a, base) * b
    return act_ref(x, base)


def act_backward_ref(up: torch.Tensor, z: torch.Tensor, name: str) -> torch.Tensor:
    """The gradient ``up`` taken through act at z, with torch's own backward kernels (relu:
    ``threshold_backward``, 0 where z <= 0; the others multiply by act'(z))."""
    if name == "gelu":
        return torch.ops.aten.gelu_backward(up, z)
    if name == "silu":
        return torch.ops.aten.silu_backward(up, z)
    if name == "gelu_tanh":
        return torch.ops.aten.gelu_backward(up, z, approximate="tanh")
    if name == "relu":
        return torch.ops.aten.threshold_backward(up, z, 0)
    raise ValueError(f"unknown activation {name!r}; expected one of {sorted(ACT_IDS)}")


def _z_ref(x, bias, cd):
    z = cast_to(x, cd)
    return z + cast_to(bias, cd) if bias is not None else z


def _drop_factor_ref(shape, dropout_p, seed, device, cd) -> torch.Tensor:
    """``keep / (1 - p)`` (0 where dropped) in ``cd`` (dropout_p > 0)."""
    keep = dropout_keep_mask(shape, dropout_p, seed, device)
    return torch.where(keep, torch.tensor(keep_scale(dropout_p), dtype=cd, device=device),
                       torch.zeros((), dtype=cd, device=device))


def bias_act_fwd_ref(
    x: torch.Tensor, bias: Optional[torch.Tensor], kind: str, *, dropout_p: float = 0.0,
    seed: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Pure-torch :func:`~fusible_ops.kernels.activation.bias_act_fwd` (fp32 math, fp64 for fp64
    x; same dropout mask, computed from the seed tensor with tensor ops only)."""
    _, gated, base = check_bias_act(x, bias, kind, dropout_p, seed)
    cd = compute_dtype(x.dtype)
    z = _z_ref(x, bias, cd)
    if gated:
        a, b = z.chunk(2, -1)
        y = act_ref(a, base) * b
    else:
        y = act_ref(z, base)
    if dropout_p > 0.0:
        y = y * _drop_factor_ref(y.shape, dropout_p, seed, x.device, cd)
    return cast_to(y, x.dtype)


def bias_act_bwd_ref(
    dy: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor], kind: str, need_dbias: bool,
    *, dropout_p: float = 0.0, seed: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Pure-torch :func:`~fusible_ops.kernels.activation.bias_act_bwd` (fp32 math, fp64 for fp64
    x; same dropout mask)."""
    _, gated, base = check_bias_act(x, bias, kind, dropout_p, seed)
    cd = compute_dtype(x.dtype)
    z = _z_ref(x, bias, cd)
    g = cast_to(dy, cd)
    if dropout_p > 0.0:
        g = g * _drop_factor_ref(g.shape, dropout_p, seed, x.device, cd)
    if gated:
        a, b = z.chunk(2, -1)  # (even last dim: checked)
        dz = torch.cat([act_backward_ref(g * b, a, base), g * act_ref(a, base)], dim=-1)
    else:
        dz = act_backward_ref(g, z, base)
    dbias = None
    if need_dbias and bias is not None:
        lead = dz.dim() - 1
        dbias = cast_to(dz.clone() if lead == 0 else dz.sum(0) if lead == 1 else dz.flatten(0, -2).sum(0), bias.dtype)
    return cast_to(dz, x.dtype), dbias


def scaled_swiglu_fwd_ref(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Pure-torch :func:`~fusible_ops.kernels.activation.scaled_swiglu_fwd` (fp32, fp64 for fp64)."""
    check_scales(x, scales)
    cd = compute_dtype(x.dtype)
    a, b = x.to(cd).chunk(2, -1)
    return (torch.nn.functional.silu(a) * b * scales.to(cd)[..., None]).to(x.dtype)


def scaled_swiglu_bwd_ref(
    dy: torch.Tensor, x: torch.Tensor, scales: torch.Tensor, need_dscales: bool
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Pure-torch :func:`~fusible_ops.kernels.activation.scaled_swiglu_bwd` (fp32, fp64 for fp64)."""
    check_scales(x, scales)
    cd = compute_dtype(x.dtype)
    a, b = x.to(cd).chunk(2, -1)
    dyc = dy.to(cd)
    act_a, dact_a = act_and_grad_ref(a, "silu", True)
    g = dyc * scales.to(cd)[..., None]
    dx = torch.cat([g * b * dact_a, g * act_a], dim=-1).to(x.dtype)
    dscales = (dyc * act_a * b).sum(-1).to(scales.dtype) if need_dscales else None
    return dx, dscales


__all__ = [
    "ACTIVATIONS",
    "act_native",
    "GATED",
    "check_bias_act",
    "check_kind",
    "check_scales",
    "out_cols",
    "bias_act_bwd_ref",
    "bias_act_fwd_ref",
    "scaled_swiglu_bwd_ref",
    "scaled_swiglu_fwd_ref",
]
