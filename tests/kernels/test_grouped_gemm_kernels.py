"""Grouped GEMM kernels (fusible_ops.kernels.grouped_gemm): Triton vs ref vs float64 math.

CPU: the Triton path runs under the interpreter on tiny shapes (fp32/fp16 for dots: the 3.9
interpreter's bf16 dot is wrong). GPU (marked ``gpu``): larger odd sizes in bf16/fp16/fp32, the
TMA and pointer paths, CUDA-graph capture/replay with changed split sizes, torch.compile.
"""

import pytest
import torch

import fusible_ops.kernels as K
from fusible_ops.kernels import grouped_gemm as gg
from fusible_ops.kernels import launch, persistent
from fusible_ops.testing import assert_close, assert_close_norm

CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _fixed_configs(monkeypatch):
    """No autotuning in tests (one compile per variant); test_gpu_autotuned* opt back in."""
    monkeypatch.setattr(launch, "AUTOTUNE", False)
DEV = "cuda" if CUDA else "cpu"
LOW = [torch.float32, torch.float16]  # dot dtypes the interpreter computes right


def _gid(split: torch.Tensor) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(split.numel()), split.cpu())


# ---------------------------------------------------------------- independent float64 math
def fwd64(x, w, split, bias=None):
    gid = _gid(split)
    y = torch.einsum("mk,mnk->mn", x.double().cpu(), w.double().cpu()[gid])
    return y if bias is None else y + bias.double().cpu()[gid]


def dgrad64(dy, w, split):
    return torch.einsum("mn,mnk->mk", dy.double().cpu(), w.double().cpu()[_gid(split)])


def wgrad64(dy, x, split):
    G = split.numel()
    outer = dy.double().cpu()[:, :, None] * x.double().cpu()[:, None, :]
    return torch.zeros(G, dy.shape[1], x.shape[1], dtype=torch.float64).index_add_(0, _gid(split), outer)


def bgrad64(dy, split):
    return torch.zeros(split.numel(), dy.shape[1], dtype=torch.float64).index_add_(0, _gid(split), dy.double().cpu())


def _data(M, N, Kd, splits, dtype, device=DEV, seed=0):
    g = torch.Generator().manual_seed(seed)
    split = torch.tensor(splits, dtype=torch.int64)
    assert int(split.sum()) == M
    x = torch.randn(M, Kd, generator=g).to(device, dtype)
    w = (torch.randn(len(splits), N, Kd, generator=g) / Kd ** 0.5).to(device, dtype)
    b = torch.randn(len(splits), N, generator=g).to(device, dtype)
    dy = torch.randn(M, N, generator=g).to(device, dtype)
    return x, w, b, dy, split.to(device)


SMALL = [(70, 33, 40, [20, 0, 37, 13]), (7, 5, 3, [3, 4]), (1, 1, 1, [1])]


# ---------------------------------------------------------------- refs vs float64 (CPU)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_refs_match_float64(dtype):
    x, w, b, dy, split = _data(70, 33, 40, [20, 0, 37, 13], dtype, "cpu")
    assert_close_norm(gg.grouped_gemm_fwd_ref(x, w, split, b), fwd64(x, w, split, b), dtype)
    assert_close_norm(gg.grouped_gemm_dgrad_ref(dy, w, split), dgrad64(dy, w, split), dtype)
    assert_close_norm(gg.grouped_gemm_wgrad_ref(dy, x, split), wgrad64(dy, x, split), dtype)
    assert_close_norm(gg.grouped_bias_grad_ref(dy, split), bgrad64(dy, split), dtype)


# ---------------------------------------------------------------- Triton under the interpreter / on GPU
@pytest.mark.parametrize("M,N,Kd,splits", SMALL)
@pytest.mark.parametrize("dtype", LOW)
def test_fwd_dgrad_wgrad(M, N, Kd, splits, dtype):
    x, w, b, dy, split = _data(M, N, Kd, splits, dtype)
    with K.use("triton"):
        y = gg.grouped_gemm_fwd(x, w, split, b)
        y0 = gg.grouped_gemm_fwd(x, w, split)
        dx = gg.grouped_gemm_dgrad(dy, w, split)
        dw = gg.grouped_gemm_wgrad(dy, x, split)
    assert y.dtype == dtype and dw.shape == w.shape and dw.dtype == dtype
    assert_close_norm(y, fwd64(x, w, split, b), dtype, msg="fwd+bias")
    assert_close_norm(y0, fwd64(x, w, split), dtype, msg="fwd")
    assert_close_norm(dx, dgrad64(dy, w, split), dtype, msg="dgrad")
    assert_close_norm(dw, wgrad64(dy, x, split), dtype, msg="wgrad")
    assert_close_norm(gg.grouped_gemm_fwd_ref(x, w, split, b), fwd64(x, w, split, b), dtype, msg="ref")


def test_wgrad_out_accumulate_and_empty_groups():
    dtype = torch.float16
    x, w, b, dy, split = _data(70, 33, 40, [20, 0, 37, 13], dtype)
    init = torch.randn(w.shape, generator=torch.Generator().manual_seed(3)).to(DEV)
    truth = wgrad64(dy, x, split)
    with K.use("triton"):
        out = init.clone()
        r = gg.grouped_gemm_wgrad(dy, x, split, out=out, accumulate=True)
        assert r is out
        assert torch.equal(out[1], init[1]), "empty group must stay untouched when accumulating"
        assert_close_norm(out, truth + init.double().cpu(), torch.float32, msg="accumulate fp32")
        out2 = torch.full(w.shape, float("nan"), device=DEV)
        gg.grouped_gemm_wgrad(dy, x, split, out=out2, accumulate=False)
        assert torch.equal(out2[1], torch.zeros_like(out2[1])), "empty group must be exactly zero"
        assert_close_norm(out2, truth, torch.float32, msg="overwrite fp32")
        out3 = init.to(dtype)
        gg.grouped_gemm_wgrad(dy, x, split, out=out3, accumulate=True)
        assert_close_norm(out3, truth + init.to(dtype).double().cpu(), dtype, msg="accumulate fp16")
    ref = gg.grouped_gemm_wgrad_ref(dy, x, split, out=init.clone(), accumulate=True)
    assert_close_norm(ref, truth + init.double().cpu(), torch.float32, msg="ref accumulate")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_bias_grad(dtype):
    x, w, b, dy, split = _data(70, 33, 40, [20, 0, 37, 13], dtype)
    with K.use("triton"):
        db = gg.grouped_bias_grad(dy, split)
    assert db.dtype == dtype and db.shape == (4, 33)
    assert_close_norm(db, bgrad64(dy, split), dtype)
    assert torch.equal(db[1].float().cpu(), torch.zeros(33))


def test_noncontiguous_inputs():
    dtype = torch.float16
    x, w, b, dy, split = _data(70, 33, 40, [20, 0, 37, 13], dtype)
    xs = torch.cat([x, x], dim=1)[:, ::2]  # stride (80, 2)
    wt = w.transpose(1, 2).contiguous().transpose(1, 2)  # [G, N, K] with K-stride N
    dyt = dy.t().contiguous().t()  # column-major
    bs = torch.cat([b, b], dim=1)[:, 1::2]
    with K.use("triton"):
        y = gg.grouped_gemm_fwd(xs, wt, split, bs)
        dx = gg.grouped_gemm_dgrad(dyt, wt, split)
        dw = gg.grouped_gemm_wgrad(dyt, xs, split)
        db = gg.grouped_bias_grad(dyt, split)
    assert not (xs.is_contiguous() or wt.is_contiguous() or dyt.is_contiguous() or bs.is_contiguous())
    assert_close_norm(y, fwd64(xs, wt, split, bs), dtype)
    assert_close_norm(dx, dgrad64(dyt, wt, split), dtype)
    assert_close_norm(dw, wgrad64(dyt, xs, split), dtype)
    assert_close_norm(db, bgrad64(dyt, split), dtype)


def test_zero_rows_and_all_in_one_group():
    dtype = torch.float32
    x, w, b, dy, split = _data(0, 5, 7, [0, 0, 0], dtype)
    with K.use("triton"):
        assert gg.grouped_gemm_fwd(x, w, split, b).shape == (0, 5)
        assert gg.grouped_gemm_dgrad(dy, w, split).shape == (0, 7)
        dw = gg.grouped_gemm_wgrad(dy, x, split)
        assert torch.equal(dw.cpu(), torch.zeros(3, 5, 7))
        assert torch.equal(gg.grouped_bias_grad(dy, split).cpu(), torch.zeros(3, 5))
    x, w, b, dy, split = _data(21, 18, 17, [0, 21, 0], dtype)
    with K.use("triton"):
        assert_close_norm(gg.grouped_gemm_fwd(x, w, split, b), fwd64(x, w, split, b), dtype)
        assert_close_norm(gg.grouped_gemm_wgrad(dy, x, split), wgrad64(dy, x, split), dtype)


def test_rows_past_the_groups_are_neither_read_nor_written():
    """Split sizes summing to fewer than M rows (the expert-parallel padded exchange's buffers):
    the groups' rows are exactly those of the same call on the first sum(splits) rows, the rows
    past them do not enter the weight or bias gradients (they hold NaN here), and the outputs'
    rows past them keep what the kernels found there (not asserted: fresh memory)."""
    dtype = torch.float32
    x, w, b, dy, split = _data(23, 18, 17, [5, 0, 9, 9], dtype)
    pad = torch.full((6, 17), float("nan"), device=x.device, dtype=dtype)
    xp, dyp = torch.cat([x, pad]), torch.cat([dy, torch.full((6, 18), float("nan"), device=x.device, dtype=dtype)])
    with K.use("triton"):
        assert torch.equal(gg.grouped_gemm_fwd(xp, w, split, b)[:23], gg.grouped_gemm_fwd(x, w, split, b))
        assert torch.equal(gg.grouped_gemm_dgrad(dyp, w, split)[:23], gg.grouped_gemm_dgrad(dy, w, split))
        assert torch.equal(gg.grouped_gemm_wgrad(dyp, xp, split), gg.grouped_gemm_wgrad(dy, x, split))
        assert torch.equal(gg.grouped_bias_grad(dyp, split), gg.grouped_bias_grad(dy, split))
    refs = (gg.grouped_gemm_fwd_ref(xp, w, split, b), gg.grouped_gemm_wgrad_ref(dyp, xp, split))
    assert torch.equal(refs[0][23:], torch.zeros(6, 18, device=x.device)) and not refs[1].isnan().any()


def test_tma_path_logic_under_interpreter(monkeypatch):
    """The TMA (tensor-descriptor) code path, run by the interpreter: same results."""
    if CUDA:
        pytest.skip("covered by the GPU tests")
    monkeypatch.setattr(gg, "tma_ok", lambda *t: True)
    dtype = torch.float16
    x, w, b, dy, split = _data(70, 32, 48, [20, 0, 37, 13], dtype)
    with K.use("triton"):
        assert_close_norm(gg.grouped_gemm_fwd(x, w, split, b), fwd64(x, w, split, b), dtype)
        assert_close_norm(gg.grouped_gemm_dgrad(dy, w, split), dgrad64(dy, w, split), dtype)
        assert_close_norm(gg.grouped_gemm_wgrad(dy, x, split), wgrad64(dy, x, split), dtype)


def _gather_case(T, R, N, Kd, splits, dtype, device=DEV, seed=3):
    """Tokens x [T, Kd] and a gather index [R] (tokens repeated, in any order) for grouped_gemm_fwd."""
    x, w, b, _, split = _data(R, N, Kd, splits, dtype, device, seed)
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randn(T, Kd, generator=g).to(device, dtype)
    idx = torch.randint(0, T, (R,), generator=g).to(device)
    return tokens, idx, w, b, split


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma_b"])
@pytest.mark.parametrize("T,R,N,Kd,splits", [(9, 70, 33, 40, [20, 0, 37, 13]), (3, 7, 5, 3, [3, 4]), (1, 1, 1, 1, [1])])
@pytest.mark.parametrize("dtype", LOW)
def test_fwd_gather(T, R, N, Kd, splits, dtype, tma, monkeypatch):
    """grouped_gemm_fwd(x, ..., gather=idx) == grouped_gemm_fwd(x[idx], ...): row r reads token
    idx[r] in the kernel (pointer loads; with TMA on, B still through descriptors)."""
    if tma:
        if CUDA or Kd % 8:
            pytest.skip("covered by the GPU tests" if CUDA else "TMA needs 16-byte rows")
        monkeypatch.setattr(gg, "tma_ok", lambda *t: True)
    tokens, idx, w, b, split = _gather_case(T, R, N, Kd, splits, dtype)
    with K.use("triton"):
        y = gg.grouped_gemm_fwd(tokens, w, split, b, gather=idx)
        y0 = gg.grouped_gemm_fwd(tokens, w, split, gather=idx)
    assert y.shape == (R, N) and y.dtype == dtype
    assert_close_norm(y, fwd64(tokens[idx], w, split, b), dtype, msg="gather+bias")
    assert_close_norm(y0, fwd64(tokens[idx], w, split), dtype, msg="gather")
    assert_close_norm(gg.grouped_gemm_fwd(tokens, w, split, b, gather=idx.cpu() if DEV == "cpu" else idx),
                      fwd64(tokens[idx], w, split, b), dtype, msg="ref")


def test_fwd_gather_rejects_a_bad_index():
    tokens, idx, w, b, split = _gather_case(3, 7, 5, 3, [3, 4], torch.float32)
    with pytest.raises(TypeError, match="gather"):
        gg.grouped_gemm_fwd(tokens, w, split, gather=idx.to(torch.int32))


def test_bad_split_sizes_rejected():
    x, w, b, dy, split = _data(7, 5, 3, [3, 4], torch.float32)
    with pytest.raises(ValueError):
        gg.grouped_gemm_fwd(x, w, split[:1])
    with pytest.raises(TypeError):
        gg.grouped_gemm_fwd(x, w, split.to(torch.int32))


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, w = torch.empty(9, 8), torch.empty(3, 5, 8)
        split, dy = torch.empty(3, dtype=torch.int64), torch.empty(9, 5)
        assert torch.ops.fusible_ops.grouped_gemm_fwd(x, w, split, None).shape == (9, 5)
        assert torch.ops.fusible_ops.grouped_gemm_fwd_gather(x[:4], w, split, None,
                                                             torch.empty(9, dtype=torch.int64)).shape == (9, 5)
        assert torch.ops.fusible_ops.grouped_gemm_dgrad(dy, w, split).shape == (9, 8)
        assert torch.ops.fusible_ops.grouped_gemm_wgrad(dy, x, split).shape == (3, 5, 8)
        assert torch.ops.fusible_ops.grouped_bias_grad(dy, split).shape == (3, 5)


# ---------------------------------------------------------------- GPU


GPU_SHAPES = [(1000, 200, 136, [300, 0, 411, 1, 288]),  # TMA-eligible for 16-bit
              (777, 97, 100, [0, 777, 0]),  # pointer path (unaligned rows)
              (513, 130, 72, [129, 128, 0, 256])]


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,Kd,splits", GPU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_all_ops(M, N, Kd, splits, dtype):
    x, w, b, dy, split = _data(M, N, Kd, splits, dtype, "cuda")
    y = gg.grouped_gemm_fwd(x, w, split, b)
    dx = gg.grouped_gemm_dgrad(dy, w, split)
    dw = gg.grouped_gemm_wgrad(dy, x, split)
    acc = torch.randn(w.shape, device="cuda")
    acc0 = acc.clone()
    gg.grouped_gemm_wgrad(dy, x, split, out=acc, accumulate=True)
    db = gg.grouped_bias_grad(dy, split)
    assert_close_norm(y, fwd64(x, w, split, b), dtype, msg="fwd")
    assert_close_norm(dx, dgrad64(dy, w, split), dtype, msg="dgrad")
    assert_close_norm(dw, wgrad64(dy, x, split), dtype, msg="wgrad")
    assert_close_norm(acc, wgrad64(dy, x, split) + acc0.double().cpu(), dtype, msg="wgrad accumulate")
    assert_close_norm(db, bgrad64(dy, split), dtype, msg="bias grad")
    for g, m in enumerate(splits):
        if m == 0:
            assert torch.equal(acc[g], acc0[g]) and not dw[g].any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_fwd_gather_and_graph_replay(dtype):
    """The gathered forward at the GPU shapes (TMA-eligible and not), then captured and replayed with
    other split sizes and another index."""
    for M, N, Kd, splits in GPU_SHAPES:
        tokens, idx, w, b, split = _gather_case(M // 3 + 1, M, N, Kd, splits, dtype, "cuda")
        assert_close_norm(gg.grouped_gemm_fwd(tokens, w, split, b, gather=idx), fwd64(tokens[idx], w, split, b),
                          dtype, msg=str(splits))
    tokens, idx, w, b, split = _gather_case(300, 1000, 200, 136, [300, 0, 411, 1, 288], dtype, "cuda")
    gg.grouped_gemm_fwd(tokens, w, split, b, gather=idx)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gg.grouped_gemm_fwd(tokens, w, split, b, gather=idx)
    for seed, splits in ((5, [0, 1000, 0, 0, 0]), (6, [1, 129, 0, 300, 570])):
        split.copy_(torch.tensor(splits))
        idx.copy_(torch.randint(0, 300, (1000,), generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        assert_close_norm(y, fwd64(tokens[idx], w, split, b), dtype, msg=str(splits))


def _wg_id(cfg) -> str:
    m = cfg.kwargs
    return (f"{m['BN']}x{m['BK']}x{m['BR']}w{cfg.num_warps}s{cfg.num_stages}pps{m.get('PPS', 0)}"
            + ("tma_out" if m.get("TMA_STORE") else ""))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", gg.WGRAD_KERNEL.configs if CUDA else [], ids=_wg_id)
def test_gpu_every_wgrad_config(cfg, monkeypatch):
    """Each weight-gradient config of the autotuning list, fixed (one tile per program or
    persistent; pointer or TMA-store epilogue), on split sizes whose groups end mid-chunk, with an
    empty group: a new bf16 output (the TMA store where the config asks for it), a bf16 output
    overwritten and an fp32 main_grad accumulated (pointer epilogues), against float64."""
    monkeypatch.setattr(gg.WGRAD_KERNEL, "fixed", (cfg, cfg))
    splits = [300, 0, 411, 1, 288, 64]
    x, w, b, dy, split = _data(sum(splits), 200, 136, splits, torch.bfloat16, "cuda")
    want = wgrad64(dy, x, split)
    dw = gg.grouped_gemm_wgrad(dy, x, split)
    assert_close_norm(dw, want, torch.bfloat16, msg="new")
    assert not dw[1].any()
    out = torch.full_like(dw, float("nan"))
    gg.grouped_gemm_wgrad(dy, x, split, out=out)
    assert torch.equal(out, dw)
    main = torch.randn(dw.shape, device="cuda")
    before = main.clone()
    gg.grouped_gemm_wgrad(dy, x, split, out=main, accumulate=True)
    assert_close_norm(main, want + before.double().cpu(), torch.float32, msg="accumulate")
    assert torch.equal(main[1], before[1])


@pytest.mark.gpu
def test_gpu_many_groups():
    """G = 130 (group table of 256 lanes), skewed sizes with many empty groups."""
    g = torch.Generator().manual_seed(5)
    sizes = (torch.rand(130, generator=g) ** 4 * 40).long() * (torch.rand(130, generator=g) > 0.4)
    x, w, b, dy, split = _data(int(sizes.sum()), 72, 64, sizes.tolist(), torch.bfloat16, "cuda")
    assert_close_norm(gg.grouped_gemm_fwd(x, w, split, b), fwd64(x, w, split, b), torch.bfloat16)
    assert_close_norm(gg.grouped_gemm_dgrad(dy, w, split), dgrad64(dy, w, split), torch.bfloat16)
    assert_close_norm(gg.grouped_gemm_wgrad(dy, x, split), wgrad64(dy, x, split), torch.bfloat16)
    assert_close_norm(gg.grouped_bias_grad(dy, split), bgrad64(dy, split), torch.bfloat16)


@pytest.mark.gpu
def test_gpu_pointer_path_matches(monkeypatch):
    monkeypatch.setattr(persistent, "TMA", False)
    x, w, b, dy, split = _data(1000, 200, 136, [300, 0, 411, 1, 288], torch.bfloat16, "cuda")
    assert_close_norm(gg.grouped_gemm_fwd(x, w, split, b), fwd64(x, w, split, b), torch.bfloat16)
    assert_close_norm(gg.grouped_gemm_dgrad(dy, w, split), dgrad64(dy, w, split), torch.bfloat16)
    assert_close_norm(gg.grouped_gemm_wgrad(dy, x, split), wgrad64(dy, x, split), torch.bfloat16)


@pytest.mark.gpu
def test_gpu_autotuned_large(monkeypatch):
    """Autotuned configs (one shape): fwd/dgrad/wgrad vs float64 math."""
    monkeypatch.setattr(launch, "AUTOTUNE", True)
    x, w, b, dy, split = _data(4096, 512, 768, [1000, 0, 2000, 1096], torch.bfloat16, "cuda")
    assert_close_norm(gg.grouped_gemm_fwd(x, w, split), fwd64(x, w, split), torch.bfloat16)
    assert_close_norm(gg.grouped_gemm_dgrad(dy, w, split), dgrad64(dy, w, split), torch.bfloat16)
    assert_close_norm(gg.grouped_gemm_wgrad(dy, x, split), wgrad64(dy, x, split), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_cuda_graph_replay_with_new_splits(dtype):
    M, N, Kd = 600, 96, 136
    x, w, b, dy, split = _data(M, N, Kd, [200, 100, 0, 300], dtype, "cuda")
    static_split = split.clone()

    def step():
        y = gg.grouped_gemm_fwd(x, w, static_split, b)
        dx = gg.grouped_gemm_dgrad(dy, w, static_split)
        dw = gg.grouped_gemm_wgrad(dy, x, static_split)
        db = gg.grouped_bias_grad(dy, static_split)
        return y, dx, dw, db

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up: compiles (and would autotune) outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for new in ([0, 0, 600, 0], [1, 299, 250, 50], [200, 100, 0, 300]):
        static_split.copy_(torch.tensor(new))
        graph.replay()
        torch.cuda.synchronize()
        sp = torch.tensor(new)
        assert_close_norm(outs[0], fwd64(x, w, sp, b), dtype, msg=f"fwd {new}")
        assert_close_norm(outs[1], dgrad64(dy, w, sp), dtype, msg=f"dgrad {new}")
        assert_close_norm(outs[2], wgrad64(dy, x, sp), dtype, msg=f"wgrad {new}")
        assert_close_norm(outs[3], bgrad64(dy, sp), dtype, msg=f"bias grad {new}")


@pytest.mark.gpu
def test_gpu_tma_scratch_one_buffer_on_default_stream_fresh_on_side_streams():
    """Launches with device-made TMA descriptors share one scratch buffer per device on the
    default stream (grown when a launch needs more); launches on a side stream take their own.
    Queued back to back with different grids on both streams, every result is exact."""
    assert torch.cuda.current_stream().cuda_stream == 0  # the default stream's raw handle
    cases = [(1000, [300, 0, 411, 1, 288]), (64, [64, 0, 0, 0, 0]), (4096, [1000, 96, 0, 3000, 0])]
    data = [_data(M, 200, 136, splits, torch.bfloat16, "cuda", seed=i) for i, (M, splits) in enumerate(cases)]
    for x, w, b, dy, split in data:  # first launches (compilation) go through Triton's own path
        gg.grouped_gemm_fwd(x, w, split, b), gg.grouped_gemm_dgrad(dy, w, split), gg.grouped_gemm_wgrad(dy, x, split)
    torch.cuda.synchronize()
    launch._SCRATCH.clear()
    outs = [gg.grouped_gemm_fwd(x, w, split, b) for x, w, b, _, split in data]  # no sync in between
    dev = torch.cuda.current_device()
    assert dev in launch._SCRATCH, "the TMA path ran without the default-stream scratch buffer"
    buf = launch._SCRATCH[dev]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        side_outs = [gg.grouped_gemm_wgrad(dy, x, split) for x, _, _, dy, split in data]
    assert launch._SCRATCH[dev] is buf  # side-stream launches leave it alone
    outs += [gg.grouped_gemm_dgrad(dy, w, split) for _, w, _, dy, split in data]
    torch.cuda.synchronize()
    for i, (x, w, b, dy, split) in enumerate(data):
        assert_close_norm(outs[i], fwd64(x, w, split, b), torch.bfloat16, msg=f"fwd {i}")
        assert_close_norm(outs[3 + i], dgrad64(dy, w, split), torch.bfloat16, msg=f"dgrad {i}")
        assert_close_norm(side_outs[i], wgrad64(dy, x, split), torch.bfloat16, msg=f"wgrad (side stream) {i}")


@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph():
    x, w, b, dy, split = _data(300, 64, 72, [100, 0, 200], torch.bfloat16, "cuda")
    ops = torch.ops.fusible_ops

    def f(x, w, b, dy, split):
        y = ops.grouped_gemm_fwd(x, w, split, b)
        return y, ops.grouped_gemm_dgrad(dy, w, split), ops.grouped_gemm_wgrad(dy, x, split), \
            ops.grouped_bias_grad(dy, split)

    cf = torch.compile(f, fullgraph=True)
    got, want = cf(x, w, b, dy, split), f(x, w, b, dy, split)
    for a, e in zip(got, want):
        assert_close(a.float(), e.float(), torch.float32)


@pytest.mark.parametrize("sizes,rows,ok", [([3, 4], 7, True), ([3, -1, 5], 7, False), ([3, 4], 8, False),
                                           ([0, 0, 0], 0, True), ([5], 5, True), ([2**33, -(2**33) + 4], 4, False)])
def test_splits_ok_kernel(sizes, rows, ok):
    """The one-launch device check of split sizes (interpreter on CPU, compiled on GPU)."""
    from fusible_ops.kernels.persistent import splits_ok

    dev = "cuda" if CUDA else "cpu"
    with K.use("triton"):
        got = splits_ok(torch.tensor(sizes, dtype=torch.int64, device=dev), rows)
    assert got.dtype == torch.bool and got.dim() == 0 and bool(got) is ok


_SYNC_REPORT = """
torch.cuda.synchronize()
print("GOOD", flush=True)
try:
    {bad_call}
    torch.cuda.synchronize()
    print("NO ERROR", flush=True)
except Exception as e:
    print("ERROR", str(e).splitlines()[0], flush=True)
"""


def _assert_in_child(setup: str, good_call: str, bad_call: str) -> None:
    """Run ``setup``, ``good_call`` (must not assert) and ``bad_call`` in a child process (a
    device-side assert ends the CUDA context); the bad call must fail as a device-side assert: at
    the next sync, or at the call itself when it is the geometry's second call, which the C++
    replay records first (the recording runs the call's kernels once, so the assert has fired by
    the time the call's own launches are issued)."""
    import subprocess
    import sys

    code = f"import torch\nimport fusible_ops as fo\n{setup}\n{good_call}\n" + _SYNC_REPORT.format(bad_call=bad_call)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert "GOOD" in out, proc.stderr[-2000:]
    assert "ERROR" in out and "NO ERROR" not in out, out + proc.stderr[-2000:]
    assert "device-side assert" in out


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="CUDA")
@pytest.mark.parametrize("bad", [[4, -1, 9], [4, 4, 5]])
def test_gpu_bad_cuda_split_sizes_fail_by_device_assert(bad):
    """Default ("assert") device checks: CUDA split sizes are checked by ONE kernel that asserts
    on the device (no bool output, no ``_assert_async``); a bad size (negative, or a sum that is
    not the rows) fails at the next sync as a device-side assert."""
    _assert_in_child('op = fo.GroupedLinear(3, 16, 16, device="cuda", dtype=torch.bfloat16)\n'
                     'x = torch.randn(12, 16, device="cuda", dtype=torch.bfloat16)',
                     'op(x, torch.tensor([4, 0, 8], device="cuda"))',  # good sizes
                     f'op(x, torch.tensor({bad}, device="cuda"))')


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="CUDA")
def test_gpu_fused_mlp_fc2_splits_checked_by_one_equal_assert():
    """A fused grouped MLP given FC2 split sizes in a tensor of their own: one kernel
    (``splits_equal_assert``) asserts on the device that they equal FC1's; different values
    (here valid ones) fail at the next sync as a device-side assert."""
    _assert_in_child('hints_off = fo.fusion_rules.disabled("cost hints")  # (the fused MLP whatever its hint;\n'
                     'hints_off.__enter__()  # held by a name: an unreferenced generator would exit at once)\n'
                     'kw = dict(device="cuda", dtype=torch.bfloat16)\n'
                     'seq = fo.Sequential(fo.GroupedLinear(3, 16, 32, bias=False, **kw), fo.SwiGLU(), '
                     'fo.GroupedLinear(3, 16, 16, bias=False, **kw))\n'
                     'x = torch.randn(12, 16, **kw)\ns1 = torch.tensor([4, 0, 8], device="cuda")',
                     'seq(x, s1, s1.clone())',  # FC2's own tensor, equal values
                     'seq(x, s1, torch.tensor([4, 4, 4], device="cuda"))')  # valid alone, not FC1's


def test_launch_cdiv_and_next_pow2_match_triton():
    """The plain-Python grid helpers give what triton.cdiv / next_power_of_2 give."""
    import triton

    for a in list(range(0, 70)) + [2**31 - 1, 2**31, 2**40 + 3]:
        assert launch.next_pow2(a) == triton.next_power_of_2(a)
        for b in (1, 3, 16, 128):
            assert launch.cdiv(a, b) == triton.cdiv(a, b)


# ------------------------------------------------------------------- tuning: configs that fit
@pytest.mark.skipif(gg.triton is None, reason="needs triton")
def test_autotuning_keeps_only_configs_whose_tiles_fit_the_problem():
    """Tiny feature sizes leave one config (compiled alone, nothing timed); sizes of a tile or more
    keep the whole list. The autotuners of the grouped GEMMs carry the prune."""
    mn, wg = gg.MN_KERNEL, gg.WGRAD_KERNEL
    fit_mn = {"NOUT": "BN", "KIN": "BK"}
    tiny = launch.fit_configs(mn.configs, fit_mn, {"NOUT": 12, "KIN": 8})
    assert [(c.kwargs["BN"], c.kwargs["BK"]) for c in tiny] == [(64, 32)]
    assert launch.fit_configs(mn.configs, fit_mn, {"NOUT": 4096, "KIN": 7168}) == mn.configs
    mid = launch.fit_configs(mn.configs, fit_mn, {"NOUT": 100, "KIN": 64})  # BN <= 128, BK <= 64
    assert mid and all(c.kwargs["BN"] <= 128 and c.kwargs["BK"] <= 64 for c in mid) and len(mid) < len(mn.configs)
    wtiny = launch.fit_configs(wg.configs, {"N": "BN", "K": "BK"}, {"N": 6, "K": 8})
    assert len(wtiny) == 1
    from fusible_ops.kernels import fp8_grouped_gemm as fg
    from fusible_ops.kernels import grouped_glu as glu

    for kernel, sizes in ((mn, {"NOUT": 12, "KIN": 8}), (wg, {"N": 6, "K": 8}), (glu.GLU_FWD_KERNEL, {"F": 6, "K": 8}),
                          (glu.DGLU_KERNEL, {"F": 6, "H": 8}), (fg.MM_KERNEL, {"N": 8, "K": 16}),
                          (fg.WGRAD_KERNEL, {"N": 8, "K": 16})):
        prune = kernel.tuned.early_config_prune
        kept = prune(kernel.configs, sizes)  # the smallest tiles only (one config, but for FP8's BM variants)
        assert kept and all(c.kwargs[m] == min(d.kwargs[m] for d in kernel.configs)
                            for c in kept for m in ("BN", "BK")), kernel.kernel.__name__
        assert len(kept) == 1 or kernel in (fg.MM_KERNEL, fg.WGRAD_KERNEL)
        assert prune(kernel.configs, {k: 8192 for k in sizes}) == kernel.configs


def test_reserve_sms_nests_and_restores():
    assert launch.SM_RESERVE[0] == 0
    with launch.reserve_sms(16):
        with launch.reserve_sms(-3):
            assert launch.SM_RESERVE[0] == 0
        assert launch.SM_RESERVE[0] == 16
        assert persistent.persistent_sms(torch.device("cpu"), 2) == 2  # (the interpreter's programs: unchanged)
    assert launch.SM_RESERVE[0] == 0


@pytest.mark.gpu
def test_gpu_reserved_sms_shrink_the_persistent_grid_not_the_result():
    """Under reserve_sms(n) the grouped GEMMs launch #SMs - n programs (room for communication
    kernels beside them) and compute the same bits: the tiles are the same, only spread over
    fewer programs; the launch records of both grids coexist."""
    x, w, b, dy, split = _data(300, 72, 64, [100, 0, 150, 50], torch.bfloat16, "cuda")
    sms = launch.num_sms(x.device)
    with launch.reserve_sms(sms - 3):
        assert persistent.persistent_sms(x.device) == 3
        grid = persistent.persistent_grid(300, 4, 72, x.device)({"BM": 16, "BN": 16})
        assert grid == (3,)
        reserved = [gg.grouped_gemm_fwd(x, w, split, b), gg.grouped_gemm_dgrad(dy, w, split),
                    gg.grouped_gemm_wgrad(dy, x, split)]
    full = [gg.grouped_gemm_fwd(x, w, split, b), gg.grouped_gemm_dgrad(dy, w, split), gg.grouped_gemm_wgrad(dy, x, split)]
    for a, f in zip(reserved, full):
        assert torch.equal(a, f)
    with launch.reserve_sms(sms - 3):  # (the reserved grid's launch records again)
        assert torch.equal(gg.grouped_gemm_fwd(x, w, split, b), full[0])


def test_deterministic_algorithms_turn_autotuning_off(monkeypatch):
    """Autotuning picks by timing (another process may pick another config and sum in another
    order); under torch.use_deterministic_algorithms(True) the kernels use their fixed configs."""
    monkeypatch.setattr(launch, "AUTOTUNE", True)
    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        assert launch.autotuning()
        torch.use_deterministic_algorithms(True, warn_only=True)
        assert not launch.autotuning()
        monkeypatch.setattr(launch, "AUTOTUNE", False)
        torch.use_deterministic_algorithms(False)
        assert not launch.autotuning()
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)


@pytest.mark.gpu
def test_gpu_deterministic_flag_uses_the_fixed_config(monkeypatch):
    """With autotuning on, the flag gives the bits of the fixed config (AUTOTUNE off)."""
    x, w, b, dy, split = _data(1024, 256, 384, [300, 0, 500, 224], torch.bfloat16, "cuda")
    fixed = gg.grouped_gemm_wgrad(dy, x, split)
    monkeypatch.setattr(launch, "AUTOTUNE", True)
    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        assert torch.equal(gg.grouped_gemm_wgrad(dy, x, split), fixed)
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)
