"""Test helpers users can reuse to property-test their own ops and fusions.

* :func:`assert_matches_reference`: a fused ``Sequential`` against the same ops run unfused, one
  by one, under plain autograd in float64 (outputs and every input/parameter gradient).
* :mod:`fusible_ops.testing.strategies`: hypothesis strategies for op chains, shapes, dtypes.
* The one tolerance table by dtype (:data:`TOLERANCES`) and comparison helpers.
"""

from .reference import assert_close_scaled, assert_matches_reference, run_unfused
from .tolerances import NORM_TOLERANCES, TOLERANCES, assert_close, assert_close_norm, tolerance

__all__ = [
    "NORM_TOLERANCES", "TOLERANCES", "assert_close", "assert_close_norm", "assert_close_scaled",
    "assert_matches_reference", "run_unfused", "tolerance",
]
