"""Core framework: fuser, rules, plans, Sequential container, bad input."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import Phase, given, settings, strategies as st

import fusible_ops as fo
from fusible_ops.rules import MATCH_STATS
from fusible_ops.testing import assert_close, assert_matches_reference
from fusible_ops.testing.strategies import chains, dtypes, leading_shapes


# --------------------------------------------------------------------------- property tests
@given(chain=chains(), dtype=dtypes(), lead=leading_shapes(), seed=st.integers(0, 2**16))
def test_random_chains_match_unfused_reference(chain, dtype, lead, seed):
    seq = chain.build(dtype=dtype, seed=seed)
    assert_matches_reference(seq, *chain.inputs(lead, dtype=dtype, seed=seed))


@given(chain=chains(allow_extra=False), lead=leading_shapes())
def test_random_chains_input_without_grad(chain, lead):
    seq = chain.build()
    assert_matches_reference(seq, *chain.inputs(lead, x_requires_grad=False))


# torch.compile (aot_eager, fullgraph=True) of random chains of every built-in op against eager.
def _outputs_and_grads(module, params, inputs, seed):
    ins = [t.detach().clone().requires_grad_(t.requires_grad) if t.is_floating_point() else t for t in inputs]
    for p in params:
        p.grad = None
    torch.manual_seed(seed)  # dropout draws the same seeds in the compiled and the eager run
    out = module(*ins)
    outs = list(out) if isinstance(out, tuple) else [out]
    diff = [o for o in outs if o.requires_grad]
    g = torch.Generator().manual_seed(7)
    if diff:
        torch.autograd.backward(diff, [torch.randn(o.shape, generator=g).to(o.dtype) for o in diff])
    grads = [t.grad for t in ins if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    grads += [p.grad for p in params if p.requires_grad]
    return [o.detach() for o in outs], [None if t is None else t.detach().clone() for t in grads]


def _assert_compiled_matches_eager(seq, inputs, dtype):
    torch._dynamo.reset()  # every example is a new module: no recompile limit, no stale guards
    params = list(seq.parameters())
    compiled = torch.compile(seq, backend="aot_eager", fullgraph=True)
    outs_c, grads_c = _outputs_and_grads(compiled, params, inputs, seed=11)
    outs_e, grads_e = _outputs_and_grads(seq, params, inputs, seed=11)
    assert len(outs_c) == len(outs_e) and len(grads_c) == len(grads_e)
    for i, (a, b) in enumerate(zip(outs_c + grads_c, outs_e + grads_e)):
        assert (a is None) == (b is None), f"tensor {i}: gradient missing in one run"
        if a is not None:
            assert_close(a, b, dtype, msg=f"compiled vs eager, tensor {i}")


@settings(max_examples=8, phases=[Phase.explicit, Phase.reuse, Phase.generate])  # no shrinking: compiles are slow
@given(chain=chains(max_len=4), dtype=dtypes(), lead=leading_shapes(), seed=st.integers(0, 2**16))
def test_random_chains_compile_fullgraph_matches_eager(chain, dtype, lead, seed):
    seq = chain.build(dtype=dtype, seed=seed)
    _assert_compiled_matches_eager(seq, chain.inputs(lead, dtype=dtype, seed=seed), dtype)


def test_odd_shape_3x5_all_activations():
    for act in [fo.ReLU(), fo.GELU(), fo.GELU("tanh"), fo.SiLU()]:
        seq = fo.Sequential(fo.Linear(5, 5), act, fo.Linear(5, 3))
        assert_matches_reference(seq, torch.randn(3, 5, requires_grad=True))
    for act in [fo.SwiGLU(), fo.GEGLU(), fo.GEGLU("tanh"), fo.ReGLU()]:
        seq = fo.Sequential(fo.Linear(5, 6), act, fo.Linear(3, 5))
        assert_matches_reference(seq, torch.randn(3, 5, requires_grad=True))


ALL_BASIC = [
    lambda: (fo.BasicLinear(5, 3), ()),
    lambda: (fo.Bias(5), ()),
    lambda: (fo.ReLU(), ()),
    lambda: (fo.GELU(), ()),
    lambda: (fo.GELU("tanh"), ()),
    lambda: (fo.SiLU(), ()),
    lambda: (fo.ConstantScale(1.5), ()),
    lambda: (fo.LayerNorm(5), ()),
    lambda: (fo.RMSNorm(5), ()),
    lambda: (fo.Identity(), ()),
    lambda: (fo.AddExtraInput(), (torch.randn(3, 5, dtype=torch.float64, requires_grad=True),)),
]


@pytest.mark.parametrize("make", ALL_BASIC)
def test_basic_op_math_matches_plain_torch(make):
    """Each op's own forward/backward against its plain-PyTorch ``reference_forward`` (float64)."""
    op, extras = make()
    op = op.to(torch.float64)
    with torch.no_grad():
        for p in op.parameters():
            p.uniform_(-1, 1)
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    y = op(x, *extras)
    x2 = x.detach().clone().requires_grad_()
    ex2 = [e.detach().clone().requires_grad_() for e in extras]
    y_ref = op.reference_forward(x2, *ex2)
    torch.testing.assert_close(y, y_ref)
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, *extras, *op.parameters()], g)
    grads_ref = torch.autograd.grad(y_ref, [x2, *ex2, *op.parameters()], g)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("op", [fo.SwiGLU(), fo.GEGLU(), fo.GEGLU("tanh"), fo.ReGLU()])
def test_gated_first_half_is_activated(op):
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(op(x), op.reference_forward(x))
    a, b = x.detach().chunk(2, -1)
    act = {"swiglu": torch.nn.functional.silu, "reglu": torch.relu}.get(op.kind, None)
    if act is not None:
        torch.testing.assert_close(op(x), act(a) * b)


def test_scaled_swiglu_and_grouped_linear_match_plain_torch():
    x = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)
    s = torch.rand(7, dtype=torch.float64, requires_grad=True)
    op = fo.ScaledSwiGLU()
    y = op(x, s)
    ref = op.reference_forward(x, s)
    torch.testing.assert_close(y, ref)
    g = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, [x, s], g), torch.autograd.grad(ref, [x, s], g)):
        torch.testing.assert_close(a, b)
    gl = fo.GroupedLinear(3, 6, 4, dtype=torch.float64)
    splits = torch.tensor([3, 0, 4])
    y = gl(x, splits)
    ref = gl.reference_forward(x, splits)
    torch.testing.assert_close(y, ref)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, gl.weight, gl.bias], g)
    exp = torch.autograd.grad(ref, [x, gl.weight, gl.bias], g)
    for a, b in zip(got, exp):
        torch.testing.assert_close(a, b)
    assert got[1][1].abs().sum() == 0  # empty group: zero weight gradient


# --------------------------------------------------------------------------- rules and plans
def _rules(plan):
    return [row["rule"] for row in plan]


def test_builtin_rules_fire():
    seq = fo.Sequential(fo.Linear(8, 16), fo.GELU(), fo.Linear(16, 8))
    fwd = seq.fusion_plan("forward")
    bwd = seq.fusion_plan("backward")
    assert fwd[0] == {"rule": "linear_bias_activation", "op": "ForwardLinearBiasActivation", "indices": (0, 1, 2)}
    assert fwd[1]["rule"] == "linear_bias" and fwd[1]["indices"] == (3, 4)
    assert {"rule": "activation_bias_backward", "op": "BackwardBiasActivation", "indices": (1, 2)} in bwd
    assert_matches_reference(seq, torch.randn(5, 8, requires_grad=True))


def test_residual_norm_rule_fires():
    seq = fo.Sequential(fo.AddExtraInput(), fo.LayerNorm(6))
    assert _rules(seq.fusion_plan()) == ["residual_norm"]
    assert _rules(seq.fusion_plan("backward")) == ["residual_norm_backward"]
    assert_matches_reference(seq, torch.randn(3, 6, requires_grad=True), torch.randn(3, 6, requires_grad=True))


def test_same_tensor_passed_twice_gets_both_gradients():
    """Eager calls hand a tensor passed twice (x as its own residual, one weight tied into two
    linears) to autograd twice, with no alias: both positions' gradients reach it, as with plain
    torch."""
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64)
    seq = fo.Sequential(fo.AddExtraInput(), fo.RMSNorm(6, dtype=torch.float64))
    with torch.no_grad():
        seq[1].weight.copy_(w)
    dy = torch.randn(3, 6, dtype=torch.float64)
    seq(x, x).backward(dy)
    xr = x.detach().clone().requires_grad_()
    wr = w.clone().requires_grad_()
    F.rms_norm(xr + xr, (6,), wr, seq[1].eps).backward(dy)
    assert _rules(seq.fusion_plan("forward", x, x)) == ["residual_norm"]
    assert_close(x.grad, xr.grad, torch.float64)
    assert_close(seq[1].weight.grad, wr.grad, torch.float64)

    tied = fo.Sequential(fo.BasicLinear(4, 4, dtype=torch.float64), fo.BasicLinear(4, 4, dtype=torch.float64))
    tied[1].weight = tied[0].weight  # one parameter, two ops
    xt = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    tied(xt).sum().backward()
    wt = tied[0].weight.detach().clone().requires_grad_()
    xp = xt.detach().clone().requires_grad_()
    (xp @ wt.t() @ wt.t()).sum().backward()
    assert_close(tied[0].weight.grad, wt.grad, torch.float64)
    assert_close(xt.grad, xp.grad, torch.float64)


def test_explain_shows_declines():
    seq = fo.Sequential(fo.Linear(4, 4), fo.ReLU(), fo.Dropout(0.5))
    assert "linear_bias_activation_dropout" in _rules(seq.fusion_plan())
    seq.eval()
    text = seq.explain()
    assert "rule 'linear_bias_activation_dropout' (forward) on ops [0, 1, 2, 3]: dropout is inactive" in text
    assert _rules(seq.fusion_plan())[0] == "linear_bias_activation"


class Doubler(fo.BasicOperation):
    def op_forward(self, ctx, x, **kwargs):
        return 2 * x

    def op_backward(self, ctx, dy):
        return 2 * dy, ()

    def reference_forward(self, x):
        return 2 * x


class FusedDoubleDouble(fo.FusedOperation):
    def __init__(self, ops, factor=4):
        super().__init__(ops)
        self.factor = factor

    def fuser_forward(self, ctxs, x, *, extra_inputs, **kwargs):
        return self.factor * x, [(), ()]

    def fuser_backward(self, ctxs, dy, *, grad_extra_outputs, **kwargs):
        return self.factor * dy, [(), ()], [(), ()]


def test_user_rule_scoped_to_its_ruleset():
    rs = fo.RuleSet.builtin()
    rs.register("double_double", [Doubler, Doubler], pass_="joint", build=FusedDoubleDouble)
    scoped = fo.Sequential(Doubler(), Doubler(), rules=rs)
    plain = fo.Sequential(Doubler(), Doubler())
    assert _rules(scoped.fusion_plan()) == ["double_double"]
    assert _rules(scoped.fusion_plan("backward")) == ["double_double"]
    assert _rules(plain.fusion_plan()) == [None, None]
    x = torch.randn(3, 5, requires_grad=True)
    assert_matches_reference(scoped, x)
    assert "double_double" not in fo.RuleSet.builtin()


def test_assert_matches_reference_catches_a_wrong_fusion():
    rs = fo.RuleSet()
    rs.register("bad", [Doubler, Doubler], pass_="joint", build=lambda ops: FusedDoubleDouble(ops, factor=3))
    with pytest.raises(AssertionError, match="output 0"):
        assert_matches_reference(fo.Sequential(Doubler(), Doubler(), rules=rs), torch.randn(3, 5, requires_grad=True))


def test_global_registration_decorator_and_disabled():
    @fo.register_fusion("test_global_double", [Doubler, fo.match(Doubler, where=lambda op: True)], pass_="forward")
    class FwdOnly(FusedDoubleDouble):
        pass

    try:
        seq = fo.Sequential(Doubler(), Doubler())
        assert _rules(seq.fusion_plan()) == ["test_global_double"]
        assert _rules(seq.fusion_plan("backward")) == [None, None]
        with fo.fusion_rules.disabled("test_global_double"):
            assert _rules(seq.fusion_plan()) == [None, None]
        assert _rules(seq.fusion_plan()) == ["test_global_double"]
        assert_matches_reference(seq, torch.randn(2, 3, requires_grad=True))
    finally:
        fo.rules.global_rules().unregister("test_global_double")


def test_checker_decline_reason_and_priority():
    rs = fo.RuleSet()
    rs.register("never", [Doubler, Doubler], pass_="forward", build=FusedDoubleDouble,
                check=lambda ops, ctx: f"no thanks for {ctx.dtype}")
    rs.register("low", [Doubler, Doubler], pass_="forward", build=FusedDoubleDouble, priority=-1)
    seq = fo.Sequential(Doubler(), Doubler(), rules=rs)
    assert _rules(seq.fusion_plan()) == ["low"]
    assert "rule 'never' (forward) on ops [0, 1]: no thanks for torch.float32" in seq.explain(torch.randn(2, 2))


def test_plan_that_does_not_expand_raises():
    rs = fo.RuleSet()
    other = Doubler()
    rs.register("broken", [Doubler, Doubler], pass_="forward", build=lambda ops: FusedDoubleDouble([ops[0], other]))
    seq = fo.Sequential(Doubler(), Doubler(), rules=rs)
    with pytest.raises(RuntimeError, match="does not expand to the basic ops"):
        seq(torch.randn(2, 2))


def test_plan_cached_and_remade_when_requires_grad_flips():
    seq = fo.Sequential(fo.Linear(4, 4), fo.GELU())
    x = torch.randn(3, 4, requires_grad=True)
    seq(x).sum().backward()
    fuser = seq._get_stages()[0][0]
    made, calls = fuser.num_plans_made, MATCH_STATS["calls"]
    for _ in range(3):
        seq(x).sum().backward()
    assert fuser.num_plans_made == made and MATCH_STATS["calls"] == calls  # steady state: no matching
    seq[0].weight.requires_grad_(False)
    seq(x).sum().backward()
    assert fuser.num_plans_made == made + 1
    with torch.no_grad():
        seq(x)
    assert fuser.num_plans_made == made + 2


def test_no_grad_mode_runs_forward_only():
    seq = fo.Sequential(fo.Linear(4, 4), fo.GELU())
    with torch.no_grad():
        y = seq(torch.randn(2, 4, requires_grad=True))
    assert not y.requires_grad
    assert seq.fusion_plan("backward") != []


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "nothing_requires_grad"])
def test_calls_without_gradients_skip_the_autograd_function(monkeypatch, mode):
    """With no gradient anywhere the fuser runs the plan's forward steps without its autograd
    function (no node to build): same outputs, bit for bit, as a call with gradients, extra
    outputs in order, and the fused forward plan still runs."""
    import contextlib

    from fusible_ops import fuser as fuser_mod

    torch.manual_seed(0)
    seq = fo.Sequential(fo.Linear(6, 6), fo.MakeExtraOutput(), fo.AddExtraInput(), fo.RMSNorm(6), fo.GELU())
    x, r = torch.randn(3, 6), torch.randn(3, 6)
    want = seq(x.requires_grad_(True), r)  # with gradients: through the autograd function
    x = x.detach()
    if mode == "nothing_requires_grad":
        for p in seq.parameters():
            p.requires_grad_(False)

    def no_function(*args):
        raise AssertionError("the autograd function ran for a call without gradients")

    monkeypatch.setattr(fuser_mod, "_RAW_APPLY", no_function)
    ctx = {"no_grad": torch.no_grad(), "inference_mode": torch.inference_mode()}.get(mode, contextlib.nullcontext())
    with ctx:
        got = seq(x, r)
    assert isinstance(got, tuple) and len(got) == 2
    for g, w in zip(got, want):
        assert not g.requires_grad and g.grad_fn is None
        assert torch.equal(g, w.detach())
    assert "residual_norm" in [g["rule"] for g in seq.fusion_plan("forward")]


def test_forward_mode_ad_raises_with_and_without_grad():
    """Forward-mode AD has no jvp through the fuser: a call with dual inputs raises, also under
    no_grad (where the fuser otherwise skips its autograd function: the kernels would drop the
    tangents silently)."""
    import torch.autograd.forward_ad as fwAD

    seq = fo.Sequential(fo.Linear(4, 4), fo.GELU())
    for grad in (True, False):
        with fwAD.dual_level(), torch.set_grad_enabled(grad):
            with pytest.raises(NotImplementedError, match="jvp"):
                seq(fwAD.make_dual(torch.randn(2, 4), torch.randn(2, 4)))


def test_extra_inputs_and_outputs_order():
    seq = fo.Sequential(fo.GroupedLinear(2, 4, 4), fo.MakeExtraOutput(), fo.AddExtraInput(), fo.Linear(4, 4))
    x, r = torch.randn(5, 4), torch.randn(5, 4)
    y, extra = seq(x, torch.tensor([2, 3]), r)
    torch.testing.assert_close(extra, seq[0](x, torch.tensor([2, 3])))
    torch.testing.assert_close(y, seq[3](extra + r))


# --------------------------------------------------------------------------- container
def test_sequential_container_protocol_and_state_dict():
    ref = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    seq = fo.Sequential(fo.Linear(3, 4), fo.ReLU(), fo.Linear(4, 2))
    assert list(seq.state_dict()) == list(ref.state_dict())
    seq.load_state_dict(ref.state_dict())
    x = torch.randn(5, 3)
    torch.testing.assert_close(seq(x), ref(x))
    assert len(seq) == 3 and isinstance(seq[1], fo.ReLU) and len(seq[1:]) == 2
    assert [type(m).__name__ for m in seq] == ["Linear", "ReLU", "Linear"]
    seq.append(fo.Identity()).extend([fo.ConstantScale(2.0)]).insert(0, fo.Identity())
    assert [type(m).__name__ for m in seq] == ["Identity", "Linear", "ReLU", "Linear", "Identity", "ConstantScale"]
    torch.testing.assert_close(seq(x), 2 * ref(x))
    del seq[0]
    assert list(seq.state_dict())[0] == "0.weight"


@pytest.mark.parametrize("how", ["setattr", "add_module", "register_module", "delattr"])
def test_sequential_replans_when_a_module_is_swapped_without_setitem(how):
    """Swapping a module through torch.nn.Module's own API (not ``seq[i] = m``) is seen by the
    next call: no stale fusion stages, no silently wrong result."""
    seq = fo.Sequential(fo.GELU(), fo.ReLU())
    x = torch.randn(4, 8)
    seq(x)
    if how == "setattr":
        setattr(seq, "1", fo.SiLU())
    elif how == "delattr":
        delattr(seq, "1")
    else:
        getattr(seq, how)("1", fo.SiLU())
    want = F.gelu(x) if how == "delattr" else F.silu(F.gelu(x))
    torch.testing.assert_close(seq(x), want)
    assert [r["op"] for r in seq.fusion_plan()] == (["GELU"] if how == "delattr" else ["GELU", "SiLU"])


def test_linear_init_matches_torch_linear():
    torch.manual_seed(0)
    ref = torch.nn.Linear(7, 5)
    torch.manual_seed(0)
    lin = fo.Linear(7, 5)
    torch.testing.assert_close(lin.weight, ref.weight)
    torch.testing.assert_close(lin.bias, ref.bias)
    assert lin.weight is lin.basic_ops[0].weight and lin.bias is lin.basic_ops[1].bias
    assert list(lin.state_dict()) == ["weight", "bias"]
    lin_nb = fo.Linear(7, 5, bias=False)
    assert lin_nb.bias is None and list(lin_nb.state_dict()) == ["weight"]


def test_non_fusible_module_runs_between_fusers():
    seq = fo.Sequential(fo.Linear(4, 4), torch.nn.Tanh(), fo.Linear(4, 4), fo.GELU())
    assert len([s for s, _ in seq._get_stages() if isinstance(s, fo.OperationFuser)]) == 2
    assert_matches_reference(seq, torch.randn(3, 4, requires_grad=True))


# --------------------------------------------------------------------------- bad input
def test_bad_inputs_raise_clear_errors():
    lin = fo.Linear(4, 3)
    with pytest.raises(ValueError, match="last dim must be 4"):
        lin(torch.randn(2, 5))
    with pytest.raises(TypeError, match="does not match parameter dtype"):
        lin(torch.randn(2, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="is on meta"):
        lin(torch.randn(2, 4, device="meta"))
    with pytest.raises(RuntimeError, match="parameters are on meta"):  # (both off CUDA: compared as devices)
        fo.Linear(4, 3, device="meta")(torch.randn(2, 4))
    with pytest.raises(RuntimeError, match="extra input is on meta"):
        fo.Sequential(fo.AddExtraInput(), fo.RMSNorm(4))(torch.randn(2, 4), torch.randn(2, 4, device="meta"))
    with pytest.raises(TypeError, match="floating-point"):
        lin(torch.ones(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="last dim must be even"):
        fo.SwiGLU()(torch.randn(2, 5))
    with pytest.raises(TypeError, match="does not match input dtype"):
        fo.AddExtraInput()(torch.randn(2, 3), torch.randn(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="does not match input shape"):
        fo.AddExtraInput()(torch.randn(2, 3), torch.randn(3, 3))
    with pytest.raises(TypeError, match="extra input"):
        fo.Sequential(fo.AddExtraInput())(torch.randn(2, 3))


@pytest.mark.parametrize(
    "splits, err, msg",
    [
        (torch.tensor([2, 3]), ValueError, r"shape \[3\]"),
        (torch.tensor([2, -1, 4]), ValueError, "non-negative"),
        (torch.tensor([2, 2, 2]), ValueError, "sum to 6 but the input has 5 rows"),
        (torch.tensor([2.0, 1.0, 2.0]), TypeError, "integer"),
        ([2, 1, 2], TypeError, "1-D int64 tensor"),
    ],
)
def test_bad_split_sizes(splits, err, msg):
    gl = fo.GroupedLinear(3, 4, 2)
    with pytest.raises(err, match=msg):
        gl(torch.randn(5, 4), splits)


def test_empty_groups_and_zero_rows():
    gl = fo.GroupedLinear(3, 4, 2)
    x = torch.randn(0, 4, requires_grad=True)
    y = gl(x, torch.zeros(3, dtype=torch.int64))
    assert y.shape == (0, 2)
    y.sum().backward()
    assert gl.weight.grad.abs().sum() == 0


def test_linear_bias_activation_bad_bias_raises_clear_errors():
    """The fused linear + bias (+ activation) forward checks the bias on every path (CPU under
    PyTorch's autograd, inference, and the ops' own backward)."""
    for act in ([fo.GELU()], []):
        seq = fo.Sequential(fo.Linear(4, 3), *act)
        seq[0].bias.data = seq[0].bias.data.double()
        for grad in (True, False):
            with torch.set_grad_enabled(grad), pytest.raises(TypeError, match="Bias: input dtype"):
                seq(torch.randn(2, 4))
        seq[0].bias = torch.nn.Parameter(torch.zeros(3, device="meta"))
        with pytest.raises(RuntimeError, match="parameters are on meta"):
            seq(torch.randn(2, 4))


def test_kernel_mode_is_per_thread_and_restored():
    """``kernels.use`` / ``set_mode`` set this thread's mode only; a thread that never set one (its
    first read included) sees the environment's; leaving ``use`` restores the previous one."""
    import threading

    from fusible_ops import kernels

    base = kernels.current_mode()
    seen = []
    with kernels.use("reference"):
        assert kernels.current_mode() == "reference"
        t = threading.Thread(target=lambda: seen.append(kernels.current_mode()))
        t.start()
        t.join()
        previous = kernels.set_mode("triton")
        assert previous == "reference" and kernels.current_mode() == "triton"
        kernels.set_mode(previous)
    assert seen == [base] and kernels.current_mode() == base
