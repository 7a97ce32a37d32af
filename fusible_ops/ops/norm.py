"""LayerNorm and RMSNorm over the last dim. The input has the parameters' dtype, or is bf16/fp16
with float32 parameters (the math runs in fp32; the output has the input's dtype); any other
dtype raises a ``TypeError`` naming the op.

Context contract: ``saved_tensors == (xsum, weight, mean, rstd)`` (``mean`` is ``None`` for
RMSNorm) where ``xsum`` is the normalized tensor (the input, or input + residual when a fused
residual add precedes the norm); ``ctx.weight_grad`` / ``ctx.bias_grad`` say which parameter
gradients to compute (a frozen one costs no reduction).
"""

from __future__ import annotations

import torch

from ..kernels import norm as _K
from ..kernels import use_triton
from ..op import BasicOperation
from .validation import NATIVE_DTYPES as _NATIVE_DTYPES
from .validation import check_input



class _Norm(BasicOperation):
    def __init__(self, size: int, eps: float = 1e-5, *, device=None, dtype=None, bias: bool) -> None:
        super().__init__()
        if size <= 0:
            raise ValueError(f"{type(self).__name__}: size must be positive, got {size}")
        self.size = int(size)
        self.eps = float(eps)
        self.weight = torch.nn.Parameter(torch.ones(size, device=device, dtype=dtype))
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(size, device=device, dtype=dtype))

    def extra_repr(self) -> str:
        return f"{self.size}, eps={self.eps}"

    @classmethod
    def _example(cls, n: int, **factory):
        op = cls(n, **factory)
        with torch.no_grad():
            for p in op.parameters():
                p.uniform_(0.5, 1.5)
        return op, n

    def check_input(self, x: torch.Tensor) -> None:
        """Raise a clear error if ``x`` cannot be this norm's input."""
        check_input(self, x, features=self.size, like=self.weight, wide_params=True)

    writes_fp8_output = True  # serves a following FP8 linear from its own kernel (see norm_forward)
    cpu_autograd = True  # (see FusibleOperation.cpu_autograd)
    replayable = True  # (see FusibleOperation.replayable)
    _IS_RMS = False

    def norm_forward(self, ctx, x: torch.Tensor, residual=None, quant=None):
        """Check ``x`` (as :meth:`check_input`; ``residual``, if any, must have been checked
        against ``x`` by the caller), run the (optionally residual-fused) forward and fill ``ctx``.
        Returns (y, xsum). With ``quant`` (the next FP8 linear's
        :class:`~fusible_ops.quantization.InputQuantizer`) y is that linear's FP8 input, written by
        the norm kernel itself."""
        w = self.weight  # (each parameter read once per call: reads go through Module.__getattr__)
        check_input(self, x, features=self.size, like=w, wide_params=True)
        bias = None if self._IS_RMS else self.bias
        if (not ctx.requires_grad and quant is None and x.dtype in _NATIVE_DTYPES and w.dtype is x.dtype
                and (bias is None or bias.dtype is x.dtype) and not use_triton(x, w)):
            # Reference math that keeps no statistics (a call under PyTorch's autograd, or
            # inference): torch's own norm, same math in x's dtype (fp32, or fp64), one op where
            # the reference formula takes six (and, under autograd, its fused backward).
            xsum = x if residual is None else x + residual
            # (torch.rms_norm / torch.layer_norm: F.*'s bodies without their Python wrappers)
            if self._IS_RMS:
                return torch.rms_norm(xsum, (self.size,), w, self.eps), xsum
            return torch.layer_norm(xsum, (self.size,), w, bias, self.eps, torch.backends.cudnn.enabled), xsum
        y, mean, rstd, xsum = self._run(x, w, bias, residual, quant)
        if ctx.requires_grad:
            ctx.save_for_backward(xsum, w, mean, rstd)
            ctx.weight_grad = w.requires_grad
            if bias is not None:
                ctx.bias_grad = bias.requires_grad
        return y, xsum

    def _run(self, x, w, bias, residual, quant):
        """(y, mean or None, rstd, xsum) of the kernels."""
        rms = self._IS_RMS
        if quant is None:
            if rms:
                y, rstd, xsum = _K.rmsnorm_fwd_unchecked(x, w, self.eps, residual)
                return y, None, rstd, xsum
            return _K.layernorm_fwd_unchecked(x, w, bias, self.eps, residual)
        stats = []

        def run(amax=None, **fp8):
            if amax is None:
                out = self._run(x, w, bias, residual, None)
            else:
                out = _K.norm_fwd_fp8(x, w, bias, self.eps, residual, is_rms=rms, amax=amax, **fp8)
            stats.append(out)
            return out[0]

        y = quant.produce(run, x)
        return (y,) + tuple(stats[0][1:])

    def op_forward(self, ctx, x, **kwargs):
        y, _ = self.norm_forward(ctx, x, quant=kwargs.get("next_op_input_quantizer"))
        return y

    def op_backward(self, ctx, dy):
        return self.norm_backward(ctx, dy)


class LayerNorm(_Norm):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dim of size ``size``."""

    def __init__(self, size: int, eps: float = 1e-5, *, device=None, dtype=None) -> None:
        super().__init__(size, eps, device=device, dtype=dtype, bias=True)

    def norm_backward(self, ctx, dy, dxsum_extra=None):
        xsum, w, mean, rstd = ctx.saved_tensors
        dx, dw, db = _K.layernorm_bwd_unchecked(dy, xsum, w, mean, rstd, ctx.weight_grad, ctx.bias_grad, dxsum_extra)
        return dx, (dw, db)

    def reference_forward(self, x):
        return torch.nn.functional.layer_norm(
            x.to(self.weight.dtype), (self.size,), self.weight, self.bias, self.eps
        ).to(x.dtype)


class RMSNorm(_Norm):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim of size ``size``."""

    _IS_RMS = True

    def __init__(self, size: int, eps: float = 1e-5, *, device=None, dtype=None) -> None:
        super().__init__(size, eps, device=device, dtype=dtype, bias=False)

    def norm_backward(self, ctx, dy, dxsum_extra=None):
        xsum, w, _, rstd = ctx.saved_tensors
        dx, dw = _K.rmsnorm_bwd_unchecked(dy, xsum, w, rstd, ctx.weight_grad, dxsum_extra)
        return dx, (dw,)

    def reference_forward(self, x):
        xf = x.to(torch.promote_types(x.dtype, self.weight.dtype))
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return y.to(x.dtype)


NORM_CLASSES = (LayerNorm, RMSNorm)
