"""FP8 cast kernels (fusible_ops.kernels.fp8_cast): Triton and the ``*_ref`` twins agree bit for bit.

Unmarked tests run Triton's interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1);
``gpu`` tests compile the kernels on CUDA and compare with the same refs (torch's own fp8 casts).
The refs themselves are checked against an independent float64 reading of the scales.
"""

from __future__ import annotations

import pytest
import torch

from fusible_ops import kernels
from fusible_ops.kernels import fp8_cast as C

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # cpu: the interpreter


def _bytes(t):
    return t.contiguous().view(torch.uint8)


def _assert_bytes(a, b, exact, msg=""):
    """FP8 bytes equal (``exact``), or within one code of each other at < 1% of the elements (a
    producer's own last-bit differences flipping a rounding boundary)."""
    if exact:
        assert torch.equal(_bytes(a), _bytes(b)), msg
        return
    da, db = a.float(), b.float()
    diff = da != db
    assert diff.float().mean().item() < 0.01, msg
    # one fp8 code apart: the gap is at most one ulp of the larger magnitude
    ulp = torch.maximum(da.abs(), db.abs()) * 2.0 ** -3
    assert ((da - db).abs()[diff] <= ulp[diff] + 2.0 ** -9).all(), msg


def _edge_values(dtype):
    """Values around fp8 rounding boundaries: halfway points, subnormals, the max, signed zeros."""
    fmax = C._FMAX[dtype]
    grid = torch.arange(-128, 128, dtype=torch.int16).to(torch.uint8).view(dtype).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2  # exact halfway points: round to even
    vals = torch.cat([grid, mids, mids * (1 + 2**-20), mids * (1 - 2**-20), torch.tensor([-0.0, 0.0, fmax * 1.5, -fmax * 3, float("inf"), -float("inf")])])
    return vals


def _x(shape, dtype=torch.float32, device="cpu", outlier=True, noncontig=False):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * 3
    if outlier and x.numel():
        x.view(-1)[0] = 700.0
    x = x.to(device=device, dtype=dtype)
    if noncontig:
        x = torch.cat([x, x], dim=-1)[..., : shape[-1]]
        assert not x.is_contiguous()
    return x


def _check_tensor(x, dtype, transposed=True, use_amax=True):
    scale = C.scale_from_amax_ref(C.tensor_amax(x), C._FMAX[dtype])
    am_k = torch.zeros(1, device=x.device) if use_amax else None
    am_r = torch.zeros(1, device=x.device) if use_amax else None
    with kernels.use("triton"):
        q1, qt1 = C.cast_tensor(x, scale, dtype, transposed, am_k)
    q2, qt2 = C.cast_tensor_ref(x, scale, dtype, transposed, am_r)
    assert q1.dtype == dtype and q1.shape == q2.shape
    assert torch.equal(_bytes(q1), _bytes(q2))
    if transposed:
        assert torch.equal(_bytes(qt1), _bytes(qt2))
        assert torch.equal(_bytes(qt1), _bytes(q1.t()))
    if use_amax:
        assert torch.equal(am_k, am_r)
    # current scaling: the kernel derives the scale from the amax and writes scale_inv itself
    amax = C.tensor_amax(x)
    inv_k, inv_r = torch.full((1,), -1.0, device=x.device), torch.full((1,), -1.0, device=x.device)
    with kernels.use("triton"):
        q3, qt3 = C.cast_tensor(x, amax, dtype, transposed, from_amax=True, inv=inv_k)
    q4, qt4 = C.cast_tensor_ref(x, amax, dtype, transposed, from_amax=True, inv=inv_r)
    assert torch.equal(_bytes(q3), _bytes(q1)) and torch.equal(_bytes(q4), _bytes(q1))
    assert torch.equal(inv_k, inv_r) and torch.equal(inv_k, (1.0 / scale).reshape(1))


def _check_block(x, square, pow2, transposed=True, dtype=E4M3):
    with kernels.use("triton"):
        got = C.cast_block(x, square, pow2, transposed, dtype)
    want = C.cast_block_ref(x, square, pow2, transposed, dtype)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
            continue
        assert g.shape == w.shape and g.stride() == w.stride()
        if w.dtype == torch.float32:
            assert torch.equal(g, w)
        else:
            assert torch.equal(_bytes(g), _bytes(w))


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_edge_values_bit_exact(dtype):
    x = _edge_values(dtype).reshape(1, -1)
    one = torch.ones(1)
    with kernels.use("triton"):
        q1, _ = C.cast_tensor(x, one, dtype)
    q2, _ = C.cast_tensor_ref(x, one, dtype)
    assert torch.equal(_bytes(q1), _bytes(q2))
    # and the ref is torch's round-to-nearest-even of the clamped value
    fmax = C._FMAX[dtype]
    assert torch.equal(_bytes(q2), _bytes(torch.clamp(x, -fmax, fmax).to(dtype)))


@pytest.mark.parametrize("shape", [(5, 17), (130, 70), (3, 1), (0, 8)])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_cast_tensor_bit_exact(shape, dtype, xdtype):
    _check_tensor(_x(shape, xdtype), dtype)


def test_cast_tensor_noncontiguous_and_no_transpose():
    _check_tensor(_x((9, 33), noncontig=True), E4M3, transposed=False, use_amax=False)


@pytest.mark.parametrize("shape", [(5, 17), (130, 200), (128, 256), (1, 129)])
@pytest.mark.parametrize("square", [False, True], ids=["1x128", "128x128"])
@pytest.mark.parametrize("pow2", [False, True], ids=["exact", "pow2"])
def test_cast_block_bit_exact(shape, square, pow2):
    _check_block(_x(shape, torch.bfloat16), square, pow2)


def test_cast_block_noncontiguous_zero_tiles_and_empty():
    x = _x((40, 300), noncontig=True)
    x[:, 128:256] = 0  # an all-zero tile: scale 1
    _check_block(x, False, False)
    _check_block(x, True, False, transposed=False)
    _check_block(_x((0, 128)), False, False)


def test_block_ref_scales_match_float64_reading():
    x = _x((130, 200), torch.float32)
    q, s, qt, st = C.cast_block_ref(x, square=False, transposed=True)
    x64 = x.double()
    for m, kb in [(0, 0), (129, 1), (7, 1)]:
        amax = x64[m, kb * 128 : (kb + 1) * 128].abs().max()
        assert s[m, kb].item() == pytest.approx((amax / 448.0).item(), rel=1e-6)
    amax_col = x64[128:, 5].abs().max()
    assert st[5, 1].item() == pytest.approx((amax_col / 448.0).item(), rel=1e-6)
    deq = q.float() * s.repeat_interleave(128, 1)[:, :200]
    assert (deq.double() - x64).abs().max() <= x64.abs().max() * 2**-4  # within e4m3's half-ulp


def test_pow2_scales_are_powers_of_two():
    _, s, _, _ = C.cast_block_ref(_x((64, 256)), square=False, pow2=True)
    m, e = torch.frexp(s)
    assert torch.all(m == 0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("xdtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_gpu_cast_tensor_bit_exact(dtype, xdtype):
    # row counts that are and are not multiples of 16, and strided rows (the transposed copy: from
    # the tile in registers for 16-bit inputs, re-loaded for fp32 ones, see fp8_cast._store_t)
    for shape in [(1000, 4100), (128, 128), (16, 64), (48, 640), (2064, 384)]:
        _check_tensor(_x(shape, xdtype, device="cuda"), dtype)
    _check_tensor(_x((130, 300), xdtype, device="cuda", noncontig=True), dtype)
    x = _edge_values(dtype).reshape(1, -1).cuda()
    q1, _ = C.cast_tensor(x, torch.ones(1, device="cuda"), dtype)
    q2, _ = C.cast_tensor_ref(x, torch.ones(1, device="cuda"), dtype)
    assert torch.equal(_bytes(q1), _bytes(q2))


def _extreme_magnitudes(subnormal: bool) -> torch.Tensor:
    """[256, 384] with a tile of tiny values (448 / amax overflows fp32: the scale caps at fp32's
    max and its inverse is subnormal), a tile near bf16's max, a column at bf16's edge and a zero
    row segment, beside ordinary tiles; with ``subnormal`` also a row of bf16 subnormals."""
    g = torch.Generator().manual_seed(7)
    u = torch.rand(256, 384, generator=g) + 1.0  # magnitudes in [1, 2): no subnormal products
    x = torch.where(torch.rand(256, 384, generator=g) < 0.5, -u, u) * 3
    x[:128, :128] *= 1e-37
    x[128:, 128:256] *= 1e37
    x[:, 300] = -3e38
    x[200, 256:] = 0.0
    if subnormal:
        x[5, :] = 1e-40
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("square", [False, True], ids=["1x128", "128x128"])
@pytest.mark.parametrize("pow2", [False, True], ids=["exact", "pow2"])
def test_cast_block_extreme_magnitudes(square, pow2, device):
    """Bytes and scales as the ref at the edges of fp32's and bf16's ranges, including the 1x128
    cast's scales computed once per row / column (``fp8_cast._scale_once``). Subnormal inputs on
    the GPU only: Triton's interpreter converts bf16 subnormals inexactly (seen with Triton 3.9)."""
    _check_block(_extreme_magnitudes(subnormal=device == "cuda").to(device), square, pow2)


@pytest.mark.gpu
@pytest.mark.parametrize("xdtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("square", [False, True], ids=["1x128", "128x128"])
@pytest.mark.parametrize("pow2", [False, True], ids=["exact", "pow2"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_gpu_cast_block_bit_exact(square, pow2, xdtype, dtype):
    # the transposed copies come from the tile in registers for 16-bit inputs and from a transposed
    # re-load for fp32 ones (fp8_cast._store_t): every input dtype, both FP8 formats, strided rows
    for shape in [(1000, 4100), (256, 384), (48, 384), (2064, 640)]:
        _check_block(_x(shape, xdtype, device="cuda"), square, pow2, dtype=dtype)
        _check_block(_x(shape, xdtype, device="cuda"), square, pow2, transposed=False, dtype=dtype)
    _check_block(_x((130, 300), xdtype, device="cuda", noncontig=True), square, pow2, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,gated", [("gelu", False), ("swiglu", True)])
@pytest.mark.parametrize("delayed", [False, True], ids=["amax", "fp8"])
def test_activation_fp8_epilogue_matches_unfused_cast(kind, gated, delayed, device):
    """bias_act_fwd_fp8 (the activation kernel's FP8 epilogue) gives the bytes, transposed copy and
    amax of bias_act_fwd followed by a standalone cast: on the interpreter and on the ref path."""
    from fusible_ops.kernels import activation as A

    g = torch.Generator().manual_seed(7)
    n = 96
    xdtype = torch.float32 if delayed else torch.bfloat16  # both input dtypes through the epilogue
    x = torch.randn(37, 2 * n if gated else n, generator=g).to(device, xdtype)
    b = torch.randn(x.shape[-1], generator=g).to(device, xdtype)
    for mode in ("triton", "reference"):
        with kernels.use(mode):
            y = A.bias_act_fwd(x, b, kind)
            amax = torch.zeros(1, device=device)
            if delayed:
                scale = torch.full((1,), 3.0, device=device)
                q = A.bias_act_fwd_fp8(x, b, kind, amax=amax, scale=scale, fp8_dtype=E4M3)
                q2, _ = C.cast_tensor(y, scale, E4M3)
                assert torch.equal(_bytes(q), _bytes(q2)), mode
            else:
                y1 = A.bias_act_fwd_fp8(x, b, kind, amax=amax)
                assert torch.equal(y1, y), mode
            assert torch.equal(amax, C.tensor_amax(y)), mode


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rms", [False, True], ids=["ln", "rms"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "res"])
@pytest.mark.parametrize("loop", [False, True], ids=["rows", "loop"])
@pytest.mark.parametrize("delayed", [False, True], ids=["amax", "fp8"])
def test_norm_fp8_epilogue_matches_unfused_cast(rms, residual, loop, delayed, device, monkeypatch):
    from fusible_ops.kernels import norm as Nk
    from fusible_ops.kernels import norm_config as NC

    if loop:  # the wide-row variant on a small N
        monkeypatch.setattr(NC, "_FWD_MAX_FUSED_N", 16)
        monkeypatch.setattr(NC, "_FWD_NORES_MAX_FUSED_N", 16)
        monkeypatch.setattr(NC, "_FWD_LOOP_BLOCK_N", 32)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(21, 80, generator=g).to(device, (torch.float32 if delayed else torch.bfloat16))
    res = torch.randn(21, 80, generator=g).to(device, x.dtype) if residual else None
    w = torch.rand(80, generator=g).to(device) + 0.5
    b = None if rms else torch.randn(80, generator=g).to(device)
    for mode in ("triton", "reference"):
        with kernels.use(mode):
            if rms:
                y, rstd, xsum = Nk.rmsnorm_fwd(x, w, 1e-5, res)
            else:
                y, mean, rstd, xsum = Nk.layernorm_fwd(x, w, b, 1e-5, res)
            amax = torch.zeros(1, device=device)
            scale = torch.full((1,), 5.0, device=device) if delayed else None
            out, mean2, rstd2, xsum2 = Nk.norm_fwd_fp8(x, w, b, 1e-5, res, is_rms=rms, amax=amax, scale=scale)
            assert torch.equal(xsum2, xsum), mode
            exact = device == "cpu"  # compiled variants may reduce rows in another order (last-bit rstd)
            torch.testing.assert_close(rstd2, rstd, rtol=0 if exact else 1e-6, atol=0)
            if delayed:
                q, _ = C.cast_tensor(y, scale, E4M3)
                _assert_bytes(out, q, exact, mode)
            else:
                torch.testing.assert_close(out, y, rtol=0 if exact else 2 ** -7, atol=0)
            torch.testing.assert_close(amax, C.tensor_amax(y), rtol=0 if exact else 2 ** -7, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,gated", [("gelu", False), ("swiglu", True)])
def test_activation_backward_amax(kind, gated, device):
    """bias_act_bwd_amax: the same dz and dbias as bias_act_bwd, and max|dz| in the same pass."""
    from fusible_ops.kernels import activation as A

    g = torch.Generator().manual_seed(9)
    n = 96
    x = torch.randn(37, 2 * n if gated else n, generator=g).to(device, torch.bfloat16)
    b = torch.randn(x.shape[-1], generator=g).to(device, torch.bfloat16)
    dy = torch.randn(37, n, generator=g).to(device, torch.bfloat16)
    for mode in ("triton", "reference"):
        with kernels.use(mode):
            dz, db = A.bias_act_bwd(dy, x, b, kind, True)
            amax = torch.zeros(1, device=device)
            dz2, db2 = A.bias_act_bwd_amax(dy, x, b, kind, True, amax=amax)
            assert torch.equal(dz2, dz) and torch.equal(db2, db), mode
            assert torch.equal(amax, C.tensor_amax(dz)), mode


@pytest.mark.parametrize("weight", [False, True])
@pytest.mark.parametrize("max_algo", [True, False])
@pytest.mark.parametrize("L", [1, 5, 1024])
@pytest.mark.parametrize("device", DEVICES)
def test_delayed_update_kernel_matches_ref(weight, max_algo, L, device):
    """The one-launch delayed-scaling step equals its torch twin bit for bit: scale from the
    history (a zero amax keeps the old scale), the column rolled down; or, for a weight, scale
    from its amax, written as the newest entry with the column not rolled."""
    g = torch.Generator().manual_seed(L)
    hist = (torch.rand(L, 3, generator=g) * 10).to(device)
    hist[:, 2] = 0.0  # a role whose history is all zeros: its scale stays
    scale = (torch.rand(3, generator=g) + 0.5).to(device)
    for r in range(3):
        amax = (torch.rand(1, generator=g) * 7).to(device) if weight else None
        h1, s1, h2, s2 = hist.clone(), scale.clone(), hist.clone(), scale.clone()
        with kernels.use("triton"):
            C.delayed_update(h1, s1, r, 448.0 / 2, max_algo, amax)
        C.delayed_update_ref(h2, s2, r, 448.0 / 2, max_algo, amax)
        assert torch.equal(h1, h2) and torch.equal(s1, s2)
        assert torch.equal(torch.cat([h1[:, :r], h1[:, r + 1:]], 1), torch.cat([hist[:, :r], hist[:, r + 1:]], 1))
        if weight:  # the newest entry is the amax, the older ones stay: a second cast changes nothing
            assert torch.equal(h1[0, r:r + 1], amax) and torch.equal(h1[1:, r], hist[1:, r])
            assert torch.equal(s1[r:r + 1], C.scale_from_amax_ref(amax, 448.0 / 2))
            with kernels.use("triton"):
                C.delayed_update(h1, s1, r, 448.0 / 2, max_algo, amax)
            assert torch.equal(h1, h2) and torch.equal(s1, s2)
        else:
            assert torch.equal(h1[1:, r], hist[:-1, r]) and h1[0, r] == 0
        if not weight and r == 2:
            assert torch.equal(s1[2], scale[2])
