"""Device-side checks: the default assert and the recoverable flag mode (fusible_ops.errors)."""

import pytest
import torch

import fusible_ops as fo
from fusible_ops.errors import device_check


def test_flag_mode_reports_the_op_and_the_bad_values_then_clears():
    op = fo.GroupedLinear(3, 4, 2)
    with fo.device_checks("flag"):
        splits = torch.tensor([2, -1, 4])
        device_check(op, (splits >= 0).all(), splits, "split sizes must be non-negative")
        device_check(op, torch.tensor(True), torch.tensor([1, 1, 1]), "split sizes must be non-negative")
    with pytest.raises(ValueError, match=r"GroupedLinear\(num_groups=3.*non-negative; got \[2, -1, 4\]"):
        fo.check_errors()
    fo.check_errors()  # cleared: nothing to report


def test_flag_mode_passes_good_values_and_assert_mode_is_default():
    op = fo.GroupedLinear(2, 4, 2)
    with fo.device_checks("flag"):
        device_check(op, torch.tensor(True), torch.tensor([1, 2]), "must hold")
    fo.check_errors()
    assert fo.set_device_checks("assert") == "assert"
    with pytest.raises(RuntimeError):
        device_check(op, torch.tensor(False), torch.tensor([1, 2]), "must hold")  # CPU assert raises at once
    with pytest.raises(ValueError, match="mode must be one of"):
        fo.set_device_checks("warn")


@pytest.mark.gpu
def test_bad_cuda_splits_in_flag_mode_leave_the_context_usable():
    gl = fo.GroupedLinear(3, 64, 32, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(10, 64, device="cuda", dtype=torch.bfloat16)
    with fo.device_checks("flag"):
        gl(x, torch.tensor([4, 9, 4], device="cuda"))  # sums to 17 rows, not 10
        torch.cuda.synchronize()
        with pytest.raises(ValueError, match=r"GroupedLinear.*sum to the input's 10 rows; got \[4, 9, 4\]"):
            fo.check_errors()
        y = gl(x, torch.tensor([4, 2, 4], device="cuda"))
        torch.testing.assert_close(y.float(), gl.reference_forward(x, torch.tensor([4, 2, 4])).float(),
                                   rtol=2e-2, atol=2e-2)
        fo.check_errors()
