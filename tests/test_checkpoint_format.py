"""Checkpoints without pickle: everything the library keeps between steps is a plain tensor in
``state_dict()`` (no ``get_extra_state``), so a checkpoint loads with
``torch.load(weights_only=True)`` and round-trips through safetensors; the format is versioned
(``fusible_ops.training_state``); the golden checkpoint in tests/data (written by
``python -m fusible_ops.testing.golden``) still loads with the values it was written with.
"""

from __future__ import annotations

import inspect
import io
import os
import pathlib
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load, load_file, save

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import training_loop as T  # noqa: E402

import fusible_ops as fo  # noqa: E402
from fusible_ops.testing import golden  # noqa: E402
from fusible_ops.training_state import FORMAT_KEY, FORMAT_VERSION  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
GOLDEN = pathlib.Path(__file__).parent / "data" / "golden_checkpoint.safetensors"


def _library_modules() -> list:
    import fusible_ops

    found = set()
    for name, mod in list(sys.modules.items()):
        if name.startswith("fusible_ops"):
            for _, cls in inspect.getmembers(mod, inspect.isclass):
                if issubclass(cls, torch.nn.Module) and cls.__module__.startswith(fusible_ops.__name__):
                    found.add(cls)
    return sorted(found, key=lambda c: c.__qualname__)


def test_no_module_keeps_pickled_extra_state():
    classes = _library_modules()
    assert fo.Linear in classes and fo.Router in classes and fo.Sequential in classes
    for cls in classes:
        for hook in ("get_extra_state", "set_extra_state"):
            assert getattr(cls, hook) is getattr(torch.nn.Module, hook), f"{cls.__qualname__} overrides {hook}"


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_loads_weights_only_and_round_trips_through_safetensors(device):
    """After training under delayed scaling, the model's state dict holds only tensors; it loads
    with weights_only=True (as does the optimizer's), round-trips through safetensors, and a fresh
    model loaded from it computes what the trained one does, bit for bit."""
    recipe = T.RECIPES["delayed"]
    model = T.build(device)
    opt = T.optimizer(model)
    T.run(model, opt, recipe, range(2))
    state = model.state_dict()
    assert all(type(v) is torch.Tensor for v in state.values())
    assert {"dense.1.fp8_amax_history", "dense.1." + FORMAT_KEY, "moe.0.expert_load", "moe.2.fp8_scale"} <= set(state)

    buf = io.BytesIO()
    torch.save({"model": state, "optimizer": opt.state_dict()}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    from_st = load(save(dict(state)))
    for k, v in state.items():
        assert torch.equal(loaded["model"][k], v) and torch.equal(from_st[k].to(device), v), k
        assert from_st[k].dtype == v.dtype, k

    x = T.batch(5, device)[0]
    with torch.no_grad():
        expected = T.forward(model.eval(), x, recipe)
    for sd in (loaded["model"], from_st):
        fresh = T.build(device, seed=7)
        fresh.load_state_dict(sd)  # (strict: every key known, the version entries included)
        T.optimizer(fresh).load_state_dict(loaded["optimizer"])
        with torch.no_grad():
            got = T.forward(fresh.eval(), x, recipe)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_format_version_entry_and_check():
    lin = fo.Linear(32, 32)
    assert list(lin.state_dict()) == ["weight", "bias"]  # no library state: torch.nn.Linear's keys
    assert list(fo.Router(32, 4).state_dict()) == ["weight"]
    with fo.autocast(recipe=fo.Float8DelayedScaling(amax_history_len=2)):
        lin(torch.randn(16, 32)).sum().backward()
    sd = lin.state_dict()
    assert sd[FORMAT_KEY].dtype == torch.int64 and sd[FORMAT_KEY].item() == FORMAT_VERSION
    assert fo.Router(32, 4, score="sigmoid", expert_bias=True).state_dict()[FORMAT_KEY].item() == FORMAT_VERSION

    seq = fo.Sequential(fo.Linear(32, 32), fo.GELU())
    old = {k: v for k, v in sd.items() if k != FORMAT_KEY}  # (a checkpoint from before the entry)
    seq[0].load_state_dict(old)
    assert torch.equal(seq[0].fp8_scale, lin.fp8_scale)
    seq.load_state_dict({"0." + k: v for k, v in sd.items()})
    newer = {"0." + k: v for k, v in sd.items()}
    newer["0." + FORMAT_KEY] = torch.tensor(FORMAT_VERSION + 1)
    with pytest.raises(RuntimeError, match=rf"Linear \(0\): .*format version {FORMAT_VERSION + 1}, newer than"):
        seq.load_state_dict(newer)
    newer["0." + FORMAT_KEY] = torch.tensor(1.5)
    with pytest.raises(RuntimeError, match="must be a one-element tensor holding an integer"):
        seq.load_state_dict(newer)
    seq.load_state_dict({"0." + k: v.double() for k, v in sd.items()})  # (a state dict converted as a whole)
    assert seq[0].state_dict()[FORMAT_KEY].dtype == torch.int64
    fo.Linear(32, 32).load_state_dict(torch.nn.Linear(32, 32).state_dict())


def test_rng_state_round_trip():
    state = fo.training_state.rng_state()
    a = torch.rand(3)
    fo.training_state.set_rng_state(load(save(state)))  # (plain uint8 tensors: safetensors holds them)
    assert torch.equal(torch.rand(3), a)
    with pytest.raises(KeyError, match="unknown generator 'mps'"):
        fo.training_state.set_rng_state({"mps": state["cpu"]})


def _div(fmax: float, amax: torch.Tensor) -> torch.Tensor:
    """``fmax / amax`` rounded once, in float32 (``float / tensor`` multiplies by a reciprocal)."""
    return torch.full_like(amax, fmax) / amax


@pytest.mark.parametrize("device", DEVICES)
def test_golden_checkpoint_loads_with_its_values(device):
    """The checkpoint written by ``python -m fusible_ops.testing.golden`` loads (strictly) into a
    freshly built model and holds what this format says: the version, the delayed-scaling state
    (input and gradient columns: the scale of the last update from the entries before the newest;
    the weight column: its amax at the newest entry, not rolled), the router's buffers."""
    with safe_open(str(GOLDEN), "pt") as f:
        assert f.metadata()["fusible_ops_format"] == str(FORMAT_VERSION)
    sd = load_file(str(GOLDEN), device=device)
    model = golden.golden_model().to(device)
    model.load_state_dict(sd)
    state = model.state_dict()
    assert sorted(state) == sorted(sd)
    for k, v in sd.items():
        assert state[k].dtype == v.dtype and torch.equal(state[k], v), k
    for i in ("0", "2", "4"):
        assert state[f"{i}.{FORMAT_KEY}"].item() == FORMAT_VERSION
    for i in ("0", "4"):  # the Linear and the GroupedLinear
        hist, scale = state[f"{i}.fp8_amax_history"], state[f"{i}.fp8_scale"]
        assert hist.shape == (golden.RECIPE.amax_history_len, 3) and scale.shape == (3,)
        assert (hist[: golden.STEPS, 0] > 0).all() and (hist[golden.STEPS:] == 0).all()
        assert hist[0, 1] > 0 and (hist[1:, 1] == 0).all()  # the weight column: not rolled
        assert scale[0] == _div(448.0, hist[1:, 0].max()) and scale[2] == _div(57344.0, hist[1:, 2].max())
        assert scale[1] == _div(448.0, hist[0, 1])
    load_, bias = state["2.expert_load"], state["2.expert_bias"]
    assert load_.dtype == torch.int64 and load_.sum() == golden.TOKENS * 2 and bias.abs().sum() > 0
    with torch.no_grad(), fo.autocast(recipe=golden.RECIPE):
        y, _ = model.eval()(torch.randn(16, 16, device=device))
    assert torch.isfinite(y).all()
    for k, v in model.state_dict().items():  # (an evaluation call changed nothing)
        assert torch.equal(v, sd[k]), k
