"""Losses: CrossEntropy (a language model's loss over logits [..., V]).

The per-row math is one Triton kernel family (:mod:`fusible_ops.kernels.cross_entropy`: loss and
logsumexp in one pass over V, the gradient in a second), shared with the fused
``linear_cross_entropy`` op (:mod:`fusible_ops.fusion_rules.linear_ce`), which runs it on chunks of
tokens. Everything is computed in float32 (float64 for float64 logits: :func:`loss_dtype`); the input
gradient comes back in the logits' dtype.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..kernels.cross_entropy import ce_grad_rows, ce_loss
from ..op import BasicOperation
from .validation import check_input

_REDUCTIONS = ("mean", "sum", "none")


class CrossEntropy(BasicOperation):
    """Cross-entropy of logits ``[..., V]`` against integer class ids (``targets``, an extra input of
    the logits' shape without its last dim): ``seq(x, targets)`` or ``seq(x, targets=t)``.

    Returns the loss: a scalar for ``reduction="mean"`` (over the rows whose target is not
    ``ignore_index``; NaN when every row is ignored, as ``torch.nn.functional.cross_entropy``) or
    ``"sum"``, per row (the targets' shape; 0 for ignored rows) for ``"none"``. Float32 math and
    result for 16- and 32-bit logits, float64 for float64 logits (:func:`loss_dtype`). Options, as in
    ``F.cross_entropy`` where it has them:

    * ``label_smoothing`` in [0, 1]: each row's target distribution is ``1 - eps`` on the target
      plus ``eps / V`` everywhere.
    * ``z_loss_coeff``: adds ``z_loss_coeff * logsumexp(logits)^2`` per row (so
      ``z_loss_coeff * mean(logsumexp^2)`` under ``"mean"``), as in PaLM.
    * ``logit_softcap``: the logits go through ``softcap * tanh(logits / softcap)`` first, as in
      Gemma 2.

    A loss is the last op of its ``Sequential`` (a nested ``Sequential`` that ends with it is the
    outer one's last module): any module after it raises a ``ValueError`` naming this op.

    After a ``BasicLinear`` (``fo.Linear(d, V, bias=False)``) the rule ``linear_cross_entropy``
    fuses both and never materializes the ``[T, V]`` logits (see docs/ops.md, "LM head").
    """

    num_extra_inputs = 1
    extra_input_names = ("targets",)  # (Sequential accepts it by this name: seq(x, targets=...))
    is_loss = True  # (the last op of its Sequential: anything after it raises when the chain is built)

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 z_loss_coeff: float = 0.0, logit_softcap: Optional[float] = None) -> None:
        super().__init__()
        if reduction not in _REDUCTIONS:
            raise ValueError(f"CrossEntropy: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
        if not 0.0 <= float(label_smoothing) <= 1.0:
            raise ValueError(f"CrossEntropy: label_smoothing must be in [0, 1], got {label_smoothing}")
        if float(z_loss_coeff) < 0.0:
            raise ValueError(f"CrossEntropy: z_loss_coeff must be >= 0, got {z_loss_coeff}")
        if logit_softcap is not None and not float(logit_softcap) > 0.0:
            raise ValueError(f"CrossEntropy: logit_softcap must be positive or None, got {logit_softcap}")
        self.ignore_index = int(ignore_index)
        self.reduction = reduction
        self.label_smoothing = float(label_smoothing)
        self.z_loss_coeff = float(z_loss_coeff)
        self.logit_softcap = None if logit_softcap is None else float(logit_softcap)

    def extra_repr(self) -> str:
        parts = [f"reduction={self.reduction!r}"]
        if self.ignore_index != -100:
            parts.append(f"ignore_index={self.ignore_index}")
        for name in ("label_smoothing", "z_loss_coeff"):
            if getattr(self, name):
                parts.append(f"{name}={getattr(self, name)}")
        if self.logit_softcap is not None:
            parts.append(f"logit_softcap={self.logit_softcap}")
        return ", ".join(parts)

    @classmethod
    def _example(cls, n: int, **factory):
        return cls(), None

    def options(self) -> tuple:
        """``(ignore_index, label_smoothing, z_loss_coeff, logit_softcap)``, the ``opts`` of the kernels of
        :mod:`fusible_ops.kernels.cross_entropy`."""
        return self.ignore_index, self.label_smoothing, self.z_loss_coeff, self.logit_softcap

    def check_targets(self, logits_shape, vocab: int, targets, device) -> torch.Tensor:
        """Validate ``targets`` for logits of ``logits_shape`` (``[..., vocab]``); returns them flat
        ``[rows]``. Out-of-range ids (other than ``ignore_index``) raise on CPU; on CUDA (and while
        torch.compile traces) they are an asynchronous assert (no host sync), as in
        ``F.cross_entropy``."""
        name = type(self).__name__
        if not isinstance(targets, torch.Tensor):
            raise TypeError(f"{name}: targets must be a tensor of class ids, got {type(targets).__name__}")
        if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
            raise TypeError(f"{name}: targets must be integer class ids, got {targets.dtype} (class probabilities "
                            f"are not supported)")
        if tuple(targets.shape) != tuple(logits_shape[:-1]):
            raise ValueError(f"{name}: targets must have the logits' shape without its last dim, "
                             f"{list(logits_shape[:-1])}, got {list(targets.shape)}")
        if targets.device != device:
            raise RuntimeError(f"{name}: targets are on {targets.device} but the logits are on {device}")
        flat = targets.reshape(-1)
        bad = ((flat < 0) | (flat >= vocab)) & (flat != self.ignore_index)
        if flat.is_cuda or torch.compiler.is_compiling():  # (no host read: no sync, no graph break)
            torch._assert_async(~bad.any(), f"{name}: a target is out of range [0, {vocab})")
        elif bool(bad.any()):
            v = int(flat[bad][0])
            raise ValueError(f"{name}: target {v} is out of range [0, {vocab}) and is not ignore_index "
                             f"({self.ignore_index})")
        return flat

    def fuser_forward(self, ctxs, x, *, extra_inputs, **kwargs):
        ctx = ctxs[0]
        check_input(self, x)
        (targets,) = extra_inputs[0]
        if x.dim() == 0:
            raise ValueError(f"{type(self).__name__}: logits need a class dim, got a scalar")
        vocab = x.shape[-1]
        t = self.check_targets(x.shape, vocab, targets, x.device)
        z = x.reshape(-1, vocab)
        rows, lse = ce_loss(z, t, self.options())
        if ctx.requires_grad and ctx.input_requires_grad:
            ctx.save_for_backward(z, t, lse)
            ctx.logits_shape = x.shape
        return reduce_rows(rows, t, self.ignore_index, self.reduction, targets.shape), [()]

    def fuser_backward(self, ctxs, dy, *, grad_extra_outputs, **kwargs):
        ctx = ctxs[0]
        if not ctx.input_requires_grad:
            return None, [()], [(None,)]
        z, t, lse = ctx.saved_tensors
        g = row_scale(dy, t, self.ignore_index, self.reduction, lse.dtype)
        dz = ce_grad_rows(z, t, lse, g, self.options())
        return dz.reshape(ctx.logits_shape), [()], [(None,)]

    def reference_forward(self, x, targets):
        return cross_entropy_ref(x, targets, self.ignore_index, self.reduction, self.label_smoothing,
                                 self.z_loss_coeff, self.logit_softcap)


# ---- reductions over the rows (shared with the fused linear + cross-entropy)


def reduce_rows(rows: torch.Tensor, targets: torch.Tensor, ignore_index: int, reduction: str, shape) -> torch.Tensor:
    """The loss from per-row losses: mean over non-ignored rows, sum, or per row in ``shape``."""
    if reduction == "none":
        return rows.reshape(shape)
    total = rows.sum()
    if reduction == "sum":
        return total
    return total / (targets != ignore_index).sum()


def loss_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the loss (and its per-row math) for logits of ``logits_dtype``: float32, float64
    for float64 logits."""
    return torch.promote_types(logits_dtype, torch.float32)


def row_scale(dy: torch.Tensor, targets: torch.Tensor, ignore_index: int, reduction: str,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[rows] in ``dtype`` (the loss's, :func:`loss_dtype`): d loss / d row loss times the loss's
    gradient ``dy`` (0 on ignored rows)."""
    valid = targets != ignore_index
    dy = dy.to(dtype)
    if reduction == "none":
        g = dy.reshape(-1)
    elif reduction == "sum":
        g = dy.expand(targets.shape)
    else:
        g = (dy / valid.sum()).expand(targets.shape)
    return torch.where(valid, g, 0.0)


def cross_entropy_ref(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, reduction: str = "mean",
                      label_smoothing: float = 0.0, z_loss_coeff: float = 0.0,
                      logit_softcap: Optional[float] = None) -> torch.Tensor:
    """Reference: ``F.cross_entropy`` on the (soft-capped) logits in float32 (float64 stays), plus the
    z-loss over the non-ignored rows."""
    z = logits.to(loss_dtype(logits.dtype))
    if logit_softcap is not None:
        z = logit_softcap * torch.tanh(z / logit_softcap)
    flat, t = z.reshape(-1, z.shape[-1]), targets.reshape(-1)
    loss = torch.nn.functional.cross_entropy(flat, t, ignore_index=ignore_index, reduction="none",
                                             label_smoothing=label_smoothing)
    if z_loss_coeff:
        loss = loss + torch.where(t != ignore_index, z_loss_coeff * torch.logsumexp(flat, -1) ** 2, 0.0)
    if reduction == "none":
        return loss.reshape(targets.shape)
    if reduction == "sum":
        return loss.sum()
    n = (t != ignore_index).sum()
    return loss.sum() / n if n > 0 else loss.sum() * math.nan


__all__ = ["CrossEntropy", "cross_entropy_ref", "loss_dtype", "reduce_rows", "row_scale"]
