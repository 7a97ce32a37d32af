"""GroupedLinear: one linear per group of rows (mixture-of-experts experts)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..errors import assert_mode, device_check
from ..kernels import use_triton
from ..kernels.persistent import splits_assert, splits_ok
from ..grad import WeightGradMixin, deliver_weight_grad
from ..op import BasicOperation
from ..quantization.casting import FP8StateMixin
from ..quantization.tensor import float8, is_float8
from .fp8_grouped import fp8_grouped_backward, fp8_grouped_forward, grouped_quantizer, grouped_recipe
from .validation import check_input


def check_split_shape(op, split_sizes, num_groups: int) -> None:
    """The host-known checks of :func:`check_split_sizes`: a 1-D integer tensor of length
    ``num_groups`` (errors name ``op``)."""
    name = type(op).__name__
    if not isinstance(split_sizes, torch.Tensor):
        raise TypeError(f"{name}: split sizes must be a 1-D int64 tensor, got {type(split_sizes).__name__}")
    if split_sizes.dtype.is_floating_point or split_sizes.dtype.is_complex or split_sizes.dtype == torch.bool:
        raise TypeError(f"{name}: split sizes must be an integer tensor (int64), got {split_sizes.dtype}")
    if split_sizes.dim() != 1 or split_sizes.numel() != num_groups:
        raise ValueError(
            f"{name}: split sizes must have shape [{num_groups}] (one per group), got {list(split_sizes.shape)}"
        )


def check_split_sizes(op, split_sizes, num_groups: int, rows: int, device: torch.device) -> torch.Tensor:
    """Validate ``split_sizes`` and return it as an int64 tensor on ``device``.

    Host-known properties (a 1-D integer tensor of length ``num_groups``) are checked on the
    host. Values: a CPU tensor is checked on the host (``ValueError``); a CUDA tensor is checked
    on the device (no host sync, so the call stays CUDA-graph capturable), reported per
    :mod:`fusible_ops.errors`: by default one kernel that asserts on the device
    (:func:`~fusible_ops.kernels.persistent.splits_assert`), failing loudly at the next
    synchronization, or with ``set_device_checks("flag")`` a recoverable flag that
    ``fusible_ops.check_errors()`` turns into a ``ValueError``. Under ``torch.compile`` both
    host and device tensors use the tensor assert (no data-dependent Python branch to trace).
    """
    name = type(op).__name__
    check_split_shape(op, split_sizes, num_groups)
    if split_sizes.device.type == "cpu" and not torch.compiler.is_compiling():
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{name}: split sizes are a CPU tensor while a CUDA graph is being captured; the op would "
                f"read them on the host and copy them to the GPU, which capture forbids. Pass them as a "
                f"CUDA int64 tensor (they are then read on the device and may change between replays)"
            )
        values = split_sizes.tolist()
        if any(v < 0 for v in values):
            raise ValueError(f"{name}: split sizes must be non-negative, got {values}")
        if sum(values) != rows:
            raise ValueError(f"{name}: split sizes sum to {sum(values)} but the input has {rows} rows")
    else:  # CUDA, or traced by torch.compile: checked on the device, no host sync
        if split_sizes.dtype != torch.int64 or split_sizes.device != device:  # (.to costs host time)
            split_sizes = split_sizes.to(device=device, dtype=torch.int64)
        if not torch.compiler.is_compiling() and use_triton(split_sizes):
            if assert_mode():  # one launch that checks and asserts (no bool, no _assert_async)
                splits_assert(split_sizes, rows)
                return split_sizes
            ok = splits_ok(split_sizes, rows)  # one launch
        else:
            ok = (split_sizes >= 0).all() & (split_sizes.sum() == rows)
        device_check(op, ok, split_sizes, f"split sizes must be non-negative and sum to the input's {rows} rows")
        return split_sizes
    return split_sizes.to(device=device, dtype=torch.int64)


class GroupedLinear(FP8StateMixin, WeightGradMixin, BasicOperation):
    """Rows of ``x`` [..., in_features] are split in order into ``num_groups`` groups by the
    extra input ``split_sizes`` (1-D int64, length ``num_groups``, any device; empty groups are
    valid); group g computes ``x_g @ weight[g].T (+ bias[g])``.

    Parameters: ``weight`` [G, out, in] (one tensor) and ``bias`` [G, out]. On CUDA the
    forward, input gradient and weight gradient are one Triton grouped-GEMM launch each, with
    group offsets computed on the device (no host sync: CUDA-graph capturable with CUDA split
    sizes). A ``main_grad`` must be one buffer viewable as [G, out, in] without a copy.

    Inside :func:`fusible_ops.autocast` the three grouped GEMMs run in FP8 under every recipe (see
    :mod:`fusible_ops.ops.fp8_grouped`): one scale per tensor under current or delayed scaling;
    1x128 tiles of x and dy and 128x128 blocks of each expert's weight under block scaling, which
    needs ``in_features`` and ``out_features`` divisible by 128.
    """

    num_extra_inputs = 1
    extra_input_names = ("split_sizes",)  # (Sequential accepts it by this name: seq(x, split_sizes=...))
    # (see FusibleOperation.replayable: delayed FP8 scaling and flagged weights are never replayed; a replay
    # returns the weight gradient to autograd, where delayed_wgrad()'s hooks deliver it)
    replayable = True
    # Under a per-tensor FP8 recipe the op before (an activation, a norm) writes this op's input in
    # FP8 with the amax from its own pass, and the op after writes its output gradient so
    # (input_quantizer / grad_output_quantizer); the grouped GEMMs read those as they are.
    accepts_fp8 = True

    def __init__(
        self,
        num_groups: int,
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
        if num_groups <= 0 or in_features <= 0 or out_features <= 0:
            raise ValueError(f"GroupedLinear: sizes must be positive, got ({num_groups}, {in_features}, {out_features})")
        self.num_groups = int(num_groups)
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.weight = torch.nn.Parameter(torch.empty(num_groups, out_features, in_features, device=device, dtype=dtype))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(num_groups, out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self._init_wgrad(accumulate_into_main_grad, delay_wgrad_compute)
        self.reset_parameters()

    @property
    def main_grad_shape(self) -> tuple[int, int, int]:
        return (self.num_groups, self.out_features, self.in_features)

    def reset_parameters(self) -> None:
        # torch.nn.Linear's init, per group
        bound = 1 / math.sqrt(self.in_features)
        with torch.no_grad():
            for g in range(self.num_groups):
                torch.nn.init.kaiming_uniform_(self.weight[g], a=math.sqrt(5))
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)

    def extra_repr(self) -> str:
        return (
            f"num_groups={self.num_groups}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.bias is not None}"
        )

    @classmethod
    def _example(cls, n: int, **factory):
        return cls(3, n, 2 * n, **factory), 2 * n

    def input_quantizer(self):
        """Under a per-tensor FP8 recipe, the :class:`~fusible_ops.quantization.InputQuantizer` a
        producer uses to write this op's input in FP8 itself (None otherwise: see
        :func:`~fusible_ops.ops.fp8_grouped.grouped_quantizer`)."""
        return grouped_quantizer(self, "input")

    def grad_output_quantizer(self):
        """Under a per-tensor FP8 recipe and without a bias, the
        :class:`~fusible_ops.quantization.GradOutputQuantizer` the backward of the op after this
        one uses to write this op's output gradient in FP8 (None otherwise)."""
        return grouped_quantizer(self, "grad_output")

    # shared with fused ops ---------------------------------------------------------------
    def prepare(self, x: torch.Tensor, split_sizes) -> tuple[torch.Tensor, torch.Tensor]:
        """Validate inputs; return (x as [rows, in], split sizes as int64 on x's device)."""
        check_input(self, x, features=self.in_features, like=self.weight)
        x2d = x if x.dim() == 2 else _rows(x, self.in_features)
        splits = check_split_sizes(self, split_sizes, self.num_groups, x2d.shape[0], x.device)
        return x2d, splits

    def forward_2d(self, x2d: torch.Tensor, splits: torch.Tensor) -> torch.Tensor:
        from ..kernels.grouped_gemm import grouped_gemm_fwd

        return grouped_gemm_fwd(x2d, self.weight, splits, self.bias)

    def save_ctx(self, ctx, x2d: Optional[torch.Tensor], splits: torch.Tensor, input_shape) -> None:
        """What backward reads: x2d only for the weight gradient (``ctx.weight_grad``), the weight
        only for dgrad, the split sizes; ``ctx.bias_grad``."""
        ctx.weight_grad = ctx.weight_requires_grad and self.weight.requires_grad
        ctx.save_for_backward(x2d if ctx.weight_grad else None, self.weight if ctx.input_requires_grad else None,
                              splits)
        ctx.input_shape = input_shape
        ctx.bias_grad = ctx.requires_grad and self.bias is not None and self.bias.requires_grad

    def backward_2d(self, ctx, dy2d: torch.Tensor) -> tuple:
        """(dx2d or None, (dweight, dbias)) from the saved ctx."""
        from ..kernels.grouped_gemm import grouped_bias_grad, grouped_gemm_dgrad, grouped_gemm_wgrad

        x2d, w, splits = ctx.saved_tensors
        dx = grouped_gemm_dgrad(dy2d, w, splits) if ctx.input_requires_grad else None
        dw = None
        if ctx.weight_grad:
            dw = deliver_weight_grad(
                self,
                self.weight,
                lambda out, acc: grouped_gemm_wgrad(dy2d, x2d, splits, out=out, accumulate=acc),
            )
        db = grouped_bias_grad(dy2d, splits) if ctx.bias_grad else None
        return dx, ((dw, db) if self.bias is not None else (dw,))

    # fuser interface ------------------------------------------------------------------------
    def fuser_forward(self, ctxs, x, *, extra_inputs, **kwargs):
        (split_sizes,) = extra_inputs[0]
        x2d, splits = self.prepare(x, split_sizes)
        ctx = ctxs[0]
        recipe = grouped_recipe()
        if recipe is not None:
            y = fp8_grouped_forward(self, ctx, x2d, splits, recipe)
            ctx.input_shape = x.shape
        else:
            if is_float8(x2d):  # (from a Quantize op outside autocast)
                x2d = x2d.dequantize()
            y = self.forward_2d(x2d, splits)
            ctx.fp8 = None
            if ctx.requires_grad:
                self.save_ctx(ctx, x2d, splits, x.shape)
        return y.reshape(*x.shape[:-1], self.out_features), [()]

    def fuser_backward(self, ctxs, dy, *, grad_extra_outputs, **kwargs):
        ctx = ctxs[0]
        dy2d = _rows(dy, self.out_features)
        if getattr(ctx, "fp8", None) is not None:
            dx, pgrads = fp8_grouped_backward(self, ctx, dy2d)
        else:
            dx, pgrads = self.backward_2d(ctx, dy2d.dequantize() if is_float8(dy2d) else dy2d)
        if dx is not None:
            dx = dx.reshape(ctx.input_shape)
        return dx, [pgrads], [(None,)]

    def reference_forward(self, x, split_sizes):
        x2d = x.reshape(-1, self.in_features)
        outs = []
        for g, xg in enumerate(torch.split(x2d, [int(s) for s in split_sizes.tolist()])):
            yg = xg @ self.weight[g].t()
            outs.append(yg + self.bias[g] if self.bias is not None else yg)
        return torch.cat(outs).reshape(*x.shape[:-1], self.out_features)


def _rows(t: torch.Tensor, k: int) -> torch.Tensor:
    """``t`` as [rows, k]; a per-tensor Float8Tensor stays one (its bytes viewed as rows: a
    reshape through torch would dequantize it)."""
    if t.dim() == 2:
        return t
    if is_float8(t) and t.scaling == "tensor":
        data, inv = t.rowwise
        colwise = t.colwise or (None, None)
        return float8(data.reshape(-1, k), inv, t.dtype, (t.numel() // k, k), scaling="tensor",
                            data_t=colwise[0], scale_inv_t=colwise[1], recipe=t._recipe)
    return t.reshape(-1, k)
