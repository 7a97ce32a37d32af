"""Fused grouped-GLU kernels (fusible_ops.kernels.grouped_glu) vs refs vs float64 autograd math."""

import pytest
import torch
import torch.nn.functional as Fn

import fusible_ops.kernels as K
from fusible_ops.kernels import grouped_gemm as gg
from fusible_ops.kernels import launch
from fusible_ops.kernels import grouped_glu as gm
from fusible_ops.testing import assert_close, assert_close_norm

CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _fixed_configs(monkeypatch):
    """No autotuning in tests (one compile per variant); test_gpu_autotuned* opt back in."""
    monkeypatch.setattr(launch, "AUTOTUNE", False)
DEV = "cuda" if CUDA else "cpu"
KINDS = ["swiglu", "geglu", "geglu_tanh", "scaled_swiglu"]


def _gid(split):
    return torch.repeat_interleave(torch.arange(split.numel()), split.cpu())


def _act64(a, kind):
    if kind in ("swiglu", "scaled_swiglu"):
        return Fn.silu(a)
    return Fn.gelu(a, approximate="tanh" if kind == "geglu_tanh" else "none")


def glu64(h, kind, scales=None):
    a, b = h.chunk(2, dim=-1)
    y = _act64(a, kind) * b
    return y if scales is None else y * scales[:, None]


def glu_fwd64(x, w1, split, bias1, kind, scales):
    gid = _gid(split)
    h = torch.einsum("mk,mnk->mn", x.double().cpu(), w1.double().cpu()[gid])
    if bias1 is not None:
        h = h + bias1.double().cpu()[gid]
    return glu64(h, kind, None if scales is None else scales.double().cpu()), h


def dglu64(dy2, w2, split, h, kind, scales):
    """Autograd of glu(h) * scales in float64, upstream g = dy2_g @ w2[g]."""
    g = torch.einsum("mh,mhf->mf", dy2.double().cpu(), w2.double().cpu()[_gid(split)])
    h64 = h.double().cpu().requires_grad_()
    s64 = (torch.ones(h.shape[0], dtype=torch.float64) if scales is None else scales.double().cpu()).requires_grad_()
    y = glu64(h64, kind, s64)
    dh, ds = torch.autograd.grad(y, (h64, s64), g)
    return dh, y.detach(), ds


def _data(M, F, Kd, H, splits, dtype, kind, device=DEV, seed=0):
    gen = torch.Generator().manual_seed(seed)
    G = len(splits)
    split = torch.tensor(splits, dtype=torch.int64).to(device)
    x = torch.randn(M, Kd, generator=gen).to(device, dtype)
    w1 = (torch.randn(G, 2 * F, Kd, generator=gen) * 1.5 / Kd ** 0.5).to(device, dtype)
    b1 = (0.3 * torch.randn(G, 2 * F, generator=gen)).to(device, dtype)
    w2 = (torch.randn(G, H, F, generator=gen) / F ** 0.5).to(device, dtype)
    dy2 = torch.randn(M, H, generator=gen).to(device, dtype)
    scales = torch.rand(M, generator=gen).to(device) if kind == "scaled_swiglu" else None
    return x, w1, b1, w2, dy2, scales, split


def _check_fwd(x, w1, split, b1, kind, scales, dtype):
    with K.use("triton"):
        y, h = gm.grouped_glu_fwd(x, w1, split, b1, kind, scales)
    y64, h64 = glu_fwd64(x, w1, split, b1, kind, scales)
    assert y.dtype == dtype and h.dtype == dtype
    assert_close_norm(h, h64, dtype, msg=f"h {kind}")
    assert_close_norm(y, y64, dtype, msg=f"y {kind}")
    # y is glu of h as stored (what backward recomputes)
    y_h = glu64(h.double().cpu(), kind, None if scales is None else scales.double().cpu())
    assert_close(y, y_h, dtype, msg=f"y vs glu(h) {kind}")
    return h


def _check_dglu(dy2, w2, split, h, kind, scales, dtype):
    with K.use("triton"):
        dh, y, ds = gm.grouped_dglu(dy2, w2, split, h, kind, scales, need_dscales=scales is not None)
    dh64, y64, ds64 = dglu64(dy2, w2, split, h, kind, scales)
    assert dh.dtype == dtype and y.dtype == dtype
    assert_close_norm(dh, dh64, dtype, msg=f"dh {kind}")
    assert_close_norm(y, y64, dtype, msg=f"y {kind}")
    if scales is None:
        assert ds is None
    else:
        assert ds.dtype == torch.float32 and ds.shape == (h.shape[0],)
        assert_close_norm(ds, ds64, dtype, msg=f"dscales {kind}")


# ---------------------------------------------------------------- refs vs float64 autograd (CPU)
@pytest.mark.parametrize("kind", KINDS)
def test_refs_match_float64(kind):
    dtype = torch.float32
    x, w1, b1, w2, dy2, scales, split = _data(40, 12, 16, 10, [10, 0, 30], dtype, kind, "cpu")
    y, h = gm.grouped_glu_fwd_ref(x, w1, split, b1, kind, scales)
    y64, h64 = glu_fwd64(x, w1, split, b1, kind, scales)
    assert_close_norm(h, h64, dtype)
    assert_close_norm(y, y64, dtype)
    dh, y2, ds = gm.grouped_dglu_ref(dy2, w2, split, h, kind, scales, need_dscales=True)
    dh64, y2_64, ds64 = dglu64(dy2, w2, split, h, kind, scales)
    assert_close_norm(dh, dh64, dtype)
    assert_close_norm(y2, y2_64, dtype)
    g = torch.einsum("mh,mhf->mf", dy2.double(), w2.double()[_gid(split)])
    assert_close_norm(ds, (g * glu64(h.double(), kind)).sum(-1), dtype)
    # the ref in float64 is exact against autograd
    dh_64, _, ds_64 = gm.grouped_dglu_ref(dy2.double(), w2.double(), split, h.double(), kind,
                                          None if scales is None else scales.double(), True)
    assert_close(dh_64, dh64, torch.float64)
    if scales is not None:
        assert_close(ds_64, ds64, torch.float64)


# ---------------------------------------------------------------- Triton (interpreter on CPU)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_glu_fwd_and_dglu(kind, dtype):
    x, w1, b1, w2, dy2, scales, split = _data(70, 20, 40, 24, [20, 0, 37, 13], dtype, kind)
    h = _check_fwd(x, w1, split, b1 if kind != "geglu" else None, kind, scales, dtype)
    _check_dglu(dy2, w2, split, h, kind, scales, dtype)


def test_odd_tiny_and_noncontiguous():
    dtype = torch.float16
    x, w1, b1, w2, dy2, scales, split = _data(7, 3, 5, 6, [3, 4], dtype, "scaled_swiglu")
    h = _check_fwd(x, w1, split, b1, "scaled_swiglu", scales, dtype)
    _check_dglu(dy2, w2, split, h, "scaled_swiglu", scales, dtype)
    x, w1, b1, w2, dy2, scales, split = _data(33, 17, 24, 9, [0, 33], dtype, "swiglu")
    xs = torch.cat([x, x], 1)[:, 1::2]
    w1t = w1.transpose(1, 2).contiguous().transpose(1, 2)
    w2t = w2.transpose(1, 2).contiguous().transpose(1, 2)
    dyt = dy2.t().contiguous().t()
    sc = torch.rand(66, device=DEV)[::2]
    h = _check_fwd(xs, w1t, split, b1, "swiglu", sc, dtype)
    ht = h.t().contiguous().t()
    _check_dglu(dyt, w2t, split, ht, "swiglu", sc, dtype)
    x, w1, b1, w2, dy2, scales, split = _data(1, 1, 1, 1, [1], torch.float32, "geglu")
    h = _check_fwd(x, w1, split, None, "geglu", None, torch.float32)
    _check_dglu(dy2, w2, split, h, "geglu", None, torch.float32)


def test_zero_rows():
    x, w1, b1, w2, dy2, scales, split = _data(0, 8, 16, 12, [0, 0], torch.float32, "scaled_swiglu")
    with K.use("triton"):
        y, h = gm.grouped_glu_fwd(x, w1, split, b1, "scaled_swiglu", scales)
        dh, y2, ds = gm.grouped_dglu(dy2, w2, split, h, "scaled_swiglu", scales, need_dscales=True)
    assert y.shape == (0, 8) and h.shape == (0, 16) and dh.shape == (0, 16) and y2.shape == (0, 8)
    assert ds.shape == (0,)


def test_tma_path_logic_under_interpreter(monkeypatch):
    if CUDA:
        pytest.skip("covered by the GPU tests")
    monkeypatch.setattr(gm, "tma_ok", lambda *t: True)
    dtype = torch.float16
    x, w1, b1, w2, dy2, scales, split = _data(70, 24, 48, 32, [20, 0, 37, 13], dtype, "scaled_swiglu")
    h = _check_fwd(x, w1, split, b1, "scaled_swiglu", scales, dtype)
    _check_dglu(dy2, w2, split, h, "scaled_swiglu", scales, dtype)


def test_bad_kind_and_missing_scales():
    x, w1, b1, w2, dy2, scales, split = _data(7, 3, 5, 6, [3, 4], torch.float32, "swiglu")
    with pytest.raises(ValueError):
        gm.grouped_glu_fwd(x, w1, split, None, "relu")
    with pytest.raises(ValueError):
        gm.grouped_glu_fwd(x, w1, split, None, "scaled_swiglu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", ["swiglu", "scaled_swiglu"])
def test_fwd_gathered_rows_equal_the_gathered_copy(dtype, kind):
    """``gather``: row r reads x[gather[r]] inside the mainloop; exactly the gathered copy's result."""
    x, w1, b1, _, _, scales, split = _data(40, 12, 24, 8, [7, 0, 25, 8], dtype, kind)
    tokens = x[:11]
    gather = torch.randint(0, 11, (40,), generator=torch.Generator().manual_seed(5)).to(DEV)
    with K.use("triton"):
        y, h = gm.grouped_glu_fwd(tokens, w1, split, b1, kind, scales, gather)
        y0, h0 = gm.grouped_glu_fwd(tokens[gather], w1, split, b1, kind, scales)
    assert torch.equal(y, y0) and torch.equal(h, h0)
    with K.use("reference"):
        yr, hr = gm.grouped_glu_fwd(tokens, w1, split, b1, kind, scales, gather)
    assert_close_norm(hr, h.double(), dtype)
    with pytest.raises(ValueError, match="gather must be a contiguous 1-D int64"):
        gm.grouped_glu_fwd(tokens, w1, split, b1, kind, scales, gather.to(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_fwd_gathered_rows(dtype):
    """TMA-eligible shapes: the weights through TMA, the gathered rows through pointer loads."""
    x, w1, b1, _, _, _, split = _data(1000, 136, 200, 64, [300, 0, 411, 1, 288], dtype, "swiglu")
    gather = torch.randint(0, 700, (1000,), generator=torch.Generator().manual_seed(6)).to(DEV)
    tokens = x[:700]
    y, h = gm.grouped_glu_fwd(tokens, w1, split, b1, "swiglu", None, gather)
    y64, h64 = glu_fwd64(tokens[gather], w1, split, b1, "swiglu", None)
    assert_close_norm(h, h64, dtype)
    assert_close_norm(y, y64, dtype)
    y0, h0 = gm.grouped_glu_fwd(tokens[gather], w1, split, b1, "swiglu", None)
    assert torch.equal(h, h0) and torch.equal(y, y0)


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, w1, split = torch.empty(9, 8), torch.empty(3, 10, 8), torch.empty(3, dtype=torch.int64)
        y, h = torch.ops.fusible_ops.grouped_glu_fwd(x, w1, split, None, "swiglu", None, None)
        assert y.shape == (9, 5) and h.shape == (9, 10)
        yg, hg = torch.ops.fusible_ops.grouped_glu_fwd(x, w1, split, None, "swiglu", None,
                                                       torch.empty(12, dtype=torch.int64))
        assert yg.shape == (12, 5) and hg.shape == (12, 10)
        dh, y2, ds = torch.ops.fusible_ops.grouped_dglu(torch.empty(9, 6), torch.empty(3, 6, 5), split, h,
                                                        "swiglu", None, True)
        assert dh.shape == (9, 10) and y2.shape == (9, 5) and ds.shape == (9,)


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("M,F,Kd,H,splits", [(1000, 200, 136, 72, [300, 0, 411, 1, 288]),
                                              (513, 97, 100, 50, [0, 513])])
def test_gpu_glu_fwd_and_dglu(M, F, Kd, H, splits, kind, dtype):
    x, w1, b1, w2, dy2, scales, split = _data(M, F, Kd, H, splits, dtype, kind, "cuda")
    h = _check_fwd(x, w1, split, b1, kind, scales, dtype)
    _check_dglu(dy2, w2, split, h, kind, scales, dtype)


@pytest.mark.gpu
def test_gpu_autotuned(monkeypatch):
    monkeypatch.setattr(launch, "AUTOTUNE", True)
    x, w1, b1, w2, dy2, scales, split = _data(4096, 384, 512, 512, [1000, 0, 2000, 1096], torch.bfloat16,
                                              "scaled_swiglu", "cuda")
    h = _check_fwd(x, w1, split, None, "scaled_swiglu", scales, torch.bfloat16)
    _check_dglu(dy2, w2, split, h, "scaled_swiglu", scales, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_cuda_graph_mlp_fwd_bwd():
    """Capture the whole fused expert MLP fwd+bwd once, replay with other splits (same total)."""
    dtype, kind = torch.bfloat16, "scaled_swiglu"
    M, F, Kd, H = 640, 96, 128, 128
    x, w1, b1, w2, dy2, scales, split = _data(M, F, Kd, H, [200, 100, 0, 340], dtype, kind, "cuda")
    ss = split.clone()

    def step():
        y, h = gm.grouped_glu_fwd(x, w1, ss, b1, kind, scales)
        out = gg.grouped_gemm_fwd(y, w2, ss)
        dh, y2, ds = gm.grouped_dglu(dy2, w2, ss, h, kind, scales, need_dscales=True)
        dw2 = gg.grouped_gemm_wgrad(dy2, y2, ss)
        dx = gg.grouped_gemm_dgrad(dh, w1, ss)
        dw1 = gg.grouped_gemm_wgrad(dh, x, ss)
        return h, out, dh, ds, dw2, dx, dw1

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for new in ([640, 0, 0, 0], [0, 1, 639, 0], [200, 100, 0, 340]):
        ss.copy_(torch.tensor(new))
        graph.replay()
        torch.cuda.synchronize()
        sp = torch.tensor(new)
        y_r, h_r = gm.grouped_glu_fwd_ref(x, w1, sp.cuda(), b1, kind, scales)
        out_r = gg.grouped_gemm_fwd_ref(y_r, w2, sp.cuda())
        dh_r, y2_r, ds_r = gm.grouped_dglu_ref(dy2, w2, sp.cuda(), h_r, kind, scales, True)
        refs = (h_r, out_r, dh_r, ds_r, gg.grouped_gemm_wgrad_ref(dy2, y2_r, sp.cuda()),
                gg.grouped_gemm_dgrad_ref(dh_r, w1, sp.cuda()), gg.grouped_gemm_wgrad_ref(dh_r, x, sp.cuda()))
        for name, a, e in zip(("h", "out", "dh", "ds", "dw2", "dx", "dw1"), outs, refs):
            # the chained ref (fp32 math, bf16 storage) is the reference for the chained kernels
            assert_close_norm(a, e.double(), dtype, msg=f"{name} {new}")


@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph():
    x, w1, b1, w2, dy2, scales, split = _data(300, 64, 72, 48, [100, 0, 200], torch.bfloat16, "scaled_swiglu",
                                              "cuda")
    ops = torch.ops.fusible_ops

    def f(x, w1, b1, w2, dy2, scales, split):
        y, h = ops.grouped_glu_fwd(x, w1, split, b1, "scaled_swiglu", scales, None)
        dh, y2, ds = ops.grouped_dglu(dy2, w2, split, h, "scaled_swiglu", scales, True)
        return y, h, dh, y2, ds

    got = torch.compile(f, fullgraph=True)(x, w1, b1, w2, dy2, scales, split)
    want = f(x, w1, b1, w2, dy2, scales, split)
    for a, e in zip(got, want):
        assert_close(a.float(), e.float(), torch.float32)
