"""The gradient contract table, for every weight-owning op and every fused op that computes
weight gradients (discovered from the registry, so later ops and fusions are covered)."""

import copy
import itertools
import os
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import fusible_ops as fo
from fusible_ops.grad import WeightGradMixin
from fusible_ops.rules import global_rules
from fusible_ops.testing import assert_close_scaled, run_unfused

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rule_examples import classes, example_inputs, fires, main_output, rule_sequential  # noqa: E402


def _owns_weight(cls) -> bool:
    return isinstance(cls, type) and hasattr(cls, "register_wgrad_hook")


def _weight_ops(seq):
    return [op for op in seq.basic_ops() if isinstance(op, WeightGradMixin)]


def _subjects():
    subjects = []
    for name in fo.__all__:
        obj = getattr(fo, name)
        if _owns_weight(obj) and issubclass(obj, torch.nn.Module):
            subjects.append(pytest.param(("op", obj), id=f"op-{obj.__name__}"))
    for rule in global_rules().rules():
        if rule.pass_ in ("backward", "joint") and any(_owns_weight(c) for m in rule.pattern for c in classes(m.op_class)):
            subjects.append(pytest.param(("rule", rule), id=f"rule-{rule.name}"))
    return subjects


def _build(subject, seed=0):
    kind, what = subject
    if kind == "rule":
        seq = rule_sequential(what, seed)
        assert fires(seq, what), "the rule must fire in this test"
        return seq
    torch.manual_seed(seed)  # an op that cannot run alone (a Router) names the chain it runs in
    seq = fo.Sequential(*(what._contract_ops(5) if hasattr(what, "_contract_ops") else [what._example(5)[0]]))
    with torch.no_grad():
        for p in seq.parameters():
            p.uniform_(-1, 1)
    return seq


def _reference_wgrads(seq, inputs, grad_out):
    ref = copy.deepcopy(seq).to(torch.float64)
    for op in _weight_ops(ref):  # the reference is plain autograd
        op.accumulate_into_main_grad = op.delay_wgrad_compute = False
        op.weight.requires_grad_(True)
        op.weight.grad = None
    ins = [t.detach().double().requires_grad_() if t.is_floating_point() else t for t in inputs]
    out = main_output(run_unfused(ref, *ins))
    out.backward(grad_out.double())
    return [op.weight.grad for op in _weight_ops(ref)]


COMBOS = list(itertools.product([False, True], repeat=6))


@pytest.mark.parametrize("subject", _subjects())
@pytest.mark.parametrize("main_grad,added_attr,overwrite,zero_out,delayed,frozen", COMBOS)
def test_gradient_table(subject, main_grad, added_attr, overwrite, zero_out, delayed, frozen):
    seq = _build(subject)
    inputs = example_inputs(seq)
    wops = _weight_ops(seq)
    grad_out = torch.randn(main_output(seq(*inputs)).shape, generator=torch.Generator().manual_seed(3))
    expected = _reference_wgrads(seq, inputs, grad_out)
    hook_calls = []
    for op in wops:
        op.accumulate_into_main_grad = main_grad
        op.delay_wgrad_compute = delayed
        op.register_wgrad_hook(lambda: hook_calls.append(1))
        w = op.weight
        w.requires_grad_(not frozen)
        if added_attr:
            w.grad_added_to_main_grad = False
        if overwrite:
            w.overwrite_main_grad = True
        if zero_out:
            w.zero_out_wgrad = True
        if main_grad and not frozen:  # a frozen weight needs no main_grad at all
            w.main_grad = torch.randn(w.shape, dtype=torch.float32)
        if not main_grad and not frozen:
            w.grad = torch.randn_like(w)  # autograd / delayed add must keep it
    before = {id(op): (getattr(op.weight, "main_grad", None), op.weight.grad) for op in wops}
    before = {k: tuple(None if t is None else t.clone() for t in v) for k, v in before.items()}

    main_output(seq(*inputs)).backward(grad_out)

    for op in wops:
        w = op.weight
        mg0, g0 = before[id(op)]
        if frozen:
            assert w.grad is None and getattr(w, "main_grad", None) is None
            continue
        if delayed:  # nothing delivered yet
            assert w.skip_backward_post_hook is True
            if main_grad:
                assert torch.equal(w.main_grad, mg0) and w.grad is None
                if added_attr:
                    assert w.grad_added_to_main_grad is False
            else:
                assert torch.equal(w.grad, g0)
    seq.backward_dw()
    assert len(hook_calls) == (len(wops) if delayed and not frozen else 0)
    seq.backward_dw()  # nothing pending: does nothing
    assert len(hook_calls) == (len(wops) if delayed and not frozen else 0)

    for op, dw in zip(wops, expected):
        w = op.weight
        mg0, g0 = before[id(op)]
        if frozen:
            continue
        assert getattr(w, "skip_backward_post_hook", False) is False
        if main_grad:
            want = dw if overwrite else mg0.double() + dw
            assert_close_scaled(w.main_grad, want, torch.float32, "main_grad")
            if added_attr:
                assert w.grad_added_to_main_grad is True
                if delayed:
                    assert w.grad is None
                else:  # a dummy went to autograd
                    assert w.grad is not None and w.grad.shape == w.shape
                    if zero_out:
                        assert w.grad.abs().sum() == 0
            else:
                assert w.grad is None
        else:
            assert_close_scaled(w.grad, g0.double() + dw, torch.float32, "grad")


def test_subjects_cover_every_weight_owner():
    names = {p.values[0][1].__name__ for p in _subjects() if p.values[0][0] == "op"}
    assert {"BasicLinear", "Linear", "GroupedLinear"} <= names


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("subject", [s for s in _subjects() if s.values[0][0] == "op"])
def test_three_micro_batches_into_bf16_weights_fp32_main_grad(subject, overwrite):
    seq = _build(subject).to(torch.bfloat16)
    wops = _weight_ops(seq)
    for op in wops:
        op.accumulate_into_main_grad = True
        op.weight.main_grad = torch.zeros(op.weight.shape, dtype=torch.float32)
        if overwrite:
            op.weight.overwrite_main_grad = True
    total = [torch.zeros(op.weight.shape, dtype=torch.float64) for op in wops]
    for step in range(3):
        torch.manual_seed(10 + step)
        inputs = [t.to(torch.bfloat16) if t.is_floating_point() else t for t in example_inputs(seq)]
        inputs[0] = torch.randn_like(inputs[0]).requires_grad_()
        grad_out = torch.randn(main_output(seq(*inputs)).shape)
        ref = _reference_wgrads(seq, inputs, grad_out)
        main_output(seq(*inputs)).backward(grad_out.to(torch.bfloat16))
        total = [r if overwrite else t + r for t, r in zip(total, ref)]
    for op, want in zip(wops, total):
        assert op.weight.grad is None
        assert_close_scaled(op.weight.main_grad, want, torch.bfloat16, "main_grad")


def test_missing_or_bad_main_grad_raises():
    lin = fo.Sequential(fo.Linear(4, 3, accumulate_into_main_grad=True))
    with pytest.raises(RuntimeError, match="BasicLinear: accumulate_into_main_grad=True but the weight has no main_grad"):
        lin(torch.randn(2, 4, requires_grad=True)).sum().backward()
    gl = fo.GroupedLinear(3, 4, 2, accumulate_into_main_grad=True)
    gl.weight.main_grad = torch.zeros(2, 4, 3).transpose(1, 2)  # right numel, not viewable
    with pytest.raises(RuntimeError, match=r"GroupedLinear: main_grad must be one contiguous buffer viewable as \[3, 2, 4\].*stride"):
        gl(torch.randn(5, 4), torch.tensor([1, 2, 2])).sum().backward()
    gl.weight.main_grad = torch.zeros(24)  # flat buffer: viewable without a copy, accepted
    gl(torch.randn(5, 4), torch.tensor([1, 2, 2])).sum().backward()
    assert gl.weight.main_grad.abs().sum() > 0


def test_delayed_equals_immediate_and_scheduler_form():
    torch.manual_seed(0)
    base = fo.Sequential(fo.Linear(5, 6), fo.GELU(), fo.Linear(6, 4))
    x = torch.randn(3, 5, requires_grad=True)
    imm = copy.deepcopy(base)
    imm(x).sum().backward()
    # per-op flag, two backward passes queue up
    dly = copy.deepcopy(base)
    for m in (dly[0], dly[2]):
        m.basic_ops[0].delay_wgrad_compute = True
    dly(x).sum().backward()
    dly(x).sum().backward()
    assert dly[0].weight.grad is None and dly[0].bias.grad is not None
    dly.backward_dw()
    torch.testing.assert_close(dly[0].weight.grad, 2 * imm[0].weight.grad)
    torch.testing.assert_close(dly[2].weight.grad, 2 * imm[2].weight.grad)
    # scheduler form: no flags needed
    sch = copy.deepcopy(base)
    with fo.delayed_wgrad():
        sch(x).sum().backward()
    assert sch[0].weight.grad is None and sch[0].weight.skip_backward_post_hook
    fo.flush_wgrad()
    torch.testing.assert_close(sch[0].weight.grad, imm[0].weight.grad)
    torch.testing.assert_close(sch[2].weight.grad, imm[2].weight.grad)
    fo.flush_wgrad()  # nothing pending
    torch.testing.assert_close(sch[0].weight.grad, imm[0].weight.grad)


def test_sequential_backward_dw_reaches_nested_sequentials():
    inner = fo.Sequential(fo.Linear(4, 4, delay_wgrad_compute=True), fo.GELU())
    outer = fo.Sequential(fo.Linear(4, 4, delay_wgrad_compute=True), inner)
    outer(torch.randn(3, 4)).sum().backward()
    assert inner[0].weight.grad is None and inner[0].basic_ops[0].has_pending_wgrad()
    outer.backward_dw()
    assert outer[0].weight.grad is not None and inner[0].weight.grad is not None


def test_tied_weight_accumulates_both_uses():
    lin = fo.BasicLinear(4, 4)
    seq = fo.Sequential(lin, fo.ReLU(), lin)
    x = torch.randn(3, 4, requires_grad=True)
    seq(x).sum().backward()
    w = lin.weight.detach().clone().requires_grad_()
    torch.relu(x @ w.t()).matmul(w.t()).sum().backward()
    torch.testing.assert_close(lin.weight.grad, w.grad)
    lin.weight.grad = None
    lin.delay_wgrad_compute = True
    seq(x).sum().backward()
    lin.backward_dw()
    torch.testing.assert_close(lin.weight.grad, w.grad)


@pytest.mark.parametrize("delayed", [False, True])
def test_overwrite_main_grad_with_a_tied_weight_overwrites_once_per_backward(delayed):
    """The first use in a backward overwrites main_grad, later uses of that backward add."""
    lin = fo.BasicLinear(4, 4, accumulate_into_main_grad=True, delay_wgrad_compute=delayed)
    seq = fo.Sequential(lin, fo.ReLU(), lin)
    x = torch.randn(3, 4, requires_grad=True)
    w = lin.weight.detach().clone().requires_grad_()
    torch.relu(x @ w.t()).matmul(w.t()).sum().backward()
    lin.weight.main_grad = torch.full((4, 4), 100.0)
    lin.weight.overwrite_main_grad = True
    for _ in range(2):  # each backward starts over
        seq(x).sum().backward()
        lin.backward_dw()
        torch.testing.assert_close(lin.weight.main_grad, w.grad)


# ----------------------------------------------------------------------------- frozen weights
@pytest.mark.parametrize("make", [lambda: fo.BasicLinear(64, 32), lambda: fo.Linear(64, 32),
                                  lambda: fo.GroupedLinear(2, 64, 32)])
def test_frozen_weight_halves_backward_flops_and_saves_no_input(make):
    torch.manual_seed(0)
    op = make()
    extras = (torch.tensor([10, 6]),) if isinstance(op, fo.GroupedLinear) else ()
    seq = fo.Sequential(op)
    x = torch.randn(16, 64, requires_grad=True)
    y = seq(x, *extras)
    with FlopCounterMode(display=False) as c1:
        y.sum().backward()
    saved_trainable = _saved_bytes_call(seq, x, extras)
    op.weight.requires_grad_(False)
    y = seq(x, *extras)
    with FlopCounterMode(display=False) as c2:
        y.sum().backward()
    saved_frozen = _saved_bytes_call(seq, x, extras)
    if isinstance(op, fo.GroupedLinear):  # reference grouped GEMMs run per group: count them too
        assert c2.get_total_flops() * 2 == c1.get_total_flops()
    else:
        assert c1.get_total_flops() == 2 * 2 * 16 * 64 * 32
        assert c2.get_total_flops() == 2 * 16 * 64 * 32
    assert saved_trainable - saved_frozen == x.numel() * x.element_size()


def _saved_bytes_call(seq, x, extras):
    sizes = []

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        seq(x, *extras)
    return sum(sizes)


def test_input_without_grad_skips_dgrad_and_frozen_bias_skips_reduction():
    torch.manual_seed(0)
    seq = fo.Sequential(fo.Linear(64, 32))
    x = torch.randn(16, 64)
    y = seq(x)
    with FlopCounterMode(display=False) as c:
        y.sum().backward()
    assert c.get_total_flops() == 2 * 16 * 64 * 32  # wgrad only
    seq[0].bias.requires_grad_(False)
    seq[0].weight.requires_grad_(False)
    seq[0].bias.grad = seq[0].weight.grad = None
    y = seq(torch.randn(16, 64, requires_grad=True))
    y.sum().backward()
    assert seq[0].bias.grad is None
    norm = fo.Sequential(fo.LayerNorm(8))
    norm[0].weight.requires_grad_(False)
    norm[0].bias.requires_grad_(False)
    xx = torch.randn(3, 8, requires_grad=True)
    norm(xx).sum().backward()
    assert xx.grad is not None and norm[0].weight.grad is None and norm[0].bias.grad is None


def test_lora_chain_trains_without_main_grad_on_frozen_base():
    torch.manual_seed(0)
    base = fo.BasicLinear(16, 16, accumulate_into_main_grad=True)
    base.weight.requires_grad_(False)  # frozen base: no main_grad attached
    adapter_a = fo.BasicLinear(16, 4, accumulate_into_main_grad=True)
    adapter_b = fo.BasicLinear(4, 16, accumulate_into_main_grad=True)
    for a in (adapter_a, adapter_b):
        a.weight.main_grad = torch.zeros_like(a.weight)
    seq = fo.Sequential(base, fo.GELU(), adapter_a, adapter_b)
    x = torch.randn(8, 16)
    opt = torch.optim.SGD([adapter_a.weight, adapter_b.weight], lr=0.1)
    losses = []
    for _ in range(5):
        loss = seq(x).pow(2).mean()
        loss.backward()
        for a in (adapter_a, adapter_b):
            a.weight.grad = a.weight.main_grad.clone()
            a.weight.main_grad.zero_()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert base.weight.grad is None
