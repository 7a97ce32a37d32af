"""Whole ops and fusions on CUDA (Triton kernels) against the float64 unfused reference."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import fusible_ops as fo
from fusible_ops.testing import assert_matches_reference
from fusible_ops.testing.strategies import chains

pytestmark = pytest.mark.gpu


@settings(max_examples=8)
@given(chain=chains(features=st.integers(1, 48)), dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       rows=st.sampled_from([1, 3, 37, 130]))
def test_random_chains_on_cuda(chain, dtype, rows):
    seq = chain.build(dtype=dtype, device="cuda")
    assert_matches_reference(seq, *chain.inputs((rows,), dtype=dtype, device="cuda"))


SMOOTH = [fo.GELU, fo.SiLU, fo.SwiGLU, fo.GEGLU]
KINKED = [fo.ReLU, fo.ReGLU]  # relu' jumps at 0: a pre-activation that rounds across 0 in bf16
# flips the gradient, so against a float64 reference these are compared in float32 only.
CASES = [(a, d) for a in SMOOTH for d in (torch.bfloat16, torch.float16, torch.float32)]
CASES += [(a, torch.float32) for a in KINKED]


@pytest.mark.parametrize("act,dtype", CASES)
def test_linear_bias_activation_dropout_fused_on_cuda(dtype, act):
    torch.manual_seed(0)
    gated = act in (fo.SwiGLU, fo.GEGLU, fo.ReGLU)
    seq = fo.Sequential(fo.Linear(72, 130, device="cuda", dtype=dtype), act(), fo.Dropout(0.2),
                        fo.Linear(65 if gated else 130, 33, device="cuda", dtype=dtype))
    rules = [r["rule"] for r in seq.fusion_plan()]
    assert rules[0] == "linear_bias_activation_dropout"
    assert "bias_activation_dropout_backward" in [r["rule"] for r in seq.fusion_plan("backward")]
    assert_matches_reference(seq, torch.randn(257, 72, device="cuda", dtype=dtype, requires_grad=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("norm", [fo.LayerNorm, fo.RMSNorm])
def test_residual_norm_fused_on_cuda(dtype, norm):
    seq = fo.Sequential(fo.AddExtraInput(), fo.MakeExtraOutput(), norm(1031, device="cuda", dtype=torch.float32))
    probe = torch.empty(0, 1031, device="cuda", dtype=dtype, requires_grad=True)
    assert [r["rule"] for r in seq.fusion_plan("forward", probe, probe)] == ["residual_extra_norm"]
    x = torch.randn(3, 129, 1031, device="cuda", dtype=dtype, requires_grad=True)
    r = torch.randn(3, 129, 1031, device="cuda", dtype=dtype, requires_grad=True)
    assert_matches_reference(seq, x, r)


def test_dropout_mask_same_on_cpu_and_cuda():
    """Dropout draws its seed tensor on the input's device (that device's generator); the same
    seed VALUE gives the same mask on CPU and CUDA."""
    from fusible_ops.kernels.dropout import dropout_fwd

    x = torch.randn(37, 129)
    seed = torch.tensor([12345])
    y_cpu = dropout_fwd(x, 0.3, seed)
    torch.testing.assert_close(dropout_fwd(x.cuda(), 0.3, seed.cuda()).cpu(), y_cpu)
    d = fo.Dropout(0.3)
    torch.manual_seed(5)
    y_gpu = d(x.cuda())
    torch.manual_seed(5)
    drawn = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device="cuda")  # what the op draws
    torch.testing.assert_close(y_gpu.cpu(), dropout_fwd(x, 0.3, drawn.cpu()))


def test_kernels_dispatch_to_triton_on_cuda():
    from fusible_ops.kernels import use_triton

    t = torch.empty(1, device="cuda", dtype=torch.bfloat16)
    assert use_triton(t)
    with fo.kernels.use("reference"):
        assert not use_triton(t)
