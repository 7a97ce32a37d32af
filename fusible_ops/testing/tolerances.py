"""The one tolerance table, by dtype. Tests compare against float64 references.

Never loosen an entry to make a test pass: fix the kernel or the reference.
"""

from __future__ import annotations

import torch

# (rtol, atol) for a result computed in `dtype` (inputs in `dtype`, fp32 math where
# the kernel says so) against a float64 reference computed from the same inputs.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1.3e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}

# Reductions over K elements (GEMMs, column sums, norms) grow rounding error ~ sqrt(K)
# in the inputs' precision; GEMM-type results are compared by relative norm error
# instead of elementwise: ||out - ref|| / ||ref|| <= NORM_TOLERANCES[dtype].
NORM_TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-4,  # tf32 is not used for fp32 (allow_tf32 stays off in tests)
    torch.float16: 3e-3,
    torch.bfloat16: 1.2e-2,
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for elementwise comparison of a `dtype` result with a float64 reference."""
    return TOLERANCES[dtype]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, *, msg: str = "") -> None:
    """Elementwise comparison with the table's tolerance for ``dtype`` (default: actual's dtype).

    ``expected`` should be a float64 reference; both are compared in float64 on the CPU.
    """
    dtype = dtype or actual.dtype
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(
        actual.detach().to("cpu", torch.float64),
        expected.detach().to("cpu", torch.float64),
        rtol=rtol,
        atol=atol,
        msg=(lambda m: f"{msg}\n{m}") if msg else None,
    )


def assert_close_norm(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, *, msg: str = "") -> None:
    """Relative-norm comparison (for GEMM-like results): ||a - e|| / ||e|| <= NORM_TOLERANCES."""
    dtype = dtype or actual.dtype
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    assert a.shape == e.shape, f"{msg} shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert torch.isfinite(a).all(), f"{msg} result has non-finite values"
    denom = e.norm().item()
    err = (a - e).norm().item()
    rel = err / denom if denom > 0 else err
    assert rel <= NORM_TOLERANCES[dtype], f"{msg} relative error {rel:.3e} > {NORM_TOLERANCES[dtype]:.1e} ({dtype})"


# Baseline acceptance (used by assert_matches_reference on top of the table): an element whose
# error misses TOLERANCES still passes if |err| <= BASELINE_FACTOR * (max error of the same math
# run in plain PyTorch at the same dtype, for that tensor) + BASELINE_ATOL * max(1, max|ref|).
# A fused op need not be more accurate than plain PyTorch at its precision, but not much worse.
BASELINE_FACTOR: float = 2.0
BASELINE_ATOL: float = 1e-6
# The baseline also holds a float64 run rounded to the dtype at every op boundary (ideal kernels)
# and this many such runs with stochastic rounding (a single rounding of a one-element tensor may
# be luckily exact); the largest error of all counts.
BASELINE_SAMPLES: int = 4
