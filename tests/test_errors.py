"""Clear errors: the device-side checks (the default assert and the recoverable flag mode,
fusible_ops.errors), and errors for bad chains and inputs that name the op on every path."""

import pytest
import torch

import fusible_ops as fo
from fusible_ops.errors import device_check
from fusible_ops.fuser import cpu_autograd


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


# ---------------------------------------------------------------- bad chains and inputs (issue 63)
def _error(fn):
    with pytest.raises(Exception) as info:
        fn()
    return type(info.value), str(info.value)


@pytest.mark.parametrize("act", [fo.SwiGLU, fo.GEGLU, fo.ReGLU])
def test_odd_width_into_a_fused_gated_activation_raises_as_the_op_alone(act):
    """Linear(64, 33) -> GLU runs as ``linear_bias_activation``: on every path (under PyTorch's
    autograd, inference, the ops' own backward) it raises the activation's own error, not a
    shape mismatch from inside the kernels' math."""
    alone = _error(lambda: act()(torch.randn(8, 33)))
    assert alone == (ValueError, f"{act.__name__}: the input's last dim must be even, got shape [8, 33]")
    seq = fo.Sequential(fo.Linear(64, 33), act())
    x = torch.randn(8, 64)
    assert seq.fusion_plan("forward", x)[0]["rule"] == "linear_bias_activation"
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            assert _error(lambda: seq(x)) == alone
            with cpu_autograd(False):
                assert _error(lambda: seq(x)) == alone


@pytest.mark.parametrize("act", [fo.SwiGLU, fo.GEGLU, fo.ScaledSwiGLU])
def test_odd_width_into_a_grouped_glu_raises_naming_the_activation(act):
    """GroupedLinear(out=33) -> GLU -> GroupedLinear: the grouped-MLP rules decline (33 != 2 x 16)
    and the activation raises its own error."""
    seq = fo.Sequential(fo.GroupedLinear(2, 8, 33), act(), fo.GroupedLinear(2, 16, 8))
    splits = torch.tensor([2, 4])
    scales = (torch.rand(6),) if act is fo.ScaledSwiGLU else ()
    with pytest.raises(ValueError, match=rf"^{act.__name__}: the input's last dim must be even, got shape \[6, 33\]"):
        seq(torch.randn(6, 8), splits, *scales, splits)


def test_expert_parallel_overlap_declines_an_odd_glu_width():
    """``moe_ep_overlap`` would run the GLU on FC1's odd output in its kernels (no op named): it
    declines, so the unfused activation raises its own error."""
    from types import SimpleNamespace

    from fusible_ops.fusion_rules import moe_ep_overlap

    dispatch = SimpleNamespace(ep_size=2, ep_chunks=2, ep_exchange="chunked")
    ctx = SimpleNamespace(recipe=None)
    ops = [dispatch, fo.GroupedLinear(2, 8, 33), fo.SwiGLU(), fo.GroupedLinear(2, 16, 8), None]
    assert moe_ep_overlap._check(ops, ctx) == "SwiGLU needs an even input width, FC1 gives 33"
    ops[1] = fo.GroupedLinear(2, 8, 32)
    assert moe_ep_overlap._check(ops, ctx) is None


def test_a_module_after_a_loss_raises_naming_the_loss():
    want = r"^CrossEntropy: a loss must be the last op of a Sequential, but module \[2\] Linear follows it"
    for bias in (True, False):  # (bias=False: the linear_cross_entropy rule would match ops 0-1)
        with pytest.raises(ValueError, match=want):
            fo.Sequential(fo.Linear(64, 64, bias=bias), fo.CrossEntropy(), fo.Linear(64, 64))
    with pytest.raises(ValueError, match=r"module \[1\] Linear follows it \(it ends module \[0\] Sequential\)"):
        fo.Sequential(fo.Sequential(fo.Linear(64, 64), fo.CrossEntropy()), fo.Linear(64, 64))
    with pytest.raises(ValueError, match=r"^CrossEntropy: .* module \[2\] Identity follows it"):
        fo.Sequential(fo.Linear(64, 64), fo.CrossEntropy(), torch.nn.Identity())
    seq = fo.Sequential(fo.Linear(64, 64), fo.CrossEntropy())
    seq.append(fo.ConstantScale(2.0))  # (built by append: raises at the next call)
    with pytest.raises(ValueError, match=r"^CrossEntropy: .* module \[2\] ConstantScale follows it"):
        seq(torch.randn(8, 64), torch.randint(0, 64, (8,)))
    with pytest.raises(ValueError, match=r"^CrossEntropy: .* op \[1\] GELU follows it"):
        fo.OperationFuser([fo.CrossEntropy(), fo.GELU()])
    del seq[2]  # a loss at the end runs
    assert seq(torch.randn(8, 64), torch.randint(0, 64, (8,))).dim() == 0
    fo.Sequential(fo.Linear(64, 64), fo.Sequential(fo.Linear(64, 64), fo.CrossEntropy()))  # (ends with it)


@pytest.mark.parametrize("norm", [fo.RMSNorm, fo.LayerNorm])
def test_norms_take_the_parameters_dtype_or_16_bits_under_float32(norm):
    """docs/ops.md: a dtype other than the parameters' raises a TypeError naming the op; float32
    parameters also take bf16/fp16 input (their math runs in float32). On every path: inference,
    under PyTorch's autograd, the ops' own backward, and the residual add fused in front."""
    name = norm.__name__
    cases = [(torch.float32, torch.float64), (torch.bfloat16, torch.float32), (torch.float64, torch.float32),
             (torch.bfloat16, torch.float16)]
    for pdtype, xdtype in cases:
        seqs = (fo.Sequential(norm(8, dtype=pdtype)), fo.Sequential(fo.AddExtraInput(), norm(8, dtype=pdtype)))
        for seq in seqs:
            extra = (torch.randn(4, 8, dtype=xdtype),) if len(seq) == 2 else ()
            for grad in (True, False):
                with torch.set_grad_enabled(grad), cpu_autograd(grad):
                    with pytest.raises(TypeError, match=rf"^{name}: input dtype {xdtype} does not match parameter "
                                                        rf"dtype {pdtype}"):
                        seq(torch.randn(4, 8, dtype=xdtype), *extra)
    for xdtype in (torch.bfloat16, torch.float16, torch.float32):
        seq = fo.Sequential(fo.AddExtraInput(), norm(8))
        x = torch.randn(4, 8, dtype=xdtype, requires_grad=True)
        y = seq(x, torch.randn(4, 8, dtype=xdtype))
        y.float().sum().backward()
        assert y.dtype == x.grad.dtype == xdtype and seq[1].weight.grad.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):  # (a bf16 GEMM output into float32 parameters)
        seq = fo.Sequential(fo.Linear(8, 8), norm(8))
        assert seq(torch.randn(4, 8)).dtype == torch.bfloat16
