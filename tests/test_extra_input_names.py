"""Extra inputs by name: ``seq(x, residual=r)``. Each op names its extra inputs
(``extra_input_names``); a Sequential maps keywords onto positions with a table built once per
module list; the errors name the ops that take extra inputs and their names; positional calls
keep their path (no table is built); keyword calls trace under torch.compile without a graph break."""

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import fusible_ops as fo

D = 6


def _rules(plan):
    return [row["rule"] for row in plan]


def _x(*shape, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(grad)


# ------------------------------------------------------------------------ names per op
def test_ops_name_their_extra_inputs():
    assert fo.AddExtraInput.extra_input_names == ("residual",)
    assert fo.GroupedLinear.extra_input_names == ("split_sizes",)
    assert fo.ScaledSwiGLU.extra_input_names == ("scales",)
    assert fo.BasicOperation.extra_input_names == ()  # (default: derived, see below)
    import fusible_ops.ops as ops_pkg
    for name in dir(ops_pkg):  # every built-in op with extra inputs names each of them
        cls = getattr(ops_pkg, name)
        if isinstance(cls, type) and issubclass(cls, fo.BasicOperation) and cls.num_extra_inputs:
            assert len(cls.extra_input_names) == cls.num_extra_inputs, name


def test_keyword_call_matches_positional_and_fuses():
    seq = fo.Sequential(fo.AddExtraInput(), fo.RMSNorm(D, dtype=torch.float64))
    assert seq.extra_input_names == ("residual",)
    x, r = _x(3, D, grad=True), _x(3, D, seed=1, grad=True)
    y = seq(x, residual=r)
    assert _rules(seq.fusion_plan()) == ["residual_norm"]  # the keyword call fused as a positional one does
    torch.testing.assert_close(y, seq(x, r))
    dx, dr = torch.autograd.grad(y.sum(), [x, r])
    dx2, dr2 = torch.autograd.grad(seq(x, r).sum(), [x, r])
    torch.testing.assert_close(dx, dx2)
    torch.testing.assert_close(dr, dr2)


def test_brief_example_linear_then_residual():
    block = fo.Sequential(fo.Linear(D, D, dtype=torch.float64), fo.AddExtraInput())
    x = _x(2, D)
    torch.testing.assert_close(block(x, residual=x), block(x, x))


def test_several_ops_names_in_any_keyword_order_and_mixed_with_positional():
    torch.manual_seed(0)
    seq = fo.Sequential(
        fo.GroupedLinear(3, D, 8, dtype=torch.float64), fo.ScaledSwiGLU(),
        fo.GroupedLinear(3, 4, D, dtype=torch.float64), fo.AddExtraInput(),
    )
    assert seq.extra_input_names == ("split_sizes_0", "scales", "split_sizes_1", "residual")
    x, s, r = _x(5, D), _x(5, seed=2).abs(), _x(5, D, seed=3)
    splits = torch.tensor([2, 0, 3])
    want = seq(x, splits, s, splits, r)
    torch.testing.assert_close(seq(x, residual=r, split_sizes_1=splits, scales=s, split_sizes_0=splits), want)
    torch.testing.assert_close(seq(x, splits, s, residual=r, split_sizes_1=splits), want)  # positional first
    assert _rules(seq.fusion_plan(x=x, split_sizes_0=splits, scales=s, split_sizes_1=splits, residual=r))[0] \
        == "grouped_mlp"  # fusion_plan takes names too (and the grouped MLP fuses)
    assert "grouped_mlp" in seq.explain(x, splits, s, split_sizes_1=splits, residual=r)


def test_names_span_boundaries_and_hooked_modules():
    """Extra inputs of ops in different fusers (a plain torch module between them, a module with
    hooks running on its own) still map by name, with module indices in the table."""
    seq = fo.Sequential(fo.AddExtraInput(), torch.nn.Identity(), fo.AddExtraInput(), fo.ScaledSwiGLU())
    seq[2].register_forward_hook(lambda *a: None)
    assert seq.extra_input_names == ("residual_0", "residual_1", "scales")
    x, r0, r1, s = _x(2, 4), _x(2, 4, seed=1), _x(2, 4, seed=2), _x(2, seed=3)
    torch.testing.assert_close(seq(x, scales=s, residual_1=r1, residual_0=r0), seq(x, r0, r1, s))
    with pytest.raises(TypeError, match=r"expected 3 extra inputs after x, got 0.*residual_0 \(AddExtraInput, "
                                        r"module 0\), residual_1 \(AddExtraInput, module 2\), scales \(ScaledSwiGLU, "
                                        r"module 3\)"):
        seq(x)


def test_routed_grouped_linears_take_no_names():
    torch.manual_seed(0)
    moe = fo.Sequential(fo.Router(D, 4, 2), fo.Dispatch(), fo.GroupedLinear(4, D, 8, bias=False), fo.SwiGLU(),
                        fo.GroupedLinear(4, 4, D, bias=False), fo.Combine(), fo.AddExtraInput())
    assert moe.extra_input_names == ("residual",)
    x, r = torch.randn(5, D), torch.randn(5, D)
    torch.testing.assert_close(moe(x, residual=r)[0], moe(x, r)[0])
    with pytest.raises(TypeError, match="unexpected keyword argument 'split_sizes'"):
        moe(x, split_sizes=torch.tensor([1, 1, 1, 2]), residual=r)


# ------------------------------------------------------------------------ default names
class TwoExtras(fo.BasicOperation):
    """y = x + a * b (two unnamed extra inputs)."""

    num_extra_inputs = 2
    cpu_autograd = True

    def fuser_forward(self, ctxs, x, *, extra_inputs, **kwargs):
        a, b = extra_inputs[0]
        return x + a * b, [()]


class OneExtra(TwoExtras):
    num_extra_inputs = 1

    def fuser_forward(self, ctxs, x, *, extra_inputs, **kwargs):
        return x - extra_inputs[0][0], [()]


class BadNames(OneExtra):
    extra_input_names = ("a", "b")


def test_default_names_for_ops_that_name_none():
    seq = fo.Sequential(TwoExtras(), OneExtra())
    assert seq.extra_input_names == ("extra_input_0", "extra_input_1", "extra_input")
    x, a, b, c = _x(2, 3), _x(2, 3, seed=1), _x(2, 3, seed=2), _x(2, 3, seed=3)
    torch.testing.assert_close(seq(x, extra_input=c, extra_input_1=b, extra_input_0=a), x + a * b - c)
    with pytest.raises(TypeError, match=r"BadNames.extra_input_names has 2 name\(s\) for its 1 extra input"):
        fo.Sequential(BadNames())(x, a=a)


# ------------------------------------------------------------------------ errors
def _res2():
    return fo.Sequential(fo.AddExtraInput(), fo.RMSNorm(D), fo.AddExtraInput())


def test_count_errors_name_the_ops_and_their_inputs():
    x = torch.randn(2, D)
    with pytest.raises(TypeError) as e:
        fo.Sequential(fo.Linear(D, D), fo.AddExtraInput())(x)
    assert str(e.value) == ("Sequential expected 1 extra input after x, got 0. It takes, in this order (positionally "
                            "or by name): residual (AddExtraInput, module 1)")
    with pytest.raises(TypeError, match=r"expected 2 extra inputs after x, got 3.*residual_0 \(AddExtraInput, "
                                        r"module 0\), residual_1 \(AddExtraInput, module 2\)"):
        _res2()(x, x, x, x)
    with pytest.raises(TypeError, match="expected 0 extra inputs after x, got 1: none of its ops takes one"):
        fo.Sequential(fo.GELU())(x, x)


def test_keyword_errors():
    x = torch.randn(2, D)
    seq = fo.Sequential(fo.Linear(D, D), fo.AddExtraInput())
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'resid' \(did you mean 'residual'\?\); it takes: "
                                        r"residual \(AddExtraInput, module 1\)"):
        seq(x, resid=x)
    with pytest.raises(TypeError, match=r"two values for extra input 'residual' \(AddExtraInput, module 1\): one "
                                        r"positionally \(extra input 0 after x\) and one by name"):
        seq(x, x, residual=x)
    with pytest.raises(TypeError, match="unexpected keyword argument 'r': none of its ops takes an extra input"):
        fo.Sequential(fo.GELU())(x, r=x)
    two = _res2()
    with pytest.raises(TypeError, match=r"'residual' is shared by 2 ops \(AddExtraInput, module 0; AddExtraInput, "
                                        r"module 2\): pass residual_0=, residual_1="):
        two(x, residual=x)
    with pytest.raises(TypeError, match=r"expected 2 extra inputs after x, got 1: missing residual_1 \(AddExtraInput, "
                                        r"module 2\)"):
        two(x, residual_0=x)
    with pytest.raises(TypeError, match="expected 2 extra inputs after x, got 4"):
        two(x, x, x, x, residual_1=x)


# ------------------------------------------------------------------------ cost and caching
def test_the_name_table_is_built_with_the_sequential_and_cached():
    seq = fo.Sequential(fo.Linear(D, D), fo.AddExtraInput())
    table = seq._xnames  # built at construction: a first call traced by torch.compile finds it
    assert table is not None
    x = torch.randn(2, D)
    seq(x, x)
    seq(x, x)
    assert seq._xnames is table
    seq(x, residual=x)
    assert seq._xnames is table and seq._name_table() is table  # built once, reused
    seq.append(fo.AddExtraInput())  # the module list changed: rebuilt on next use
    assert seq._xnames is None
    assert seq.extra_input_names == ("residual_0", "residual_1")
    seq[2] = fo.ScaledSwiGLU()
    assert seq.extra_input_names == ("residual", "scales")
    del seq[1]
    assert seq.extra_input_names == ("scales",)
    seq.rules = fo.RuleSet()
    assert seq._xnames is None


# ------------------------------------------------------------------------ torch.compile
def test_keyword_calls_trace_without_graph_breaks_or_extra_recompiles():
    x, r = torch.randn(3, D, requires_grad=True), torch.randn(3, D)
    counts = {}
    for by_name in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        seq = fo.Sequential(fo.Linear(D, D), fo.AddExtraInput(), fo.LayerNorm(D))
        cnt = CompileCounter()
        compiled = torch.compile(seq, backend=cnt, fullgraph=True)  # (fullgraph: a graph break raises)
        frames = []
        for _ in range(4):
            y = compiled(x, residual=r) if by_name else compiled(x, r)
            frames.append(cnt.frame_count)
        torch.testing.assert_close(y, seq(x, r))
        assert frames[-1] == frames[-2]  # steady state: no recompile per call
        counts[by_name] = frames
    torch._dynamo.reset()
    assert counts[True] == counts[False]  # keywords cost no extra compile
    seq = fo.Sequential(fo.Linear(D, D), fo.AddExtraInput())
    out = torch._dynamo.explain(seq)(x, residual=r)
    torch._dynamo.reset()
    assert out.graph_break_count == 0
