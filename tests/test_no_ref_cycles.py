"""A deleted model frees its parameters at ``del``, without the cyclic garbage collector: no
reference cycle holds them (dense and MoE Sequentials, after forward + backward, in bf16-free CPU
runs and under FP8 autocast, whose weight cache lives on the modules)."""

import gc
import weakref

import pytest
import torch

import fusible_ops as fo


def _dense():
    return fo.Sequential(fo.RMSNorm(32), fo.Linear(32, 64), fo.SwiGLU(), fo.Linear(32, 32), fo.AddExtraInput())


def _moe():
    return fo.Sequential(fo.Router(32, 4, top_k=2), fo.Dispatch(), fo.GroupedLinear(4, 32, 64, bias=False),
                         fo.SwiGLU(), fo.GroupedLinear(4, 32, 32, bias=False), fo.Combine())


def _step(model, moe: bool) -> None:
    x = torch.randn(16, 32, requires_grad=True)
    if moe:
        y, aux = model(x)
        (y.sum() + aux).backward()
    else:
        model(x, x).sum().backward()


@pytest.mark.parametrize("recipe", [None, "current", "delayed"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_deleted_model_frees_its_parameters_without_gc(moe, recipe):
    recipes = {None: None, "current": fo.Float8CurrentScaling(), "delayed": fo.Float8DelayedScaling()}
    gc.collect()
    gc.disable()
    try:
        model = _moe() if moe else _dense()
        refs = [weakref.ref(p) for p in model.parameters()] + [weakref.ref(model)]
        with fo.autocast(recipe=recipes[recipe]):
            _step(model, moe)
            _step(model, moe)  # (a planned, cached second call too)
        del model
        alive = [r for r in refs if r() is not None]
        assert not alive, f"{len(alive)} of {len(refs)} objects outlive `del model` until the cyclic GC runs"
    finally:
        gc.enable()


def test_copies_and_pickles_of_a_linear_read_their_own_weights():
    """``Linear``'s inner ops hold their owner weakly; a deep copy or a pickled-and-loaded copy
    still computes with the copy's own weight and bias."""
    import copy
    import io

    lin = fo.Linear(8, 4)
    for clone in (copy.deepcopy(lin), torch.load(_saved(lin, io), weights_only=False)):
        with torch.no_grad():
            clone.weight.mul_(2.0)
            clone.bias.add_(1.0)
        x = torch.randn(3, 8)
        torch.testing.assert_close(clone(x), torch.nn.functional.linear(x, clone.weight, clone.bias))
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
        assert clone.basic_ops[0].param_owner("weight") is clone and lin.basic_ops[0].param_owner("weight") is lin


def _saved(module, io):
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    return buf


_FIRST_CALL_UNDER_A_DISPATCH_MODE = """
import gc, sys, weakref, torch
import fusible_ops as fo
from torch.utils._python_dispatch import TorchDispatchMode

class Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))

gc.disable()
model = fo.Sequential(fo.Linear(8, 8), fo.GELU())
refs = [weakref.ref(p) for p in model.parameters()] + [weakref.ref(model)]
def step(m):  # (a frame holding the model, as a training loop's)
    with Passthrough():
        m(torch.randn(4, 8, requires_grad=True)).sum().backward()

step(model)
del model
print(sum(r() is not None for r in refs))
"""


def test_first_call_under_a_dispatch_mode_in_a_fresh_process_frees_the_model():
    """The first call under a dispatch mode in a process (the replay recorder is one) makes torch
    import torch._dynamo, whose torch.fx.wrap leaves a frame cycle holding the calling stack. With
    ``import fusible_ops`` having imported it, no model is caught in it (a fresh interpreter: this
    one has imported torch._dynamo already)."""
    import os
    import subprocess
    import sys

    # (a plain process, as a user's: none of the suite's settings)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "FUSIBLE_OPS_"))}
    env["CUDA_VISIBLE_DEVICES"] = ""
    out = subprocess.run([sys.executable, "-c", _FIRST_CALL_UNDER_A_DISPATCH_MODE], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "0", f"objects outlive `del model`: {out.stdout}"


@pytest.mark.gpu
def test_deleted_cuda_model_frees_its_parameters_after_replayed_calls():
    """On CUDA a plan's calls are replayed from C++ from the second call (fusible_ops.replay): its
    replayer holds the fuser and the plan weakly, so ``del`` still frees the parameters."""
    from fusible_ops import replay

    gc.collect()
    gc.disable()
    try:
        torch.manual_seed(0)
        kw = dict(device="cuda", dtype=torch.bfloat16)
        model = fo.Sequential(fo.RMSNorm(256, **kw), fo.Linear(256, 512, bias=False, **kw), fo.SwiGLU(),
                              fo.Linear(256, 256, bias=False, **kw), fo.AddExtraInput(from_input=True))
        refs = [weakref.ref(p) for p in model.parameters()] + [weakref.ref(model)]
        x = torch.randn(512, 256, **kw, requires_grad=True)  # (above the native-autograd size)
        for _ in range(4):
            model(x).sum().backward()
        fusers = [s for s, _ in model._stages if isinstance(s, fo.OperationFuser)]
        assert replay.extension() is None or any(
            p.replay is not None and p.replay.replayed for f in fusers for p in f._plans.values())
        del model, fusers
        alive = [r for r in refs if r() is not None]
        assert not alive, f"{len(alive)} of {len(refs)} objects outlive `del model` until the cyclic GC runs"
    finally:
        gc.enable()
