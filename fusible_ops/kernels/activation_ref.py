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

from fusible_ops.kernels.dropout import _check_p_seed, _keep_scale, dropout_keep_mask

ACTIVATIONS: tuple[str, ...] = ("relu", "gelu", "gelu_tanh", "silu", "swiglu", "geglu", "geglu_tanh", "reglu")
GATED: frozenset[str] = frozenset({"swiglu", "geglu", "geglu_tanh", "reglu"})

# kind -> (elementwise activation, gated); ids used as tl.constexpr in the kernels
_BASE = {
    "relu": ("relu", False), "gelu": ("gelu", False), "gelu_tanh": ("gelu_tanh", False),
    "silu": ("silu", False), "swiglu": ("silu", True), "geglu": ("gelu", True),
    "geglu_tanh": ("gelu_tanh", True), "reglu": ("relu", True),
}
_ACT_ID = {"relu": 0, "gelu": 1, "gelu_tanh": 2, "silu": 3}

_SQRT_HALF = 0.7071067811865476  # 1/sqrt(2)
_INV_SQRT_2PI = 0.3989422804014327  # 1/sqrt(2 pi)
_SQRT_2_OVER_PI = 0.7978845608028654  # sqrt(2/pi)
_GELU_C = 0.044715


def _check_kind(kind: str) -> tuple[int, bool]:
    if kind not in _BASE:
        raise ValueError(f"unknown activation kind {kind!r}; expected one of {ACTIVATIONS}")
    base, gated = _BASE[kind]
    return _ACT_ID[base], gated


def _out_cols(x: torch.Tensor, gated: bool) -> int:
    n = x.shape[-1]
    if gated and n % 2:
        raise ValueError(f"gated activation needs an even last dim, got {n}")
    return n // 2 if gated else n


def _check_bias_act(x, bias, kind, dropout_p, seed):
    _, gated = _check_kind(kind)
    if x.dim() < 1:
        raise ValueError("bias_act: x must have at least one dimension")
    _out_cols(x, gated)
    if bias is not None and tuple(bias.shape) != (x.shape[-1],):
        raise ValueError(f"bias_act: bias shape {tuple(bias.shape)} != ({x.shape[-1]},)")
    _check_p_seed(dropout_p, seed)


def _check_scales(x, scales):
    _out_cols(x, True)
    if tuple(scales.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"scaled_swiglu: scales shape {tuple(scales.shape)} != {tuple(x.shape[:-1])}")


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _act_and_grad_ref(z: torch.Tensor, base: str, need_grad: bool):
    """(act(z), act'(z) or None), the kernel's formulas; apply act' with :func:`_dact_ref`."""
    g = None
    if base == "relu":
        y = torch.relu(z)  # NaN stays NaN
        if need_grad:
            g = torch.where(z <= 0, 0.0, 1.0).to(z.dtype)  # 1 at NaN, like torch
    elif base == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(z * _SQRT_HALF))
        y = z * cdf
        if need_grad:
            g = cdf + z * torch.exp(-0.5 * z * z) * _INV_SQRT_2PI
    elif base == "gelu_tanh":
        t = torch.tanh(_SQRT_2_OVER_PI * (z + _GELU_C * z * z * z))
        y = 0.5 * z * (1.0 + t)
        if need_grad:
            g = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * _GELU_C * z * z)
    else:  # silu
        s = torch.sigmoid(z)
        y = z * s
        if need_grad:
            g = s * (1.0 + z * (1.0 - s))
    return y, g


def _dact_ref(up: torch.Tensor, z: torch.Tensor, g: torch.Tensor, base: str) -> torch.Tensor:
    """The upstream gradient ``up`` taken through the activation at z: relu selects (torch's
    threshold_backward: 0 where z <= 0 even for NaN/Inf ``up``), the others multiply."""
    if base == "relu":
        return torch.where(z <= 0, torch.zeros((), dtype=up.dtype, device=up.device), up)
    return up * g


def _halves(z):
    h = z.shape[-1] // 2
    return z[..., :h], z[..., h:]


def _z_ref(x, bias, cd):
    z = x.to(cd)
    return z + bias.to(cd) if bias is not None else z


def _drop_factor_ref(shape, dropout_p, seed, device, cd) -> Optional[torch.Tensor]:
    """``keep / (1 - p)`` (0 where dropped) in ``cd``, or None without dropout."""
    if dropout_p <= 0.0:
        return None
    keep = dropout_keep_mask(shape, dropout_p, seed, device)
    return torch.where(keep, torch.tensor(_keep_scale(dropout_p), dtype=cd, device=device),
                       torch.zeros((), dtype=cd, device=device))


def bias_act_fwd_ref(
    x: torch.Tensor, bias: Optional[torch.Tensor], kind: str, *, dropout_p: float = 0.0,
    seed: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Pure-torch :func:`~fusible_ops.kernels.activation.bias_act_fwd` (fp32 math, fp64 for fp64
    x; same dropout mask, computed from the seed tensor with tensor ops only)."""
    _check_bias_act(x, bias, kind, dropout_p, seed)
    base, gated = _BASE[kind]
    cd = _compute_dtype(x)
    z = _z_ref(x, bias, cd)
    if gated:
        a, b = _halves(z)
        y = _act_and_grad_ref(a, base, False)[0] * b
    else:
        y = _act_and_grad_ref(z, base, False)[0]
    m = _drop_factor_ref(y.shape, dropout_p, seed, x.device, cd)
    if m is not None:
        y = y * m
    return y.to(x.dtype)


def bias_act_bwd_ref(
    dy: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor], kind: str, need_dbias: bool,
    *, dropout_p: float = 0.0, seed: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Pure-torch :func:`~fusible_ops.kernels.activation.bias_act_bwd` (fp32 math, fp64 for fp64
    x; same dropout mask)."""
    _check_bias_act(x, bias, kind, dropout_p, seed)
    base, gated = _BASE[kind]
    cd = _compute_dtype(x)
    z = _z_ref(x, bias, cd)
    g = dy.to(cd)
    m = _drop_factor_ref(g.shape, dropout_p, seed, x.device, cd)
    if m is not None:
        g = g * m
    if gated:
        a, b = _halves(z)
        act_a, dact_a = _act_and_grad_ref(a, base, True)
        dz = torch.cat([_dact_ref(g * b, a, dact_a, base), g * act_a], dim=-1)
    else:
        dz = _dact_ref(g, z, _act_and_grad_ref(z, base, True)[1], base)
    dbias = None
    if need_dbias and bias is not None:
        dbias = (dz.reshape(-1, dz.shape[-1]).sum(0) if dz.shape[-1] else dz.new_zeros(0)).to(bias.dtype)
    return dz.to(x.dtype), dbias


def scaled_swiglu_fwd_ref(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Pure-torch :func:`~fusible_ops.kernels.activation.scaled_swiglu_fwd` (fp32, fp64 for fp64)."""
    _check_scales(x, scales)
    cd = _compute_dtype(x)
    a, b = _halves(x.to(cd))
    return (torch.nn.functional.silu(a) * b * scales.to(cd)[..., None]).to(x.dtype)


def scaled_swiglu_bwd_ref(
    dy: torch.Tensor, x: torch.Tensor, scales: torch.Tensor, need_dscales: bool
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Pure-torch :func:`~fusible_ops.kernels.activation.scaled_swiglu_bwd` (fp32, fp64 for fp64)."""
    _check_scales(x, scales)
    cd = _compute_dtype(x)
    a, b = _halves(x.to(cd))
    dyc = dy.to(cd)
    act_a, dact_a = _act_and_grad_ref(a, "silu", True)
    g = dyc * scales.to(cd)[..., None]
    dx = torch.cat([g * b * dact_a, g * act_a], dim=-1).to(x.dtype)
    dscales = (dyc * act_a * b).sum(-1).to(scales.dtype) if need_dscales else None
    return dx, dscales


__all__ = [
    "ACTIVATIONS",
    "GATED",
    "bias_act_bwd_ref",
    "bias_act_fwd_ref",
    "scaled_swiglu_bwd_ref",
    "scaled_swiglu_fwd_ref",
]
