"""Built-in fused ops and the rules that match them (one module per family).

``fusible_ops.fusion_rules.disabled(*names)`` disables rules by name inside a ``with`` block.
Built-in rule names: see ``fusible_ops.RuleSet.builtin().names()``.
"""

from ..rules import disabled
from . import bias_activation, comm_overlap, grouped_mlp, linear_add, linear_ce, moe_combine, moe_ep_overlap, moe_mlp, \
    residual_norm

BUILTIN_RULES = (*bias_activation.RULES, *linear_add.RULES, *residual_norm.RULES, *grouped_mlp.RULES, *moe_mlp.RULES, *moe_combine.RULES,
                 *moe_ep_overlap.RULES, *comm_overlap.RULES, *linear_ce.RULES)
"""Every built-in rule, as data (installed into the built-in and global rule sets by
``fusible_ops/__init__.py``)."""

__all__ = ["BUILTIN_RULES", "disabled", "bias_activation", "comm_overlap", "grouped_mlp", "linear_add", "linear_ce",
           "moe_combine", "moe_ep_overlap", "moe_mlp", "residual_norm"]
