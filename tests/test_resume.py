"""Exact resume: 4 training steps in one process equal 2 steps, a checkpoint, and 2 more steps in a
FRESH process that loads it, bit for bit (losses of every step, every gradient the optimizer
used, parameters, optimizer state, the library's buffers), without FP8 and under each FP8 recipe.

The model (tests/training_loop.py): a dense block (RMSNorm, Linear, SwiGLU, Linear, + its input,
Dropout, a Linear with a frozen weight) and a MoE layer (a sigmoid router with balancing buffers,
two GroupedLinears), weights under ``main_grad`` with delayed weight gradients, AdamW.

The checkpoint is what docs/training.md says to save: the model's ``state_dict()`` (in
safetensors), the optimizer's ``state_dict()`` and the RNG states
(:func:`fusible_ops.training_state.rng_state`) with ``torch.save``, loaded with
``torch.load(weights_only=True)``. One subprocess resumes every recipe (imports cost seconds).
Both processes run under ``torch.use_deterministic_algorithms(True)``, as docs/training.md says
exact resume needs on CUDA (the GEMM kernels' autotuner picks configs by timing, so a fresh
process may pick another; the flag makes them use fixed configs).
Run as a script, this file is that subprocess: ``python tests/test_resume.py CKPT_DIR OUT DEVICE``.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import training_loop as T  # noqa: E402

import fusible_ops as fo  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
STEPS, SPLIT = 4, 2


def save_checkpoint(directory: pathlib.Path, model, opt) -> None:
    """The model in safetensors; the optimizer and the RNG states with ``torch.save``."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file(dict(model.state_dict()), str(directory / "model.safetensors"))
    torch.save({"optimizer": opt.state_dict(), "rng": fo.training_state.rng_state()}, directory / "train.pt")


def load_checkpoint(directory: pathlib.Path, model, opt) -> None:
    from safetensors.torch import load_file

    device = next(model.parameters()).device
    model.load_state_dict(load_file(str(directory / "model.safetensors"), device=str(device)))
    train = torch.load(directory / "train.pt", weights_only=True)
    opt.load_state_dict(train["optimizer"])
    fo.training_state.set_rng_state(train["rng"])


@contextlib.contextmanager
def deterministic():
    """``torch.use_deterministic_algorithms(True)`` inside the block (``warn_only``: cuBLAS wants
    ``CUBLAS_WORKSPACE_CONFIG`` set before CUDA starts, which this pytest process cannot promise;
    one stream with the default workspace is deterministic without it)."""
    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)


def _final(model, opt, steps) -> dict:
    return {"steps": steps, "state": {k: v.clone() for k, v in model.state_dict().items()},
            "opt": T.flat_optimizer_state(opt)}


def _resume_main(ckpt_root: str, out: str, device: str) -> None:
    """The fresh process: for each recipe, a new model and optimizer, the checkpoint, 2 steps."""
    results = {}
    torch.use_deterministic_algorithms(True, warn_only=True)
    for name, recipe in T.RECIPES.items():
        model = T.build(device, seed=123)  # (other initial weights: the checkpoint must overwrite them)
        opt = T.optimizer(model)
        load_checkpoint(pathlib.Path(ckpt_root) / name, model, opt)
        results[name] = _final(model, opt, T.run(model, opt, recipe, range(SPLIT, STEPS)))
    torch.save(results, out)


@pytest.fixture(scope="module", params=DEVICES)
def runs(request, tmp_path_factory):
    """Per recipe: the uninterrupted run, the first half, and the fresh process's second half."""
    device = request.param
    root = tmp_path_factory.mktemp(f"resume_{device}")
    whole, first = {}, {}
    with deterministic():
        for name, recipe in T.RECIPES.items():
            model = T.build(device)
            opt = T.optimizer(model)
            whole[name] = _final(model, opt, T.run(model, opt, recipe, range(STEPS)))
            model = T.build(device)
            opt = T.optimizer(model)
            first[name] = T.run(model, opt, recipe, range(SPLIT))
            save_checkpoint(root / name, model, opt)
    out = root / "resumed.pt"
    proc = subprocess.run([sys.executable, __file__, str(root), str(out), device], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resumed = torch.load(out, weights_only=True)
    return whole, first, resumed


def _assert_equal(a: dict, b: dict, what: str) -> None:
    assert sorted(a) == sorted(b), f"{what}: keys differ: {sorted(set(a) ^ set(b))}"
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: {k} differs"


@pytest.mark.parametrize("recipe", list(T.RECIPES))
def test_resume_in_a_fresh_process_is_bit_exact(runs, recipe):
    whole, first, resumed = runs
    w, r = whole[recipe], resumed[recipe]
    steps = first[recipe] + r["steps"]
    assert len(steps) == len(w["steps"]) == STEPS
    for t, (a, b) in enumerate(zip(w["steps"], steps)):
        assert torch.equal(a["loss"], b["loss"]), f"step {t}: loss {a['loss'].item()} != {b['loss'].item()}"
        _assert_equal(a["grads"], b["grads"], f"step {t} gradients")
        assert torch.equal(a["expert_bias"], b["expert_bias"]), f"step {t}: the router's expert_bias differs"
    _assert_equal(w["state"], r["state"], "model state")
    _assert_equal(w["opt"], r["opt"], "optimizer state")
    state = r["state"]
    if recipe == "delayed":  # the library state the checkpoint carried (and the frozen weight's)
        assert state["dense.6.fp8_amax_history"][0, 1] > 0 and state["moe.2.fp8_amax_history"].shape == (4, 3)
    # the balancing state moved in the resumed steps (sign steps of +-rate: after an even number
    # of them the bias can be back at exactly 0, as on CUDA, so any step after the resume counts)
    assert any(s["expert_bias"].abs().sum() > 0 for s in r["steps"])


if __name__ == "__main__":
    _resume_main(*sys.argv[1:4])
