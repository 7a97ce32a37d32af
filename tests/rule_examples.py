"""One small Sequential per fusion rule, built from the ops' ``_example``s, and its inputs: the
catalogue the tests that cover every rule share (tests/test_grad_contract.py, tests/test_rule_dtypes.py),
so a new rule is covered by all of them once its ops have an ``_example``."""

import pytest
import torch

import fusible_ops as fo
from fusible_ops.ops.moe import routing_layout
from fusible_ops.rules import rule as make_rule

ROWS = 7
WIDTH = 6
"""The input width of every rule_sequential."""


def classes(matcher_cls) -> tuple:
    """The op classes a pattern element accepts."""
    return matcher_cls if isinstance(matcher_cls, tuple) else (matcher_cls,)


def main_output(out):
    """The main output (ops with extra outputs, e.g. a Router's aux loss, return a tuple)."""
    return out[0] if isinstance(out, tuple) else out


def rule_passes(rule) -> tuple:
    """The plan passes a rule appears in (a joint rule: both)."""
    return ("forward", "backward") if rule.pass_ == "joint" else (rule.pass_,)


def fires(seq, rule, *inputs) -> bool:
    """Whether ``rule`` is in ``seq``'s plan of every pass it belongs to, for ``inputs`` (default:
    a training call) in the current grad mode."""
    return all(rule.name in [g["rule"] for g in seq.fusion_plan(p, *inputs)] for p in rule_passes(rule))


def fires_in_inference(seq, rule) -> bool:
    """Whether ``rule`` is in ``seq``'s plan of a call without grad (a forward-only rule for
    inference, e.g. ``grouped_mlp_forward``)."""
    with torch.no_grad():
        return fires(seq, rule, *[t.detach() for t in example_inputs(seq, WIDTH)])


def unchecked(rule):
    """The built-in rules with ``rule``'s checker set aside."""
    rs = fo.RuleSet.builtin()
    rs.add(make_rule(rule.name, rule.pattern, pass_=rule.pass_, build=rule.build, priority=rule.priority))
    return rs


def rule_sequential(rule, seed: int = 0):
    """A float32 CPU Sequential of the ``_example`` of each of ``rule``'s pattern elements (the first
    class whose example matches; input width ``WIDTH``), wrapped in the Router / Dispatch / Combine
    a MoE span runs between; parameters uniform in [-1, 1]. Where the rule declines in one CPU
    process, in training and in inference (the comm rules: a one-rank group), its checker is set
    aside (``seq.rules``), so the fused op runs."""
    torch.manual_seed(seed)
    ops, n = [], WIDTH
    for m in rule.pattern:
        for cls in classes(m.op_class):
            op, n_out = cls._example(n)
            if m.matches(op):
                break
        else:
            pytest.fail(f"rule {rule.name}: no _example of {m} matches the pattern")
        ops.append(op)
        n = n_out
    if getattr(ops[0], "routing_role", None) == "dispatch":  # a MoE span runs between its Router and Combine
        experts = next(op.num_groups for op in ops if isinstance(op, fo.GroupedLinear))
        ops = [fo.Router(WIDTH, experts, top_k=2), *ops, *([] if isinstance(ops[-1], fo.Combine) else [fo.Combine()])]
    elif isinstance(ops[-1], fo.Combine):  # a span ending at Combine (moe_combine: FC2 without a bias)
        experts = next(op.num_groups for op in ops if isinstance(op, fo.GroupedLinear))
        ops = [fo.GroupedLinear(op.num_groups, op.in_features, op.out_features, bias=False)
               if isinstance(op, fo.GroupedLinear) else op for op in ops]
        ops = [fo.Router(WIDTH, experts, top_k=2), fo.Dispatch(), *ops]
    seq = fo.Sequential(*ops)
    if not fires(seq, rule) and not fires_in_inference(seq, rule):  # declined in one CPU process
        seq.rules = unchecked(rule)  # (the comm rules: a one-rank group)
    with torch.no_grad():
        for p in seq.parameters():
            p.uniform_(-1, 1)
    return seq


def extra_inputs(seq, h: int) -> list:
    """The extra inputs of ``seq``'s ops for an input of ``ROWS`` rows and ``h`` features (float32)."""
    extras, g = [], torch.Generator().manual_seed(1)
    layout = routing_layout(seq.basic_ops())
    for i, op in enumerate(seq.basic_ops()):
        if layout is not None and layout.feeds[i]:
            pass  # a routed GroupedLinear (MoE): its split sizes come from the Router
        elif isinstance(op, fo.GroupedLinear):
            extras.append(torch.tensor([3, 0, ROWS - 3]))
        elif isinstance(op, fo.ScaledSwiGLU):
            extras.append(torch.rand(ROWS, generator=g))
        elif isinstance(op, fo.AddExtraInput):
            extras.append(torch.randn(ROWS, h, generator=g))
        elif isinstance(op, fo.CrossEntropy):  # (class ids of the h logits)
            extras.append(torch.randint(0, h, (ROWS,), generator=g))
        if hasattr(op, "out_features"):
            h = op.out_features if isinstance(op.out_features, int) else h
    return extras


def example_inputs(seq, width=None) -> list:
    """``[x, *extra inputs]`` for ``seq`` (float32; x requires grad): ``width`` features (default: the
    first op's ``in_features`` that has one; comm ops keep the width)."""
    if width is None:
        width = next(op for op in seq.basic_ops() if hasattr(op, "in_features")).in_features
    x = torch.randn(ROWS, width, generator=torch.Generator().manual_seed(2), requires_grad=True)
    return [x, *extra_inputs(seq, x.shape[-1])]
