"""``Float8Tensor``: FP8 data plus scales, standing in for a high-precision tensor.

It holds a row-wise form (``data`` [M, K] with ``scale_inv``: K is the reduction dim of the GEMM
that reads it) and, when a GEMM reads the tensor transposed, a column-wise form (``data_t``
[K, M] with ``scale_inv_t``); see :mod:`fusible_ops.kernels.fp8_cast` for the scale layouts.
``scaling`` is ``"tensor"``, ``"1x128"`` or ``"128x128"``.

To any torch op it is the high-precision tensor it stands for: ``__torch_dispatch__``
dequantizes it (``data * scale_inv`` in fp32, cast to ``dtype``) and runs the op on that, so the
result is a plain tensor. The ops of this library read its FP8 data directly instead.
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


class Float8Tensor(torch.Tensor):
    """FP8 data with its scales (see the module docstring). Build with
    :func:`fusible_ops.quantization.quantize`; read it back with :meth:`dequantize`."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, shape, *, scaling: str,
                data_t: Optional[torch.Tensor] = None, scale_inv_t: Optional[torch.Tensor] = None, recipe=None,
                requires_grad: bool = False):
        self = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=data.device,
                                                   requires_grad=requires_grad)
        self._data = data
        self._scale_inv = scale_inv
        self._data_t = data_t
        self._scale_inv_t = scale_inv_t
        self._scaling = scaling
        self._recipe = recipe
        return self

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

    def __repr__(self) -> str:
        return (f"Float8Tensor(shape={list(self.shape)}, dtype={self.dtype}, fp8={self._data.dtype}, "
                f"scaling={self._scaling!r}, colwise={self._data_t is not None})")

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def plain(t):
            return t.dequantize() if isinstance(t, Float8Tensor) else t

        return func(*tree_map(plain, args), **tree_map(plain, kwargs or {}))


__all__ = ["Float8Tensor", "dequantize_2d"]
