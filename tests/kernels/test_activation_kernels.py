"""Bias + activation (+ dropout) and scaled SwiGLU: Triton (interpreter on CPU) and refs vs float64."""

import pytest
import torch
import torch.nn.functional as F

import fusible_ops.kernels as K
from fusible_ops.kernels import activation as A
from fusible_ops.kernels import dropout as D
from fusible_ops.kernels import launch
from fusible_ops.testing import assert_close, assert_close_norm

_BASE64 = {
    "relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu,
}
_GATE_OF = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_tanh", "reglu": "relu"}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def S(seed: int, device="cpu") -> torch.Tensor:
    """A dropout seed as the kernels take it: an int64 tensor with one element."""
    return torch.tensor([seed], dtype=torch.int64, device=device)


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiny tiles / few programs so that small shapes exercise multi-program grids and row loops."""
    monkeypatch.setattr(launch, "EW_MAX_BLOCK_C", 16)
    monkeypatch.setattr(launch, "EW_TILE", 64)
    monkeypatch.setattr(A, "_BWD_MAX_BLOCK_C", 16)
    monkeypatch.setattr(A, "_BWD_TILE", 32)


def _make(shape, dtype, layout, device="cpu", seed=0):
    """Random tensor; layout: contiguous | rowstride (padded rows, a view) | transposed (needs a copy)."""
    g = torch.Generator().manual_seed(seed)
    if layout == "contiguous":
        t = torch.randn(shape, generator=g)
    elif layout == "rowstride":
        t = torch.randn((*shape[:-1], shape[-1] + 5), generator=g)[..., : shape[-1]]
    else:  # last dim outermost in memory, step-2 columns
        t = torch.randn((2 * shape[-1], *shape[:-1]), generator=g).permute(*range(1, len(shape)), 0)[..., ::2]
    return t.to(device=device, dtype=dtype)


def _act64(z, kind):
    if kind in A.GATED:
        h = z.shape[-1] // 2
        return _BASE64[_GATE_OF[kind]](z[..., :h]) * z[..., h:]
    return _BASE64[kind](z)


def _bias_act64(dy, x, bias, kind, p, seed):
    """Independent float64 math (torch functional + autograd) for y, dz, dbias."""
    z = x.double().detach().clone().requires_grad_(True)
    zb = z + bias.double() if bias is not None else z
    y = _act64(zb, kind)
    if p > 0:  # dropout multiplies by keep / (1 - p), like torch's
        y = y * D.dropout_keep_mask(y.shape, p, S(seed), x.device).double() / (1.0 - p)
    (dz,) = torch.autograd.grad(y, z, dy.double())
    dbias = None
    if bias is not None:
        dbias = dz.reshape(-1, dz.shape[-1]).sum(0) if dz.shape[-1] else dz.new_zeros(0)
    return y.detach(), dz, dbias


def _run_bias_act(dy, x, bias, kind, p, seed, mode):
    s = S(seed, x.device) if p > 0 else None  # no seed without dropout
    with K.use(mode):
        y = A.bias_act_fwd(x, bias, kind, dropout_p=p, seed=s)
        dz, dbias = A.bias_act_bwd(dy, x, bias, kind, bias is not None, dropout_p=p, seed=s)
    return y, dz, dbias


def _check_bias_act(kind, dtype, shape, layout, bias_mode, p, seed, device="cpu"):
    n = shape[-1]
    out_shape = (*shape[:-1], n // 2 if kind in A.GATED else n)
    x = _make(shape, dtype, layout, device, seed)
    dy = _make(out_shape, dtype, layout, device, seed + 1)
    bias = None
    if bias_mode is not None:
        bias = _make((n,), dtype if bias_mode == "same" else torch.float32, "contiguous", device, seed + 2)
    y64, dz64, db64 = _bias_act64(dy, x, bias, kind, p, seed)
    modes = ("triton", "reference") if device == "cpu" else ("auto", "reference")
    for mode in modes:
        y, dz, dbias = _run_bias_act(dy, x, bias, kind, p, seed, mode)
        tag = f"{mode} {kind} {dtype} {shape} {layout} bias={bias_mode} p={p}"
        assert y.shape == out_shape and y.dtype == dtype, tag
        assert dz.shape == x.shape and dz.dtype == dtype, tag
        assert_close(y, y64, msg=f"y {tag}")
        assert_close(dz, dz64, msg=f"dz {tag}")
        if bias is None:
            assert dbias is None
        else:
            assert dbias.shape == bias.shape and dbias.dtype == bias.dtype, tag
            assert_close_norm(dbias, db64, msg=f"dbias {tag}")


# ----------------------------------------------------------------------------- CPU

CPU_CASES = [  # (shape, layout, bias_mode, dropout_p)
    ((3, 6), "contiguous", "same", 0.0),
    ((7, 34), "rowstride", "fp32", 0.3),
    ((1, 2), "contiguous", None, 0.0),
    ((0, 10), "contiguous", "same", 0.2),
    ((2, 5, 10), "transposed", "same", 0.5),
    ((37, 40), "contiguous", "fp32", 0.0),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", A.ACTIVATIONS)
def test_bias_act_matches_float64(kind, dtype, small_tiles):
    for i, (shape, layout, bias_mode, p) in enumerate(CPU_CASES):
        _check_bias_act(kind, dtype, shape, layout, bias_mode, p, seed=10 * i + 1)


@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_bias_act_default_tiles(kind):
    _check_bias_act(kind, torch.float32, (45, 300), "rowstride", "same", 0.25, seed=5)
    _check_bias_act(kind, torch.float16, (3, 0), "contiguous", "same", 0.0, seed=6)


@pytest.mark.parametrize("kind", A.ACTIVATIONS)
def test_ref_float64_inputs(kind):
    x = torch.randn(4, 3, 12, dtype=torch.float64)
    bias = torch.randn(12, dtype=torch.float64)
    dy = torch.randn(4, 3, 6 if kind in A.GATED else 12, dtype=torch.float64)
    y64, dz64, db64 = _bias_act64(dy, x, bias, kind, 0.4, 77)
    y = A.bias_act_fwd_ref(x, bias, kind, dropout_p=0.4, seed=S(77))
    dz, db = A.bias_act_bwd_ref(dy, x, bias, kind, True, dropout_p=0.4, seed=S(77))
    assert y.dtype == dz.dtype == db.dtype == torch.float64
    assert_close(y, y64)
    assert_close(dz, dz64)
    assert_close_norm(db, db64)


@pytest.mark.parametrize("off64", [False, True])
def test_dropout_mask_is_mask_of_y_fwd_and_bwd(off64, monkeypatch):
    """Fused kernels draw dropout_keep_mask(y.shape) bit-exactly, forward and backward, on odd widths
    (int32 counters, and int64 ones forced by lowering the threshold)."""
    if off64:
        monkeypatch.setattr(launch, "INT64_MIN_COUNTERS", 0)
    monkeypatch.setattr(A, "_BWD_MAX_BLOCK_C", 8)  # several column tiles in the backward
    monkeypatch.setattr(A, "_BWD_TILE", 32)
    for i, (rows, cols) in enumerate([(6, 10), (3, 5), (7, 33), (1, 1)]):
        seed, p = 4 + i, (0.5, 0.3)[i % 2]
        x = torch.rand(rows, cols) + 1.0  # relu(x) > 0 everywhere
        xg = torch.cat([x, x], -1)
        ones = torch.ones(rows, cols)
        with K.use("triton"):
            y = A.bias_act_fwd(x, None, "relu", dropout_p=p, seed=S(seed))
            yg = A.bias_act_fwd(xg, None, "reglu", dropout_p=p, seed=S(seed))
            dz, _ = A.bias_act_bwd(ones, x, None, "relu", False, dropout_p=p, seed=S(seed))
            dzg, _ = A.bias_act_bwd(ones, xg, None, "reglu", False, dropout_p=p, seed=S(seed))
        keep = D.dropout_keep_mask((rows, cols), p, S(seed), "cpu")
        assert torch.equal(keep, D.dropout_keep_mask((rows, cols), p, seed, "cpu"))  # int seed: same key
        for t in (y, yg, dz, dzg[:, :cols], dzg[:, cols:]):
            assert torch.equal(t != 0, keep), (rows, cols)
        y_ref = A.bias_act_fwd_ref(xg, None, "reglu", dropout_p=p, seed=S(seed))
        assert torch.equal(y_ref != 0, keep)


def test_need_dbias_false_and_bad_args():
    x, bias, dy = torch.randn(3, 8), torch.randn(8), torch.randn(3, 8)
    for mode in ("triton", "reference"):
        with K.use(mode):
            dz, db = A.bias_act_bwd(dy, x, bias, "silu", False)
            assert db is None and dz.shape == x.shape
    with pytest.raises(ValueError):
        A.bias_act_fwd(x, bias, "tanh")
    with pytest.raises(ValueError):
        A.bias_act_fwd(torch.randn(3, 7), None, "swiglu")
    with pytest.raises(ValueError):
        A.bias_act_fwd(x, torch.randn(7), "relu")
    with pytest.raises(ValueError, match="needs a seed"):
        A.bias_act_fwd(x, bias, "relu", dropout_p=0.5)
    with pytest.raises(ValueError, match="one element"):
        A.bias_act_fwd(x, bias, "relu", dropout_p=0.5, seed=torch.tensor([1, 2]))


def _scaled64(dy, x, scales):
    x64 = x.double().detach().clone().requires_grad_(True)
    s64 = scales.double().detach().clone().requires_grad_(True)
    y = _act64(x64, "swiglu") * s64[..., None]
    dx, ds = torch.autograd.grad(y, (x64, s64), dy.double())
    return y.detach(), dx, ds


def _check_scaled(dtype, shape, layout, scales_fp32, device="cpu", seed=0):
    x = _make(shape, dtype, layout, device, seed)
    out_shape = (*shape[:-1], shape[-1] // 2)
    dy = _make(out_shape, dtype, layout, device, seed + 1)
    scales = torch.rand(shape[:-1], generator=torch.Generator().manual_seed(seed + 2)).to(device)
    scales = scales if scales_fp32 else scales.to(dtype)
    y64, dx64, ds64 = _scaled64(dy, x, scales)
    modes = ("triton", "reference") if device == "cpu" else ("auto", "reference")
    for mode in modes:
        with K.use(mode):
            y = A.scaled_swiglu_fwd(x, scales)
            dx, ds = A.scaled_swiglu_bwd(dy, x, scales, True)
            dx2, none = A.scaled_swiglu_bwd(dy, x, scales, False)
        tag = f"{mode} {dtype} {shape} {layout}"
        assert y.shape == out_shape and y.dtype == dtype and dx.dtype == dtype, tag
        assert ds.shape == scales.shape and ds.dtype == scales.dtype and none is None, tag
        assert_close(y, y64, msg=f"y {tag}")
        assert_close(dx, dx64, msg=f"dx {tag}")
        assert torch.equal(dx, dx2), tag
        assert_close_norm(ds, ds64, msg=f"dscales {tag}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_swiglu_matches_float64(dtype, small_tiles):
    cases = [((3, 10), "contiguous", False), ((7, 66), "rowstride", True), ((1, 2), "contiguous", False),
             ((0, 8), "contiguous", False), ((3, 4, 18), "transposed", True), ((37, 36), "contiguous", False)]
    for i, (shape, layout, s32) in enumerate(cases):
        _check_scaled(dtype, shape, layout, s32, seed=i)


@pytest.mark.interpreter
def test_compile_fullgraph_cpu_aot_eager():
    """Custom ops trace under torch.compile (fake impls); aot_eager avoids needing a C++ compiler."""
    x, bias, s, seed = torch.randn(5, 12), torch.randn(12), torch.rand(5), S(3)

    def f(x, bias, s):
        y = A.bias_act_fwd(x, bias, "geglu", dropout_p=0.1, seed=seed)
        dz, db = A.bias_act_bwd(y, x, bias, "geglu", True, dropout_p=0.1, seed=seed)
        y2 = A.scaled_swiglu_fwd(x, s)
        dx, ds = A.scaled_swiglu_bwd(y2, x, s, True)
        return y, dz, db, y2, dx, ds

    with K.use("triton"):
        out = torch.compile(f, backend="aot_eager", fullgraph=True)(x, bias, s)
        ref = f(x, bias, s)
    for a, b in zip(out, ref):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- GPU

GPU_CASES = [
    ((1031, 4098), "contiguous", "same", 0.0),
    ((3, 517, 2050), "rowstride", "fp32", 0.3),
    ((129, 770), "transposed", "same", 0.1),
    ((0, 64), "contiguous", "same", 0.0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", A.ACTIVATIONS)
def test_gpu_bias_act_matches_float64(kind, dtype):
    for i, (shape, layout, bias_mode, p) in enumerate(GPU_CASES):
        _check_bias_act(kind, dtype, shape, layout, bias_mode, p, seed=i + 1, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_scaled_swiglu_matches_float64(dtype):
    for i, (shape, layout, s32) in enumerate([((2049, 2050), "contiguous", True),
                                               ((5, 301, 1538), "rowstride", False),
                                               ((33, 4100), "transposed", True)]):
        _check_scaled(dtype, shape, layout, s32, device="cuda", seed=i)


@pytest.mark.gpu
def test_gpu_dropout_mask_odd_widths_both_counter_widths(monkeypatch):
    for off64 in (False, True):
        if off64:
            monkeypatch.setattr(launch, "INT64_MIN_COUNTERS", 0)
        for i, (rows, cols) in enumerate([(3, 5), (7, 33), (1, 1), (1031, 1027), (5, 4099)]):
            x = torch.rand(rows, cols, device="cuda") + 1.0
            xg = torch.cat([x, x], -1).to(torch.bfloat16)
            ones = torch.ones(rows, cols, device="cuda", dtype=torch.bfloat16)
            yg = A.bias_act_fwd(xg, None, "reglu", dropout_p=0.3, seed=S(i, "cuda"))
            dzg, _ = A.bias_act_bwd(ones, xg, None, "reglu", False, dropout_p=0.3, seed=S(i, "cuda"))
            keep = D.dropout_keep_mask((rows, cols), 0.3, S(i), "cpu")
            for t in (yg, dzg[:, :cols], dzg[:, cols:]):
                assert torch.equal((t != 0).cpu(), keep), (rows, cols, off64)


@pytest.mark.gpu
def test_gpu_compile_fullgraph():
    x = torch.randn(257, 1030, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(1030, device="cuda", dtype=torch.float32)
    s = torch.rand(257, device="cuda")
    seed = S(3, "cuda")

    def f(x, bias, s):
        y = A.bias_act_fwd(x, bias, "swiglu", dropout_p=0.1, seed=seed)
        dz, db = A.bias_act_bwd(y, x, bias, "swiglu", True, dropout_p=0.1, seed=seed)
        y2 = A.scaled_swiglu_fwd(x, s)
        dx, ds = A.scaled_swiglu_bwd(y2, x, s, True)
        return y, dz, db, y2, dx, ds

    out = torch.compile(f, fullgraph=True)(x, bias, s)
    for a, b in zip(out, f(x, bias, s)):
        assert torch.equal(a, b)


def test_eager_backward_allocates_no_dbias_placeholder():
    """The eager backward call returns None for a dbias not asked for (no [0] dummy); the custom
    op (the torch.compile path) returns a fresh [0] tensor there, and the same dz."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(5, 18, device=dev, dtype=torch.float16)
    dy = torch.randn(5, 9, device=dev, dtype=torch.float16)
    with K.use("triton"):
        dz_e, db_e = A._bias_act_bwd_op(dy, x, None, "swiglu", False, 0.0, None)
        dz_o, db_o = A._bias_act_bwd_op.op(dy, x, None, "swiglu", False, 0.0, None)
    assert db_e is None and db_o.numel() == 0
    assert torch.equal(dz_e, dz_o)


def test_backward_prefetch_rule():
    """The backward prefetches the next row tile only where it was measured to win: with dbias,
    no dropout and an activation costlier than ReLU (activation._BWD_PREFETCH's table)."""
    x = torch.randn(64, 32)

    def prefetch(kind, bias, need_dbias, drop):
        dy = torch.randn(64, 16 if kind in A.GATED else 32)
        geo = A._bwd_geometry(("test", kind, bias, need_dbias, drop), dy, x, torch.randn(32) if bias else None, None,
                              kind, need_dbias and bias, False, drop)
        return geo[3]["PREFETCH"]

    assert all(prefetch(k, True, True, False) for k in ("gelu", "gelu_tanh", "silu", "swiglu", "geglu"))
    assert not prefetch("relu", True, True, False) and not prefetch("reglu", True, True, False)
    assert not prefetch("gelu", True, True, True)  # dropout
    assert not prefetch("gelu", True, False, False) and not prefetch("gelu", False, False, False)  # no dbias
