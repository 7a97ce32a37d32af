"""FP8 grouped GEMMs (fusible_ops.kernels.fp8_grouped_gemm) against float64 math on the
dequantized operands.

CPU: the Triton kernels under the interpreter with fp16/fp32 stand-ins holding FP8 values (FP8
dot is not emulated there), and the ``*_ref`` on real FP8 tensors. GPU (marked ``gpu``): real
e4m3 / e5m2 operands, odd sizes, empty groups, bias, main_grad accumulation, the TMA and the
pointer paths, and CUDA-graph replay with changed split sizes.
"""

import pytest
import torch

import fusible_ops.kernels as K
from fusible_ops.kernels import fp8_grouped_gemm as F
from fusible_ops.kernels import launch, persistent
from fusible_ops.testing import SQNR_DB, assert_close_norm, assert_sqnr

KERNEL_DB = SQNR_DB["kernel", "fp8 operands"]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.fixture(autouse=True)
def _fixed_configs(monkeypatch):
    monkeypatch.setattr(launch, "AUTOTUNE", False)


def _gid(split):
    return torch.repeat_interleave(torch.arange(split.numel()), split.cpu())


def _fp8(shape, dtype, g, scale=1.0):
    """Random FP8 bytes and a scale_inv: values ~ N(0, 1) * scale."""
    x = torch.randn(*shape, generator=g) * 8.0
    return x.to(dtype), torch.tensor(scale / 8.0)


def _deq64(pair):
    data, inv = pair
    return data.double().cpu() * inv.double().cpu()


def _case(M, N, K, splits, a_dtype=E4M3, b_dtype=E4M3, seed=0):
    g = torch.Generator().manual_seed(seed)
    split = torch.tensor(splits, dtype=torch.int64)
    assert int(split.sum()) == M
    a = _fp8((M, K), a_dtype, g)
    b = _fp8((len(splits), N, K), b_dtype, g, scale=K ** -0.5)
    bias = torch.randn(len(splits), N, generator=g)
    return a, b, bias, split


def mm64(a, b, split, bias=None):
    gid = _gid(split)
    y = torch.einsum("mk,mnk->mn", _deq64(a), _deq64(b)[gid])
    return y if bias is None else y + bias.double().cpu()[gid]


def wgrad64(a_t, b_t, split):
    gid = _gid(split)
    outer = _deq64(a_t).t()[:, :, None] * _deq64(b_t).t()[:, None, :]
    return torch.zeros(split.numel(), a_t[0].shape[0], b_t[0].shape[0], dtype=torch.float64).index_add_(0, gid, outer)


def _on(pair, device, dtype=None):
    data, inv = pair
    return (data.to(device) if dtype is None else data.to(dtype).to(device)), inv.to(device)


def _spy(monkeypatch) -> list:
    calls = []
    for name, tag in (("_launch_mm", "mm"), ("_launch_wgrad", "wgrad")):
        real = getattr(F, name)
        monkeypatch.setattr(F, name, lambda *a, _r=real, _t=tag: (calls.append(_t), _r(*a))[1])
    return calls


SPLITS = [[5, 0, 17, 10], [0, 0, 32, 0], [1, 30, 1, 0]]


@pytest.mark.parametrize("carrier", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", SPLITS)
def test_interpreter_mm_and_wgrad_with_fp8_values(carrier, splits, monkeypatch):
    """The kernels (interpreter, fp16/fp32 carriers of the FP8 values) vs float64 math."""
    M, N, Kd = sum(splits), 24, 40
    a, b, bias, split = _case(M, N, Kd, splits)
    spy = _spy(monkeypatch)
    with K.use("triton"):
        y = F.fp8_grouped_mm(_on(a, "cpu", carrier), _on(b, "cpu", carrier), split, torch.float32, bias=bias)
    assert_close_norm(y, mm64(a, b, split, bias), torch.float32)
    dy_t = _fp8((N, M), E5M2, torch.Generator().manual_seed(3))
    x_t = (a[0].t().contiguous(), a[1])
    main = torch.randn(len(splits), N, Kd)
    before = main.clone()
    with K.use("triton"):
        F.fp8_grouped_wgrad(_on(dy_t, "cpu", carrier), _on(x_t, "cpu", carrier), split, out=main, accumulate=True)
        fresh = F.fp8_grouped_wgrad(_on(dy_t, "cpu", carrier), _on(x_t, "cpu", carrier), split)
    assert spy == ["mm", "wgrad", "wgrad"]  # the kernels ran, not the refs
    assert_close_norm(main, before.double() + wgrad64(dy_t, x_t, split), torch.float32)
    empty = [g for g, s in enumerate(splits) if s == 0]
    assert torch.equal(main[empty], before[empty])  # empty groups untouched
    assert fresh.dtype == torch.float32 and torch.equal(fresh[empty], torch.zeros_like(fresh[empty]))


def test_ref_on_real_fp8_matches_float64():
    a, b, bias, split = _case(48, 24, 32, [16, 0, 32], a_dtype=E5M2)
    assert_close_norm(F.fp8_grouped_mm(a, b, split, torch.float32, bias=bias), mm64(a, b, split, bias), torch.float32)
    out = F.fp8_grouped_mm(a, b, split, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert_close_norm(out, mm64(a, b, split), torch.bfloat16)


def test_bad_inputs_raise():
    a, b, _, split = _case(16, 8, 32, [8, 8])
    with pytest.raises(ValueError, match="K must agree"):
        F.fp8_grouped_mm(a, (b[0][:, :, :16], b[1]), split, torch.float32)
    with pytest.raises(ValueError, match="scale_inv shapes"):
        F.fp8_grouped_mm(a, (b[0], torch.ones(2)), split, torch.float32)
    with pytest.raises(ValueError, match="scale_inv shapes"):  # block scales of the wrong shape
        F.fp8_grouped_mm((a[0], torch.ones(16, 2)), (b[0], torch.ones(2, 1, 1)), split, torch.float32)


# ---------------------------------------------------------------- block scaling (1x128 / 128x128)
def _block_case(splits, N, Kd, seed=0):
    """x [M, Kd], dy [M, N] (fp32, rows of very different magnitude per group), w [G, N, Kd]."""
    g = torch.Generator().manual_seed(seed)
    M, G = sum(splits), len(splits)
    mag = torch.repeat_interleave(torch.logspace(-2, 2, G), torch.tensor(splits))[:, None]
    return (torch.randn(M, Kd, generator=g) * mag, torch.randn(M, N, generator=g) * mag,
            torch.randn(G, N, Kd, generator=g), torch.tensor(splits, dtype=torch.int64))


def _blocks(x, **kw):
    from fusible_ops.kernels.fp8_cast import cast_block_ref
    return cast_block_ref(x, **kw)


def _block_weights(w):
    """Each expert's weight [G, N, K] cast in 128x128 blocks inside its group: (bytes, scale_inv [G, N/128, K/128])."""
    per_group = [_blocks(w[g], square=True) for g in range(w.shape[0])]
    return torch.stack([p[0] for p in per_group]), torch.stack([p[1] for p in per_group])

def _deq64_block(data, inv, square=False):
    s = inv.double().repeat_interleave(128, dim=-1)[..., : data.shape[-1]]
    if square:
        s = s.repeat_interleave(128, dim=-2)[..., : data.shape[-2], :]
    return data.double() * s


BLOCK_SPLITS = [[5, 0, 130, 17], [0, 0, 300, 0], [129, 1, 127, 0, 3]]


@pytest.mark.parametrize("splits", BLOCK_SPLITS)
def test_padded_layout_loses_no_row(splits):
    x = torch.arange(sum(splits), dtype=torch.float32)[:, None].expand(-1, 3).contiguous() + 1
    split = torch.tensor(splits)
    p = F.pad_groups(x, split)
    assert p.shape == (F.padded_rows(x.shape[0], len(splits)), 3) and p.shape[0] % 128 == 0
    idx = F.padded_index(split, x.shape[0])
    assert torch.equal(p[idx], x) and int((p != 0).any(1).sum()) == x.shape[0]  # every row once, zeros elsewhere
    starts = (torch.cumsum((split + 127) // 128 * 128, 0) - (split + 127) // 128 * 128)
    assert torch.equal(idx[torch.cumsum(split, 0)[split > 0] - split[split > 0]], starts[split > 0])
    assert bool((starts % 128 == 0).all())


ROWMAP_SPLITS = BLOCK_SPLITS + [[0, 0], [2], [128, 128, 0, 256], [(7 * g) % 300 for g in range(130)]]


def _check_rowmap(splits, device):
    split = torch.tensor(splits, device=device)
    M = sum(splits)
    with K.use("triton"):
        got = F.padded_rowmap(split, M)
    want = F.padded_rowmap_ref(split, M)
    assert got.dtype == torch.int32 and got.shape == want.shape and torch.equal(got, want), splits


@pytest.mark.parametrize("splits", ROWMAP_SPLITS, ids=range(len(ROWMAP_SPLITS)))
def test_interpreter_padded_rowmap(splits):
    """The one-launch padded_rowmap equals its torch twin (empty groups, 130 groups, no rows)."""
    _check_rowmap(splits, "cpu")


def test_interpreter_padded_rowmap_bad_split_sizes_stay_in_bounds():
    """Split sizes the device-side check reports never map a row outside [0, M)."""
    for bad in ([300, 5, -3], [-200, 100, 100], [1, 1, 1], [90, 90]):
        with K.use("triton"):
            got = F.padded_rowmap(torch.tensor(bad), 100)
        assert got.shape == (F.padded_rows(100, len(bad)),)
        assert int(got.min()) >= -1 and int(got.max()) < 100, bad


@pytest.mark.gpu
def test_gpu_padded_rowmap_and_graph_replay():
    for splits in ROWMAP_SPLITS + [[1000, 0, 3, 2048, 129]]:
        _check_rowmap(splits, "cuda")
    split = torch.tensor([640, 0, 0, 0, 0], device="cuda")
    F.padded_rowmap(split, 640)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = F.padded_rowmap(split, 640)
    for splits in ([0, 0, 0, 0, 640], [1, 129, 0, 300, 210], [128, 128, 128, 128, 128]):
        split.copy_(torch.tensor(splits))
        g.replay()
        assert torch.equal(got, F.padded_rowmap_ref(split, 640)), splits


def _check_cast_block_padded(x, splits, pow2=False):
    """cast_block_padded (Triton) is bit-identical to the two-pass way: the row-wise 1x128 cast of
    x, and the transposed cast of the zero-padded copy pad_groups makes."""
    from fusible_ops.kernels import fp8_cast as C

    split = torch.tensor(splits, device=x.device)
    with K.use("triton"):
        got = F.cast_block_padded(x, split, pow2)
    q, s, _, _ = C.cast_block_ref(x, False, pow2)
    _, _, qt, st = C.cast_block_ref(F.pad_groups(x, split), False, pow2, transposed=True)
    for g, w in zip(got, (q, s, qt, st)):
        assert g.shape == w.shape and g.stride() == w.stride()
        assert torch.equal(g.view(torch.uint8) if g.element_size() == 1 else g,
                           w.view(torch.uint8) if w.element_size() == 1 else w)


@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("splits", BLOCK_SPLITS + [[0, 0], [2]])
def test_interpreter_cast_block_padded(splits, xdtype):
    g = torch.Generator().manual_seed(len(splits))
    x = (torch.randn(sum(splits), 300, generator=g) * 3).to(xdtype)
    if x.shape[0]:
        x[0, 0] = 700.0
    _check_cast_block_padded(x, splits)
    _check_cast_block_padded(torch.cat([x, x], 1)[:, :256], splits, pow2=True)  # (strided rows)


@pytest.mark.gpu
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_cast_block_padded(xdtype):
    g = torch.Generator().manual_seed(0)
    for splits in BLOCK_SPLITS + [[0, 0], [1000, 0, 3, 2048, 129]]:
        x = (torch.randn(sum(splits), 384, generator=g) * 3).to("cuda", xdtype)
        _check_cast_block_padded(x, splits)
        _check_cast_block_padded(torch.cat([x, x], 1)[:, :256], splits, pow2=True)


# every split pattern once, both carriers (the interpreter runs ~12 s a case; the full product
# took 75 s of the serial suite)
@pytest.mark.parametrize("splits, carrier", [(BLOCK_SPLITS[0], torch.float32), (BLOCK_SPLITS[1], torch.float16),
                                             (BLOCK_SPLITS[2], torch.float16)])
def test_interpreter_block_scaled_mm_and_wgrad(carrier, splits, monkeypatch):
    """Block-scaled kernels (interpreter, carriers of the FP8 values) vs float64 on the same FP8
    operands; the weight gradient's 1x128 tiles never span two groups (groups of 1e-2..1e2
    magnitude side by side keep their own scales)."""
    N, Kd = 144, 136  # partial 128-blocks in both dims
    x, dy, w, split = _block_case(splits, N, Kd)
    G = len(splits)
    xq, xs, _, _ = _blocks(x, square=False)
    wq, ws = _block_weights(w)
    spy = _spy(monkeypatch)
    with K.use("triton"):
        y = F.fp8_grouped_mm((xq.to(carrier), xs), (wq.to(carrier), ws), split, torch.float32)
    gid = _gid(split)
    y64 = torch.einsum("mk,mnk->mn", _deq64_block(xq, xs), _deq64_block(wq, ws, square=True)[gid])
    assert_close_norm(y, y64, torch.float32)
    _, _, dyt, dyts = _blocks(F.pad_groups(dy, split), square=False, transposed=True)
    _, _, xt, xts = _blocks(F.pad_groups(x, split), square=False, transposed=True)
    main = torch.randn(G, N, Kd)
    before = main.clone()
    with K.use("triton"):
        F.fp8_grouped_wgrad((dyt.to(carrier), dyts), (xt.to(carrier), xts), split, out=main, accumulate=True)
    assert spy == ["mm", "wgrad"]
    rows = F.padded_index(split, x.shape[0])
    a64, b64 = _deq64_block(dyt, dyts)[:, rows], _deq64_block(xt, xts)[:, rows]
    want = torch.zeros(G, N, Kd, dtype=torch.float64).index_add_(0, gid, a64.t()[:, :, None] * b64.t()[:, None, :])
    assert_close_norm(main, before.double() + want, torch.float32)
    empty = [g for g, s in enumerate(splits) if s == 0]
    assert torch.equal(main[empty], before[empty])
    # the refs agree with the kernels on the same operands
    ref = F.fp8_grouped_wgrad_ref((dyt, dyts), (xt, xts), split)
    assert_close_norm(ref, want, torch.float32)
    # each group's tiles are its own: the small-magnitude group is quantized as finely as alone
    for g in range(G):
        if splits[g]:
            sel = rows[gid == g]
            alone = _blocks(x[gid == g].t().contiguous(), square=False)[1]  # 1x128 along its own rows
            assert torch.equal(xts[:, sel.min() // 128: sel.min() // 128 + alone.shape[1]], alone)


# ---------------------------------------------------------------- GPU
gpu = pytest.mark.gpu


def _skip_without_fp8():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from fusible_ops.kernels.fp8_gemm import fp8_capable
    if not fp8_capable(torch.device("cuda")):
        pytest.skip("needs FP8 tensor cores")


@gpu
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "ptr"])
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3)], ids=["e4m3", "e5m2xe4m3"])
@pytest.mark.parametrize("splits", [[100, 0, 333, 7, 200], [0, 640, 0, 0, 0], [1, 1, 1, 1, 636]])
def test_gpu_mm_and_wgrad(tma, dtypes, splits, monkeypatch):
    _skip_without_fp8()
    if not tma:
        monkeypatch.setattr(persistent, "TMA", False)
    M, N, K = sum(splits), 272, 384
    a, b, bias, split = _case(M, N, K, splits, *dtypes)
    d = "cuda"
    y = F.fp8_grouped_mm(_on(a, d), _on(b, d), split.to(d), torch.float32, bias=bias.to(d, torch.bfloat16))
    print("mm SQNR", assert_sqnr(y.cpu(), mm64(a, b, split, bias.to(torch.bfloat16)), KERNEL_DB, msg="mm"))
    dy_t = _fp8((N, M), dtypes[0], torch.Generator().manual_seed(3))
    x_t = (a[0].t().contiguous(), a[1])
    main = torch.randn(len(splits), N, K, device=d)
    before = main.clone()
    F.fp8_grouped_wgrad(_on(dy_t, d), _on(x_t, d), split.to(d), out=main, accumulate=True)
    print("wgrad SQNR", assert_sqnr((main - before).cpu(), wgrad64(dy_t, x_t, split), KERNEL_DB, msg="wgrad"))
    empty = [g for g, s in enumerate(splits) if s == 0]
    assert torch.equal(main[empty], before[empty])


@gpu
@pytest.mark.parametrize("cfg", F.WGRAD_KERNEL.configs if torch.cuda.is_available() else [],
                         ids=lambda c: "x".join(str(c.kwargs[k]) for k in ("BN", "BK", "BR"))
                         + f"w{c.num_warps}s{c.num_stages}pps{c.kwargs.get('PPS', 0)}"
                         + ("tma_out" if c.kwargs.get("TMA_STORE") else ""))
def test_gpu_every_wgrad_config(cfg, monkeypatch):
    """Each per-tensor weight-gradient config of the autotuning list, fixed (one tile per program
    or persistent; pointer or TMA-store epilogue), on split sizes with unaligned group starts,
    partial chunks and an empty group: a new bf16 output (the TMA store where the config asks for
    it) and an fp32 main_grad accumulated, against float64 by SQNR."""
    _skip_without_fp8()
    monkeypatch.setattr(F.WGRAD_KERNEL, "fixed", (cfg, cfg))
    splits = [100, 0, 333, 7, 200, 256]
    M, N, K = sum(splits), 272, 384
    a, _, _, split = _case(M, N, K, splits)
    dy_t = _fp8((N, M), E4M3, torch.Generator().manual_seed(3))
    x_t = (a[0].t().contiguous(), a[1])
    d = "cuda"
    want = wgrad64(dy_t, x_t, split)
    dw = F.fp8_grouped_wgrad(_on(dy_t, d), _on(x_t, d), split.to(d), out_dtype=torch.bfloat16)
    assert dw.dtype == torch.bfloat16 and not dw[1].any()
    assert_sqnr(dw.float().cpu(), want, KERNEL_DB, msg="new bf16")
    main = torch.randn(len(splits), N, K, device=d)
    before = main.clone()
    F.fp8_grouped_wgrad(_on(dy_t, d), _on(x_t, d), split.to(d), out=main, accumulate=True)
    assert_sqnr((main - before).cpu(), want, KERNEL_DB, msg="accumulate")
    assert torch.equal(main[1], before[1])


@gpu
def test_gpu_graph_replay_with_changed_splits():
    _skip_without_fp8()
    d = "cuda"
    M, N, K = 512, 256, 256
    a, b, _, split = _case(M, N, K, [128, 256, 0, 128])
    a_d, b_d, s_d = _on(a, d), _on(b, d), split.to(d)
    F.fp8_grouped_mm(a_d, b_d, s_d, torch.float32)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = F.fp8_grouped_mm(a_d, b_d, s_d, torch.float32)
    for splits in ([500, 0, 12, 0], [0, 0, 0, 512], [3, 300, 200, 9]):
        s_d.copy_(torch.tensor(splits))
        g.replay()
        torch.cuda.synchronize()
        assert_sqnr(y.cpu(), mm64(a, b, torch.tensor(splits)), KERNEL_DB, msg=str(splits))


# ---------------------------------------------------------------- the GLU epilogues on FP8 operands
def _glu64(h, kind):
    a, b = h.chunk(2, dim=-1)
    act = torch.nn.functional.silu(a) if kind == "swiglu" else torch.nn.functional.gelu(a)
    return act * b


@pytest.mark.parametrize("kind", ["swiglu", "geglu"])
@pytest.mark.parametrize("splits", SPLITS[:2])
def test_interpreter_glu_fwd_and_dglu_fp8(kind, splits, monkeypatch):
    """FC1 + GLU and FC2's input gradient + dGLU on FP8 values (fp32 carriers, interpreter) vs
    float64 math; the amax each takes in its pass equals max|output|."""
    from fusible_ops.kernels import grouped_glu as GL

    M, Hd, Fd = sum(splits), 32, 24
    g = torch.Generator().manual_seed(4)
    x = _fp8((M, Hd), E4M3, g)
    w1 = _fp8((len(splits), 2 * Fd, Hd), E4M3, g, scale=Hd ** -0.5)
    split = torch.tensor(splits)
    amax = torch.zeros(1)
    with K.use("triton"):
        y, h = GL.grouped_glu_fwd_fp8(_on(x, "cpu", torch.float32), _on(w1, "cpu", torch.float32), split, None, kind,
                                      None, torch.float32, amax)
    h64 = mm64(x, w1, split)
    assert_close_norm(h, h64, torch.float32)
    assert_close_norm(y, _glu64(h.double(), kind), torch.float32)
    assert amax.item() == y.abs().max().item()
    dy = _fp8((M, Hd), E5M2, g)
    w2t = _fp8((len(splits), Fd, Hd), E4M3, g, scale=Fd ** -0.5)  # FC2's weight [G, H, F], transposed per group
    amax2 = torch.zeros(1)
    with K.use("triton"):
        dh, _ = GL.grouped_dglu_fp8(_on(dy, "cpu", torch.float32), _on(w2t, "cpu", torch.float32), split, h, kind,
                                    None, False, amax2)
    hr = h.double().requires_grad_()
    gr = mm64(dy, w2t, split)  # dy_g @ w2[g] = dy_g @ w2t[g].T
    (dh64,) = torch.autograd.grad(_glu64(hr, kind), hr, gr)
    assert_close_norm(dh, dh64, torch.float32)
    assert amax2.item() == dh.abs().max().item()


@gpu
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "ptr"])
@pytest.mark.parametrize("splits", [[100, 0, 333, 7, 200], [0, 640, 0, 0, 0], [1, 1, 1, 1, 636]])
def test_gpu_block_scaled_mm_and_wgrad(tma, splits, monkeypatch):
    """Block-scaled kernels on real e4m3 against float64 on the same FP8 operands."""
    _skip_without_fp8()
    if not tma:
        monkeypatch.setattr(persistent, "TMA", False)
    N, Kd = 256, 384
    x, dy, w, split = _block_case(splits, N, Kd, seed=1)
    G = len(splits)
    xq, xs, _, _ = _blocks(x, square=False)
    wq, ws = _block_weights(w)
    wt = (wq.view(torch.uint8).transpose(1, 2).contiguous().view(wq.dtype), ws.transpose(1, 2).contiguous())
    dyq, dys, _, _ = _blocks(dy, square=False)
    _, _, dyt, dyts = _blocks(F.pad_groups(dy, split), square=False, transposed=True)
    _, _, xt, xts = _blocks(F.pad_groups(x, split), square=False, transposed=True)
    c = [t.cuda() for t in (xq, xs, wq, ws, dyq, dys, *wt, dyt, dyts, xt, xts, split)]
    xq_, xs_, wq_, ws_, dyq_, dys_, wt_, wts_, dyt_, dyts_, xt_, xts_, s_ = c
    gid = _gid(split)
    y = F.fp8_grouped_mm((xq_, xs_), (wq_, ws_), s_, torch.float32)
    y64 = torch.einsum("mk,mnk->mn", _deq64_block(xq, xs), _deq64_block(wq, ws, square=True)[gid])
    assert_sqnr(y.cpu(), y64, KERNEL_DB, msg="forward")
    dx = F.fp8_grouped_mm((dyq_, dys_), (wt_, wts_), s_, torch.float32)
    dx64 = torch.einsum("mn,mnk->mk", _deq64_block(dyq, dys), _deq64_block(wq, ws, square=True)[gid])
    assert_sqnr(dx.cpu(), dx64, KERNEL_DB, msg="dgrad")
    main = torch.randn(G, N, Kd, device="cuda")
    before = main.clone()
    F.fp8_grouped_wgrad((dyt_, dyts_), (xt_, xts_), s_, out=main, accumulate=True)
    rows = F.padded_index(split, x.shape[0])
    a64, b64 = _deq64_block(dyt, dyts)[:, rows], _deq64_block(xt, xts)[:, rows]
    want = torch.zeros(G, N, Kd, dtype=torch.float64).index_add_(0, gid, a64.t()[:, :, None] * b64.t()[:, None, :])
    live = [g for g, m in enumerate(splits) if m]
    assert_sqnr((main - before).cpu()[live], want[live], KERNEL_DB, msg="wgrad")
    empty = [g for g, m in enumerate(splits) if m == 0]
    assert torch.equal(main[empty], before[empty])



@gpu
def test_gpu_block_scaled_graph_replay_with_changed_splits():
    """The block-scaled forward captured once and replayed with other split sizes of the same
    total (empty experts, one expert taking every row) against float64: 1x128 tiles run along K,
    so the cast operands serve every split."""
    _skip_without_fp8()
    N, Kd = 256, 384
    x, _, w, split = _block_case([100, 0, 333, 7, 200], N, Kd, seed=2)
    xq, xs, _, _ = _blocks(x, square=False)
    wq, ws = _block_weights(w)
    a_d, b_d, s_d = (xq.cuda(), xs.cuda()), (wq.cuda(), ws.cuda()), split.cuda()
    F.fp8_grouped_mm(a_d, b_d, s_d, torch.float32)  # compile and tune outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = F.fp8_grouped_mm(a_d, b_d, s_d, torch.float32)
    for splits in ([640, 0, 0, 0, 0], [0, 0, 0, 0, 640], [1, 129, 0, 300, 210]):
        s_d.copy_(torch.tensor(splits))
        g.replay()
        torch.cuda.synchronize()
        gid = _gid(torch.tensor(splits))
        y64 = torch.einsum("mk,mnk->mn", _deq64_block(xq, xs), _deq64_block(wq, ws, square=True)[gid])
        assert_sqnr(y.cpu(), y64, KERNEL_DB, msg=str(splits))

def test_padded_index_stays_inside_the_layout_for_bad_split_sizes():
    """Bad split sizes (flagged by the device-side check) must not make pad_groups write out of
    bounds: the indices are clamped into the layout."""
    for bad in ([300, 5, -3], [-200, 100, 100], [1, 1, 1]):
        idx = F.padded_index(torch.tensor(bad), 100)
        assert int(idx.min()) >= 0 and int(idx.max()) < F.padded_rows(100, 3)
        assert F.pad_groups(torch.ones(100, 4), torch.tensor(bad)).shape == (F.padded_rows(100, 3), 4)
