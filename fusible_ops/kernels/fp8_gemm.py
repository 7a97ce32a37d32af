"""The FP8 GEMM seam: ``a @ b.T`` for two FP8 operands in row-wise form, fp32 accumulation.

An operand is ``(data [R, K] row-major FP8, scale_inv)`` with K the reduction dim and the scale
in the layout :mod:`.fp8_cast` writes (per tensor, 1x128 along K, or 128x128). Then

* fprop ``y = x @ w.T``: ``fp8_gemm(x.rowwise, w.rowwise)``;
* dgrad ``dx = dy @ w``: ``fp8_gemm(dy.rowwise, w.colwise)``;
* wgrad ``dw = dy.T @ x``: ``fp8_gemm(dy.colwise, x.colwise)``.

On CUDA devices with FP8 tensor cores (compute capability 8.9 and newer) this is
``torch._scaled_mm`` (cuBLASLt: per-tensor scales, and 1x128 / 128x128 block scales on Hopper).
Elsewhere (CPU), and on CUDA for 128x128-scaled operands whose reduction dim is not a multiple of
512 (see :func:`cublas_layout_ok`), it is the emulation :func:`fp8_gemm_ref`: dequantize both operands to fp32,
multiply in fp32, cast the result. The emulation is also the reference the tests compare with.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..quantization.tensor import dequantize_2d

_FP8_CAPABLE: dict = {}


def fp8_capable(device: torch.device) -> bool:
    """True when ``device`` runs FP8 matmuls natively (CUDA compute capability >= 8.9)."""
    if device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    ok = _FP8_CAPABLE.get(idx)
    if ok is None:
        ok = torch.cuda.get_device_capability(idx) >= (8, 9)
        if not torch.compiler.is_compiling():  # (a trace writes no global state: dynamo would guard on it)
            _FP8_CAPABLE[idx] = ok
    return ok


def cublas_layout_ok(operand, scaling: str) -> bool:
    """Whether cuBLASLt reads this operand's scales as laid out. 128x128 block scales need a
    reduction dim that is a multiple of 512 (4 blocks): with fewer, cuBLAS reads a padded row
    stride that torch 2.11's ``_scaled_mm`` does not check for (measured on an H200: wrong
    results, no error). Such GEMMs take the emulation instead (correct, slower)."""
    return scaling != "128x128" or operand[1].shape[1] % 4 == 0


def fp8_gemm_ref(a, b, scaling_a: str, scaling_b: str, out_dtype: torch.dtype) -> torch.Tensor:
    """Emulation: ``(dequant(a) @ dequant(b).T)`` in fp32, cast to ``out_dtype``."""
    return (dequantize_2d(*a, scaling_a) @ dequantize_2d(*b, scaling_b).t()).to(out_dtype)


def fp8_gemm(a, b, scaling_a: str, scaling_b: str, out_dtype: torch.dtype,
             out: Optional[torch.Tensor] = None, accumulate: bool = False) -> torch.Tensor:
    """``a @ b.T`` ([M, K] x [N, K] -> [M, N]) in ``out_dtype``; with ``out`` the result is written
    (or, ``accumulate``, added) into it and ``out`` returned."""
    a_data, b_data = a[0], b[0]
    if a_data.is_cuda and not fp8_capable(a_data.device):
        raise RuntimeError("FP8 GEMM needs a GPU with FP8 tensor cores (compute capability 8.9+: Ada, Hopper)")
    if a_data.is_cuda and cublas_layout_ok(a, scaling_a) and cublas_layout_ok(b, scaling_b):
        sb = b[1] if scaling_b == "tensor" else b[1].t()
        r = torch._scaled_mm(a_data, b_data.t(), scale_a=a[1], scale_b=sb, out_dtype=out_dtype)
    else:
        r = fp8_gemm_ref(a, b, scaling_a, scaling_b, out_dtype)
    if out is None:
        return r
    if accumulate:
        return out.add_(r)
    return out.copy_(r)


__all__ = ["cublas_layout_ok", "fp8_capable", "fp8_gemm", "fp8_gemm_ref"]
