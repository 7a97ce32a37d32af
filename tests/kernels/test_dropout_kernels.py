"""Counter-based dropout: Triton (interpreter on CPU) vs the pure-torch Philox twin."""

import pytest
import torch

import fusible_ops.kernels as K
from fusible_ops.kernels import dropout as D
from fusible_ops.kernels import launch
from fusible_ops.testing import assert_close

triton = pytest.importorskip("triton")
tl = triton.language


def S(seed: int, device="cpu") -> torch.Tensor:
    """A dropout seed as the kernels take it: an int64 tensor with one element."""
    return torch.tensor([seed], dtype=torch.int64, device=device)


@triton.jit
def _rand_kernel(OFFS, OUT, n, seed, BLOCK: tl.constexpr):
    # OFFS [n] int32 or int64 counters; OUT [n] fp32
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    offs = tl.load(OFFS + i, mask=m, other=0)
    tl.store(OUT + i, tl.rand(seed, offs), mask=m)


@triton.jit
def _rand4_kernel(OFFS, OUT, n, seed, BLOCK: tl.constexpr):
    # OFFS [n] int32 or int64 counters; OUT [4, n] fp32 (the 4 words of tl.rand4x)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    offs = tl.load(OFFS + i, mask=m, other=0)
    u0, u1, u2, u3 = tl.rand4x(seed, offs)
    tl.store(OUT + i, u0, mask=m)
    tl.store(OUT + n + i, u1, mask=m)
    tl.store(OUT + 2 * n + i, u2, mask=m)
    tl.store(OUT + 3 * n + i, u3, mask=m)


@triton.jit
def _rand4_seed_ptr_kernel(OFFS, OUT, n, SEED, BLOCK: tl.constexpr):
    # as _rand4_kernel, with the seed read from a pointer ([1] int64), like the dropout kernels
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    offs = tl.load(OFFS + i, mask=m, other=0)
    u0, u1, u2, u3 = tl.rand4x(tl.load(SEED), offs)
    tl.store(OUT + i, u0, mask=m)
    tl.store(OUT + n + i, u1, mask=m)
    tl.store(OUT + 2 * n + i, u2, mask=m)
    tl.store(OUT + 3 * n + i, u3, mask=m)


@triton.jit
def _randint4_kernel(OFFS, OUT, n, seed, BLOCK: tl.constexpr):
    # OFFS [n] int32 or int64 counters; OUT [4, n] int64 (the 4 uint32 words of tl.randint4x)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    offs = tl.load(OFFS + i, mask=m, other=0)
    w0, w1, w2, w3 = tl.randint4x(seed, offs)
    tl.store(OUT + i, w0.to(tl.int64), mask=m)
    tl.store(OUT + n + i, w1.to(tl.int64), mask=m)
    tl.store(OUT + 2 * n + i, w2.to(tl.int64), mask=m)
    tl.store(OUT + 3 * n + i, w3.to(tl.int64), mask=m)


@triton.jit
def _keep_tile_kernel(ROWS, OUT, n_rows, n_cols, drop_t, seed, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                      OFF64: tl.constexpr):
    # ROWS [n_rows] int64 row indices (may be huge: counters with a non-zero high word);
    # OUT [n_rows, n_cols] int8 keep mask of those rows from D.keep_tile
    i = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    col0 = tl.program_id(1) * BLOCK_C
    cols = col0 + tl.arange(0, BLOCK_C)
    rm = i < n_rows
    rows = tl.load(ROWS + i, mask=rm, other=0)
    keep = D.keep_tile(seed, rows, col0, n_cols, drop_t, BLOCK_R, BLOCK_C, OFF64)
    m = rm[:, None] & (cols < n_cols)[None, :]
    tl.store(OUT + i[:, None] * n_cols + cols[None, :], keep.to(tl.int8), mask=m)


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiny tiles so that small shapes still span several programs in both grid dims."""
    monkeypatch.setattr(launch, "EW_MAX_BLOCK_C", 16)
    monkeypatch.setattr(launch, "EW_TILE", 64)


@pytest.fixture(params=["off32", "off64"])
def counters(request, monkeypatch):
    """Runs a test with int32 mask counters (the default at small sizes) and with int64 ones."""
    if request.param == "off64":
        monkeypatch.setattr(launch, "INT64_MIN_COUNTERS", 0)
    return request.param


def _threshold(p):
    """The contract's drop threshold, spelled out: p * 2**16 rounded half up."""
    return min(65536, int(p * 65536 + 0.5))


def _halves(counters, seed):
    """[8, *counters.shape]: 16-bit half k of the Philox words of each counter (the low half of
    word k // 2 for even k, the high half for odd k)."""
    words = D.philox4_ref(counters, seed)
    return torch.stack([(words[k // 2] >> (16 * (k % 2))) & 0xFFFF for k in range(8)], 0)


def _mask_formula(shape, p, seed):
    """The mask contract spelled out: [rows, cols] view, counter r * C8 + c // 8, half c % 8."""
    cols = shape[-1] if len(shape) else 1
    rows = (torch.Size(shape).numel() // cols) if cols else 0
    c8 = (cols + 7) // 8
    r = torch.arange(rows)[:, None]
    c = torch.arange(cols)[None, :]
    h = _halves(r * c8 + c // 8, seed)  # [8, rows, cols]
    h = torch.gather(h, 0, (c % 8).expand(rows, cols)[None])[0]
    return (h >= _threshold(p)).reshape(shape)


def _make(shape, dtype, layout, device="cpu", seed=0):
    """Random tensor of `shape`; layout: contiguous | rowstride (padded rows) | strided (step-2 cols)."""
    g = torch.Generator().manual_seed(seed)
    if layout == "contiguous":
        t = torch.randn(shape, generator=g)
    elif layout == "rowstride":
        t = torch.randn((*shape[:-1], shape[-1] + 3), generator=g)[..., : shape[-1]]
    else:
        t = torch.randn((*shape[:-1], 2 * shape[-1]), generator=g)[..., ::2]
    return t.to(device=device, dtype=dtype)


def _expected(x, p, seed):
    keep = D.dropout_keep_mask(x.shape, p, S(seed), x.device)
    return x.double() * keep.double() / (1.0 - p)  # a product, like torch's dropout


def _device_ctx(device):
    return K.use("triton") if device == "cpu" else K.use("auto")


def _check_fwd_bwd(shape, dtype, layout, p, seed, device="cpu"):
    x = _make(shape, dtype, layout, device, seed=seed)
    dy = _make(shape, dtype, layout, device, seed=seed + 1)
    with _device_ctx(device):
        y = D.dropout_fwd(x, p, S(seed, device))
        dx = D.dropout_bwd(dy, p, S(seed, device))
    y_ref = D.dropout_fwd_ref(x, p, S(seed, device))
    dx_ref = D.dropout_bwd_ref(dy, p, S(seed, device))
    for out in (y, dx, y_ref, dx_ref):
        assert out.shape == x.shape and out.dtype == dtype
    assert_close(y, _expected(x, p, seed), msg="triton fwd")
    assert_close(y_ref, _expected(x, p, seed), msg="ref fwd")
    assert_close(dx, _expected(dy, p, seed), msg="triton bwd")
    assert_close(dx_ref, _expected(dy, p, seed), msg="ref bwd")
    # exact mask equality (inputs are nonzero almost surely; compare where they are)
    keep = D.dropout_keep_mask(shape, p, S(seed, device), device)
    nz = x != 0
    assert torch.equal((y != 0) & nz, keep & nz)
    assert torch.equal((y_ref != 0) & nz, keep & nz)


# ----------------------------------------------------------------------------- CPU


@pytest.mark.interpreter
@pytest.mark.parametrize("offs_dtype", [torch.int32, torch.int64])
def test_philox_ref_bit_identical_to_tl_rand(offs_dtype):
    offs = torch.cat([torch.arange(0, 300), torch.tensor([2**31 - 1, 123456789, 7])]).to(offs_dtype)
    if offs_dtype == torch.int64:  # counters with a non-zero high word
        offs = torch.cat([offs, torch.tensor([2**32, 2**32 + 5, 3 * 2**33 + 17, 2**40 - 1])])
    for seed in (0, 1, 424242, 2**31 - 1):
        out = torch.empty(offs.numel(), dtype=torch.float32)
        with K.use("triton"):
            _rand_kernel[(triton.cdiv(offs.numel(), 128),)](offs, out, offs.numel(), seed, BLOCK=128)
        ref = D.philox_rand_ref(offs, seed)
        assert ref.dtype == torch.float32
        assert torch.equal(out.view(torch.int32), ref.view(torch.int32)), f"seed={seed}"
        assert (ref >= 0).all() and (ref < 1).all()


def _counters(offs_dtype):
    """Philox counters of offs_dtype: 0..199 and a few large ones (int64: some past 2**32)."""
    offs = torch.cat([torch.arange(0, 200), torch.tensor([2**31 - 1, 123456789, 7])]).to(offs_dtype)
    if offs_dtype == torch.int64:  # counters with a non-zero high word
        offs = torch.cat([offs, torch.tensor([2**32, 2**32 + 5, 3 * 2**33 + 17, 2**40 - 1])])
    return offs


@pytest.mark.interpreter
@pytest.mark.parametrize("offs_dtype", [torch.int32, torch.int64])
def test_philox_refs_bit_identical_to_tl_rand4x_and_randint4x(offs_dtype):
    """philox4_ref == tl.randint4x (the words the masks use) and philox_rand4_ref == tl.rand4x
    (those words as uniforms), for int and tensor seeds."""
    offs = _counters(offs_dtype)
    n = offs.numel()
    for seed in (0, 424242, 2**31 - 1):
        out = torch.empty(4, n, dtype=torch.float32)
        words_k = torch.empty(4, n, dtype=torch.int64)
        with K.use("triton"):
            _rand4_kernel[(triton.cdiv(n, 128),)](offs, out, n, seed, BLOCK=128)
            _randint4_kernel[(triton.cdiv(n, 128),)](offs, words_k, n, seed, BLOCK=128)
        ref = D.philox_rand4_ref(offs, seed)
        words = D.philox4_ref(offs, seed)
        assert len(ref) == 4 and len(words) == 4
        for k in range(4):
            assert ref[k].dtype == torch.float32 and ref[k].shape == offs.shape
            assert torch.equal(out[k].view(torch.int32), ref[k].view(torch.int32)), f"seed={seed} word={k}"
            assert words[k].dtype == torch.int64 and ((words[k] >= 0) & (words[k] < 2**32)).all()
            assert torch.equal(words_k[k] & 0xFFFFFFFF, words[k]), f"seed={seed} word={k}"
            u = torch.where(words[k] >= 2**31, words[k] ^ 0xFFFFFFFF, words[k]).float() * 4.6566127342e-10
            assert torch.equal(u, ref[k])
        assert torch.equal(D.philox_rand_ref(offs, seed), ref[0])
        for k, u in enumerate(D.philox_rand4_ref(offs, S(seed))):  # a tensor seed: the same words
            assert torch.equal(u.view(torch.int32), ref[k].view(torch.int32))
            assert torch.equal(D.philox4_ref(offs, S(seed))[k], words[k])


def test_drop_threshold():
    """p * 2**16 rounded half up: the drop probability is a multiple of 2**-16."""
    assert [D.drop_threshold(p) for p in (0.0, 0.1, 0.25, 0.5, 0.9, 1.0)] == [0, 6554, 16384, 32768, 58982, 65536]
    assert D.drop_threshold(2**-17) == 1 and D.drop_threshold(2**-17 - 2**-30) == 0
    assert D.drop_threshold(1 - 2**-17) == 65536 and D.drop_threshold(1 - 2**-16) == 65535
    # p below 2**-17 drops nothing; above 1 - 2**-17, everything
    assert D.dropout_keep_mask((64, 64), 2**-18, S(1), "cpu").all()
    assert not D.dropout_keep_mask((64, 64), 1 - 2**-18, S(1), "cpu").any()


@pytest.mark.interpreter
def test_philox_ref_int64_seed_from_pointer_bit_identical():
    """Kernels read the seed as int64 from memory: the key is its (lo, hi) words, and the ref
    matches for any int64 value (beyond 2**31 and negative too), so no range check is needed."""
    offs = torch.cat([torch.arange(0, 70), torch.tensor([2**32 + 5, 2**40 - 1])])
    n = offs.numel()
    for seed in (0, 77, 2**31 - 1, 2**31, 2**40 + 7, -5):
        out = torch.empty(4, n, dtype=torch.float32)
        with K.use("triton"):
            _rand4_seed_ptr_kernel[(triton.cdiv(n, 64),)](offs, out, n, S(seed), BLOCK=64)
        for k, ref in enumerate(D.philox_rand4_ref(offs, S(seed))):
            assert torch.equal(out[k].view(torch.int32), ref.view(torch.int32)), (seed, k)


@pytest.mark.interpreter
def test_keep_tile_int64_counters_with_high_word():
    """_keep_tile on rows whose counters exceed 2**32 (int64 path) matches the ref contract."""
    n_cols, p, seed = 13, 0.45, 77
    c8 = (n_cols + 7) // 8
    rows = torch.tensor([0, 1, 2**31 // c8 + 3, 2**33 + 5, 2**40 + 1])
    out = torch.empty(rows.numel(), n_cols, dtype=torch.int8)
    with K.use("triton"):
        _keep_tile_kernel[(triton.cdiv(rows.numel(), 4), triton.cdiv(n_cols, 8))](
            rows, out, rows.numel(), n_cols, float(D.drop_threshold(p)), seed, BLOCK_R=4, BLOCK_C=8, OFF64=True)
    c = torch.arange(n_cols)[None, :]
    h = _halves(rows[:, None] * c8 + c // 8, seed)
    h = torch.gather(h, 0, (c % 8).expand(rows.numel(), n_cols)[None])[0]
    assert torch.equal(out.bool(), h >= _threshold(p))


@pytest.mark.parametrize("tiles", ["default", "small"])
def test_triton_mask_bit_exact_odd_shapes(tiles, counters, monkeypatch):
    """The Triton kernel's mask equals the ref mask exactly, incl. cols not a multiple of 8."""
    shapes = [(3, 5), (7, 33), (1, 1), (5, 1026), (2, 3, 6), (9,), ()]
    if tiles == "small":  # many programs per dim (small widths: the interpreter is slow)
        monkeypatch.setattr(launch, "EW_MAX_BLOCK_C", 8)
        monkeypatch.setattr(launch, "EW_TILE", 32)
        shapes[3] = (5, 66)
    for i, shape in enumerate(shapes):
        seed, p = 500 + i, (0.3, 0.5, 0.8)[i % 3]
        x = torch.rand(shape) + 0.5  # nonzero: y != 0 exactly where kept
        with K.use("triton"):
            y = D.dropout_fwd(x, p, S(seed))
            dx = D.dropout_bwd(torch.ones(shape), p, S(seed))
        keep = D.dropout_keep_mask(shape, p, S(seed), "cpu")
        assert torch.equal(keep, _mask_formula(shape, p, seed)), shape
        assert torch.equal(y != 0, keep), shape
        assert torch.equal(dx != 0, keep), shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dropout_triton_and_ref_match_float64(dtype, small_tiles):
    cases = [((3, 5), "contiguous"), ((7, 33), "rowstride"), ((1, 1), "contiguous"),
             ((0, 5), "contiguous"), ((2, 3, 17), "strided"), ((9,), "contiguous")]
    for i, (shape, layout) in enumerate(cases):
        _check_fwd_bwd(shape, dtype, layout, p=(0.25, 0.6)[i % 2], seed=1000 + i)


def test_dropout_default_tiles_and_scalar():
    _check_fwd_bwd((37, 129), torch.float32, "rowstride", p=0.5, seed=77)
    _check_fwd_bwd((), torch.float32, "contiguous", p=0.5, seed=3)


def test_mask_contract_rows_cols_view():
    """keep[r, c] = half c % 8 of randint4x(r * ceil(cols / 8) + c // 8) >= t on the [rows, cols] view."""
    keep = D.dropout_keep_mask((6, 10), 0.4, S(9), "cpu")
    assert torch.equal(keep, _mask_formula((6, 10), 0.4, 9))
    # only the [rows, cols] view matters: leading dims flatten into rows
    assert torch.equal(D.dropout_keep_mask((2, 3, 10), 0.4, S(9), "cpu").reshape(6, 10), keep)
    # cols a multiple of 8: the mask is the flat stream of 8-half blocks (w0 lo, w0 hi, w1 lo, ...)
    w = D.philox4_ref(torch.arange(12), 9)
    h = torch.stack([w[k // 2] >> 16 if k % 2 else w[k // 2] & 0xFFFF for k in range(8)], -1).flatten()
    keep16 = D.dropout_keep_mask((6, 16), 0.4, S(9), "cpu")
    assert torch.equal(keep16.flatten(), h >= 26214)
    # cols not a multiple of 8: each row starts a new counter (last halves unused)
    keep5 = D.dropout_keep_mask((3, 5), 0.4, S(9), "cpu")
    assert torch.equal(keep5, (h >= 26214).reshape(12, 8)[:3, :5])
    assert D.dropout_keep_mask((0, 5), 0.4, S(9), "cpu").shape == (0, 5)
    assert D.dropout_keep_mask((4, 0), 0.4, S(9), "cpu").shape == (4, 0)
    assert D.dropout_keep_mask((), 0.4, S(9), "cpu").shape == ()


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_fraction(p):
    n = 512 * 1024
    frac = D.dropout_keep_mask((512, 1024), p, S(31337), "cpu").float().mean().item()
    assert abs(frac - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5 + 1e-4
    x = torch.ones(128, 257)
    with K.use("triton"):
        y = D.dropout_fwd(x, p, S(5))
    frac_t = (y != 0).float().mean().item()
    assert abs(frac_t - (1 - p)) < 5 * (p * (1 - p) / x.numel()) ** 0.5 + 1e-4
    # kept values are scaled by 1/(1-p): the mean is preserved
    assert abs(y.double().mean().item() - 1.0) < 6 * ((p / (1 - p)) / x.numel()) ** 0.5


def test_backward_regenerates_forward_mask(counters):
    x = torch.rand(11, 23) + 0.5
    with K.use("triton"):
        y = D.dropout_fwd(x, 0.35, S(2024))
        dx = D.dropout_bwd(torch.ones_like(x), 0.35, S(2024))
    assert torch.equal(y != 0, dx != 0)
    assert_close(dx, torch.where(y != 0, 1 / 0.65, 0.0).double(), torch.float32)
    assert torch.equal(D.dropout_bwd_ref(torch.ones_like(x), 0.35, S(2024)) != 0, y != 0)


def test_seeds_give_different_masks():
    a = D.dropout_keep_mask((64, 64), 0.5, S(1), "cpu")
    b = D.dropout_keep_mask((64, 64), 0.5, S(2), "cpu")
    assert not torch.equal(a, b)


@pytest.mark.parametrize("mode", ["triton", "reference"])
def test_p_zero_and_one(mode):
    x = torch.randn(5, 7)
    with K.use(mode):
        assert D.dropout_fwd(x, 0.0) is x  # inactive: no seed needed
        assert D.dropout_bwd(x, 0.0) is x
        y = D.dropout_fwd(x, 1.0, S(3))
        dx = D.dropout_bwd(x, 1.0, S(3))
    for t in (y, dx):
        assert torch.isfinite(t).all() and (t == 0).all()
    assert D.dropout_keep_mask((5, 7), 0.0, 3, "cpu").all()
    assert not D.dropout_keep_mask((5, 7), 1.0, 3, "cpu").any()


def test_bad_arguments():
    x = torch.randn(3)
    with pytest.raises(ValueError):
        D.dropout_fwd(x, 1.5, S(0))
    with pytest.raises(ValueError, match="needs a seed"):
        D.dropout_fwd(x, 0.5)
    for bad in (torch.tensor([1, 2]), torch.tensor([1.0]), torch.tensor([True])):
        with pytest.raises(ValueError, match="one element"):
            D.dropout_fwd(x, 0.5, bad)
    with pytest.raises(ValueError):  # Python int seeds are checked on the host
        D.dropout_fwd(x, 0.5, -1)
    with pytest.raises(ValueError):
        D.dropout_keep_mask((3,), 0.5, 2**31, "cpu")


@pytest.mark.parametrize("mode", ["triton", "reference"])
def test_seed_tensor_forms(mode):
    """A seed tensor of any integer dtype / shape with one element gives the mask of its value; a
    Python int the same; the seed is read where the data is (no host read in the kernels)."""
    x = torch.rand(6, 9) + 0.5
    with K.use(mode):
        y = D.dropout_fwd(x, 0.4, S(321))
        for seed in (torch.tensor(321), torch.tensor([[321]], dtype=torch.int32), 321):
            assert torch.equal(D.dropout_fwd(x, 0.4, seed), y)
        assert not torch.equal(D.dropout_fwd(x, 0.4, S(322)), y)
    assert torch.equal(y != 0, D.dropout_keep_mask(x.shape, 0.4, S(321), "cpu"))


@pytest.mark.parametrize("mode", [pytest.param("triton", marks=pytest.mark.interpreter), "reference"])
def test_compile_fullgraph_seed_tensor_aot_eager(mode):
    """The seed is a graph input: no int(), no .item(); same result as eager."""
    x, seed = torch.randn(7, 10), S(99)

    def f(x, seed):
        y = D.dropout_bwd(D.dropout_fwd(x, 0.3, seed), 0.3, seed)
        return y, D.dropout_keep_mask(x.shape, 0.3, seed, x.device)

    with K.use(mode):
        out = torch.compile(f, backend="aot_eager", fullgraph=True)(x, seed)
        ref = f(x, seed)
    for a, b in zip(out, ref):
        assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the interpreter's numpy: inf * 0
@pytest.mark.parametrize("mode", ["triton", "reference"])
def test_dropped_nan_inf_give_nan_like_torch(mode):
    """y = x * keep / (1 - p): a dropped NaN/Inf is NaN (inf * 0), as in torch.nn.functional.dropout."""
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0] * 8).reshape(4, 8)
    keep = D.dropout_keep_mask(x.shape, 0.5, S(4), "cpu")
    assert keep.any() and not keep.all()
    expected = x * keep.float() * 2.0
    with K.use(mode):
        y = D.dropout_fwd(x, 0.5, S(4))
        dx = D.dropout_bwd(x, 0.5, S(4))
    torch.testing.assert_close(y, expected, equal_nan=True)
    torch.testing.assert_close(dx, expected, equal_nan=True)


def test_float64_ref():
    x = torch.randn(4, 9, dtype=torch.float64)
    y = D.dropout_fwd_ref(x, 0.3, S(8))
    assert y.dtype == torch.float64
    assert_close(y, _expected(x, 0.3, 8))


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_dropout_matches_ref(dtype):
    for i, (shape, layout) in enumerate([((1031, 4099), "contiguous"), ((3, 517, 1025), "rowstride"),
                                          ((257, 2051), "strided"), ((0, 33), "contiguous")]):
        _check_fwd_bwd(shape, dtype, layout, p=(0.1, 0.5, 0.9)[i % 3], seed=17 + i, device="cuda")


@pytest.mark.gpu
def test_gpu_mask_bit_identical_and_fraction():
    x = torch.ones(4097, 1023, device="cuda")
    y = D.dropout_fwd(x, 0.3, S(123, "cuda"))
    keep = D.dropout_keep_mask(x.shape, 0.3, S(123, "cuda"), "cuda")
    assert torch.equal(y != 0, keep)
    assert torch.equal(D.dropout_keep_mask(x.shape, 0.3, S(123), "cpu"), keep.cpu())
    assert abs(keep.float().mean().item() - 0.7) < 2e-3
    offs = torch.arange(0, 1 << 16, device="cuda", dtype=torch.int64) * 65537 + 2**33
    out = torch.empty(offs.numel(), dtype=torch.float32, device="cuda")
    _rand_kernel[(triton.cdiv(offs.numel(), 1024),)](offs, out, offs.numel(), 99, BLOCK=1024)
    assert torch.equal(out.view(torch.int32), D.philox_rand_ref(offs, 99).view(torch.int32))
    out4 = torch.empty(4, offs.numel(), dtype=torch.float32, device="cuda")
    _rand4_kernel[(triton.cdiv(offs.numel(), 1024),)](offs, out4, offs.numel(), 99, BLOCK=1024)
    for k, ref in enumerate(D.philox_rand4_ref(offs, 99)):
        assert torch.equal(out4[k].view(torch.int32), ref.view(torch.int32)), k
    w4 = torch.empty(4, offs.numel(), dtype=torch.int64, device="cuda")
    _randint4_kernel[(triton.cdiv(offs.numel(), 1024),)](offs, w4, offs.numel(), 99, BLOCK=1024)
    for k, ref in enumerate(D.philox4_ref(offs, 99)):
        assert torch.equal(w4[k] & 0xFFFFFFFF, ref), k


@pytest.mark.gpu
def test_gpu_mask_odd_shapes_both_counter_widths(monkeypatch):
    for off64 in (False, True):
        if off64:
            monkeypatch.setattr(launch, "INT64_MIN_COUNTERS", 0)
        for i, shape in enumerate([(3, 5), (7, 33), (1, 1), (5, 1026), (1025, 4099), (3, 2051)]):
            x = torch.rand(shape, device="cuda") + 0.5
            y = D.dropout_fwd(x, 0.3, S(40 + i, "cuda"))
            dx = D.dropout_bwd(torch.ones_like(x), 0.3, S(40 + i, "cuda"))
            keep = D.dropout_keep_mask(shape, 0.3, S(40 + i), "cpu")
            assert torch.equal((y != 0).cpu(), keep), (shape, off64)
            assert torch.equal((dx != 0).cpu(), keep), (shape, off64)
    rows = torch.tensor([0, 1, 2**31 // 2 + 3, 2**33 + 5, 2**40 + 1], device="cuda")
    out = torch.empty(rows.numel(), 13, dtype=torch.int8, device="cuda")
    _keep_tile_kernel[(2, 2)](rows, out, rows.numel(), 13, float(D.drop_threshold(0.45)), 77, BLOCK_R=4, BLOCK_C=8,
                              OFF64=True)
    c = torch.arange(13)[None, :]
    h = _halves(rows.cpu()[:, None] * 2 + c // 8, 77)  # (13 columns: 2 counters per row)
    h = torch.gather(h, 0, (c % 8).expand(rows.numel(), 13)[None])[0]
    assert torch.equal(out.cpu().bool(), h >= _threshold(0.45))


@pytest.mark.gpu
def test_gpu_compile_fullgraph():
    x = torch.randn(333, 517, device="cuda", dtype=torch.bfloat16)
    seed = S(11, "cuda")

    def f(x, seed):
        return D.dropout_bwd(D.dropout_fwd(x, 0.2, seed), 0.2, seed)

    out = torch.compile(f, fullgraph=True)(x, seed)
    assert torch.equal(out, f(x, seed))


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_draw_new_masks():
    """The Dropout op draws its seed on the device: each CUDA-graph replay gets a new mask, and
    backward (captured too) regenerates the mask of its own forward."""
    import fusible_ops as fo

    drop = fo.Dropout(0.5)
    x = torch.ones(64, 96, device="cuda", requires_grad=True)
    gy = torch.ones(64, 96, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (Triton compiles) off the capture
        for _ in range(2):
            y = drop(x)
            (gx,) = torch.autograd.grad(y, [x], gy)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = drop(x)
        (gx,) = torch.autograd.grad(y, [x], gy)
    masks = []
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y != 0, gx != 0)
        masks.append((y != 0).clone())
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
