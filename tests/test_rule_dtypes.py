"""Every built-in fusion rule returns what the same ops unfused return: the same dtype for every
output and gradient, and values within the tolerance table (against the unfused ops in float64).

One small Sequential per rule from tests/rule_examples.py, in float64 and float32 on CPU, with
CPU autograd of the fused forward (the default) and with the fused op's own backward (as on CUDA).
Every built-in rule runs here: the comm rules with their checker set aside (they decline a
one-rank group), ``grouped_mlp_forward`` in a call without grad (its only use).
"""

import copy
import os
import sys

import pytest
import torch

import fusible_ops as fo
from fusible_ops.fuser import cpu_autograd
from fusible_ops.testing import assert_close_scaled, run_unfused

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rule_examples import WIDTH, example_inputs, fires, fires_in_inference, rule_sequential  # noqa: E402

SEED = 1234
DTYPES = (torch.float64, torch.float32)


def _cases():
    for rule in fo.RuleSet.builtin().rules():
        for dtype in DTYPES:
            yield pytest.param(rule, dtype, id=f"{rule.name}-{str(dtype)[6:]}")


def _outputs(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _run(seq, inputs, run, grads_out):
    """Outputs, then the gradients of the floating inputs and of every parameter, of ``run(seq,
    *inputs)`` on fresh copies of the inputs (None where a gradient is missing)."""
    ins = [t.detach().clone().requires_grad_(t.requires_grad) if t.is_floating_point() else t for t in inputs]
    for p in seq.parameters():
        p.grad = None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)  # (dropout draws the same mask in every run)
        outs = _outputs(run(seq, *ins))
    diff = [(o, g.to(o.dtype)) for o, g in zip(outs, grads_out) if o.requires_grad]
    if diff:
        torch.autograd.backward(*zip(*diff))
    named = {f"output {i}": o.detach() for i, o in enumerate(outs)}
    named.update({f"grad of input {i}": t.grad for i, t in enumerate(ins) if t.is_floating_point() and t.requires_grad})
    named.update({f"grad of {n}": p.grad for n, p in seq.named_parameters()})
    return named


@pytest.mark.parametrize("rule,dtype", list(_cases()))
def test_fused_plan_returns_what_the_unfused_ops_return(rule, dtype):
    seq = rule_sequential(rule).to(dtype)
    inputs = [t.detach().to(dtype).requires_grad_() if t.is_floating_point() else t  # (extra inputs' gradients too)
              for t in example_inputs(seq, WIDTH)]
    training = fires(seq, rule, *inputs)
    if not training:  # a rule for inference calls (grouped_mlp_forward)
        inputs = [t.detach() for t in inputs]
        assert fires_in_inference(seq, rule), f"{rule.name} must fire in this test"
    with torch.random.fork_rng(devices=[]), torch.set_grad_enabled(training):
        torch.manual_seed(SEED)
        shapes = [o.shape for o in _outputs(seq(*inputs))]
    gen = torch.Generator().manual_seed(4321)
    grads_out = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    ref64 = copy.deepcopy(seq).to(torch.float64)
    ins64 = [t.double() if t.is_floating_point() else t for t in inputs]
    for own_backward in (False, True):  # CPU autograd of the fused forward; the fused op's own backward
        with cpu_autograd(not own_backward), torch.set_grad_enabled(training):
            fused = _run(seq, inputs, lambda s, *a: s(*a), grads_out)
            unfused = _run(copy.deepcopy(seq), inputs, run_unfused, grads_out)
            ref = _run(ref64, ins64, run_unfused, grads_out)
        assert fused.keys() == unfused.keys()
        for what, got in fused.items():
            want, exact = unfused[what], ref[what]
            where = f"{rule.name}, {dtype}, {'own backward' if own_backward else 'CPU autograd'}: {what}"
            assert (got is None) == (want is None), f"{where}: fused {got is not None}, unfused {want is not None}"
            if got is None:
                continue
            assert got.dtype == want.dtype, f"{where}: fused {got.dtype}, unfused {want.dtype}"
            assert_close_scaled(got, exact, dtype, where)
