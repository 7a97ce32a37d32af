"""The partials sum (fusible_ops.kernels.partials): ``part.sum(0)`` of fp32 partials, rounded once to
the output dtype, against a float64 sum. Unmarked tests run on Triton's interpreter without CUDA
(tests/conftest.py sets TRITON_INTERPRET=1) and compiled on a GPU machine."""

import pytest
import torch

from fusible_ops.kernels.partials import sum_partials, sum_partials_pair, sum_partials_pair_ref, sum_partials_ref
from fusible_ops.testing import assert_close

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("p,n", [(1, 1), (2, 5), (7, 33), (9, 256), (17, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sum_partials_matches_float64(p, n, dtype):
    part = torch.randn(p, n, generator=torch.Generator().manual_seed(p * 1000 + n)).to(DEV)
    truth = part.double().sum(0)
    out = sum_partials(part, dtype)
    assert out.dtype == dtype and out.shape == (n,)
    # one rounding to dtype of an fp32 sum: the dtype's elementwise tolerance
    assert_close(out, truth, dtype)
    assert_close(sum_partials_ref(part, dtype), truth, dtype)


def test_sum_partials_non_contiguous_and_empty():
    base = torch.randn(12, 10, generator=torch.Generator().manual_seed(3)).to(DEV)
    part = base[:, ::2]  # a strided view: summed as a contiguous copy
    assert_close(sum_partials(part, torch.float32), part.double().sum(0))
    assert sum_partials(torch.empty(4, 0, device=DEV), torch.bfloat16).shape == (0,)


@pytest.mark.parametrize("p,n", [(1, 1), (7, 33), (17, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_partials_pair_matches_two_sums(p, n, dtype):
    """Two partials in one launch (a norm's dweight and dbias): each against float64, and bit for
    bit the single sums' values (a strided second partial is summed as a contiguous copy)."""
    g = torch.Generator().manual_seed(p * 7 + n)
    a = torch.randn(p, n, generator=g).to(DEV)
    b = torch.randn(p, 2 * n, generator=g).to(DEV)[:, ::2]
    out_a, out_b = sum_partials_pair(a, b, dtype)
    assert out_a.dtype == out_b.dtype == dtype and out_a.shape == out_b.shape == (n,)
    assert_close(out_a, a.double().sum(0), dtype)
    assert_close(out_b, b.double().sum(0), dtype)
    assert torch.equal(out_a, sum_partials(a, dtype)) and torch.equal(out_b, sum_partials(b, dtype))
    ref_a, ref_b = sum_partials_pair_ref(a, b, dtype)
    assert_close(ref_a, a.double().sum(0), dtype)
    assert_close(ref_b, b.double().sum(0), dtype)


def test_sum_partials_pair_rejects_different_shapes_and_takes_empty():
    with pytest.raises(ValueError, match="differ"):
        sum_partials_pair(torch.zeros(2, 3, device=DEV), torch.zeros(2, 4, device=DEV), torch.float32)
    out_a, out_b = sum_partials_pair(torch.empty(4, 0, device=DEV), torch.empty(4, 0, device=DEV), torch.bfloat16)
    assert out_a.shape == out_b.shape == (0,)


def test_sum_partials_is_deterministic():
    part = torch.randn(300, 129, generator=torch.Generator().manual_seed(5)).to(DEV)
    assert torch.equal(sum_partials(part, torch.float32), sum_partials(part, torch.float32))


@pytest.mark.gpu
def test_partials_buffer_reused_on_the_default_stream_only():
    """One buffer per (thread, device, slot) on the default stream, grown when needed; fresh tensors
    on any other stream (graph capture runs on one) and in another thread."""
    import threading

    from fusible_ops.kernels.partials import partials_buffer

    like = torch.empty(1, device="cuda")
    a = partials_buffer(like, 8, 100, 0)
    assert a.shape == (8, 100) and a.dtype == torch.float32 and a.is_contiguous()
    assert partials_buffer(like, 8, 100, 0) is a
    b = partials_buffer(like, 8, 100, 1)  # the other slot: another buffer
    assert b.data_ptr() != a.data_ptr()
    big = partials_buffer(like, 300, 1 << 12, 0)  # grows slot 0: its old views are dropped
    assert big.shape == (300, 1 << 12) and partials_buffer(like, 8, 100, 0).data_ptr() == big.data_ptr()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        s1, s2 = partials_buffer(like, 8, 100, 0), partials_buffer(like, 8, 100, 0)
    assert s1.data_ptr() != s2.data_ptr() and s1.data_ptr() != big.data_ptr()
    got = []
    t = threading.Thread(target=lambda: got.append(partials_buffer(like, 8, 100, 0)))
    t.start()
    t.join()
    assert got[0].data_ptr() != big.data_ptr()


@pytest.mark.gpu
def test_backwards_in_turns_reusing_partials_match_fresh_buffers():
    """Norm and bias-activation backwards of different widths issued back to back on the default
    stream (each reusing the partials buffers the one before filled) give bit for bit what the
    same calls give on a side stream, where every call gets fresh buffers (the sums are
    deterministic)."""
    from fusible_ops.kernels import activation as A
    from fusible_ops.kernels import norm as N

    gen = torch.Generator().manual_seed(11)
    cases = []
    for rows, n in [(4096, 1024), (64, 4096), (4096, 1024), (333, 2048), (8, 64)]:
        x, dy = torch.randn(rows, n, generator=gen).cuda(), torch.randn(rows, n, generator=gen).cuda()
        w, b = (torch.rand(n, generator=gen) + 0.5).cuda(), torch.randn(n, generator=gen).cuda()
        cases.append((x, w, b, dy))

    def run_all():
        outs = []
        for x, w, b, dy in cases:  # all issued before any result is read
            _, mean, rstd, xs = N.layernorm_fwd(x, w, b, 1e-5)
            outs.append(N.layernorm_bwd(dy, xs, w, mean, rstd, True, True))
            _, rstd, xs = N.rmsnorm_fwd(x, w, 1e-5)
            outs.append(N.rmsnorm_bwd(dy, xs, w, rstd, True))
            outs.append(A.bias_act_bwd(dy, x, b, "gelu", True))
        return outs

    reused = run_all()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fresh = run_all()
    torch.cuda.synchronize()
    for a, b in zip(reused, fresh):
        for ta, tb in zip(a, b):
            assert ta is not None and torch.equal(ta, tb)
