"""Input validation shared by the basic ops (and, through their ``check_input``, the fused ops)."""

from __future__ import annotations

from typing import Optional

import torch

from ..quantization.tensor import TracedFloat8

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
NATIVE_DTYPES = (torch.float32, torch.float64)
"""Dtypes whose reference math runs in the input's own dtype (no casts): where an op needs no
ctx (a call under PyTorch's autograd, or inference), it may call torch's own ops directly."""


def native_dtype_ok(x: torch.Tensor, gated: bool) -> bool:
    """Whether an activation of ``x`` may run as torch's own op in x's dtype (see
    :data:`NATIVE_DTYPES`): float32/float64 always; on CUDA also 16-bit x for a non-gated
    activation, which torch computes in float32 and rounds once, as the reference does (a gated
    product in 16 bits would round twice)."""
    return x.dtype in NATIVE_DTYPES or (x.is_cuda and not gated and x.dtype in FLOAT_DTYPES)


WIDE_PARAM_INPUTS = (torch.float16, torch.bfloat16)
"""Input dtypes that float32 parameters of an op with ``wide_params`` (the norms, whose math runs
in float32) also take: :func:`check_input`."""


def check_input(op, x: torch.Tensor, *, features: Optional[int] = None, like: Optional[torch.Tensor] = None,
                wide_params: bool = False, shape=None) -> None:
    """Raise a clear error for a bad input: not floating point, wrong last dim, or a dtype /
    device that does not match the op's parameter ``like`` (``wide_params``: float32 parameters
    also take a :data:`WIDE_PARAM_INPUTS` input). ``shape`` (optional) is checked in place of
    ``x.shape``: a fused op validates an input it has not computed yet (same dtype and device as
    ``x``) without allocating it."""
    if not isinstance(x, torch.Tensor) and type(x) is not TracedFloat8:  # (an FP8 operand, traced)
        raise TypeError(f"{type(op).__name__}: input must be a tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{type(op).__name__}: input dtype {x.dtype} is not a floating-point dtype {FLOAT_DTYPES}")
    shape = x.shape if shape is None else tuple(shape)
    if features is not None and (len(shape) == 0 or shape[-1] != features):
        raise ValueError(f"{type(op).__name__}: input's last dim must be {features}, got shape {list(shape)}")
    if like is not None:
        gd = x.get_device()  # (an int: cheaper than comparing devices; -1 off CUDA)
        if gd != like.get_device() or (gd < 0 and _other_device(x, like)):
            raise RuntimeError(f"{type(op).__name__}: input is on {x.device} but the op's parameters are on {like.device}")
        if x.dtype != like.dtype and not (wide_params and like.dtype == torch.float32 and x.dtype in WIDE_PARAM_INPUTS):
            also = " (float32 parameters also take float16 / bfloat16 input)" if wide_params else ""
            raise TypeError(f"{type(op).__name__}: input dtype {x.dtype} does not match parameter dtype {like.dtype}"
                            f"{also}")


def check_same(op, what: str, t: torch.Tensor, x: torch.Tensor, *, shape: bool = True) -> None:
    """An extra input must match the main input's device, dtype and (optionally) shape."""
    name = type(op).__name__
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: {what} must be a tensor, got {type(t).__name__}")
    gd = t.get_device()  # (as in check_input)
    if gd != x.get_device() or (gd < 0 and _other_device(t, x)):
        raise RuntimeError(f"{name}: {what} is on {t.device} but the input is on {x.device}")
    if t.dtype != x.dtype:
        raise TypeError(f"{name}: {what} dtype {t.dtype} does not match input dtype {x.dtype}")
    if shape and t.shape != x.shape:
        raise ValueError(f"{name}: {what} shape {list(t.shape)} does not match input shape {list(x.shape)}")


def _other_device(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors off CUDA (``get_device() == -1`` for both) are on different devices:
    two CPU tensors without building device objects (host time), others by their devices."""
    if a.is_cpu:
        return not b.is_cpu
    return a.device != b.device
