"""torch.compile with the default (inductor) backend on CPU, training mode, fullgraph: a dropout
block and a mixture-of-experts block, forward + backward, against the eager modules.

Dropout draws its seed with ``torch.randint`` inside the graph. Inductor generates random numbers
with its own RNG unless ``torch._inductor.config.fallback_random`` is set, so these tests set it:
then the compiled run draws the same seeds as eager after the same ``torch.manual_seed``, and the
masks (a pure function of the seed) are identical.
"""


import pytest
import torch
import torch._inductor.config as inductor_config
import torch._inductor.cpp_builder

import fusible_ops as fo


def _have_cxx() -> bool:
    try:
        return bool(torch._inductor.cpp_builder.get_cpp_compiler())
    except Exception:  # no compiler found
        return False


pytestmark = pytest.mark.skipif(not _have_cxx(), reason="inductor on CPU needs a C++ compiler")




def _assert_no_graph_breaks(module, *inputs):
    out = torch._dynamo.explain(module)(*inputs)
    torch._dynamo.reset()
    reasons = [f"{r.user_stack[-1].filename}:{r.user_stack[-1].lineno} {r.reason.splitlines()[0]}"
               if r.user_stack else r.reason for r in out.break_reasons]
    assert out.graph_break_count == 0, f"{out.graph_break_count} graph breaks:\n" + "\n".join(reasons)


def _dropout_block():
    torch.manual_seed(0)
    return fo.Sequential(fo.Linear(8, 16), fo.GELU(), fo.Dropout(0.25), fo.Linear(16, 8))


def _moe_block():
    torch.manual_seed(0)
    return fo.Sequential(fo.GroupedLinear(4, 8, 16, bias=False), fo.SwiGLU(), fo.GroupedLinear(4, 8, 8, bias=False))


def _run(module, x, *extra, seed=None):
    """(y, dx, param grads) of one training step; params' grads are reset first."""
    for p in module.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_()
    if seed is not None:
        torch.manual_seed(seed)
    y = module(x, *extra)
    y.backward(torch.linspace(-1.0, 1.0, y.numel()).reshape(y.shape))
    return y.detach(), x.grad, [p.grad.clone() for p in module.parameters()]


def _compare(compiled_out, eager_out):
    (y_c, dx_c, g_c), (y_e, dx_e, g_e) = compiled_out, eager_out
    torch.testing.assert_close(y_c, y_e)
    torch.testing.assert_close(dx_c, dx_e)
    assert len(g_c) == len(g_e)
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b)


def test_dropout_block_inductor_fullgraph_matches_eager():
    seq = _dropout_block()
    seq.train()
    x = torch.randn(6, 8)
    _assert_no_graph_breaks(seq, x.clone().requires_grad_())
    with inductor_config.patch(fallback_random=True):
        compiled = torch.compile(seq, fullgraph=True)
        first = _run(compiled, x, seed=1)
        second = _run(compiled, x, seed=2)  # a new seed: a new mask, no recompile needed
    _compare(first, _run(seq, x, seed=1))
    _compare(second, _run(seq, x, seed=2))
    assert not torch.equal(first[0], second[0])  # different masks
    # the mask really is applied: a quarter of the dropout output is dropped, so compare with eval
    seq.eval()
    assert not torch.allclose(first[0], seq(x))


def test_moe_block_inductor_fullgraph_matches_eager():
    moe = _moe_block()
    x = torch.randn(6, 8)
    splits = torch.tensor([3, 0, 2, 1])
    _assert_no_graph_breaks(moe, x.clone().requires_grad_(), splits, splits)
    compiled = torch.compile(moe, fullgraph=True)
    out = _run(compiled, x, splits, splits)
    _compare(out, _run(moe, x, splits, splits))
