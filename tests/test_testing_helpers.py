"""The reusable test helpers themselves (fusible_ops.testing): they must catch wrong ops and
fusions, accept what plain PyTorch at the same precision cannot beat, draw users' own ops, and
the recipe of docs/testing.md must work verbatim in a fresh project."""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given

import fusible_ops as fo
from fusible_ops.testing import (
    MissingReferenceError, UncheckedOpWarning, assert_matches_reference, fusion_settings, run_reference,
)
from fusible_ops.testing.strategies import BUILTIN_OPS, OpSpec, chains, dtypes, leading_shapes


# --------------------------------------------------------------------------- (A) backward checked
class Square(fo.BasicOperation):
    """y = x * x with a deliberately WRONG backward (dy * x instead of 2 * dy * x)."""

    def op_forward(self, ctx, x, **kwargs):
        ctx.save_for_backward(x)
        return x * x

    def op_backward(self, ctx, dy):
        (x,) = ctx.saved_tensors
        return dy * x, ()

    def reference_forward(self, x):
        return x * x


class GoodSquare(Square):
    def op_backward(self, ctx, dy):
        (x,) = ctx.saved_tensors
        return 2 * dy * x, ()


def test_wrong_basic_op_backward_is_caught():
    x = torch.randn(3, 5, requires_grad=True)
    assert_matches_reference(fo.Sequential(GoodSquare()), x)
    with pytest.raises(AssertionError, match="grad of input 0"):
        assert_matches_reference(fo.Sequential(Square()), x)
    with pytest.raises(AssertionError, match="grad of input 0"):  # also inside a chain with built-ins
        assert_matches_reference(fo.Sequential(fo.Linear(5, 4), Square(), fo.Bias(4)), x)


class ChannelScale(fo.BasicOperation):
    """y = x * weight (per feature). ``wrong_wgrad`` forgets the x in the weight gradient."""

    def __init__(self, size, *, device=None, dtype=None, wrong_wgrad=False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(size, device=device, dtype=dtype).uniform_(0.5, 1.5))
        self.wrong_wgrad = wrong_wgrad

    def op_forward(self, ctx, x, **kwargs):
        ctx.save_for_backward(x)
        return x * self.weight

    def op_backward(self, ctx, dy):
        (x,) = ctx.saved_tensors
        g = dy if self.wrong_wgrad else dy * x
        return dy * self.weight, (g.reshape(-1, x.shape[-1]).sum(0),)

    def reference_forward(self, x):
        return x * self.weight


def test_wrong_parameter_gradient_is_caught():
    x = torch.randn(4, 6, requires_grad=True)
    assert_matches_reference(fo.Sequential(ChannelScale(6), fo.GELU()), x)
    with pytest.raises(AssertionError, match="grad of parameter 0.weight"):
        assert_matches_reference(fo.Sequential(ChannelScale(6, wrong_wgrad=True), fo.GELU()), x)


def test_main_grad_and_delayed_wgrad_are_read_through_the_op():
    torch.manual_seed(0)
    lin = fo.Linear(5, 4, accumulate_into_main_grad=True)
    lin.weight.main_grad = torch.randn(4, 5)
    seq = fo.Sequential(fo.LayerNorm(5), lin, fo.SiLU(), fo.Linear(4, 3, delay_wgrad_compute=True))
    assert_matches_reference(seq, torch.randn(2, 3, 5, requires_grad=True))


class NoReference(fo.BasicOperation):
    def op_forward(self, ctx, x, **kwargs):
        return x + 1

    def op_backward(self, ctx, dy):
        return dy, ()


def test_op_without_reference_forward_needs_an_explicit_flag():
    seq = fo.Sequential(fo.Linear(3, 3), NoReference())
    x = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(MissingReferenceError, match=r"NoReference \(basic op 2\).*reference_forward.*unchecked_ops"):
        assert_matches_reference(seq, x)
    with pytest.raises(MissingReferenceError):
        run_reference(seq, x)
    for flag in [(NoReference,), NoReference, "all"]:
        with pytest.warns(UncheckedOpWarning, match="NoReference.*NOT independently checked"):
            assert_matches_reference(seq, x, unchecked_ops=flag)
    with pytest.raises(MissingReferenceError):  # the flag names classes: other ops stay checked
        assert_matches_reference(seq, x, unchecked_ops=(fo.Dropout,))


def test_reference_runs_extra_inputs_and_outputs_and_plain_modules():
    seq = fo.Sequential(fo.Linear(4, 4), fo.MakeExtraOutput(), torch.nn.Tanh(), fo.AddExtraInput(), fo.RMSNorm(4))
    x, r = torch.randn(3, 4), torch.randn(3, 4)
    y, extra = run_reference(seq, x, r)
    h = x @ seq[0].weight.T + seq[0].bias
    torch.testing.assert_close(extra, h)
    torch.testing.assert_close(y, seq[4].reference_forward(torch.tanh(h) + r))
    assert_matches_reference(seq, x.requires_grad_(), r.requires_grad_())


# --------------------------------------------------------------------------- (B) baseline error
F, N = 1.003, 300  # y = x * F**N as N roundings in the run's dtype: plain fp16 drifts past the table


class Drift(fo.BasicOperation):
    """y = x * F**N. Reference: N multiplications (plain PyTorch). This op's forward returns the
    exact value plus ``blow`` times the plain-PyTorch rounding error; backward = the plain loop."""

    def __init__(self, blow):
        super().__init__()
        self.blow = blow

    def reference_forward(self, x):
        for _ in range(N):
            x = x * F
        return x

    def op_forward(self, ctx, x, **kwargs):
        exact = x.double() * F**N
        return (exact + self.blow * (self.reference_forward(x).double() - exact)).to(x.dtype)

    def op_backward(self, ctx, dy):
        return self.reference_forward(dy), ()


def test_low_precision_judged_against_plain_pytorch_at_the_same_dtype():
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0)).half().requires_grad_()
    with pytest.raises(AssertionError, match="output 0"):  # plain fp16 math itself misses the table
        assert_matches_reference(fo.Sequential(Drift(1.0)), x, baseline=False)
    assert_matches_reference(fo.Sequential(Drift(1.0)), x)
    assert_matches_reference(fo.Sequential(Drift(1.5)), x)  # within 2x of plain PyTorch's error
    with pytest.raises(AssertionError, match=r"output 0: .*plain PyTorch at torch.float16 has max \|err\|"):
        assert_matches_reference(fo.Sequential(Drift(4.0)), x)  # much worse than plain PyTorch


def _toward_zero_fp16(t):
    r = t.to(torch.float16)
    return torch.where(r.double().abs() > t.double().abs(), torch.nextafter(r, torch.zeros_like(r)), r)


class Times11(fo.BasicOperation):
    """y = 1.1 x computed exactly and rounded toward zero (within 1 ulp: a legitimate kernel);
    ``off_ulps`` more ulps are added to the first feature (a bad kernel)."""

    def __init__(self, off_ulps=0):
        super().__init__()
        self.off_ulps = off_ulps

    def op_forward(self, ctx, x, **kwargs):
        y = _toward_zero_fp16(x.double() * 1.1).to(x.dtype)
        return y + torch.tensor([self.off_ulps * 0.0625, 0.0], dtype=y.dtype)

    def op_backward(self, ctx, dy):
        return _toward_zero_fp16(dy.double() * 1.1).to(dy.dtype), ()

    def reference_forward(self, x):
        return x * 1.1


class Difference(fo.BasicOperation):
    """y = x[0] - x[1]: a cancelling result (near zero, made of large terms)."""

    def op_forward(self, ctx, x, **kwargs):
        return x[..., :1] - x[..., 1:]

    def op_backward(self, ctx, dy):
        return torch.cat([dy, -dy], -1), ()

    def reference_forward(self, x):
        return x[..., :1] - x[..., 1:]


def test_one_lucky_rounding_is_not_the_bar(monkeypatch):
    """One row, one output element that cancels: plain fp16 happens to round both terms the same
    way (error ~0), a legitimate kernel is 1 ulp (of 110) off. The stochastically rounded float64
    runs show what fp16 rounding does here, so it passes; 4 ulps off still fails."""
    x = torch.tensor([[116.0, 118.5]], dtype=torch.float16, requires_grad=True)
    plain = x.detach() * 1.1
    exact = x.detach().double() * 1.1
    assert (plain[0, 0] - plain[0, 1]).double() == pytest.approx((exact[0, 0] - exact[0, 1]).item(), abs=1e-9)
    assert_matches_reference(fo.Sequential(Times11(), Difference()), x)
    with pytest.raises(AssertionError, match="output 0"):
        assert_matches_reference(fo.Sequential(Times11(off_ulps=4), Difference()), x)
    monkeypatch.setattr("fusible_ops.testing.reference.BASELINE_SAMPLES", 0)  # plain PyTorch alone
    with pytest.raises(AssertionError, match="output 0"):
        assert_matches_reference(fo.Sequential(Times11(), Difference()), x)


class SquareFp16(fo.BasicOperation):
    """y = x * x; ``detour`` computes it as (1000 x^2) / 1000 in the input's dtype (overflows early)."""

    def __init__(self, detour=False):
        super().__init__()
        self.detour = detour

    def op_forward(self, ctx, x, **kwargs):
        ctx.save_for_backward(x)
        return (x * x * 1000) / 1000 if self.detour else (x.float() * x.float()).to(x.dtype)

    def op_backward(self, ctx, dy):
        (x,) = ctx.saved_tensors
        return (2 * dy.float() * x.float()).to(dy.dtype), ()

    def reference_forward(self, x):
        return x * x


def test_overflow_accepted_only_where_ideal_kernels_overflow_too():
    x = torch.tensor([[300.0, 2.0, -100.0]], dtype=torch.float16, requires_grad=True)  # 300^2 > fp16 max
    assert_matches_reference(fo.Sequential(SquareFp16()), x)  # inf where exact math overflows fp16
    with pytest.raises(AssertionError, match="output 0: 1 non-finite values in result where"):
        assert_matches_reference(fo.Sequential(SquareFp16(detour=True)), x)  # -100: inf, ideal is finite
    with pytest.raises(AssertionError, match="non-finite"):
        assert_matches_reference(fo.Sequential(SquareFp16()), x, baseline=False)


def test_float32_result_far_off_still_fails():
    class Off(fo.BasicOperation):
        def op_forward(self, ctx, x, **kwargs):
            return x * 1.001

        def op_backward(self, ctx, dy):
            return dy * 1.001, ()

        def reference_forward(self, x):
            return x

    with pytest.raises(AssertionError, match="output 0"):
        assert_matches_reference(fo.Sequential(Off()), torch.randn(3, 4, requires_grad=True))


# --------------------------------------------------------------------------- (C) users' ops in chains
class ScaleBias(fo.FusedOperation):
    """ChannelScale then Bias in one pass; ``wrong`` forgets the scale in the input gradient."""

    def __init__(self, ops, wrong=False):
        super().__init__(ops)
        self.wrong = wrong

    def fuser_forward(self, ctxs, x, *, extra_inputs, **kwargs):
        scale, bias = self.basic_ops
        ctxs[0].save_for_backward(x)
        return torch.addcmul(bias.bias, x, scale.weight), [(), ()]

    def fuser_backward(self, ctxs, dy, *, grad_extra_outputs, **kwargs):
        scale, _ = self.basic_ops
        (x,) = ctxs[0].saved_tensors
        dw = (dy * x).reshape(-1, x.shape[-1]).sum(0)
        db = dy.reshape(-1, dy.shape[-1]).sum(0)
        return (dy if self.wrong else dy * scale.weight), [(dw,), (db,)], [(), ()]


def _rules(wrong=False):
    rs = fo.RuleSet.builtin()
    rs.register("scale_bias", [ChannelScale, fo.Bias], pass_="joint", build=lambda ops: ScaleBias(ops, wrong))
    return rs


SCALE = OpSpec("ChannelScale", lambda n, **f: ChannelScale(n, **f))
USER_OPS = [SCALE, SCALE] + [s for s in BUILTIN_OPS if s.name in ("Bias", "activation", "Linear", "AddExtraInput")]


def test_chains_draw_user_ops_and_the_user_rule_fires():
    fired, drawn = [], []
    rules = _rules()

    @fusion_settings(max_examples=25)
    @given(chain=chains(ops=USER_OPS, min_len=2), dtype=dtypes(), lead=leading_shapes())
    def check(chain, dtype, lead):
        seq = chain.build(dtype=dtype, rules=rules)
        assert seq.rules is rules
        drawn.extend(type(m).__name__ for m in seq)
        if "scale_bias" in [row["rule"] for row in seq.fusion_plan()]:
            fired.append(chain)
        assert_matches_reference(seq, *chain.inputs(lead, dtype=dtype))

    check()
    assert "ChannelScale" in drawn and "AddExtraInput" in drawn
    assert fired, "no drawn chain used the user rule"


def test_chains_catch_a_wrong_user_fusion():
    rules = _rules(wrong=True)

    @fusion_settings(max_examples=25, report_multiple_bugs=False)
    @given(chain=chains(ops=USER_OPS, min_len=2), lead=leading_shapes())
    def check(chain, lead):
        seq = chain.build(rules=rules)
        assert_matches_reference(seq, *chain.inputs(lead))

    with pytest.raises(AssertionError, match="grad of input"):
        check()


@given(chain=chains(ops=[OpSpec("gated", lambda n, **f: (fo.SwiGLU(), n // 2), accepts=lambda n: n % 2 == 0)]))
def test_chains_project_widths_an_op_does_not_accept(chain):
    n = chain.features
    for step in chain.steps:
        assert step.n_in == n
        if step.spec.name == "gated":
            assert n % 2 == 0 and step.n_out == n // 2
        n = step.n_out
    assert chain.build()(*chain.inputs((3,))).shape == (3, chain.features_out)


def test_opspec_mistakes_are_reported_at_draw_time():
    bad = OpSpec("add_without_extra", lambda n, **f: fo.AddExtraInput())

    @fusion_settings(max_examples=1)
    @given(chain=chains(ops=[bad]))
    def check(chain):
        pass

    with pytest.raises(ValueError, match="add_without_extra.*extra input.*no extra="):
        check()


def test_builtin_catalogue_draws_every_op():
    names = set()

    @fusion_settings(max_examples=60)
    @given(chain=chains())
    def check(chain):
        names.update(s.spec.name for s in chain.steps)

    check()
    assert names == {s.name for s in BUILTIN_OPS}


# --------------------------------------------------------------------------- the docs recipe
# Exactly the code block of docs/testing.md's "Testing your own fusions" section (marked
# "not run" there: tests/test_docs_snippets.py leaves it to this test).
def _docs_recipe() -> str:
    """The python block of docs/testing.md's "Testing your own fusions" section."""
    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "testing.md").read_text()
    section = page[page.index("## Testing your own fusions"):]
    start = section.index("```python\n") + 10
    return section[start : section.index("\n```", start)]


RECIPE = _docs_recipe()


def test_readme_recipe_runs_verbatim_in_a_fresh_project(tmp_path):
    (tmp_path / "test_recipe.py").write_text(textwrap.dedent(RECIPE).lstrip())
    env = {k: v for k, v in os.environ.items()
           if k not in ("HYPOTHESIS_PROFILE", "FUSIBLE_OPS_MAX_EXAMPLES", "TRITON_INTERPRET", "PYTEST_ADDOPTS")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
         str(tmp_path / "test_recipe.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "2 passed" in proc.stdout
    assert "conftest" not in proc.stdout
