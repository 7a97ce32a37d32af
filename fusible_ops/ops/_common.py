"""Shared helpers for basic ops: input validation and GEMM helpers."""

from __future__ import annotations

from typing import Optional

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_input(op, x: torch.Tensor, *, features: Optional[int] = None, like: Optional[torch.Tensor] = None,
                same_dtype: bool = True) -> None:
    """Raise a clear error for a bad input: not floating point, wrong last dim, or a dtype /
    device that does not match the op's parameter ``like``."""
    name = type(op).__name__
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: input must be a tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: input dtype {x.dtype} is not a floating-point dtype {FLOAT_DTYPES}")
    if features is not None and (x.dim() == 0 or x.shape[-1] != features):
        raise ValueError(f"{name}: input's last dim must be {features}, got shape {list(x.shape)}")
    if like is not None:
        if x.device != like.device:
            raise RuntimeError(f"{name}: input is on {x.device} but the op's parameters are on {like.device}")
        if same_dtype and x.dtype != like.dtype:
            raise TypeError(f"{name}: input dtype {x.dtype} does not match parameter dtype {like.dtype}")


def check_same(op, what: str, t: torch.Tensor, x: torch.Tensor, *, shape: bool = True) -> None:
    """An extra input must match the main input's device, dtype and (optionally) shape."""
    name = type(op).__name__
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: {what} must be a tensor, got {type(t).__name__}")
    if t.device != x.device:
        raise RuntimeError(f"{name}: {what} is on {t.device} but the input is on {x.device}")
    if t.dtype != x.dtype:
        raise TypeError(f"{name}: {what} dtype {t.dtype} does not match input dtype {x.dtype}")
    if shape and t.shape != x.shape:
        raise ValueError(f"{name}: {what} shape {list(t.shape)} does not match input shape {list(x.shape)}")


def gemm_wgrad(dy2d: torch.Tensor, x2d: torch.Tensor, out: Optional[torch.Tensor], accumulate: bool) -> torch.Tensor:
    """``dy2d.T @ x2d`` ([N, K]); with ``out`` given, written (or added) straight into it by the GEMM.

    A float32 ``out`` (main_grad) with half-precision inputs: on CUDA the Triton grouped-GEMM
    wgrad kernel (one group) accumulates in fp32 in its epilogue; on CPU the inputs are upcast and
    ``addmm`` writes into ``out``. Never a temporary full-size gradient plus a copy.
    """
    if out is None:
        return dy2d.t() @ x2d
    beta = 1.0 if accumulate else 0.0
    if out.dtype == dy2d.dtype == x2d.dtype:
        return torch.addmm(out, dy2d.t(), x2d, beta=beta, out=out)
    if out.is_cuda:
        from ..kernels import use_triton

        if use_triton(out):
            from ..kernels.grouped_gemm import grouped_gemm_wgrad

            splits = torch.full((1,), x2d.shape[0], dtype=torch.int64, device=out.device)
            grouped_gemm_wgrad(dy2d, x2d, splits, out=out.view(1, *out.shape), accumulate=accumulate)
            return out
    return torch.addmm(out, dy2d.t().to(out.dtype), x2d.to(out.dtype), beta=beta, out=out)
