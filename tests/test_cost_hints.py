"""The built-in cost hints: the joint grouped-MLP rules (grouped_mlp, moe_dispatch_mlp) decline in
training on CUDA where they measured slower than the same ops unfused (16/32-bit; FP8 from expert
width FP8_WIDE_FFN), explain() says so, and "cost hints" disabled takes the fused plan back."""

import pytest
import torch

import fusible_ops as fo
from fusible_ops.fusion_rules.grouped_mlp import FP8_WIDE_FFN, grouped_glu_cost
from fusible_ops.rules import FusionContext

pytestmark = pytest.mark.cost_hints


def _ops(width):
    return [fo.GroupedLinear(4, 32, 2 * width, bias=False), fo.SwiGLU(), fo.GroupedLinear(4, width, 32, bias=False)]


def _ctx(device="cuda", recipe=None, requires_grad=True):
    return FusionContext(torch.bfloat16, torch.device(device), recipe, requires_grad, True, "joint")


def test_grouped_glu_cost_declines_what_was_measured_slower():
    assert "16/32-bit" in grouped_glu_cost(_ops(256), _ctx())
    fp8 = fo.Float8CurrentScaling()
    assert grouped_glu_cost(_ops(256), _ctx(recipe=fp8)) is None  # (measured 9% faster)
    assert grouped_glu_cost(_ops(FP8_WIDE_FFN - 32), _ctx(recipe=fp8)) is None
    assert f"expert width {FP8_WIDE_FFN} >= {FP8_WIDE_FFN}" in grouped_glu_cost(_ops(FP8_WIDE_FFN), _ctx(recipe=fp8))
    assert grouped_glu_cost(_ops(256), _ctx(device="cpu")) is None  # (CPU runs the reference math)
    assert grouped_glu_cost(_ops(256), _ctx(requires_grad=False)) is None  # (joint rules only)


def test_disabling_cost_hints_takes_a_hinted_rule_back():
    import dataclasses

    rs = fo.RuleSet.builtin()
    base = next(r for r in rs.rules("forward") if r.name == "linear_bias")
    rs.add(dataclasses.replace(base, cost=lambda ops, ctx: "loses (test)"))
    seq = fo.Sequential(fo.Linear(8, 8), rules=rs)
    x = torch.randn(4, 8)
    assert [r["rule"] for r in seq.fusion_plan("forward", x)] == [None, None]
    with fo.fusion_rules.disabled("cost hints"):
        assert [r["rule"] for r in seq.fusion_plan("forward", x)] == ["linear_bias"]


def _moe(device):
    return fo.Sequential(fo.Router(32, 4, top_k=2), fo.Dispatch(), *_ops(64), fo.Combine()).to(device)


def test_cpu_plans_keep_the_fused_moe_mlp():
    moe = _moe("cpu")
    x = torch.randn(16, 32, requires_grad=True)
    assert "moe_dispatch_mlp" in [r["rule"] for r in moe.fusion_plan("forward", x)]


@pytest.mark.gpu
def test_gpu_bf16_training_declines_and_cost_hints_off_fuses():
    moe = _moe("cuda").to(torch.bfloat16)
    x = torch.randn(256, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert "moe_dispatch_mlp" not in [r["rule"] for r in moe.fusion_plan("forward", x)]
    assert "cost hint: training in 16/32-bit" in moe.explain(x)
    with fo.fusion_rules.disabled("cost hints"):
        assert "moe_dispatch_mlp" in [r["rule"] for r in moe.fusion_plan("forward", x)]
    with torch.no_grad():  # (inference: the hint is about training)
        assert "cost hint" not in moe.explain(x)
