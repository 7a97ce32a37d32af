"""Linear + cross-entropy: ``BasicLinear -> CrossEntropy``, a language model's head (rule
``linear_cross_entropy``, joint: forward and backward).

The ``[T, V]`` logits are the largest activation of a language model (T=16384 tokens, V=128256:
4 GB in bf16, 8 GB for their fp32 gradient). The fused op works through the tokens in chunks of
:func:`chunk_rows` rows, so no ``[T, V]`` tensor is ever made or kept. Per chunk: ``logits = x_c @
W.T`` (one GEMM in x's dtype), then one Triton kernel (:mod:`fusible_ops.kernels.cross_entropy`)
gives the rows' loss and logsumexp in float32 (float64 for float64 x, as the unfused ops) and, where
the gradient is made then, writes the logits' gradient over the logits (one chunk buffer). ``dx_c = dlogits @ W`` and ``dW += dlogits.T @
x_c`` follow (:func:`~fusible_ops.kernels.gemm.linear_wgrad` into the gradient buffer, an fp32
``main_grad`` included: fp32 accumulation in the GEMM, one rounding per chunk). Two schedules:

* **gradients in forward** (the default when the loss is reduced, ``"mean"`` or ``"sum"``, and the
  weight gradient is not delayed): three GEMMs per chunk, all in the forward pass, for a loss
  gradient of 1; backward scales dx and dW by the loss's actual gradient (in place). It keeps dx
  (``[T, d]``) and dW (``[V, d]``, W's dtype) from forward to backward, and neither x nor W.
  Backward may run once: a second one through the same forward (``retain_graph``) gets autograd's
  error that a saved tensor was modified in place.
* **logits recomputed in backward** (``reduction="none"``, whose per-row gradient is unknown in
  forward; delayed weight gradients, whose GEMM must wait for ``backward_dw()``): forward runs one
  GEMM per chunk and keeps x, W, the targets and the logsumexp (fp32 ``[T]``); backward runs the
  logits GEMM again, so four GEMMs per chunk in all.

:data:`GRAD_IN_FORWARD` forces either (the benchmark times both). Either way the weight gradient goes
through :func:`~fusible_ops.grad.deliver_weight_grad` (``main_grad`` accumulation; a frozen head
runs no weight-gradient GEMM; delayed weight gradients), and a weight tied to an embedding gets both
gradients, as unfused.

Chunk size: :data:`CHUNK_BYTES` of logits in x's dtype (the kernel writes the gradient over them),
rounded down to a multiple of 128 rows. ``explain()`` shows the chunking and the schedule. On CPU the
same chunking runs with the kernels' torch twins (the CPU tests prove the memory behaviour).

Under :class:`~fusible_ops.Float8CurrentScaling` the GEMMs run in FP8: x quantized once per call
(both layouts when W's gradient is needed), W from the weight cache, each chunk's logits gradient
quantized once (E5M2 under "hybrid") for its dx and dW GEMMs; chunks are then a multiple of 16 tokens
(the FP8 dims). Declines under the other recipes (delayed scaling would update its history once per
chunk; block scaling is not built).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..grad import deliver_weight_grad, scheduler_active
from ..kernels.cross_entropy import ce_grad_, ce_loss, ce_loss_grad_
from ..kernels.fp8_gemm import fp8_gemm
from ..kernels.gemm import linear_fprop, linear_fprop_again, linear_wgrad_chain
from ..op import FusedOperation
from ..ops.fp8_linear import check_dims
from ..ops.linear import BasicLinear
from ..ops.loss import CrossEntropy, loss_dtype, reduce_rows, row_scale
from ..ops.validation import check_input
from ..quantization.casting import cached_weight, quantize
from ..quantization.recipes import Float8CurrentScaling, current_recipe
from ..quantization.tensor import is_float8
from ..rules import rule

CHUNK_BYTES = 128 << 20
"""Memory target of one chunk: its logits in x's dtype (``V * x.element_size()`` bytes per row)."""

GRAD_IN_FORWARD: Optional[bool] = None
"""None (default): gradients in forward where the schedule allows (see the module docstring);
False: always recompute the logits in backward; True: in forward wherever allowed."""


def chunk_rows(vocab: int, rows: int, elem_bytes: int = 2, fp8: bool = False) -> int:
    """Rows per chunk for ``rows`` tokens and ``vocab`` classes of ``elem_bytes`` each (at least 1,
    at most ``rows``; a multiple of 128 when at least 128 and fewer than ``rows``; under FP8 a
    multiple of 16, the weight gradient's reduction dim)."""
    step = max(1, min(rows, CHUNK_BYTES // (elem_bytes * max(vocab, 1))))
    if 128 <= step < rows:
        step = step // 128 * 128
    return max(16, step // 16 * 16) if fp8 else step


def grad_in_forward(lin: BasicLinear, ce: CrossEntropy) -> bool:
    """Whether the head computes its gradients in forward (see the module docstring)."""
    if ce.reduction == "none" or lin.delay_wgrad_compute or scheduler_active():
        return False
    return GRAD_IN_FORWARD is not False


class LinearCrossEntropy(FusedOperation):
    """Forward and backward of ``BasicLinear -> CrossEntropy`` over chunks of tokens (see the module
    docstring): the loss of ``x @ weight.T`` against the targets, without the ``[T, V]`` logits."""

    def __init__(self, ops) -> None:
        super().__init__(ops)
        self._no_extras = [(), ()]

    def explain_note(self, x: torch.Tensor) -> str:
        """The chunking and schedule for an input like ``x`` (explain() appends it to the plan line)."""
        lin, ce = self.basic_ops
        rows = x.numel() // max(x.shape[-1], 1) if x.dim() else 1
        fp8 = current_recipe() is not None
        step = chunk_rows(lin.out_features, rows, x.element_size(), fp8=fp8)
        when = ("gradients in forward (3 GEMMs)" if grad_in_forward(lin, ce)
                else "logits recomputed in backward (4 GEMMs)")
        return (f"{-(-rows // step) if rows else 0} chunk(s) of {step} token(s), no [{rows}, {lin.out_features}] "
                f"logits; {when}" + ("; FP8 GEMMs, each chunk's logits gradient cast once" if fp8 else ""))

    def fuser_forward(self, ctxs, x, *, extra_inputs, **kwargs):
        lin, ce = self.basic_ops
        lctx = ctxs[0]
        w = lin.weight
        check_input(lin, x, features=lin.in_features, like=w)
        (targets,) = extra_inputs[1]
        vocab = lin.out_features
        t = ce.check_targets((*x.shape[:-1], vocab), vocab, targets, x.device)
        if is_float8(x):
            x = x.dequantize()
        x2 = x.reshape(-1, lin.in_features)
        n = x2.shape[0]
        xg = lctx.requires_grad and lctx.input_requires_grad
        wg = lctx.requires_grad and lctx.weight_requires_grad and w.requires_grad
        early = (xg or wg) and grad_in_forward(lin, ce)
        recipe = current_recipe()
        if recipe is None:
            gemms = _HighPrecision(x2, w)
        else:  # FP8 current scaling (the rule declines the other recipes)
            check_dims(lin, recipe, n, vocab, lin.in_features, wg)
            owner = lin.param_owner("weight")
            xq = quantize(x2, recipe, "input", transposed=wg, owner=owner)
            wq = cached_weight(owner, w, recipe, transposed=xg)
            gemms = _Fp8(recipe, x2.dtype, xq.rowwise, xq.colwise, wq.rowwise, wq.colwise)
        step = chunk_rows(vocab, n, x2.element_size(), fp8=recipe is not None)
        acc = loss_dtype(x2.dtype)  # (as CrossEntropy's own: float32, float64 for float64 logits)
        rows = torch.empty(n, dtype=acc, device=x.device)
        lse = torch.empty(n, dtype=acc, device=x.device)
        opts = ce.options()
        if early:
            g = row_scale(torch.ones((), device=x.device), t, ce.ignore_index, ce.reduction, acc)
            dx = torch.empty(n, lin.in_features, dtype=x2.dtype, device=x.device) if xg else None
            new = torch.empty if n else torch.zeros  # (the first chunk writes dW)
            dw = new(w.shape, dtype=w.dtype, device=w.device) if wg else None
            for s in range(0, n, step):
                z = gemms.logits(s, s + step)
                rows[s:s + step], lse[s:s + step] = ce_loss_grad_(z, t[s:s + step], g[s:s + step], opts)
                d = gemms.prepare(z)
                if xg:
                    gemms.dx(d, dx[s:s + step])
                if wg:
                    gemms.add_wgrad(dw, d, s, s + step, first=s == 0)
                del z, d  # (before the next chunk's logits: one chunk buffer at a time)
        else:
            for s in range(0, n, step):
                rows[s:s + step], lse[s:s + step] = ce_loss(gemms.logits(s, s + step), t[s:s + step], opts)
        loss = reduce_rows(rows, t, ce.ignore_index, ce.reduction, targets.shape)
        if lctx.requires_grad:
            lctx.weight_grad = wg
            lctx.input_shape = x.shape
            lctx.step = step
            lctx.early = early
            lctx.loss_dtype = acc
            if early:
                lctx.save_for_backward(dx, dw)
            else:
                lctx.fp8 = gemms.state()  # (non-tensor state; the tensors go through save_for_backward)
                lctx.save_for_backward(t, lse, *gemms.tensors())
        return loss, self._no_extras

    def fuser_backward(self, ctxs, dy, *, grad_extra_outputs, **kwargs):
        lctx = ctxs[0]
        if lctx.early:
            return self._scale_early(lctx, dy)
        lin, ce = self.basic_ops
        t, lse, *tensors = lctx.saved_tensors
        gemms = _HighPrecision(*tensors) if lctx.fp8 is None else _Fp8.from_saved(lctx.fp8, tensors)
        w = lin.weight
        g = row_scale(dy, t, ce.ignore_index, ce.reduction, lse.dtype)
        opts = ce.options()
        n, step = t.shape[0], lctx.step
        dx = torch.empty(n, lin.in_features, dtype=gemms.dtype, device=t.device) if lctx.input_requires_grad else None
        pending_dx = [dx is not None]  # (filled by the first pass over the chunks, whichever it is)

        def dlogits(s: int):  # the chunk's logits gradient as its two GEMMs read it
            d = ce_grad_(gemms.logits(s, s + step, again=True), t[s:s + step], lse[s:s + step], g[s:s + step], opts)
            return gemms.prepare(d)

        def compute(out, acc):  # the weight gradient (and dx, when this is the first pass)
            overwrite = out is None or not acc  # (then the first chunk writes dw)
            dw = torch.empty_like(w) if out is None else out
            if overwrite and n == 0:
                dw.zero_()
            for s in range(0, n, step):
                d = dlogits(s)
                if pending_dx[0]:
                    gemms.dx(d, dx[s:s + step])
                gemms.add_wgrad(dw, d, s, s + step, first=overwrite and s == 0)
                del d  # (one chunk buffer at a time)
            pending_dx[0] = False
            return dw

        dw = deliver_weight_grad(lin, w, compute) if lctx.weight_grad else None
        if pending_dx[0]:  # frozen head, or its weight gradient delayed
            for s in range(0, n, step):
                gemms.dx(dlogits(s), dx[s:s + step])
            pending_dx[0] = False
        if dx is not None:
            dx = dx.reshape(lctx.input_shape)
        return dx, [(dw,), ()], [(), (None,)]

    def _scale_early(self, lctx, dy):
        """Backward of the gradients-in-forward schedule: dx and dW (made for a loss gradient of 1)
        scaled in place by the loss's gradient ``dy`` (a scalar: the loss is reduced). They are saved
        tensors, so a second backward through the same forward gets autograd's error that a saved
        tensor was modified in place, never a gradient scaled twice."""
        lin = self.basic_ops[0]
        dx, dw = lctx.saved_tensors
        # (in place; _foreach_mul_ keeps dy in the loss's dtype (fp32; fp64 for float64 x) and
        # vectorizes: a plain bf16.mul_(fp32 0-dim tensor) takes torch's mixed-dtype path, 2.6 ms for
        # the 1 GB dW of the lm_head case, H200)
        dy = dy.to(lctx.loss_dtype)
        if dx is not None:
            torch._foreach_mul_([dx], dy)
            dx = dx.reshape(lctx.input_shape)

        def compute(out, acc):
            torch._foreach_mul_([dw], dy)
            return dw if out is None else out.add_(dw) if acc else out.copy_(dw)

        dwg = deliver_weight_grad(lin, lin.weight, compute) if lctx.weight_grad else None
        return dx, [(dwg,), ()], [(), (None,)]


class _HighPrecision:
    """The head's three GEMM shapes in x's dtype: a chunk's logits, its dx, its dW contribution."""

    def __init__(self, x2: torch.Tensor, w: torch.Tensor) -> None:
        self.x2, self.w, self.dtype = x2, w, x2.dtype

    def state(self):
        return None

    def tensors(self) -> tuple:
        return self.x2, self.w

    def logits(self, s: int, e: int, again: bool = False) -> torch.Tensor:
        # (again: backward's recompute, which torch.compile must not merge with forward's GEMM)
        return (linear_fprop_again if again else linear_fprop)(self.x2[s:e], self.w)

    def prepare(self, d: torch.Tensor):
        return d

    def dx(self, d, out: torch.Tensor) -> None:
        torch.mm(d, self.w, out=out)

    def add_wgrad(self, dw: torch.Tensor, d, s: int, e: int, first: bool = False) -> None:
        # (the dense GEMM seam: one GEMM writes or adds into dw, an fp32 main_grad too, no temporary)
        linear_wgrad_chain(d, self.x2[s:e], dw, not first)


class _Fp8:
    """The same GEMMs in FP8 (current scaling): x and W quantized once per call (W from the weight
    cache), each chunk's logits gradient quantized once (E5M2 under "hybrid") for its dx and dW."""

    def __init__(self, recipe, dtype, x_rows, x_cols, w_rows, w_cols) -> None:
        self.recipe, self.dtype = recipe, dtype
        self.x_rows, self.x_cols, self.w_rows, self.w_cols = x_rows, x_cols, w_rows, w_cols

    def state(self):
        return self.recipe, self.dtype

    def tensors(self) -> tuple:
        none = (None, None)
        return (*self.x_rows, *(self.x_cols or none), *self.w_rows, *(self.w_cols or none))

    @staticmethod
    def from_saved(state, parts) -> "_Fp8":
        """From :meth:`state` and the saved :meth:`tensors` (pairs; None where not made)."""
        return _Fp8(*state, *[None if parts[i] is None else (parts[i], parts[i + 1]) for i in range(0, 8, 2)])

    def logits(self, s: int, e: int, again: bool = False) -> torch.Tensor:
        data, inv = self.x_rows
        return fp8_gemm((data[s:e], inv), self.w_rows, "tensor", "tensor", self.dtype)

    def prepare(self, d: torch.Tensor):
        return quantize(d, self.recipe, "grad_output", transposed=self.x_cols is not None)

    def dx(self, dq, out: torch.Tensor) -> None:
        fp8_gemm(dq.rowwise, self.w_cols, "tensor", "tensor", out.dtype, out=out)

    def add_wgrad(self, dw: torch.Tensor, dq, s: int, e: int, first: bool = False) -> None:
        data, inv = self.x_cols  # (the chunk's columns copied out: [d, chunk] FP8, small; a plain operand)
        fp8_gemm(dq.colwise, (data[:, s:e].contiguous(), inv), "tensor", "tensor", dw.dtype, out=dw,
                 accumulate=not first)


def _check(ops, ctx):
    if ctx.recipe is not None and not isinstance(ctx.recipe, Float8CurrentScaling):
        return (f"{type(ctx.recipe).__name__}: the chunked head runs FP8 under Float8CurrentScaling only "
                "(delayed scaling would update its history once per chunk)")
    return None


RULES = [  # the built-in rules of this family (installed by fusible_ops/__init__.py)
    rule("linear_cross_entropy", [BasicLinear, CrossEntropy], pass_="joint", build=LinearCrossEntropy, check=_check),
]

__all__ = ["CHUNK_BYTES", "GRAD_IN_FORWARD", "LinearCrossEntropy", "RULES", "chunk_rows", "grad_in_forward"]
