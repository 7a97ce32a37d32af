"""The ``linear_add`` rule (``BasicLinear -> AddExtraInput``: the residual as the GEMM's
accumulate input, fusible_ops/fusion_rules/linear_add.py), on CPU: the plan, its declines, its
numerics against float64 autograd, the residual's gradient handed on without a copy, the
gradient contract, its errors, and its choice against ``residual_norm``."""

import contextlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fusible_ops as fo
from fusible_ops.fuser import cpu_autograd
from fusible_ops.testing import assert_close_scaled, assert_matches_reference
from fusible_ops.testing.strategies import BUILTIN_OPS, OpSpec, chains, leading_shapes

F64 = torch.float64
DTYPES = [torch.float32, torch.bfloat16]
# (leading dims, features in, features out): 2-D, 3-D and 1-D inputs, odd sizes, no rows
SHAPES = [((5,), 7, 9), ((2, 3), 13, 13), ((3, 1, 4), 6, 11), ((), 5, 3), ((0,), 4, 4)]
PATHS = ["fuser_backward", "torch_autograd"]  # CPU: the ops' own backward, or PyTorch's autograd of the forward


def _path(path):
    return cpu_autograd(False) if path == "fuser_backward" else contextlib.nullcontext()


def _seq(n_in, n_out, dtype=torch.float32, **kw):
    torch.manual_seed(0)
    return fo.Sequential(fo.Linear(n_in, n_out, bias=False, dtype=dtype, **kw), fo.AddExtraInput())


def _inputs(lead, n_in, n_out, dtype=torch.float32, contiguous=True, seed=0):
    """x [*lead, n_in] and the residual [*lead, n_out]; non-contiguous: transposed storage."""
    g = torch.Generator().manual_seed(seed)

    def make(n):
        if contiguous or len(lead) < 1:
            t = torch.randn(*lead, n, generator=g)
        else:  # same shape, features not innermost: a dense, non-contiguous tensor
            t = torch.randn(n, *lead, generator=g).movedim(0, -1)
            assert not t.is_contiguous() or t.numel() <= n
        return t.to(dtype).requires_grad_()

    return make(n_in), make(n_out)


def _rules(seq, pass_="forward", *inputs):
    return [g["rule"] for g in seq.fusion_plan(pass_, *inputs)]


# --------------------------------------------------------------------------- the plan
def test_rule_fires_forward_only_and_explain_shows_it():
    seq = _seq(8, 8)
    x, r = _inputs((2, 3), 8, 8)
    seq(x, r)
    assert _rules(seq) == ["linear_add"]
    assert _rules(seq, "backward") == [None, None]  # the unfused backward hands dy on as is
    text = seq.explain()
    assert "rule 'linear_add' -> ForwardLinearAdd (BasicLinear, AddExtraInput)" in text
    with fo.fusion_rules.disabled("linear_add"):
        assert _rules(seq, "forward", x, r) == [None, None]
    with torch.no_grad():  # inference too
        assert _rules(seq, "forward", x, r) == ["linear_add"]


def test_fp8_recipe_declines_with_its_reason():
    seq = _seq(16, 16)
    x, r = _inputs((4,), 16, 16)
    with fo.autocast(recipe=fo.Float8CurrentScaling()):
        assert _rules(seq, "forward", x, r) == [None, None]
        text = seq.explain(x, r)
    assert "declined:" in text
    assert "rule 'linear_add' (forward) on ops [0, 1]: an FP8 recipe is active" in text
    assert _rules(seq, "forward", x, r) == ["linear_add"]  # outside the block again


def test_biased_linear_keeps_linear_bias():
    """No ``linear_bias_add``: the bias stays in the GEMM's epilogue, the add unfused."""
    torch.manual_seed(0)
    seq = fo.Sequential(fo.Linear(6, 6), fo.AddExtraInput())
    x, r = _inputs((3,), 6, 6)
    assert _rules(seq, "forward", x, r) == ["linear_bias", None]
    assert_matches_reference(seq, x, r)


@pytest.mark.parametrize("extra_out", [False, True])
@pytest.mark.parametrize("norm", [fo.RMSNorm, fo.LayerNorm])
def test_residual_norm_wins_over_linear_add(norm, extra_out):
    """``Linear -> AddExtraInput [-> MakeExtraOutput] -> norm``: the residual rules take the add
    (linear_add's priority is below theirs, whatever the lengths); with them off, linear_add
    fuses and the norm's fused backward runs after it (plans are independent)."""
    torch.manual_seed(0)
    mid = [fo.MakeExtraOutput()] if extra_out else []
    seq = fo.Sequential(fo.Linear(10, 10, bias=False), fo.AddExtraInput(), *mid, norm(10))
    x, r = _inputs((2, 5), 10, 10)
    name = "residual_extra_norm" if extra_out else "residual_norm"
    assert _rules(seq, "forward", x, r) == [None, name]
    assert _rules(seq, "backward", x, r) == [None, name + "_backward"]
    assert_matches_reference(seq, x, r)
    with fo.fusion_rules.disabled("residual_norm", "residual_extra_norm"):
        assert _rules(seq, "forward", x, r) == ["linear_add", *[None] * len(mid), None]
        assert _rules(seq, "backward", x, r) == [None, name + "_backward"]
        assert_matches_reference(seq, x, r)


def test_rule_is_forward_only_with_priority_below_the_residual_rules():
    """Priority -1: linear_add never takes ops from a rule that overlaps it (residual_norm,
    residual_extra_norm at 0, the comm-overlap rules at 1)."""
    rules = [r for r in fo.RuleSet.builtin().rules() if r.name == "linear_add"]
    assert len(rules) == 1 and rules[0].pass_ == "forward" and rules[0].priority == -1


# --------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("lead,n_in,n_out", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_float64_reference(dtype, lead, n_in, n_out, contiguous):
    """Output and every gradient (x, residual, weight) against float64 autograd of the plain
    math, judged by the project's tolerance table (the ops' own backward on CPU)."""
    seq = _seq(n_in, n_out, dtype)
    x, r = _inputs(lead, n_in, n_out, dtype, contiguous)
    assert _rules(seq, "forward", x, r) == ["linear_add"]
    assert_matches_reference(seq, x, r)


@pytest.mark.parametrize("dtype", DTYPES)
def test_under_torch_autograd_matches_float64(dtype):
    """The CPU training path where PyTorch's autograd differentiates the fused forward (addmm)."""
    seq = _seq(7, 5, dtype)
    x, r = _inputs((3, 2), 7, 5, dtype, contiguous=False)
    y = seq(x, r)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    y.backward(dy)
    w = seq[0].weight
    x64, r64, w64 = (t.detach().double().requires_grad_() for t in (x, r, w))
    y64 = torch.nn.functional.linear(x64, w64) + r64
    y64.backward(dy.double())
    assert_close_scaled(y, y64, dtype, "output")
    for got, want, what in [(x.grad, x64.grad, "x"), (r.grad, r64.grad, "residual"), (w.grad, w64.grad, "weight")]:
        assert_close_scaled(got, want, dtype, f"grad of {what}")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_same_gradients_as_the_unfused_plan(dtype, path):
    """Fused and unfused (``disabled("linear_add")``) give the same gradients bit for bit where
    the same backward runs (the ops' own), and outputs within the table either way (the fused
    sum is rounded once in 16 bits, the unfused one twice)."""
    results = []
    for off in (False, True):
        seq = _seq(9, 9, dtype)
        x, r = _inputs((4, 3), 9, 9, dtype)
        dy = torch.randn(4, 3, 9, generator=torch.Generator().manual_seed(5)).to(dtype)
        with _path(path), (fo.fusion_rules.disabled("linear_add") if off else contextlib.nullcontext()):
            assert _rules(seq, "forward", x, r) == ([None, None] if off else ["linear_add"])
            y = seq(x, r)
            y.backward(dy)
        results.append((y.detach(), x.grad, r.grad, seq[0].weight.grad))
    (y0, *g0), (y1, *g1) = results
    assert_close_scaled(y0, y1.double(), dtype, "output")
    for a, b in zip(g0, g1):
        if path == "fuser_backward":
            assert torch.equal(a, b)
        else:
            assert_close_scaled(a, b.double(), dtype, "gradient")


# --------------------------------------------------------------------------- the residual's gradient
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("lead", [(6,), (2, 3)])
def test_residual_gets_dy_without_a_copy(lead, path):
    seq = _seq(5, 4)
    x, r = _inputs(lead, 5, 4)
    seen = []
    r.register_hook(seen.append)  # the gradient autograd delivers to the residual
    with _path(path):
        y = seq(x, r)
        dy = torch.randn(y.shape)
        y.backward(dy)
    assert _rules(seq) == ["linear_add"]
    (g,) = seen
    assert g.data_ptr() == dy.data_ptr() and g.shape == dy.shape
    assert torch.equal(r.grad, dy)


# --------------------------------------------------------------------------- the gradient contract
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_main_grad_accumulation(dtype, path):
    seq = _seq(7, 7, dtype, accumulate_into_main_grad=True)
    w = seq[0].weight
    w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    x, r = _inputs((3, 2), 7, 7, dtype)
    with _path(path):
        assert_matches_reference(seq, x, r)  # compares main_grad's increment
        assert _rules(seq) == ["linear_add"]
        after_one = w.main_grad.clone()
        assert after_one.abs().sum() > 0 and w.grad is None
        seq(x, r).backward(torch.ones(3, 2, 7, dtype=dtype))
    expected = after_one + (torch.ones(6, 7).t() @ x.detach().reshape(6, 7).float())
    assert_close_scaled(w.main_grad, expected.double(), dtype, "main_grad after a second backward")


@pytest.mark.parametrize("path", PATHS)
def test_delayed_wgrad(path):
    seq = _seq(6, 6, delay_wgrad_compute=True)
    lin = seq[0]
    x, r = _inputs((5,), 6, 6)
    with _path(path):
        y = seq(x, r)
        dy = torch.randn(y.shape)
        y.backward(dy)
    assert _rules(seq) == ["linear_add"]
    assert lin.weight.grad is None and lin.basic_ops[0].has_pending_wgrad()
    assert x.grad is not None and torch.equal(r.grad, dy)
    lin.backward_dw()
    assert not lin.basic_ops[0].has_pending_wgrad()
    torch.testing.assert_close(lin.weight.grad, dy.t() @ x.detach(), rtol=1.3e-4, atol=1e-4)
    x2, r2 = _inputs((5,), 6, 6)
    assert_matches_reference(seq, x2, r2)  # (flushes the delayed gradient itself)


@pytest.mark.parametrize("path", PATHS)
def test_frozen_weight(path):
    seq = _seq(6, 8)
    seq[0].weight.requires_grad_(False)
    x, r = _inputs((2, 3), 6, 8)
    with _path(path):
        y = seq(x, r)
        y.backward(torch.ones(y.shape))
    assert _rules(seq) == ["linear_add"]
    assert seq[0].weight.grad is None and not seq[0].basic_ops[0].has_pending_wgrad()
    assert x.grad is not None and r.grad is not None
    x2, r2 = _inputs((2, 3), 6, 8)
    assert_matches_reference(seq, x2, r2)  # (also fails if the frozen weight got a gradient)


def test_only_the_residual_requires_grad():
    seq = _seq(5, 5)
    seq[0].weight.requires_grad_(False)
    x, r = _inputs((4,), 5, 5)
    x.requires_grad_(False)
    with cpu_autograd(False):
        y = seq(x, r)
        dy = torch.randn(y.shape)
        y.backward(dy)
    assert x.grad is None and seq[0].weight.grad is None and torch.equal(r.grad, dy)


# --------------------------------------------------------------------------- errors and autocast
def _error(seq, x, r):
    with pytest.raises(Exception) as info:
        seq(x, r)
    return type(info.value), str(info.value)


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("bad", ["shape", "rank", "dtype"])
def test_bad_residual_raises_as_the_unfused_add_does(bad, grad):
    seq = _seq(4, 6)
    x, _ = _inputs((3,), 4, 6)
    r = {"shape": torch.randn(2, 6), "rank": torch.randn(1, 3, 6),
         "dtype": torch.randn(3, 6, dtype=torch.float64)}[bad]
    with torch.set_grad_enabled(grad):
        assert _rules(seq, "forward", x, r) == ["linear_add"]
        fused = _error(seq, x, r)
        with fo.fusion_rules.disabled("linear_add"):
            unfused = _error(seq, x, r)
    assert fused == unfused
    assert fused[1].startswith("AddExtraInput: the extra input")
    assert fused[0] is (TypeError if bad == "dtype" else ValueError)


def test_bad_input_raises_as_the_linear_does():
    seq = _seq(4, 6)
    x, r = torch.randn(3, 5), torch.randn(3, 6)
    fused = _error(seq, x, r)
    with fo.fusion_rules.disabled("linear_add"):
        assert fused == _error(seq, x, r)
    assert fused[1].startswith("BasicLinear: input's last dim must be 4")


def test_torch_autocast_runs_the_unfused_math():
    """Under torch.autocast the GEMM's output is cast: the residual is checked against it and
    added after it, exactly as without the rule."""
    seq = _seq(8, 8)
    x = torch.randn(3, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r = torch.randn(3, 8, dtype=torch.bfloat16)
        y = seq(x, r)
        with fo.fusion_rules.disabled("linear_add"):
            y_ref = seq(x, r)
        assert _rules(seq, "forward", x, r) == ["linear_add"]
        assert y.dtype == torch.bfloat16 and torch.equal(y, y_ref)
        fused = _error(seq, x, r.float())
        with fo.fusion_rules.disabled("linear_add"):
            assert fused == _error(seq, x, r.float())


def test_torch_compile_fullgraph_matches_eager():
    seq = _seq(8, 6)
    x, r = _inputs((2, 3), 8, 6)
    y_eager = seq(x, r)
    (gx, gr, gw) = torch.autograd.grad(y_eager.sum(), (x, r, seq[0].weight))
    assert _rules(seq) == ["linear_add"]
    y = torch.compile(seq, backend="aot_eager", fullgraph=True)(x, r)
    torch.testing.assert_close(y, y_eager)
    for a, b in zip(torch.autograd.grad(y.sum(), (x, r, seq[0].weight)), (gx, gr, gw)):
        torch.testing.assert_close(a, b)
    torch._dynamo.reset()


# --------------------------------------------------------------------------- property test
class _LinearAdd(fo.FusibleOperation):
    """``BasicLinear(n, out) -> AddExtraInput`` as one catalogue entry (so drawn chains hold the
    pattern often); fusible like ``fo.Linear``: the Sequential fuses its basic ops."""

    def __init__(self, n, out, **factory):
        super().__init__()
        self.linear = fo.BasicLinear(n, out, **factory)
        self.add = fo.AddExtraInput()

    @property
    def is_fused_op(self):
        return False

    @property
    def basic_ops(self):
        return (self.linear, self.add)


_LINEAR_ADD = OpSpec("BasicLinear+AddExtraInput", lambda n, out, **f: (_LinearAdd(n, out, **f), out),
                     args={"out": st.integers(1, 12)},
                     extra=lambda lead, n, dtype, device, g, out: [
                         torch.randn(*lead, out, generator=g).to(device, dtype).requires_grad_()])
_OPS = BUILTIN_OPS + [_LINEAR_ADD] * 6


@given(chain=chains(ops=_OPS, max_len=5), dtype=st.sampled_from(DTYPES), lead=leading_shapes())
def test_random_chains_with_linear_add_match_the_reference(chain, dtype, lead):
    seq = chain.build(dtype=dtype)
    assert_matches_reference(seq, *chain.inputs(lead, dtype=dtype))


def test_the_property_test_draws_linear_add():
    """The catalogue above puts linear_add in most drawn chains (else the property test would
    not test it)."""
    fired = []

    @given(chain=chains(ops=_OPS, max_len=5))
    def probe(chain):
        seq = chain.build()
        fired.append("linear_add" in _rules(seq, "forward", *chain.inputs((3,))))

    probe()
    assert sum(fired) >= len(fired) // 3, fired


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_matches_float64_and_the_unfused_plan(dtype):
    """On CUDA (cuBLAS addmm): the fused plan against float64 and against the unfused plan,
    outputs and every gradient, with leading dims and a non-contiguous residual."""
    torch.manual_seed(0)
    seq = fo.Sequential(fo.Linear(96, 80, bias=False, device="cuda", dtype=dtype), fo.AddExtraInput())
    x = torch.randn(3, 17, 96, device="cuda", dtype=dtype, requires_grad=True)
    r = torch.randn(80, 3, 17, device="cuda", dtype=dtype).permute(1, 2, 0).requires_grad_()
    dy = torch.randn(3, 17, 80, device="cuda", dtype=dtype)
    runs = {}
    for fused in (True, False):
        ctx = contextlib.nullcontext() if fused else fo.fusion_rules.disabled("linear_add")
        with ctx:
            y = seq(x, r)
            assert ("linear_add" in [g["rule"] for g in seq.fusion_plan()]) == fused
            runs[fused] = (y, *torch.autograd.grad(y, (x, r, seq[0].weight), dy))
    w = seq[0].weight.detach().double().requires_grad_()
    x64, r64 = x.detach().double().requires_grad_(), r.detach().double().requires_grad_()
    y64 = x64 @ w.t() + r64
    ref = (y64, *torch.autograd.grad(y64, (x64, r64, w), dy.double()))
    for name, a, b, c in zip(("y", "dx", "dresidual", "dweight"), runs[True], runs[False], ref):
        assert_close_scaled(a, c, dtype, f"fused {name}")
        assert_close_scaled(b, c, dtype, f"unfused {name}")
