"""LayerNorm / RMSNorm kernels (fusible_ops.kernels.norm) against float64 math.

Unmarked tests: tiny odd shapes, on Triton's interpreter without CUDA (tests/conftest.py sets
TRITON_INTERPRET=1), compiled on CUDA when there is a GPU; the wide-row kernels (forward loop,
backward column slices) are exercised by shrinking their thresholds. ``@pytest.mark.gpu``: larger
odd sizes and torch.compile (inductor, fullgraph) of the custom ops. Speed is measured by the
benchmark harness (python -m fusible_ops.bench), never by a timed unit test.

Every Triton and ``*_ref`` result is compared with an independent float64 computation of the same
inputs (the norms written out in float64, gradients by autograd; checked against
F.layer_norm / F.rms_norm in ``test_truth_matches_torch``). ``y``, the
statistics and ``dx`` are checked against the math applied to the returned ``xsum`` (the kernels
normalize the rounded sum); ``xsum`` itself is checked against ``x + residual`` in float64.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
import torch.nn.functional as F

import fusible_ops.kernels as K
from fusible_ops.kernels import norm as N
from fusible_ops.kernels import norm_config as NC
from fusible_ops.kernels.launch import as_rows, clear_geometry_caches, row_align
from fusible_ops.testing import assert_close, assert_close_norm

EPS = 1e-5
F64 = torch.float64
# The small-shape Triton tests run on the interpreter without CUDA, and compiled on a GPU machine
# (where TRITON_INTERPRET is off, so use("triton") on CPU tensors would refuse).
DEV = "cuda" if torch.cuda.is_available() else "cpu"


# ---------------------------------------------------------------------------------------------
# float64 truth, independent of the module under test
# ---------------------------------------------------------------------------------------------


def _truth(xsum, weight, bias, dy, dxe, rms):
    """float64 (y, mean, rstd, dx, dweight, dbias) of the norm of ``xsum`` (autograd gradients)."""
    xs = xsum.detach().to(F64).requires_grad_(True)
    w = weight.detach().to(F64).requires_grad_(True) if weight is not None else None
    b = bias.detach().to(F64).requires_grad_(True) if bias is not None else None
    mean = xs.mean(-1, keepdim=True)
    xc = xs if rms else xs - mean  # exactly 0 for N == 1 (F.layer_norm's Welford leaves 1e-14 noise)
    rstd = torch.rsqrt((xc * xc).mean(-1, keepdim=True) + EPS)
    y = xc * rstd
    y = y * w if w is not None else y
    y = y + b if b is not None else y
    y.backward(dy.to(F64))
    dx = xs.grad + (dxe.to(F64) if dxe is not None else 0)
    dw = w.grad if w is not None else None
    db = b.grad if b is not None else None
    return y.detach(), mean.detach().reshape(-1), rstd.detach().reshape(-1), dx, dw, db


def _inputs(shape, dtype, pdtype, residual, dxe, noncontig, bias=True, seed=0, device=DEV):
    g = torch.Generator().manual_seed(seed)
    n = shape[-1]

    def rnd(*s, dt=dtype):
        return torch.randn(*s, generator=g).to(device=device, dtype=dt)

    def make():  # optionally a non-contiguous view with the same values layout-independent
        if noncontig == "rows":  # row-strided view, last dim contiguous (no copy needed)
            return rnd(*shape[:-1], n + 3)[..., :n]
        if noncontig == "rows8":  # rows 8 elements apart beyond n (launch.row_align: at most 8)
            return rnd(*shape[:-1], n + 8)[..., :n]
        if noncontig == "cols":  # transposed storage: last dim strided (launcher copies)
            return rnd(*shape[:-2], n, shape[-2]).transpose(-1, -2)
        return rnd(*shape)

    x = make()
    r = make() if residual else None
    dy = make()
    e = make() if dxe else None
    w = (1 + 0.5 * torch.randn(n, generator=g)).to(device=device, dtype=pdtype)
    b = (0.5 * torch.randn(n, generator=g)).to(device=device, dtype=pdtype) if bias else None
    return x, r, w, b, dy, e


def _check_norm(shape, dtype, pdtype=None, residual=True, dxe=True, need_dw=True, need_db=True,
                noncontig=None, rms=False, backend="triton", weight=True, device=DEV):
    """Run fwd + bwd on ``backend`` and compare every output with float64 truth."""
    pdtype = pdtype or dtype
    x, r, w, b, dy, e = _inputs(shape, dtype, pdtype, residual, dxe, noncontig, bias=not rms, device=device)
    if noncontig and x.numel() > shape[-1] > 1:
        assert not x.is_contiguous()
    if not weight:
        w, b = None, None
    with K.use(backend):
        if rms:
            y, rstd, xsum = N.rmsnorm_fwd(x, w, EPS, r)
            mean = None
            dx, dw = N.rmsnorm_bwd(dy, xsum, w, rstd, need_dw, e)
            db = None
        else:
            y, mean, rstd, xsum = N.layernorm_fwd(x, w, b, EPS, r)
            dx, dw, db = N.layernorm_bwd(dy, xsum, w, mean, rstd, need_dw, need_db, e)
    rows = x.numel() // shape[-1]
    # forward
    if r is None:
        assert xsum is x
    else:
        assert xsum.dtype == dtype and xsum.shape == x.shape
        assert_close(xsum, x.to(F64) + r.to(F64), dtype)
    ty, tmean, trstd, tdx, tdw, tdb = _truth(xsum, w, b, dy, e, rms)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, ty, dtype, msg="y")
    sdtype = F64 if dtype == F64 else torch.float32  # statistics: fp32 (float64 for float64 x)
    assert rstd.dtype == sdtype and rstd.shape == (rows,)
    assert_close(rstd, trstd, sdtype, msg="rstd")
    if not rms:
        assert mean.dtype == sdtype and mean.shape == (rows,)
        assert_close(mean, tmean, sdtype, msg="mean")
    # backward
    assert dx.dtype == dtype and dx.shape == x.shape
    assert_close(dx, tdx, dtype, msg="dx")
    if need_dw and w is not None:
        assert dw.dtype == pdtype and dw.shape == (shape[-1],)
        assert_close_norm(dw, tdw, pdtype, msg="dweight")
    else:
        assert dw is None
    if not rms:
        if need_db:
            assert db.dtype == (pdtype if w is not None else dtype)
            if b is not None:
                assert_close_norm(db, tdb, db.dtype, msg="dbias")
            else:  # no bias in the forward: dbias is still sum_rows(dy)
                assert_close_norm(db, dy.to(F64).reshape(-1, shape[-1]).sum(0), db.dtype, msg="dbias")
        else:
            assert db is None


def test_truth_matches_torch():
    x = torch.randn(4, 3, 9, dtype=F64)
    w, b, dy = torch.randn(9, dtype=F64), torch.randn(9, dtype=F64), torch.randn(4, 3, 9, dtype=F64)
    for rms in (False, True):
        xs = x.clone().requires_grad_(True)
        ws = w.clone().requires_grad_(True)
        y = F.rms_norm(xs, (9,), ws, EPS) if rms else F.layer_norm(xs, (9,), ws, b, EPS)
        y.backward(dy)
        ty, _, _, tdx, tdw, _ = _truth(x, w, None if rms else b, dy, None, rms)
        for a, e in ((ty, y), (tdx, xs.grad), (tdw, ws.grad)):
            assert_close(a, e, F64)


# ---------------------------------------------------------------------------------------------
# CPU: reference path
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rms", [False, True], ids=["ln", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_ref_matches_float64(dtype, rms):
    _check_norm((7, 33), dtype, rms=rms, backend="reference")
    _check_norm((2, 3, 5), dtype, rms=rms, residual=False, dxe=False, need_db=False, backend="reference",
                noncontig="cols")


def test_ref_fp32_params_and_no_weight():
    _check_norm((5, 17), torch.bfloat16, pdtype=torch.float32, backend="reference")
    _check_norm((5, 17), torch.float16, backend="reference", weight=False)
    _check_norm((5, 17), torch.float16, backend="reference", weight=False, rms=True)


# ---------------------------------------------------------------------------------------------
# CPU: Triton path under the interpreter
# ---------------------------------------------------------------------------------------------

# (shape, dtype, param dtype, residual, dxsum_extra, need_dweight, need_dbias, non-contiguous)
_CASES = [
    ((3, 5), torch.float32, None, True, True, True, True, None),
    ((3, 5), torch.float32, None, False, False, True, False, None),
    ((7, 33), torch.float16, None, True, False, True, True, "rows"),
    ((7, 33), torch.float16, torch.float32, False, True, False, True, "cols"),
    ((7, 33), torch.bfloat16, torch.float32, True, True, True, True, None),
    ((1, 1), torch.float32, None, True, True, True, True, None),
    ((4, 1), torch.float16, None, False, True, True, True, None),
    ((2, 3, 1000), torch.bfloat16, torch.float32, True, True, True, True, None),
    ((2, 3, 1000), torch.float32, None, False, False, False, False, "rows"),
    ((37, 3), torch.float32, None, True, False, True, True, None),
    ((4, 24), torch.bfloat16, torch.float32, True, True, True, True, None),
    ((5, 16), torch.float16, None, True, True, True, True, "rows8"),
]
_IDS = [f"{'x'.join(map(str, c[0]))}-{str(c[1])[6:]}-p{str(c[2])[6:]}-r{int(c[3])}e{int(c[4])}"
        f"w{int(c[5])}b{int(c[6])}-{c[7]}" for c in _CASES]


@pytest.mark.parametrize("rms", [False, True], ids=["ln", "rms"])
@pytest.mark.parametrize("case", _CASES, ids=_IDS)
def test_triton_interpreter(case, rms):
    shape, dtype, pdtype, res, dxe, need_dw, need_db, nc = case
    _check_norm(shape, dtype, pdtype, res, dxe, need_dw, need_db, nc, rms=rms)


@pytest.mark.parametrize("rms", [False, True], ids=["ln", "rms"])
def test_triton_interpreter_no_weight(rms):
    _check_norm((5, 17), torch.float16, rms=rms, weight=False)


@pytest.fixture
def wide_rows(monkeypatch):
    """Shrink the thresholds so small N runs the forward loop and backward sliced kernels."""
    monkeypatch.setattr(NC, "_FWD_MAX_FUSED_N", 16)
    monkeypatch.setattr(NC, "_FWD_LOOP_BLOCK_N", 16)
    monkeypatch.setattr(NC, "_BWD_MAX_FUSED_N", 16)
    monkeypatch.setattr(NC, "_BWD_SLICE_N", 16)


@pytest.mark.parametrize("rms", [False, True], ids=["ln", "rms"])
@pytest.mark.parametrize(
    "shape,dtype,pdtype,res,dxe,nc",
    [
        ((5, 33), torch.float32, None, True, True, None),
        ((3, 100), torch.float16, torch.float32, False, True, "rows"),
        ((2, 2, 47), torch.bfloat16, torch.float32, True, False, "cols"),
    ],
)
def test_triton_interpreter_wide_row_kernels(wide_rows, shape, dtype, pdtype, res, dxe, nc, rms):
    assert NC._fwd_config(shape[-1], 4)[0] and NC._bwd_config(shape[-1], 4)[0] == "sliced"
    _check_norm(shape, dtype, pdtype, res, dxe, True, True, nc, rms=rms)
    _check_norm(shape, dtype, pdtype, res, dxe, False, False, nc, rms=rms)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_zero_rows(backend):
    x = torch.randn(0, 5, dtype=torch.float16, device=DEV)
    w, b = torch.randn(5, device=DEV), torch.randn(5, device=DEV)
    with K.use(backend):
        y, mean, rstd, xsum = N.layernorm_fwd(x, w, b, EPS, x.clone())
        assert y.shape == (0, 5) and mean.shape == (0,) and rstd.shape == (0,) and xsum.shape == (0, 5)
        dx, dw, db = N.layernorm_bwd(x, x, w, mean, rstd, True, True, None)
        assert dx.shape == (0, 5) and dx.dtype == torch.float16
        assert torch.equal(dw, torch.zeros_like(w)) and torch.equal(db, torch.zeros_like(w))
        y, rstd, xsum = N.rmsnorm_fwd(x, w, EPS)
        assert y.shape == (0, 5) and rstd.shape == (0,) and xsum is x
        dx, dw = N.rmsnorm_bwd(x, x, w, rstd, True)
        assert dx.shape == (0, 5) and torch.equal(dw, torch.zeros_like(w))


def test_inputs_not_modified():
    x, r, w, b, dy, e = _inputs((3, 7), torch.float16, torch.float32, True, True, None)
    saved = [t.clone() for t in (x, r, w, b, dy, e)]
    with K.use("triton"):
        y, mean, rstd, xsum = N.layernorm_fwd(x, w, b, EPS, r)
        N.layernorm_bwd(dy, xsum, w, mean, rstd, True, True, e)
        y, rstd, xsum = N.rmsnorm_fwd(x, w, EPS, r)
        N.rmsnorm_bwd(dy, xsum, w, rstd, True, e)
    for a, s in zip((x, r, w, b, dy, e), saved):
        assert torch.equal(a, s)


def test_shape_errors():
    x = torch.randn(3, 5)
    with pytest.raises(ValueError):
        N.layernorm_fwd(x, torch.randn(4), None, EPS)
    with pytest.raises(ValueError):
        N.rmsnorm_fwd(x, torch.randn(5), EPS, torch.randn(3, 4))


def test_custom_ops_opcheck_and_compile():
    """Fake impls / schemas (opcheck) and a fullgraph trace of the public functions."""
    from torch.library import opcheck

    x, r, w, b, dy, _ = _inputs((3, 5), torch.float32, torch.float32, True, False, None)
    mean, rstd = torch.randn(3, device=DEV), torch.rand(3, device=DEV) + 0.5
    with K.use("triton"):
        opcheck(torch.ops.fusible_ops.layernorm_fwd, (x, w, b, EPS, r))
        opcheck(torch.ops.fusible_ops.layernorm_fwd, (x, w, None, EPS, None))
        opcheck(torch.ops.fusible_ops.layernorm_bwd, (dy, x, w, mean, rstd, True, False, None))
        opcheck(torch.ops.fusible_ops.rmsnorm_fwd, (x, w, EPS, r))
        opcheck(torch.ops.fusible_ops.rmsnorm_bwd, (dy, x, None, rstd, False, dy))

        def f(x, r, w, b, dy):
            y, m, rs, xs = N.layernorm_fwd(x, w, b, EPS, r)
            dx, dw, db = N.layernorm_bwd(dy, xs, w, m, rs, True, True, None)
            y2, rs2, xs2 = N.rmsnorm_fwd(x, w, EPS)
            dx2, dw2 = N.rmsnorm_bwd(dy, xs2, w, rs2, True, dy)
            return y, dx, dw, db, y2, dx2, dw2

        torch._dynamo.reset()
        expected = f(x, r, w, b, dy)
        got = torch.compile(f, backend="aot_eager", fullgraph=True)(x, r, w, b, dy)
    for a, e in zip(got, expected):
        assert torch.equal(a, e)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

_GPU_SHAPES = [(1031, 1), (517, 1000), (257, 1537), (129, 4097), (65, 5120), (65, 8193), (33, 16384), (17, 20011), (4, 5, 3001)]


@pytest.mark.gpu
@pytest.mark.parametrize("rms", [False, True], ids=["ln", "rms"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", _GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_matches_float64(shape, dtype, rms):
    pdtype = torch.float32 if dtype != torch.float32 else None
    for backend in ("auto", "reference"):
        _check_norm(shape, dtype, pdtype, True, True, True, True, "rows", rms=rms, backend=backend, device="cuda")
        _check_norm(shape, dtype, None, False, False, True, False, "cols", rms=rms, backend=backend, device="cuda")


@given(lead=st.lists(st.integers(1, 5), min_size=0, max_size=3), n=st.integers(1, 80),
       pad=st.integers(0, 24), layout=st.sampled_from(["contiguous", "padded", "transposed", "expanded"]))
def test_row_align_divides_what_the_kernels_index_with(lead, n, pad, layout):
    """launch.row_align(n, t) divides n and the row stride of every row view as_rows makes of t (the
    kernels rewrite N and the row strides as multiples of it: a wrong value would be a misaligned
    vector access on the GPU, which the interpreter cannot show)."""
    if layout == "padded":
        t = torch.empty(*lead, n + pad)[..., :n]
    elif layout == "transposed" and len(lead) >= 2:
        t = torch.empty(lead[1], lead[0], *lead[2:], n + pad)[..., :n].transpose(0, 1)
    elif layout == "expanded" and lead:
        t = torch.empty(1, *lead[1:], n + pad)[..., :n].expand(*lead, n)
    else:
        t = torch.empty(*lead, n)
    a = row_align(n, t)
    assert a in (1, 2, 4, 8, 16) and n % a == 0
    rows = as_rows(t)
    assert rows.shape == (t.numel() // n, n) and rows.stride(0) % a == 0
    if t.dim() <= 1 or t.shape[:-1].numel() <= 1:
        return
    if n % 16 == 0 and all(s % 16 == 0 for s in t.stride()[:-1]):
        assert a == 16


@pytest.mark.gpu
@pytest.mark.parametrize("rms", [False, True], ids=["ln", "rms"])
@pytest.mark.parametrize("shape,nc", [((65, 5120), "rows8"), ((33, 8200), None), ((9, 2, 3000), "rows8")])
def test_gpu_rows_aligned_to_8(shape, nc, rms):
    """Rows whose length or stride is a multiple of 8 but not 16 (launch.row_align 8: 16-byte
    accesses the compiler only knows of through the kernels' hints)."""
    assert row_align(shape[-1], torch.empty(*shape[:-1], shape[-1] + (8 if nc else 0))) == 8
    _check_norm(shape, torch.bfloat16, torch.float32, True, True, True, True, nc, rms=rms, device="cuda")
    _check_norm(shape, torch.float32, None, False, False, True, False, nc, rms=rms, device="cuda")


@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph():
    torch._dynamo.reset()
    dev = "cuda"
    x = torch.randn(67, 1001, device=dev, dtype=torch.bfloat16)
    r, dy = torch.randn_like(x), torch.randn_like(x)
    w, b = torch.randn(1001, device=dev), torch.randn(1001, device=dev)

    def f(x, r, w, b, dy):
        y, m, rs, xs = torch.ops.fusible_ops.layernorm_fwd(x, w, b, EPS, r)
        dx, dw, db = torch.ops.fusible_ops.layernorm_bwd(dy, xs, w, m, rs, True, True, None)
        y2, rs2, _ = torch.ops.fusible_ops.rmsnorm_fwd(y, w, EPS, None)
        dx2, dw2 = torch.ops.fusible_ops.rmsnorm_bwd(dy, y, w, rs2, True, dx)
        return y * 2, xs, dx, dw, db, y2, dx2, dw2

    expected = f(x, r, w, b, dy)
    got = torch.compile(f, fullgraph=True)(x, r, w, b, dy)
    for a, e in zip(got, expected):  # same kernels, deterministic: bitwise equal
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    # public functions trace too
    g = torch.compile(lambda x, w, b, r: N.layernorm_fwd(x, w, b, EPS, r)[0], fullgraph=True)
    torch.testing.assert_close(g(x, w, b, r), N.layernorm_fwd(x, w, b, EPS, r)[0], rtol=0, atol=0)


@pytest.mark.parametrize("rms", [False, True], ids=["ln", "rms"])
def test_triton_interpreter_bwd_reload(monkeypatch, rms):
    """The fused backward's RELOAD mode (wide rows: xsum/dy loaded twice) matches float64 math."""
    monkeypatch.setattr(NC, "_BWD_RELOAD_MIN_N", 1)
    _check_norm((5, 33), torch.bfloat16, torch.float32, True, True, True, True, "rows", rms=rms)
    _check_norm((3, 7), torch.float16, None, False, False, False, False, None, rms=rms)


def test_bwd_prefetch_rule():
    """Prefetch in the fused backward where it was measured to win (norm_config's table)."""
    pf = lambda n, rms, dxe: NC._bwd_config(n, 16384, rms, dxe)[5]  # noqa: E731
    for n in (256, 1024, 2048, 4096, 8192):
        assert pf(n, True, False) and pf(n, True, True) and pf(n, False, False)
    assert pf(256, False, True) and pf(1024, False, True) and pf(6144, False, True)
    assert NC._bwd_choice(512, False, True) == (*NC._BWD_FEW_WARPS, True)  # LayerNorm + dxsum_extra
    assert NC._bwd_choice(1024, False, True) == (*NC._BWD_LN_DXE_MID, True)
    assert not pf(12288, True, False) and not pf(12288, False, False)  # RELOAD
    assert not pf(32768, True, False)  # sliced


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no_prefetch"])
@pytest.mark.parametrize("rms", [False, True], ids=["ln", "rms"])
def test_triton_interpreter_bwd_prefetch(monkeypatch, rms, prefetch):
    """The fused backward's loops (each tile loaded one iteration early, or in its own iteration)
    match float64 math, on shapes whose programs walk several tiles (the last prefetch is past the
    end)."""
    monkeypatch.setattr(NC, "_TILE", 32)  # row tiles of a few rows,
    monkeypatch.setattr(NC, "_BWD_PROGS_PER_SM", 1)  # two programs (interpreter): each walks many tiles
    choice = NC._bwd_choice
    monkeypatch.setattr(NC, "_bwd_choice", lambda n, is_rms, has_dxe: (*choice(n, is_rms, has_dxe)[:2], prefetch))
    clear_geometry_caches()
    for shape in [(37, 3), (9, 33), (2, 3, 24)]:
        assert NC._bwd_config(shape[-1], 4, rms, False)[5] == prefetch
        assert NC._bwd_config(shape[-1], 4, rms, True)[5] == prefetch
        _check_norm(shape, torch.bfloat16, torch.float32, True, False, True, True, "rows", rms=rms)
        _check_norm(shape, torch.float16, None, False, True, True, not rms, None, rms=rms)
    clear_geometry_caches()


@pytest.mark.parametrize("rms", [False, True], ids=["ln", "rms"])
def test_triton_interpreter_bwd_db_colsum(monkeypatch, rms):
    """The backward with dbias as a separate column sum of dy matches float64 math."""
    monkeypatch.setattr(NC, "_BWD_DB_COLSUM_MIN_N", 1)
    _check_norm((5, 33), torch.bfloat16, torch.float32, True, True, True, True, "rows", rms=rms)
    _check_norm((3, 7), torch.float16, None, False, False, False, True, None, rms=rms)


@pytest.mark.gpu
@pytest.mark.parametrize("rms", [False, True], ids=["ln", "rms"])
def test_gpu_bwd_db_colsum(monkeypatch, rms):
    monkeypatch.setattr(NC, "_BWD_DB_COLSUM_MIN_N", 1)
    for shape in [(65, 8193), (33, 16384), (517, 1000)]:
        _check_norm(shape, torch.bfloat16, torch.float32, True, True, True, True, "rows", rms=rms, device="cuda")


@pytest.mark.parametrize("rms", [False, True], ids=["ln", "rms"])
def test_eager_calls_allocate_no_placeholders(rms):
    """Eager kernel calls return None where nothing is computed (no residual: no xsum; a frozen
    weight: no dweight) instead of allocating a [0] dummy; the custom ops (the torch.compile
    path), which cannot return None, return fresh [0] placeholders there, and the same values."""
    x = torch.randn(6, 24, device=DEV, dtype=torch.float16)
    w = torch.rand(24, device=DEV, dtype=torch.float32) + 0.5
    b = torch.randn(24, device=DEV, dtype=torch.float32) if not rms else None
    dy = torch.randn_like(x)
    with K.use("triton"):
        if rms:
            eager_f, op_f = N._rmsnorm_fwd_op(x, w, EPS, None), N._rmsnorm_fwd_op.op(x, w, EPS, None)
            y_e, rstd_e, xsum_e = eager_f
            y_o, rstd_o, xsum_o = op_f
            eager_b = N._rmsnorm_bwd_op(dy, x, w, rstd_e, False, None)
            op_b = N._rmsnorm_bwd_op.op(dy, x, w, rstd_e, False, None)
        else:
            eager_f, op_f = N._layernorm_fwd_op(x, w, b, EPS, None), N._layernorm_fwd_op.op(x, w, b, EPS, None)
            y_e, mean_e, rstd_e, xsum_e = eager_f
            y_o, _, rstd_o, xsum_o = op_f
            eager_b = N._layernorm_bwd_op(dy, x, w, mean_e, rstd_e, False, False, None)
            op_b = N._layernorm_bwd_op.op(dy, x, w, mean_e, rstd_e, False, False, None)
    assert xsum_e is None and xsum_o.numel() == 0
    assert torch.equal(y_e, y_o) and torch.equal(rstd_e, rstd_o)
    assert all(t is None for t in eager_b[1:]) and all(t.numel() == 0 and t.dtype == w.dtype for t in op_b[1:])
    assert torch.equal(eager_b[0], op_b[0])
