"""FP8 accuracy helpers: SQNR against a float64 reference, and quantized-input references.

FP8 results are judged by signal-to-quantization-noise ratio, not elementwise tolerances:
``sqnr(a, ref) = 10 log10(sum ref^2 / sum (a - ref)^2)`` in dB. :data:`SQNR_DB` holds the one
threshold table (by what is compared and the recipe's format).
"""

from __future__ import annotations

import math

import torch

from ..quantization.tensor import Float8Tensor

# Minimum SQNR in dB against float64 math on Gaussian data, per result and fp8_format.
SQNR_DB: dict[tuple[str, str], float] = {
    ("output", "hybrid"): 25.0,
    ("output", "e4m3"): 25.0,
    ("grad", "hybrid"): 20.0,  # E5M2 gradients: 2 mantissa bits
    ("grad", "e4m3"): 20.0,
    # an FP8 GEMM kernel on exact FP8 operands against float64 math on the same values: its own
    # accumulation error only (Hopper's FP8 MMA accumulates with fewer bits than fp32)
    ("kernel", "fp8 operands"): 50.0,
}


def sqnr(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """SQNR of ``actual`` against ``reference`` in dB (both compared in float64 on the CPU; a
    Float8Tensor is dequantized first). ``inf`` for an exact match."""
    if isinstance(actual, Float8Tensor):
        actual = actual.dequantize()
    a = actual.detach().to("cpu", torch.float64)
    r = reference.detach().to("cpu", torch.float64)
    if a.shape != r.shape:
        raise ValueError(f"sqnr: shapes differ, {tuple(a.shape)} vs {tuple(r.shape)}")
    noise = (a - r).pow(2).sum().item()
    signal = r.pow(2).sum().item()
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def assert_sqnr(actual: torch.Tensor, reference: torch.Tensor, min_db: float, *, msg: str = "") -> float:
    """Assert ``sqnr(actual, reference) >= min_db`` (and a finite result); returns the SQNR."""
    a = actual.dequantize() if isinstance(actual, Float8Tensor) else actual
    assert torch.isfinite(a.detach()).all(), f"{msg} result has non-finite values"
    db = sqnr(a, reference)
    assert db >= min_db, f"{msg} SQNR {db:.2f} dB < {min_db} dB"
    return db


def quantized_reference(x: torch.Tensor, recipe, role: str = "input") -> torch.Tensor:
    """float64 values of ``x`` after quantizing under ``recipe`` for ``role``: feed these to a
    float64 reference to separate quantization error from the kernel's own error (a kernel
    computing on the same FP8 values should match this reference to fp32 accuracy)."""
    from ..quantization.casting import quantize
    from ..quantization.recipes import Float8DelayedScaling

    if isinstance(recipe, Float8DelayedScaling):
        raise ValueError("quantized_reference: delayed scaling depends on an op's history; use current scaling")
    return quantize(x.detach(), recipe, role).dequantize(torch.float64)


__all__ = ["SQNR_DB", "assert_sqnr", "quantized_reference", "sqnr"]
