"""CPU calls (and small CUDA calls) under PyTorch's own autograd (``fusible_ops.fuser.CPU_AUTOGRAD``,
``fusible_ops.fuser.NATIVE_MAX_NUMEL``).

A CPU training call whose forward steps are all ``cpu_autograd`` ops runs the forward steps with
autograd recording (no autograd function, no ``fuser_backward``); trainable linear weights pass
through ``ContractGate``, which keeps the gradient contract. These tests hold: the same outputs and gradients as the ops' own backward
(``cpu_autograd(False)``) for every op and fused op that opts in, in float64; that the path is
really taken (and really not taken where it must not be); and that the plan is unchanged.
"""

import copy
import io

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fusible_ops as fo
from fusible_ops import fuser as fuser_mod
from fusible_ops import grad as grad_mod
from fusible_ops.grad import WeightGradMixin
from fusible_ops.kernels import use
from fusible_ops.testing import assert_close
from fusible_ops.testing.strategies import chains, leading_shapes

F64 = torch.float64


def _through_function(y) -> bool:
    """Whether ``y`` came out of the fused path: the fuser's autograd function, or its C++ replay
    (CUDA: fusible_ops.replay), not PyTorch's autograd over torch's own ops."""
    return "FuserFunction" in type(y.grad_fn).__name__ or y.grad_fn.name() == "FusibleReplayBackward"


def _run(seq, inputs, seed=7):
    """Outputs, and gradients (inputs, then parameters by name) for fixed output gradients."""
    xs = [t.detach().clone().requires_grad_(t.requires_grad) if t.is_floating_point() else t for t in inputs]
    for p in seq.parameters():
        p.grad = None
    torch.manual_seed(seed)
    out = seq(*xs)
    outs = list(out) if isinstance(out, tuple) else [out]
    g = torch.Generator().manual_seed(3)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=F64).to(o.device, o.dtype)).sum() for o in outs)
    loss.backward()
    grads = [x.grad for x in xs if isinstance(x, torch.Tensor) and x.requires_grad]
    grads += [p.grad for _, p in sorted(seq.named_parameters()) if p.requires_grad]
    return outs, grads, _through_function(outs[0])


def _compare(seq, inputs, dtype=F64):
    """Default (native) run against ``cpu_autograd(False)``; returns whether the default run
    went native."""
    outs, grads, fn_default = _run(seq, inputs)
    with fuser_mod.cpu_autograd(False):
        ref_outs, ref_grads, fn_off = _run(seq, inputs)
    assert fn_off, "cpu_autograd(False) must run the fuser's autograd function"
    assert len(outs) == len(ref_outs) and len(grads) == len(ref_grads)
    for a, e in zip(outs, ref_outs):
        assert_close(a, e, dtype, msg="output")
    for i, (a, e) in enumerate(zip(grads, ref_grads)):
        assert (a is None) == (e is None), f"gradient {i}: one path lost it"
        if a is not None:
            assert_close(a, e, dtype, msg=f"gradient {i}")
    return not fn_default


def _x(*shape, rg=True, dtype=F64):
    return torch.randn(*shape, dtype=dtype).requires_grad_(rg)


def _frozen_linear(n, m, dtype):
    lin = fo.Linear(n, m, dtype=dtype)
    lin.weight.requires_grad_(False)  # PEFT: no weight-gradient work, nothing under the contract
    return lin


CASES = {  # name -> (make(dtype) -> (Sequential, inputs), rule expected in the forward plan or None)
    "swiglu": (lambda d: (fo.Sequential(fo.SwiGLU()), (_x(5, 8, dtype=d),)), None),
    "geglu": (lambda d: (fo.Sequential(fo.GEGLU()), (_x(5, 8, dtype=d),)), None),
    "reglu": (lambda d: (fo.Sequential(fo.ReGLU()), (_x(5, 8, dtype=d),)), None),
    "gelu_tanh": (lambda d: (fo.Sequential(fo.GELU("tanh")), (_x(2, 3, 6, dtype=d),)), None),
    "relu_silu": (lambda d: (fo.Sequential(fo.ReLU(), fo.SiLU()), (_x(5, 6, dtype=d),)), None),
    "scaled_swiglu": (lambda d: (fo.Sequential(fo.ScaledSwiGLU()), (_x(5, 8, dtype=d), _x(5, dtype=d))), None),
    "residual_rmsnorm": (lambda d: (fo.Sequential(fo.AddExtraInput(), fo.RMSNorm(6, dtype=d)),
                                    (_x(4, 6, dtype=d), _x(4, 6, dtype=d))), "residual_norm"),
    "residual_extra_layernorm": (lambda d: (fo.Sequential(fo.AddExtraInput(), fo.MakeExtraOutput(),
                                                          fo.LayerNorm(6, dtype=d)),
                                            (_x(4, 6, dtype=d), _x(4, 6, dtype=d))), "residual_extra_norm"),
    "norms": (lambda d: (fo.Sequential(fo.LayerNorm(6, dtype=d), fo.RMSNorm(6, dtype=d)), (_x(3, 6, dtype=d),)),
              None),
    "bias_gelu_dropout": (lambda d: (fo.Sequential(fo.Bias(6, dtype=d), fo.GELU(), fo.Dropout(0.25)),
                                     (_x(5, 6, dtype=d),)), "bias_activation_dropout"),
    "frozen_linear_silu": (lambda d: (fo.Sequential(_frozen_linear(6, 8, d), fo.SiLU()), (_x(5, 6, dtype=d),)),
                           "linear_bias_activation"),
    "scale_reshape_identity": (lambda d: (fo.Sequential(fo.ConstantScale(0.5), fo.Reshape((-1, 4)), fo.Identity(),
                                                        fo.Dropout(0.3)), (_x(3, 8, dtype=d),)), None),
}


def _case(name):
    """(Sequential, inputs, expected rule) of a case in float64, parameters drawn in [0.5, 1.5]."""
    make, rule = CASES[name]
    torch.manual_seed(0)
    seq, inputs = make(F64)
    with torch.no_grad():
        for p in seq.parameters():
            p.uniform_(0.5, 1.5)
    return seq, inputs, rule


@pytest.mark.parametrize("name", sorted(CASES))
def test_native_matches_own_backward(name):
    seq, inputs, rule = _case(name)
    assert _compare(seq, inputs), f"{name}: the default CPU call did not run under PyTorch's autograd"
    if rule is not None:  # the plan is the same either way: the fusion happened
        assert rule in [g["rule"] for g in seq.fusion_plan()]


@pytest.mark.parametrize("name", ["residual_rmsnorm", "swiglu", "bias_gelu_dropout"])
def test_native_float32_against_float64(name):
    """fp32 native run against the float64 run of the ops' own backward (table tolerance)."""
    make, _ = CASES[name]
    torch.manual_seed(0)
    seq32, in32 = make(torch.float32)
    torch.manual_seed(0)
    seq64, in64 = make(F64)
    seq64.load_state_dict({k: v.to(F64) for k, v in seq32.state_dict().items()})
    in64 = [t.detach().to(F64).requires_grad_(t.requires_grad) for t in in32]
    _against_reference(seq32, in32, seq64, in64, torch.float32)


def _against_reference(seq, inputs, ref_seq, ref_inputs, dtype):
    """``seq`` runs under PyTorch's autograd and matches ``ref_seq``'s float64 run through the
    ops' own backward (table tolerance of ``dtype``)."""
    outs, grads, fn = _run(seq, inputs)
    assert not fn
    with fuser_mod.cpu_autograd(False):
        ref_outs, ref_grads, _ = _run(ref_seq, ref_inputs)
    for a, e in zip(outs + grads, ref_outs + ref_grads):
        assert_close(a, e, dtype)


def _contract_run(native: bool, mode: str):
    """Three micro-batches through Linear -> GELU -> Linear under one gradient-contract mode;
    returns what the contract says must hold afterwards, per weight."""
    torch.manual_seed(0)
    main = mode in ("main_grad", "main_grad_flag")
    seq = fo.Sequential(fo.Linear(6, 5, dtype=F64, accumulate_into_main_grad=main,
                                  delay_wgrad_compute=(mode == "delay_flag")),
                        fo.GELU(), fo.Linear(5, 4, dtype=F64, accumulate_into_main_grad=main))
    weights = [seq[0].weight, seq[2].weight]
    for w in weights:
        if main:
            w.main_grad = torch.zeros_like(w)
        if mode == "main_grad_flag":
            w.grad_added_to_main_grad = False
    seen, x = [], _x(3, 6)
    with fuser_mod.cpu_autograd(native):
        for i in range(3):
            if mode == "delayed_fwd":  # delayed_wgrad() around the forward too (the gate, not the hooks)
                with fo.delayed_wgrad():
                    y = seq(x * (i + 1))
                    y.backward(torch.ones_like(y))
                seen.append([(w.grad is None, getattr(w, "skip_backward_post_hook", False)) for w in weights])
                fo.flush_wgrad()
                continue
            y = seq(x * (i + 1))
            assert _through_function(y) != native
            if mode == "delayed":
                with fo.delayed_wgrad():
                    y.backward(torch.ones_like(y))
                seen.append([(w.grad is None, getattr(w, "skip_backward_post_hook", False)) for w in weights])
                fo.flush_wgrad()
            else:
                y.backward(torch.ones_like(y))
                if mode == "delay_flag":
                    seen.append([w.grad is None for w in weights])
                    seq.backward_dw()
            if mode == "main_grad_flag":
                seen.append([w.grad_added_to_main_grad for w in weights])
    state = [getattr(w, "main_grad", None) if main else w.grad for w in weights]
    grads = [w.grad for w in weights]
    return seen, state, grads, seq[0].bias.grad, x.grad


@pytest.mark.parametrize("mode", ["plain", "main_grad", "main_grad_flag", "delayed", "delayed_fwd", "delay_flag"])
def test_contract_weights_under_native_autograd(mode):
    """Trainable linear weights go native (flagged ones through ContractGate, plain-mode ones
    straight to autograd, hooked while delayed_wgrad() is active): main_grad accumulation over
    three micro-batches, the flag and dummy, delayed_wgrad() around the backward (and around the
    forward too), and the op flag give what the ops' own backward gives."""
    seen, state, grads, bgrad, xgrad = _contract_run(True, mode)
    ref_seen, ref_state, ref_grads, ref_bgrad, ref_xgrad = _contract_run(False, mode)
    assert seen == ref_seen
    if mode in ("delayed", "delayed_fwd"):
        assert seen[0] == [(True, True), (True, True)]  # nothing in .grad until the first flush
        assert all(skip for batch in seen for _, skip in batch)  # pending work: hooks told to skip
    for a, e in zip(state + [bgrad, xgrad], ref_state + [ref_bgrad, ref_xgrad]):
        assert_close(a, e, F64)
    for a, e in zip(grads, ref_grads):  # .grad: None, the dummy, or the gradient, as the table says
        assert (a is None) == (e is None)
        if mode == "main_grad_flag":
            assert a.shape == e.shape
        elif a is not None:
            assert_close(a, e, F64)


def test_plain_weights_are_not_gated_and_late_hooks_go_away():
    """A plain-mode weight is not gated (its gradient goes to autograd's AccumulateGrad); the
    hooks delayed_wgrad() puts on such weights are gone after it: a later backward accumulates
    into .grad at once."""
    seq = fo.Sequential(fo.Linear(6, 5, dtype=F64), fo.GELU(), fo.Linear(5, 4, dtype=F64))
    x = _x(3, 6)
    y = seq(x)
    plan = seq._only._plans[seq._only.last_key]
    assert plan.gated is None and len(plan.gated_all[0]) == 2
    assert "ContractGate" not in str(y.grad_fn.next_functions)  # straight to the weights
    with fo.delayed_wgrad():
        y.sum().backward()
    assert seq[0].weight.grad is None and seq[2].weight.grad is None
    fo.flush_wgrad()
    assert not grad_mod._late_handles  # (removed when delayed_wgrad() ended)
    g0 = seq[0].weight.grad.clone()
    seq(x).sum().backward()  # no delayed_wgrad(): straight into .grad
    assert_close(seq[0].weight.grad, 2 * g0, F64)
    assert not seq[0].weight.skip_backward_post_hook


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_copy_of_a_module_that_ran_keeps_delayed_wgrad(how):
    """A copy (deepcopy, or torch.save + torch.load) of a Sequential that already ran holds its
    plans: under delayed_wgrad() around the backward the copy's plain-mode weights are queued
    for flush_wgrad() as the original's are, not accumulated into .grad at once."""
    seq = fo.Sequential(fo.Linear(6, 5, dtype=F64), fo.GELU(), fo.Linear(5, 4, dtype=F64))
    x = _x(3, 6)
    seq(x).sum().backward()
    if how == "deepcopy":
        twin = copy.deepcopy(seq)
    else:
        buf = io.BytesIO()
        torch.save(seq, buf)
        buf.seek(0)
        twin = torch.load(buf, weights_only=False)
    for m in (seq, twin):
        m.zero_grad(set_to_none=True)
        y = m(x)
        with fo.delayed_wgrad():
            y.sum().backward()
        assert m[0].weight.grad is None and m[2].weight.grad is None
        fo.flush_wgrad()
    assert_close(twin[0].weight.grad, seq[0].weight.grad, F64)


def test_tied_plain_weight_under_delayed_wgrad():
    """One weight used by two linears of a chain, delayed_wgrad() around the backward: after
    flush_wgrad() its .grad holds both uses' gradients, as with the ops' own backward."""
    def run(native):
        torch.manual_seed(0)
        seq = fo.Sequential(fo.Linear(5, 5, dtype=F64), fo.GELU(), fo.Linear(5, 5, dtype=F64))
        seq[2].weight = seq[0].weight
        x = _x(3, 5)
        with fuser_mod.cpu_autograd(native):
            y = seq(x)
            with fo.delayed_wgrad():
                y.sum().backward()
            assert seq[0].weight.grad is None
            fo.flush_wgrad()
        return seq[0].weight.grad, x.grad
    for a, e in zip(run(True), run(False)):
        assert_close(a, e, F64)


def test_frozen_weight_gets_no_gradient():
    seq = fo.Sequential(fo.Linear(6, 6, dtype=F64), fo.GELU())
    seq[0].weight.requires_grad_(False)
    x = _x(3, 6)
    y = seq(x)
    assert not _through_function(y)
    assert seq._only._plans[seq._only.last_key].gated is None  # no gate: no weight-gradient work
    y.sum().backward()
    assert seq[0].weight.grad is None and seq[0].bias.grad is not None


def test_switch_interpreter_and_no_grad():
    seq = fo.Sequential(fo.AddExtraInput(), fo.RMSNorm(6, dtype=F64))
    x, r = _x(3, 6), _x(3, 6)
    assert not _through_function(seq(x, r))
    with fuser_mod.cpu_autograd(False):
        assert _through_function(seq(x, r))
    assert fuser_mod.CPU_AUTOGRAD  # restored
    with use("reference"):
        assert not _through_function(seq(x, r))
    with torch.no_grad():
        assert seq(x, r).grad_fn is None
    text = seq.explain()
    assert "PyTorch's autograd differentiates the forward steps" in text
    with fuser_mod.cpu_autograd(False):
        assert "PyTorch's autograd differentiates" not in seq.explain()


def test_fp8_input_keeps_the_function():
    """A Float8Tensor input that requires grad: its dequantization is not differentiable, so the
    call keeps the autograd function, which routes the input's gradient."""
    from fusible_ops.quantization import Float8CurrentScaling
    from fusible_ops.quantization.casting import quantize

    seq = fo.Sequential(fo.SwiGLU())
    xq = quantize(torch.randn(4, 8), Float8CurrentScaling(), "input").requires_grad_()
    y = seq(xq)
    assert _through_function(y)
    y.sum().backward()
    assert xq.grad is not None and xq.grad.shape == (4, 8)


def test_op_not_opted_in_keeps_the_function():
    """An op without ``cpu_autograd`` (here a user's op) keeps the whole call on the function."""

    class Twice(fo.BasicOperation):
        def op_forward(self, ctx, x, **kwargs):
            return x * 2

        def op_backward(self, ctx, dy):
            return dy * 2, ()

    seq = fo.Sequential(fo.SiLU(), Twice())
    x = _x(3, 4)
    y = seq(x)
    assert _through_function(y)
    y.sum().backward()
    assert_close(x.grad, torch.autograd.grad(2 * torch.nn.functional.silu(x).sum(), x)[0])


@given(chain=chains(max_len=4), lead=leading_shapes(), seed=st.integers(0, 2**16), freeze=st.booleans())
def test_property_native_matches_own_backward(chain, lead, seed, freeze):
    """Random chains of built-in ops (float64), with the contract weights frozen or not: the
    default run matches the ops' own backward, and runs natively exactly when every forward
    step opts in."""
    seq = chain.build(F64, seed=seed)
    contract = [op for op in seq.basic_ops() if isinstance(op, WeightGradMixin)]
    if freeze:
        for op in contract:
            op.weight.requires_grad_(False)
    inputs = chain.inputs(lead, F64, seed=seed)
    native = _compare(seq, inputs)
    fuser = getattr(seq, "_only", None)
    if isinstance(fuser, fuser_mod.OperationFuser):  # (one fuser: no module boundary in the chain)
        plan = fuser._plans[fuser.last_key]
        assert native == all(g.op.cpu_autograd for g in plan.forward)


def test_checkpoint_double_backward_and_retain_graph():
    """The CPU autograd path under torch's own machinery: checkpointing (dropout redraws the same
    seed), double backward through the weight gate, and a retained graph run twice."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    seq = fo.Sequential(fo.RMSNorm(8, dtype=F64), fo.Linear(8, 16, dtype=F64), fo.SwiGLU(), fo.Dropout(0.3),
                        fo.Linear(8, 8, dtype=F64)).train()
    x = _x(5, 8)
    torch.manual_seed(1)
    y1 = seq(x)
    assert not _through_function(y1)
    grads1 = torch.autograd.grad(y1.sum(), [x, *seq.parameters()])
    torch.manual_seed(1)
    y2 = checkpoint(seq, x, use_reentrant=False)
    grads2 = torch.autograd.grad(y2.sum(), [x, *seq.parameters()])
    assert_close(y2, y1, F64)
    for a, e in zip(grads2, grads1):
        assert_close(a, e, F64)
    # double backward: a gradient penalty on the input gradient reaches the weights
    (gx,) = torch.autograd.grad(seq(x).sum(), x, create_graph=True)
    gx.pow(2).sum().backward()
    assert seq[1].weight.grad is not None and seq[1].weight.grad.abs().sum() > 0
    # retained graph, two backwards: the weight gradient accumulates twice
    seq.zero_grad(set_to_none=True)
    y = seq(x)
    y.sum().backward(retain_graph=True)
    once = seq[1].weight.grad.clone()
    y.sum().backward()
    assert_close(seq[1].weight.grad, 2 * once, F64)


# ---------------------------------------------------------------- small CUDA calls (fuser.NATIVE_MAX_NUMEL)
def _cuda_case(name, dtype):
    seq, inputs, rule = _case(name)
    on_cuda = copy.deepcopy(seq).to("cuda", dtype)
    cuda_inputs = [t.detach().to("cuda", dtype).requires_grad_(t.requires_grad) for t in inputs]
    return (seq, inputs), (on_cuda, cuda_inputs), rule


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_small_cuda_calls_run_native(name, monkeypatch):
    """A small CUDA training call runs under PyTorch's autograd (torch's own ops) and gives, in
    float32, what the fused kernels and their backward give (same device, same dropout seed)."""
    monkeypatch.setattr(fuser_mod, "NATIVE_MAX_NUMEL", 1 << 16)
    _, (seq, inputs), rule = _cuda_case(name, torch.float32)
    assert _compare(seq, inputs, torch.float32), f"{name}: the small CUDA call did not run natively"
    if rule is not None:
        assert rule in [g["rule"] for g in seq.fusion_plan()]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["frozen_linear_silu", "residual_rmsnorm", "swiglu", "norms", "gelu_tanh"])
def test_small_cuda_calls_bf16_against_float64(name, monkeypatch):
    """bf16 small CUDA calls under PyTorch's autograd against the float64 reference (the ops' own
    backward on CPU), with the table's bf16 tolerance."""
    monkeypatch.setattr(fuser_mod, "NATIVE_MAX_NUMEL", 1 << 16)
    (ref_seq, ref_in), (seq, inputs), _ = _cuda_case(name, torch.bfloat16)
    _against_reference(seq, inputs, ref_seq, ref_in, torch.bfloat16)


@pytest.mark.gpu
def test_large_cuda_calls_and_switches_take_the_fused_kernels(monkeypatch):
    monkeypatch.setattr(fuser_mod, "NATIVE_MAX_NUMEL", 64)
    seq = fo.Sequential(fo.Linear(8, 8, device="cuda"), fo.GELU())
    assert not _through_function(seq(torch.randn(8, 8, device="cuda", requires_grad=True)))  # 64 elements
    assert _through_function(seq(torch.randn(9, 8, device="cuda", requires_grad=True)))  # 72: fused kernels
    x = torch.randn(8, 8, device="cuda", requires_grad=True)
    with fuser_mod.cpu_autograd(False):
        assert _through_function(seq(x))
    with use("triton"):
        assert _through_function(seq(x))
    assert "CUDA inputs of at most 64 elements" in seq.explain()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["plain", "main_grad", "main_grad_flag", "delayed", "delayed_fwd", "delay_flag"])
def test_contract_on_small_cuda_calls(mode, monkeypatch):
    """The gradient contract on the small-CUDA path matches the fused kernels' (three micro-batches)."""
    monkeypatch.setattr(fuser_mod, "NATIVE_MAX_NUMEL", 1 << 16)
    torch.set_default_device("cuda")
    try:
        got = _contract_run(True, mode)
        want = _contract_run(False, mode)
    finally:
        torch.set_default_device(None)
    assert got[0] == want[0]
    for a, e in zip(got[1] + [got[3], got[4]], want[1] + [want[3], want[4]]):
        assert_close(a, e, F64)


@pytest.mark.gpu
def test_graphs_of_small_chains(monkeypatch):
    """fusible_ops.make_graphed_callables captures the fused kernels of a small chain, and
    torch.cuda.make_graphed_callables captures the native path: replays give eager's gradients."""
    monkeypatch.setattr(fuser_mod, "NATIVE_MAX_NUMEL", 1 << 16)
    torch.manual_seed(0)
    x = torch.randn(16, 32, device="cuda", requires_grad=True)
    dy = torch.randn(16, 32, device="cuda")

    def make():
        torch.manual_seed(1)
        return fo.Sequential(fo.Linear(32, 32, device="cuda"), fo.GELU(), fo.Linear(32, 32, device="cuda"))

    eager = make()
    eager(x).backward(dy)
    want = [p.grad.clone() for p in eager.parameters()]
    for graph in (fo.make_graphed_callables, lambda m, a: torch.cuda.make_graphed_callables(m, a)):
        seq = make()
        for p in seq.parameters():
            p.grad = None
        g = graph(seq, (x.detach().clone().requires_grad_(),))
        for p in seq.parameters():
            p.grad = None
        g(x.detach().clone().requires_grad_()).backward(dy)
        for a, e in zip([p.grad for p in seq.parameters()], want):
            assert_close(a, e.double(), torch.float32)
