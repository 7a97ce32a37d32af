"""User-facing module protocol: plan staleness, torch utilities (functional_call,
parametrizations, hooks), data-parallel guards, rule-name and builder errors, ScaledSwiGLU
shapes, reprs and docstrings. Each test failed before its fix (issue 8)."""

import os
import tempfile

import pytest
import torch
from torch.func import functional_call
from torch.nn.utils.parametrizations import weight_norm

import fusible_ops as fo
from fusible_ops.testing import assert_matches_reference


def _rules(plan):
    return [row["rule"] for row in plan]


class AddOne(fo.BasicOperation):
    def op_forward(self, ctx, x, **kwargs):
        return x + 1

    def op_backward(self, ctx, dy):
        return dy, ()

    def reference_forward(self, x):
        return x + 1


class Double(fo.BasicOperation):
    def __init__(self):
        super().__init__()
        self.flag = True
        self.options = {"fuse": True}

    def op_forward(self, ctx, x, **kwargs):
        return 2 * x

    def op_backward(self, ctx, dy):
        return 2 * dy, ()

    def reference_forward(self, x):
        return 2 * x

    def plan_key(self):
        return (self.options["fuse"],)


class MarkedFused(fo.FusedOperation):
    """(x + 1) * 2, plus 1000 so a test can tell that the fused op ran."""

    def fuser_forward(self, ctxs, x, *, extra_inputs, **kwargs):
        return (x + 1) * 2 + 1000, [(), ()]


# ------------------------------------------------------------------ 1. stale plans
def test_plan_follows_op_state_read_by_a_rule_predicate():
    rs = fo.RuleSet()
    rs.register("marked", [AddOne, fo.match(Double, where=lambda op: op.flag)], pass_="forward", build=MarkedFused)
    seq = fo.Sequential(AddOne(), Double(), rules=rs)
    x = torch.zeros(1)
    assert seq(x).item() == 1002 and _rules(seq.fusion_plan()) == ["marked"]
    seq[1].flag = False  # the predicate now declines: execution and report must both follow
    assert seq(x).item() == 2
    assert _rules(seq.fusion_plan()) == [None, None]
    assert "marked" not in seq.explain().split("declined")[0]
    seq[1].flag = True
    assert seq(x).item() == 1002 and _rules(seq.fusion_plan()) == ["marked"]


def test_plan_follows_state_reported_by_plan_key_and_checker():
    rs = fo.RuleSet()
    rs.register("marked", [AddOne, Double], pass_="forward", build=MarkedFused,
                check=lambda ops, ctx: None if ops[1].options["fuse"] else "option off")
    seq = fo.Sequential(AddOne(), Double(), rules=rs)
    x = torch.zeros(1)
    assert seq(x).item() == 1002
    seq[1].options["fuse"] = False  # a mutation, not an assignment: covered by plan_key()
    assert seq(x).item() == 2
    assert "option off" in seq.explain()


def test_fusion_plan_reports_the_plan_of_the_last_call():
    """A call without grad gets the forward-only plan; fusion_plan() says so afterwards."""
    seq = fo.Sequential(fo.Linear(4, 4), fo.GELU(), fo.Dropout(0.5))
    seq.eval()
    seq(torch.randn(2, 4))
    assert _rules(seq.fusion_plan())[0] == "linear_bias_activation"
    seq.train()
    seq(torch.randn(2, 4))
    assert _rules(seq.fusion_plan())[0] == "linear_bias_activation_dropout"


def test_steady_state_state_flag_costs_no_replanning():
    seq = fo.Sequential(AddOne(), Double())
    x = torch.zeros(1)
    seq(x)
    fuser = seq._get_stages()[0][0]
    made = fuser.num_plans_made
    for _ in range(5):
        seq(x)
    assert fuser.num_plans_made == made


# ------------------------------------------------------------------ 3. torch utilities
def test_functional_call_on_linear_uses_the_substituted_parameters():
    lin = fo.Linear(4, 3)
    x = torch.randn(2, 4)
    y = functional_call(lin, {"weight": torch.zeros(3, 4), "bias": torch.zeros(3)}, (x,))
    assert y.abs().max() == 0
    seq = fo.Sequential(fo.Linear(4, 3), fo.GELU(), fo.Linear(3, 2))
    w = torch.randn(3, 4, requires_grad=True)
    y = functional_call(seq, {"0.weight": w}, (x,))
    ref = seq[2](torch.nn.functional.gelu(torch.nn.functional.linear(x, w, seq[0].bias)))
    torch.testing.assert_close(y, ref)
    (gw,) = torch.autograd.grad(y.sum(), [w])
    (gw_ref,) = torch.autograd.grad(ref.sum(), [w])
    torch.testing.assert_close(gw, gw_ref)
    assert seq[0].weight.grad is None  # the module's own weight was not used


def test_parametrized_linear_is_honoured_with_gradients():
    torch.manual_seed(0)
    lin = weight_norm(fo.Linear(4, 3), "weight")
    with torch.no_grad():
        lin.parametrizations.weight.original0.mul_(3.0)  # norm != 1: the parametrization matters
    x = torch.randn(5, 4, requires_grad=True)
    seq = fo.Sequential(lin, fo.ReLU())
    y = seq(x)
    g0, g1 = lin.parametrizations.weight.original0, lin.parametrizations.weight.original1
    ref = torch.relu(torch.nn.functional.linear(x, lin.weight, lin.bias))
    torch.testing.assert_close(y, ref)
    grads = torch.autograd.grad(y.sum(), [x, g0, g1, lin.bias])
    grads_ref = torch.autograd.grad(ref.sum(), [x, g0, g1, lin.bias])
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b)


def test_parametrized_weight_with_main_grad_is_refused():
    lin = weight_norm(fo.Linear(4, 3, accumulate_into_main_grad=True), "weight")
    with pytest.raises(RuntimeError, match="need leaf weights"):
        lin(torch.randn(2, 4))


def test_forward_hooks_on_a_fusible_op_inside_sequential_run():
    seq = fo.Sequential(fo.Linear(4, 4), fo.GELU(), fo.Linear(4, 4))
    seen = []
    handle = seq[1].register_forward_hook(lambda m, args, out: seen.append((args[0].shape, out.shape)))
    pre = seq[0].register_forward_pre_hook(lambda m, args: (args[0] * 0,))  # a hook may change inputs
    y = seq(torch.randn(2, 4))
    assert seen == [(torch.Size([2, 4]), torch.Size([2, 4]))]
    torch.testing.assert_close(y, seq[2](torch.nn.functional.gelu(seq[0].bias.expand(2, 4))))
    assert "has hooks: runs on its own" in seq.explain()
    handle.remove()
    pre.remove()
    seq(torch.randn(2, 4))
    assert _rules(seq.fusion_plan())[0] == "linear_bias_activation"  # fused again without hooks


def test_hooks_added_after_calls_run():
    """Sequential's one-fuser fast path notices hooks registered after it was built (on a module,
    and global module hooks) and runs them; removing them fuses again."""
    seq = fo.Sequential(fo.Linear(4, 4), fo.GELU(), fo.Linear(4, 4))
    seq(torch.randn(2, 4))
    seq(torch.randn(2, 4))  # (built, the fast path set)
    seen = []
    handle = seq[1].register_forward_hook(lambda m, args, out: seen.append("module"))
    seq(torch.randn(2, 4))
    assert seen == ["module"]
    handle.remove()
    glob = torch.nn.modules.module.register_module_forward_hook(lambda m, args, out: seen.append(type(m).__name__))
    try:
        seq(torch.randn(2, 4))
    finally:
        glob.remove()
    assert "GELU" in seen[1:] and "Sequential" in seen[1:]
    seen.clear()
    seq(torch.randn(2, 4))
    assert seen == []
    assert _rules(seq.fusion_plan())[0] == "linear_bias_activation"


def test_repr_and_docstrings():
    assert repr(fo.Linear(4, 3)) == "Linear(in_features=4, out_features=3, bias=True)"
    assert "bias=False" in repr(fo.Linear(4, 3, bias=False))
    for cls in [fo.ReLU, fo.GELU, fo.SiLU, fo.SwiGLU, fo.GEGLU, fo.ReGLU, fo.ScaledSwiGLU, fo.LayerNorm, fo.RMSNorm,
                fo.Bias, fo.BasicLinear, fo.Linear, fo.GroupedLinear, fo.Dropout, fo.Identity, fo.ConstantScale,
                fo.AddExtraInput, fo.MakeExtraOutput, fo.Reshape]:
        doc = cls.__doc__ or ""
        assert doc and doc != fo.BasicOperation.__doc__, cls
    assert "first half" in fo.SwiGLU.__doc__


def test_grouped_linear_docstring_says_what_block_scaling_runs():
    """Block scaling runs FP8 grouped GEMMs (as docs/fp8.md says; its accuracy: test_fp8_grouped.py):
    the output is not the high-precision one, and the docstring no longer says it is (issue 63)."""
    lin = fo.GroupedLinear(2, 128, 128, bias=False)
    x, splits = torch.randn(40, 128), torch.tensor([15, 25])
    with fo.autocast(recipe=fo.Float8BlockScaling()):
        y = lin(x, splits)
    assert not torch.equal(y, lin(x, splits))
    doc = " ".join(fo.GroupedLinear.__doc__.split())
    assert "high precision" not in doc and "FP8 under every recipe" in doc


def test_linear_parameters_single_owner():
    lin = fo.Linear(4, 3)
    assert [n for n, _ in lin.named_parameters()] == ["weight", "bias"]
    assert list(lin.basic_ops[0].parameters()) == []  # lent, not duplicated
    new_w = torch.nn.Parameter(torch.zeros(3, 4))
    lin.weight = new_w
    assert lin.basic_ops[0].weight is new_w
    assert lin(torch.randn(2, 4)).sub(lin.bias).abs().max() == 0
    lin2 = lin.to(torch.float64)
    assert lin2.basic_ops[0].weight.dtype == torch.float64


# ------------------------------------------------------------------ 4. data-parallel guards
@pytest.fixture
def gloo_world():
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed not available")
    path = tempfile.mktemp()
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()
        if os.path.exists(path):
            os.remove(path)


@pytest.mark.parametrize("flag", ["accumulate_into_main_grad", "delay_wgrad_compute"])
def test_main_grad_or_delayed_wgrad_inside_ddp(gloo_world, flag):
    """Both flags run inside DDP (tests/distributed/test_dist_data_parallel.py checks the results at
    2 and 4 ranks); a main_grad attached by the trainer is refused there (fusible_ops keeps the
    accumulator, the result goes to .grad)."""
    seq = fo.Sequential(fo.Linear(4, 4, **{flag: True}), fo.GELU())
    ddp = torch.nn.parallel.DistributedDataParallel(seq)
    ddp(torch.randn(2, 4)).sum().backward()
    seq.backward_dw()
    assert seq[0].weight.grad is not None and getattr(seq[0].weight, "main_grad", None) is None
    if flag == "accumulate_into_main_grad":
        seq[0].weight.main_grad = torch.zeros(4, 4)
        with pytest.raises(RuntimeError, match="BasicLinear: accumulate_into_main_grad=True under .*DistributedDataParallel"
                                               ".*do not attach weight.main_grad"):
            ddp(torch.randn(2, 4))
        seq(torch.randn(2, 4)).sum().backward()  # the same module outside the wrapper uses it
        assert seq[0].weight.main_grad.abs().sum() > 0


def test_delayed_wgrad_scheduler_inside_ddp_and_after(gloo_world):
    """fo.delayed_wgrad() binds plain-mode weights to DDP at forward; a forward outside DDP
    unbinds them (no reduction then)."""
    from fusible_ops import data_parallel

    seq = fo.Sequential(fo.Linear(4, 4), fo.GELU())
    ddp = torch.nn.parallel.DistributedDataParallel(seq)
    with fo.delayed_wgrad():
        ddp(torch.randn(2, 4)).sum().backward()
    assert data_parallel.wrapper_of(seq[0].weight) is not None
    fo.flush_wgrad()
    assert seq[0].weight.grad.abs().sum() > 0
    seq[0].weight.grad = None
    with fo.delayed_wgrad():
        seq(torch.randn(2, 4)).sum().backward()
    assert data_parallel.wrapper_of(seq[0].weight) is None
    fo.flush_wgrad()
    assert seq[0].weight.grad.abs().sum() > 0


def test_main_grad_and_delayed_wgrad_inside_fsdp2(gloo_world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    seq = fo.Sequential(fo.Linear(4, 4, accumulate_into_main_grad=True, delay_wgrad_compute=True), fo.GELU())
    fully_shard(seq, mesh=init_device_mesh("cpu", (1,)))
    seq(torch.randn(2, 4)).sum().backward()
    assert seq[0].weight.grad is None  # reduced only once backward_dw() has computed it
    seq.backward_dw()
    assert type(seq[0].weight.grad).__name__ == "DTensor"  # on the sharded parameter
    seq[0].weight.main_grad = torch.zeros(4, 4)
    with pytest.raises(RuntimeError, match="under FSDP2 .*do not attach weight.main_grad"):
        seq(torch.randn(2, 4))


# ------------------------------------------------------------------ 6, 9. rule errors
def test_disabled_unknown_rule_name_lists_close_matches():
    with pytest.raises(ValueError, match="did you mean 'linear_bias_activation'"):
        with fo.fusion_rules.disabled("linear_bias_activations"):
            pass
    seq = fo.Sequential(fo.Linear(4, 4), fo.GELU())
    with fo.fusion_rules.disabled("linear_bias_activation"):
        assert _rules(seq.fusion_plan())[0] != "linear_bias_activation"


def test_disabled_in_a_loop_keeps_the_plan_cache_bounded():
    seq = fo.Sequential(fo.Linear(4, 4), fo.GELU())
    x = torch.randn(2, 4, requires_grad=True)
    fuser = seq._get_stages()[0][0]
    for _ in range(3):
        with fo.fusion_rules.disabled("linear_bias_activation"):
            seq(x).sum().backward()
        seq(x).sum().backward()
    made, size = fuser.num_plans_made, len(fuser._plans)
    for _ in range(1000):
        with fo.fusion_rules.disabled("linear_bias_activation"):
            seq(x)
        seq(x)
    assert fuser.num_plans_made == made and len(fuser._plans) == size


def test_builder_returning_a_non_fusible_module_names_the_rule():
    rs = fo.RuleSet()
    rs.register("oops", [AddOne, Double], pass_="forward", build=lambda ops: torch.nn.Identity())
    seq = fo.Sequential(AddOne(), Double(), rules=rs)
    with pytest.raises(TypeError, match=r"rule 'oops': build\(\['AddOne', 'Double'\]\) returned Identity"):
        seq(torch.zeros(1))


def test_assigning_rules_after_the_first_call_is_honoured():
    rs = fo.RuleSet()
    rs.register("marked", [AddOne, Double], pass_="forward", build=MarkedFused)
    seq = fo.Sequential(AddOne(), Double())
    assert seq(torch.zeros(1)).item() == 2
    seq.rules = rs
    assert seq(torch.zeros(1)).item() == 1002
    with pytest.raises(TypeError, match="RuleSet"):
        seq.rules = ["marked"]


# ------------------------------------------------------------------ 7. ScaledSwiGLU shapes
@pytest.mark.parametrize("scales_shape", [(2, 3), (6,)])
@pytest.mark.parametrize("fused", [True, False])
def test_scaled_swiglu_3d_input_accepts_both_scale_shapes(scales_shape, fused):
    torch.manual_seed(0)
    seq = fo.Sequential(fo.GroupedLinear(2, 4, 8, bias=False, dtype=torch.float64), fo.ScaledSwiGLU(),
                        fo.GroupedLinear(2, 4, 4, bias=False, dtype=torch.float64))
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    s = torch.rand(*scales_shape, dtype=torch.float64, requires_grad=True)
    splits = torch.tensor([4, 2])
    names = () if fused else ("grouped_mlp",)
    with fo.fusion_rules.disabled(*names):
        assert ("grouped_mlp" in _rules(seq.fusion_plan("forward", x, splits, s, splits))) == fused
        y = seq(x, splits, s, splits)
        y.sum().backward()
    assert s.grad.shape == s.shape
    x2, s2 = x.detach().requires_grad_(), s.detach().requires_grad_()
    ref = seq[2].reference_forward(seq[1].reference_forward(seq[0].reference_forward(x2, splits), s2), splits)
    ref.sum().backward()
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(s.grad, s2.grad)
    torch.testing.assert_close(x.grad, x2.grad)
    op = fo.ScaledSwiGLU()
    y = op(x.detach(), s.detach().requires_grad_())
    assert y.shape == (2, 3, 2)


def test_scaled_swiglu_rejects_transposed_scales():
    with pytest.raises(ValueError, match=r"must have shape \[2, 3\].*or \[6\]"):
        fo.ScaledSwiGLU()(torch.randn(2, 3, 8), torch.rand(3, 2))


def test_matches_reference_after_linear_ownership_change():
    seq = fo.Sequential(fo.Linear(5, 6), fo.SwiGLU(), fo.Linear(3, 5, bias=False))
    assert_matches_reference(seq, torch.randn(4, 5, requires_grad=True))
