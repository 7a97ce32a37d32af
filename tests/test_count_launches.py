"""fusible_ops.testing.launches: what count_launches and count_python_calls count."""

import torch

from fusible_ops import kernels
from fusible_ops.kernels import fp8_cast as C
from fusible_ops.kernels.fp8_gemm import fp8_gemm
from fusible_ops.testing.launches import count_launches, count_python_calls


def test_count_launches_counts_aten_ops_triton_launches_and_emulated_gemms():
    x = torch.randn(64, 128)
    with count_launches(where=True) as n:
        y = x.t()  # a view: no launch
        z = torch.empty(3)  # an allocation: no launch
        x.abs().sum()  # two ATen launches
        with kernels.use("triton"):
            q, s, _, _ = C.cast_block(x, square=False)  # one Triton launch (its interpreter's copies not counted)
        fp8_gemm((q, s), (q, s), "1x128", "1x128", torch.float32)  # on CUDA one _scaled_mm
    assert dict(n.aten) == {"abs.default": 1, "sum.default": 1}
    assert dict(n.triton) == {"_cast_block_kernel": 1}
    assert dict(n.emulated) == {"fp8_gemm (emulated _scaled_mm)": 1}
    assert n.launches == 4 and n.views >= 1 and n.allocations >= 1
    assert n.sites[("_cast_block_kernel", "kernels/fp8_cast.py:_cast_block_launch")] == 1
    assert "4 launches" in n.summary() and y.shape == (128, 64) and z.numel() == 3


def test_count_python_calls_leaves_out_launches_and_restores_the_profiler():
    import sys

    x = torch.randn(64, 128)
    before = sys.getprofile()
    with kernels.use("triton"):
        C.cast_block(x, square=True)
        with count_python_calls(where=True) as n:
            C.cast_block(x, square=True)
    assert n.triton["_cast_block_kernel"] == 1
    assert 0 < n.python_calls < 40  # (the interpreter's own calls, thousands, are not counted)
    assert n.python_sites["fp8_cast.py:cast_block"] == 1
    assert sys.getprofile() is before
