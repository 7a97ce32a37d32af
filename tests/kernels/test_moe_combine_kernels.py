"""MoE gather-sum kernels (fusible_ops.kernels.moe_combine): Triton vs ref vs float64 math.

CPU: the Triton path runs under the interpreter (no dots here, so bf16 too), tiles shrunk so that
several programs and column steps run. GPU (marked ``gpu``): larger odd sizes, strided inputs.
"""

import pytest
import torch

import fusible_ops.kernels as K
from fusible_ops.kernels import moe_combine as mc
from fusible_ops.testing import assert_close

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiny tiles on CPU: many token programs and several column steps per program."""
    monkeypatch.setattr(mc, "GATHER_TILE", 64)
    monkeypatch.setattr(mc, "BWD_TILE", 32)


def _case(t, k, h, dtype, device=DEV, seed=0, strided=False):
    g = torch.Generator().manual_seed(seed)
    n = t * k
    index = torch.randperm(n, generator=g).view(t, k)
    w = torch.rand(t, k, generator=g)
    src = torch.randn(n, h + 3 if strided else h, generator=g)
    src = (src[:, :h] if strided else src).to(device, dtype)
    dy = torch.randn(t, h, generator=g).to(device, dtype)
    return src, index.to(device), w.to(device), dy


def _expected(src, index, w, dy):
    """float64: (gather-sum, dsrc, dprobs)."""
    s, i, wd, g = src.double().cpu(), index.cpu(), w.double().cpu(), dy.double().cpu()
    rows = s[i]  # [T, k, H]
    out = (rows * wd[..., None]).sum(1)
    dsrc = torch.empty_like(s)
    dsrc[i.reshape(-1)] = (wd[..., None] * g[:, None, :]).reshape(-1, s.shape[1])
    return out, dsrc, (rows * g[:, None, :]).sum(-1)


def _run(fn, mode, *args):
    with K.use(mode):
        return fn(*args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,k,h", [(1, 1, 1), (7, 3, 37), (33, 8, 19), (5, 2, 64)])
@pytest.mark.parametrize("strided", [False, True])
def test_gather_sum_triton_and_ref_match_float64(dtype, t, k, h, strided, small_tiles):
    src, index, w, dy = _case(t, k, h, dtype, strided=strided)
    out64, _, _ = _expected(src, index, w, dy)
    for mode in ("triton", "reference"):
        out = _run(mc.gather_sum, mode, src, index, w)
        assert out.dtype == dtype and out.shape == (t, h)
        assert_close(out, out64, msg=f"{mode} weighted")
        plain = _run(mc.gather_sum, mode, src, index, None)
        assert_close(plain, src.double().cpu()[index.cpu()].sum(1), msg=f"{mode} unweighted")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,k,h", [(1, 1, 1), (7, 3, 37), (33, 8, 19)])
@pytest.mark.parametrize("want", ["both", "dsrc", "dprobs"])
def test_combine_bwd_triton_and_ref_match_float64(dtype, t, k, h, want, small_tiles):
    src, index, w, dy = _case(t, k, h, dtype, seed=1, strided=True)
    _, dsrc64, dp64 = _expected(src, index, w, dy)
    for mode in ("triton", "reference"):
        dsrc, dp = _run(mc.combine_bwd, mode, dy, src if want != "dsrc" else None, index,
                        w if want != "dprobs" else None)
        if want == "dprobs":
            assert dsrc is None
        else:
            assert dsrc.dtype == dtype and dsrc.shape == src.shape
            assert_close(dsrc, dsrc64, msg=f"{mode} dsrc")
        if want == "dsrc":
            assert dp is None
        else:
            assert dp.dtype == torch.float32 and dp.shape == (t, k)
            # a dot over h products of rounded inputs: the fp32 table of the inputs' dtype
            assert_close(dp, dp64, dtype, msg=f"{mode} dprobs")


def test_empty_tokens_and_empty_features():
    for t, h in ((0, 5), (3, 0)):
        src, index, w, dy = _case(t, 2, h, torch.float32)
        for mode in ("triton", "reference"):
            assert _run(mc.gather_sum, mode, src, index, w).shape == (t, h)
            dsrc, dp = _run(mc.combine_bwd, mode, dy, src, index, w)
            assert dsrc.shape == (2 * t, h) and dp.shape == (t, 2)
            assert torch.equal(dp, torch.zeros(t, 2, device=dp.device))


def test_float64_runs_the_reference_exactly():
    src, index, w, dy = _case(6, 3, 10, torch.float64)
    out64, dsrc64, dp64 = _expected(src, index, w, dy)
    with K.use("triton"):
        out = mc.gather_sum(src, index, w)
        dsrc, dp = mc.combine_bwd(dy, src, index, w)
    torch.testing.assert_close(out.cpu(), out64)
    torch.testing.assert_close(dsrc.cpu(), dsrc64)
    torch.testing.assert_close(dp.cpu(), dp64)


def test_bad_shapes_raise():
    src, index, w, dy = _case(4, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="does not match the 7 copies"):
        mc.gather_sum(src[:7], index, w)
    with pytest.raises(ValueError, match=r"index must be \[T, k\] int64"):
        mc.gather_sum(src, index.to(torch.int32), w)
    with pytest.raises(ValueError, match="must have index's shape"):
        mc.gather_sum(src, index, w[:, :1])
    with pytest.raises(ValueError, match="src must be"):
        mc.combine_bwd(dy, src[:, :4], index, w)


def _scale_dot_case(t, k, f, dtype, act=None, device=DEV, seed=2):
    """(g, a strided, probs [T, k], perm [N]) and the float64 (dx, dprobs, a_scaled); with ``act``
    ``a`` is the activation's input (gated: [N, 2F]) and the values are act(a) as the forward's
    activation kernel stores it (fp32 math, rounded to dtype)."""
    from fusible_ops.kernels.act_table import GLU_BASE, act_and_grad_ref, dact_ref

    g0 = torch.Generator().manual_seed(seed)
    n = t * k
    width = 2 * f if act in GLU_BASE else f
    perm = torch.randperm(n, generator=g0)
    probs = torch.rand(t, k, generator=g0)
    g = torch.randn(n, f, generator=g0).to(device, dtype)
    a = torch.randn(n, width + 5, generator=g0).to(device, dtype)[:, :width]  # (row stride width + 5)
    p = probs.double().reshape(-1)[perm][:, None]
    g64, z = g.double().cpu(), a.double().cpu()
    if act is None:
        v, dx = z, p * g64
    else:
        base = GLU_BASE.get(act, act)
        za, zb = (z[:, :f], z[:, f:]) if act in GLU_BASE else (z, None)
        act_a, dz = act_and_grad_ref(za, base)
        # the values the forward stored: act in fp32 (the activation kernels' math), rounded to dtype
        a32, _ = act_and_grad_ref(za.float(), base, need_grad=False)
        v = (a32 if zb is None else a32 * zb.float()).to(dtype).double()
        gs = p * g64
        dx = dact_ref(gs, za, dz, base) if zb is None else torch.cat([dact_ref(gs * zb, za, dz, base), gs * act_a], 1)
    dp = torch.empty(n, dtype=torch.float64)
    dp[perm] = (g64 * v).sum(-1)
    return (g, a, probs.to(device), perm.to(device)), (dx, dp.view(t, k), p * v)


ACTS = [None, "swiglu", "geglu", "reglu", "gelu_tanh", "silu"]
# (the interpreter runs ~0.3-3 s a case: every kind and dtype at one odd shape; the larger shape and
# the skipped outputs for the plain and the SwiGLU case)
SCALE_DOT_CASES = ([(dt, (7, 3, 37), act, (True, True)) for dt in DTYPES for act in ACTS]
                   + [(dt, shape, act, want) for dt in (torch.float32, torch.bfloat16) for act in (None, "swiglu")
                      for shape, want in (((1, 1, 1), (True, True)), ((33, 8, 19), (True, True)),
                                          ((7, 3, 37), (False, False)))])


@pytest.mark.parametrize("dtype,shape,act,want", SCALE_DOT_CASES)
def test_rows_scale_dot_triton_and_ref_match_float64(dtype, shape, act, want, small_tiles):
    t, k, f = shape
    args, (dx64, dp64, as64) = _scale_dot_case(t, k, f, dtype, act)
    for mode in ("triton", "reference"):
        dx, dp, a_s = _run(lambda *a: mc.rows_scale_dot(*a, dx=want[0], scaled_a=want[1], act=act), mode, *args)
        assert dp.dtype == torch.float32 and dp.shape == (t, k)
        assert_close(dp, dp64, dtype, msg=f"{mode} dprobs")  # a dot of rounded inputs: the inputs' table
        for out, ref, on, name in ((dx, dx64, want[0], "dx"), (a_s, as64, want[1], "a_scaled")):
            if not on:
                assert out is None, name
            else:
                assert out.dtype == dtype and out.shape == ref.shape
                assert_close(out, ref, msg=f"{mode} {name}")


def test_rows_scale_dot_empty_and_float64_and_bad_shapes():
    for t, f in ((0, 4), (3, 0)):
        args, _ = _scale_dot_case(t, 2, f, torch.float32)
        for mode in ("triton", "reference"):
            dx, dp, a_s = _run(mc.rows_scale_dot, mode, *args)
            assert dx.shape == a_s.shape == (2 * t, f) and torch.equal(dp, torch.zeros(t, 2, device=dp.device))
    args, expected = _scale_dot_case(5, 3, 9, torch.float64)
    with K.use("triton"):
        for out, ref in zip(mc.rows_scale_dot(*args), expected):
            torch.testing.assert_close(out.cpu(), ref)
    g, a, probs, perm = _scale_dot_case(4, 2, 8, torch.float32)[0]
    with pytest.raises(ValueError, match=r"a must be \[8, 8\]"):
        mc.rows_scale_dot(g, a[:, :4], probs, perm)
    with pytest.raises(ValueError, match=r"a must be \[8, 16\]"):
        mc.rows_scale_dot(g, a, probs, perm, act="swiglu")
    with pytest.raises(ValueError, match="unknown activation"):
        mc.rows_scale_dot(g, a, probs, perm, act="tanh")
    with pytest.raises(ValueError, match="perm must be"):
        mc.rows_scale_dot(g, a, probs, perm[:7])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("t,k,f", [(1000, 8, 256), (333, 2, 4100), (5, 1, 7)])
@pytest.mark.parametrize("act", [None, "swiglu", "gelu"])
def test_gpu_rows_scale_dot_odd_sizes(dtype, t, k, f, act):
    args, (dx64, dp64, as64) = _scale_dot_case(t, k, f, dtype, act)
    dx, dp, a_s = mc.rows_scale_dot(*args, act=act)
    assert_close(dx, dx64)
    assert_close(a_s, as64)
    assert_close(dp, dp64, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("t,k,h", [(1000, 8, 1536), (333, 2, 4100), (5, 1, 7)])
def test_gpu_odd_sizes(dtype, t, k, h):
    src, index, w, dy = _case(t, k, h, dtype, strided=True)
    out64, dsrc64, dp64 = _expected(src, index, w, dy)
    assert_close(mc.gather_sum(src, index, w), out64)
    dsrc, dp = mc.combine_bwd(dy, src, index, w)
    assert_close(dsrc, dsrc64)
    assert_close(dp, dp64, dtype)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,m,k", [(1, 1, 1), (13, 40, 37), (50, 7, 70)])
def test_gather_rows_t_moves_bytes_exactly(dtype, n, m, k):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(n, k + 5, generator=g) * 4)[:, :k].to(DEV).to(dtype)  # strided rows
    index = torch.randint(0, n, (m,), generator=g).to(DEV)
    want = x.index_select(0, index).t().contiguous()
    for mode in ("triton", "reference"):
        got = _run(mc.gather_rows_t, mode, x, index)
        assert got.dtype == dtype and got.shape == (k, m) and got.is_contiguous()
        assert torch.equal(got.view(torch.uint8) if dtype.itemsize == 1 else got,
                           want.view(torch.uint8) if dtype.itemsize == 1 else want)
    assert _run(mc.gather_rows_t, "triton", x, index[:0]).shape == (k, 0)
    with pytest.raises(ValueError, match="index must be 1-D int64"):
        mc.gather_rows_t(x, index.to(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("n,m,k", [(1, 1, 1), (9, 31, 37), (40, 100, 48), (5, 3, 1536)])
def test_gather_rows_moves_bytes_exactly(dtype, n, m, k, monkeypatch):
    monkeypatch.setattr(mc, "ROWS_TILE", 256)  # several row blocks
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(n, k + 5, generator=g) * 4)[:, :k].to(DEV).to(dtype)  # strided rows
    index = torch.randint(0, n, (m,), generator=g).to(DEV)
    want = x.index_select(0, index)
    for mode in ("triton", "reference"):
        got = _run(mc.gather_rows, mode, x, index)
        assert got.dtype == dtype and got.shape == (m, k) and got.is_contiguous()
        assert torch.equal(got.view(torch.uint8) if dtype.itemsize == 1 else got,
                           want.view(torch.uint8) if dtype.itemsize == 1 else want)
    assert _run(mc.gather_rows, "triton", x, index[:0]).shape == (0, k)
    with pytest.raises(ValueError, match="index must be 1-D int64"):
        mc.gather_rows(x, index.view(-1, 1))


@pytest.mark.gpu
def test_gpu_gather_rows_large():
    x = torch.randn(24576, 1536, device="cuda", dtype=torch.bfloat16)
    index = torch.randint(0, 24576, (196611,), device="cuda")
    assert torch.equal(mc.gather_rows(x, index), x.index_select(0, index))


@pytest.mark.gpu
def test_gpu_gather_rows_t_large_fp8():
    x = torch.randn(3000, 1536, device="cuda").to(torch.float8_e4m3fn)
    index = torch.randint(0, 3000, (24001,), device="cuda")
    got = mc.gather_rows_t(x, index)
    assert torch.equal(got.view(torch.uint8), x.index_select(0, index).t().contiguous().view(torch.uint8))


def _copies_case(t, k, h, dtype, seed):
    """x [t, h] with strided rows, a permutation index [t, k], and the copies by gather: row r is
    x[perm[r] // k] for perm the inverse of the index (the layer's perm / inv_perm)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, h + 5, generator=g) * 4)[:, :h].to(DEV).to(dtype)
    inv = torch.randperm(t * k, generator=g).to(DEV)
    perm = torch.argsort(inv)
    return x, inv.view(t, k), x.index_select(0, torch.div(perm, k, rounding_mode="floor"))


def _bytes(x):
    return x.view(torch.uint8) if x.dtype.itemsize == 1 else x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("t,k,h", [(1, 1, 1), (9, 3, 37), (40, 8, 48), (5, 2, 1536), (33, 1, 19)])
def test_scatter_copies_equals_the_gathered_copies(dtype, t, k, h, monkeypatch):
    monkeypatch.setattr(mc, "ROWS_TILE", 256)  # several token blocks
    x, index, want = _copies_case(t, k, h, dtype, seed=t + k)
    for mode in ("triton", "reference"):
        got = _run(mc.scatter_copies, mode, x, index)
        assert got.dtype == dtype and got.shape == (t * k, h) and got.is_contiguous()
        assert torch.equal(_bytes(got), _bytes(want))
    assert _run(mc.scatter_copies, "triton", x[:0], index[:0]).shape == (0, h)
    with pytest.raises(ValueError, match="index must be 2-D int64"):
        mc.scatter_copies(x, index.reshape(-1))
    with pytest.raises(ValueError, match="a row per row of x"):
        mc.scatter_copies(x, torch.zeros(t + 1, k, dtype=torch.int64, device=DEV))


@pytest.mark.gpu
def test_gpu_scatter_copies_large_and_graph_replay():
    x, index, want = _copies_case(24576, 8, 1536, torch.bfloat16, seed=3)
    assert torch.equal(mc.scatter_copies(x, index), want)
    # captured once, replayed with another permutation in the same index buffer
    idx = index.clone()
    mc.scatter_copies(x, idx)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mc.scatter_copies(x, idx)
    x2, index2, want2 = _copies_case(24576, 8, 1536, torch.bfloat16, seed=4)
    x.copy_(x2)
    idx.copy_(index2)
    graph.replay()
    assert torch.equal(out, want2)
