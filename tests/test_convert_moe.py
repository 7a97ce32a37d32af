"""fusible_ops.convert on Hugging Face MoE models (tiny random configs built in code: no download).

Qwen3-MoE (softmax top-k, not normalized; normalized too), Mixtral (normalized) and Qwen2-MoE (a
shared expert behind a sigmoid gate), against the unconverted model in float64 at the same weights
(each step loads the converted model's state dict into it): loss with labels and with the
load-balancing loss transformers adds from the recorded router logits, the aux loss and router
logits themselves, logits, every parameter's gradient over AdamW steps within the tolerance
table; state dicts and save_pretrained / from_pretrained both ways; greedy generate(); FP8
emulation within the SQNR table; the MoE fusion; what is left alone and why.
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch

import fusible_ops as fo
from fusible_ops.convert.modules import ConvertedMLP
from fusible_ops.convert.moe import ConvertedMoE
from fusible_ops.testing import SQNR_DB, assert_close, assert_close_norm, assert_close_scaled, assert_sqnr

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from test_convert import (batch, check_fp8_step, check_greedy_generate, check_save_pretrained_both_ways,  # noqa: E402
                          check_state_dict_round_trips, grads, train_against)  # (the dense models' tests' helpers)
from test_convert import tiny as dense_tiny  # noqa: E402

MOE_BLOCK = {"qwen3_moe": "Qwen3MoeSparseMoeBlock", "mixtral": "MixtralSparseMoeBlock",
             "qwen2_moe": "Qwen2MoeSparseMoeBlock"}


def tiny(arch: str = "qwen3_moe", seed: int = 0, **overrides) -> torch.nn.Module:
    """A 2-layer MoE model of ``arch`` (tests/test_convert.py's ``ARCHS``: hidden 64, 8 experts of
    width 32, top-2, vocab 128), its aux-loss coefficient 0.1 (so its gradient counts here)."""
    return dense_tiny(arch, seed, **{"router_aux_loss_coef": 0.1, **overrides})


def float64_twin(model) -> torch.nn.Module:
    """The unconverted model in float64 (transformers' eager experts: its grouped_mm takes no float64)."""
    ref = copy.deepcopy(model).double()
    ref.config._experts_implementation = "eager"
    return ref


# -- what converts ------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,routing", [("qwen3_moe", "Router(softmax, top-2)"),
                                          ("mixtral", "Router(softmax, top-2, normalized)")])
def test_report_names_what_converted_and_the_moe_fuses(arch, routing):
    model = tiny(arch)
    fo.convert(model)
    report = model.fusible_ops_report
    blocks = [f"model.layers.{i}.mlp" for i in range(2)]
    assert report.left_alone == []
    moe = [e for e in report.converted if e.source == MOE_BLOCK[arch]]
    assert [e.name for e in moe] == blocks
    assert moe[0].into.startswith(f"fo.Sequential({routing}, Dispatch, GroupedLinear, SwiGLU, GroupedLinear, Combine)")
    assert "lm_head" in report.names()
    block = model.model.layers[0].mlp
    assert isinstance(block, ConvertedMoE)
    assert f"{MOE_BLOCK[arch]} -> fo.Sequential({routing}" in str(report)
    ids, labels = batch()
    model(input_ids=ids, labels=labels).loss.backward()
    for pass_ in ("forward", "backward"):
        assert [g["rule"] for g in block.fusion_plan(pass_)] == [None, "moe_dispatch_mlp", None]
    assert "MoE routing (8 experts, top_k=2)" in block.explain()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_parameters_are_the_original_objects(arch):
    """Router, experts (and shared-expert gate) keep their modules and Parameter objects: the
    names and an optimizer built before convert() are unchanged (a shared expert's gate/up
    become one parameter, as for any MLP)."""
    model = tiny(arch)
    before = dict(model.named_parameters())
    fo.convert(model)
    after = dict(model.named_parameters())
    block = model.model.layers[0].mlp
    for name in (n for n in before if ".mlp." in n and ".shared_expert." not in n):
        assert after[name] is before[name], name
    if arch == "qwen2_moe":
        report = model.fusible_ops_report
        assert isinstance(block.shared_expert, ConvertedMLP)
        assert "model.layers.0.mlp.shared_expert" in report.names()
        entry = next(e for e in report.converted if e.name == "model.layers.0.mlp")
        assert entry.into.endswith(" + sigmoid(shared_expert_gate(x)) * shared_expert(x)")


# -- numerics --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,overrides", [("qwen3_moe", {}), ("qwen3_moe", {"norm_topk_prob": True}),
                                            ("mixtral", {}), ("qwen2_moe", {})])
def test_training_matches_unconverted_float32(arch, overrides):
    """Three AdamW steps of the converted float32 model; at each, the unconverted model in float64
    at the same weights gives the same loss, logits and gradients (the table's float32 entries).
    Steps 1 and 2 pass ``output_router_logits=True``: the loss then includes transformers'
    load-balancing loss, computed from the router logits the converted blocks still record."""
    model = tiny(arch, **overrides)
    ref = float64_twin(model)
    conv = fo.convert(model)
    assert all(isinstance(conv.model.layers[i].mlp, ConvertedMoE) for i in range(2))

    def router_outputs(step, out, want):
        if not step:
            assert out.aux_loss is None
            return
        assert_close(out.aux_loss, want.aux_loss, torch.float32, msg=f"step {step} aux loss")
        assert len(out.router_logits) == 2
        for got_l, want_l in zip(out.router_logits, want.router_logits):
            assert_close(got_l, want_l, torch.float32, msg="router logits")

    train_against(conv, ref, lambda step: {"output_router_logits": True} if step else {}, router_outputs)


def test_training_matches_unconverted_bf16():
    """bf16: loss and gradients against the float64 model, judged by the table's baseline rule
    (within the bf16 entry, or no worse than BASELINE_FACTOR times the unconverted model's error
    in bf16). The converted router computes its logits in float32 (the original rounds them to
    bf16 first): no less accurate, and the same experts on this batch."""
    model = tiny("qwen3_moe", norm_topk_prob=True)
    ref = float64_twin(model)
    base = copy.deepcopy(model).bfloat16()
    conv = fo.convert(copy.deepcopy(model).bfloat16())
    ids, labels = batch()
    losses = [m(input_ids=ids, labels=labels, output_router_logits=True).loss for m in (conv, ref, base)]
    for loss in losses:
        loss.backward()
    assert_close_scaled(losses[0].float(), losses[1], torch.bfloat16, "loss", baseline=losses[2].float())
    got, want, plain = grads(conv), dict(ref.named_parameters()), dict(base.named_parameters())
    for name, p in want.items():
        assert got[name].dtype == torch.bfloat16, name
        assert_close_scaled(got[name], p.grad, torch.bfloat16, name, baseline=plain[name].grad)


def test_router_module_called_only_once_hooked():
    """The converted block calls the original router module (for its logits) only once it has
    forward hooks: transformers installs its recording hooks on the first call with
    ``output_router_logits`` and keeps them. A model never asked for router logits pays for no
    second router GEMM."""
    model = fo.convert(tiny("qwen3_moe"))
    ids, _ = batch()
    router_cls = type(model.model.layers[0].mlp.gate)
    calls = []
    original = router_cls.forward

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    with mock.patch.object(router_cls, "forward", counted):
        model(input_ids=ids)
        assert calls == []
        assert len(model(input_ids=ids, output_router_logits=True).router_logits) == 2
        assert len(calls) == 2


def test_gradient_checkpointing_with_router_logits():
    """HF gradient checkpointing (non-reentrant: the recomputation must save what the forward
    saved) on the converted model, with and without the load-balancing loss: same loss and
    gradients as without checkpointing."""
    model = fo.convert(tiny("qwen3_moe"))
    ckpt = copy.deepcopy(model)
    (getattr(ckpt, "activation_checkpointing_enable", None) or ckpt.gradient_checkpointing_enable)()
    assert ckpt.model.layers[0].gradient_checkpointing
    ids, labels = batch()
    for kw in ({}, {"output_router_logits": True}):
        for m in (model, ckpt):
            m.zero_grad()
            m(input_ids=ids, labels=labels, **kw).loss.backward()
        a, b = grads(model), grads(ckpt)
        for name, g in a.items():
            assert_close_norm(b[name], g, torch.float32, msg=f"{kw} {name}")


def test_torch_compile_no_graph_break_one_graph():
    """``torch.compile`` (aot_eager on CPU) of a converted MoE model training with labels: no graph
    break, one graph over steps with new inputs, the eager model's loss. (With
    ``output_router_logits`` transformers' own hook installation breaks the graph, converted or
    not: docs/convert.md.)"""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = fo.convert(tiny("qwen3_moe"))
    twin = copy.deepcopy(model)
    compiled = torch.compile(model, backend="aot_eager")
    for step in range(2):
        ids, labels = batch(step)
        loss, want = compiled(input_ids=ids, labels=labels).loss, twin(input_ids=ids, labels=labels).loss
        loss.backward()
        assert_close(loss, want, torch.float32)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def test_routing_ties_resolve_as_the_original():
    """Two experts with the same router row tie on every token; on CPU the converted router's
    top-k is torch.topk of the same softmax, so it picks what the original picks."""
    model = tiny("mixtral")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight[1].copy_(layer.mlp.gate.weight[0])
    ref = copy.deepcopy(model)
    conv = fo.convert(model)
    ids, labels = batch()
    assert_close(conv(input_ids=ids, labels=labels).loss, ref(input_ids=ids, labels=labels).loss, torch.float32)
    with torch.no_grad():
        assert_close(conv(input_ids=ids).logits, ref(input_ids=ids).logits, torch.float32)


# -- checkpoints -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_state_dict_round_trips(arch):
    """Keys (in order), shapes, dtypes and values stay the original's; load_state_dict both ways."""
    conv, other = check_state_dict_round_trips(lambda seed: tiny(arch, seed=seed))
    ids, _ = batch()
    with torch.no_grad():  # (the ops compute with what was loaded)
        assert_close(conv.eval()(input_ids=ids).logits, other.eval()(input_ids=ids).logits, torch.float32)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_save_pretrained_from_pretrained_both_ways(arch, tmp_path):
    check_save_pretrained_both_ways(tiny(arch), tmp_path)


# -- generation, FP8 ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_greedy_generate_same_tokens(arch):
    check_greedy_generate(tiny(arch))


def test_fp8_emulation_within_sqnr_table():
    """Float8CurrentScaling (emulated on CPU) through ``recipe=``: the experts' grouped GEMMs run
    FP8 (the router stays float32), and the loss (with the aux loss), logits and every gradient
    stay within the SQNR table against the float64 model. Format e4m3, as tests/test_convert.py
    (under "hybrid" the E5M2 gradients compound through the layers below the per-op table)."""
    recipe = fo.Float8CurrentScaling(fp8_format="e4m3")
    model = tiny("qwen3_moe")
    ref = float64_twin(model)
    conv = fo.convert(model, recipe=recipe)
    ids, fmt = check_fp8_step(conv, ref, recipe.fp8_format, output_router_logits=True)
    owners = conv.model.layers[0].mlp.fusible_weights
    assert owners["experts_gate_up_proj"].fp8_weight_casts == 1 and owners["experts_down_proj"].fp8_weight_casts == 1
    conv.eval()
    with torch.no_grad():
        assert_sqnr(conv(input_ids=ids).logits, ref(input_ids=ids).logits, SQNR_DB["output", fmt], msg="logits")
