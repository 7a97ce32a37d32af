"""Activations: ReLU, GELU, SiLU and the gated SwiGLU, GEGLU, ReGLU, ScaledSwiGLU.

Gated ops split the input's last dim in two halves; the FIRST half goes through the activation
and multiplies the second. On CUDA the math runs Triton kernels
(:mod:`fusible_ops.kernels.activation`), on CPU their ``*_ref`` twins.

Context contract (what fused ops must leave in an activation's ctx): ``saved_tensors == (x,)``
with ``x`` the activation's input *before* an optional folded bias, and ``ctx.act_bias`` that
bias (``None`` when no bias was folded in). The activation's backward recomputes
``z = x + act_bias`` on the fly, so a fused bias+activation forward never writes ``z``.
"""

from __future__ import annotations

import math

import torch

from ..kernels import activation as _K
from ..kernels import use_triton
from ..kernels.activation_ref import act_native
from ..op import BasicOperation
from .validation import native_dtype_ok
from .validation import check_input


def check_gated_width(op, shape) -> None:
    """Raise naming ``op`` (a gated activation) unless ``shape``, its input's shape, has an even
    last dim. The one width check of every path that runs a gated activation: the op's own
    :meth:`~Activation.check_input`, and fused ops that compute its input themselves (a linear's
    output: its shape is known before the GEMM runs)."""
    if len(shape) == 0 or shape[-1] % 2 != 0:
        raise ValueError(f"{type(op).__name__}: the input's last dim must be even, got shape {list(shape)}")


class Activation(BasicOperation):
    """Base class of the elementwise activations. ``kind`` names the kernel's activation."""

    kind: str = ""
    cpu_autograd = True  # (see FusibleOperation.cpu_autograd)
    replayable = True  # (see FusibleOperation.replayable)
    gated: bool = False
    # Before an FP8 linear, the activation's own kernels serve it: the forward pass also takes the
    # amax of y (current scaling) or writes the FP8 bytes (delayed), the backward pass the amax of
    # dx (see InputQuantizer.produce); fuser_backward only adds that, op_backward is the plain path.
    writes_fp8_output = True
    writes_fp8_grad = True

    def check_input(self, x: torch.Tensor) -> None:
        """Raise a clear error if ``x`` cannot be this activation's input."""
        check_input(self, x)
        if self.gated:
            check_gated_width(self, x.shape)

    def out_features(self, n: int) -> int:
        return n // 2 if self.gated else n

    @classmethod
    def _example(cls, n: int, **factory):
        op = cls()
        return op, op.out_features(n)

    def save_ctx(self, ctx, x: torch.Tensor, bias=None) -> None:
        if ctx.input_requires_grad:
            ctx.save_for_backward(x)
        ctx.act_bias = bias

    def op_forward(self, ctx, x, next_op_input_quantizer=None, **kwargs):
        self.check_input(x)
        kind = self.kind
        if next_op_input_quantizer is not None:  # the next op is an FP8 linear: this kernel serves its input

            def run(amax=None, **fp8):
                if amax is None:
                    return _K.bias_act_fwd(x, None, kind, dropout_p=0.0)
                return _K.bias_act_fwd_fp8(x, None, kind, amax=amax, **fp8)

            y = next_op_input_quantizer.produce(run, x)
        elif not ctx.requires_grad and native_dtype_ok(x, self.gated) and not use_triton(x):
            # Reference math with no ctx to fill (a call under PyTorch's autograd, or inference):
            # torch's ops in x's dtype, without the kernel API's checks and casts
            return act_native(x, kind)
        else:
            y = _K.bias_act_fwd(x, None, kind, dropout_p=0.0)
        self.save_ctx(ctx, x)
        return y

    def op_backward(self, ctx, dy):
        if not ctx.input_requires_grad:
            return None, ()
        (x,) = ctx.saved_tensors
        dx, _ = _K.bias_act_bwd(dy, x, ctx.act_bias, self.kind, False, dropout_p=0.0)
        return dx, ()

    def fuser_backward(self, ctxs, dy, *, grad_extra_outputs, prev_op_grad_output_quantizer=None, **kwargs):
        ctx, gq = ctxs[0], prev_op_grad_output_quantizer
        if gq is None or not ctx.input_requires_grad:
            return self.op_backward(ctx, dy)[0], [()], [()]
        # the op before is an FP8 linear: this pass also takes max|dx| for its cast
        (x,) = ctx.saved_tensors
        kind = self.kind

        def run(amax=None):
            if amax is None:
                return _K.bias_act_bwd(dy, x, ctx.act_bias, kind, False, dropout_p=0.0)[0]
            return _K.bias_act_bwd_amax(dy, x, ctx.act_bias, kind, False, amax=amax)[0]

        return gq.produce(run, x, direct=False), [()], [()]


def _gelu(x, approximate):
    return torch.nn.functional.gelu(x, approximate=approximate)


class ReLU(Activation):
    """``y = max(x, 0)`` elementwise (NaN propagates, as in ``torch.relu``)."""

    kind = "relu"

    def reference_forward(self, x):
        return torch.relu(x)


class GELU(Activation):
    """``y = x * Phi(x)`` elementwise, ``Phi`` the standard normal CDF; ``approximate="none"``
    (exact, erf) or ``"tanh"`` (``torch.nn.functional.gelu``'s tanh formula)."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU: approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate
        self.kind = "gelu" if approximate == "none" else "gelu_tanh"

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"

    def reference_forward(self, x):
        return _gelu(x, self.approximate)


class SiLU(Activation):
    """``y = x * sigmoid(x)`` elementwise (a.k.a. swish)."""

    kind = "silu"

    def reference_forward(self, x):
        return torch.nn.functional.silu(x)


class _Gated(Activation):
    gated = True

    def _act(self, a):
        raise NotImplementedError

    def reference_forward(self, x):
        a, b = x.chunk(2, dim=-1)
        return self._act(a) * b


class SwiGLU(_Gated):
    """``y = silu(a) * b`` where ``a, b = x.chunk(2, dim=-1)``: the first half is activated.

    Input ``[..., 2n]``, output ``[..., n]``."""

    kind = "swiglu"

    def _act(self, a):
        return torch.nn.functional.silu(a)


class ReGLU(_Gated):
    """``y = relu(a) * b`` where ``a, b = x.chunk(2, dim=-1)``: the first half is activated.

    Input ``[..., 2n]``, output ``[..., n]``."""

    kind = "reglu"

    def _act(self, a):
        return torch.relu(a)


class GEGLU(_Gated):
    """``y = gelu(a) * b`` where ``a, b = x.chunk(2, dim=-1)``: the first half is activated.

    Input ``[..., 2n]``, output ``[..., n]``; ``approximate="none"`` (erf) or ``"tanh"``."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GEGLU: approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate
        self.kind = "geglu" if approximate == "none" else "geglu_tanh"

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"

    def _act(self, a):
        return _gelu(a, self.approximate)


class ScaledSwiGLU(BasicOperation):
    """``y = silu(a) * b * scales[..., None]`` where ``a, b = x.chunk(2, dim=-1)`` (the first half
    is activated): input ``[..., 2n]``, output ``[..., n]``.

    Extra input ``scales``: one per row (e.g. MoE routing probabilities), shaped ``x.shape[:-1]``
    or flat ``[rows]``; its gradient comes back in the scales' own shape when they require one."""

    num_extra_inputs = 1
    extra_input_names = ("scales",)  # (Sequential accepts it by this name: seq(x, scales=...))
    kind = "scaled_swiglu"
    cpu_autograd = True  # (see FusibleOperation.cpu_autograd)
    gated = True

    @classmethod
    def _example(cls, n: int, **factory):
        return cls(), n // 2

    def check_scales(self, x: torch.Tensor, scales) -> torch.Tensor:
        """Validate ``scales`` for input ``x``: shape ``x.shape[:-1]`` or flat ``[rows]``.
        Returns them viewed as ``x.shape[:-1]`` (gradients go back in the scales' own shape)."""
        check_input(self, x)
        check_gated_width(self, x.shape)
        if not isinstance(scales, torch.Tensor) or not scales.is_floating_point():
            raise TypeError("ScaledSwiGLU: scales must be a floating-point tensor")
        if scales.device != x.device:
            raise RuntimeError(f"ScaledSwiGLU: scales are on {scales.device} but the input is on {x.device}")
        rows = math.prod(x.shape[:-1])
        if scales.shape != x.shape[:-1] and tuple(scales.shape) != (rows,):
            raise ValueError(
                f"ScaledSwiGLU: scales must have shape {list(x.shape[:-1])} (the input's leading dims) or "
                f"[{rows}] (one per row), got {list(scales.shape)}"
            )
        return scales.reshape(x.shape[:-1])

    def fuser_forward(self, ctxs, x, *, extra_inputs, **kwargs):
        ctx = ctxs[0]
        given = extra_inputs[0][0]
        scales = self.check_scales(x, given)
        y = _K.scaled_swiglu_fwd(x, scales)
        ctx.scales_shape = given.shape
        ctx.scales_grad = ctx.requires_grad and scales.requires_grad
        if ctx.input_requires_grad or ctx.scales_grad:
            ctx.save_for_backward(x, scales)
        return y, [()]

    def fuser_backward(self, ctxs, dy, *, grad_extra_outputs, **kwargs):
        ctx = ctxs[0]
        if not (ctx.input_requires_grad or ctx.scales_grad):
            return None, [()], [(None,)]
        x, scales = ctx.saved_tensors
        dx, dscales = _K.scaled_swiglu_bwd(dy, x, scales, ctx.scales_grad)
        if dscales is not None:
            dscales = dscales.reshape(ctx.scales_shape)
        return (dx if ctx.input_requires_grad else None), [()], [(dscales,)]

    def reference_forward(self, x, scales):
        a, b = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(a) * b * scales.reshape(x.shape[:-1]).unsqueeze(-1).to(x.dtype)


ACTIVATION_CLASSES = (ReLU, GELU, SiLU, SwiGLU, GEGLU, ReGLU)
