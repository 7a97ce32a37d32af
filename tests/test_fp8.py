"""FP8 training (issue 11): recipes, autocast, Quantize, Float8Tensor, FP8 dense linears.

CPU runs every recipe as emulation (real FP8 casts and scales, the GEMM on dequantized values in
fp32); ``gpu`` tests run torch._scaled_mm on Hopper and compare with the emulation. Accuracy is
SQNR against float64 math (fusible_ops.testing.SQNR_DB).
"""

from __future__ import annotations

import pytest
import torch

import fusible_ops as fo
from fusible_ops.fusion_rules import disabled
from fusible_ops.kernels import fp8_gemm as G
import fusible_ops.quantization.casting as Q
from fusible_ops.testing import SQNR_DB, assert_sqnr, quantized_reference, sqnr

RECIPES = [fo.Float8CurrentScaling(), fo.Float8DelayedScaling(amax_history_len=4), fo.Float8BlockScaling(),
           fo.Float8CurrentScaling("e4m3")]
IDS = ["current", "delayed", "block", "current-e4m3"]
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _mlp(device="cpu", dtype=torch.float32, h=128, f=256, seed=0):
    torch.manual_seed(seed)
    return fo.Sequential(fo.Linear(h, f, device=device, dtype=dtype), fo.GELU(),
                         fo.Linear(f, h, device=device, dtype=dtype))


def _run(seq, x, dy, recipe, steps=1):
    x = x.detach().clone().requires_grad_()
    for _ in range(steps):
        with fo.autocast(recipe=recipe):
            y = seq(x)
        y.backward(dy)
    return y, x.grad


@pytest.fixture
def cast_roles(monkeypatch):
    """(role, transposed) of every cast the FP8 linears and Quantize ops make themselves."""
    import fusible_ops.ops.fp8_linear as FL
    import fusible_ops.ops.quantize as QO

    calls = []
    real = Q.quantize

    def spy(t, r, role, **kw):
        calls.append((role, kw.get("transposed", False)))
        return real(t, r, role, **kw)

    monkeypatch.setattr(FL, "quantize", spy)
    monkeypatch.setattr(QO, "quantize", spy)
    return calls


def _count(calls, role):
    return sum(1 for r, _ in calls if r == role)


def _float64_reference(seq, x, dy):
    ref = _mlp(dtype=torch.float64, h=seq[0].in_features, f=seq[0].out_features)
    ref.load_state_dict({k: v.double().cpu() for k, v in seq.state_dict().items()})
    x64 = x.detach().double().cpu().requires_grad_()
    y = ref(x64)
    y.backward(dy.double().cpu())
    return y, x64.grad, ref


# ---- recipes and autocast


def test_recipes_are_frozen_and_validated():
    r = fo.Float8DelayedScaling()
    assert (r.amax_history_len, r.amax_compute_algo, r.margin, r.fp8_format) == (1024, "max", 0, "hybrid")
    with pytest.raises(Exception):
        r.margin = 1
    with pytest.raises(ValueError, match="fp8_format"):
        fo.Float8CurrentScaling(fp8_format="e5m2")
    with pytest.raises(ValueError, match="amax_compute_algo"):
        fo.Float8DelayedScaling(amax_compute_algo="mean")
    assert fo.Float8BlockScaling(power_of_two_scales=True).power_of_two_scales
    assert fo.quantization.fp8_dtype(fo.Float8CurrentScaling(), "grad_output") == torch.float8_e5m2
    assert fo.quantization.fp8_dtype(fo.Float8CurrentScaling("e4m3"), "grad_output") == torch.float8_e4m3fn


def test_autocast_nesting_and_bad_recipe():
    cur = fo.quantization.current_recipe
    a, b = fo.Float8CurrentScaling(), fo.Float8BlockScaling()
    assert cur() is None
    with fo.autocast(recipe=a):
        assert cur() is a
        with fo.autocast(recipe=b):
            assert cur() is b
            with fo.autocast(recipe=None):
                assert cur() is None
            assert cur() is b
        assert cur() is a
    assert cur() is None
    with pytest.raises(TypeError, match="recipe must be None or an instance"):
        with fo.autocast(recipe="fp8"):
            pass


def test_recipe_is_part_of_the_plan_key():
    seq = _mlp()
    x = torch.randn(32, 128)
    fuser = seq._fusers()[0] if hasattr(seq, "_fusers") else None
    seq(x)
    with fo.autocast(recipe=RECIPES[0]):
        seq(x)
        seq(x)
    seq(x)
    made = [f.num_plans_made for f in _fusers(seq)]
    assert made == [2], made  # one plan without FP8, one with: no replanning per call
    assert "linear_bias_activation" in [g["rule"] for g in seq.fusion_plan()]
    del fuser


def _fusers(seq):
    return [m for m in seq.__dict__.values() if isinstance(m, fo.OperationFuser)] or \
        [f for f in getattr(seq, "_stage_cache", ()) if isinstance(f, fo.OperationFuser)] or \
        [s for s, _ in seq._get_stages() if isinstance(s, fo.OperationFuser)]


# ---- accuracy (CPU emulation; the same thresholds on the GPU)


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_mlp_sqnr(recipe):
    seq = _mlp()
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(256, 128, generator=g), torch.randn(256, 128, generator=g)
    steps = 2 if isinstance(recipe, fo.Float8DelayedScaling) else 1  # the second step uses the history
    y, dx = _run(seq, x, dy, recipe, steps=steps)
    y64, dx64, ref = _float64_reference(seq, x, dy)
    fmt = recipe.fp8_format
    assert_sqnr(y, y64, SQNR_DB["output", fmt], msg="y")
    assert_sqnr(dx, steps * dx64, SQNR_DB["grad", fmt], msg="dx")  # gradients of the steps accumulate
    for i in (0, 2):
        assert_sqnr(seq[i].weight.grad, steps * ref[i].weight.grad, SQNR_DB["grad", fmt], msg=f"dw{i}")


def test_block_scaling_beats_per_tensor_on_outliers():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(256, 512, generator=g)
    rows = torch.arange(0, 256, 32)
    x[rows, torch.randint(0, 512, (len(rows),), generator=g)] = 1e5  # a few large outliers
    w = torch.randn(128, 512, generator=g) / 16
    ref = x.double() @ w.double().t()
    worst = {}  # (worst row, median row) SQNR
    for name, recipe in [("tensor", fo.Float8CurrentScaling("e4m3")), ("block", fo.Float8BlockScaling())]:
        xq = Q.quantize(x, recipe, "input")
        wq = Q.quantize(w, recipe, "weight")
        y = G.fp8_gemm(xq.rowwise, wq.rowwise, xq.scaling, wq.scaling, torch.float32)
        per_row = torch.tensor([sqnr(y[i], ref[i]) for i in range(256)])
        worst[name] = (per_row.min().item(), per_row.median().item())
    assert worst["block"][0] >= worst["tensor"][0] - 0.5, worst  # the outlier rows: no worse
    assert worst["block"][1] >= SQNR_DB["output", "e4m3"], worst
    assert worst["block"][1] > worst["tensor"][1] + 6, worst  # the other rows: clearly better


def test_quantized_reference_separates_quantization_error():
    recipe = fo.Float8CurrentScaling()
    x, w = torch.randn(64, 128), torch.randn(32, 128)
    xq, wq = Q.quantize(x, recipe, "input"), Q.quantize(w, recipe, "weight")
    y = G.fp8_gemm(xq.rowwise, wq.rowwise, "tensor", "tensor", torch.float32)
    ref = quantized_reference(x, recipe) @ quantized_reference(w, recipe, "weight").t()
    assert sqnr(y, ref) > 100  # the same FP8 values: only fp32 rounding left


# ---- Quantize and Float8Tensor


def test_quantize_op_identity_outside_autocast():
    op = fo.Quantize()
    x = torch.randn(8, 32, requires_grad=True)
    y = op(x)
    assert type(y) is torch.Tensor and torch.equal(y, x)


def test_quantize_output_is_float8_tensor_that_dequantizes():
    seq = fo.Sequential(fo.Linear(64, 64), fo.Quantize())
    x = torch.randn(32, 64, requires_grad=True)
    with fo.autocast(recipe=fo.Float8CurrentScaling()):
        y = seq(x)
    assert isinstance(y, fo.Float8Tensor) and y.dtype == torch.float32 and y.shape == (32, 64)
    z = y * 2 + 1  # any torch op sees the dequantized values
    assert type(z) is torch.Tensor
    assert torch.equal(z, y.dequantize() * 2 + 1)
    z.sum().backward()
    assert x.grad is not None and seq[0].weight.grad is not None


def test_next_sequential_consumes_quantized_input_without_recasting(cast_roles):
    recipe = fo.Float8CurrentScaling()
    first = fo.Sequential(fo.Linear(64, 64), fo.Quantize())
    second = fo.Sequential(fo.Linear(64, 32))
    x = torch.randn(32, 64, requires_grad=True)
    roles = cast_roles
    with fo.autocast(recipe=recipe):
        h = first(x)
        roles.clear()
        out = second(h)
    assert roles == []  # the second linear used the Float8Tensor's data as it is
    expected = G.fp8_gemm(h.rowwise, Q.quantize(second[0].weight.detach(), recipe, "weight").rowwise, "tensor",
                          "tensor", torch.float32) + second[0].bias
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape and type(x.grad) is torch.Tensor


# ---- weight cache, delayed-scaling state


def test_weight_cache_one_cast_per_optimizer_step():
    seq = _mlp()
    opt = torch.optim.SGD(seq.parameters(), lr=0.01)
    x = torch.randn(64, 128)
    recipe = fo.Float8CurrentScaling()
    for step in range(3):
        for _ in range(4):  # micro-batches
            with fo.autocast(recipe=recipe):
                seq(x).sum().backward()
        assert seq[0].fp8_weight_casts == step + 1 and seq[2].fp8_weight_casts == step + 1
        opt.step()
        opt.zero_grad()


def test_delayed_state_dict_round_trip():
    recipe = fo.Float8DelayedScaling(amax_history_len=8)
    seq = _mlp()
    x = torch.randn(64, 128)
    for _ in range(3):
        with fo.autocast(recipe=recipe):
            seq(x).sum().backward()
    sd = seq.state_dict()
    assert "0.fp8_amax_history" in sd and sd["0.fp8_amax_history"].shape == (8, 3)
    assert (sd["0.fp8_amax_history"][:3, :] > 0).any()
    fresh = _mlp(seed=5)
    fresh.load_state_dict(sd)
    assert torch.equal(fresh[0].fp8_amax_history, seq[0].fp8_amax_history)
    assert torch.equal(fresh[0].fp8_scale, seq[0].fp8_scale)
    with fo.autocast(recipe=recipe):
        a, b = seq(x), fresh(x)
    assert torch.equal(a, b)
    # a torch.nn.Linear checkpoint (no FP8 state) still loads into a fresh Linear
    lin = fo.Linear(128, 256)
    lin.load_state_dict(torch.nn.Linear(128, 256).state_dict())


# ---- gradient contract under FP8


@pytest.mark.parametrize("recipe", RECIPES[:3], ids=IDS[:3])
def test_main_grad_and_delayed_wgrad(recipe):
    seq = _mlp()
    plain = _mlp()
    g = torch.Generator().manual_seed(3)
    x, dy = torch.randn(64, 128, generator=g), torch.randn(64, 128, generator=g)
    lin = seq[0]
    lin.accumulate_into_main_grad = True
    lin.delay_wgrad_compute = True
    lin.weight.main_grad = torch.zeros(256, 128)
    x, dy = torch.cat([x, x]), torch.cat([dy, dy])  # 128 tokens: the block recipe's wgrad needs it
    _run(seq, x, dy, recipe)
    assert lin.weight.grad is None and torch.count_nonzero(lin.weight.main_grad) == 0  # delayed
    seq.backward_dw()
    _run(plain, x, dy, recipe)
    torch.testing.assert_close(lin.weight.main_grad, plain[0].weight.grad, rtol=0, atol=1e-6)


def test_frozen_weight_keeps_no_input_copy(cast_roles):
    seq = fo.Sequential(fo.Linear(128, 128))
    seq[0].weight.requires_grad_(False)
    x = torch.randn(64, 128, requires_grad=True)
    with fo.autocast(recipe=fo.Float8CurrentScaling()):
        seq(x).sum().backward()
    assert cast_roles == [("input", False), ("grad_output", False)]  # no transposed copies
    assert seq[0].weight.grad is None and x.grad is not None


# ---- bad input


def test_dims_not_divisible_raise_clearly():
    seq = fo.Sequential(fo.Linear(100, 64))
    with pytest.raises(ValueError, match="divisible by 16"):
        with fo.autocast(recipe=fo.Float8CurrentScaling()):
            seq(torch.randn(32, 100))
    with pytest.raises(ValueError, match="divisible by 128"):
        with fo.autocast(recipe=fo.Float8BlockScaling()):
            fo.Sequential(fo.Linear(64, 64))(torch.randn(128, 64))


# ---- GPU: torch._scaled_mm against the emulation


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_gpu_fp8_mlp_matches_emulation_and_sqnr(recipe, dtype):
    if not G.fp8_capable(torch.device("cuda")):
        pytest.skip("needs FP8 tensor cores")
    seq = _mlp("cuda", dtype, h=512, f=1024)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1024, 512, generator=g).to("cuda", dtype)
    dy = torch.randn(1024, 512, generator=g).to("cuda", dtype)
    y, dx = _run(seq, x, dy, recipe)
    y64, dx64, ref = _float64_reference(seq, x.float(), dy.float())
    fmt = recipe.fp8_format
    assert_sqnr(y, y64, SQNR_DB["output", fmt], msg="y")
    assert_sqnr(dx, dx64, SQNR_DB["grad", fmt], msg="dx")
    assert_sqnr(seq[0].weight.grad, ref[0].weight.grad, SQNR_DB["grad", fmt], msg="dw0")


@pytest.mark.gpu
@pytest.mark.parametrize("n", [768, 1024])  # 768: a 128x128-scaled reduction dim that is not a multiple of 512
@pytest.mark.parametrize("scaling", ["tensor", "block"])
def test_gpu_scaled_mm_equals_emulation(scaling, n):
    if not G.fp8_capable(torch.device("cuda")):
        pytest.skip("needs FP8 tensor cores")
    recipe = fo.Float8CurrentScaling() if scaling == "tensor" else fo.Float8BlockScaling()
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, 1024, device="cuda", dtype=torch.bfloat16)
    xq = Q.quantize(x, recipe, "input", transposed=True)
    wq = Q.quantize(w, recipe, "weight", transposed=True)
    dy = Q.quantize(torch.randn(512, n, device="cuda", dtype=torch.bfloat16), recipe, "grad_output", transposed=True)
    for a, b, sa, sb in [(xq.rowwise, wq.rowwise, xq.scaling, wq.scaling),
                         (dy.rowwise, wq.colwise, dy.scaling, wq.scaling),
                         (dy.colwise, xq.colwise, dy.scaling, xq.scaling)]:
        got = G.fp8_gemm(a, b, sa, sb, torch.float32)
        want = G.fp8_gemm_ref(a, b, sa, sb, torch.float32)
        assert sqnr(got, want) > 60


def test_explain_shows_where_casts_run_and_fallbacks():
    seq = fo.Sequential(fo.Identity(), fo.Linear(128, 256), fo.GELU(), fo.Quantize(), fo.Linear(256, 128),
                        fo.GroupedLinear(2, 128, 128))
    x = torch.randn(128, 128)
    assert "fp8" not in seq.explain(x, torch.tensor([64, 64]))
    with fo.autocast(recipe=fo.Float8CurrentScaling()):
        text = seq.explain(x, torch.tensor([64, 64]))
    assert "[1] BasicLinear: FP8 GEMMs; input: standalone cast (E4M3)" in text
    assert "producer [0] Identity does not write FP8 itself" in text
    assert "[5] BasicLinear: FP8 GEMMs; input already FP8 from Quantize [4]" in text
    assert "output gradient: standalone cast (E5M2)" in text  # [4]: GELU's backward is not next to it
    assert "[1] BasicLinear" in text and "output gradient (E5M2) written for it by the fused backward of [2...]" in text
    assert "[7] GroupedLinear: FP8 grouped GEMMs" in text
    with fo.autocast(recipe=fo.Float8BlockScaling()):
        assert "[7] GroupedLinear: block-scaled FP8 grouped GEMMs" in seq.explain(x, torch.tensor([64, 64]))


def _amax_reduction_worker(rank, world, init_file, out_dir):
    import os

    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        lin = fo.Linear(64, 64)  # the same weights on every rank
        x = torch.randn(32, 64) * (rank + 1)  # a different input amax per rank
        recipe = fo.Float8DelayedScaling(amax_history_len=4)
        group = torch.distributed.group.WORLD
        for _ in range(2):  # the second call reduces the amax the first one recorded
            with fo.autocast(recipe=recipe, amax_reduction_group=group):
                lin(x)
        torch.save({"scale": lin.fp8_scale.clone(), "amax": x.abs().max()}, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def test_delayed_amax_reduced_over_a_process_group(tmp_path):
    import torch.multiprocessing as mp

    world = 2
    mp.spawn(_amax_reduction_worker, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world)
    r = [torch.load(tmp_path / f"{i}.pt") for i in range(world)]
    assert torch.equal(r[0]["scale"][0], r[1]["scale"][0])  # the input scale: one value on every rank
    expected = 448.0 / max(r[0]["amax"], r[1]["amax"])  # from the max over ranks
    assert r[0]["scale"][0].item() == pytest.approx(float(expected), rel=1e-6)


def _casting_itself(act):
    """``act`` turned into an activation that never serves an FP8 linear (each linear casts its
    input and output gradient itself): the baseline the hand-off must equal."""

    class Plain(type(act)):
        writes_fp8_grad = False

        def op_forward(self, ctx, x, next_op_input_quantizer=None, **kwargs):
            return super().op_forward(ctx, x)

        def fuser_backward(self, ctxs, dy, *, grad_extra_outputs, **kwargs):
            return self.op_backward(ctxs[0], dy)[0], [()], [()]

    act.__class__ = Plain
    return act


@pytest.mark.parametrize("recipe", RECIPES[:3], ids=IDS[:3])
@pytest.mark.parametrize("chain", ["bias_gelu", "swiglu"])
@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_activation_writes_the_next_linears_fp8_input(recipe, chain, dev, cast_roles):
    """Hand-off: the activation writes the second linear's FP8 input (its pass records the amax,
    then one cast writes both layouts; block: a standalone cast), its backward writes the first
    linear's FP8 output gradient the same way, and the results equal those of a chain whose linears
    cast themselves. ``bias_gelu``: the fused bias + GELU of rule linear_bias_activation;
    ``swiglu``: a bias-free Llama MLP, the basic SwiGLU op (no rule matches)."""
    import copy

    if dev == "cuda" and not G.fp8_capable(torch.device("cuda")):
        pytest.skip("needs FP8 tensor cores")
    if chain == "bias_gelu":
        fused = _mlp(dev)
        rules = ["linear_bias_activation", "linear_bias"]
    else:
        torch.manual_seed(0)
        fused = fo.Sequential(fo.Linear(128, 512, bias=False, device=dev), fo.SwiGLU(),
                              fo.Linear(256, 128, bias=False, device=dev))
        rules = [None, None]
    plain = copy.deepcopy(fused)
    _casting_itself(plain[1])
    g = torch.Generator().manual_seed(5)
    x, dy = torch.randn(128, 128, generator=g).to(dev), torch.randn(128, 128, generator=g).to(dev)
    casts = cast_roles
    outs = {}
    for name, seq in (("fused", fused), ("plain", plain)):
        casts.clear()
        ctx = (disabled("linear_bias_activation", "activation_bias_backward") if name == "plain"
               else torch.enable_grad())
        with ctx:
            for _ in range(2):  # delayed scaling: the second step reads the history
                y, dx = _run(seq, x, dy, recipe)
            outs[name] = (y, dx, seq[2].weight.grad.clone(), seq[0].weight.grad.clone(), _count(casts, "input"),
                          _count(casts, "grad_output"))
            assert [r["rule"] for r in seq.fusion_plan()][0] == (rules[0] if name == "fused" else rules[1])
    assert outs["plain"][4:] == (4, 4)  # two steps: both linears cast their input and output gradient
    # the second linear's input came from the activation, the first linear's gradient from its backward
    assert outs["fused"][4:] == (2, 2)
    for a, b in zip(outs["fused"][:4], outs["plain"][:4]):
        assert torch.equal(a, b)
    with fo.autocast(recipe=recipe):
        text = fused.explain(x)
    assert "input written for it by the fused producer of [" in text.split("[2] BasicLinear")[-1], text


@pytest.mark.parametrize("recipe", RECIPES[:3], ids=IDS[:3])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("residual", [False, True])
def test_norm_writes_the_next_linears_fp8_input(recipe, norm, residual, monkeypatch, cast_roles):
    """Hand-off from LayerNorm / RMSNorm (residual-fused or not): no cast in the linear, and the same
    results as the chain with the linear casting its input itself."""
    import copy

    import fusible_ops.ops.norm as N

    cls = fo.LayerNorm if norm == "layernorm" else fo.RMSNorm
    torch.manual_seed(0)
    ops = ([fo.AddExtraInput()] if residual else []) + [cls(128), fo.Linear(128, 128)]
    fused = fo.Sequential(*ops)
    plain = copy.deepcopy(fused)
    g = torch.Generator().manual_seed(6)
    x, r, dy = (torch.randn(128, 128, generator=g) for _ in range(3))
    extra = (r,) if residual else ()
    casts = cast_roles
    outs = []
    for seq, hand_off in ((fused, True), (plain, False)):
        casts.clear()
        if not hand_off:  # the norm ignores the quantizer: the linear casts
            monkeypatch.setattr(N._Norm, "writes_fp8_output", False)
            orig = N._Norm._run
            monkeypatch.setattr(N._Norm, "_run", lambda self, x, w, b, res, quant: orig(self, x, w, b, res, None))
        xx = x.clone().requires_grad_()
        for _ in range(2):
            with fo.autocast(recipe=recipe):
                y = seq(xx, *extra)
            y.backward(dy)
        outs.append((y, xx.grad, seq[-1].weight.grad.clone(), _count(casts, "input")))
    assert outs[0][3] == 0 and outs[1][3] == 2
    for a, b in zip(outs[0][:3], outs[1][:3]):
        assert torch.equal(a, b)


def test_delayed_hand_off_without_grad_writes_fp8_in_the_producer(monkeypatch):
    """No gradient (no transposed copy needed): the activation kernel writes the FP8 bytes itself
    (no plain output, no cast); the result equals the unfused chain's."""
    import copy

    from fusible_ops.fusion_rules import disabled
    from fusible_ops.kernels import activation as A

    recipe = fo.Float8DelayedScaling(amax_history_len=4)
    fused = _mlp()
    plain = copy.deepcopy(fused)
    _casting_itself(plain[1])
    x = torch.randn(64, 128)
    calls = []
    real = A.bias_act_fwd_fp8
    monkeypatch.setattr(A, "bias_act_fwd_fp8", lambda *a, **k: calls.append(k.get("scale") is not None) or real(*a, **k))
    with torch.no_grad(), fo.autocast(recipe=recipe):
        for _ in range(2):
            y = fused(x)
        with disabled("linear_bias_activation"):
            for _ in range(2):
                yp = plain(x)
    assert calls == [True, True]  # FP8 written by the producer, both calls
    assert torch.equal(y, yp)


def test_graph_weight_refresh_recasts_only_changed_weights():
    """What a graphed module runs before a replay (fusible_ops.make_graphed_callables): the FP8
    weight the graph reads is re-cast in place, once, after the weight changed; else nothing."""
    lin = fo.Linear(128, 256)
    recipe = fo.Float8CurrentScaling()
    wq = Q.cached_weight(lin, lin.weight, recipe, transposed=True)
    bufs = (wq._data, wq._scale_inv, wq._data_t)
    entries = [(lin, lin.weight, recipe, True, False, True, wq)]
    Q.refresh_graph_weights(entries)
    assert lin.fp8_weight_casts == 1  # unchanged weight: no cast
    with torch.no_grad():
        lin.weight.add_(torch.randn_like(lin.weight))
    Q.refresh_graph_weights(entries)
    Q.refresh_graph_weights(entries)
    assert lin.fp8_weight_casts == 2
    fresh = Q.quantize(lin.weight.detach(), recipe, "weight", transposed=True)
    assert all(a is b for a, b in zip((wq._data, wq._scale_inv, wq._data_t), bufs))  # written in place
    assert torch.equal(wq._data.view(torch.uint8), fresh._data.view(torch.uint8))
    assert torch.equal(wq._data_t.view(torch.uint8), fresh._data_t.view(torch.uint8))
    assert torch.equal(wq._scale_inv, fresh._scale_inv)
    assert Q.cached_weight(lin, lin.weight, recipe, transposed=True) is wq  # the eager cache agrees
