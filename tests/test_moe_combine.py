"""Rules ``moe_act_combine`` (activation + FC2 + Combine) and ``moe_combine`` (FC2 + Combine),
fusible_ops.fusion_rules.moe_combine: the probabilities' gradient from FC2's input gradient and
FC2's input, with no kept [T * k, hidden] output (nor FC2's input, with the activation).

The rules are taken where the fused expert MLP is not (bf16 training on CUDA, where its cost hint
declines it; here on CPU by disabling ``moe_dispatch_mlp`` and ``grouped_mlp``). Checked against
float64 autograd over the reference math, against the unfused layer in float64, through the
gradient contract, with a frozen router, and for what they keep.
"""

import contextlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fusible_ops as fo
from fusible_ops.testing import assert_matches_reference
from test_moe_layer import F, H, _moe, _no_near_ties, _saved_shapes, _x

MLP_RULES = ("moe_dispatch_mlp", "grouped_mlp")


def _plan(moe):
    return [(r["op"], r["rule"]) for r in moe.fusion_plan()]


FUSED = [("Router", None), ("Dispatch", None), ("GroupedLinear", None), ("GroupedLinearCombine", "moe_act_combine")]
LAST = ("GroupedLinearCombine", "moe_act_combine")


@pytest.mark.parametrize("top_k,normalize,score", [(1, False, "softmax"), (2, True, "softmax"), (4, False, "sigmoid")])
@pytest.mark.parametrize("lead", [(13,), (2, 5)])
def test_matches_float64_reference_and_fuses(top_k, normalize, score, lead):
    moe = _moe(5, top_k, score=score, normalize=normalize)
    x = _x((*lead, H), seed=21)
    _no_near_ties(moe[0], x)
    with fo.fusion_rules.disabled(*MLP_RULES):
        assert_matches_reference(moe, x)
        moe(x)
        assert _plan(moe) == FUSED


def _grads(moe, x, dy, rule, dtype=torch.float64):
    """Saved shapes, outputs and gradients with only ``rule`` of this family (None: neither)."""
    off = [r for r in ("moe_act_combine", "moe_combine") if r != rule]
    with fo.fusion_rules.disabled(*MLP_RULES, *off):
        x = x.detach().to(dtype).requires_grad_()
        moe.zero_grad(set_to_none=True)
        shapes, y, aux = _saved_shapes(moe, x)
        (y * dy.to(dtype)).sum().add(aux).backward()
        assert [r["rule"] for r in moe.fusion_plan()][-1] == rule
    return shapes, [y.detach(), x.grad] + [p.grad for p in moe.parameters()]


def test_float64_equals_the_unfused_layer_and_keeps_no_fc2_output():
    """In float64 the fused backward equals the unfused one to rounding. FC2's output (a [T * k,
    hidden] tensor whose rows are not token copies) is kept only by the unfused plan; FC2's input
    ([T * k, F]) is not kept with the activation in the rule."""
    moe = _moe(4, 2, normalize=True, dtype=torch.float64)
    x, dy = _x((37, H), seed=3), torch.randn(37, H, generator=torch.Generator().manual_seed(4))
    _no_near_ties(moe[0], x)
    s_u, unfused = _grads(moe, x, dy, None)
    for rule in ("moe_act_combine", "moe_combine"):
        s_f, fused = _grads(moe, x, dy, rule)
        for a, b in zip(fused, unfused):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        assert (37 * 2, H) in s_u and (37 * 2, H) not in s_f
        assert s_f.count(("copies", (37 * 2, H))) == s_u.count(("copies", (37 * 2, H))) == 1  # (Dispatch's, for FC1)
        assert s_u.count((37 * 2, F)) == 1 and s_f.count((37 * 2, F)) == (rule == "moe_combine")


@pytest.mark.parametrize("act", [fo.GEGLU, fo.ReLU, fo.SiLU])
def test_other_activations_match_float64_reference(act):
    moe = _moe(4, 2)
    gated = act is fo.GEGLU
    width = 2 * F if gated else F
    moe[2] = fo.GroupedLinear(4, H, width, bias=False)
    moe[3] = act()
    with torch.no_grad():
        moe[2].weight.uniform_(-1, 1)
    x = _x((11, H), seed=7)
    _no_near_ties(moe[0], x)
    with fo.fusion_rules.disabled(*MLP_RULES, "moe_ep_overlap"):
        assert_matches_reference(moe, x)
        assert _plan(moe)[-1] == LAST


def test_moe_combine_alone_matches_float64_reference():
    moe = _moe(4, 2)
    x = _x((11, H), seed=12)
    _no_near_ties(moe[0], x)
    with fo.fusion_rules.disabled(*MLP_RULES, "moe_act_combine"):
        assert_matches_reference(moe, x)
        assert _plan(moe)[-1] == ("GroupedLinearCombine", "moe_combine")


@pytest.mark.parametrize("frozen", ["router", "fc2", "both"])
def test_frozen_router_or_fc2(frozen):
    moe = _moe(4, 2)
    if frozen in ("router", "both"):
        moe[0].weight.requires_grad_(False)
    if frozen in ("fc2", "both"):
        moe[4].weight.requires_grad_(False)
    x = _x((11, H), seed=5)
    _no_near_ties(moe[0], x)
    with fo.fusion_rules.disabled(*MLP_RULES):
        assert_matches_reference(moe, x)
        moe(x)
        assert _plan(moe)[-1] == LAST
        if frozen in ("router", "both"):  # (the input's gradient still reaches the router's probabilities)
            x2 = x.detach()
            assert_matches_reference(moe, x2)


@pytest.mark.parametrize("delayed", [False, True])
def test_main_grad_and_delayed_wgrad_of_fc2(delayed):
    moe = _moe(4, 2)
    fc2 = moe[4]
    fc2.accumulate_into_main_grad, fc2.delay_wgrad_compute = True, delayed
    fc2.weight.main_grad = torch.zeros_like(fc2.weight)
    x = _x((11, H), seed=6)
    _no_near_ties(moe[0], x)
    with fo.fusion_rules.disabled(*MLP_RULES):
        assert_matches_reference(moe, x)
        assert _plan(moe)[-1] == LAST


def test_empty_experts_and_interpreter_fp32():
    from fusible_ops.kernels import interpreter_enabled

    moe = _moe(6, 2)
    x = _x((3, H), seed=8)  # 6 copies over 6 experts: some get none
    _no_near_ties(moe[0], x)
    ctx = fo.kernels.use("triton") if interpreter_enabled() else contextlib.nullcontext()
    with fo.fusion_rules.disabled(*MLP_RULES), ctx:
        assert_matches_reference(moe, x)
        assert _plan(moe)[-1] == LAST


def test_declines_with_reasons():
    x = _x((8, H), seed=9)
    seq = fo.Sequential(fo.Router(H, 4, 2), fo.Dispatch(), fo.GroupedLinear(4, H, H, bias=True), fo.Combine())
    assert "FC2 has a bias" in seq.explain(x)
    moe = _moe(4, 2)
    with fo.fusion_rules.disabled(*MLP_RULES):
        with fo.autocast(recipe=fo.Float8BlockScaling()):
            assert "FP8 autocast" in moe.explain(x)
        with torch.no_grad():
            moe(x)
            assert [r["rule"] for r in moe.fusion_plan()][-1] is None


def test_cost_hint_declines_where_the_backward_moves_more_bytes():
    """On CUDA: with the activation the rule pays while FC2's input width is below its output
    width; without it, while 4x the input width is (the byte counts of fusion_rules.moe_combine)."""
    from types import SimpleNamespace

    from fusible_ops.fusion_rules.moe_combine import _cost

    def fc2(f, hidden=1536):
        return fo.GroupedLinear(4, f, hidden, bias=False, device="meta")

    cuda = SimpleNamespace(device=torch.device("cuda"), requires_grad=True, recipe=None)
    act, comb = fo.SwiGLU(), fo.Combine()
    assert _cost([act, fc2(256), comb], cuda) is None and _cost([act, fc2(1535), comb], cuda) is None
    assert "input width 1536 >= its output width 1536" in _cost([act, fc2(1536), comb], cuda)
    assert _cost([fc2(383), comb], cuda) is None
    assert "input width 384 x 4 >= its output width 1536" in _cost([fc2(384), comb], cuda)
    cpu = SimpleNamespace(device=torch.device("cpu"), requires_grad=True, recipe=None)
    assert _cost([act, fc2(4096), comb], cpu) is None


_ACTS = {"swiglu": fo.SwiGLU, "geglu": fo.GEGLU, "reglu": fo.ReGLU, "silu": fo.SiLU, "relu": fo.ReLU,
         None: None}


@given(experts=st.integers(1, 5), top_k=st.integers(1, 3), tokens=st.integers(0, 9), ffn=st.integers(1, 7),
       act=st.sampled_from(list(_ACTS)), dtype=st.sampled_from([torch.float32, torch.float64]),
       frozen=st.sampled_from(["none", "router", "fc2"]), score=st.sampled_from(["softmax", "sigmoid"]))
def test_random_layers_match_the_reference(experts, top_k, tokens, ffn, act, dtype, frozen, score):
    """Random MoE layers ending in (an activation,) a bias-free FC2 and Combine, fused by
    moe_act_combine / moe_combine, against float64 autograd: any expert count, top_k <= experts,
    no tokens at all, widths of 1."""
    top_k = min(top_k, experts)
    torch.manual_seed(experts * 100 + tokens)
    kind = _ACTS[act]
    gated = kind is not None and issubclass(kind, (fo.SwiGLU, fo.GEGLU, fo.ReGLU))
    ops = [fo.Router(H, experts, top_k, score=score, dtype=dtype), fo.Dispatch(),
           fo.GroupedLinear(experts, H, (2 if gated else 1) * ffn, bias=False, dtype=dtype)]
    ops += [kind()] if kind is not None else []
    ops += [fo.GroupedLinear(experts, ffn, H, bias=False, dtype=dtype), fo.Combine()]
    seq = fo.Sequential(*ops)
    with torch.no_grad():
        for p in seq.parameters():
            p.uniform_(-1, 1)
    if frozen == "router":
        seq[0].weight.requires_grad_(False)
    elif frozen == "fc2":
        seq[-2].weight.requires_grad_(False)
    x = _x((tokens, H), seed=tokens + 1, dtype=dtype)
    _no_near_ties(seq[0], x)
    rule = "moe_act_combine" if kind is not None else "moe_combine"
    with fo.fusion_rules.disabled(*MLP_RULES):
        assert_matches_reference(seq, x)
        assert [r["rule"] for r in seq.fusion_plan()][-1] == rule
