"""C++ replay of fused CUDA training calls (fusible_ops.replay): a replayed call gives bit for bit the
outputs and gradients of the Python path, and every call it cannot serve takes the Python path.
The GPU tests build the extension (about a minute, once per machine); the CPU tests check the
recording's pieces and that nothing is replayed off CUDA."""

import copy
import gc
import types

import pytest
import torch

import fusible_ops as fo
from fusible_ops import replay as R
from fusible_ops import replay_steps as RS

DEV = "cuda"
gpu = pytest.mark.gpu


def _plan(seq):
    fuser = seq._only
    return fuser._plans[fuser.last_key]


def _cases(dt=torch.bfloat16):
    kw = dict(device=DEV, dtype=dt)
    yield "residual_rmsnorm", lambda: fo.Sequential(fo.AddExtraInput(), fo.RMSNorm(384, **kw)), [(2, 96, 384), (2, 96, 384)]
    yield "residual_layernorm", lambda: fo.Sequential(fo.AddExtraInput(), fo.LayerNorm(1000, **kw)), [(33, 1000), (33, 1000)]
    yield "rmsnorm", lambda: fo.Sequential(fo.RMSNorm(4096, **kw)), [(300, 4096)]
    # (hidden >= 8193: dbias is a torch column sum, an ATen op the replay runs through the dispatcher)
    yield "layernorm_wide", lambda: fo.Sequential(fo.LayerNorm(8200, **kw)), [(5, 8200)]
    yield "swiglu", lambda: fo.Sequential(fo.SwiGLU()), [(4, 65, 512)]
    yield "gelu", lambda: fo.Sequential(fo.GELU()), [(257, 768)]
    yield "bias_gelu", lambda: fo.Sequential(fo.Bias(768, **kw), fo.GELU()), [(257, 768)]
    yield "bias", lambda: fo.Sequential(fo.Bias(768, **kw)), [(3, 50, 768)]
    yield "dense", lambda: fo.Sequential(fo.Linear(256, 512, **kw), fo.GELU(), fo.Linear(512, 192, **kw)), [(300, 256)]
    yield "linear_nobias", lambda: fo.Sequential(fo.Linear(256, 160, bias=False, **kw)), [(4, 33, 256)]
    yield "mlp_block", lambda: fo.Sequential(
        fo.RMSNorm(256, **kw), fo.Linear(256, 1024, **kw), fo.SwiGLU(), fo.Linear(512, 256, **kw),
        fo.AddExtraInput()), [(3, 40, 256), (3, 40, 256)]


def _run(seq, xs, dy, n=3):
    """n forward + backward calls; the last call's output and every gradient (accumulated)."""
    for t in [*xs, *seq.parameters()]:
        t.grad = None
    for _ in range(n):
        y = seq(*xs)
        y.backward(dy)
    return y, [t.grad for t in xs], [p.grad for p in seq.parameters()]


def _inputs(shapes, dt=torch.bfloat16, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return [torch.randn(*s, device=DEV, dtype=dt, generator=g).requires_grad_() for s in shapes]


def _setup(name, prepare=None):
    """(module, its copy, inputs, output gradient) of one case; ``prepare(module)`` runs first."""
    _, make, shapes = next(c for c in _cases() if c[0] == name)
    seq = make()
    if prepare is not None:
        prepare(seq)
    twin, xs = copy.deepcopy(seq), _inputs(shapes)
    with torch.no_grad():  # (the output's shape; an inference plan, not the training plan's first call)
        shape = seq(*xs).shape
    return seq, twin, xs, torch.randn(shape, device=DEV, dtype=torch.bfloat16)


def _same_all(got, want):
    """``_run``'s output and every gradient, bit for bit."""
    for a, b in zip([got[0], *got[1], *got[2]], [want[0], *want[1], *want[2]]):
        _same(a, b)


def _same(a, b):
    assert (a is None) == (b is None)
    if a is not None:
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b), (a - b).abs().max()


def _no_replay(fn):
    old, R.ENABLED = R.ENABLED, False
    try:
        return fn()
    finally:
        R.ENABLED = old


@gpu
@pytest.mark.parametrize("name", [c[0] for c in _cases()])
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32])
def test_replay_matches_python_path_bit_for_bit(name, dt):
    _, make, shapes = next(c for c in _cases(dt) if c[0] == name)
    seq = make()
    with torch.no_grad():
        for p in seq.parameters():
            p.uniform_(0.5, 1.5)
    twin = copy.deepcopy(seq)
    xs = _inputs(shapes, dt)
    xs2 = [x.detach().clone().requires_grad_() for x in xs]
    y = seq(*xs)
    dy = torch.randn_like(y)
    got = _run(seq, xs, dy)
    want = _no_replay(lambda: _run(twin, xs2, dy))
    plan = _plan(seq)
    # (call 1 ran no backward: call 2 compiles it while recording, call 3 records)
    assert plan.replay is not None and plan.replay.replayed >= 2, R.record.last_failure
    assert _plan(twin).replay is None
    assert got[0].grad_fn.name() == "FusibleReplayBackward"
    assert any("replayed; forward:" in line for line in R.explain(seq)), R.explain(seq)
    _same_all(got, want)


@gpu
def test_replay_declines_what_it_was_not_recorded_for():
    seq, twin, xs, dy = _setup("residual_rmsnorm")
    _run(seq, xs, dy)
    plan = _plan(seq)
    n = plan.replay.replayed
    assert n >= 2
    # an input 2 bytes off 16-byte alignment: the recipe declines, the Python path serves it
    buf = torch.randn(2 * 96 * 384 + 1, device=DEV, dtype=torch.bfloat16)
    x_odd = buf[1:].view(2, 96, 384).requires_grad_()
    r = xs[1].detach().clone().requires_grad_()
    y = seq(x_odd, r)
    assert y.grad_fn.name() != "FusibleReplayBackward" and plan.replay.replayed == n
    y2 = _no_replay(lambda: twin(x_odd.detach().clone(), r.detach()))
    _same(y, y2)
    # a residual that is not a tensor: the Python path's own error
    with pytest.raises((TypeError, ValueError)):
        seq(xs[0], 1.0)
    # a gradient with other strides (expanded): copied to the recorded layout
    x, r = [t.detach().clone().requires_grad_() for t in xs]
    y = seq(x, r)
    assert y.grad_fn.name() == "FusibleReplayBackward"
    y.sum().backward()
    x2, r2 = [t.detach().clone().requires_grad_() for t in xs]
    _no_replay(lambda: twin(x2, r2).sum().backward())
    _same(x.grad, x2.grad)
    _same(r.grad, r2.grad)


@gpu
def test_replay_frozen_weight_and_partial_grads():
    seq, twin, xs, dy = _setup("residual_rmsnorm", lambda m: m[1].weight.requires_grad_(False))
    got = _run(seq, xs, dy)
    assert _plan(seq).replay.replayed >= 2
    assert seq[1].weight.grad is None
    xs2 = [x.detach().clone().requires_grad_() for x in xs]
    want = _no_replay(lambda: _run(twin, xs2, dy))
    for a, b in zip(got[1], want[1]):
        _same(a, b)
    # only the residual requires grad; torch.autograd.grad of it alone
    x = xs[0].detach()
    r = xs[1].detach().clone().requires_grad_()
    for _ in range(3):
        (g,) = torch.autograd.grad(seq(x, r), r, dy)
    (g2,) = _no_replay(lambda: torch.autograd.grad(twin(x, r), r, dy))
    _same(g, g2)


def _grouped(bias=False):
    kw = dict(device=DEV, dtype=torch.bfloat16)
    seq = fo.Sequential(fo.GroupedLinear(4, 64, 256, bias=bias, **kw), fo.SwiGLU(),
                        fo.GroupedLinear(4, 128, 64, bias=bias, **kw))
    with torch.no_grad():
        for p in seq.parameters():
            p.normal_(0, 0.05)
    return seq


@gpu
@pytest.mark.parametrize("bias", [False, True])
def test_replay_grouped_mlp_matches_python_path(bias):
    seq = _grouped(bias)
    twin = copy.deepcopy(seq)
    splits = torch.tensor([5, 0, 7, 4], device=DEV)
    x = torch.randn(16, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(16, 64, device=DEV, dtype=torch.bfloat16)
    got = _run(seq, [x, splits, splits], dy)
    x2 = x.detach().clone().requires_grad_()
    want = _no_replay(lambda: _run(twin, [x2, splits, splits], dy))
    assert _plan(seq).replay.replayed >= 1, R.record.last_failure
    assert got[0].grad_fn.name() == "FusibleReplayBackward"
    _same(got[0], want[0])
    for a, b in zip(got[1][:1] + got[2], want[1][:1] + want[2]):
        _same(a, b)
    # other split sizes, same total rows: the same recipe (they are read on the device)
    s2 = torch.tensor([0, 9, 3, 4], device=DEV)
    y = seq(x, s2, s2)
    y2 = _no_replay(lambda: twin(x, s2, s2))
    assert y.grad_fn.name() == "FusibleReplayBackward"
    _same(y, y2)
    # one split tensor per linear where the recording had one for both: declined, Python path
    n = _plan(seq).replay.replayed
    y = seq(x, s2, s2.clone())
    assert _plan(seq).replay.replayed == n
    _same(y, y2)


@gpu
def test_deepcopy_of_a_replayed_module_records_its_own():
    """copy.deepcopy of a module whose calls replay: the copy holds no recipe of the original
    (C++ objects) and records and replays its own, with the original's results."""
    seq, _, xs, dy = _setup("rmsnorm")
    want = _run(seq, xs, dy)
    assert _plan(seq).replay.replayed >= 2, R.record.last_failure
    twin = copy.deepcopy(seq)
    assert _plan(twin).replay is not None and _plan(twin).replay.replayed == 0
    got = _run(twin, [x.detach().clone().requires_grad_() for x in xs], dy)
    assert _plan(twin).replay.replayed >= 1 and got[0].grad_fn.name() == "FusibleReplayBackward"
    _same_all(got, want)


@gpu
@pytest.mark.parametrize("kind", ["grouped", "dense"])
def test_replay_weight_grads_follow_delayed_wgrad_around_backward(kind):
    if kind == "grouped":
        seq = _grouped()
        splits = torch.tensor([5, 0, 7, 4], device=DEV)
        x = torch.randn(16, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        args = [x, splits, splits]
    else:
        seq, _, args, dy = _setup("dense")
        x = args[0]
    twin = copy.deepcopy(seq)
    if kind == "grouped":
        dy = torch.randn_like(x)
    _run(seq, args, dy)
    for m in (seq, twin):
        m.zero_grad(set_to_none=True)
    y = seq(*args)
    assert y.grad_fn.name() == "FusibleReplayBackward"
    with fo.delayed_wgrad():
        y.backward(dy)
    # (queued, not accumulated: the weights'; a bias's gradient goes to .grad as on the Python path)
    assert all(p.grad is None for n, p in seq.named_parameters() if n.endswith("weight"))
    fo.flush_wgrad()
    y2 = _no_replay(lambda: twin(*args))
    with fo.delayed_wgrad():
        y2.backward(dy)
    fo.flush_wgrad()
    for a, b in zip(seq.parameters(), twin.parameters()):
        _same(a.grad, b.grad)


@gpu
def test_replay_frozen_linear_weight():
    """A frozen linear weight: no weight gradient on the replay either (its plan records none)."""
    seq, twin, xs, dy = _setup("dense", lambda m: m[0].weight.requires_grad_(False))
    got = _run(seq, xs, dy)
    assert _plan(seq).replay.replayed >= 2, R.record.last_failure
    assert got[0].grad_fn.name() == "FusibleReplayBackward"
    assert seq[0].weight.grad is None
    xs2 = [x.detach().clone().requires_grad_() for x in xs]
    want = _no_replay(lambda: _run(twin, xs2, dy))
    _same_all(got, want)


@gpu
def test_no_replay_under_torch_autocast():
    seq, twin, xs, dy = _setup("bias_gelu")
    _run(seq, xs, dy)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = seq(*xs)
        y2 = _no_replay(lambda: twin(*xs))
    assert y.grad_fn.name() != "FusibleReplayBackward"
    _same(y, y2)


@gpu
def test_replay_backward_twice_and_retain_graph():
    seq, _, xs, dy = _setup("rmsnorm")
    _run(seq, xs, dy)
    x = xs[0].detach().clone().requires_grad_()
    y = seq(x)
    assert y.grad_fn.name() == "FusibleReplayBackward"
    y.backward(dy, retain_graph=True)
    g1 = x.grad.clone()
    y.backward(dy)
    _same(x.grad, 2 * g1)
    with pytest.raises(RuntimeError, match="second time"):
        y.backward(dy)


@gpu
def test_replay_not_planned_for_unreplayable_ops():
    kw = dict(device=DEV, dtype=torch.bfloat16)
    for seq, args in [(fo.Sequential(fo.GELU(), fo.Dropout(0.1)).train(), (torch.randn(256, 512, **kw),)),
                      (fo.Sequential(fo.Linear(256, 512, **kw), fo.GELU(), fo.Dropout(0.1)).train(), (torch.randn(256, 256, **kw),))]:
        args[0].requires_grad_()
        for _ in range(3):
            seq(*args).sum().backward()
        assert _plan(seq).replay is None


@gpu
def test_replay_under_cuda_graphs():
    seq, twin, xs, dy = _setup("residual_rmsnorm")
    _run(seq, xs, dy)  # (recorded and replayed eagerly first)
    sample = [x.detach().clone().requires_grad_() for x in xs]
    g = fo.make_graphed_callables(seq, tuple(sample))
    for p in seq.parameters():
        p.grad.zero_()  # (graphed: zero, not None, between steps)
    outs = []
    for _ in range(3):
        x, r = [t.detach().clone().requires_grad_() for t in xs]
        y = g(x, r)
        y.backward(dy)
        outs.append((y.detach().clone(), x.grad, r.grad))
    for p in twin.parameters():
        p.grad = None
    for y, gx, gr in outs:
        x, r = [t.detach().clone().requires_grad_() for t in xs]
        y2 = _no_replay(lambda: twin(x, r))
        y2.backward(dy)
        _same(y, y2.detach())
        _same(gx, x.grad)
        _same(gr, r.grad)
    _same(seq[1].weight.grad, twin[1].weight.grad)


def _mark_accumulators(tensors):
    for k, t in enumerate(tensors):
        torch.autograd.graph.get_gradient_edge(t).node.metadata["fo_mark"] = k


def _marked_alive(tensors):
    return ["fo_mark" in torch.autograd.graph.get_gradient_edge(t).node.metadata for t in tensors]


@gpu
@pytest.mark.parametrize("capture", ["fusible_ops", "torch"])
def test_chain_of_replayed_modules_captures_after_eager_steps(capture):
    """Four Sequentials in a chain (RMSNorm -> GELU each, every call replayed) trained eagerly,
    then captured: the graphed steps give the eager Python path's gradients. A recording must
    keep nothing of its call's autograd history alive (checked with the cyclic GC off): a
    recording that held its inputs kept the weights' AccumulateGrad nodes of that eager step
    alive, on the default stream, and the capture then failed (legacy stream dependency)."""
    kw = dict(device=DEV, dtype=torch.bfloat16)

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[fo.Sequential(fo.RMSNorm(128, **kw), fo.GELU()) for _ in range(4)])

    chain, twin = make(), make()
    x = torch.randn(256, 128, requires_grad=True, **kw)
    dy = torch.randn(256, 128, **kw)
    weights = list(chain.parameters())
    gc.disable()
    try:
        for i in range(3):
            y = chain(x)
            if i == 1:  # (the step that records every module)
                _mark_accumulators(weights)
            y.backward(dy)
            del y
        alive = _marked_alive(weights)
    finally:
        gc.enable()
    assert all(_plan(b).replay.replayed >= 1 for b in chain), R.record.last_failure
    assert not any(alive), alive  # (else the capture below fails and breaks the CUDA context)
    chain.zero_grad(set_to_none=True)
    sample = (x.detach().clone().requires_grad_(),)
    if capture == "fusible_ops":
        g = fo.make_graphed_callables(chain, sample)
    else:
        for p in chain.parameters():
            p.grad = torch.zeros_like(p)
        g = torch.cuda.make_graphed_callables(chain, sample)
    for p in chain.parameters():
        p.grad.zero_()
    for _ in range(2):
        g(x).backward(dy)
    for _ in range(2):
        _no_replay(lambda: twin(x)).backward(dy)
    for a, b in zip(chain.parameters(), twin.parameters()):
        _same(a.grad, b.grad)


# ---------------------------------------------------------------- CPU: the recording's pieces

def test_backward_slots_find_forward_tensors_as_saved():
    """A backward pointer into a forward tensor becomes a saved slot (once per use, numbered
    after the backward's own tensors)."""
    a, b, dy = torch.empty(8), torch.empty(4), torch.empty(8)
    fwd = RS._Slots([a], [b])
    saved = []
    bwd = RS._BwdSlots([dy], [], fwd, saved)
    assert bwd.find(dy.data_ptr() + 4) == (0, 4)
    assert bwd.find(b.data_ptr() + 8) == (1, 8) and saved == [1]
    other = torch.empty(2)
    with pytest.raises(R._Refuse, match="neither an input nor made by the call"):
        bwd.find(other.data_ptr())

def test_no_replay_off_cuda():
    seq = fo.Sequential(fo.AddExtraInput(), fo.RMSNorm(16))
    x, r = torch.randn(4, 16, requires_grad=True), torch.randn(4, 16, requires_grad=True)
    for _ in range(3):
        seq(x, r).sum().backward()
    assert _plan(seq).replay is None


def test_kernel_params_follow_triton_launcher():
    fn = types.SimpleNamespace(arg_names=["X", "Y", "n", "one", "eps", "BLOCK"], __name__="k")
    src = types.SimpleNamespace(fn=fn, signature={"X": "*bf16", "Y": "*fp32", "n": "i32", "one": "constexpr",
                                                  "eps": "fp32", "BLOCK": "constexpr"},
                                constants={(3,): 1, (5,): 128})
    md = types.SimpleNamespace(global_scratch_size=0, profile_scratch_size=0, num_ctas=1, num_warps=4, shared=0)
    params = RS._kernel_params(types.SimpleNamespace(src=src, metadata=md))
    assert params == [(0, "*bf16"), (1, "*fp32"), (2, "i32"), (4, "fp32"), (None, "*scratch"), (None, "*scratch")]
    md.global_scratch_size = 64  # (used: the replay gives each launch a fresh buffer)
    assert RS._kernel_params(types.SimpleNamespace(src=src, metadata=md))[4] == (None, "*gscratch")
    md.profile_scratch_size = 64
    with pytest.raises(R._Refuse, match="profile scratch"):
        RS._kernel_params(types.SimpleNamespace(src=src, metadata=md))
    md.global_scratch_size, md.profile_scratch_size, md.num_ctas = 0, 0, 2
    with pytest.raises(R._Refuse, match="cluster"):
        RS._kernel_params(types.SimpleNamespace(src=src, metadata=md))


def test_slots_find_pointers_inside_extents_only():
    a, b = torch.empty(10, 4), torch.empty(3)
    slots = RS._Slots([a], [b])
    assert slots.find(a.data_ptr()) == (0, 0)
    assert slots.find(a[2:].data_ptr()) == (0, 32)
    assert slots.find(b.data_ptr() + 8) == (1, 8)
    with pytest.raises(R._Refuse, match="neither an input nor made by the call"):
        slots.find(b.data_ptr() + 12)


def test_recorder_refuses_compute_and_accepts_allocations_and_views():
    rec = R._Recorder()
    with rec:
        t = torch.empty(4, 4)
        t.view(16)
        t.t()
    assert rec.failure is not None  # (CPU allocations are refused: replays allocate on CUDA)
    rec = R._Recorder()
    x = torch.ones(3)
    with rec:
        x.view(3, 1)
    assert rec.failure is None
    with rec:
        y = x + 1
    assert rec.failure is None and rec.steps[0][1] is torch.ops.aten.add.Tensor and rec.steps[0][4] is y
    with rec:
        torch.rand(3)
    assert "random" in rec.failure
    rec = R._Recorder()
    with rec:
        x.sum().item()
    assert rec.failure is not None


def test_op_refusals():
    assert R._op_refusal(torch.ops.aten.sum.dim_IntList) is None
    assert "random" in R._op_refusal(torch.ops.aten.bernoulli.default)
    assert "other than tensors" in R._op_refusal(torch.ops.aten._assert_async.default)  # (returns nothing)
    assert "depends on data" in R._op_refusal(torch.ops.aten._local_scalar_dense.default)  # (.item())


def test_explain_lists_each_geometry_note():
    seq = fo.Sequential(fo.AddExtraInput(), fo.RMSNorm(8))
    seq(torch.randn(2, 8, requires_grad=True), torch.randn(2, 8)).sum().backward()
    assert R.explain(seq) == []  # (CPU: no replayer)
    _plan(seq).replay = types.SimpleNamespace(notes={"k": "[(2, 8)]: replayed; forward: ..."})
    assert R.explain(seq) == ["[(2, 8)]: replayed; forward: ..."]
    ck = types.SimpleNamespace(src=types.SimpleNamespace(fn=types.SimpleNamespace(__name__="_norm_fwd_kernel")))
    steps = [("launch", (None, None, None, None, ck), (1,), []), ("op", torch.ops.aten.sum.dim_IntList, (), {}, None)]
    assert R._names(steps) == "[_norm_fwd_kernel, aten.sum.dim_IntList]"


def test_lifetimes_make_at_first_use_and_release_after_last():
    """A replayed call holds each temporary only while the Python path would: an allocation is made
    before its first step, a slot not handed out is released after its last, kept slots stay."""
    # slots: 2 given, allocations 2, 3, 4; the op's output becomes slot 5
    steps = [(1, (1, 1, 1), 32, 0, [0, 0], [[0, 0, 0], [1, 2, 0]]),
             ("op", "add", "Tensor", [None, None, 1], [[0, [2, False, [], [], 0]], [1, [0, False, [], [], 0]]], [True]),
             (2, (1, 1, 1), 32, 0, [0, 0], [[0, 3, 0], [1, 5, 0]])]
    make, release, late = RS._lifetimes(steps, 2, 3, keep={3})
    assert make == [[2], [], [3]]
    assert release == [[], [2], [5]]  # (given slots 0, 1 and the kept slot 3 are never released)
    assert late == [4]
