"""``AddExtraInput(from_input=True)``: a residual block as ONE Sequential called with one tensor
(``h + mlp(norm(h))``): the Sequential passes its own input as the residual, the residual fusions
apply, gradients of the input sum both uses, and it composes with extra inputs by name,
``explain()``, hooks and ``torch.compile``."""

import pytest
import torch

import fusible_ops as fo
from fusible_ops.testing import assert_close_scaled

D, F = 16, 24


def _block(from_input, dtype=torch.float32):
    torch.manual_seed(0)
    return fo.Sequential(fo.RMSNorm(D, dtype=dtype), fo.Linear(D, 2 * F, bias=False, dtype=dtype), fo.SwiGLU(),
                         fo.Linear(F, D, bias=False, dtype=dtype), fo.AddExtraInput(from_input=from_input))


def _grads(seq, y, h):
    return torch.autograd.grad(y, [h, *seq.parameters()], torch.ones_like(y))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_in_one_sequential_equals_passing_the_residual(dtype):
    auto, manual = _block(True, dtype), _block(False, dtype)
    manual.load_state_dict(auto.state_dict())
    h = torch.randn(2, 5, D, dtype=dtype, requires_grad=True)
    y_auto, y_manual = auto(h), manual(h, h)
    torch.testing.assert_close(y_auto, y_manual, rtol=0, atol=0)
    for a, b in zip(_grads(auto, y_auto, h), _grads(manual, y_manual, h)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert "linear_add" in [g["rule"] for g in auto.fusion_plan()]  # the residual fusion applied


def test_matches_float64_math():
    seq = _block(True)
    h = torch.randn(3, D, dtype=torch.float64).float().requires_grad_()
    y = seq(h)
    n, w1, w2 = seq[0], seq[1].weight, seq[3].weight
    h64 = h.detach().double().requires_grad_()
    z = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + n.eps) * n.weight.double()
    a, b = (z @ w1.double().t()).chunk(2, dim=-1)
    y64 = h64 + (torch.nn.functional.silu(a) * b) @ w2.double().t()
    assert_close_scaled(y, y64, torch.float32, "output")
    (g,) = torch.autograd.grad(y.sum(), h)
    (g64,) = torch.autograd.grad(y64.sum(), h64)
    assert_close_scaled(g, g64, torch.float32, "input grad (both uses summed)")


def test_takes_no_extra_input_for_it_and_says_so():
    seq = _block(True)
    assert seq.extra_input_names == ()
    h = torch.randn(3, D)
    with pytest.raises(TypeError, match="expected 0 extra inputs after x, got 1"):
        seq(h, h)
    with pytest.raises(TypeError, match="unexpected keyword argument 'residual'"):
        seq(h, residual=h)
    # another AddExtraInput in the same Sequential still takes its residual, by position or name
    two = fo.Sequential(fo.Linear(D, D), fo.AddExtraInput(), fo.AddExtraInput(from_input=True))
    assert two.extra_input_names == ("residual",)
    r = torch.randn(3, D)
    torch.testing.assert_close(two(h, residual=r), two[0](h) + r + h)
    torch.testing.assert_close(two(h, r), two[0](h) + r + h)


def test_explain_and_fusion_plan_with_x_given():
    seq = _block(True)
    h = torch.randn(4, D, requires_grad=True)
    assert "linear_add" in seq.explain(h)
    assert [g["rule"] for g in seq.fusion_plan("forward", h) if g["rule"]] == ["linear_add"]


def test_alone_and_behind_a_boundary_it_adds_the_sequential_input():
    op = fo.AddExtraInput(from_input=True)
    x = torch.randn(3, D)
    torch.testing.assert_close(op(x), 2 * x)
    assert "from_input=True" in repr(op)
    # a plain torch module between: the residual is still the Sequential's input, not the stage's
    seq = fo.Sequential(fo.Linear(D, D), torch.nn.Tanh(), fo.AddExtraInput(from_input=True))
    torch.testing.assert_close(seq(x), torch.tanh(seq[0](x)) + x)
    # a fusible module with a hook runs on its own and gets the same residual
    seen = []
    seq[2].register_forward_hook(lambda m, args, out: seen.append(len(args)))
    torch.testing.assert_close(seq(x), torch.tanh(seq[0](x)) + x)
    assert seen == [2]


def test_torch_compile_fullgraph():
    seq = _block(True)
    h = torch.randn(2, 5, D, requires_grad=True)
    ref = seq(h)
    out = torch.compile(seq, backend="aot_eager", fullgraph=True)(h)
    torch.testing.assert_close(out, ref)
    torch._dynamo.reset()
