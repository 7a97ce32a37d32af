"""``Float8Tensor``: FP8 data plus scales, standing in for a high-precision tensor.

It holds a row-wise form (``data`` [M, K] with ``scale_inv``: K is the reduction dim of the GEMM
that reads it) and, when a GEMM reads the tensor transposed, a column-wise form (``data_t``
[K, M] with ``scale_inv_t``); see :mod:`fusible_ops.kernels.fp8_cast` for the scale layouts.
``scaling`` is ``"tensor"``, ``"1x128"`` or ``"128x128"``.

To any torch op it is the high-precision tensor it stands for: ``__torch_dispatch__``
dequantizes it (``data * scale_inv`` in fp32, cast to ``dtype``) and runs the op on that, so the
result is a plain tensor. The ops of this library read its FP8 data directly instead.

While ``torch.compile`` traces, the same FP8 operands travel as a :class:`TracedFloat8`, a plain
Python object with the same reading API (dynamo cannot trace the construction of a wrapper
subclass): :func:`float8` builds whichever fits, :func:`is_float8` tests for either.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils._pytree import tree_map

from ..kernels.fp8_cast import BLOCK


def dequantize_2d(data: torch.Tensor, scale_inv: torch.Tensor, scaling: str) -> torch.Tensor:
    """fp32 values of an [R, C] FP8 operand in the row-wise layout of ``scaling``."""
    x = data.float()
    if scaling == "tensor":
        return x * scale_inv
    r, c = x.shape
    s = scale_inv.repeat_interleave(BLOCK, dim=1)[:, :c]
    if scaling == "128x128":
        s = s.repeat_interleave(BLOCK, dim=0)[:r]
    return x * s


class _Float8Reads:
    """What the ops read from an FP8 operand, shared by :class:`Float8Tensor` and
    :class:`TracedFloat8` (attributes ``_data``, ``_scale_inv``, ``_data_t``, ``_scale_inv_t``,
    ``_scaling``, ``_recipe``, and the ``dtype`` / ``shape`` it stands for)."""

    @property
    def rowwise(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(data [M, K], scale_inv)``."""
        return self._data, self._scale_inv

    @property
    def colwise(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """``(data_t [K, M], scale_inv_t)``, or None when not made."""
        return None if self._data_t is None else (self._data_t, self._scale_inv_t)

    @property
    def scaling(self) -> str:
        return self._scaling

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self._data.dtype

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The high-precision tensor (``dtype`` default: the one this tensor stands for)."""
        out = dequantize_2d(self._data, self._scale_inv, self._scaling)
        return out.to(dtype or self.dtype).reshape(self.shape)

    def _set_parts(self, data, scale_inv, scaling: str, data_t, scale_inv_t, recipe) -> None:
        self._data = data
        self._scale_inv = scale_inv
        self._data_t = data_t
        self._scale_inv_t = scale_inv_t
        self._scaling = scaling
        self._recipe = recipe

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(shape={list(self.shape)}, dtype={self.dtype}, fp8={self._data.dtype}, "
                f"scaling={self._scaling!r}, colwise={self._data_t is not None})")


class Float8Tensor(_Float8Reads, torch.Tensor):
    """FP8 data with its scales (see the module docstring). Build with
    :func:`fusible_ops.quantization.quantize`; read it back with :meth:`dequantize`."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, shape, *, scaling: str,
                data_t: Optional[torch.Tensor] = None, scale_inv_t: Optional[torch.Tensor] = None, recipe=None,
                requires_grad: bool = False):
        self = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=data.device,
                                                   requires_grad=requires_grad)
        self._set_parts(data, scale_inv, scaling, data_t, scale_inv_t, recipe)
        return self

    def __deepcopy__(self, memo) -> "Float8Tensor":
        """A copy with its own bytes and scales (``copy.deepcopy`` of a module holding a cached
        FP8 weight)."""
        def c(t):
            return None if t is None else t.clone()

        inv = self._scale_inv.clone()
        inv_t = inv if self._scale_inv_t is self._scale_inv else c(self._scale_inv_t)
        new = Float8Tensor(self._data.clone(), inv, self.dtype, self.shape, scaling=self._scaling, data_t=c(self._data_t),
                           scale_inv_t=inv_t, recipe=self._recipe)
        memo[id(self)] = new
        return new

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def plain(t):
            return t.dequantize() if isinstance(t, Float8Tensor) else t

        return func(*tree_map(plain, args), **tree_map(plain, kwargs or {}))


class TracedFloat8(_Float8Reads):
    """What stands for a :class:`Float8Tensor` while ``torch.compile`` traces: the same FP8
    operands and reading API in a plain object, which dynamo traces like any Python object (it
    cannot trace ``_make_wrapper_subclass``). Unlike a Float8Tensor it is no ``torch.Tensor``: it
    lives inside one traced call of a fuser (whose output is dequantized), and only the ops that
    read FP8 operands (``accepts_fp8``) get it. Metadata: ``dtype``, ``shape``, ``device``,
    ``is_cuda``, ``is_cpu``, ``dim()``, ``numel()``, ``get_device()``, ``size()``."""

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, shape, *, scaling: str,
                 data_t: Optional[torch.Tensor] = None, scale_inv_t: Optional[torch.Tensor] = None,
                 recipe=None) -> None:
        self._set_parts(data, scale_inv, scaling, data_t, scale_inv_t, recipe)
        self.dtype = dtype
        self.shape = torch.Size(shape)
        self.requires_grad = False

    @property
    def device(self) -> torch.device:
        return self._data.device

    @property
    def is_cuda(self) -> bool:
        return self._data.is_cuda

    @property
    def is_cpu(self) -> bool:
        return self._data.is_cpu

    def get_device(self) -> int:
        return self._data.get_device()

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self.shape.numel()

    def size(self, dim: Optional[int] = None):
        return self.shape if dim is None else self.shape[dim]


FLOAT8_TYPES = (Float8Tensor, TracedFloat8)


def is_float8(t) -> bool:
    """Whether ``t`` is an FP8 operand: a :class:`Float8Tensor`, or its traced stand-in."""
    return type(t) in FLOAT8_TYPES


def float8(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, shape, *, scaling: str,
           data_t: Optional[torch.Tensor] = None, scale_inv_t: Optional[torch.Tensor] = None, recipe=None):
    """A :class:`Float8Tensor` of these parts; while ``torch.compile`` traces, a :class:`TracedFloat8`."""
    cls = TracedFloat8 if torch.compiler.is_compiling() else Float8Tensor
    return cls(data, scale_inv, dtype, shape, scaling=scaling, data_t=data_t, scale_inv_t=scale_inv_t, recipe=recipe)


__all__ = ["FLOAT8_TYPES", "Float8Tensor", "TracedFloat8", "dequantize_2d", "float8", "is_float8"]
