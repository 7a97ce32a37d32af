"""Test helpers users can reuse to property-test their own ops and fusions."""
from .tolerances import NORM_TOLERANCES, TOLERANCES, assert_close, assert_close_norm, tolerance

__all__ = ["NORM_TOLERANCES", "TOLERANCES", "assert_close", "assert_close_norm", "tolerance"]
