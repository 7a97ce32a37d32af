"""CrossEntropy (the op) and linear_cross_entropy (BasicLinear -> CrossEntropy, chunked): against
float64 ``F.cross_entropy(x @ W.T)`` for every option and reduction, ignored rows, all rows ignored,
chunks that do not divide the tokens, bf16 and fp32, 3-D input; no [T, V] tensor kept; errors."""

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given  # (the CI profile: tests/conftest.py)
from hypothesis import strategies as st

import fusible_ops as fo
from fusible_ops.fusion_rules import disabled
from fusible_ops.fusion_rules import linear_ce as LCE
from fusible_ops.ops.loss import cross_entropy_ref
from fusible_ops.testing import SQNR_DB, assert_close, assert_close_norm, assert_sqnr

D, V = 24, 37  # (V prime: no chunk or block divides it)
OPTIONS = [dict(), dict(label_smoothing=0.1), dict(z_loss_coeff=1e-3), dict(logit_softcap=5.0),
           dict(ignore_index=3, label_smoothing=0.2, z_loss_coeff=1e-2, logit_softcap=3.0)]
OPT_IDS = ["plain", "smoothing", "z_loss", "softcap", "all"]


def _targets(shape, ignore_index=-100, seed=1, n_ignored=3):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, V, shape, generator=g)
    t.view(-1)[:n_ignored] = ignore_index
    return t


def _head(dtype, opts, reduction):
    torch.manual_seed(0)
    return fo.Sequential(fo.Linear(D, V, bias=False, dtype=dtype), fo.CrossEntropy(reduction=reduction, **opts))


def _float64(seq, x, t, dy):
    """Loss, dx and dW of F.cross_entropy(x @ W.T) in float64 (plus z-loss / softcap as documented)."""
    ce = seq[1]
    w = seq[0].weight.detach().double().requires_grad_()
    x64 = x.detach().double().requires_grad_()
    loss = cross_entropy_ref(x64 @ w.t(), t, ce.ignore_index, ce.reduction, ce.label_smoothing, ce.z_loss_coeff,
                             ce.logit_softcap)
    loss.backward(dy.double())
    return loss, x64.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opts", OPTIONS, ids=OPT_IDS)
@pytest.mark.parametrize("fused", ["forward", "backward", False], ids=["grad_in_forward", "recompute", "unfused"])
def test_loss_and_gradients_match_float64(fused, opts, reduction, dtype, monkeypatch):
    """Loss (float32; float64 for float64 logits, fused or not), dx and dW against float64."""
    monkeypatch.setattr(LCE, "CHUNK_BYTES", V * 4 * dtype.itemsize)  # 4 rows per chunk: 3 chunks for 10 tokens
    monkeypatch.setattr(LCE, "GRAD_IN_FORWARD", fused == "forward")
    seq = _head(dtype, opts, reduction)
    x = torch.randn(2, 5, D, dtype=dtype, requires_grad=True)  # 3-D input
    t = _targets((2, 5), opts.get("ignore_index", -100))
    dy = torch.randn(2, 5) if reduction == "none" else torch.tensor(1.7)
    with (torch.enable_grad() if fused else disabled("linear_cross_entropy")):
        rule = [r["rule"] for r in seq.fusion_plan("forward", x, t)][-1]
        loss = seq(x, t)
        loss.backward(dy)
    assert rule == ("linear_cross_entropy" if fused else None)
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert loss.shape == (() if reduction != "none" else t.shape)
    want_loss, want_dx, want_dw = _float64(seq, x, t, dy)
    assert_close(loss, want_loss, dtype, msg="loss")  # (the logits are a GEMM's output in x's dtype)
    assert x.grad.dtype == dtype
    assert_close_norm(x.grad, want_dx, dtype, msg="dx")
    assert_close_norm(seq[0].weight.grad, want_dw, dtype, msg="dW")


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_all_rows_ignored(fused):
    """As F.cross_entropy: the mean is NaN, the sum 0, every gradient 0."""
    for reduction, want in (("mean", float("nan")), ("sum", 0.0)):
        seq = _head(torch.float32, {}, reduction)
        x = torch.randn(6, D, requires_grad=True)
        t = torch.full((6,), -100)
        with (torch.enable_grad() if fused else disabled("linear_cross_entropy")):
            loss = seq(x, t)
            loss.backward()
        assert torch.equal(loss, torch.tensor(want)) or (loss.isnan() and want != want)
        assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(seq[0].weight.grad, torch.zeros(V, D))


def test_op_alone_matches_torch_and_reference_forward():
    ce = fo.CrossEntropy(label_smoothing=0.1)
    z = torch.randn(3, 4, V, dtype=torch.float64, requires_grad=True)
    t = _targets((3, 4))
    got = fo.Sequential(ce)(z, t)
    want = F.cross_entropy(z.reshape(-1, V), t.reshape(-1), label_smoothing=0.1)
    assert_close(got, want, torch.float64)
    assert_close(ce.reference_forward(z, t), want, torch.float64)
    (g,) = torch.autograd.grad(got, z)
    (g2,) = torch.autograd.grad(want, z)
    assert_close(g, g2, torch.float64)


def test_fused_head_keeps_no_tokens_by_vocab_tensor(monkeypatch):
    """Saved-tensor bytes: the fused head keeps x, W, targets and one fp32 per token; unfused the
    [T, V] logits are saved (the test can fail)."""
    monkeypatch.setattr(LCE, "CHUNK_BYTES", 4 * V * 16)
    T = 64

    def largest_saved(fused):
        seq = _head(torch.float32, {}, "mean")
        x = torch.randn(T, D, requires_grad=True)
        sizes = []

        def pack(t):
            sizes.append(t.numel())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with (torch.enable_grad() if fused else disabled("linear_cross_entropy")):
                seq(x, _targets((T,))).backward()
        return max(sizes, default=0)

    assert largest_saved(True) < T * V
    assert largest_saved(False) >= T * V


def test_tied_embedding_weight_gets_both_gradients():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(V, D)
    head = fo.Sequential(fo.Linear(D, V, bias=False), fo.CrossEntropy())
    head[0].weight = emb.weight  # (tied: one Parameter)
    ids, t = _targets((12,), n_ignored=0), _targets((12,), seed=2)
    head(emb(ids), t).backward()
    got = emb.weight.grad.clone()
    ref_w = emb.weight.detach().double().requires_grad_()
    F.cross_entropy(F.embedding(ids, ref_w) @ ref_w.t(), t).backward()
    assert [r["rule"] for r in head.fusion_plan("forward", emb(ids), t)] == ["linear_cross_entropy"]
    assert_close_norm(got, ref_w.grad, torch.float32)


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_fp8_current_scaling_runs_the_chunked_gemms_in_fp8(reduction, monkeypatch):
    """Under Float8CurrentScaling the fused head's GEMMs run FP8 (CPU: emulation): per-token losses
    and gradients against float64 within the FP8 SQNR table; chunks of 16 tokens (the FP8 dims)."""
    monkeypatch.setattr(LCE, "CHUNK_BYTES", 4 * 48 * 16)
    torch.manual_seed(0)
    seq = fo.Sequential(fo.Linear(32, 48, bias=False), fo.CrossEntropy(reduction=reduction))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 32, generator=g, requires_grad=True)
    t = torch.randint(0, 48, (64,), generator=g)
    dy = torch.randn(64, generator=g) if reduction == "none" else torch.tensor(1.0)
    recipe = fo.Float8CurrentScaling()
    with fo.autocast(recipe=recipe):
        assert [r["rule"] for r in seq.fusion_plan("forward", x, t)] == ["linear_cross_entropy"]
        assert "FP8 GEMMs" in seq.explain(x, t)
        loss = seq(x, t)
    loss.backward(dy)
    want_loss, want_dx, want_dw = _float64(seq, x, t, dy)
    if reduction == "none":
        assert_sqnr(loss, want_loss, SQNR_DB["output", recipe.fp8_format], msg="loss")
    assert_sqnr(x.grad, want_dx, SQNR_DB["grad", recipe.fp8_format], msg="dx")
    assert_sqnr(seq[0].weight.grad, want_dw, SQNR_DB["grad", recipe.fp8_format], msg="dW")
    # the FP8 path is what ran: the same head outside autocast differs
    x2 = x.detach().clone().requires_grad_()
    assert not torch.equal(seq(x2, t), loss.detach())


@pytest.mark.parametrize("recipe", [fo.Float8DelayedScaling(), fo.Float8BlockScaling()], ids=["delayed", "block"])
def test_declines_under_other_fp8_recipes_and_names_the_reason(recipe):
    seq = fo.Sequential(fo.Linear(128, 256, bias=False), fo.CrossEntropy())
    x, t = torch.randn(128, 128), torch.randint(0, 256, (128,))
    with fo.autocast(recipe=recipe):
        text = seq.explain(x, t)
        loss = seq(x, t)
    assert "rule 'linear_cross_entropy'" in text and "Float8CurrentScaling only" in text
    assert torch.isfinite(loss)


def test_explain_shows_the_chunking_and_schedule(monkeypatch):
    monkeypatch.setattr(LCE, "CHUNK_BYTES", 4 * V * 4)
    text = _head(torch.float32, {}, "mean").explain(torch.randn(10, D), _targets((10,)))
    assert "3 chunk(s) of 4 token(s), no [10, 37] logits; gradients in forward (3 GEMMs)" in text
    text = _head(torch.float32, {}, "none").explain(torch.randn(10, D), _targets((10,)))
    assert "logits recomputed in backward (4 GEMMs)" in text


def test_chunk_rows_follows_the_memory_target(monkeypatch):
    monkeypatch.setattr(LCE, "CHUNK_BYTES", 128 << 20)
    assert LCE.chunk_rows(128256, 16384, 2) == 512  # (523 rows fit: rounded down to a multiple of 128)
    assert LCE.chunk_rows(128256, 300, 2) == 300
    assert LCE.chunk_rows(128256, 16384, 4) == 256
    assert LCE.chunk_rows(10**9, 5, 2) == 1
    assert LCE.chunk_rows(10**9, 64, 2, fp8=True) == 16


def test_gradients_in_forward_run_backward_once():
    """The default schedule hands out gradients made in forward and scaled in place: a second
    backward raises (autograd's in-place check) instead of returning a wrong gradient; the
    recompute schedule allows it."""
    seq = _head(torch.float32, {}, "mean")
    x, t = torch.randn(6, D, requires_grad=True), _targets((6,))
    loss = seq(x, t)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    old, LCE.GRAD_IN_FORWARD = LCE.GRAD_IN_FORWARD, False
    try:
        x.grad = None
        loss = seq(x, t)
        loss.backward(retain_graph=True)
        first = x.grad.clone()
        loss.backward()
    finally:
        LCE.GRAD_IN_FORWARD = old
    assert torch.allclose(x.grad, 2 * first)


def test_gradients_in_forward_keep_neither_x_nor_w_nor_logits():
    """The default schedule keeps dx and dW (made in forward), neither x nor any [T, V] tensor."""
    seq = _head(torch.float32, {}, "sum")
    x, t = torch.randn(6, D, requires_grad=True), _targets((6,))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda s: saved.append(s.shape) or s, lambda s: s):
        seq(x, t).backward()
    assert saved == [(6, D), (V, D)]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_bad_targets_raise_naming_the_op(fused):
    seq = _head(torch.float32, {}, "mean")
    x = torch.randn(4, D)
    with (torch.enable_grad() if fused else disabled("linear_cross_entropy")):
        with pytest.raises(ValueError, match=r"CrossEntropy: target 37 is out of range \[0, 37\)"):
            seq(x, torch.tensor([0, 1, 37, 2]))
        with pytest.raises(TypeError, match="CrossEntropy: targets must be integer class ids"):
            seq(x, torch.zeros(4))
        with pytest.raises(ValueError, match="CrossEntropy: targets must have the logits' shape"):
            seq(x, torch.zeros(4, 1, dtype=torch.long))
        assert torch.isfinite(seq(x, torch.tensor([0, -100, 36, 2])))  # ignore_index is no error


def test_bad_options_raise():
    with pytest.raises(ValueError, match="reduction"):
        fo.CrossEntropy(reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing"):
        fo.CrossEntropy(label_smoothing=1.5)
    with pytest.raises(ValueError, match="logit_softcap"):
        fo.CrossEntropy(logit_softcap=0.0)


def test_targets_by_name_and_deepcopy():
    seq = _head(torch.float32, {}, "mean")
    x, t = torch.randn(5, D), _targets((5,), n_ignored=0)
    assert torch.equal(seq(x, targets=t), copy.deepcopy(seq)(x, t))


@pytest.mark.gpu
@pytest.mark.parametrize("reduction,schedule", [("mean", None), ("mean", False), ("none", None)])
def test_gpu_fused_head_matches_float64(reduction, schedule, monkeypatch):
    monkeypatch.setattr(LCE, "CHUNK_BYTES", 2 * 1000 * 128)  # 128-token chunks: 5 for 520 tokens
    monkeypatch.setattr(LCE, "GRAD_IN_FORWARD", schedule)
    torch.manual_seed(0)
    seq = fo.Sequential(fo.Linear(256, 1000, bias=False, device="cuda", dtype=torch.bfloat16),
                        fo.CrossEntropy(reduction=reduction, z_loss_coeff=1e-4))
    x = torch.randn(4, 130, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 1000, (4, 130), device="cuda")
    t[0, :7] = -100
    dy = torch.randn(4, 130, device="cuda") if reduction == "none" else torch.tensor(1.0, device="cuda")
    assert [r["rule"] for r in seq.fusion_plan("forward", x, t)] == ["linear_cross_entropy"]
    loss = seq(x, t)
    loss.backward(dy)
    want_loss, want_dx, want_dw = _float64(seq, x, t, dy)
    assert_close(loss, want_loss, torch.bfloat16, msg="loss")
    assert_close_norm(x.grad, want_dx, torch.bfloat16, msg="dx")
    assert_close_norm(seq[0].weight.grad, want_dw, torch.bfloat16, msg="dW")


@given(T=st.integers(0, 19), d=st.integers(1, 9), vocab=st.integers(1, 23), chunk=st.integers(1, 7),
       reduction=st.sampled_from(["mean", "sum", "none"]), smoothing=st.sampled_from([0.0, 0.3]),
       z=st.sampled_from([0.0, 0.01]), cap=st.sampled_from([None, 2.0]), ignored=st.integers(0, 19),
       seed=st.integers(0, 2**16))
def test_fused_head_property_against_float64(T, d, vocab, chunk, reduction, smoothing, z, cap, ignored, seed):
    """Any token count (0 included), width, vocabulary and chunk size: the fused head equals the
    float64 composition (fp32 tolerance), and fused it is."""
    g = torch.Generator().manual_seed(seed)
    seq = fo.Sequential(fo.Linear(d, vocab, bias=False),
                        fo.CrossEntropy(reduction=reduction, label_smoothing=smoothing, z_loss_coeff=z, logit_softcap=cap))
    with torch.no_grad():
        seq[0].weight.copy_(torch.randn(vocab, d, generator=g))
    x = torch.randn(T, d, generator=g, requires_grad=True)
    t = torch.randint(0, vocab, (T,), generator=g)
    t[: min(ignored, T)] = -100
    dy = torch.randn(T, generator=g) if reduction == "none" else torch.tensor(0.7)
    old, LCE.CHUNK_BYTES = LCE.CHUNK_BYTES, 4 * vocab * chunk
    try:
        assert [r["rule"] for r in seq.fusion_plan("forward", x, t)] == ["linear_cross_entropy"]
        loss = seq(x, t)
        loss.backward(dy)
    finally:
        LCE.CHUNK_BYTES = old
    want_loss, want_dx, want_dw = _float64(seq, x, t, dy)
    if reduction == "mean" and bool((t == -100).all()):
        assert loss.isnan() and want_loss.isnan()
    else:
        assert_close(loss, want_loss, torch.float32, msg="loss")
    assert_close(x.grad, want_dx, torch.float32, msg="dx")
    assert_close(seq[0].weight.grad, want_dw, torch.float32, msg="dW")


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torch_compile_of_the_fused_head_has_no_graph_break(reduction):
    """torch.compile of a step through the fused head: one graph, no break (the targets' range
    check is an asynchronous assert while tracing), the same loss and gradients as eager."""
    from torch._dynamo.utils import counters

    seq = _head(torch.float32, {}, reduction)
    x, t = torch.randn(12, D, requires_grad=True), _targets((12,))
    seq(x, t).sum().backward()
    want = [x.grad.clone(), seq[0].weight.grad.clone()]
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(lambda x, t: seq(x, t), backend="aot_eager")
    for _ in range(3):
        x.grad = seq[0].weight.grad = None
        step(x, t).sum().backward()
    assert sum(counters["graph_break"].values()) == 0 and counters["stats"]["unique_graphs"] == 1
    assert torch.allclose(x.grad, want[0], atol=1e-6) and torch.allclose(seq[0].weight.grad, want[1], atol=1e-6)


@pytest.mark.interpreter
@pytest.mark.parametrize("schedule", [None, False], ids=["grad_in_forward", "recompute"])
def test_fused_head_with_the_triton_kernels_matches_float64(schedule, monkeypatch):
    """The fused head with the loss kernels themselves (Triton's interpreter on CPU): chunks of 4
    rows over a V that needs several column steps, every option."""
    import fusible_ops.kernels as K
    from fusible_ops.kernels import cross_entropy as kce

    monkeypatch.setattr(kce, "MAX_BLOCK_V", 16)
    monkeypatch.setattr(LCE, "CHUNK_BYTES", V * 4 * 4)
    monkeypatch.setattr(LCE, "GRAD_IN_FORWARD", schedule)
    seq = _head(torch.float32, OPTIONS[-1], "mean")
    x = torch.randn(10, D, requires_grad=True)
    t = _targets((10,), OPTIONS[-1]["ignore_index"])
    launches = []
    launch = kce._launch
    monkeypatch.setattr(kce, "_launch", lambda *a: launches.append(a[-2:]) or launch(*a))
    with K.use("triton"):
        loss = seq(x, t)
        loss.backward(torch.tensor(1.3))
    assert len(launches) == (3 if schedule is None else 6)  # (3 chunks: loss + gradient, or loss then gradient)
    want_loss, want_dx, want_dw = _float64(seq, x, t, torch.tensor(1.3))
    assert_close(loss, want_loss, torch.float32, msg="loss")
    assert_close_norm(x.grad, want_dx, torch.float32, msg="dx")
    assert_close_norm(seq[0].weight.grad, want_dw, torch.float32, msg="dW")
