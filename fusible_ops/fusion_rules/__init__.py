"""Built-in fused ops and the rules that match them.

``fusible_ops.fusion_rules.disabled(*names)`` disables rules by name inside a ``with`` block.
"""

from ..rules import disabled

__all__ = ["disabled"]
