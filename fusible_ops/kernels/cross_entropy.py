"""Cross-entropy rows: each row's loss and logsumexp, and the logits' gradient, in one kernel.

One program per row of ``logits [rows, V]`` (fp32 / fp16 / bf16, row stride free, column stride
1), float32 math whatever the dtype. Options (as :class:`fusible_ops.CrossEntropy`):
``ignore_index``, ``label_smoothing`` (eps), ``z_loss_coeff`` and ``logit_softcap``:

* pass 1 (``LOSS``): an online max / sum of exponentials over V gives ``lse`` (the logsumexp of the
  soft-capped logits); the row's loss is ``lse - z[t]``, mixed with ``lse - mean(z)`` by eps, plus
  ``z_loss_coeff * lse^2``; 0 for a row whose target is ``ignore_index``.
* pass 2 (``GRAD``): ``d = g * (softmax(z) * (1 + 2 zl lse) - eps / V - (1 - eps) [j == t])``,
  times ``1 - (z / cap)^2`` under a softcap, written in ``out``'s dtype. ``out`` may be the logits
  themselves (each program reads its row's element before writing it): the fused linear +
  cross-entropy keeps one chunk buffer, logits then gradient. ``g`` is the per-row scale of the
  loss's gradient (0 on ignored rows: :func:`fusible_ops.ops.loss.row_scale`). Without ``LOSS``
  pass 2 reads a given ``lse``.

Entry points: :func:`ce_loss` (pass 1), :func:`ce_grad_rows` (pass 2 into a new tensor),
:func:`ce_loss_grad_` (both, gradient in place of the logits), :func:`ce_grad_` (pass 2 in place).
Each runs the ``*_ref`` twin (:func:`ce_loss_ref`, :func:`ce_grad_ref`, the same math in torch ops;
the reference of the op, ``F.cross_entropy``, is in :mod:`fusible_ops.ops.loss`) where the dispatch
rule says so (CPU, float64, ``use("reference")``).
Out-of-range targets are the caller's to check (:meth:`CrossEntropy.check_targets`); the kernel
reads ``z[t]`` only for ``0 <= t < V``.
"""

from __future__ import annotations

from typing import Optional

import torch

from fusible_ops.kernels import HAS_TRITON, use_triton
from fusible_ops.kernels.launch import DirectKernel, generic_key, kernel_op, next_pow2

if HAS_TRITON:
    import triton
    import triton.language as tl

    from fusible_ops.kernels.act_table import tanh_exp

    @triton.jit
    def _capped(x_ptr, cols, mask, cap, SOFTCAP: tl.constexpr):
        z = tl.load(x_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if SOFTCAP:
            z = tl.where(mask, cap * tanh_exp(z / cap), float("-inf"))
        return z

    @triton.jit
    def _ce_kernel(
        x_ptr, x_stride,  # logits [rows, V] (column stride 1)
        t_ptr,  # targets [rows] (int32 / int64)
        g_ptr,  # fp32 [rows]: the loss gradient's row scale (pass 2)
        lse_ptr,  # fp32 [rows]: written by pass 1, read by pass 2 alone
        loss_ptr,  # fp32 [rows] (pass 1)
        out_ptr, out_stride,  # gradient [rows, V] (pass 2; may be x itself)
        V, ignore_index, eps, zl, cap,
        LOSS: tl.constexpr, GRAD: tl.constexpr, SOFTCAP: tl.constexpr, SMOOTH: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * x_stride
        t = tl.load(t_ptr + row).to(tl.int32)
        valid = t != ignore_index
        offs = tl.arange(0, BLOCK_V)
        if LOSS:
            m = tl.full((), float("-inf"), tl.float32)
            s = tl.full((), 0.0, tl.float32)
            zsum = tl.full((), 0.0, tl.float32)
            for v0 in range(0, V, BLOCK_V):
                cols = v0 + offs
                mask = cols < V
                z = _capped(x_row, cols, mask, cap, SOFTCAP)
                m_new = tl.maximum(m, tl.max(z, 0))
                s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
                m = m_new
                if SMOOTH:
                    zsum += tl.sum(tl.where(mask, z, 0.0), 0)
            lse = m + tl.log(s)
            tt = tl.where(valid & (t >= 0) & (t < V), t, 0)
            zt = tl.load(x_row + tt).to(tl.float32)
            if SOFTCAP:
                zt = cap * tanh_exp(zt / cap)
            loss = lse - zt
            if SMOOTH:
                loss = (1.0 - eps) * loss + eps * (lse - zsum / V)
            loss += zl * lse * lse
            tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))
            tl.store(lse_ptr + row, lse)
        else:
            lse = tl.load(lse_ptr + row)
        if GRAD:
            g = tl.load(g_ptr + row)
            pscale = g * (1.0 + 2.0 * zl * lse)
            o_row = out_ptr + row * out_stride
            for v0 in range(0, V, BLOCK_V):
                cols = v0 + offs
                mask = cols < V
                z = _capped(x_row, cols, mask, cap, SOFTCAP)
                d = tl.exp(z - lse) * pscale - g * eps / V
                d = tl.where(cols == t, d - g * (1.0 - eps), d)
                if SOFTCAP:
                    zc = tl.where(mask, z / cap, 0.0)  # (masked lanes hold -inf: no inf * 0)
                    d = d * (1.0 - zc * zc)
                tl.store(o_row + cols, d.to(out_ptr.dtype.element_ty), mask=mask)

    _CE = DirectKernel(_ce_kernel)


MAX_BLOCK_V = 8192
"""Columns per step of a row's loop over V (tests shrink it to run several steps)."""


def _block_v(vocab: int) -> tuple[int, int]:
    block = max(16, min(MAX_BLOCK_V, next_pow2(vocab)))
    return block, (16 if block >= 8192 else 8 if block >= 2048 else 4)


def _launch(x, t, g, lse, loss, out, opts, loss_pass: bool, grad_pass: bool) -> None:
    ignore_index, eps, zl, cap = opts
    rows, vocab = x.shape
    if rows == 0:
        return
    block, warps = _block_v(vocab)
    dummy = lse
    args = (x, x.stride(0), t, g if g is not None else dummy, lse, loss if loss is not None else dummy,
            out if out is not None else x, out.stride(0) if out is not None else 0, vocab, ignore_index,
            float(eps), float(zl), float(cap or 1.0))
    meta = dict(LOSS=loss_pass, GRAD=grad_pass, SOFTCAP=cap is not None, SMOOTH=bool(eps), BLOCK_V=block,
                num_warps=warps)
    _CE((rows,), generic_key(args, meta), args, meta)


def _rows_cols(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _loss_rows(x, t, g, out, opts) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 1 (and pass 2 into ``out`` when given): fresh fp32 ``(loss, lse)`` rows."""
    loss = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    lse = torch.empty_like(loss)
    _launch(x, t, g, lse, loss, out, opts, True, out is not None)
    return loss, lse


def _rows_fake(x):
    return x.new_empty(x.shape[0], dtype=torch.float32), x.new_empty(x.shape[0], dtype=torch.float32)


@kernel_op("fusible_ops::ce_loss", mutates_args=())
def _ce_loss_op(x: torch.Tensor, t: torch.Tensor, ignore_index: int, eps: float, zl: float,
                cap: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    return _loss_rows(x, t, None, None, (ignore_index, eps, zl, cap))


@_ce_loss_op.register_fake
def _(x, t, ignore_index, eps, zl, cap):
    return _rows_fake(x)


@kernel_op("fusible_ops::ce_grad_rows", mutates_args=())
def _ce_grad_op(x: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, ignore_index: int,
                eps: float, zl: float, cap: Optional[float]) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, t, g, lse, None, out, (ignore_index, eps, zl, cap), False, True)
    return out


@_ce_grad_op.register_fake
def _(x, t, lse, g, ignore_index, eps, zl, cap):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@kernel_op("fusible_ops::ce_loss_grad_", mutates_args=("x",))
def _ce_loss_grad_op(x: torch.Tensor, t: torch.Tensor, g: torch.Tensor, ignore_index: int, eps: float, zl: float,
                     cap: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    return _loss_rows(x, t, g, x, (ignore_index, eps, zl, cap))


@_ce_loss_grad_op.register_fake
def _(x, t, g, ignore_index, eps, zl, cap):
    return _rows_fake(x)


@kernel_op("fusible_ops::ce_grad_", mutates_args=("x",))
def _ce_grad_inplace_op(x: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, ignore_index: int,
                        eps: float, zl: float, cap: Optional[float]) -> None:
    _launch(x, t, g, lse, None, x, (ignore_index, eps, zl, cap), False, True)


# ----------------------------------------------------------------------------- public API
# opts = (ignore_index, label_smoothing, z_loss_coeff, logit_softcap), CrossEntropy.options()


def ce_loss(x: torch.Tensor, t: torch.Tensor, opts: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(loss, lse)`` per row of logits ``x [rows, V]`` against targets ``t [rows]``."""
    if use_triton(x):
        return _ce_loss_op(_rows_cols(x), t, *opts)
    if _is_compiling():  # (the twin as one opaque op: see _ce_loss_grad_ref_op)
        return _ce_loss_ref_op(x, t, *opts)
    return ce_loss_ref(x, t, opts)


def ce_grad_rows(x: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, opts: tuple) -> torch.Tensor:
    """The logits' gradient (x's dtype, a new tensor) from the rows' ``lse`` and scale ``g``."""
    if use_triton(x):
        return _ce_grad_op(_rows_cols(x), t, lse, g, *opts)
    return ce_grad_ref(x, t, lse, g, opts).to(x.dtype)


def ce_loss_grad_(x: torch.Tensor, t: torch.Tensor, g: torch.Tensor, opts: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, lse)`` as :func:`ce_loss`, and the gradient (row scale ``g``) written over ``x``
    (which must have column stride 1)."""
    if use_triton(x):
        return _ce_loss_grad_op(x, t, g, *opts)
    if _is_compiling():  # (the twin as one opaque op: see _ce_loss_grad_ref_op)
        return _ce_loss_grad_ref_op(x, t, g, *opts)
    return _ce_loss_grad_ref(x, t, g, opts)


def ce_grad_(x: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, opts: tuple) -> torch.Tensor:
    """The gradient written over ``x`` (column stride 1); returns ``x``."""
    if use_triton(x):
        _ce_grad_inplace_op(x, t, lse, g, *opts)
    elif _is_compiling():
        _ce_grad_inplace_ref_op(x, t, lse, g, *opts)
    else:
        x.copy_(ce_grad_ref(x, t, lse, g, opts))
    return x


# The head's entry points' torch twins as custom ops, for traced calls (torch.compile) only: traced
# as plain torch ops, inductor fuses each chunk's ``z[target]`` gather of the chunked linear +
# cross-entropy head into the final loss reduction, so every chunk's logits stay alive at once
# (tests/test_compile_head_memory.py); opaque, each chunk's buffer is done with before the next
# chunk's logits, as with the Triton kernels.
_is_compiling = torch.compiler.is_compiling


def _ce_loss_grad_ref(x, t, g, opts):
    loss, lse = ce_loss_ref(x, t, opts)
    x.copy_(ce_grad_ref(x, t, lse, g, opts))
    return loss, lse


@torch.library.custom_op("fusible_ops::ce_loss_ref", mutates_args=())
def _ce_loss_ref_op(x: torch.Tensor, t: torch.Tensor, ignore_index: int, eps: float, zl: float,
                    cap: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    return ce_loss_ref(x, t, (ignore_index, eps, zl, cap))


@torch.library.custom_op("fusible_ops::ce_loss_grad_ref_", mutates_args=("x",))
def _ce_loss_grad_ref_op(x: torch.Tensor, t: torch.Tensor, g: torch.Tensor, ignore_index: int, eps: float,
                         zl: float, cap: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    return _ce_loss_grad_ref(x, t, g, (ignore_index, eps, zl, cap))


def _ref_rows_fake(x, *args):
    acc = torch.promote_types(x.dtype, torch.float32)
    return x.new_empty(x.shape[0], dtype=acc), x.new_empty(x.shape[0], dtype=acc)


_ce_loss_ref_op.register_fake(_ref_rows_fake)
_ce_loss_grad_ref_op.register_fake(_ref_rows_fake)


@torch.library.custom_op("fusible_ops::ce_grad_ref_", mutates_args=("x",))
def _ce_grad_inplace_ref_op(x: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, g: torch.Tensor,
                            ignore_index: int, eps: float, zl: float, cap: Optional[float]) -> None:
    x.copy_(ce_grad_ref(x, t, lse, g, (ignore_index, eps, zl, cap)))


def _softcap(z: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    return z if cap is None else cap * torch.tanh(z / cap)


def ce_loss_ref(x: torch.Tensor, t: torch.Tensor, opts: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of pass 1: per-row loss (fp32 [rows], 0 for ignored rows; float64 stays) and
    logsumexp (of the soft-capped logits) of ``x [rows, V]`` against ``t [rows]``."""
    ignore_index, eps, zl, cap = opts
    z = _softcap(x.to(torch.promote_types(x.dtype, torch.float32)), cap)
    lse = torch.logsumexp(z, dim=-1)
    valid = t != ignore_index
    zt = z.gather(1, torch.where(valid, t, 0).unsqueeze(1)).squeeze(1)
    loss = lse - zt
    if eps:
        loss = (1.0 - eps) * loss + eps * (lse - z.mean(dim=-1))
    if zl:
        loss = loss + zl * lse * lse
    return torch.where(valid, loss, 0.0), lse


def ce_grad_ref(x: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, opts: tuple) -> torch.Tensor:
    """Reference of pass 2: the gradient of ``sum(g * loss)`` w.r.t. ``x [rows, V]`` in float32
    (float64 stays); ``g`` [rows], already 0 on ignored rows."""
    ignore_index, eps, zl, cap = opts
    z = _softcap(x.to(torch.promote_types(x.dtype, torch.float32)), cap)
    d = torch.exp(z - lse.unsqueeze(1))
    if zl:
        d = d * (1.0 + 2.0 * zl * lse).unsqueeze(1)
    if eps:
        d = d - eps / z.shape[-1]
    valid = t != ignore_index
    d.scatter_add_(1, torch.where(valid, t, 0).unsqueeze(1),
                   torch.full((z.shape[0], 1), -(1.0 - eps), dtype=d.dtype, device=z.device))
    d = d * g.to(d.dtype).unsqueeze(1)
    if cap is not None:
        d = d * (1.0 - (z / cap) ** 2)
    return d


__all__ = ["ce_grad_", "ce_grad_ref", "ce_grad_rows", "ce_loss", "ce_loss_grad_", "ce_loss_ref"]
