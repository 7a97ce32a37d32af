"""Pure-torch ``*_ref`` twins of :mod:`fusible_ops.kernels.norm` (re-exported there).

Same contracts as the public functions of :mod:`fusible_ops.kernels.norm` and the same math
(written out in its module docstring), in fp32, or float64 for float64 inputs (the reference
precision: float64 always takes these twins).
"""

from __future__ import annotations

import math

import torch

from .launch import as_rows, cast_to, compute_dtype


def _ref_fwd(x, weight, bias, eps, residual, is_rms):
    ct = compute_dtype(x.dtype)
    xsum = cast_to(cast_to(x, ct) + cast_to(residual, ct), x.dtype) if residual is not None else x
    rows = math.prod(x.shape[:-1])
    xs = as_rows(cast_to(xsum, ct))
    if is_rms:
        mean = None
        xc = xs
    else:
        mean = xs.mean(-1)
        xc = xs - mean[:, None]
    rstd = torch.rsqrt((xc * xc).mean(-1, keepdim=True) + eps)  # [rows, 1]
    y = xc * rstd
    if weight is not None:
        y = y * cast_to(weight, ct)
    if bias is not None:
        y = y + cast_to(bias, ct)
    y = cast_to(y, x.dtype)
    return (y if x.dim() == 2 else y.reshape(x.shape)), mean, rstd.view(rows), xsum


def _ref_bwd(dy, xsum, weight, mean, rstd, need_dweight, need_dbias, dxsum_extra, is_rms):
    ct = compute_dtype(xsum.dtype)
    pdtype = weight.dtype if weight is not None else xsum.dtype
    rows = math.prod(xsum.shape[:-1])
    xs = as_rows(cast_to(xsum, ct))
    g0 = as_rows(cast_to(dy, ct))
    r = cast_to(rstd, ct).reshape(rows, 1)
    xhat = xs * r if is_rms else (xs - cast_to(mean, ct).reshape(rows, 1)) * r
    g = g0 * cast_to(weight, ct) if weight is not None else g0
    dx = g - xhat * (g * xhat).mean(-1, keepdim=True)
    if not is_rms:
        dx = dx - g.mean(-1, keepdim=True)
    dx = dx * r
    if dxsum_extra is not None:
        dx = dx + as_rows(cast_to(dxsum_extra, ct))
    dw = cast_to((g0 * xhat).sum(0), pdtype) if (need_dweight and weight is not None) else None
    db = cast_to(g0.sum(0), pdtype) if need_dbias else None
    dx = cast_to(dx, xsum.dtype)
    return (dx if xsum.dim() == 2 else dx.reshape(xsum.shape)), dw, db


def layernorm_fwd_ref(x, weight, bias, eps, residual=None):
    """Pure-torch twin of :func:`~fusible_ops.kernels.norm.layernorm_fwd` (same contract; fp32
    math, float64 for float64 x)."""
    return _ref_fwd(x, weight, bias, eps, residual, False)


def layernorm_bwd_ref(dy, xsum, weight, mean, rstd, need_dweight, need_dbias, dxsum_extra=None):
    """Pure-torch twin of :func:`~fusible_ops.kernels.norm.layernorm_bwd` (same contract; fp32
    math, float64 for float64 xsum)."""
    return _ref_bwd(dy, xsum, weight, mean, rstd, need_dweight, need_dbias, dxsum_extra, False)


def rmsnorm_fwd_ref(x, weight, eps, residual=None):
    """Pure-torch twin of :func:`~fusible_ops.kernels.norm.rmsnorm_fwd` (same contract; fp32
    math, float64 for float64 x)."""
    y, _, rstd, xsum = _ref_fwd(x, weight, None, eps, residual, True)
    return y, rstd, xsum


def rmsnorm_bwd_ref(dy, xsum, weight, rstd, need_dweight, dxsum_extra=None):
    """Pure-torch twin of :func:`~fusible_ops.kernels.norm.rmsnorm_bwd` (same contract; fp32
    math, float64 for float64 xsum)."""
    dx, dw, _ = _ref_bwd(dy, xsum, weight, None, rstd, need_dweight, False, dxsum_extra, True)
    return dx, dw


__all__ = ["layernorm_bwd_ref", "layernorm_fwd_ref", "rmsnorm_bwd_ref", "rmsnorm_fwd_ref"]
