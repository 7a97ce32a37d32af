"""Test helpers users can reuse to property-test their own ops and fusions.

* :func:`assert_matches_reference`: a fused ``Sequential`` against plain autograd over each
  basic op's ``reference_forward`` on float64 copies (outputs and every input/parameter
  gradient), judged by the tolerance table and, for low precision, against plain PyTorch at the
  same dtype. :func:`run_reference` runs that reference chain.
* :mod:`fusible_ops.testing.strategies` (needs ``hypothesis``): the op catalogue
  (``OpSpec``, ``BUILTIN_OPS``), ``chains()``, shapes, dtypes, and :func:`fusion_settings`
  (also importable from here).
* The one tolerance table by dtype (:data:`TOLERANCES`) and comparison helpers.
* FP8: :func:`sqnr`, :func:`assert_sqnr`, the threshold table :data:`SQNR_DB` and
  :func:`quantized_reference` (:mod:`fusible_ops.testing.fp8`).
* :func:`count_host_reads`: the host's reads of tensor data in a block (each a sync on a GPU).
* :func:`count_launches`, :func:`count_python_calls`: the kernels a block launches (as on CUDA,
  on any device) and the Python calls it makes (:mod:`fusible_ops.testing.launches`).
"""

from .reference import (
    MissingReferenceError, UncheckedOpWarning, assert_close_scaled, assert_matches_reference, run_reference,
    run_unfused,
)
from .fp8 import SQNR_DB, assert_sqnr, quantized_reference, sqnr
from .host_reads import HostReads, count_host_reads
from .launches import LaunchCounts, count_launches, count_python_calls
from .tolerances import (
    BASELINE_ATOL, BASELINE_FACTOR, NORM_TOLERANCES, TOLERANCES, assert_close, assert_close_norm, tolerance,
)

_FROM_STRATEGIES = ("BUILTIN_OPS", "Chain", "OpSpec", "chains", "dtypes", "fusion_settings", "leading_shapes")

__all__ = [
    "HostReads", "count_host_reads", "LaunchCounts", "count_launches", "count_python_calls",
    "SQNR_DB", "assert_sqnr", "quantized_reference", "sqnr",
    "BASELINE_ATOL", "BASELINE_FACTOR", "MissingReferenceError", "NORM_TOLERANCES", "TOLERANCES",
    "UncheckedOpWarning", "assert_close", "assert_close_norm", "assert_close_scaled", "assert_matches_reference",
    "run_reference", "run_unfused", "tolerance", *_FROM_STRATEGIES,
]


def __getattr__(name):  # hypothesis-based helpers load on first use (hypothesis stays optional)
    if name in _FROM_STRATEGIES:
        from . import strategies

        return getattr(strategies, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
