"""BasicLinear, Bias, and Linear (BasicLinear + Bias with torch.nn.Linear's init and names)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..grad import WeightGradMixin, deliver_weight_grad
from ..kernels.gemm import linear_dgrad, linear_fprop, linear_wgrad
from ..op import BasicOperation, FusibleOperation
from ..quantization.casting import FP8StateMixin, GradOutputQuantizer, InputQuantizer
from ..quantization.recipes import current_recipe
from ..quantization.tensor import is_float8
from .fp8_linear import fp8_backward, fp8_forward
from .validation import check_input


class BasicLinear(FP8StateMixin, WeightGradMixin, BasicOperation):
    """``y = x @ weight.T`` with ``weight`` [out_features, in_features]. No bias (see :class:`Bias`).

    Gradient contract flags (see :mod:`fusible_ops.grad` and the README table):
    ``accumulate_into_main_grad``, ``delay_wgrad_compute``. A frozen weight
    (``requires_grad=False``) costs no weight-gradient GEMM and its input is not saved.

    Inside :func:`fusible_ops.autocast` with a recipe, forward and backward GEMMs run in FP8
    (see :mod:`fusible_ops.ops.fp8_linear`); the output keeps the input's dtype.
    """

    accepts_fp8 = True  # reads a Float8Tensor input / output gradient directly
    cpu_autograd = True  # (see FusibleOperation.cpu_autograd)
    # (see FusibleOperation.replayable: cuBLAS GEMMs, ATen ops the replay runs through the
    # dispatcher. FP8 plans and flagged weights are never replayed; a replay returns the weight
    # gradient to autograd, where delayed_wgrad()'s hooks deliver it)
    replayable = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        device=None,
        dtype=None,
        accumulate_into_main_grad: bool = False,
        delay_wgrad_compute: bool = False,
    ) -> None:
        super().__init__()
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"BasicLinear: sizes must be positive, got ({in_features}, {out_features})")
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self._init_wgrad(accumulate_into_main_grad, delay_wgrad_compute)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # torch.nn.Linear's init
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"

    @classmethod
    def _example(cls, n: int, **factory):
        return cls(n, n + 3, **factory), n + 3

    # pieces protocol (see BasicOperation) ----------------------------------------------
    def check_input(self, x: torch.Tensor) -> None:
        """Raise a clear error if ``x`` cannot be this linear's input."""
        check_input(self, x, features=self.in_features, like=self.weight)

    def save_ctx(self, ctx, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> None:
        """What backward needs: x only for the weight gradient, the weight only for dgrad.
        Sets ``ctx.weight_grad``."""
        w = self.weight if weight is None else weight
        ctx.weight_grad = wg = ctx.weight_requires_grad and w.requires_grad
        ctx.save_for_backward(x if wg else None, w if ctx.input_requires_grad else None)
        ctx.input_shape = x.shape

    def fprop(self, ctx, x: torch.Tensor, bias=None) -> torch.Tensor:
        """Checked ``x @ weight.T (+ bias)`` with the ctx filled for this op's backward (FP8
        under an active recipe, the bias then added after the GEMM). The piece fused ops call."""
        w = getattr(ctx, "gated_weight", None)  # (a CPU call under PyTorch's autograd: see ContractGate)
        if w is None:
            w = self.weight
        check_input(self, x, features=self.in_features, like=w)
        recipe = current_recipe()
        if recipe is not None:
            y = fp8_forward(self, ctx, x, recipe)
            return y + bias if bias is not None else y
        ctx.fp8 = None
        if is_float8(x):
            x = x.dequantize()
        y = linear_fprop(x, w, bias)
        if ctx.requires_grad:
            self.save_ctx(ctx, x, w)
        return y

    def input_quantizer(self):
        """Under an active recipe, the :class:`~fusible_ops.quantization.InputQuantizer` a producer
        uses to write this op's input in FP8 itself (None otherwise)."""
        recipe = current_recipe()
        return None if recipe is None else InputQuantizer(recipe, self)

    def grad_output_quantizer(self):
        """Under an active recipe, the :class:`~fusible_ops.quantization.GradOutputQuantizer` the
        backward of the op after this one uses to write this op's output gradient in FP8."""
        recipe = current_recipe()
        return None if recipe is None else GradOutputQuantizer(recipe, self)

    def op_forward(self, ctx, x, **kwargs):
        return self.fprop(ctx, x)

    def op_backward(self, ctx, dy):
        if getattr(ctx, "fp8", None) is not None:
            return fp8_backward(self, ctx, dy)
        x, w = ctx.saved_tensors
        dy2d = dy if dy.dim() == 2 else dy.reshape(-1, self.out_features)  # (a reshape costs host time)
        dx = None
        if ctx.input_requires_grad:
            dx = linear_dgrad(dy2d, w)
            if len(ctx.input_shape) != 2:
                dx = dx.reshape(ctx.input_shape)
        dw = None
        if ctx.weight_grad:
            x2d = x if x.dim() == 2 else x.reshape(-1, self.in_features)
            dw = deliver_weight_grad(self, self.weight, lambda out, acc: linear_wgrad(dy2d, x2d, out, acc))
        return dx, (dw,)

    def reference_forward(self, x):
        return torch.nn.functional.linear(x, self.weight)


class Bias(BasicOperation):
    """``y = x + bias`` over the last dim; ``bias`` [size]. Its gradient always goes through
    autograd; a frozen bias costs no reduction."""

    cpu_autograd = True  # (see FusibleOperation.cpu_autograd)
    replayable = True  # (see FusibleOperation.replayable: an add and a column sum, both ATen ops)

    def __init__(self, size: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.size = int(size)
        self.bias = torch.nn.Parameter(torch.zeros(size, device=device, dtype=dtype))

    def extra_repr(self) -> str:
        return f"size={self.size}"

    @classmethod
    def _example(cls, n: int, **factory):
        op = cls(n, **factory)
        with torch.no_grad():
            op.bias.uniform_(-1, 1)
        return op, n

    def check_input(self, x: torch.Tensor, shape=None) -> None:
        """Raise a clear error if ``x`` (or a tensor of ``shape`` with x's dtype and device, not
        computed yet) cannot be this bias's input."""
        check_input(self, x, features=self.size, like=self.bias, shape=shape)

    def save_ctx(self, ctx) -> None:
        """Sets ``ctx.bias_grad`` (the bias's backward saves no tensor): the fuser's
        ``ctx.weight_requires_grad``, which for this one-parameter op says that autograd runs
        backward and the bias requires grad."""
        ctx.bias_grad = ctx.weight_requires_grad

    def op_forward(self, ctx, x, **kwargs):
        b = self.bias  # (one attribute read: it goes through the owner when the bias is lent)
        check_input(self, x, features=self.size, like=b)
        self.save_ctx(ctx)
        return x + b

    def op_backward(self, ctx, dy):
        db = None
        if ctx.bias_grad:
            db = dy.sum(0) if dy.dim() == 2 else dy.reshape(-1, self.size).sum(0)
        return (dy if ctx.input_requires_grad else None), (db,)

    def reference_forward(self, x):
        return x + self.bias


class Linear(FP8StateMixin, FusibleOperation):
    """``torch.nn.Linear`` as fusible ops: ``y = x @ weight.T + bias``, run as
    :class:`BasicLinear` followed by :class:`Bias` (so it fuses with its neighbours).

    ``weight`` [out_features, in_features] and ``bias`` [out_features] are this module's own
    parameters, with ``torch.nn.Linear``'s init and names, so checkpoints are interchangeable.
    Its basic ops hold no copy: they read ``self.weight`` / ``self.bias`` of this module at every
    call, so whatever torch does to these attributes is honoured (``torch.func.functional_call``,
    parametrizations such as ``weight_norm``, reassignment, ``.to()``). Takes the
    gradient-contract flags of :class:`BasicLinear` (readable and settable here).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        device=None,
        dtype=None,
        accumulate_into_main_grad: bool = False,
        delay_wgrad_compute: bool = False,
    ) -> None:
        super().__init__()
        linear = BasicLinear(
            in_features,
            out_features,
            device=device,
            dtype=dtype,
            accumulate_into_main_grad=accumulate_into_main_grad,
            delay_wgrad_compute=delay_wgrad_compute,
        )
        ops = [linear]
        self.in_features = in_features
        self.out_features = out_features
        self.weight = linear.weight
        linear.lend_parameters(self, ("weight",))
        if bias:
            b = Bias(out_features, device=device, dtype=dtype)
            bound = 1 / math.sqrt(in_features)
            with torch.no_grad():
                b.bias.uniform_(-bound, bound)  # torch.nn.Linear's bias init
            self.bias = b.bias
            b.lend_parameters(self, ("bias",))
            ops.append(b)
        else:
            self.register_parameter("bias", None)
        self.__dict__["_basic_ops"] = tuple(ops)

    @property
    def is_fused_op(self) -> bool:
        return False

    @property
    def basic_ops(self) -> tuple[BasicOperation, ...]:
        return self.__dict__["_basic_ops"]

    @classmethod
    def _example(cls, n: int, **factory):
        return cls(n, n + 2, **factory), n + 2

    def reset_parameters(self) -> None:
        """``torch.nn.Linear``'s init."""
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            with torch.no_grad():
                self.bias.uniform_(-bound, bound)

    # weight-gradient contract: delegated to the BasicLinear
    def backward_dw(self) -> None:
        self.basic_ops[0].backward_dw()

    def register_wgrad_hook(self, fn):
        return self.basic_ops[0].register_wgrad_hook(fn)

    @property
    def accumulate_into_main_grad(self) -> bool:
        return self.basic_ops[0].accumulate_into_main_grad

    @accumulate_into_main_grad.setter
    def accumulate_into_main_grad(self, value: bool) -> None:
        self.basic_ops[0].accumulate_into_main_grad = bool(value)

    @property
    def delay_wgrad_compute(self) -> bool:
        return self.basic_ops[0].delay_wgrad_compute

    @delay_wgrad_compute.setter
    def delay_wgrad_compute(self, value: bool) -> None:
        self.basic_ops[0].delay_wgrad_compute = bool(value)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
