"""Counter-based dropout: Triton (interpreter on CPU) vs the pure-torch Philox twin."""

import pytest
import torch

import fusible_ops.kernels as K
from fusible_ops.kernels import dropout as D
from fusible_ops.testing import assert_close

triton = pytest.importorskip("triton")
tl = triton.language


@triton.jit
def _rand_kernel(OFFS, OUT, n, seed, BLOCK: tl.constexpr):
    # OFFS [n] int32 or int64 counters; OUT [n] fp32
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    offs = tl.load(OFFS + i, mask=m, other=0)
    tl.store(OUT + i, tl.rand(seed, offs), mask=m)


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiny tiles so that small shapes still span several programs in both grid dims."""
    monkeypatch.setattr(D, "_EW_MAX_BLOCK_C", 16)
    monkeypatch.setattr(D, "_EW_TILE", 64)


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
    keep = D.dropout_keep_mask(x.shape, p, seed, x.device)
    return torch.where(keep, x.double() / (1.0 - p), torch.zeros((), dtype=torch.float64, device=x.device))


def _device_ctx(device):
    return K.use("triton") if device == "cpu" else K.use("auto")


def _check_fwd_bwd(shape, dtype, layout, p, seed, device="cpu"):
    x = _make(shape, dtype, layout, device, seed=seed)
    dy = _make(shape, dtype, layout, device, seed=seed + 1)
    with _device_ctx(device):
        y = D.dropout_fwd(x, p, seed)
        dx = D.dropout_bwd(dy, p, seed)
    y_ref = D.dropout_fwd_ref(x, p, seed)
    dx_ref = D.dropout_bwd_ref(dy, p, seed)
    for out in (y, dx, y_ref, dx_ref):
        assert out.shape == x.shape and out.dtype == dtype
    assert_close(y, _expected(x, p, seed), msg="triton fwd")
    assert_close(y_ref, _expected(x, p, seed), msg="ref fwd")
    assert_close(dx, _expected(dy, p, seed), msg="triton bwd")
    assert_close(dx_ref, _expected(dy, p, seed), msg="ref bwd")
    # exact mask equality (inputs are nonzero almost surely; compare where they are)
    keep = D.dropout_keep_mask(shape, p, seed, device)
    nz = x != 0
    assert torch.equal((y != 0) & nz, keep & nz)
    assert torch.equal((y_ref != 0) & nz, keep & nz)


# ----------------------------------------------------------------------------- CPU


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dropout_triton_and_ref_match_float64(dtype, small_tiles):
    cases = [((3, 5), "contiguous"), ((7, 33), "rowstride"), ((1, 1), "contiguous"),
             ((0, 5), "contiguous"), ((2, 3, 17), "strided"), ((9,), "contiguous")]
    for i, (shape, layout) in enumerate(cases):
        _check_fwd_bwd(shape, dtype, layout, p=(0.25, 0.6)[i % 2], seed=1000 + i)


def test_dropout_default_tiles_and_scalar():
    _check_fwd_bwd((37, 129), torch.float32, "rowstride", p=0.5, seed=77)
    _check_fwd_bwd((), torch.float32, "contiguous", p=0.5, seed=3)


def test_mask_is_flat_index_of_contiguous_view():
    keep = D.dropout_keep_mask((6, 10), 0.4, 9, "cpu")
    assert torch.equal(keep.reshape(3, 20), D.dropout_keep_mask((3, 20), 0.4, 9, "cpu"))
    rand = D.philox_rand_ref(torch.arange(60), 9)
    assert torch.equal(keep.flatten(), rand >= torch.tensor(0.4, dtype=torch.float32))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_fraction(p):
    n = 512 * 1024
    frac = D.dropout_keep_mask((512, 1024), p, 31337, "cpu").float().mean().item()
    assert abs(frac - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5 + 1e-4
    x = torch.ones(128, 257)
    with K.use("triton"):
        y = D.dropout_fwd(x, p, 5)
    frac_t = (y != 0).float().mean().item()
    assert abs(frac_t - (1 - p)) < 5 * (p * (1 - p) / x.numel()) ** 0.5 + 1e-4
    # kept values are scaled by 1/(1-p): the mean is preserved
    assert abs(y.double().mean().item() - 1.0) < 6 * ((p / (1 - p)) / x.numel()) ** 0.5


def test_backward_regenerates_forward_mask():
    x = torch.rand(11, 23) + 0.5
    with K.use("triton"):
        y = D.dropout_fwd(x, 0.35, 2024)
        dx = D.dropout_bwd(torch.ones_like(x), 0.35, 2024)
    assert torch.equal(y != 0, dx != 0)
    assert_close(dx, torch.where(y != 0, 1 / 0.65, 0.0).double(), torch.float32)
    assert torch.equal(D.dropout_bwd_ref(torch.ones_like(x), 0.35, 2024) != 0, y != 0)


def test_seeds_give_different_masks():
    a = D.dropout_keep_mask((64, 64), 0.5, 1, "cpu")
    b = D.dropout_keep_mask((64, 64), 0.5, 2, "cpu")
    assert not torch.equal(a, b)


@pytest.mark.parametrize("mode", ["triton", "reference"])
def test_p_zero_and_one(mode):
    x = torch.randn(5, 7)
    with K.use(mode):
        assert D.dropout_fwd(x, 0.0, 3) is x
        assert D.dropout_bwd(x, 0.0, 3) is x
        y = D.dropout_fwd(x, 1.0, 3)
        dx = D.dropout_bwd(x, 1.0, 3)
    for t in (y, dx):
        assert torch.isfinite(t).all() and (t == 0).all()
    assert D.dropout_keep_mask((5, 7), 0.0, 3, "cpu").all()
    assert not D.dropout_keep_mask((5, 7), 1.0, 3, "cpu").any()


def test_bad_arguments():
    x = torch.randn(3)
    with pytest.raises(ValueError):
        D.dropout_fwd(x, 1.5, 0)
    with pytest.raises(ValueError):
        D.dropout_fwd(x, 0.5, -1)
    with pytest.raises(ValueError):
        D.dropout_keep_mask((3,), 0.5, 2**31, "cpu")


def test_float64_ref():
    x = torch.randn(4, 9, dtype=torch.float64)
    y = D.dropout_fwd_ref(x, 0.3, 8)
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
    y = D.dropout_fwd(x, 0.3, 123)
    keep = D.dropout_keep_mask(x.shape, 0.3, 123, "cuda")
    assert torch.equal(y != 0, keep)
    assert torch.equal(D.dropout_keep_mask(x.shape, 0.3, 123, "cpu"), keep.cpu())
    assert abs(keep.float().mean().item() - 0.7) < 2e-3
    offs = torch.arange(0, 1 << 16, device="cuda", dtype=torch.int64) * 65537 + 2**33
    out = torch.empty(offs.numel(), dtype=torch.float32, device="cuda")
    _rand_kernel[(triton.cdiv(offs.numel(), 1024),)](offs, out, offs.numel(), 99, BLOCK=1024)
    assert torch.equal(out.view(torch.int32), D.philox_rand_ref(offs, 99).view(torch.int32))


@pytest.mark.gpu
def test_gpu_compile_fullgraph():
    x = torch.randn(333, 517, device="cuda", dtype=torch.bfloat16)

    def f(x):
        return D.dropout_bwd(D.dropout_fwd(x, 0.2, 11), 0.2, 11)

    out = torch.compile(f, fullgraph=True)(x)
    assert torch.equal(out, f(x))
