"""Whole-Sequential CUDA graphs (fusible_ops.make_graphed_callables) under the gradient contract:
every replay is compared with the same steps run eagerly on a copy of the model."""

import copy

import pytest
import torch

import fusible_ops as fo

pytestmark = pytest.mark.gpu
DEV = "cuda"
DT = torch.float32  # exact-ish comparisons (graph vs eager run the same kernels)
TOL = dict(rtol=1e-5, atol=1e-5)


def _main_grads(seq):
    for m in seq.modules():
        if isinstance(m, fo.Linear) or isinstance(m, fo.GroupedLinear):
            if m.weight.requires_grad:
                m.weight.main_grad = torch.zeros(m.weight.shape, device=DEV, dtype=torch.float32)


def _dense(main_grad=True, delayed=False, p=0.0):
    torch.manual_seed(0)
    kw = dict(device=DEV, dtype=DT, accumulate_into_main_grad=main_grad, delay_wgrad_compute=delayed)
    mods = [fo.Linear(64, 128, **kw), fo.GELU(), fo.Linear(128, 64, **kw)]
    if p:
        mods.insert(2, fo.Dropout(p))
    return fo.Sequential(*mods)


def _weights(seq):
    return [m.weight for m in seq.modules() if isinstance(m, (fo.Linear, fo.GroupedLinear))]


def _steps(n=3):
    g = torch.Generator(device=DEV).manual_seed(1)
    return [(torch.randn(16, 64, device=DEV, dtype=DT, generator=g),
             torch.randn(16, 64, device=DEV, dtype=DT, generator=g)) for _ in range(n)]


def test_main_grad_accumulates_over_three_replays_with_flag_and_dummy():
    seq = _dense()
    ref = copy.deepcopy(seq)
    for s in (seq, ref):
        _main_grads(s)
        for w in _weights(s):
            w.grad_added_to_main_grad = False
            w.zero_out_wgrad = True  # the dummy is zeros: .grad stays comparable
    x0 = torch.zeros(16, 64, device=DEV, dtype=DT, requires_grad=True)
    assert [r["rule"] for r in seq.fusion_plan("forward", x0) if r["rule"]] == ["linear_bias_activation", "linear_bias"]
    x_static = torch.zeros(16, 64, device=DEV, dtype=DT, requires_grad=True)
    graphed = fo.make_graphed_callables(seq, (x_static,))
    for w in _weights(seq):  # warm-up and capture left no trace
        assert torch.count_nonzero(w.main_grad) == 0 and w.grad_added_to_main_grad is False
    for x, dy in _steps():
        for s in (seq, ref):
            for w in _weights(s):
                w.grad_added_to_main_grad = False
        with torch.no_grad():
            x_static.copy_(x)
        x_static.grad = None
        graphed(x_static).backward(dy)
        xr = x.clone().requires_grad_(True)
        ref(xr).backward(dy)
        torch.testing.assert_close(x_static.grad, xr.grad, **TOL)
        for w, wr in zip(_weights(seq), _weights(ref)):
            assert w.grad_added_to_main_grad is True and wr.grad_added_to_main_grad is True
            torch.testing.assert_close(w.main_grad, wr.main_grad, **TOL)
            assert w.grad is not None and torch.count_nonzero(w.grad) == 0  # the zero dummy, as eager
            assert torch.equal(w.grad, wr.grad)
    for b, br in zip([seq[0].bias, seq[2].bias], [ref[0].bias, ref[2].bias]):  # plain .grad accumulates
        torch.testing.assert_close(b.grad, br.grad, **TOL)


def test_plain_grad_and_frozen_weight():
    seq = _dense(main_grad=False)
    seq[0].weight.requires_grad_(False)  # frozen: no weight-gradient work, no .grad
    ref = copy.deepcopy(seq)
    x_static = torch.zeros(16, 64, device=DEV, dtype=DT, requires_grad=True)
    graphed = fo.make_graphed_callables(seq, (x_static,))
    for x, dy in _steps():
        with torch.no_grad():
            x_static.copy_(x)
        graphed(x_static).backward(dy)
        ref(x.clone().requires_grad_(True)).backward(dy)
    assert seq[0].weight.grad is None and ref[0].weight.grad is None
    for p, pr in zip(seq.parameters(), ref.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, pr.grad, **TOL)


def test_delayed_wgrad_replays_its_own_graph():
    seq = _dense(delayed=True)
    ref = copy.deepcopy(seq)
    for s in (seq, ref):
        _main_grads(s)
    calls = []
    seq[2].register_wgrad_hook(lambda: calls.append(1))
    x_static = torch.zeros(16, 64, device=DEV, dtype=DT, requires_grad=True)
    graphed = fo.make_graphed_callables(seq, (x_static,))
    assert not seq[0].basic_ops[0].has_pending_wgrad() and calls == []
    for x, dy in _steps():
        with torch.no_grad():
            x_static.copy_(x)
        graphed(x_static).backward(dy)
        ref(x.clone().requires_grad_(True)).backward(dy)
        for w, wr in zip(_weights(seq), _weights(ref)):  # nothing added before backward_dw
            torch.testing.assert_close(w.main_grad, wr.main_grad, **TOL)
        assert seq[0].basic_ops[0].has_pending_wgrad()
        for s in (seq, ref):
            s[0].backward_dw()
            s[2].backward_dw()
        for w, wr in zip(_weights(seq), _weights(ref)):
            torch.testing.assert_close(w.main_grad, wr.main_grad, **TOL)
    assert len(calls) == 3 and torch.count_nonzero(seq[0].weight.main_grad) > 0


def test_dropout_new_mask_every_replay_forward_and_backward_agree():
    seq = fo.Sequential(fo.Dropout(0.5)).train()
    x_static = torch.ones(64, 256, device=DEV, dtype=DT, requires_grad=True)
    graphed = fo.make_graphed_callables(seq, (x_static,))
    masks = []
    for _ in range(3):
        x_static.grad = None
        y = graphed(x_static)
        y.backward(torch.ones_like(y))
        keep = y.detach() != 0
        masks.append(keep)
        torch.testing.assert_close(x_static.grad, keep.to(DT) * 2.0)  # backward used this replay's mask
        assert 0.4 < keep.float().mean().item() < 0.6
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])


def _moe():
    torch.manual_seed(0)
    kw = dict(device=DEV, dtype=DT, accumulate_into_main_grad=True, bias=False)
    return fo.Sequential(fo.GroupedLinear(4, 64, 2 * 96, **kw), fo.SwiGLU(), fo.GroupedLinear(4, 96, 64, **kw))


@pytest.mark.parametrize("with_dense", [False, True])
def test_moe_changing_splits_between_replays(with_dense):
    moe = _moe()
    dense = _dense()
    mods = (dense, moe) if with_dense else (moe,)
    refs = tuple(copy.deepcopy(m) for m in mods)
    for m in (*mods, *refs):
        _main_grads(m)
    splits = torch.tensor([4, 0, 7, 5], device=DEV)
    x_static = torch.zeros(16, 64, device=DEV, dtype=DT, requires_grad=True)
    assert [r["rule"] for r in moe.fusion_plan("forward", x_static, splits, splits)] == ["grouped_mlp"]
    if with_dense:
        h_static = torch.zeros(16, 64, device=DEV, dtype=DT, requires_grad=True)
        graphed = fo.make_graphed_callables(mods, ((x_static,), (h_static, splits, splits)))
    else:
        graphed = (fo.make_graphed_callables(moe, (x_static, splits, splits)),)
    for (x, dy), sizes in zip(_steps(), ([4, 0, 7, 5], [16, 0, 0, 0], [1, 2, 3, 10])):
        splits.copy_(torch.tensor(sizes, device=DEV))
        with torch.no_grad():
            x_static.copy_(x)
        x_static.grad = None
        h = graphed[0](x_static) if with_dense else x_static
        y = graphed[-1](h, splits, splits)
        y.backward(dy)
        xr = x.clone().requires_grad_(True)
        hr = refs[0](xr) if with_dense else xr
        yr = refs[-1](hr, splits.clone(), splits.clone())
        yr.backward(dy)
        torch.testing.assert_close(y, yr, **TOL)
        torch.testing.assert_close(x_static.grad, xr.grad, **TOL)
        for m, r in zip(mods, refs):
            for w, wr in zip(_weights(m), _weights(r)):
                torch.testing.assert_close(w.main_grad, wr.main_grad, **TOL)


def test_cpu_split_sizes_are_refused_with_a_clear_error():
    moe = _moe()
    _main_grads(moe)
    x = torch.zeros(16, 64, device=DEV, dtype=DT, requires_grad=True)
    cpu_splits = torch.tensor([4, 4, 4, 4])
    with pytest.raises(ValueError, match="split sizes too"):
        fo.make_graphed_callables(moe, (x, cpu_splits, cpu_splits))
    moe(x, cpu_splits, cpu_splits)  # eager warm-up is fine
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError) as info:
        with torch.cuda.graph(g):
            moe(x, cpu_splits, cpu_splits)
    chain, e = [], info.value
    while e is not None:
        chain.append(str(e))
        e = e.__context__
    assert any("GroupedLinear: split sizes are a CPU tensor while a CUDA graph is being captured" in m for m in chain)


def _fp8_casts(seq) -> int:
    owners = {id(m): m for m in seq.modules()}
    owners.update((id(op), op) for m in seq.modules() if isinstance(m, fo.Linear) for op in m.basic_ops)
    return sum(o.__dict__.get("fp8_weight_casts", 0) for o in owners.values())


@pytest.mark.parametrize("recipe", ["current", "delayed", "block"])
@pytest.mark.parametrize("weight_cache", [True, False])
def test_fp8_graphed_training_loop_matches_eager(recipe, weight_cache):
    """FP8 under capture, optimizer steps with two micro-batches each: graph replays equal eager.
    With the weight cache (the default) the graphs read the cached FP8 weights and the wrapper
    re-casts each weight once per optimizer step, before the first replay that sees it changed;
    without it the cast is captured and runs on every replay (no host-side casts)."""
    from fusible_ops.kernels.fp8_gemm import fp8_capable
    if not fp8_capable(torch.device(DEV)):
        pytest.skip("needs FP8 tensor cores")
    recipe = {"current": fo.Float8CurrentScaling(), "delayed": fo.Float8DelayedScaling(amax_history_len=4),
              "block": fo.Float8BlockScaling()}[recipe]
    torch.manual_seed(0)
    seq = fo.Sequential(fo.Linear(128, 256, device=DEV, dtype=DT), fo.GELU(), fo.Linear(256, 128, device=DEV, dtype=DT))
    ref = copy.deepcopy(seq)
    opt, opt_ref = torch.optim.SGD(seq.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    x_static = torch.zeros(128, 128, device=DEV, dtype=DT, requires_grad=True)
    with fo.autocast(recipe=recipe):
        ref(x_static.detach().clone().requires_grad_(True)).sum().backward()  # the same warm-up state
        ref.zero_grad(set_to_none=True)
        graphed = fo.make_graphed_callables(seq, (x_static,), num_warmup_iters=1, fp8_weight_cache=weight_cache)
    for p in list(seq.parameters()) + list(ref.parameters()):
        p.grad = torch.zeros_like(p)
    g = torch.Generator(device=DEV).manual_seed(1)
    casts0 = _fp8_casts(seq)
    n_steps = 3
    for step in range(n_steps):
        for _ in range(2):  # two micro-batches per optimizer step
            x = torch.randn(128, 128, device=DEV, dtype=DT, generator=g)
            dy = torch.randn(128, 128, device=DEV, dtype=DT, generator=g)
            with torch.no_grad():
                x_static.copy_(x)
            y = graphed(x_static)
            y.backward(dy)
            with fo.autocast(recipe=recipe):
                yr = ref(x.clone().requires_grad_(True))
            yr.backward(dy)
            torch.testing.assert_close(y, yr, **TOL)
        opt.step(), opt_ref.step()
        opt.zero_grad(set_to_none=False), opt_ref.zero_grad(set_to_none=False)
    # one cast per weight per optimizer step seen by a later replay (2 weights x 2 steps), or none
    assert _fp8_casts(seq) - casts0 == (2 * (n_steps - 1) if weight_cache else 0)
    for p, pr in zip(seq.parameters(), ref.parameters()):
        torch.testing.assert_close(p, pr, **TOL)


def test_first_tuning_inside_a_capture_is_refused_by_name_and_cuda_stays_usable():
    """A kernel meeting a new tuning key inside a CUDA graph capture raises a clear error before
    launching anything: the capture ends cleanly and later captures (and their RNG) work."""
    from fusible_ops.kernels.grouped_gemm import grouped_gemm_fwd
    from fusible_ops.kernels.launch import AUTOTUNE, forget_tuning

    if not AUTOTUNE:
        pytest.skip("FUSIBLE_OPS_GGEMM_AUTOTUNE=0: nothing tunes")
    forget_tuning()
    x = torch.randn(40, 64, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(3, 32, 64, device=DEV, dtype=torch.bfloat16)
    splits = torch.tensor([10, 0, 30], device=DEV)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        with torch.cuda.graph(g):
            grouped_gemm_fwd(x, w, splits)
    seq = _dense(p=0.5)
    _main_grads(seq)
    graphed = fo.make_graphed_callables(seq, (torch.randn(16, 64, device=DEV, requires_grad=True),))
    xs = torch.randn(16, 64, device=DEV, requires_grad=True)
    graphed(xs).sum().backward()
    torch.cuda.synchronize()
    assert torch.isfinite(xs.grad).all()
    with pytest.raises(ValueError, match="Sequential is already graphed"):  # a capture cannot hold a replay
        fo.make_graphed_callables(graphed, (xs,))


@pytest.mark.parametrize("recipe", [None, "current"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_dropping_a_graphed_model_frees_its_parameters_without_gc(recipe, train):
    """``del`` of a graphed model (and of what make_graphed_callables returned) frees its
    parameters at once: the graphed forward holds the module weakly, and the capture's
    forward-side references are dropped with the module (torch's own closes over the module and
    replays through a per-capture class, both cycles). In eval mode the original forward runs."""
    import gc
    import weakref

    if recipe is not None:
        from fusible_ops.kernels.fp8_gemm import fp8_capable
        if not fp8_capable(torch.device(DEV)):
            pytest.skip("needs FP8 tensor cores")
    recipe = {None: None, "current": fo.Float8CurrentScaling()}[recipe]
    gc.collect()
    gc.disable()
    try:
        seq = _dense(main_grad=False)
        _main_grads(seq)
        refs = [weakref.ref(p) for p in seq.parameters()] + [weakref.ref(seq)]
        x = torch.randn(16, 64, device=DEV, dtype=DT, requires_grad=True)
        with fo.autocast(recipe=recipe):
            graphed = fo.make_graphed_callables(seq, (x,), num_warmup_iters=1)
        graphed.train(train)
        with fo.autocast(recipe=recipe):
            for _ in range(2):
                graphed(x).sum().backward()
        del seq, graphed
        alive = [r for r in refs if r() is not None]
        assert not alive, f"{len(alive)} of {len(refs)} objects outlive `del` until the cyclic GC runs"
    finally:
        gc.enable()
