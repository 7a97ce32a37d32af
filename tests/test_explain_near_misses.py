"""``Sequential.explain()``: near misses (rules one op away from matching, and what they lack), the
modules each plan line's basic ops belong to, and non-fusible modules as boundary lines.
``fusible_ops.rules.near_misses`` is checked on rule sets built from the built-in families, so
rules other families add do not change the expected lines."""

import pytest
import torch

import fusible_ops as fo
from fusible_ops.fusion_rules import bias_activation, grouped_mlp, residual_norm
from fusible_ops.rules import find_near_misses, near_misses

D, F = 8, 16


def _rs(*families):
    rs = fo.RuleSet()
    for family in families:
        for r in family.RULES:
            rs.add(r)
    return rs


def _rules(plan):
    return [row["rule"] for row in plan]


def _section(text, head):
    """The lines of explain()'s section starting at the line ``head`` (up to the next unindented line)."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(head))
    out = [lines[start]]
    for ln in lines[start + 1:]:
        if not ln.startswith("  "):
            break
        out.append(ln)
    return out


def _llama_mlp(bias=False):
    torch.manual_seed(0)
    return fo.Sequential(fo.RMSNorm(D), fo.Linear(D, 2 * F, bias=bias), fo.SwiGLU(), fo.Linear(F, D, bias=False),
                         fo.AddExtraInput())


# ------------------------------------------------------------------------ near misses
def test_bias_free_llama_mlp_says_what_is_missing():
    seq = _llama_mlp()
    x = torch.randn(3, D)
    seq(x, residual=x)
    assert "linear_bias_activation" not in _rules(seq.fusion_plan())
    text = seq.explain()
    assert ("  linear_bias_activation: needs a Bias between BasicLinear and SwiGLU (at ops 1-2, modules 1-2)"
            in _section(text, "near misses"))
    assert near_misses(_rs(bias_activation, residual_norm, grouped_mlp), seq.basic_ops()) == [
        "linear_bias_activation: needs a Bias between BasicLinear and SwiGLU (at ops 1-2)"]
    assert near_misses(_rs(bias_activation), seq.basic_ops(), offset=10) == [
        "linear_bias_activation: needs a Bias between BasicLinear and SwiGLU (at ops 11-12)"]


def test_with_the_bias_the_rule_fuses_and_is_no_near_miss():
    seq = _llama_mlp(bias=True)
    x = torch.randn(3, D)
    seq(x, x)
    assert _rules(seq.fusion_plan())[1] == "linear_bias_activation"
    assert not any("linear_bias_activation:" in ln for ln in _section(seq.explain(), "near misses"))


def test_wrong_class_names_what_was_found_and_needed():
    ops = [fo.GroupedLinear(4, D, 2 * F), fo.SwiGLU(), fo.BasicLinear(F, D)]
    assert near_misses(_rs(grouped_mlp), ops) == [
        "grouped_mlp, grouped_mlp_forward: op 2 is BasicLinear, needs a GroupedLinear (at ops 0-2)"]
    (m, _) = find_near_misses(_rs(grouped_mlp), ops)  # as data: one per rule (merged only in the text)
    assert (m.rule, m.kind, m.indices, m.at, m.class_ok) == ("grouped_mlp", "wrong", (0, 1, 2), 2, False)


def test_missing_first_or_last_element():
    rs = _rs(residual_norm)
    assert near_misses(rs, [fo.MakeExtraOutput(), fo.LayerNorm(D)]) == [
        "residual_extra_norm, residual_extra_norm_backward: needs an AddExtraInput before MakeExtraOutput (at ops 0-1)"]
    assert near_misses(rs, [fo.AddExtraInput(), fo.MakeExtraOutput()]) == [
        "residual_extra_norm, residual_extra_norm_backward: needs one of LayerNorm/RMSNorm after MakeExtraOutput "
        "(at ops 0-1)"]


class AddOne(fo.BasicOperation):
    def op_forward(self, ctx, x, **kwargs):
        return x + 1

    def op_backward(self, ctx, dy):
        return dy, ()


class Double(AddOne):
    def __init__(self, flag=True):
        super().__init__()
        self.flag = flag

    def op_forward(self, ctx, x, **kwargs):
        return 2 * x

    def op_backward(self, ctx, dy):
        return 2 * dy, ()


class Tripled(fo.FusedOperation):
    def fuser_forward(self, ctxs, x, *, extra_inputs, **kwargs):
        return 2 * (2 * (x + 1)), [(), (), ()]


def test_a_false_where_condition_is_a_near_miss():
    rs = fo.RuleSet()
    rs.register("one_double_double", [AddOne, Double, fo.match(Double, where=lambda op: op.flag)],
                pass_="forward", build=Tripled)
    seq = fo.Sequential(AddOne(), Double(), Double(flag=False), rules=rs)
    x = torch.zeros(1)
    assert seq(x).item() == 4 and _rules(seq.fusion_plan()) == [None, None, None]
    assert _section(seq.explain(), "near misses") == [
        "near misses:", "  one_double_double: op 2 (Double) fails the rule's condition (at ops 0-2, modules 0-2)"]
    seq[2].flag = True
    assert seq(x).item() == 4 and _rules(seq.fusion_plan()) == ["one_double_double"]
    assert seq.explain().splitlines()[-1] == "near misses: none"


def test_covered_and_short_and_unrelated_rules_are_not_near_misses():
    rs = _rs(bias_activation, residual_norm)
    # Linear + GELU without Dropout: linear_bias_activation matches, so the dropout rules are quiet
    assert near_misses(rs, [fo.BasicLinear(D, D), fo.Bias(D), fo.GELU()]) == []
    # a residual norm without extra output: residual_norm matches, residual_extra_norm is quiet
    assert near_misses(rs, [fo.AddExtraInput(), fo.LayerNorm(D)]) == []
    # two-element rules never (one op in common is no evidence), and unrelated ops share nothing
    assert near_misses(rs, [fo.Identity(), fo.GELU(), fo.Identity()]) == []  # (activation_dropout: 2 elements)
    assert near_misses(rs, [fo.AddExtraInput(), fo.Identity()]) == []  # (residual_norm: 2 elements)
    assert near_misses(rs, [fo.Identity(), fo.ConstantScale(2.0), fo.Reshape((-1,))]) == []
    seq = fo.Sequential(fo.GELU())
    seq(torch.randn(2, D))
    assert "near misses: none" in seq.explain()


def test_declined_rules_keep_their_reason_and_are_not_near_misses():
    seq = fo.Sequential(fo.Linear(4, 4), fo.ReLU(), fo.Dropout(0.5))
    seq.eval()
    text = seq.explain()
    assert "rule 'linear_bias_activation_dropout' (forward) on ops [0, 1, 2, 3]: dropout is inactive" in text
    assert not any("dropout" in ln for ln in _section(text, "near misses"))


def test_one_line_per_rule_leftmost_and_disabled_rules_skipped():
    torch.manual_seed(0)
    seq = fo.Sequential(fo.Linear(D, 2 * F, bias=False), fo.SwiGLU(), fo.Linear(F, 2 * F, bias=False), fo.SwiGLU())
    seq(torch.randn(2, D))
    lines = [ln for ln in _section(seq.explain(), "near misses") if "linear_bias_activation:" in ln]
    assert lines == ["  linear_bias_activation: needs a Bias between BasicLinear and SwiGLU (at ops 0-1, modules 0-1)"]
    with fo.fusion_rules.disabled("linear_bias_activation"):
        assert not any("linear_bias_activation:" in ln for ln in _section(seq.explain(), "near misses"))


def test_a_rule_matched_in_another_fuser_is_no_near_miss():
    torch.manual_seed(0)
    seq = fo.Sequential(fo.Linear(D, 2 * F), fo.SwiGLU(), torch.nn.Identity(),
                        fo.Linear(F, 2 * F, bias=False), fo.SwiGLU())
    seq(torch.randn(2, D))
    assert _rules(seq.fusion_plan())[0] == "linear_bias_activation"
    assert not any("linear_bias_activation:" in ln for ln in _section(seq.explain(), "near misses"))
    seq[0] = fo.Linear(D, 2 * F, bias=False)  # now neither fuser has it: the leftmost near miss, once
    seq(torch.randn(2, D))
    lines = [ln for ln in _section(seq.explain(), "near misses") if "linear_bias_activation:" in ln]
    assert lines == ["  linear_bias_activation: needs a Bias between BasicLinear and SwiGLU (at ops 0-1, modules 0-1)"]


# ------------------------------------------------------------------------ modules and boundaries
def test_plan_lines_show_modules():
    seq = fo.Sequential(fo.LayerNorm(D), fo.Linear(D, D), fo.GELU(), fo.Linear(D, D))
    seq(torch.randn(2, D))
    assert [r["indices"] for r in seq.fusion_plan()] == [(0,), (1, 2, 3), (4, 5)]
    fwd = _section(seq.explain(), "forward plan")
    assert fwd[1].startswith("  ops [0] (module 0): unfused (LayerNorm)")
    assert fwd[2].startswith("  ops [1, 2, 3] (modules 1-2): rule 'linear_bias_activation'")
    assert fwd[3].startswith("  ops [4, 5] (module 3): rule 'linear_bias'")


class Plain(torch.nn.Module):
    def forward(self, x):
        return x * 3


def test_non_fusible_modules_are_boundary_lines():
    torch.manual_seed(0)
    seq = fo.Sequential(fo.Linear(D, D), torch.nn.Dropout(0.1), fo.Linear(D, D), fo.GELU(), Plain(),
                        fo.AddExtraInput())
    x = torch.randn(2, D, requires_grad=True)
    seq(x, residual=x)
    assert _rules(seq.fusion_plan()) == ["linear_bias", "linear_bias_activation", None]  # a fuser on each side
    text = seq.explain()
    for head in ("forward plan", "backward plan"):
        lines = _section(text, head)
        b1 = lines.index("  -- module 1: torch.nn.Dropout (not fusible: a boundary) --")
        b4 = lines.index(f"  -- module 4: {__name__}.Plain (not fusible: a boundary) --")
        assert any(ln.startswith("  ops [0") and "(module 0)" in ln for ln in lines[:b1])
        assert any("(modules 2-3)" in ln or "(module 3)" in ln for ln in lines[b1:b4])
        assert any("(module 5)" in ln for ln in lines[b4:])


def test_existing_line_positions_are_kept():
    """Docs print explain().splitlines()[1]: the hooks line (or MoE routing) stays second."""
    seq = fo.Sequential(fo.Linear(D, D), fo.GELU(), torch.nn.Identity())
    seq[1].register_forward_hook(lambda *a: None)
    seq(torch.randn(2, D))
    lines = seq.explain().splitlines()
    assert lines[0].startswith("basic ops: [0] BasicLinear")
    assert lines[1].startswith("module [1] GELU has hooks: runs on its own")
    assert lines[2] == "forward plan:"
    assert lines.index("declined: none") < lines.index("near misses: none")


@pytest.mark.parametrize("pass_", ["forward", "backward"])
def test_fusion_plan_keys_unchanged(pass_):
    seq = fo.Sequential(fo.Linear(D, D), fo.GELU())
    seq(torch.randn(2, D, requires_grad=True))
    assert all(set(row) == {"rule", "op", "indices"} for row in seq.fusion_plan(pass_))
