"""The partials sum (fusible_ops.kernels.partials): ``part.sum(0)`` of fp32 partials, rounded once to
the output dtype, against a float64 sum. Unmarked tests run on Triton's interpreter without CUDA
(tests/conftest.py sets TRITON_INTERPRET=1) and compiled on a GPU machine."""

import pytest
import torch

from fusible_ops.kernels.partials import sum_partials, sum_partials_ref
from fusible_ops.testing import assert_close

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("p,n", [(1, 1), (2, 5), (7, 33), (9, 256), (17, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sum_partials_matches_float64(p, n, dtype):
    part = torch.randn(p, n, generator=torch.Generator().manual_seed(p * 1000 + n)).to(DEV)
    truth = part.double().sum(0)
    out = sum_partials(part, dtype)
    assert out.dtype == dtype and out.shape == (n,)
    # one rounding to dtype of an fp32 sum: the dtype's elementwise tolerance
    assert_close(out, truth, dtype)
    assert_close(sum_partials_ref(part, dtype), truth, dtype)


def test_sum_partials_non_contiguous_and_empty():
    base = torch.randn(12, 10, generator=torch.Generator().manual_seed(3)).to(DEV)
    part = base[:, ::2]  # a strided view: summed as a contiguous copy
    assert_close(sum_partials(part, torch.float32), part.double().sum(0))
    assert sum_partials(torch.empty(4, 0, device=DEV), torch.bfloat16).shape == (0,)


def test_sum_partials_is_deterministic():
    part = torch.randn(300, 129, generator=torch.Generator().manual_seed(5)).to(DEV)
    assert torch.equal(sum_partials(part, torch.float32), sum_partials(part, torch.float32))
