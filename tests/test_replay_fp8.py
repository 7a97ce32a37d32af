"""C++ replay of FP8 training calls (fusible_ops.replay): under current scaling a replayed call
gives bit for bit the outputs and gradients of the Python path, and its cached FP8 weights are cast
again exactly when the parameters change (an optimizer step between calls); delayed scaling (an
amax history each call updates) and block scaling stay on the Python path."""

import copy
import weakref

import pytest
import torch

import fusible_ops as fo
from fusible_ops import replay as R
from test_replay import _no_replay

DEV = "cuda"
gpu = pytest.mark.gpu


def _block(hidden=256, ffn=512):
    kw = dict(device=DEV, dtype=torch.bfloat16)
    seq = fo.Sequential(fo.RMSNorm(hidden, **kw), fo.Linear(hidden, 2 * ffn, bias=False, **kw), fo.SwiGLU(),
                        fo.Linear(ffn, hidden, bias=False, **kw), fo.AddExtraInput(from_input=True))
    with torch.no_grad():
        for p in seq.parameters():
            if p.dim() == 2:
                p.normal_(0, hidden ** -0.5)
    return seq


def _casts(seq) -> int:
    return sum(m.__dict__.get("fp8_weight_casts", 0) for m in seq.modules())


def _steps(seq, recipe, x, dy, n=5):
    """n training steps (forward, backward, an in-place update of every parameter); each step's
    output, input gradient and parameter gradients."""
    got = []
    for _ in range(n):
        x.grad = None
        for p in seq.parameters():
            p.grad = None
        with fo.autocast(recipe=recipe):
            y = seq(x)
        y.backward(dy)
        got.append((y.detach(), x.grad, [p.grad for p in seq.parameters()], y.grad_fn.name()))
        with torch.no_grad():  # (a signed step: bounded whatever the gradients' scale)
            for p in seq.parameters():
                p.sub_(1e-3 * p.grad.sign())
    return got


@gpu
@pytest.mark.parametrize("recipe", [fo.Float8CurrentScaling(), fo.Float8CurrentScaling("e4m3")], ids=["hybrid", "e4m3"])
def test_fp8_replay_matches_python_path_across_weight_updates(recipe):
    seq = _block()
    twin = copy.deepcopy(seq)
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(2, 128, 256, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_()
    dy = torch.randn(2, 128, 256, device=DEV, dtype=torch.bfloat16, generator=g)
    got = _steps(seq, recipe, x, dy)
    x2 = x.detach().clone().requires_grad_()
    want = _no_replay(lambda: _steps(twin, recipe, x2, dy))
    fuser = seq._only
    plan = fuser._plans[fuser.last_key]
    assert plan.replay is not None and plan.replay.replayed >= 3, R.record.last_failure
    assert [s[3] for s in got][-3:] == ["FusibleReplayBackward"] * 3
    assert want[-1][3] != "FusibleReplayBackward"
    assert len(plan.replay.weights) == 2  # the two linears' cached FP8 weights are the recipe's inputs
    for a, b in zip(got, want):
        for u, v in zip([a[0], a[1], *a[2]], [b[0], b[1], *b[2]]):
            assert torch.isfinite(u).all()
            assert torch.equal(u, v), (u.float() - v.float()).abs().max()
    # each weight cast once per change, replayed or not
    assert _casts(seq) == _casts(twin) == 2 * len(got)
    assert any("replayed; forward:" in line for line in R.explain(seq)), R.explain(seq)
    # the replayer holds the modules weakly: nothing keeps the weights alive after del
    ref = weakref.ref(seq[1].weight)
    del seq, got, fuser, plan
    assert ref() is None


@gpu
@pytest.mark.parametrize("recipe", [fo.Float8DelayedScaling(), fo.Float8BlockScaling()], ids=["delayed", "block"])
def test_fp8_delayed_and_block_scaling_are_not_replayed(recipe):
    seq = _block()
    x = torch.randn(256, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    got = _steps(seq, recipe, x, torch.randn_like(x), n=3)
    fuser = seq._only
    assert fuser._plans[fuser.last_key].replay is None
    assert got[-1][3] != "FusibleReplayBackward"


@gpu
@pytest.mark.parametrize("recipe", [None, fo.Float8CurrentScaling()], ids=["bf16", "fp8"])
def test_replay_peak_memory_is_no_higher_than_the_python_paths(recipe):
    """A replay makes each temporary at its first use and releases it after its last (under FP8 the
    norm's and SwiGLU's bf16 outputs, 8 MiB each here, live only until their casts)."""
    seq = _block(1024, 2048)
    twin = copy.deepcopy(seq)
    x = torch.randn(2048, 1024, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def peak(m):
        def call():
            with fo.autocast(recipe=recipe):
                y = m(x)
            y.backward(dy)
            return y.grad_fn.name()
        for _ in range(3):  # (the third call is the first replayed one)
            call()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        name = call()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, name

    got, name = peak(seq)
    want, name2 = _no_replay(lambda: peak(twin))
    assert name == "FusibleReplayBackward" and name2 != name
    assert got <= want + (1 << 20), (got / 2**20, want / 2**20)  # (1 MiB: allocator rounding)
