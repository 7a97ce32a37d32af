"""MoE router kernels (fusible_ops.kernels.moe_router): Triton vs ref vs float64 math.

CPU: the Triton path runs under the interpreter, tiles shrunk so that many programs run (the
counting sort then crosses block boundaries). GPU (marked ``gpu``): the MoE layers' shapes.
The ids and the sort are exact (integers); probabilities, score sums and the logits' gradient are
judged against float64 by the tolerance table.
"""

import pytest
import torch

import fusible_ops.kernels as K
from fusible_ops.kernels import moe_router as mr
from fusible_ops.testing import assert_close

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
FLAGS = [dict(score="softmax", normalize=False), dict(score="softmax", normalize=True),
         dict(score="sigmoid", normalize=True), dict(score="sigmoid", normalize=False, bias=True)]


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(mr, "TILE", 32)
    monkeypatch.setattr(mr, "SORT_COPIES", 8)
    monkeypatch.setattr(mr, "SCAN_CHUNK", 4)  # (the scan then takes several steps per column)
    mr._GEOMETRY.clear()
    yield
    mr._GEOMETRY.clear()


def _logits(t, e, seed=0, strided=False, device=DEV):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, e + 5 if strided else e, generator=g) * 2
    return (x[:, :e] if strided else x).to(device)


def _bias(e, seed=1, device=DEV):
    return (torch.randn(e, generator=torch.Generator().manual_seed(seed)) * 0.1).to(device)


def _route(mode, logits, k, flags, **kw):
    flags = dict(flags)
    if flags.pop("bias", False):
        flags["bias"] = _bias(logits.shape[1], device=logits.device)
    with K.use(mode):
        return mr.route(logits, k, **flags, **kw)


def _check_route(r, logits, k, flags):
    """r against float64 math: ids a top-k (equal to torch.topk's for distinct scores), the
    stable sort of those ids, probabilities and sums within the float32 tolerance."""
    t, e = logits.shape
    ref = _route("reference", logits.double(), k, flags, score_sum=True, zsum=True)
    assert torch.equal(r.ids.cpu(), ref.ids.cpu())
    flat = r.ids.reshape(-1).cpu()
    perm = torch.argsort(flat, stable=True)
    assert torch.equal(r.perm.cpu(), perm)
    assert torch.equal(r.inv_perm.cpu()[perm], torch.arange(t * k))
    assert torch.equal(r.counts.cpu(), torch.bincount(flat, minlength=e))
    assert r.probs.dtype == torch.float32 and r.counts.dtype == torch.int64
    assert_close(r.probs.double().cpu(), ref.probs.cpu(), torch.float32)
    if r.score_sum is not None:
        assert_close(r.score_sum.double().cpu(), ref.score_sum.cpu(), torch.float32)
    if r.zsum is not None:
        assert_close(r.zsum.double().cpu(), ref.zsum.cpu(), torch.float32)


@pytest.mark.parametrize("flags", FLAGS, ids=["softmax", "softmax_norm", "sigmoid_norm", "sigmoid_bias"])
@pytest.mark.parametrize("t,e,k", [(1, 2, 1), (13, 6, 2), (37, 8, 3), (21, 16, 8), (9, 5, 5)])
@pytest.mark.parametrize("mode", ["triton", "reference"])
def test_route_matches_float64(flags, t, e, k, mode, small_tiles):
    logits = _logits(t, e, seed=t * e + k)
    r = _route(mode, logits, k, flags, score_sum=True, zsum=True)
    _check_route(r, logits, k, flags)


def test_route_strided_logits_and_no_sums(small_tiles):
    logits = _logits(23, 12, strided=True)
    assert not logits.is_contiguous()
    r = _route("triton", logits, 4, FLAGS[1])
    assert r.score_sum is None and r.zsum is None
    _check_route(r, logits, 4, FLAGS[1])


def test_route_ties_go_to_the_lower_expert_and_sort_stably(small_tiles):
    """Integer logits: many exact ties. The kernels' top-k is still a top-k (lowest index first
    among equals) and the permutation is the stable sort of the ids they chose."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 3, (41, 7), generator=g).float().to(DEV)
    r = _route("triton", logits, 3, FLAGS[0])
    s = torch.softmax(logits.double(), -1).cpu()
    ids = r.ids.cpu()
    chosen = s.gather(1, ids)
    assert (chosen.min(1).values >= s.scatter(1, ids, -1.0).max(1).values).all()
    for row in range(ids.shape[0]):  # among equal scores the lower expert goes first
        for j in range(2):
            a, b = ids[row, j], ids[row, j + 1]
            assert s[row, a] > s[row, b] or (s[row, a] == s[row, b] and a < b)
    assert torch.equal(r.perm.cpu(), torch.argsort(ids.reshape(-1), stable=True))


def test_route_no_tokens_and_bad_input():
    r = mr.route(torch.empty(0, 4, device=DEV), 2, score_sum=True, zsum=True)
    assert r.ids.shape == (0, 2) and r.perm.numel() == 0 and r.counts.tolist() == [0] * 4
    with pytest.raises(ValueError, match="top_k must be in"):
        mr.route(torch.randn(3, 4), 5)
    with pytest.raises(ValueError, match="score must be one of"):
        mr.route(torch.randn(3, 4), 2, score="relu")
    with pytest.raises(ValueError, match="bias must be"):
        mr.route(torch.randn(3, 4), 2, bias=torch.zeros(3))


def _dlogits_case(t, e, k, flags, seed=0):
    logits = _logits(t, e, seed=seed)
    r = _route("reference", logits, k, flags)
    g = torch.Generator().manual_seed(seed + 1)
    dprobs = torch.randn(t, k, generator=g).to(DEV)
    daux = torch.tensor(0.7, device=DEV)
    return logits, r.ids, dprobs, r.counts, daux


@pytest.mark.parametrize("flags", FLAGS, ids=["softmax", "softmax_norm", "sigmoid_norm", "sigmoid_bias"])
@pytest.mark.parametrize("t,e,k", [(1, 2, 1), (13, 6, 2), (21, 16, 8)])
@pytest.mark.parametrize("parts", ["all", "probs_only", "aux_only"])
def test_router_dlogits_matches_float64(flags, t, e, k, parts, small_tiles):
    logits, ids, dprobs, counts, daux = _dlogits_case(t, e, k, flags, seed=t + e)
    dprobs = None if parts == "aux_only" else dprobs
    daux = None if parts == "probs_only" else daux
    opts = dict(score=flags["score"], normalize=flags["normalize"], aux_coeff=1e-2, z_coeff=1e-3)
    want = mr.router_dlogits_ref(logits.double(), ids, None if dprobs is None else dprobs.double(), counts,
                                 None if daux is None else daux.double(), **opts)
    for mode in ("triton", "reference"):
        with K.use(mode):
            got = mr.router_dlogits(logits, ids, dprobs, counts, daux, **opts)
        assert got.dtype == torch.float32 and got.shape == (t, e)
        assert_close(got.double().cpu(), want.cpu(), torch.float32, msg=mode)


def test_router_dlogits_out_dtype_and_no_tokens(small_tiles):
    logits, ids, dprobs, counts, daux = _dlogits_case(9, 6, 2, FLAGS[0])
    with K.use("triton"):
        got = mr.router_dlogits(logits, ids, dprobs, counts, daux, aux_coeff=1e-2, out_dtype=torch.bfloat16)
    want = mr.router_dlogits_ref(logits.double(), ids, dprobs.double(), counts, daux.double(), aux_coeff=1e-2)
    assert got.dtype == torch.bfloat16
    assert_close(got.double().cpu(), want.to(torch.bfloat16).double().cpu(), torch.bfloat16)
    empty = mr.router_dlogits(torch.empty(0, 6, device=DEV), torch.empty(0, 2, dtype=torch.int64, device=DEV),
                              None, counts, daux, aux_coeff=1e-2)
    assert empty.shape == (0, 6)


def test_custom_ops_opcheck_and_compile(small_tiles):
    from torch.library import opcheck

    logits, ids, dprobs, counts, daux = _dlogits_case(11, 6, 2, FLAGS[0])
    with K.use("triton"):
        opcheck(torch.ops.fusible_ops.moe_route, (logits, _bias(6), 2, False, True, True, True))
        opcheck(torch.ops.fusible_ops.moe_router_dlogits,
                (logits, ids, dprobs, counts, daux, True, True, 1e-3, 2e-3, torch.float32))

        def f(logits, dprobs, daux):
            r = mr.route(logits, 2, normalize=True, score_sum=True, zsum=True)
            return (*r, mr.router_dlogits(logits, r.ids, dprobs, r.counts, daux, normalize=True, aux_coeff=1e-2))

        torch._dynamo.reset()
        expected = f(logits, dprobs, daux)
        got = torch.compile(f, backend="aot_eager", fullgraph=True)(logits, dprobs, daux)
    for a, e in zip(got, expected):
        assert torch.equal(a, e)


@pytest.mark.gpu
@pytest.mark.parametrize("t,e,k", [(24576, 128, 8), (4099, 256, 8), (777, 60, 6), (16384, 8, 2)])
@pytest.mark.parametrize("flags", [FLAGS[1], FLAGS[3]], ids=["softmax_norm", "sigmoid_bias"])
def test_gpu_route_and_dlogits_at_layer_shapes(t, e, k, flags):
    logits = _logits(t, e, seed=e)
    r = _route("auto", logits, k, flags, score_sum=True, zsum=True)
    _check_route(r, logits, k, flags)
    dprobs = torch.randn(t, k, device=DEV)
    daux = torch.tensor(0.3, device=DEV)
    opts = dict(score=flags["score"], normalize=flags["normalize"], aux_coeff=1e-2, z_coeff=1e-3)
    got = mr.router_dlogits(logits, r.ids, dprobs, r.counts, daux, **opts)
    want = mr.router_dlogits_ref(logits.double(), r.ids, dprobs.double(), r.counts, daux.double(), **opts)
    assert_close(got.double(), want, torch.float32)
