"""The activation table: every activation and its gradient, written once as ``@triton.jit``
functions and once as the pure-torch reference, under one ID scheme.

Used by the elementwise kernels (:mod:`fusible_ops.kernels.activation`), the GEMM epilogues
(:mod:`fusible_ops.kernels.grouped_glu`) and their ``*_ref`` twins. A kernel takes the activation
as ``ACT: tl.constexpr`` = :data:`ACT_IDS` [name] and calls :func:`act_and_grad` then
:func:`dact`; a reference calls :func:`act_and_grad_ref` then :func:`dact_ref` with the name.

Activations (in fp32 inside kernels; fp64 on the reference path for fp64 inputs):

* ``relu``; ``gelu`` (exact: ``z * Phi(z)``, Phi via a Chebyshev-fitted erfc, fractional error
  < 1.2e-7: one exp and one reciprocal, cheaper than libdevice's erff, which made exact GELU
  compute-bound); ``gelu_tanh`` (``0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))``, tanh via
  exp); ``silu`` (``z sigmoid(z)``).
* Gated kinds are ``act(a) * b`` over the two halves of the last dim; :data:`GLU_BASE` names
  each one's activation.

NaN / Inf: each formula saturates at +-Inf and propagates NaN the way torch does (the table is
in :mod:`fusible_ops.kernels.activation_ref`); relu's gradient is a select (``dact``), the others
a product.
"""

from __future__ import annotations

from typing import Optional

import torch

ACT_IDS: dict[str, int] = {"relu": 0, "gelu": 1, "gelu_tanh": 2, "silu": 3}
"""Activation name -> the ``ACT`` constexpr of the kernels."""

GLU_BASE: dict[str, str] = {"swiglu": "silu", "scaled_swiglu": "silu", "geglu": "gelu",
                            "geglu_tanh": "gelu_tanh", "reglu": "relu"}
"""Gated kind -> its activation (``glu(z) = act(a) * b``)."""

SQRT_HALF = 0.7071067811865476  # 1/sqrt(2)
INV_SQRT_2PI = 0.3989422804014327  # 1/sqrt(2 pi)
SQRT_2_OVER_PI = 0.7978845608028654  # sqrt(2/pi)
GELU_C = 0.044715

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    HAS_TRITON = False

if HAS_TRITON:

    @triton.jit
    def tanh_exp(u):
        """tanh via exp: portable (Triton 3.6 / 3.9, interpreter); saturates correctly at +-inf."""
        return 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)

    @triton.jit
    def gelu_cdf(z):
        """Phi(z) = 0.5 * erfc(-z / sqrt(2)), via the Chebyshev-fitted erfc of Numerical Recipes
        (fractional error < 1.2e-7 everywhere, i.e. fp32 rounding level, also in the tails)."""
        a = tl.abs(z) * 0.7071067811865476
        t = 1.0 / (1.0 + 0.5 * a)
        p = 0.17087277
        p = -0.82215223 + t * p
        p = 1.48851587 + t * p
        p = -1.13520398 + t * p
        p = 0.27886807 + t * p
        p = -0.18628806 + t * p
        p = 0.09678418 + t * p
        p = 0.37409196 + t * p
        p = 1.00002368 + t * p
        p = -1.26551223 + t * p
        half_erfc = 0.5 * t * tl.exp(p - a * a)
        return tl.where(z >= 0.0, 1.0 - half_erfc, half_erfc)

    @triton.jit
    def act_and_grad(z, ACT: tl.constexpr):
        """(act(z), act'(z)) in fp32 (an unused gradient is removed by dead-code elimination).
        Apply act' with :func:`dact`."""
        if ACT == 0:  # relu: a select, so relu(nan) = nan (tl.maximum would drop the NaN)
            y = tl.where(z <= 0.0, 0.0, z)
            g = tl.where(z <= 0.0, 0.0, 1.0)
        elif ACT == 1:  # gelu (erf)
            cdf = gelu_cdf(z)
            y = z * cdf
            g = cdf + z * tl.exp(-0.5 * z * z) * 0.3989422804014327
        elif ACT == 2:  # gelu_tanh
            z2 = z * z
            t = tanh_exp(0.7978845608028654 * (z + 0.044715 * z2 * z))
            y = 0.5 * z * (1.0 + t)
            g = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * z2)
        else:  # silu
            s = 1.0 / (1.0 + tl.exp(-z))
            y = z * s
            g = s * (1.0 + z * (1.0 - s))
        return y, g

    @triton.jit
    def dact(up, z, g, ACT: tl.constexpr):
        """The gradient ``up`` (dL/dact) taken through the activation at z (act'(z) = g): a select
        for relu, like torch's threshold_backward (0 where z <= 0 even for a NaN/Inf ``up``; ``up``
        at z = NaN), else a product."""
        if ACT == 0:
            return tl.where(z <= 0.0, 0.0, up)
        else:
            return up * g


def act_and_grad_ref(z: torch.Tensor, name: str, need_grad: bool = True):
    """(act(z), act'(z) or None) with the kernels' formulas (exact erf for ``gelu``: the kernel's
    erfc fit is within fp32 rounding of it); apply act' with :func:`dact_ref`."""
    g = None
    if name == "relu":
        y = torch.relu(z)  # NaN stays NaN
        if need_grad:
            g = torch.where(z <= 0, 0.0, 1.0).to(z.dtype)  # 1 at NaN, like torch
    elif name == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(z * SQRT_HALF))
        y = z * cdf
        if need_grad:
            g = cdf + z * torch.exp(-0.5 * z * z) * INV_SQRT_2PI
    elif name == "gelu_tanh":
        t = torch.tanh(SQRT_2_OVER_PI * (z + GELU_C * z * z * z))
        y = 0.5 * z * (1.0 + t)
        if need_grad:
            g = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3 * GELU_C * z * z)
    elif name == "silu":
        s = torch.sigmoid(z)
        y = z * s
        if need_grad:
            g = s * (1.0 + z * (1.0 - s))
    else:
        raise ValueError(f"unknown activation {name!r}; expected one of {sorted(ACT_IDS)}")
    return y, g


def dact_ref(up: torch.Tensor, z: torch.Tensor, g: Optional[torch.Tensor], name: str) -> torch.Tensor:
    """The upstream gradient ``up`` taken through the activation at z: relu selects (torch's
    threshold_backward: 0 where z <= 0 even for NaN/Inf ``up``), the others multiply."""
    if name == "relu":
        return torch.where(z <= 0, torch.zeros((), dtype=up.dtype, device=up.device), up)
    return up * g


__all__ = ["ACT_IDS", "GLU_BASE", "act_and_grad_ref", "dact_ref"] + (
    ["act_and_grad", "dact", "gelu_cdf", "tanh_exp"] if HAS_TRITON else [])
