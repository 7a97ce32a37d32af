"""FP8 grouped linears and the grouped MLP under fusible_ops.autocast (per-tensor recipes).

CPU: emulation (real FP8 casts, fp32 math on the dequantized operands). GPU (marked ``gpu``):
the Triton FP8 grouped GEMMs, compared with float64 math by SQNR and with the CPU emulation.
"""

from __future__ import annotations

import copy

import pytest
import torch

import fusible_ops as fo
import fusible_ops.quantization.casting as Q
from fusible_ops.ops import fp8_grouped
from fusible_ops.testing import SQNR_DB, TOLERANCES, assert_sqnr

RECIPES = {"current": fo.Float8CurrentScaling(), "delayed": fo.Float8DelayedScaling(amax_history_len=4),
           "e4m3": fo.Float8CurrentScaling(fp8_format="e4m3")}


@pytest.fixture(autouse=True)
def _fp8_weight_gradients(monkeypatch):
    """These tests hold the FP8 weight gradient to the tables at their small expert sizes (pinned,
    whatever the default): the 16-bit one that FP8_WGRAD_MIN_ROWS > 0 selects has its own tests
    (below)."""
    monkeypatch.setattr(fp8_grouped, "FP8_WGRAD_MIN_ROWS", 0)


def _moe(device="cpu", dtype=torch.float32, e=4, h=64, f=96, act=fo.SwiGLU, bias=False, seed=0, **kw):
    torch.manual_seed(seed)
    return fo.Sequential(fo.GroupedLinear(e, h, 2 * f, bias=bias, device=device, dtype=dtype, **kw), act(),
                         fo.GroupedLinear(e, f, h, bias=bias, device=device, dtype=dtype, **kw))


def _inputs(splits, h=64, device="cpu", dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    t = sum(splits)
    x = torch.randn(t, h, generator=g).to(device, dtype)
    dy = torch.randn(t, h, generator=g).to(device, dtype)
    return x, dy, torch.tensor(splits, dtype=torch.int64, device=device)


def _extra(seq, splits):
    return (splits,) * sum(isinstance(m, fo.GroupedLinear) for m in seq)


def _run(seq, x, dy, splits, recipe, steps=1):
    x = x.detach().clone().requires_grad_()
    for _ in range(steps):
        with fo.autocast(recipe=recipe):
            y = seq(x, *_extra(seq, splits))
        y.backward(dy)
    return y, x.grad


def _ref64(seq, x, dy, splits):
    ref = copy.deepcopy(seq).to("cpu", torch.float64)
    xr = x.detach().to("cpu", torch.float64).requires_grad_()
    y = ref(xr, *_extra(ref, splits.cpu()))
    y.backward(dy.to("cpu", torch.float64))
    return y, xr.grad, ref


def _dense_fp8_baseline(seq, x, splits, recipe):
    """The same MLP per expert through the dense FP8 linears (fo.Linear), forward only: the
    error FP8 itself costs on this chain, which the grouped path must match."""
    fc1, act, fc2 = seq
    outs, start = [], 0
    for g, n in enumerate(splits.tolist()):
        dense = fo.Sequential(fo.Linear(fc1.in_features, fc1.out_features, bias=fc1.bias is not None), type(act)(),
                              fo.Linear(fc2.in_features, fc2.out_features, bias=fc2.bias is not None)).to(x.device, x.dtype)
        with torch.no_grad():
            for lin, grouped in ((dense[0], fc1), (dense[2], fc2)):
                lin.weight.copy_(grouped.weight[g])
                if grouped.bias is not None:
                    lin.bias.copy_(grouped.bias[g])
            if n:
                with fo.autocast(recipe=recipe):
                    outs.append(dense(x[start:start + n]))
        start += n
    return torch.cat(outs)


def test_single_grouped_linear_meets_the_sqnr_table():
    lin = fo.Sequential(fo.GroupedLinear(4, 64, 96, bias=True))
    x, _, splits = _inputs([40, 0, 57, 31])
    dy = torch.randn(128, 96, generator=torch.Generator().manual_seed(5))
    for name, recipe in RECIPES.items():
        lin.zero_grad(set_to_none=True)
        y, dx = _run(lin, x, dy, splits, recipe)
        y64, dx64, ref = _ref64(lin, x, dy, splits)
        fmt = recipe.fp8_format
        assert_sqnr(y, y64, SQNR_DB["output", fmt], msg=f"{name} y")
        assert_sqnr(dx, dx64, SQNR_DB["grad", fmt], msg=f"{name} dx")
        assert_sqnr(lin[0].weight.grad, ref[0].weight.grad, SQNR_DB["grad", fmt], msg=f"{name} dw")
        assert_sqnr(lin[0].bias.grad, ref[0].bias.grad, SQNR_DB["grad", fmt], msg=f"{name} db")


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_mlp_sqnr_and_fused_fp8_plan(recipe, bias):
    """Against float64 math (empty groups included): the output is as accurate as the same MLP
    through the dense FP8 linears (four per-tensor FP8 casts before a GLU product cost more than
    the table's 25 dB on this chain: ~23.5 dB, dense and grouped alike), the gradients meet the
    table. The fused grouped MLP runs (in FP8)."""
    from fusible_ops.testing import sqnr

    recipe = RECIPES[recipe]
    seq = _moe(bias=bias)
    x, dy, splits = _inputs([40, 0, 57, 31])
    y, dx = _run(seq, x, dy, splits, recipe)
    y64, dx64, ref = _ref64(seq, x, dy, splits)
    fmt = recipe.fp8_format
    baseline = sqnr(_dense_fp8_baseline(seq, x, splits, recipe), y64)
    assert_sqnr(y, y64, baseline - 1.0, msg=f"y (dense FP8 baseline {baseline:.2f} dB)")
    assert_sqnr(dx, dx64, SQNR_DB["grad", fmt], msg="dx")
    for i in (0, 2):
        w, wr = seq[i].weight.grad, ref[i].weight.grad
        assert_sqnr(w, wr, SQNR_DB["grad", fmt], msg=f"dw{i}")
        assert torch.count_nonzero(w[1]) == 0  # the empty group's gradient
        if bias:
            assert_sqnr(seq[i].bias.grad, ref[i].bias.grad, SQNR_DB["grad", fmt], msg=f"db{i}")
    with fo.autocast(recipe=recipe):
        assert [r["rule"] for r in seq.fusion_plan()] == ["grouped_mlp"]  # the last call's plan: fused, in FP8
        assert [r["rule"] for r in seq.fusion_plan("backward")] == ["grouped_mlp"]
        assert "FP8 grouped GEMMs" in seq.explain(x, splits, splits)


def test_fp8_grouped_differs_from_high_precision():
    """The GEMMs really run on FP8 values: the result equals float64 math on the quantized
    operands far better than float64 math on the originals."""
    from fusible_ops.testing import quantized_reference, sqnr

    lin = fo.GroupedLinear(2, 64, 32, bias=False)
    x, _, splits = _inputs([30, 34])
    recipe = RECIPES["current"]
    with fo.autocast(recipe=recipe):
        y = fo.Sequential(lin)(x, splits)
    xq = quantized_reference(x, recipe, "input")
    wq = quantized_reference(lin.weight.detach(), recipe, "weight")
    yq = torch.cat([xq[:30] @ wq[0].t(), xq[30:] @ wq[1].t()])
    y64 = torch.cat([x[:30].double() @ lin.weight[0].double().t(), x[30:].double() @ lin.weight[1].double().t()])
    assert sqnr(y, yq) > 100 and sqnr(y, y64) < 40


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_main_grad_delayed_and_frozen(recipe):
    recipe = RECIPES[recipe]
    seq, plain = _moe(accumulate_into_main_grad=True, delay_wgrad_compute=True), _moe()
    fc1 = seq[0]
    fc1.weight.main_grad = torch.zeros(fc1.weight.shape)
    seq[2].weight.main_grad = torch.full(seq[2].weight.shape, 0.5)
    x, dy, splits = _inputs([16, 48, 0, 64])
    _run(seq, x, dy, splits, recipe)
    assert torch.count_nonzero(fc1.weight.main_grad) == 0  # delayed until backward_dw()
    seq.backward_dw()
    _run(plain, x, dy, splits, recipe)
    torch.testing.assert_close(fc1.weight.main_grad, plain[0].weight.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(seq[2].weight.main_grad, 0.5 + plain[2].weight.grad, rtol=0, atol=1e-6)
    # frozen experts: no weight-gradient work, no transposed copy of the input kept
    frozen = _moe()
    for p in frozen.parameters():
        p.requires_grad_(False)
    calls = []
    real = Q.cast_tensor

    def spy(x, scale, dtype, transposed=False, amax=None, **kw):
        calls.append(transposed)
        return real(x, scale, dtype, transposed, amax, **kw)

    mp = pytest.MonkeyPatch()
    mp.setattr(Q, "cast_tensor", spy)  # every per-tensor cast: standalone and after a producer's amax
    try:
        _, dx = _run(frozen, x, dy, splits, recipe)
    finally:
        mp.undo()
    assert dx is not None and len(calls) >= 4 and not any(calls), calls  # x, y, dy, dh (+ weights): none transposed
    assert frozen[0].weight.grad is None


def test_weight_cache_one_cast_per_step_and_state_dict():
    recipe = fo.Float8DelayedScaling(amax_history_len=8)
    seq = _moe()
    opt = torch.optim.SGD(seq.parameters(), lr=0.01)
    x, dy, splits = _inputs([32, 32, 0, 64])
    for step in range(2):
        for _ in range(3):
            _run(seq, x, dy, splits, recipe)
        assert seq[0].fp8_weight_casts == step + 1
        opt.step()
        opt.zero_grad()
    sd = seq.state_dict()
    assert "0.fp8_amax_history" in sd
    fresh = _moe(seed=7)
    fresh.load_state_dict(sd)
    with fo.autocast(recipe=recipe):
        assert torch.equal(seq(x, splits, splits), fresh(x, splits, splits))


# ---------------------------------------------------------------- GPU


def _skip_without_fp8():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from fusible_ops.kernels.fp8_gemm import fp8_capable
    if not fp8_capable(torch.device("cuda")):
        pytest.skip("needs FP8 tensor cores")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("act", [fo.SwiGLU, fo.GEGLU])
def test_gpu_grouped_mlp_sqnr_and_emulation(recipe, act):
    _skip_without_fp8()
    recipe = RECIPES[recipe]
    seq = _moe("cuda", torch.bfloat16, e=5, h=256, f=352, act=act, bias=True)
    x, dy, splits = _inputs([300, 0, 17, 1, 194], h=256, device="cuda", dtype=torch.bfloat16)
    y, dx = _run(seq, x, dy, splits, recipe)
    y64, dx64, ref = _ref64(seq, x, dy, splits)
    fmt = recipe.fp8_format
    from fusible_ops.testing import sqnr
    baseline = sqnr(_dense_fp8_baseline(seq, x, splits, recipe), y64)  # the dense FP8 linears (cuBLAS)
    assert_sqnr(y, y64, baseline - 1.0, msg=f"y (dense FP8 baseline {baseline:.2f} dB)")
    assert_sqnr(dx, dx64, SQNR_DB["grad", fmt], msg="dx")
    for i in (0, 2):
        assert_sqnr(seq[i].weight.grad, ref[i].weight.grad, SQNR_DB["grad", fmt], msg=f"dw{i}")
    emu = copy.deepcopy(seq).to("cpu", torch.float32)  # CPU emulation of the same FP8 operands
    for p in emu.parameters():
        p.grad = None
    ye, dxe = _run(emu, x.float().cpu(), dy.float().cpu(), splits.cpu(), recipe)
    # the Triton kernels are as accurate as the CPU emulation (fp32 math on the FP8 values)
    assert_sqnr(y, y64, sqnr(ye, y64) - 1.0, msg="y vs the emulation's SQNR")
    assert_sqnr(dx, dx64, sqnr(dxe, dx64) - 1.0, msg="dx vs the emulation's SQNR")


@pytest.mark.gpu
def test_gpu_graphed_fp8_moe_changing_splits_matches_eager():
    """fo.make_graphed_callables of an FP8 grouped MLP: split sizes change between replays,
    optimizer steps between micro-batches re-cast the experts' weights once; equal to eager."""
    _skip_without_fp8()
    recipe = RECIPES["delayed"]
    seq = _moe("cuda", torch.float32, e=4, h=128, f=128, accumulate_into_main_grad=True)
    for m in (seq[0], seq[2]):
        m.weight.main_grad = torch.zeros(m.weight.shape, device="cuda")
    ref = copy.deepcopy(seq)
    for m in (ref[0], ref[2]):
        m.weight.main_grad = torch.zeros(m.weight.shape, device="cuda")
    x_static = torch.zeros(256, 128, device="cuda", requires_grad=True)
    s_static = torch.tensor([64, 64, 64, 64], device="cuda")
    with fo.autocast(recipe=recipe):
        ref(x_static.detach().clone().requires_grad_(), s_static, s_static).sum().backward()  # same warm-up
        for m in (ref[0], ref[2]):
            m.weight.main_grad.zero_()
        graphed = fo.make_graphed_callables(seq, (x_static, s_static, s_static), num_warmup_iters=1)
    g = torch.Generator(device="cuda").manual_seed(2)
    casts0 = seq[0].fp8_weight_casts
    for step, splits in enumerate(([100, 0, 156, 0], [1, 2, 3, 250], [64, 64, 64, 64])):
        s = torch.tensor(splits, device="cuda")
        for _ in range(2):
            x = torch.randn(256, 128, device="cuda", generator=g)
            dy = torch.randn(256, 128, device="cuda", generator=g)
            with torch.no_grad():
                x_static.copy_(x)
                s_static.copy_(s)
            y = graphed(x_static, s_static, s_static)
            y.backward(dy)
            with fo.autocast(recipe=recipe):
                yr = ref(x.clone().requires_grad_(), s, s)
            yr.backward(dy)
            torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-5)
        for m, mr in zip((seq[0], seq[2]), (ref[0], ref[2])):
            torch.testing.assert_close(m.weight.main_grad, mr.weight.main_grad, rtol=1e-5, atol=1e-5)
            with torch.no_grad():
                m.weight.sub_(0.01 * m.weight.main_grad)
                mr.weight.sub_(0.01 * mr.weight.main_grad)
    assert seq[0].fp8_weight_casts - casts0 == 2  # once after each of the two updates


def test_fused_fp8_mlp_takes_two_amaxes_in_its_kernels():
    """The hand-off inside the fused grouped MLP: FC1 + GLU takes the amax of FC2's input and
    FC2's input gradient + dGLU that of FC1's output gradient, so per step two standalone amax
    passes (x, dy) remain where the unfused ops run four; both give the same results."""
    seq = _moe(bias=True)
    x, dy, splits = _inputs([40, 0, 57, 31])
    recipe = RECIPES["current"]
    _run(seq, x, dy, splits, recipe)  # weights cached
    calls = []
    real = Q.tensor_amax
    mp = pytest.MonkeyPatch()
    mp.setattr(Q, "tensor_amax", lambda t: (calls.append(tuple(t.shape)), real(t))[1])
    try:
        seq.zero_grad(set_to_none=True)
        y, dx = _run(seq, x, dy, splits, recipe)
        fused = list(calls)
        calls.clear()
        seq.zero_grad(set_to_none=True)
        with fo.fusion_rules.disabled("grouped_mlp"):
            yu, dxu = _run(seq, x, dy, splits, recipe)
        with fo.autocast(recipe=recipe), fo.fusion_rules.disabled("grouped_mlp"):
            assert [r["rule"] for r in seq.fusion_plan()] == [None, None, None]
    finally:
        mp.undo()
    # unfused: the activation takes FC2's input amax in its pass (the hand-off); FC1 has a bias,
    # so its output gradient (whose bias gradient reads the 16-bit rows) is cast standalone
    assert fused == [(128, 64), (128, 64)] and len(calls) == 3, (fused, calls)
    torch.testing.assert_close(y, yu, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, dxu, rtol=1e-5, atol=1e-5)


def _amaxes(fn):
    """``fn()`` and the shapes of the standalone amax passes it ran."""
    calls, real = [], Q.tensor_amax
    mp = pytest.MonkeyPatch()
    mp.setattr(Q, "tensor_amax", lambda t: (calls.append(tuple(t.shape)), real(t))[1])
    try:
        return fn(), calls
    finally:
        mp.undo()


def _no_handoff(mp):
    mp.setattr(fo.GroupedLinear, "input_quantizer", lambda self: None)
    mp.setattr(fo.GroupedLinear, "grad_output_quantizer", lambda self: None)


@pytest.mark.parametrize("name", ["current", "delayed"])
def test_unfused_fp8_mlp_hands_its_casts_to_the_activation(name, monkeypatch):
    """Unfused FC1 -> SwiGLU -> FC2 (bias-free) under a per-tensor recipe: the activation's forward
    takes the amax of FC2's input and its backward that of FC1's output gradient, so only x and dy
    get standalone amax passes; FC2 reads the activation's FP8 output as is. Bit-identical to the
    run without the hand-off (where every GroupedLinear casts its own operands: four passes)."""
    recipe = RECIPES[name]
    x, dy, splits = _inputs([40, 0, 57, 31])
    results = []
    for handoff in (True, False):
        seq = _moe(accumulate_into_main_grad=True)
        for m in (seq[0], seq[2]):
            m.weight.main_grad = torch.zeros_like(m.weight)
        with monkeypatch.context() as mp:
            if not handoff:
                _no_handoff(mp)
            with fo.fusion_rules.disabled("grouped_mlp"):
                (y, dx), calls = _amaxes(lambda: _run(seq, x, dy, splits, recipe, steps=2))
                with fo.autocast(recipe=recipe):
                    assert [r["rule"] for r in seq.fusion_plan()] == [None, None, None]
        if name == "current":  # (FC2's input is [128, 96], FC1's output gradient [128, 192])
            inner = [c for c in calls if c in ((128, 96), (128, 192))]
            assert inner == ([] if handoff else [(128, 96), (128, 192)] * 2), calls
            assert calls.count((128, 64)) == 4, calls  # x and dy, each step
        results.append((y, dx, seq[0].weight.main_grad, seq[2].weight.main_grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fp8_input_of_3d_rows_is_read_as_is(monkeypatch):
    """An activation before a GroupedLinear on [B, S, F] input: the FP8 output keeps its bytes
    (viewed as rows, not dequantized by a reshape), bit-identical to the op casting it itself."""
    recipe = RECIPES["current"]
    g = torch.Generator().manual_seed(3)
    x, dy = torch.randn(2, 64, 192, generator=g), torch.randn(2, 64, 64, generator=g)
    splits = torch.tensor([50, 0, 40, 38])
    results = []
    for handoff in (True, False):
        torch.manual_seed(0)
        seq = fo.Sequential(fo.SwiGLU(), fo.GroupedLinear(4, 96, 64, bias=False))
        with monkeypatch.context() as mp:
            if not handoff:
                _no_handoff(mp)
            (y, dx), calls = _amaxes(lambda: _run(seq, x, dy, splits, recipe))
        # (the weight's first cast [256, 96]; dy; without the hand-off also the input [128, 96])
        assert sorted(calls) == sorted([(256, 96), (128, 64)] + ([] if handoff else [(128, 96)])), calls
        results.append((y, dx, seq[1].weight.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_grouped_quantizer_declines_where_the_16bit_tensor_is_read(monkeypatch):
    """No hand-off under block scaling, with FP8_WGRAD_MIN_ROWS > 0, or (output gradient) with a
    bias; none outside autocast."""
    plain, biased = fo.GroupedLinear(4, 64, 64, bias=False), fo.GroupedLinear(4, 64, 64)
    assert plain.input_quantizer() is None
    with fo.autocast(recipe=RECIPES["current"]):
        assert plain.input_quantizer() is not None and plain.grad_output_quantizer() is not None
        assert biased.input_quantizer() is not None and biased.grad_output_quantizer() is None
        monkeypatch.setattr(fp8_grouped, "FP8_WGRAD_MIN_ROWS", 16)
        assert plain.input_quantizer() is None and plain.grad_output_quantizer() is None
    with fo.autocast(recipe=fo.Float8BlockScaling()):
        assert plain.input_quantizer() is None and plain.grad_output_quantizer() is None


# ---------------------------------------------------------------- block scaling
BLOCK = fo.Float8BlockScaling()


def _block_moe(device="cpu", dtype=torch.float32, **kw):
    return _moe(device, dtype, e=4, h=128, f=128, **kw)


def test_block_scaled_grouped_linear_meets_the_table_with_odd_splits():
    """Split sizes that are no multiple of 128 (and an empty group); 1x128 / 128x128 scales."""
    lin = fo.Sequential(fo.GroupedLinear(4, 128, 256, bias=True))
    x, _, splits = _inputs([40, 0, 170, 46], h=128)
    dy = torch.randn(256, 256, generator=torch.Generator().manual_seed(5))
    y, dx = _run(lin, x, dy, splits, BLOCK)
    y64, dx64, ref = _ref64(lin, x, dy, splits)
    assert_sqnr(y, y64, SQNR_DB["output", "e4m3"], msg="y")
    assert_sqnr(dx, dx64, SQNR_DB["grad", "e4m3"], msg="dx")
    assert_sqnr(lin[0].weight.grad, ref[0].weight.grad, SQNR_DB["grad", "e4m3"], msg="dw")
    assert torch.count_nonzero(lin[0].weight.grad[1]) == 0
    with fo.autocast(recipe=BLOCK):
        assert "block-scaled FP8 grouped GEMMs" in lin.explain(x, splits)


def test_block_scaled_weight_gradient_scales_stay_inside_each_expert():
    """Experts whose tokens differ by 1e5 in magnitude, with a group boundary inside a 128-row
    tile: each expert's weight gradient is as accurate as the table asks (a tile shared across the
    boundary would quantize the small expert's rows to nothing), and per-tensor scaling is not."""
    from fusible_ops.testing import sqnr

    lin = fo.Sequential(fo.GroupedLinear(2, 128, 128, bias=False))
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(70, 128, generator=g) * 1e-3, torch.randn(120, 128, generator=g) * 1e2])
    dy = torch.cat([torch.randn(70, 128, generator=g) * 1e-3, torch.randn(120, 128, generator=g) * 1e2])
    splits = torch.tensor([70, 120])
    _, _, ref = _ref64(lin, x, dy, splits)
    for recipe, ok in ((BLOCK, True), (RECIPES["e4m3"], False)):
        lin.zero_grad(set_to_none=True)
        _run(lin, x, dy, splits, recipe)
        small = sqnr(lin[0].weight.grad[0], ref[0].weight.grad[0])
        assert (small >= SQNR_DB["grad", "e4m3"]) == ok, (type(recipe).__name__, small)


def test_block_scaled_mlp_runs_unfused_with_a_reason_and_keeps_the_contract():
    seq = _block_moe(accumulate_into_main_grad=True, delay_wgrad_compute=True)
    plain = _block_moe()
    for m in (seq[0], seq[2]):
        m.weight.main_grad = torch.full(m.weight.shape, 0.25)
    x, dy, splits = _inputs([16, 131, 0, 109], h=128)
    y, dx = _run(seq, x, dy, splits, BLOCK)
    assert float(seq[0].weight.main_grad.sub(0.25).abs().max()) == 0.0  # delayed until backward_dw()
    seq.backward_dw()
    yp, dxp = _run(plain, x, dy, splits, BLOCK)
    torch.testing.assert_close(y, yp, rtol=0, atol=0)
    for m, p in ((seq[0], plain[0]), (seq[2], plain[2])):
        torch.testing.assert_close(m.weight.main_grad, 0.25 + p.weight.grad, rtol=0, atol=1e-6)
    y64, dx64, ref = _ref64(plain, x, dy, splits)
    assert_sqnr(dx, dx64, SQNR_DB["grad", "e4m3"], msg="dx")
    with fo.autocast(recipe=BLOCK):
        assert [r["rule"] for r in seq.fusion_plan()] == [None, None, None]
        assert "the GLU-epilogue kernels take per-tensor scales" in seq.explain(x, splits, splits)


def test_block_scaling_needs_feature_sizes_divisible_by_128():
    lin = fo.Sequential(fo.GroupedLinear(2, 64, 128))
    x, dy, splits = _inputs([10, 20], h=64)
    with fo.autocast(recipe=BLOCK), pytest.raises(ValueError, match="divisible by 128.*in_features=64"):
        lin(x, splits)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [[300, 0, 17, 1, 194], [0, 512, 0, 0, 0]])
def test_gpu_block_scaled_grouped_mlp_matches_the_emulation(splits):
    """The block-scaled Triton kernels against float64, judged by the CPU emulation's own error on
    the same FP8 operands (odd split sizes, an empty expert, one expert taking every token)."""
    _skip_without_fp8()
    from fusible_ops.testing import sqnr

    seq = _moe("cuda", torch.bfloat16, e=5, h=256, f=384, bias=True)
    x, dy, splits = _inputs(splits, h=256, device="cuda", dtype=torch.bfloat16)
    y, dx = _run(seq, x, dy, splits, BLOCK)
    y64, dx64, ref = _ref64(seq, x, dy, splits)
    emu = copy.deepcopy(seq).to("cpu", torch.float32)
    for p in emu.parameters():
        p.grad = None
    ye, dxe = _run(emu, x.float().cpu(), dy.float().cpu(), splits.cpu(), BLOCK)
    assert_sqnr(y, y64, min(sqnr(ye, y64) - 1.0, SQNR_DB["output", "e4m3"]), msg="y")
    assert_sqnr(dx, dx64, min(sqnr(dxe, dx64) - 1.0, SQNR_DB["grad", "e4m3"]), msg="dx")
    for i in (0, 2):
        w64 = ref[i].weight.grad
        assert_sqnr(seq[i].weight.grad, w64, min(sqnr(emu[i].weight.grad, w64) - 1.0, SQNR_DB["grad", "e4m3"]),
                    msg=f"dw{i}")


@pytest.mark.gpu
def test_gpu_graphed_block_scaled_moe_changing_splits_matches_eager():
    """Block scaling under fo.make_graphed_callables: the padded layout's size depends only on
    the token count, so other split sizes replay; equal to eager."""
    _skip_without_fp8()
    seq = _moe("cuda", torch.float32, e=4, h=128, f=128)
    ref = copy.deepcopy(seq)
    x_static = torch.zeros(384, 128, device="cuda", requires_grad=True)
    s_static = torch.tensor([96, 96, 96, 96], device="cuda")
    with fo.autocast(recipe=BLOCK):
        graphed = fo.make_graphed_callables(seq, (x_static, s_static, s_static), num_warmup_iters=1)
    g = torch.Generator(device="cuda").manual_seed(2)
    for splits in ([100, 0, 284, 0], [1, 2, 3, 378], [129, 127, 1, 127]):
        s = torch.tensor(splits, device="cuda")
        x = torch.randn(384, 128, device="cuda", generator=g)
        dy = torch.randn(384, 128, device="cuda", generator=g)
        with torch.no_grad():
            x_static.copy_(x)
            s_static.copy_(s)
        seq.zero_grad(set_to_none=False)
        ref.zero_grad(set_to_none=True)
        y = graphed(x_static, s_static, s_static)
        y.backward(dy)
        with fo.autocast(recipe=BLOCK):
            yr = ref(x.clone().requires_grad_(), s, s)
        yr.backward(dy)
        torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-5)
        for i in (0, 2):
            torch.testing.assert_close(seq[i].weight.grad, ref[i].weight.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_gpu_block_scaled_main_grad_delayed_and_frozen():
    """The gradient contract under block scaling on the GPU: main_grad accumulation and delayed
    wgrad equal plain .grad; frozen experts launch no weight-gradient kernel."""
    _skip_without_fp8()
    import fusible_ops.kernels.fp8_grouped_gemm as FG

    seq = _moe("cuda", torch.bfloat16, e=4, h=128, f=256, accumulate_into_main_grad=True, delay_wgrad_compute=True)
    plain = copy.deepcopy(seq)
    for m in (plain[0], plain[2]):
        m.accumulate_into_main_grad = m.delay_wgrad_compute = False
    for m in (seq[0], seq[2]):
        m.weight.main_grad = torch.full(m.weight.shape, 0.5, device="cuda")
    x, dy, splits = _inputs([100, 0, 131, 153], h=128, device="cuda", dtype=torch.bfloat16)
    y, dx = _run(seq, x, dy, splits, BLOCK)
    assert float((seq[0].weight.main_grad - 0.5).abs().max()) == 0.0  # delayed until backward_dw()
    seq.backward_dw()
    yp, dxp = _run(plain, x, dy, splits, BLOCK)
    torch.testing.assert_close(y, yp, rtol=0, atol=0)
    torch.testing.assert_close(dx, dxp, rtol=0, atol=0)
    for m, p in ((seq[0], plain[0]), (seq[2], plain[2])):
        # main_grad holds the fp32 sum; .grad the same GEMM's result rounded to bf16: the bf16 table
        rtol, atol = TOLERANCES[torch.bfloat16]
        torch.testing.assert_close(m.weight.main_grad, 0.5 + p.weight.grad.float(), rtol=rtol, atol=atol)
        assert torch.count_nonzero(m.weight.main_grad[1] - 0.5) == 0  # the empty expert's buffer untouched
    frozen = copy.deepcopy(plain)
    for p in frozen.parameters():
        p.requires_grad_(False)
        p.grad = None
    calls = []
    real = FG.fp8_grouped_wgrad
    mp = pytest.MonkeyPatch()
    mp.setattr(FG, "fp8_grouped_wgrad", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    import fusible_ops.ops.fp8_grouped as OG
    mp.setattr(OG, "fp8_grouped_wgrad", FG.fp8_grouped_wgrad)
    try:
        _, dxf = _run(frozen, x, dy, splits, BLOCK)
    finally:
        mp.undo()
    assert calls == [] and frozen[0].weight.grad is None
    torch.testing.assert_close(dxf, dxp, rtol=0, atol=0)


@pytest.mark.parametrize("contract", [False, True], ids=["grad", "main_grad_delayed"])
def test_few_rows_per_expert_take_the_16bit_weight_gradient(monkeypatch, contract):
    """Below FP8_WGRAD_MIN_ROWS rows per expert the weight gradient is the 16/32-bit grouped GEMM of
    the saved input and the output gradient (exactly the reference kernel's, here in fp32), while
    the forward and the input gradient stay FP8; at the threshold the FP8 weight gradient runs
    (it differs). Through the gradient contract too (main_grad, delayed)."""
    from fusible_ops.kernels.grouped_gemm import grouped_gemm_wgrad_ref

    monkeypatch.setattr(fp8_grouped, "FP8_WGRAD_MIN_ROWS", 16)
    kw = dict(accumulate_into_main_grad=True, delay_wgrad_compute=True) if contract else {}
    x, dy, splits = _inputs([9, 0, 31, 20], h=64)  # 60 rows, 4 experts: 15 per expert < 16
    grads = []
    for rows in (60, 64):
        torch.manual_seed(0)
        lin = fo.Sequential(fo.GroupedLinear(4, 64, 64, bias=False, **kw))
        if contract:
            lin[0].weight.main_grad = torch.zeros_like(lin[0].weight)
        xs, dys = (x, dy) if rows == 60 else (torch.cat([x, x[:4]]), torch.cat([dy, dy[:4]]))
        sp = splits if rows == 60 else splits + torch.tensor([4, 0, 0, 0])
        y, dx = _run(lin, xs, dys, sp, RECIPES["current"])
        if contract:
            lin.backward_dw()
        dw = lin[0].weight.main_grad if contract else lin[0].weight.grad
        exact = grouped_gemm_wgrad_ref(dys, xs, sp)
        grads.append((torch.equal(dw, exact), dx, xs, dys, sp, lin))
    assert grads[0][0], "15 rows per expert: the weight gradient is not the 16-bit kernel's"
    assert not grads[1][0], "16 rows per expert: the weight gradient should be FP8's"
    _, dx, xs, dys, sp, lin = grads[0]
    _, dx_ref, _ = _ref64(lin, xs, dys, sp)
    assert not torch.equal(dx.double(), dx_ref), "the input gradient should stay FP8"
    assert_sqnr(dx, dx_ref, SQNR_DB["grad", "hybrid"])
