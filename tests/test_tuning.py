"""Measured plan selection (fusible_ops.tuning): with an injected fake timer the choice follows the
timings, obeys the memory policy and is cached (in memory and on disk); tuning leaves every
side-effect state bit-identical; nothing is timed under torch.compile; explain() shows it."""

import copy

import pytest
import torch

import fusible_ops as fo
from fusible_ops import tuning
from fusible_ops.testing import assert_close_norm

H, E, F = 32, 4, 32


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSIBLE_OPS_TUNING_CACHE", str(tmp_path / "tuning.json"))
    yield
    tuning.disable()


def _moe():
    torch.manual_seed(0)
    return fo.Sequential(fo.Router(H, E, top_k=2), fo.Dispatch(), fo.GroupedLinear(E, H, 2 * F, bias=False),
                         fo.SwiGLU(), fo.GroupedLinear(E, F, H, bias=False), fo.Combine())


def _dense(**kw):
    torch.manual_seed(0)
    return fo.Sequential(fo.Linear(H, 2 * F, **kw), fo.SwiGLU(), fo.Linear(F, H, **kw), fo.AddExtraInput(from_input=True))


class FakeTimer:
    """Returns a fixed time per candidate label (the label's first word: 'static', 'without',
    'unfused'); records the calls."""

    def __init__(self, **ms):
        self.ms, self.calls = ms, []

    def __call__(self, fn, label):
        fn()  # (the candidate runs: a timer that does not run it would not time it)
        self.calls.append(label)
        return self.ms[label.split()[0]]


def _rules(seq, x):
    return {g["rule"] for p in ("forward", "backward") for g in seq.fusion_plan(p, x) if g["rule"]}


@pytest.mark.parametrize("fastest", ["static", "unfused"])
def test_the_choice_follows_the_timings(fastest):
    moe = _moe()
    x = torch.randn(64, H, requires_grad=True)
    timer = FakeTimer(static=1.0 if fastest == "static" else 2.0, unfused=1.0 if fastest == "unfused" else 2.0)
    lines = fo.tune(moe, x, timer=timer)
    assert timer.calls == ["static plan (moe_dispatch_mlp)", "unfused"]
    assert _rules(moe, x) == ({"moe_dispatch_mlp"} if fastest == "static" else set())
    assert any("<- chosen" in line and line.strip().startswith(fastest) for line in lines), lines
    y, aux = moe(x)  # the model itself runs the chosen plan, with its own (untouched) parameters
    (y.sum() + aux).backward()
    ran = {g["rule"] for g in moe.fusion_plan() if g["rule"]}  # (no x: the last call's plan)
    assert ran == ({"moe_dispatch_mlp"} if fastest == "static" else set())


def test_noise_does_not_move_the_choice_off_the_static_plan():
    moe = _moe()
    x = torch.randn(64, H, requires_grad=True)
    fo.tune(moe, x, timer=FakeTimer(static=1.005, unfused=1.0))  # within tuning.MARGIN
    assert _rules(moe, x) == {"moe_dispatch_mlp"}


def test_memory_policy_and_byte_budget():
    x = torch.randn(64, H, requires_grad=True)
    timer = FakeTimer(static=2.0, unfused=1.0)  # unfused is faster; the fused plan keeps fewer bytes
    moe = _moe()
    fo.tune(moe, x, prefer="memory", timer=timer, disk=False)
    assert _rules(moe, x) == {"moe_dispatch_mlp"}
    (_, (policy, rows, chosen)), = moe._stages[0][0].tuning_notes.items()
    kept = {label.split()[0]: k for label, _, k in rows}
    assert kept["static"] < kept["unfused"] and policy == "memory"
    for budget, expect in ((kept["unfused"], set()), (kept["static"], {"moe_dispatch_mlp"}), (0, {"moe_dispatch_mlp"})):
        moe = _moe()
        fo.tune(moe, x, prefer=budget, timer=timer, disk=False)
        assert _rules(moe, x) == expect, budget  # the fastest that fits; none fits: the leanest
    with pytest.raises(ValueError, match="prefer must be"):
        fo.tune(moe, x, prefer="fast")


def test_choices_are_cached_in_memory_and_on_disk():
    x = torch.randn(64, H, requires_grad=True)
    timer = FakeTimer(static=2.0, unfused=1.0)
    tuning.enable(timer=timer)
    moe = _moe()
    moe(x)
    moe(x)
    assert len(timer.calls) == 2  # the geometry was tuned once
    moe(torch.randn(32, H, requires_grad=True))  # a new geometry: tuned again
    assert len(timer.calls) == 4
    other = _moe()  # another fuser (as in another process): the disk cache answers, no timing
    other(x)
    assert len(timer.calls) == 4 and _rules(other, x) == set()
    tuning.clear_cache(other, disk=False)
    assert not other._stages[0][0]._choices
    other(x)  # still on disk
    assert len(timer.calls) == 4
    tuning.clear_cache(other)  # (disk too)
    other(x)
    assert len(timer.calls) == 6
    tuning.disable()
    fresh = _moe()
    fresh(x)
    assert _rules(fresh, x) == {"moe_dispatch_mlp"}  # untuned: the static plan


def _state(seq):
    out = {}
    for name, p in seq.named_parameters():
        out[name] = p.detach().clone()
        for attr in ("main_grad", "grad"):
            t = getattr(p, attr, None)
            out[f"{name}.{attr}"] = None if t is None else t.detach().clone()
    for i, op in enumerate(seq.basic_ops()):
        for k, v in vars(op).items():
            if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter):
                out[f"op{i}.{k}"] = v.clone()
        out[f"op{i}.pending"] = len(op.__dict__.get("_pending_wgrads", ()))
    out["rng"] = torch.get_rng_state()
    return out


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("what", ["main_grad", "delayed_wgrad", "fp8_delayed", "dropout"])
def test_tuning_leaves_every_side_effect_state_bit_identical(what):
    kw = dict(bias=True)
    if what == "main_grad":
        kw["accumulate_into_main_grad"] = True
    if what == "delayed_wgrad":
        kw["delay_wgrad_compute"] = True
    seq = _dense(**kw)
    if what == "dropout":
        seq = fo.Sequential(fo.Linear(H, 2 * H), fo.GELU(), fo.Dropout(0.5), fo.Linear(2 * H, H))
    for p in seq.parameters():
        if what == "main_grad":
            p.main_grad = torch.randn(p.shape)
    x = torch.randn(16, H, requires_grad=True)
    recipe = fo.Float8DelayedScaling(amax_history_len=4) if what == "fp8_delayed" else None
    if recipe is not None:
        seq = fo.Sequential(fo.Linear(H, 2 * H), fo.GELU(), fo.Linear(2 * H, H))
        x = torch.randn(16, H, requires_grad=True)
    with fo.autocast(recipe=recipe):
        seq(x).sum().backward()  # some state to keep: histories, queues, main_grad, .grad
    twin = copy.deepcopy(seq)
    before = _state(seq)
    with fo.autocast(recipe=recipe):
        fo.tune(seq, x, timer=FakeTimer(static=2.0, unfused=1.0, without=1.5), disk=False)
    _assert_same(_state(seq), before)
    assert seq._stages[0][0].tuning_notes  # (it did tune)
    # the next step equals that of a model that was never tuned (same RNG draw, same state)
    rng = torch.get_rng_state()
    with fo.autocast(recipe=recipe):
        y = seq(x)
        torch.set_rng_state(rng)  # (the twin draws what seq drew)
        y2 = twin(x)
    torch.testing.assert_close(y, y2)


def test_nothing_is_timed_under_torch_compile():
    timer = FakeTimer(static=2.0, unfused=1.0)
    tuning.enable(timer=timer)
    moe = _moe()
    x = torch.randn(64, H, requires_grad=True)
    out = torch.compile(moe, backend="aot_eager")(x)
    torch._dynamo.reset()
    assert timer.calls == [] and isinstance(out, tuple)


def test_explain_shows_candidates_times_kept_bytes_and_the_choice():
    moe = _moe()
    x = torch.randn(64, H, requires_grad=True)
    fo.tune(moe, x, timer=FakeTimer(static=3.0, unfused=1.5))
    text = moe.explain(x)
    assert "tuned plans (prefer='speed'; inputs [64, 32]):" in text
    assert "static plan (moe_dispatch_mlp): 3.000 ms" in text and "KiB kept for backward" in text
    assert "unfused: 1.500 ms" in text and text.count("<- chosen") == 1


@pytest.mark.gpu
def test_tuned_moe_layer_on_cuda_matches_the_static_plan():
    """On CUDA with the default timer (CUDA events): tuning picks one of the candidates, leaves the
    parameters' gradients state as it was, and the tuned layer computes what the static plan does."""
    torch.manual_seed(0)
    kw = dict(device="cuda", dtype=torch.bfloat16)
    seq = fo.Sequential(fo.Router(256, 16, top_k=4, **kw), fo.Dispatch(), fo.GroupedLinear(16, 256, 512, bias=False, **kw),
                        fo.SwiGLU(), fo.GroupedLinear(16, 256, 256, bias=False, **kw), fo.Combine())
    ref = copy.deepcopy(seq)
    x = torch.randn(2048, 256, **kw, requires_grad=True)
    lines = fo.tune(seq, x, disk=False)
    assert sum("<- chosen" in line for line in lines) == 1, lines
    assert all(p.grad is None for p in seq.parameters())
    x2 = x.detach().clone().requires_grad_()
    (y, aux), (yr, auxr) = seq(x), ref(x2)
    # (the tuned plan may be another candidate than the static one, whose GEMMs and GLU passes
    # round differently: a GEMM-like comparison for every tensor, as between any two plans)
    assert_close_norm(y, yr)
    (y.float().sum() + aux).backward()
    (yr.float().sum() + auxr).backward()
    assert_close_norm(x.grad, x2.grad)
    for p, q in zip(seq.parameters(), ref.parameters()):
        assert_close_norm(p.grad, q.grad)


@pytest.mark.cost_hints
def test_a_cost_hint_declines_statically_and_tuning_can_take_the_rule_back():
    """A rule's cost hint: the static plan declines where the hint says the fusion loses
    (explain() says so); tuning times the plan without the hints too and keeps it when faster."""
    import dataclasses

    rs = fo.RuleSet.builtin()
    name = "linear_bias"
    base = next(r for r in rs.rules("forward") if r.name == name)
    rs.add(dataclasses.replace(base, cost=lambda ops, ctx: "loses at this size (test)" if ops[0].in_features < 64 else None))
    seq = fo.Sequential(fo.Linear(H, H), rules=rs)
    x = torch.randn(8, H, requires_grad=True)
    assert _rules(seq, x) == set()
    assert "cost hint: loses at this size (test)" in seq.explain(x)
    timer = FakeTimer(static=2.0, without=1.0, unfused=2.0)
    fo.tune(seq, x, timer=timer, disk=False)
    assert timer.calls == ["static plan (no rule applies)", "without cost hints (+linear_bias)"]
    assert _rules(seq, x) == {name}
    with pytest.raises(TypeError, match="cost must be callable"):
        fo.RuleSet().register("x", [fo.Bias], pass_="forward", build=lambda ops: None, cost=3)
