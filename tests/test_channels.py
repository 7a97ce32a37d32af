"""Channels: MakeExtraOutput(channel=) feeds a later AddExtraInput(channel=) of the same run, so a
block whose residual is made mid-chain is one Sequential called with its input alone. Against the
same math written out in float64, on both CPU backward paths and the interpreter's kernels; the
residual fusions still apply; errors name the op."""

import pytest
import torch

import fusible_ops as fo
import fusible_ops.kernels as K
from fusible_ops.fuser import cpu_autograd
from fusible_ops.testing import assert_close

D, FF = 16, 24


def _block(device="cpu", dtype=torch.float32, ff=FF):
    torch.manual_seed(0)
    kw = dict(device=device, dtype=dtype)
    return fo.Sequential(fo.AddExtraInput(), fo.MakeExtraOutput(channel="h"), fo.RMSNorm(D, **kw),
                         fo.Linear(D, 2 * ff, bias=False, **kw), fo.SwiGLU(), fo.Linear(ff, D, bias=False, **kw),
                         fo.AddExtraInput(channel="h"))


def _float64(block, x, r, dy):
    """h = x + r; h + W2 swiglu(W1 rmsnorm(h)) and its gradients, in float64."""
    x64, r64 = [t.detach().double().requires_grad_() for t in (x, r)]
    w = [block[i].weight.detach().double() for i in (2, 3, 5)]
    h = x64 + r64
    n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + block[2].eps) * w[0]
    a, g = (n @ w[1].t()).chunk(2, dim=-1)
    y = h + (torch.nn.functional.silu(a) * g) @ w[2].t()
    y.backward(dy.double())
    return y, x64.grad, r64.grad


@pytest.mark.parametrize("path", ["autograd", "own_backward", "interpreter"])
def test_mid_chain_residual_block_matches_float64_and_fuses(path):
    if path == "interpreter" and not K.interpreter_enabled():
        pytest.skip("needs Triton's interpreter")
    block = _block()
    x, r = torch.randn(2, 5, D, requires_grad=True), torch.randn(2, 5, D, requires_grad=True)
    dy = torch.randn(2, 5, D)
    assert block.extra_input_names == ("residual",)  # (the channel's consumer takes nothing from the caller)
    with cpu_autograd(path == "autograd"), K.use("triton" if path == "interpreter" else "auto"):
        y = block(x, r)  # one tensor out: the producer returns no extra output
        y.backward(dy)
        rules = [g["rule"] for g in block.fusion_plan("forward", x, r)]
    assert rules == ["residual_extra_norm", None, None, "linear_add"]
    assert "channel 'h': op [1] MakeExtraOutput -> op [6] AddExtraInput" in block.explain(x, r)
    want, dx, dr = _float64(block, x, r, dy)
    assert_close(y, want, torch.float32)
    assert_close(x.grad, dx, torch.float32)
    assert_close(r.grad, dr, torch.float32)


def test_the_channel_equals_the_block_split_by_hand():
    """The same ops as two Sequentials, the residual passed by the caller: bit for bit (the same
    plans: residual_extra_norm in the first, linear_add in the second)."""
    block = _block()
    first = fo.Sequential(block[0], fo.MakeExtraOutput(), block[2])  # (the same parameters)
    second = fo.Sequential(block[3], block[4], block[5], fo.AddExtraInput())
    x, r = torch.randn(6, D, requires_grad=True), torch.randn(6, D, requires_grad=True)
    dy = torch.randn(6, D)
    y = block(x, r)
    y.backward(dy)
    got = [y.detach(), x.grad, r.grad, *[block[i].weight.grad for i in (2, 3, 5)]]
    x.grad = r.grad = None
    for i in (2, 3, 5):
        block[i].weight.grad = None
    n, h = first(x, r)
    y2 = second(n, h)
    y2.backward(dy)
    want = [y2.detach(), x.grad, r.grad, *[block[i].weight.grad for i in (2, 3, 5)]]
    assert [g["rule"] for g in first.fusion_plan() if g["rule"]] == ["residual_extra_norm"]
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_fp8_current_scaling_through_a_channel_against_float64():
    """Under FP8 autocast (CPU: emulation) the block keeps residual_extra_norm (linear_add declines
    under FP8) and its result and gradients are within the FP8 SQNR table against float64."""
    from fusible_ops.testing import SQNR_DB, assert_sqnr

    block = _block(ff=32)  # (FP8 dims: multiples of 16)
    x, r = torch.randn(32, D, requires_grad=True), torch.randn(32, D, requires_grad=True)
    dy = torch.randn(32, D)
    recipe = fo.Float8CurrentScaling()
    with fo.autocast(recipe=recipe):
        y = block(x, r)
        assert [g["rule"] for g in block.fusion_plan() if g["rule"]] == ["residual_extra_norm"]
    y.backward(dy)
    want, dx, dr = _float64(block, x, r, dy)
    assert_sqnr(y, want, SQNR_DB["output", recipe.fp8_format], msg="y")
    assert_sqnr(x.grad, dx, SQNR_DB["grad", recipe.fp8_format], msg="dx")
    assert_sqnr(r.grad, dr, SQNR_DB["grad", recipe.fp8_format], msg="dr")


def test_torch_compile_of_the_block_has_no_graph_break():
    from torch._dynamo.utils import counters

    block = _block()
    x, r = torch.randn(6, D), torch.randn(6, D)
    want = block(x, r)
    torch._dynamo.reset()
    counters.clear()
    got = torch.compile(block, backend="aot_eager")(x, r)
    assert sum(counters["graph_break"].values()) == 0
    assert torch.allclose(got, want, atol=1e-6)


def test_channel_errors_name_the_op():
    x = torch.randn(4, D)
    with pytest.raises(ValueError, match=r"AddExtraInput\(channel='h'\) \(basic op 1\): no MakeExtraOutput"):
        fo.Sequential(fo.Identity(), fo.AddExtraInput(channel="h"))(x)
    with pytest.raises(ValueError, match="already makes channel 'h'"):
        fo.Sequential(fo.MakeExtraOutput(channel="h"), fo.MakeExtraOutput(channel="h"),
                      fo.AddExtraInput(channel="h"))(x)
    with pytest.raises(ValueError, match=r"MakeExtraOutput\(channel='h'\) \(basic op 0\): no later AddExtraInput"):
        fo.Sequential(fo.MakeExtraOutput(channel="h"), fo.Identity())(x)
    with pytest.raises(ValueError, match="from_input=True and channel= both"):
        fo.AddExtraInput(from_input=True, channel="h")
    with pytest.raises(TypeError, match="channel must be a non-empty string"):
        fo.MakeExtraOutput(channel=3)
    # a non-fusible module between producer and consumer splits the run
    split = fo.Sequential(fo.MakeExtraOutput(channel="h"), torch.nn.Tanh(), fo.AddExtraInput(channel="h"))
    with pytest.raises(ValueError, match="non-fusible module.* splits the run"):
        split(x)


def test_a_rule_that_fuses_both_ends_of_a_channel_raises_naming_it():
    class MakeThenAdd(fo.FusedOperation):
        def fuser_forward(self, ctxs, x, *, extra_inputs, **kwargs):  # (never reached)
            raise AssertionError("planned")

    rs = fo.RuleSet.builtin()
    rs.register("make_then_add", [fo.MakeExtraOutput, fo.AddExtraInput], pass_="forward", build=MakeThenAdd)
    seq = fo.Sequential(fo.MakeExtraOutput(channel="h"), fo.AddExtraInput(channel="h"), rules=rs)
    with pytest.raises(RuntimeError, match="fusion rule 'make_then_add' fuses both ends of a channel"):
        seq(torch.randn(3, D))


@pytest.mark.gpu
def test_gpu_block_matches_float64():
    block = _block("cuda")
    x, r = torch.randn(512, D, device="cuda", requires_grad=True), torch.randn(512, D, device="cuda", requires_grad=True)
    dy = torch.randn(512, D, device="cuda")
    y = block(x, r)
    y.backward(dy)
    want, dx, dr = _float64(block, x, r, dy)
    assert_close(y, want, torch.float32)
    assert_close(x.grad, dx, torch.float32)
    assert_close(r.grad, dr, torch.float32)
