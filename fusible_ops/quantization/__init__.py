"""FP8 training: recipes, :func:`autocast`, :class:`Float8Tensor` and :func:`quantize`.

See the README's FP8 section. The recipes and ``autocast`` are also exported at the top level
(``fusible_ops.autocast``, ``fusible_ops.Float8CurrentScaling``...).
"""

from .recipes import (
    E4M3, E5M2, FP8_FORMATS, FP8_MAX, RECIPES, ROLES, Float8BlockScaling, Float8CurrentScaling, Float8DelayedScaling,
    amax_reduction_group, autocast, current_recipe, fp8_dtype,
)
from .tensor import Float8Tensor, dequantize_2d
from .casting import (FP8StateMixin, GradOutputQuantizer, InputQuantizer, cached_weight, delayed_state, init_delayed_state,
                      quantize, with_colwise)
from .fsdp import Float8AllGatherWeight, Float8GatheredWeight, enable_fp8_all_gather, precompute_fp8_scales

__all__ = [
    "E4M3", "E5M2", "FP8StateMixin", "Float8AllGatherWeight", "Float8GatheredWeight", "FP8_FORMATS", "GradOutputQuantizer", "InputQuantizer", "FP8_MAX", "Float8BlockScaling", "Float8CurrentScaling",
    "Float8DelayedScaling", "Float8Tensor", "RECIPES", "ROLES", "amax_reduction_group", "autocast", "cached_weight",
    "current_recipe", "delayed_state", "dequantize_2d", "enable_fp8_all_gather", "init_delayed_state", "fp8_dtype",
    "precompute_fp8_scales", "quantize", "with_colwise",
]
