"""Delayed scaling's per-call state updates batched per fuser (fusible_ops.quantization.delayed):
bit for bit what cast-by-cast updates give, one launch per call direction whatever the number of
FP8 tensors, the state-dict format unchanged; and the launches per step of delayed and block
scaling: one per FP8 tensor (its cast) plus a constant. Launches are counted, never timed."""

import copy

import pytest
import torch

import fusible_ops as fo
from fusible_ops import kernels
from fusible_ops.op import BasicOperation
from fusible_ops.quantization import delayed as D
from fusible_ops.testing.launches import count_launches

RECIPE = fo.Float8DelayedScaling(amax_history_len=4)


def _chain(n: int, d: int = 128, seed: int = 0) -> fo.Sequential:
    """RMSNorm, then n x (Linear without bias, GELU): 2n FP8 tensors per training step."""
    torch.manual_seed(seed)
    ops = [fo.RMSNorm(d)]
    for _ in range(n):
        ops += [fo.Linear(d, d, bias=False), fo.GELU()]
    return fo.Sequential(*ops)


def _packs(seq: fo.Sequential) -> list:
    return [f.__dict__["_fp8_pack"] for f, _ in seq._get_stages() if "_fp8_pack" in getattr(f, "__dict__", {})]


@pytest.fixture
def batched(monkeypatch):
    """Sets ``D.ENABLED`` (restored after the test)."""
    def set_(on: bool):
        monkeypatch.setattr(D, "ENABLED", on)
    return set_


class _Boom(BasicOperation):
    """The identity, raising while ``_Boom.armed`` (a class flag: the plan does not change)."""

    armed = False

    def op_forward(self, ctx, x, **kwargs):
        if _Boom.armed:
            raise RuntimeError("boom")
        return x

    def op_backward(self, ctx, dy):
        return dy, ()

    def reference_forward(self, x):
        return x


def _models():
    """Sequentials whose casts cover the plans' cases: several linears in one fuser, a frozen
    weight, a Quantize hand-off to a second Sequential (its first linear casts nothing), one
    Linear twice in a fuser (tied: not batched), one Linear in two Sequentials."""
    torch.manual_seed(0)
    a = fo.Sequential(fo.RMSNorm(64), fo.Linear(64, 128, bias=False), fo.SwiGLU(), fo.Linear(64, 64),
                      fo.GELU(), fo.Linear(64, 64, bias=False), fo.Quantize())
    a[3].weight.requires_grad_(False)
    b = fo.Sequential(fo.Linear(64, 64), fo.GELU(), fo.Linear(64, 64, bias=False))
    tied = fo.Linear(64, 64, bias=False)
    c = fo.Sequential(tied, fo.GELU(), tied)
    shared = fo.Linear(64, 64, bias=False)
    d1, d2 = fo.Sequential(fo.GELU(), shared), fo.Sequential(shared, fo.ReLU())
    return torch.nn.ModuleList([a, b, c, d1, d2])


def _train(model, recipe, steps: int, evaluate_at=()) -> list:
    """Training steps (SGD) of every Sequential of ``_models()``; an evaluation call (no grad)
    at the steps in ``evaluate_at``. Returns the outputs."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    outs = []
    for t in range(steps):
        g = torch.Generator().manual_seed(t)
        x = torch.randn(32, 64, generator=g) * (1 + t)
        with fo.autocast(recipe=recipe):
            y = model[1](model[0](x.requires_grad_()))
            y = y + model[2](x) + model[4](model[3](x))
        (y.square().sum() + y.sum()).backward()
        outs.append(y.detach())
        opt.step()
        opt.zero_grad()
        if t in evaluate_at:
            with torch.no_grad(), fo.autocast(recipe=recipe):
                outs.append(model[1](model[0](x)))
    return outs


@pytest.mark.parametrize("recipe", [RECIPE, fo.Float8DelayedScaling(amax_history_len=3, amax_compute_algo="most_recent",
                                                                     margin=1, fp8_format="e4m3")])
def test_batched_updates_equal_cast_by_cast(batched, recipe):
    """The same training (with an evaluation call in between) with batched and with cast-by-cast
    updates: equal outputs and state dicts, bit for bit; the state-dict keys are the same."""
    runs = []
    for on in (False, True):
        batched(on)
        model = _models()
        outs = _train(model, recipe, 5, evaluate_at=(2,))
        runs.append((outs, model.state_dict(), model))
    (o0, s0, _), (o1, s1, model) = runs
    assert all(torch.equal(a, b) for a, b in zip(o0, o1))
    assert list(s0) == list(s1)
    for k in s0:
        assert torch.equal(s0[k], s1[k]), k
    a, b = model[0], model[1]
    # the fuser of ``a`` batched its 3 input columns (and 3 gradient columns: the frozen linear's
    # output gradient is cast too), in one buffer that the linears' buffers are views of
    (pack,) = _packs(a)
    assert pack.updates == 2 * 4  # (steps 2-5: the first call learns the plan's columns)
    assert a[1].fp8_amax_history._base is a[5].fp8_amax_history._base is pack.hist
    assert _packs(b)[0].updates == 2 * 4 and not any(p.updates for p in _packs(model[2]))  # (tied: cast by cast)


def test_launches_per_step_one_per_fp8_tensor(batched):
    """Per training step, delayed scaling launches one kernel per FP8 tensor (its cast) and two
    more (the batched updates of the forward's and the backward's columns) whatever the number of
    FP8 tensors; block scaling one per FP8 tensor. Counted against bf16 on the Triton kernels (the
    interpreter): what a CUDA step launches, the FP8 GEMMs as one launch each."""
    batched(True)

    def launches(n, recipe):
        seq = _chain(n)
        x = torch.randn(128, 128, requires_grad=True)

        def step():
            with fo.autocast(recipe=recipe):
                y = seq(x)
            y.sum().backward()
        with kernels.use("triton"):
            step()
            step()  # (the first call learns the plan's columns)
            with count_launches() as c:
                step()
        return c
    for n in (1, 3):
        bf16 = launches(n, None).launches
        dl = launches(n, RECIPE)
        assert dl.triton["_delayed_update_many_kernel"] == 2 and "_delayed_update_kernel" not in dl.triton
        assert dl.launches - bf16 == 2 * n + 2, dl.summary()
        block = launches(n, fo.Float8BlockScaling())
        assert block.launches - bf16 == 2 * n, block.summary()
        assert block.triton["_cast_block_kernel"] == 2 * n


def test_exception_inside_a_call_takes_its_updates_back(batched):
    """A call that raises after its first linear cast: the second linear's batched update is
    taken back, so the state equals cast-by-cast updates'; later calls batch again."""
    states = []
    for on in (False, True):
        batched(on)
        torch.manual_seed(0)
        seq = fo.Sequential(fo.Linear(64, 64, bias=False), _Boom(), fo.GELU(), fo.Linear(64, 64, bias=False))
        for t in range(5):
            x = torch.randn(32, 64, requires_grad=True)
            _Boom.armed = t == 2
            try:
                with fo.autocast(recipe=RECIPE):
                    y = seq(x)
                y.sum().backward()
            except RuntimeError as e:
                assert "boom" in str(e)
            finally:
                _Boom.armed = False
        states.append(seq.state_dict())
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), k
    assert _packs(seq)[0].updates == 2 * 3 + 1  # (steps 2 and 4-5 batched both directions; step 3 its forward)


def test_a_token_left_untaken_is_taken_back_and_the_plan_casts_by_cast(batched):
    """A batched call whose casts did not take every token (a plan that cast fewer tensors than
    its first call): those updates are taken back exactly and the plan updates cast by cast."""
    batched(True)
    seq = _chain(2, d=64)
    x = torch.randn(32, 64, requires_grad=True)
    for _ in range(2):
        with fo.autocast(recipe=RECIPE):
            seq(x).sum().backward()
    (pack,) = _packs(seq)
    before = {k: v.clone() for k, v in seq.state_dict().items()}
    fuser = seq._get_stages()[0][0]
    plan = fuser._plans[fuser.last_key]
    key = (id(plan), 0, False)
    handle = pack.begin(fuser, plan, key, 0, x.device)  # (the forward's update, then no cast at all)
    assert handle[0] == "packed"
    assert not torch.equal(seq[1].fp8_amax_history, before["1.fp8_amax_history"])
    pack.end(handle, True)
    for k, v in seq.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert pack.learned[key] is False


def test_copies_and_loads_keep_their_own_state(batched):
    """A deep copy trains on state of its own (the original's buffers are not its pack's views),
    bit for bit as the original; a state dict loaded into a trained model lands in the pack."""
    batched(True)
    seq = _chain(2, d=64)
    x = torch.randn(32, 64, requires_grad=True)

    def step(m):
        with fo.autocast(recipe=RECIPE):
            m(x).sum().backward()
    for _ in range(3):
        step(seq)
    twin = copy.deepcopy(seq)
    for _ in range(2):
        step(seq)
        step(twin)
    for (k, v), w in zip(seq.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(v, w), k
    assert twin[1].fp8_amax_history.data_ptr() != seq[1].fp8_amax_history.data_ptr()
    assert twin[1].fp8_amax_history._base is _packs(twin)[0].hist
    saved = {k: v.clone() for k, v in twin.state_dict().items()}
    step(twin)
    twin.load_state_dict(saved)  # (in place, into the pack's views)
    step(twin)
    step(seq)
    for (k, v), w in zip(seq.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(v, w), k


def test_buffers_a_graph_captured_never_move(batched, monkeypatch):
    """A call made while a CUDA graph captures (simulated here: the capture check patched) neither
    learns nor rebuilds the buffer (that would allocate inside the graph), and marks the fuser's
    modules: their buffers, whose addresses the graph keeps, are never moved afterwards, while
    the state stays what cast-by-cast updates give."""
    results = {}
    for on, warmup in ((False, 1), (True, 1), (False, 3), (True, 3)):
        batched(on)
        seq = _chain(2, d=64)
        x = torch.randn(32, 64, requires_grad=True)

        def step():
            with fo.autocast(recipe=RECIPE):
                seq(x).sum().backward()
        for _ in range(warmup):
            step()
        monkeypatch.setattr(D, "_capturing", lambda device: True)
        ptrs = [seq[i].fp8_amax_history.data_ptr() for i in (1, 3)]
        step()  # "captured"
        monkeypatch.setattr(D, "_capturing", lambda device: False)
        for _ in range(3):
            step()
        assert [seq[i].fp8_amax_history.data_ptr() for i in (1, 3)] == ptrs
        if on:
            assert all(seq[i].__dict__.get(D._CAPTURED) for i in (1, 3))
            updates = sum(p.updates for p in _packs(seq))
            assert updates == (0 if warmup == 1 else 2 * 2 + 2 + 2 * 3)  # (placed before the capture: batched on)
        results[on, warmup] = seq.state_dict()
    for warmup in (1, 3):
        for k, v in results[False, warmup].items():
            assert torch.equal(v, results[True, warmup][k]), (warmup, k)
