"""The mixture-of-experts layer as ops: Router -> Dispatch -> grouped MLP -> Combine.

Checked against float64 autograd over each op's reference_forward (assert_matches_reference) and
against a per-token loop. assert_matches_reference replays the run's expert choice in the
reference (checked to be a top-k of the reference's scores within the dtype's tolerance); on top
of that, inputs fed straight to a Router are checked to have no near-tie at the k-th expert
(``_no_near_ties``), so the reference's own top-k would choose the same experts too.
"""

import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import fusible_ops as fo
import fusible_ops.ops.moe as moe_ops
from fusible_ops.ops.moe import RoutingError
from fusible_ops.testing import assert_close_scaled, assert_matches_reference
from test_compile_cpu import _assert_no_graph_breaks, _have_cxx

H, F = 8, 6


def _moe(experts=4, top_k=2, *, score="softmax", normalize=False, expert_bias=False, hidden=H, ffn=F,
         dtype=torch.float32, device="cpu", seed=0, **router):
    torch.manual_seed(seed)
    router.setdefault("z_loss_coeff", 1e-2)
    seq = fo.Sequential(
        fo.Router(hidden, experts, top_k, score=score, normalize=normalize, expert_bias=expert_bias, device=device,
                  dtype=dtype, **router),
        fo.Dispatch(),
        fo.GroupedLinear(experts, hidden, 2 * ffn, bias=False, device=device, dtype=dtype),
        fo.SwiGLU(),
        fo.GroupedLinear(experts, ffn, hidden, bias=False, device=device, dtype=dtype),
        fo.Combine(),
    )
    with torch.no_grad():
        for p in seq.parameters():
            p.uniform_(-1, 1)
        if expert_bias:
            seq[0].expert_bias.copy_(torch.linspace(-0.3, 0.3, experts))
    return seq


def _selection(router, x):
    """Float64 selection scores [T, E] of ``router`` for ``x``."""
    x64 = x.detach().double().reshape(-1, router.in_features).cpu()
    s = router.scores(x64 @ router.weight.detach().double().cpu().t())
    return s if router.expert_bias is None else s + router.expert_bias.double().cpu()


def _no_near_ties(router, x, margin=1e-4):
    """The k-th and (k+1)-th selection scores of every token differ by more than ``margin``
    relatively (fp32 logits and scores are computed to ~1e-7 relative)."""
    if router.top_k == router.num_experts or x.numel() == 0:
        return
    top = torch.topk(_selection(router, x), router.top_k + 1, dim=-1).values
    gap = ((top[:, -2] - top[:, -1]) / top[:, -2].abs().clamp_min(1e-30)).min().item()
    assert gap > margin, f"test input has a near-tie in the top-k selection (gap {gap:.2e}): pick another seed"


def _counts(router, x):
    ids = torch.topk(_selection(router, x), router.top_k, dim=-1).indices
    return torch.bincount(ids.flatten(), minlength=router.num_experts)


def _x(shape, seed=1, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device, dtype).requires_grad_()


# ------------------------------------------------------------------------- against float64 autograd
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("lead", [(11,), (2, 5)])
def test_matches_float64_reference(score, top_k, normalize, lead):
    moe = _moe(8, top_k, score=score, normalize=normalize, expert_bias=score == "sigmoid")
    x = _x((*lead, H))
    _no_near_ties(moe[0], x)
    assert_matches_reference(moe, x)  # output, aux loss, and every gradient (aux loss's included)


@pytest.mark.parametrize("aux,z", [(0.0, 0.0), (0.5, 0.0), (0.0, 0.3), (0.1, 0.2)])
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_aux_and_z_loss_gradients(aux, z, score):
    moe = _moe(6, 2, score=score, aux_loss_coeff=aux, z_loss_coeff=z)
    x = _x((9, H), seed=3)
    _no_near_ties(moe[0], x)
    assert_matches_reference(moe, x)
    # the aux loss alone reaches the router weight and x (the copies' path does not carry it)
    y, loss = moe(x)
    router_w = moe[0].weight
    got = torch.autograd.grad(loss, [router_w], allow_unused=True)[0]
    if aux or z:
        assert got is not None and got.abs().sum() > 0


def test_aux_loss_values():
    """Uniform routing gives aux_loss_coeff; the z-loss is mean(logsumexp(logits)^2)."""
    moe = _moe(4, 1, aux_loss_coeff=0.25, z_loss_coeff=0.0)
    with torch.no_grad():
        moe[0].weight.zero_()  # equal scores: P_e = 1/4 for every expert
        moe[0].weight[:, 0] = torch.tensor([0.0, 1e-3, 2e-3, 3e-3])
    x = torch.zeros(8, H)
    x[:, 0] = torch.tensor([-1.0, 1.0] * 4) * 1e3  # half the tokens to expert 3, half to expert 0
    _, loss = moe(x)
    p = torch.softmax(x @ moe[0].weight.t(), -1)
    want = 0.25 * 4 * (torch.tensor([0.5, 0, 0, 0.5]) * p.mean(0)).sum()
    torch.testing.assert_close(loss, want)
    moe[0].aux_loss_coeff, moe[0].z_loss_coeff = 0.0, 0.5
    _, loss = moe(x)
    torch.testing.assert_close(loss, 0.5 * torch.logsumexp(x @ moe[0].weight.t(), -1).square().mean())


@pytest.mark.parametrize("score,normalize", [("softmax", True), ("sigmoid", False)])
def test_forward_equals_a_per_token_loop(score, normalize):
    moe = _moe(5, 2, score=score, normalize=normalize)
    x = _x((7, H), seed=4)
    _no_near_ties(moe[0], x)
    y, _ = moe(x)
    router, fc1, fc2 = moe[0], moe[2], moe[4]
    s = router.scores(x.detach() @ router.weight.detach().t())
    for t in range(7):
        top = torch.topk(s[t], 2)
        p = top.values / top.values.sum() if normalize else top.values
        want = sum(pj * (fo.SwiGLU().reference_forward(x[t].detach() @ fc1.weight[e].detach().t())
                         @ fc2.weight[e].detach().t()) for pj, e in zip(p, top.indices.tolist()))
        torch.testing.assert_close(y[t].detach(), want, rtol=1e-5, atol=1e-5)


def test_empty_experts_one_expert_with_all_tokens_and_no_tokens():
    moe = _moe(6, 2)
    with torch.no_grad():  # experts 1 and 4 take every token: the others are empty
        moe[0].weight.mul_(0.01)
        moe[0].weight[1, 0], moe[0].weight[4, 1] = 1.0, 1.0
    x = _x((10, H), seed=5)
    with torch.no_grad():
        x[:, :2] = 3.0 + x[:, :2].abs()
    counts = _counts(moe[0], x)
    assert counts.tolist() == [0, 10, 0, 0, 10, 0]
    _no_near_ties(moe[0], x)
    assert_matches_reference(moe, x)
    top1 = _moe(6, 1)
    with torch.no_grad():
        top1[0].weight.copy_(moe[0].weight)
        top1[0].weight[4, 1] = 0.0
    _no_near_ties(top1[0], x)
    assert _counts(top1[0], x).max() == 10  # one expert takes all tokens, five are empty
    assert_matches_reference(top1, x)
    empty = torch.zeros(0, H, requires_grad=True)
    y, loss = moe(empty)
    (y.sum() + loss).backward()
    assert y.shape == (0, H) and empty.grad.shape == (0, H) and loss.item() == 0.0


def test_router_adds_its_input_gradient_into_dispatchs_in_place(monkeypatch):
    """The Router's input gradient is added into the one Dispatch's backward allocated (no
    out-of-place ``torch.addmm``, which copies that [T, H] gradient first), and x's gradient
    still matches the float64 reference."""
    calls = []
    addmm = torch.addmm
    monkeypatch.setattr(torch, "addmm", lambda *a, **k: calls.append(a[0].shape) or addmm(*a, **k))
    moe = _moe(6, 2)
    x = _x((9, H), seed=3)
    _no_near_ties(moe[0], x)
    assert_matches_reference(moe, x)
    assert (9, H) not in calls


def test_two_layers_in_one_fuser_with_norm_and_residuals():
    torch.manual_seed(0)
    layers = []
    for seed in (0, 1):
        moe = _moe(4, 2, seed=seed)
        layers += [fo.RMSNorm(H), *moe, fo.AddExtraInput()]
    seq = fo.Sequential(*layers)
    assert len(seq._get_stages()) == 1  # one fuser, two routings
    x = _x((6, H), seed=7)
    r1, r2 = _x((6, H), seed=8), _x((6, H), seed=9)
    _no_near_ties(seq[1], seq[0].reference_forward(x))
    assert_matches_reference(seq, x, r1, r2)
    assert "MoE routing (4 experts, top_k=2)" in seq.explain()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_block_with_norm_before_the_router(dtype):
    """RMSNorm in bf16/fp16 feeds the Router: its input differs from the float64 reference's by
    rounding, which can flip near-tied choices. The reference replays the run's choice (checked
    to be a top-k of its own scores within the dtype's tolerance) and compares everything else."""
    moe = _moe(8, 2, dtype=dtype, seed=3)
    block = fo.Sequential(fo.RMSNorm(H, dtype=dtype), *moe, fo.AddExtraInput())
    x = _x((64, H), seed=17, dtype=dtype)
    assert_matches_reference(block, x, x.detach().clone().requires_grad_())


def test_reference_catches_a_wrong_selection(monkeypatch):
    moe = _moe(6, 2)
    x = _x((9, H), seed=18)
    real = moe_ops.route

    def worst(logits, k, **kw):  # the run picks the LOWEST scores
        return real(-logits, k, **kw)

    monkeypatch.setattr(moe_ops, "route", worst)
    with pytest.raises(AssertionError, match=r"the run's experts .* are not a top-2 of the reference"):
        assert_matches_reference(moe, x)


def test_expert_bias_selects_only_and_balances():
    moe = _moe(4, 1, score="sigmoid", expert_bias=True)
    router = moe[0]
    x = _x((40, H), seed=19)
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([0.0, 0.0, 5.0, 0.0]))  # expert 2 wins every token
    assert _counts(router, x).tolist() == [0, 0, 40, 0]
    y, _ = moe(x)
    assert router.expert_load.tolist() == [0, 0, 40, 0]
    # the probabilities are the unbiased sigmoid scores of expert 2
    s2 = torch.sigmoid(x.detach() @ router.weight.detach()[2])
    out2 = fo.SwiGLU().reference_forward(x.detach() @ moe[2].weight.detach()[2].t()) @ moe[4].weight.detach()[2].t()
    torch.testing.assert_close(y.detach(), s2[:, None] * out2, rtol=1e-5, atol=1e-5)
    router.update_expert_bias(0.5)
    assert router.expert_bias.tolist() == [0.5, 0.5, 4.5, 0.5] and router.expert_load.sum() == 0
    moe.eval()
    moe(x)
    assert router.expert_load.sum() == 0  # only training forwards count
    with pytest.raises(RuntimeError, match="without expert_bias=True"):
        _moe(4, 1).__getitem__(0).update_expert_bias()


def test_deterministic():
    moe = _moe(8, 2)
    x = _x((32, H), seed=10)
    outs = []
    for _ in range(2):
        moe.zero_grad(set_to_none=True)
        xx = x.detach().clone().requires_grad_()
        y, loss = moe(xx)
        (y.square().sum() + loss).backward()
        outs.append([y, xx.grad] + [p.grad for p in moe.parameters()])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


# -------------------------------------------------------------------------- gradient contract
@pytest.mark.parametrize("frozen", ["router", "experts", "all"])
def test_frozen_router_or_experts(frozen):
    moe = _moe(4, 2, hidden=16, ffn=8)
    x = _x((12, 16), seed=11)
    _no_near_ties(moe[0], x)

    def flops():
        y, loss = moe(x)
        with FlopCounterMode(display=False) as c:
            (y.sum() + loss).backward()
        return c.get_total_flops()

    full = flops()
    if frozen in ("router", "all"):
        moe[0].weight.requires_grad_(False)
    if frozen in ("experts", "all"):
        moe[2].weight.requires_grad_(False)
        moe[4].weight.requires_grad_(False)
    saved = {"router": 2 * 12 * 16 * 4, "experts": 2 * 24 * (16 * 16 + 8 * 16)}
    want = full - saved.get(frozen, saved["router"] + saved["experts"])
    assert flops() == want  # no weight-gradient GEMM for a frozen weight
    assert_matches_reference(moe, x)


def test_router_saves_no_input_when_frozen():
    moe = _moe(4, 2)
    x = _x((12, H), seed=11)
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
        moe(x)
    moe[0].weight.requires_grad_(False)
    frozen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: frozen.append(t.numel()) or t, lambda t: t):
        moe(x)
    assert sum(sizes) - sum(frozen) == x.numel()


@pytest.mark.parametrize("delayed", [False, True])
def test_main_grad_and_delayed_wgrad_on_router_and_experts(delayed):
    moe = _moe(4, 2)
    for i in (0, 2, 4):
        op = moe[i]
        op.accumulate_into_main_grad, op.delay_wgrad_compute = True, delayed
        op.weight.main_grad = torch.randn(op.weight.shape)
    x = _x((9, H), seed=12)
    _no_near_ties(moe[0], x)
    assert_matches_reference(moe, x)  # flushes delayed gradients, compares main_grad increments


def test_input_without_grad_and_inference():
    moe = _moe(4, 2)
    x = _x((9, H), seed=13).detach()
    _no_near_ties(moe[0], x)
    assert_matches_reference(moe, x)  # only parameter gradients
    with torch.no_grad():
        y, loss = moe(x)
        assert [r["rule"] for r in moe.fusion_plan()][2] == "grouped_mlp_forward"
    torch.testing.assert_close(y, moe(x)[0].detach())


# ------------------------------------------------------------------------------- plan and errors
def test_plan_fuses_dispatch_and_the_expert_mlp():
    moe = _moe(4, 2)
    moe(_x((5, H)))
    for pass_ in ("forward", "backward"):
        assert [(r["op"], r["rule"]) for r in moe.fusion_plan(pass_)] == [
            ("Router", None), ("DispatchGroupedMLP", "moe_dispatch_mlp"), ("Combine", None)]
    with fo.fusion_rules.disabled("moe_dispatch_mlp"):
        moe(_x((5, H)))
        assert [(r["op"], r["rule"]) for r in moe.fusion_plan()] == [
            ("Router", None), ("Dispatch", None), ("FusedGroupedMLP", "grouped_mlp"), ("Combine", None)]
    text = moe.explain()
    assert ("MoE routing (4 experts, top_k=2): Router [0] -> Dispatch [1] -> routed GroupedLinear [2] -> routed "
            "GroupedLinear [4] -> Combine [5]") in text


def test_no_split_sizes_are_taken():
    moe = _moe(4, 2)
    with pytest.raises(TypeError, match="expected 0 extra input"):
        moe(torch.randn(3, H), torch.tensor([1, 1, 1, 0]))


def _ops(experts=4):
    return dict(router=fo.Router(H, experts, 2), dispatch=fo.Dispatch(), combine=fo.Combine(),
                fc1=fo.GroupedLinear(experts, H, 2 * F, bias=False), act=fo.SwiGLU(),
                fc2=fo.GroupedLinear(experts, F, H, bias=False))


@pytest.mark.parametrize("names,match", [
    (["dispatch", "fc1", "act", "fc2", "combine"], r"Dispatch \(basic op 0 of the fuser\) has no Router before it"),
    (["router", "fc1", "act", "fc2", "combine"], r"Combine \(basic op 4 of the fuser\) has no Dispatch"),
    (["router", "dispatch", "fc1", "act", "fc2"], r"Router \(basic op 0 of the fuser\) has no Combine after it"),
    (["router"], r"Router \(basic op 0 of the fuser\) has no Dispatch and Combine after it"),
    (["router", "dispatch", "router", "combine"], r"Router \(basic op 2 of the fuser\) comes before the Combine"),
])
def test_misplaced_routing_ops_raise(names, match):
    ops = _ops()
    seq = fo.Sequential(*[ops[n] for n in names])
    with pytest.raises(RoutingError, match=match):
        seq(torch.randn(3, H))


def test_routed_grouped_linear_with_other_group_count_raises():
    ops = _ops()
    seq = fo.Sequential(ops["router"], ops["dispatch"], fo.GroupedLinear(3, H, H), ops["combine"])
    with pytest.raises(RoutingError, match=r"GroupedLinear \(basic op 2 of the fuser\) is routed by Router "
                                           r"\(basic op 0 of the fuser\) but has 3 groups for 4 experts"):
        seq(torch.randn(3, H))


def test_split_over_fusers_raises_naming_the_modules():
    ops = _ops()
    seq = fo.Sequential(ops["router"], ops["dispatch"], ops["fc1"], torch.nn.Identity(), ops["act"], ops["fc2"],
                        ops["combine"])
    with pytest.raises(RoutingError, match=r"modules \[0\] Router, \[1\] Dispatch, \[2\] GroupedLinear \(module \[3\] "
                                           r"Identity is not a fusible op\)"):
        seq(torch.randn(3, H))
    ops = _ops()
    seq = fo.Sequential(*[ops[n] for n in ("router", "dispatch", "fc1", "act", "fc2", "combine")])
    seq(torch.randn(3, H))
    handle = ops["fc1"].register_forward_hook(lambda *a: None)
    with pytest.raises(RoutingError, match=r"module \[2\] GroupedLinear has hooks"):
        seq(torch.randn(3, H))
    handle.remove()
    seq(torch.randn(3, H))  # fine again
    with pytest.raises(RoutingError, match="Router .* has no Dispatch and Combine"):
        ops["router"](torch.randn(3, H))


def test_rows_changed_between_router_and_dispatch_raise():
    ops = _ops()
    seq = fo.Sequential(ops["router"], fo.Reshape((-1, 2 * H)), fo.Dispatch(), fo.Combine())
    with pytest.raises(ValueError, match="Dispatch: the input has 2 rows but the Router routed 4 tokens"):
        seq(torch.randn(4, H))


# ------------------------------------------------------------------------------------ compile
@pytest.mark.skipif(not _have_cxx(), reason="inductor on CPU needs a C++ compiler")
def test_torch_compile_inductor_fullgraph_no_graph_breaks():
    x = _x((2, 5, H), seed=14)
    _assert_no_graph_breaks(_moe(4, 2, normalize=True), x)
    moe = _moe(4, 2, score="sigmoid", expert_bias=True)  # also: the expert_load buffer update
    _no_near_ties(moe[0], x)
    _assert_no_graph_breaks(moe, x)
    moe[0].expert_load.zero_()
    compiled = torch.compile(moe, fullgraph=True)
    results = []
    for module in (compiled, moe):
        moe.zero_grad(set_to_none=True)
        xx = x.detach().clone().requires_grad_()
        y, loss = module(xx)
        (y.square().sum() + loss).backward()
        results.append([y, loss, xx.grad] + [p.grad for p in moe.parameters()])
    torch._dynamo.reset()
    for a, b in zip(*results):  # inductor fuses reductions: fp32 rounding differs
        assert_close_scaled(a, b.double(), torch.float32)
    assert torch.equal(moe[0].expert_load, 2 * _counts(moe[0], x))  # one compiled and one eager call


def test_interpreter_runs_the_grouped_kernels_fp32():
    from fusible_ops.kernels import interpreter_enabled

    if not interpreter_enabled():
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest without a GPU)")
    moe = _moe(3, 2)
    x = _x((5, H), seed=15)
    _no_near_ties(moe[0], x)
    with fo.kernels.use("triton"):
        assert_matches_reference(moe, x)


# ---------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_gpu_odd_sizes_bf16(score, monkeypatch):
    from fusible_ops.kernels import launch

    monkeypatch.setattr(launch, "AUTOTUNE", False)
    moe = _moe(7, 3, score=score, normalize=score == "sigmoid", hidden=72, ffn=40, dtype=torch.bfloat16,
               device="cuda")
    with torch.no_grad():
        for i in (0, 2, 4):
            moe[i].weight.mul_(0.2)
    x = _x((3, 67, 72), seed=16, dtype=torch.bfloat16, device="cuda")
    _no_near_ties(moe[0], x)
    assert (_counts(moe[0], x) > 0).all()
    assert_matches_reference(moe, x)


@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph_bf16_matches_eager():
    """The bf16 layer on CUDA (tensor-core router GEMMs with float32 logits, the gather-sum
    kernels, the fused expert MLP) compiles with no graph break and matches eager."""
    moe = _moe(8, 2, normalize=True, hidden=64, ffn=48, dtype=torch.bfloat16, device="cuda")
    x = _x((2, 50, 64), seed=17, dtype=torch.bfloat16, device="cuda")
    _no_near_ties(moe[0], x)
    _assert_no_graph_breaks(moe, x.clone().requires_grad_())
    results = []
    for module in (torch.compile(moe, fullgraph=True), moe):
        moe.zero_grad(set_to_none=True)
        xx = x.detach().clone().requires_grad_()
        y, loss = module(xx)
        (y.float().square().sum() + loss).backward()
        results.append([y, loss, xx.grad] + [p.grad for p in moe.parameters()])
    torch._dynamo.reset()
    for a, b in zip(*results):
        assert_close_scaled(a, b.double(), torch.bfloat16)


@pytest.mark.gpu
def test_gpu_graph_replay_with_new_routing_each_replay():
    moe = _moe(8, 2, hidden=64, ffn=48, dtype=torch.bfloat16, device="cuda")
    eager = copy.deepcopy(moe)
    x = torch.randn(200, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = fo.make_graphed_callables(moe, (x,))
    gy = torch.randn(200, 64, device="cuda", dtype=torch.bfloat16)
    seen = []
    for step in range(3):
        with torch.no_grad():
            x.copy_(torch.randn(200, 64, generator=torch.Generator().manual_seed(20 + step)).to(x))
            if step == 2:
                x[:, :] = x.abs()  # very different routing
        x.grad = None
        for m in (moe, eager):
            m.zero_grad(set_to_none=False)
        y, loss = graphed(x)
        torch.autograd.backward([y, loss], [gy, torch.ones_like(loss)])
        torch.cuda.synchronize()
        xe = x.detach().clone().requires_grad_()
        ye, le = eager(xe)
        torch.autograd.backward([ye, le], [gy, torch.ones_like(le)])
        counts = _counts(eager[0], x)
        seen.append(counts.tolist())
        assert torch.equal(y, ye) and torch.equal(loss, le), f"replay {step}"
        assert_close_scaled(x.grad, xe.grad, torch.bfloat16, f"dx {step}")
        for (name, p), q in zip(moe.named_parameters(), eager.parameters()):
            assert_close_scaled(p.grad, q.grad, torch.bfloat16, f"grad {name} {step}")
    assert len({tuple(c) for c in seen}) == 3  # each replay routed differently


@pytest.mark.gpu
@pytest.mark.parametrize("delayed", [False, True])
def test_gpu_graph_replay_main_grad_and_delayed_wgrad(delayed):
    # as in a fresh process: no kernel tuned yet. The delayed weight-gradient kernels then tune in
    # make_graphed_callables' warm-up, never inside the capture of backward_dw.
    from fusible_ops.kernels.launch import forget_tuning

    forget_tuning()
    moe = _moe(8, 2, hidden=64, ffn=48, dtype=torch.bfloat16, device="cuda")
    eager = copy.deepcopy(moe)
    for i in (0, 2, 4):
        op = moe[i]
        op.accumulate_into_main_grad, op.delay_wgrad_compute = True, delayed
        op.weight.main_grad = torch.zeros(op.weight.shape, device="cuda", dtype=torch.float32)
    x = torch.randn(200, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = fo.make_graphed_callables(moe, (x,))
    gy = torch.randn(200, 64, device="cuda", dtype=torch.bfloat16)
    total = [torch.zeros(eager[i].weight.shape, device="cuda", dtype=torch.float64) for i in (0, 2, 4)]
    for step in range(3):
        with torch.no_grad():
            x.copy_(torch.randn(200, 64, generator=torch.Generator().manual_seed(30 + step)).to(x))
        y, loss = graphed(x)
        torch.autograd.backward([y, loss], [gy, torch.ones_like(loss)])
        if delayed:
            assert all(moe[i].has_pending_wgrad() for i in (0, 2, 4))
            moe.backward_dw()
        eager.zero_grad(set_to_none=True)
        ye, le = eager(x.detach())
        torch.autograd.backward([ye, le], [gy, torch.ones_like(le)])
        assert torch.equal(y, ye), f"replay {step}"
        total = [t + eager[i].weight.grad.double() for t, i in zip(total, (0, 2, 4))]
    torch.cuda.synchronize()
    for t, i in zip(total, (0, 2, 4)):
        assert moe[i].weight.grad is None
        assert_close_scaled(moe[i].weight.main_grad, t, torch.bfloat16, f"main_grad of op {i}")


def _saved_shapes(moe, x):
    """Shapes of every tensor autograd keeps for backward during one forward; a tensor of token
    copies (every row a row of ``x``: the gathered copy) is recorded as ``("copies", shape)``."""
    shapes = []
    rows = x.detach().reshape(-1, x.shape[-1])

    def pack(t):
        gathered = (t.dim() == 2 and t.shape[0] > rows.shape[0] and t.shape[1] == rows.shape[1]
                    and bool((t.detach()[:, None, :] == rows[None]).all(-1).any(-1).all()))
        shapes.append(("copies", tuple(t.shape)) if gathered else tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, aux = moe(x)
    return shapes, y, aux
