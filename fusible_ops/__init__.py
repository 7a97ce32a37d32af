"""fusible_ops (work in progress)."""
