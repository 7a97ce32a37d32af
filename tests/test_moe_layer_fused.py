"""The MoE layer's fused expert MLP (rule moe_dispatch_mlp: no gathered copy kept) and the layer
under FP8 autocast. Helpers from test_moe_layer.py."""

import contextlib
import copy

import pytest
import torch

import fusible_ops as fo
from test_moe_layer import H, _moe, _no_near_ties, _saved_shapes, _x


def test_dispatch_mlp_keeps_no_gathered_copy_and_matches_unfused():
    """moe_dispatch_mlp drops the gathered [T * k, hidden] copy FC1's weight gradient would keep
    (backward gathers again) and gives the unfused layer's results."""
    moe = _moe(4, 2)
    x = _x((37, H), seed=3).requires_grad_()
    dy = torch.randn(37, H, generator=torch.Generator().manual_seed(4), dtype=x.dtype)
    copies = ("copies", (37 * 2, H))
    runs = {}
    for fused in (True, False):
        ctx = contextlib.nullcontext() if fused else fo.fusion_rules.disabled("moe_dispatch_mlp")
        with ctx:
            shapes, y, aux = _saved_shapes(moe, x)
            (y * dy).sum().add(aux).backward()
            assert ("moe_dispatch_mlp" in [r["rule"] for r in moe.fusion_plan()]) == fused
        runs[fused] = (shapes, y.detach(), x.grad.clone(), [p.grad.clone() for p in moe.parameters()])
        x.grad = None
        moe.zero_grad(set_to_none=True)
    assert copies not in runs[True][0] and copies in runs[False][0]
    torch.testing.assert_close(runs[True][1], runs[False][1], rtol=0, atol=0)
    torch.testing.assert_close(runs[True][2], runs[False][2], rtol=0, atol=0)
    for a, b in zip(runs[True][3], runs[False][3]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_dispatch_mlp_declines_under_fp8_block_scaling_with_a_reason():
    moe = _moe(4, 2)
    x = _x((16, H), seed=5)
    with fo.autocast(recipe=fo.Float8BlockScaling()):
        text = moe.explain(x)
    assert "moe_dispatch_mlp" in text and "FP8 block scaling" in text


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_fp8_autocast_over_the_routed_layer(recipe):
    """Under FP8 autocast (per-tensor recipes) moe_dispatch_mlp runs the FP8 expert MLP on the
    tokens cast once, FC1's kernel gathering the FP8 rows: exactly the results of the same layer
    with moe_dispatch_mlp off (the copies gathered, then cast: same amax, same FP8 values), with
    k times less FP8 input kept for backward. Against float64 math the output is as accurate as
    the layer with every fusion off (FP8 grouped linears one by one), the gradients meet the
    SQNR table. The router stays in high precision."""
    from fusible_ops.testing import SQNR_DB, assert_sqnr, sqnr

    make = {"current": fo.Float8CurrentScaling, "delayed": fo.Float8DelayedScaling}[recipe]
    moe = _moe(4, 2, normalize=True, hidden=32, ffn=16, z_loss_coeff=0.0)
    x = _x((96, 32), seed=21)
    _no_near_ties(moe[0], x)
    dy = torch.randn(96, 32, generator=torch.Generator().manual_seed(22))
    ref = copy.deepcopy(moe).double()
    x64 = x.detach().double().requires_grad_()
    y64, aux64 = ref(x64)
    torch.autograd.backward((y64, aux64), (dy.double(), torch.ones_like(aux64)))

    def run(*disabled):
        layer = copy.deepcopy(moe)  # (fresh delayed-scaling state per run)
        xx = x.detach().clone().requires_grad_()
        with fo.fusion_rules.disabled(*disabled), fo.autocast(recipe=make()):
            shapes, y, aux = _saved_shapes(layer, xx)
            plan = [r["rule"] for r in layer.fusion_plan()]
        torch.autograd.backward((y, aux), (dy, torch.ones_like(aux)))
        return y, xx.grad, [p.grad for p in layer.parameters()], plan, shapes

    y, dx, grads, plan, shapes = run()
    assert plan == [None, "moe_dispatch_mlp", None]  # Router, Dispatch + the FP8 expert MLP, Combine
    y_off, dx_off, grads_off, plan_off, shapes_off = run("moe_dispatch_mlp")
    assert plan_off == [None, None, "grouped_mlp", None]
    torch.testing.assert_close(y, y_off, rtol=0, atol=0)
    torch.testing.assert_close(dx, dx_off, rtol=0, atol=0)
    for a, b in zip(grads, grads_off):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # FP8 input kept for FC1's weight gradient: the tokens [T, H] (fused), the copies [H, T * k] (off)
    assert (32, 192) not in shapes and (32, 192) in shapes_off
    y_unfused, *_ = run(*fo.RuleSet.builtin().names())
    fmt = make().fp8_format
    baseline = sqnr(y_unfused, y64)
    assert_sqnr(y, y64, baseline - 1.0, msg=f"y (unfused FP8 baseline {baseline:.2f} dB)")
    assert_sqnr(dx, x64.grad, SQNR_DB["grad", fmt], msg="dx")
    for g, p in zip(grads, ref.parameters()):
        assert_sqnr(g, p.grad, SQNR_DB["grad", fmt], msg="weight gradient")


@pytest.mark.gpu
def test_gpu_fp8_dispatch_mlp_gathers_fp8_rows():
    """On the GPU (Triton FP8 kernels, the gathering FC1 kernel on FP8 rows): moe_dispatch_mlp
    under FP8 current scaling gives the results of the same FP8 layer with it off up to the FP8
    kernels' own accumulation error (the SQNR table's kernel row)."""
    from fusible_ops.kernels import launch
    from fusible_ops.testing import SQNR_DB, assert_sqnr

    moe = _moe(8, 2, normalize=True, hidden=256, ffn=128, dtype=torch.bfloat16, device="cuda")
    x = _x((300, 256), seed=23, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    runs = []
    for disabled in ((), ("moe_dispatch_mlp",)):
        layer = copy.deepcopy(moe)
        xx = x.detach().clone().requires_grad_()
        old = launch.AUTOTUNE
        launch.AUTOTUNE = False
        try:
            with fo.fusion_rules.disabled(*disabled), fo.autocast(recipe=fo.Float8CurrentScaling()):
                y, aux = layer(xx)
                assert ("moe_dispatch_mlp" in [r["rule"] for r in layer.fusion_plan()]) == (not disabled)
            torch.autograd.backward((y, aux), (dy, torch.ones_like(aux)))
        finally:
            launch.AUTOTUNE = old
        runs.append([y, xx.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*runs):
        assert_sqnr(a.float(), b.double(), SQNR_DB["kernel", "fp8 operands"])

