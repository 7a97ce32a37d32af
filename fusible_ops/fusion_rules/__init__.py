"""Built-in fused ops and the rules that match them (one module per family).

``fusible_ops.fusion_rules.disabled(*names)`` disables rules by name inside a ``with`` block.
Built-in rule names: see ``fusible_ops.RuleSet.builtin().names()``.
"""

from ..rules import disabled
from . import bias_activation, grouped_mlp, residual_norm  # noqa: F401  (register the built-in rules)

__all__ = ["disabled", "bias_activation", "grouped_mlp", "residual_norm"]
