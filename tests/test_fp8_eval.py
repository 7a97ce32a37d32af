"""Evaluation calls change no training state: FP8 delayed-scaling histories and scales, a router's
expert load, and so the training curve, are the same however often a user evaluates.

An evaluation call is one made with grad mode off (``torch.no_grad()``) or with the model in eval
mode (``model.eval()``): it uses the current scales and records nothing (docs/fp8.md, "Delayed
scaling in training and evaluation"). Training runs with evaluations between the steps equal
those without, bit for bit (the same ops on the same shapes: ``torch.equal``). The model:
tests/training_loop.py (dense block with a frozen weight, MoE layer; FP8 in the dense linears, the
producers' hand-off, the grouped linears fused and unfused).
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import training_loop as T  # noqa: E402

import fusible_ops as fo  # noqa: E402
from fusible_ops.fusion_rules import disabled  # noqa: E402
from fusible_ops.kernels import fp8_cast as C  # noqa: E402
from fusible_ops.kernels import fp8_gemm as G  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
EVALS = ("no_grad", "eval_mode", "no_grad_eval_mode")
STEPS = 3
D = T.D


def _evaluate(model, recipe, kind: str, device) -> None:
    """One evaluation forward of every batch the run trains on. (Dropout in training mode draws
    its seed from torch's generator also under no_grad: that draw is the caller's RNG, forked.)"""
    grad = contextlib.nullcontext() if kind == "eval_mode" else torch.no_grad()
    if kind != "no_grad":
        model.eval()
    devices = [torch.device(device).index or 0] if torch.device(device).type == "cuda" else []
    try:
        with grad, torch.random.fork_rng(devices=devices):
            for t in range(STEPS):
                y, aux = T.forward(model, T.batch(t, device)[0], recipe)
                assert torch.isfinite(y).all()
    finally:
        model.train()


def _train(device, recipe, evals: str = "", rules_off=()) -> dict:
    model = T.build(device)
    opt = T.optimizer(model)
    steps = []
    with disabled(*rules_off) if rules_off else contextlib.nullcontext():
        for t in range(STEPS):
            if evals:
                _evaluate(model, recipe, evals, device)
            steps += T.run(model, opt, recipe, range(t, t + 1))
        if evals:
            _evaluate(model, recipe, evals, device)
        out = {"steps": steps, "state": {k: v.clone() for k, v in model.state_dict().items()},
               "opt": T.flat_optimizer_state(opt)}
        T.forward(model, T.batch(0, device)[0], recipe)  # (a training call: the plan the steps ran, for its report)
        out["plan"] = [g["rule"] for g in model["moe"].fusion_plan()]
    return out


def _assert_same_run(a: dict, b: dict) -> None:
    for t, (sa, sb) in enumerate(zip(a["steps"], b["steps"])):
        assert torch.equal(sa["loss"], sb["loss"]), f"step {t}: loss"
        for k in sa["grads"]:
            assert torch.equal(sa["grads"][k], sb["grads"][k]), f"step {t}: gradient of {k}"
    assert sorted(a["state"]) == sorted(b["state"])
    for k in a["state"]:
        assert torch.equal(a["state"][k], b["state"][k]), f"state {k} differs"
    for k in a["opt"]:
        assert torch.equal(a["opt"][k], b["opt"][k]), f"optimizer state {k} differs"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["delayed", "none"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_evaluations_leave_training_bit_identical(device, recipe, fused):
    r = T.RECIPES[recipe]
    off = () if fused else ("moe_dispatch_mlp", "grouped_mlp")
    base = _train(device, r, rules_off=off)
    assert ("moe_dispatch_mlp" in base["plan"]) == fused
    if recipe == "delayed":  # the state the evaluations must not touch exists
        assert (base["state"]["dense.1.fp8_amax_history"][:, 0] > 0).sum() == 3  # one input entry per step
        assert base["state"]["moe.2.fp8_amax_history"][:, 0].gt(0).any()
    assert base["state"]["moe.0.expert_load"].sum() == 0 and base["state"]["moe.0.expert_bias"].abs().sum() > 0
    for kind in EVALS:
        _assert_same_run(base, _train(device, r, kind, rules_off=off))


@pytest.mark.parametrize("device", DEVICES)
def test_evaluation_casts_with_the_current_scales_and_creates_no_state(device):
    """A model evaluated before any training creates no FP8 buffers (its keys stay torch.nn's)
    and counts no expert load. After training, an evaluation call (no grad, eval mode, or both)
    casts its input with the ``fp8_scale`` training left and the weight with its current amax,
    and changes nothing."""
    recipe = T.RECIPES["delayed"]
    model = T.build(device)
    keys = list(model.state_dict())
    _evaluate(model, recipe, "no_grad", device)
    _evaluate(model, recipe, "eval_mode", device)
    assert list(model.state_dict()) == keys and model["moe"][0].expert_load.sum() == 0

    torch.manual_seed(0)
    seq = fo.Sequential(fo.Linear(D, D, device=device))
    lin = seq[0]
    x = torch.randn(32, D, device=device)
    for _ in range(2):
        with fo.autocast(recipe=recipe):
            seq(x * 2).sum().backward()
    before = {k: v.clone() for k, v in lin.state_dict().items()}
    x_scale = lin.fp8_scale[0:1].clone()
    w = lin.weight.detach()
    w_scale = C.scale_from_amax_ref(C.tensor_amax(w), 448.0)
    xq, _ = C.cast_tensor(x, x_scale, torch.float8_e4m3fn)
    wq, _ = C.cast_tensor(w, w_scale, torch.float8_e4m3fn)
    expected = G.fp8_gemm((xq, (1.0 / x_scale).reshape(())), (wq, (1.0 / w_scale).reshape(())), "tensor", "tensor",
                          torch.float32) + lin.bias.detach()
    for grad, mode in ((False, True), (True, False), (False, False)):
        lin.train(mode)
        with torch.set_grad_enabled(grad), fo.autocast(recipe=recipe):
            y = seq(x)
        torch.testing.assert_close(y.detach(), expected, msg=f"grad={grad}, train={mode}")
        for k, v in lin.state_dict().items():
            assert torch.equal(v, before[k]), f"grad={grad}, train={mode}: {k} changed"
    lin.train()
    with fo.autocast(recipe=recipe):  # a training call records again
        seq(x)
    assert not torch.equal(lin.fp8_amax_history, before["fp8_amax_history"])
