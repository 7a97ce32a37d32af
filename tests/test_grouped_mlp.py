"""Fused grouped MLP (MoE experts): plan, reference match, frozen experts, interpreter and GPU runs,
CUDA-graph replay with changing split sizes."""

import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import fusible_ops as fo
from fusible_ops.testing import assert_matches_reference

ACTS = {
    "swiglu": fo.SwiGLU,
    "geglu": fo.GEGLU,
    "geglu_tanh": lambda: fo.GEGLU("tanh"),
    "scaled_swiglu": fo.ScaledSwiGLU,
}


def _mlp(act, G=4, H=6, F=5, bias=True, dtype=torch.float32, device="cpu", seed=0):
    torch.manual_seed(seed)
    seq = fo.Sequential(
        fo.GroupedLinear(G, H, 2 * F, bias=bias, dtype=dtype, device=device),
        ACTS[act](),
        fo.GroupedLinear(G, F, H, bias=bias, dtype=dtype, device=device),
    )
    with torch.no_grad():
        for p in seq.parameters():
            p.uniform_(-1, 1)
    return seq


def _inputs(act, splits, H=6, dtype=torch.float32, device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    rows = int(splits.sum())
    x = torch.randn(rows, H, generator=g).to(device, dtype).requires_grad_()
    splits = splits.to(device)
    if act == "scaled_swiglu":
        s = torch.rand(rows, generator=g).to(device, dtype).requires_grad_()
        return (x, splits, s, splits)
    return (x, splits, splits)


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("bias", [True, False])
def test_plan_and_reference(act, bias):
    seq = _mlp(act, bias=bias)
    assert [r["rule"] for r in seq.fusion_plan()] == ["grouped_mlp"]
    assert [r["rule"] for r in seq.fusion_plan("backward")] == ["grouped_mlp"]
    for splits in ([3, 0, 5, 1], [0, 0, 0, 0], [9, 0, 0, 0]):
        assert_matches_reference(seq, *_inputs(act, torch.tensor(splits)))


def test_inference_uses_forward_rule_and_mismatch_declines():
    seq = _mlp("swiglu")
    with torch.no_grad():
        assert [r["rule"] for r in seq.fusion_plan()] == ["grouped_mlp_forward"]
        y = seq(*_inputs("swiglu", torch.tensor([2, 2, 2, 2])))
    torch.testing.assert_close(y, seq[2].reference_forward(
        fo.SwiGLU().reference_forward(seq[0].reference_forward(*_inputs("swiglu", torch.tensor([2, 2, 2, 2]))[:2])),
        torch.tensor([2, 2, 2, 2])))
    bad = fo.Sequential(fo.GroupedLinear(4, 6, 10), fo.SwiGLU(), fo.GroupedLinear(3, 5, 6))
    assert "rule 'grouped_mlp' (joint) on ops [0, 1, 2]: FC1 has 4 groups, FC2 3" in bad.explain()


def test_differing_split_sizes_raise():
    seq = _mlp("swiglu")
    x = torch.randn(8, 6)
    with pytest.raises(ValueError, match="split sizes differ"):
        seq(x, torch.tensor([2, 2, 2, 2]), torch.tensor([1, 3, 2, 2]))


@pytest.mark.parametrize("frozen", ["fc1", "fc2", "both"])
def test_frozen_expert_weights_cost_no_wgrad(frozen):
    seq = _mlp("swiglu", G=2, H=16, F=8, bias=False)
    x, splits, _ = _inputs("swiglu", torch.tensor([5, 3]), H=16)

    def flops():
        y = seq(x, splits, splits)
        with FlopCounterMode(display=False) as c:
            y.sum().backward()
        return c.get_total_flops()

    full = flops()
    if frozen in ("fc1", "both"):
        seq[0].weight.requires_grad_(False)
    if frozen in ("fc2", "both"):
        seq[2].weight.requires_grad_(False)
    fc1_wgrad = 2 * 8 * 16 * 16
    fc2_wgrad = 2 * 8 * 8 * 16
    saved = {"fc1": fc1_wgrad, "fc2": fc2_wgrad, "both": fc1_wgrad + fc2_wgrad}[frozen]
    assert flops() == full - saved
    assert_matches_reference(seq, x, splits, splits)


def test_interpreter_runs_triton_kernels_fp32():
    """The fused op through the Triton kernels (CPU interpreter), against the reference path."""
    from fusible_ops.kernels import interpreter_enabled

    if not interpreter_enabled():
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest without a GPU)")
    for act in ("swiglu", "scaled_swiglu"):
        seq = _mlp(act, G=3, H=8, F=6)
        inputs = _inputs(act, torch.tensor([5, 0, 4]), H=8)
        with fo.kernels.use("triton"):
            assert_matches_reference(seq, *inputs)


# ------------------------------------------------------------------------------------- GPU
GPU_CASES = [(a, torch.bfloat16) for a in ACTS] + [("swiglu", torch.float16), ("scaled_swiglu", torch.float32)]


@pytest.mark.gpu
@pytest.mark.parametrize("act,dtype", GPU_CASES)
def test_gpu_matches_reference_odd_sizes(act, dtype, monkeypatch):
    from fusible_ops.kernels import launch

    monkeypatch.setattr(launch, "AUTOTUNE", False)  # fixed configs: no tuning pass per shape
    seq = _mlp(act, G=5, H=72, F=40, dtype=dtype, device="cuda")
    assert_matches_reference(seq, *_inputs(act, torch.tensor([37, 0, 129, 1, 66]), H=72, dtype=dtype, device="cuda"))


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_changing_splits():
    torch.manual_seed(0)
    G, H, F, rows = 4, 64, 48, 200
    seq = _mlp("swiglu", G=G, H=H, F=F, dtype=torch.bfloat16, device="cuda")
    for op in (seq[0], seq[2]):  # gradients land in preallocated buffers (no allocation at replay)
        op.accumulate_into_main_grad = True
        op.weight.main_grad = torch.zeros(op.weight.shape, device="cuda", dtype=torch.float32)
        op.weight.overwrite_main_grad = True
    x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    splits = torch.tensor([50, 50, 50, 50], device="cuda")
    gy = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)

    def step():
        y = seq(x, splits, splits)
        (dx,) = torch.autograd.grad(y, [x], gy)
        return y, dx

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up: autotuning and plans happen outside capture
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_s, dx_s = step()

    ref = copy.deepcopy(seq)
    for op in (ref[0], ref[2]):
        op.accumulate_into_main_grad = False
    for new in ([10, 0, 150, 40], [200, 0, 0, 0], [1, 2, 3, 194]):
        splits.copy_(torch.tensor(new))
        graph.replay()
        torch.cuda.synchronize()
        for p in ref.parameters():
            p.grad = None
        xr = x.detach().clone().requires_grad_()
        yr = ref(xr, splits.clone(), splits.clone())
        yr.backward(gy)
        from fusible_ops.testing import assert_close_scaled

        assert_close_scaled(y_s, yr, torch.bfloat16, f"y {new}")
        assert_close_scaled(dx_s, xr.grad, torch.bfloat16, f"dx {new}")
        for op, r in ((seq[0], ref[0]), (seq[2], ref[2])):
            assert_close_scaled(op.weight.main_grad, r.weight.grad.float(), torch.bfloat16, f"dW {new}")
