"""torch.compile compatibility: a model built from fusible ops traces without graph breaks."""

import pytest
import torch

import fusible_ops as fo


def _block(device="cpu", dtype=torch.float32):
    torch.manual_seed(0)
    return fo.Sequential(
        fo.RMSNorm(8, device=device, dtype=dtype), fo.Linear(8, 16, device=device, dtype=dtype), fo.GELU(),
        fo.Linear(16, 8, device=device, dtype=dtype), fo.AddExtraInput(),
    )


def test_compile_aot_eager_matches_eager_without_graph_breaks():
    seq = _block()
    x = torch.randn(4, 8, requires_grad=True)
    assert torch._dynamo.explain(seq)(x, x).graph_break_count == 0
    y = torch.compile(seq, backend="aot_eager")(x, x)
    (gx,) = torch.autograd.grad(y.sum(), [x])
    x2 = x.detach().clone().requires_grad_()
    y2 = seq(x2, x2)
    (gx2,) = torch.autograd.grad(y2.sum(), [x2])
    torch.testing.assert_close(y, y2)
    torch.testing.assert_close(gx, gx2)


@pytest.mark.gpu
def test_compile_inductor_on_cuda_with_triton_custom_ops():
    seq = _block("cuda", torch.bfloat16)
    x = torch.randn(64, 8, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = torch.compile(seq, fullgraph=True)(x, x)
    y.sum().backward()
    torch.testing.assert_close(y, seq(x, x))
