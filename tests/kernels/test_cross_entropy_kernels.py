"""Cross-entropy row kernels (fusible_ops.kernels.cross_entropy): Triton and ref against float64
F.cross_entropy math, every option, ignored rows, odd V (several column steps), row-strided logits,
the in-place entry points. CPU: Triton's interpreter (no dots here, so bf16 too); GPU: ``gpu``."""

import pytest
import torch
import torch.nn.functional as F

import fusible_ops.kernels as K
from fusible_ops.kernels import cross_entropy as ce
from fusible_ops.testing import assert_close

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
OPTS = {"plain": (-100, 0.0, 0.0, None), "smoothing": (-100, 0.2, 0.0, None), "z_loss": (-100, 0.0, 1e-2, None),
        "softcap": (-100, 0.0, 0.0, 4.0), "all": (5, 0.1, 1e-3, 3.0)}


@pytest.fixture
def small_blocks(monkeypatch):
    if not CUDA:
        monkeypatch.setattr(ce, "MAX_BLOCK_V", 16)


def _case(rows, vocab, dtype, ignore_index, strided, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, vocab + 5, generator=g) * 3).to(DEV, dtype)
    x = x[:, :vocab] if strided else x[:, :vocab].contiguous()
    t = torch.randint(0, vocab, (rows,), generator=g)
    t[: rows // 3] = ignore_index
    gs = torch.randn(rows, generator=g).where(t != ignore_index, torch.tensor(0.0))
    return x, t.to(DEV), gs.to(DEV)


def _expected(x, t, gs, opts):
    """float64 (loss rows, lse, dlogits) by autograd through F.cross_entropy (+ z-loss, softcap)."""
    ignore_index, eps, zl, cap = opts
    z = x.detach().double().cpu().requires_grad_()
    zc = z if cap is None else cap * torch.tanh(z / cap)
    tc = t.cpu().long()
    loss = F.cross_entropy(zc, tc, ignore_index=ignore_index, reduction="none", label_smoothing=eps)
    lse = torch.logsumexp(zc, -1)
    loss = loss + torch.where(tc != ignore_index, zl * lse * lse, 0.0)
    (loss * gs.double().cpu()).sum().backward()
    return loss.detach(), lse.detach(), z.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", [(1, 1), (7, 37), (12, 100), (3, 16)])
@pytest.mark.parametrize("name", list(OPTS))
@pytest.mark.parametrize("strided", [False, True])
def test_loss_and_grad_match_float64(dtype, rows, vocab, name, strided, small_blocks):
    opts = OPTS[name]
    x, t, gs = _case(rows, vocab, dtype, opts[0], strided)
    want_loss, want_lse, want_d = _expected(x, t, gs, opts)
    for mode in ("triton", "reference"):
        with K.use(mode):
            loss, lse = ce.ce_loss(x, t, opts)
            d = ce.ce_grad_rows(x, t, lse, gs, opts)
            buf = x.clone()
            loss2, lse2 = ce.ce_loss_grad_(buf, t, gs, opts)
            buf2 = x.clone()
            ce.ce_grad_(buf2, t, lse, gs, opts)
        assert loss.dtype == lse.dtype == torch.float32 and d.dtype == dtype and d.shape == x.shape
        assert_close(loss, want_loss, torch.float32, msg=f"{mode} loss")  # (fp32 math on the given logits)
        assert_close(lse, want_lse, torch.float32, msg=f"{mode} lse")
        assert_close(d, want_d, dtype, msg=f"{mode} grad")
        assert torch.equal(loss2, loss) and torch.equal(lse2, lse), mode
        assert torch.equal(buf, d) and torch.equal(buf2, d), f"{mode}: in-place gradient"


def test_float64_runs_the_reference():
    x, t, gs = _case(4, 9, torch.float64, 5, False)
    with K.use("triton"):
        loss, lse = ce.ce_loss(x, t, OPTS["all"])
    assert loss.dtype == torch.float64
    assert_close(loss, _expected(x, t, gs, OPTS["all"])[0], torch.float64)


def test_no_rows():
    x = torch.empty(0, 11, device=DEV)
    t = torch.empty(0, dtype=torch.long, device=DEV)
    with K.use("triton"):
        loss, lse = ce.ce_loss(x, t, OPTS["plain"])
        d = ce.ce_grad_rows(x, t, lse, loss, OPTS["plain"])
    assert loss.shape == lse.shape == (0,) and d.shape == (0, 11)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_large_vocab(dtype):
    """V = 128256 (16 column steps of 8192, the last one partial), int32 targets."""
    x, t, gs = _case(9, 128256, dtype, 5, True, seed=3)
    t = t.int()
    want_loss, want_lse, want_d = _expected(x, t, gs, OPTS["all"])
    loss, lse = ce.ce_loss(x, t, OPTS["all"])
    buf = x.contiguous()
    ce.ce_loss_grad_(buf, t, gs, OPTS["all"])
    assert_close(loss, want_loss, torch.float32)
    assert_close(lse, want_lse, torch.float32)
    assert_close(buf, want_d, dtype)


def test_custom_ops_opcheck_and_compile(small_blocks):
    """Fake impls / schemas (opcheck, the in-place ops' mutations included) and a fullgraph trace
    of the public functions."""
    from torch.library import opcheck

    opts = OPTS["all"]
    x, t, gs = _case(6, 37, torch.float32, opts[0], False)
    with K.use("triton"):
        lse = ce.ce_loss(x, t, opts)[1]
        opcheck(torch.ops.fusible_ops.ce_loss, (x, t, *opts))
        opcheck(torch.ops.fusible_ops.ce_grad_rows, (x, t, lse, gs, *opts))
        opcheck(torch.ops.fusible_ops.ce_loss_grad_, (x.clone(), t, gs, *opts))
        opcheck(torch.ops.fusible_ops.ce_grad_, (x.clone(), t, lse, gs, *opts))

        def f(x, t, gs):
            loss, lse = ce.ce_loss(x, t, opts)
            d = ce.ce_grad_rows(x, t, lse, gs, opts)
            buf = x.clone()
            loss2, _ = ce.ce_loss_grad_(buf, t, gs, opts)
            return loss, d, buf, loss2

        torch._dynamo.reset()
        expected = f(x, t, gs)
        got = torch.compile(f, backend="aot_eager", fullgraph=True)(x, t, gs)
    for a, e in zip(got, expected):
        assert torch.equal(a, e)
