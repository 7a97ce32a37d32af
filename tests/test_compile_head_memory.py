"""The chunked linear + cross-entropy head (rule ``linear_cross_entropy``) under ``torch.compile``
(inductor, CPU): how many chunk-sized buffers the generated code holds at once, forward and
backward, both schedules (gradients in forward; logits recomputed in backward).

Read from inductor's output code (``run_and_get_code``): every ``bufN = empty_strided_cpu(shape,
...)`` is a new buffer, ``bufA = bufB; del bufB  # reuse`` hands one over, ``del bufN`` frees it.
The largest number of live buffers of one shape is what the compiled step holds at its peak.

* Triton kernels (the GPU's graph; run here by Triton's interpreter): the cross-entropy kernel
  writes each chunk's gradient over its logits (one chunk buffer), and the weight gradient is
  accumulated in place by the custom op behind ``linear_wgrad_chain`` (traced as a functional
  ``addmm`` chain, inductor alternated two weight-sized buffers through the chunk loop).
* The CPU torch twins: traced as plain torch ops, inductor fused every chunk's ``z[target]``
  gather into the final loss reduction and held all chunks' logits at once; under compile the
  in-place entry points now run them as opaque custom ops, one chunk buffer at a time.
"""

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import fusible_ops as fo
import test_compile_cpu
from fusible_ops.fusion_rules import linear_ce


pytestmark = test_compile_cpu.pytestmark  # (inductor on CPU needs a C++ compiler)

D, V, T, ROWS = 32, 256, 512, 64  # 8 chunks of 64 rows


def max_live(code: str, shape: tuple) -> int:
    """The most buffers of ``shape`` alive at once in inductor's generated ``call``: made by
    ``empty_strided_*`` or returned by an opaque op (first named in its ``assert_size_stride``)."""
    live, seen, peak = set(), set(), 0
    body = code[code.index("def call("):]
    for line in body.splitlines():
        m = re.match(r"\s*(buf\d+) = (buf\d+); del (buf\d+)\s+# reuse", line)
        if m:
            seen.add(m.group(1))
            if m.group(2) in live:
                live.discard(m.group(2))
                live.add(m.group(1))
            continue
        m = (re.match(r"\s*(buf\d+) = empty_strided_\w+\((\([^)]*\))", line)
             or re.match(r"\s*assert_size_stride\((buf\d+), (\([^)]*\))", line))
        if m:
            if m.group(1) not in seen and tuple(int(v) for v in re.findall(r"\d+", m.group(2))) == tuple(shape):
                live.add(m.group(1))
                peak = max(peak, len(live))
            seen.add(m.group(1))
            continue
        m = re.match(r"\s*del (buf\d+)\s*$", line)
        if m:
            live.discard(m.group(1))
    return peak


def _codes(monkeypatch, mode: str, early: bool) -> list:
    """Inductor's code (forward, backward) of one training step of the head, checked against eager."""
    monkeypatch.setattr(linear_ce, "CHUNK_BYTES", ROWS * V * 4)
    monkeypatch.setattr(linear_ce, "GRAD_IN_FORWARD", early)
    assert linear_ce.chunk_rows(V, T, 4) == ROWS
    torch.manual_seed(0)
    seq = fo.Sequential(fo.Linear(D, V, bias=False), fo.CrossEntropy())
    x = torch.randn(T, D, requires_grad=True)
    t = torch.randint(0, V, (T,))
    ref = fo.Sequential(fo.Linear(D, V, bias=False), fo.CrossEntropy())
    ref.load_state_dict(seq.state_dict())
    xr = x.detach().clone().requires_grad_()
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b: seq(a, b), fullgraph=True)

    def step():
        loss = compiled(x, t)
        loss.backward()
        return loss

    with fo.kernels.use(mode):
        loss, codes = run_and_get_code(step)
        ref_loss = ref(xr, t)
        ref_loss.backward()
    torch._dynamo.reset()
    assert seq.fusion_plan()[0]["rule"] == "linear_cross_entropy"
    rtol, atol = fo.testing.tolerances.TOLERANCES[torch.float32]
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol)
    torch.testing.assert_close(x.grad, xr.grad, rtol=rtol, atol=atol)
    torch.testing.assert_close(seq[0].weight.grad, ref[0].weight.grad, rtol=rtol, atol=atol)
    assert len(codes) == 2
    return codes


def test_max_live_reads_reuse_and_del():
    code = ("def call(args):\n"
            "    buf0 = empty_strided_cpu((4, 8), (8, 1), torch.float32)\n"
            "    buf1 = empty_strided_cpu((4, 8), (8, 1), torch.float32)\n"
            "    del buf0\n"
            "    buf2 = buf1; del buf1  # reuse\n"
            "    buf3 = empty_strided_cpu((4, 8), (8, 1), torch.float32)\n"
            "    buf4 = empty_strided_cpu((4, ), (1, ), torch.float32)\n"
            "    buf5 = torch.ops.fusible_ops.linear_fprop_again.default(buf4, buf4)\n"
            "    assert_size_stride(buf5, (4, 8), (8, 1), 'torch.ops.fusible_ops.linear_fprop_again.default')\n"
            "    assert_size_stride(buf3, (4, 8), (8, 1), 'input')\n")
    assert max_live(code, (4, 8)) == 3
    assert max_live(code, (4,)) == 1


SCHEDULES = pytest.mark.parametrize("early", [True, False], ids=["grad_in_forward", "recompute"])


@pytest.mark.interpreter
@SCHEDULES
def test_compiled_head_holds_one_chunk_and_one_wgrad_buffer(monkeypatch, early):
    codes = _codes(monkeypatch, "triton", early)
    assert "fusible_ops.wgrad_into_" in codes[0 if early else 1]
    for code in codes:  # logits, then their gradient in place; the weight gradient accumulated in place
        assert max_live(code, (ROWS, V)) <= 1 and max_live(code, (V, D)) <= 1


@SCHEDULES
def test_compiled_reference_head_holds_one_chunk_and_one_wgrad_buffer(monkeypatch, early):
    codes = _codes(monkeypatch, "reference", early)
    assert "fusible_ops.ce_loss_grad_ref_" in codes[0] if early else "fusible_ops.ce_grad_ref_" in codes[1]
    for code in codes:
        assert max_live(code, (ROWS, V)) <= 1 and max_live(code, (V, D)) <= 1
