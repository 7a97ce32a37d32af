"""Linear + cross-entropy: ``BasicLinear -> CrossEntropy``, a language model's head (rule
``linear_cross_entropy``, joint: forward and backward).

The ``[T, V]`` logits are the largest activation of a language model (T=16384 tokens, V=128256:
4 GB in bf16, 8 GB for their fp32 gradient). The fused op works through the tokens in chunks of
:func:`chunk_rows` rows, so no ``[T, V]`` tensor is ever made or kept:

* forward, per chunk: ``logits = x_c @ W.T`` (one GEMM in x's dtype), then the rows' loss and
  logsumexp in float32 (:func:`fusible_ops.ops.loss.ce_rows`). It keeps x, W, the targets and the
  logsumexp (fp32 [T]).
* backward, per chunk: the logits again (one GEMM), their gradient in float32
  (:func:`~fusible_ops.ops.loss.ce_grad`, scaled by the loss's gradient) cast to x's dtype, then
  ``dx_c = dlogits @ W`` and ``dW += dlogits.T @ x_c`` (an ``addmm_`` into the gradient itself:
  the GEMM accumulates in fp32, one rounding per chunk; into an fp32 ``main_grad`` in row blocks),
  so the head's backward holds no ``[V, d]`` buffer beyond the gradient it returns.

So a step runs four GEMMs where the unfused ops run three; the recomputation is what keeps the
gradient contract whole: the weight gradient goes through
:func:`~fusible_ops.grad.deliver_weight_grad` (``main_grad`` accumulation in fp32, a frozen head
runs no weight-gradient GEMM, and with delayed weight gradients the chunks are recomputed once more
when ``backward_dw()`` runs). A weight tied to an embedding gets both gradients, as unfused.

Chunk size: :data:`CHUNK_BYTES` (the fp32 logits and their gradient of one chunk) over ``8 * V``
bytes per row. ``explain()`` shows it. The math is torch's ops on every device (CPU included:
the CPU tests prove the memory behaviour); there is no Triton kernel for the loss pass yet.

Declines under an FP8 recipe (the chunked GEMMs run in high precision; unfused, the linear runs FP8).
"""

from __future__ import annotations

import torch

from ..grad import deliver_weight_grad
from ..op import FusedOperation
from ..ops.linear import BasicLinear
from ..ops.loss import CrossEntropy, ce_grad, ce_rows, reduce_rows, row_scale
from ..ops.validation import check_input
from ..rules import rule

CHUNK_BYTES = 512 << 20
"""Memory target of one chunk: its fp32 logits and their fp32 gradient (``8 * V`` bytes per row)."""


def chunk_rows(vocab: int, rows: int) -> int:
    """Rows per chunk for ``rows`` tokens and ``vocab`` classes (at least 1, at most ``rows``)."""
    return max(1, min(rows, CHUNK_BYTES // (8 * vocab)))


class LinearCrossEntropy(FusedOperation):
    """Forward and backward of ``BasicLinear -> CrossEntropy`` over chunks of tokens (see the module
    docstring): the loss of ``x @ weight.T`` against the targets, without the ``[T, V]`` logits."""

    def __init__(self, ops) -> None:
        super().__init__(ops)
        self._no_extras = [(), ()]

    def explain_note(self, x: torch.Tensor) -> str:
        """The chunking for an input like ``x`` (explain() appends it to the plan line)."""
        lin = self.basic_ops[0]
        rows = x.numel() // max(x.shape[-1], 1) if x.dim() else 1
        step = chunk_rows(lin.out_features, rows)
        return (f"{-(-rows // step) if rows else 0} chunk(s) of {step} token(s), no [{rows}, {lin.out_features}] "
                f"logits (logits recomputed in backward)")

    def fuser_forward(self, ctxs, x, *, extra_inputs, **kwargs):
        lin, ce = self.basic_ops
        lctx = ctxs[0]
        w = lin.weight
        check_input(lin, x, features=lin.in_features, like=w)
        (targets,) = extra_inputs[1]
        vocab = lin.out_features
        t = ce.check_targets((*x.shape[:-1], vocab), vocab, targets, x.device)
        x2 = x.reshape(-1, lin.in_features)
        n = x2.shape[0]
        step = chunk_rows(vocab, n)
        rows = torch.empty(n, dtype=torch.float32, device=x.device)
        lse = torch.empty(n, dtype=torch.float32, device=x.device)
        opts = ce.options()
        for s in range(0, n, step):
            rows[s:s + step], lse[s:s + step] = ce_rows(x2[s:s + step] @ w.t(), t[s:s + step], *opts)
        loss = reduce_rows(rows, t, ce.ignore_index, ce.reduction, targets.shape)
        if lctx.requires_grad:
            lctx.weight_grad = lctx.weight_requires_grad and w.requires_grad
            lctx.save_for_backward(x2, w, t, lse)
            lctx.input_shape = x.shape
        return loss, self._no_extras

    def fuser_backward(self, ctxs, dy, *, grad_extra_outputs, **kwargs):
        lin, ce = self.basic_ops
        lctx = ctxs[0]
        x2, w, t, lse = lctx.saved_tensors
        g = row_scale(dy, t, ce.ignore_index, ce.reduction)
        opts = ce.options()
        n = x2.shape[0]
        step = chunk_rows(lin.out_features, n)
        dx = torch.empty_like(x2) if lctx.input_requires_grad else None
        pending_dx = [dx is not None]  # (filled by the first pass over the chunks, whichever it is)

        def dlogits(s: int) -> torch.Tensor:
            return ce_grad(x2[s:s + step] @ w.t(), t[s:s + step], lse[s:s + step], g[s:s + step], *opts).to(x2.dtype)

        def compute(out, acc):  # the weight gradient (and dx, when this is the first pass)
            dw = torch.zeros_like(w) if out is None else (out if acc else out.zero_())
            for s in range(0, n, step):
                d = dlogits(s)
                if pending_dx[0]:
                    torch.mm(d, w, out=dx[s:s + step])
                _add_wgrad(dw, d, x2[s:s + step])
            pending_dx[0] = False
            return dw

        dw = deliver_weight_grad(lin, lin.weight, compute) if lctx.weight_grad else None
        if pending_dx[0]:  # frozen head, or its weight gradient delayed
            for s in range(0, n, step):
                torch.mm(dlogits(s), w, out=dx[s:s + step])
            pending_dx[0] = False
        if dx is not None:
            dx = dx.reshape(lctx.input_shape)
        return dx, [(dw,), ()], [(), (None,)]


def _add_wgrad(dw: torch.Tensor, d: torch.Tensor, x: torch.Tensor) -> None:
    """``dw += d.T @ x`` with no temporary of dw's size: one ``addmm_`` (the GEMM accumulates in fp32
    and adds dw before its one rounding) when the dtypes agree; into an fp32 ``main_grad``, in
    blocks of at most 1/8 of the rows."""
    if dw.dtype == d.dtype:
        dw.addmm_(d.t(), x)
        return
    block = max(1, -(-dw.shape[0] // 8))
    for v in range(0, dw.shape[0], block):
        dw[v:v + block].add_(d[:, v:v + block].t() @ x)


def _check(ops, ctx):
    if ctx.recipe is not None:
        return "an FP8 recipe is active: the chunked GEMMs run in high precision (unfused, the linear runs FP8)"
    return None


RULES = [  # the built-in rules of this family (installed by fusible_ops/__init__.py)
    rule("linear_cross_entropy", [BasicLinear, CrossEntropy], pass_="joint", build=LinearCrossEntropy, check=_check),
]

__all__ = ["CHUNK_BYTES", "LinearCrossEntropy", "RULES", "chunk_rows"]
