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
from fusible_ops.convert import to_original_names
from fusible_ops.convert.modules import ConvertedMLP
from fusible_ops.convert.moe import ConvertedMoE
from fusible_ops.testing import SQNR_DB, assert_close, assert_close_norm, assert_close_scaled, assert_sqnr

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

B, S, V, E = 2, 16, 128, 8
MOE_BLOCK = {"qwen3_moe": "Qwen3MoeSparseMoeBlock", "mixtral": "MixtralSparseMoeBlock",
             "qwen2_moe": "Qwen2MoeSparseMoeBlock"}


def tiny(arch: str = "qwen3_moe", seed: int = 0, **overrides) -> torch.nn.Module:
    """A 2-layer MoE model of ``arch``: hidden 64, 8 experts of width 32, top-2, 4 heads of 16 (2
    KV heads), vocab 128; the aux-loss coefficient 0.1 (so its gradient counts in the tests)."""
    cfg = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               vocab_size=V, max_position_embeddings=64, num_experts_per_tok=2, router_aux_loss_coef=0.1,
               attn_implementation="eager", pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg.update({"qwen3_moe": dict(num_experts=E, moe_intermediate_size=32, intermediate_size=128),
                "mixtral": dict(num_local_experts=E, intermediate_size=32),
                "qwen2_moe": dict(num_experts=E, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                  intermediate_size=128)}[arch])
    cfg.update(overrides)
    config_cls, model_cls = {
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    return model_cls(config_cls(**cfg))


def float64_twin(model) -> torch.nn.Module:
    """The unconverted model in float64 (transformers' eager experts: its grouped_mm takes no float64)."""
    ref = copy.deepcopy(model).double()
    ref.config._experts_implementation = "eager"
    return ref


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, S), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # (ignored tokens)
    return ids, labels


def grads(model) -> dict:
    return to_original_names(model, {n: p.grad for n, p in model.named_parameters()})


def same_state(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k, v in sa.items():
        assert v.shape == sb[k].shape and v.dtype == sb[k].dtype, k
        assert torch.equal(v, sb[k]), k


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
        assert isinstance(block.shared_expert, ConvertedMLP)
        assert "model.layers.0.mlp.shared_expert" in model.fusible_ops_report.names()
        assert "sigmoid(shared_expert_gate(x)) * shared_expert(x)" in model.fusible_ops_report.converted[0].into \
            or any("shared_expert_gate" in e.into for e in model.fusible_ops_report.converted)


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
    opt = torch.optim.AdamW(conv.parameters(), lr=1e-2)
    before = {k: v.clone() for k, v in conv.state_dict().items()}
    for step in range(3):
        ref.load_state_dict(conv.state_dict())
        ids, labels = batch(step)
        kw = {"output_router_logits": True} if step else {}
        conv.zero_grad()
        ref.zero_grad()
        out = conv(input_ids=ids, labels=labels, **kw)
        want = ref(input_ids=ids, labels=labels, **kw)
        assert_close(out.loss, want.loss, torch.float32, msg=f"step {step} loss")
        if step:
            assert_close(out.aux_loss, want.aux_loss, torch.float32, msg=f"step {step} aux loss")
            assert len(out.router_logits) == 2
            for got_l, want_l in zip(out.router_logits, want.router_logits):
                assert_close(got_l, want_l, torch.float32, msg="router logits")
        else:
            assert out.aux_loss is None
        out.loss.backward()
        want.loss.backward()
        got = grads(conv)
        for name, p in ref.named_parameters():
            assert got[name] is not None, name
            assert_close_norm(got[name], p.grad, torch.float32, msg=f"step {step} {name}")
        with torch.no_grad():
            assert_close(conv(input_ids=ids).logits, ref(input_ids=ids).logits, torch.float32, msg="logits")
        opt.step()
    after = conv.state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in before), "every parameter trained"


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
    model = tiny(arch)
    original = copy.deepcopy(model)
    conv = fo.convert(model)
    same_state(conv, original)
    other = tiny(arch, seed=1)
    conv.load_state_dict(other.state_dict())
    same_state(conv, other)
    fresh = tiny(arch, seed=2)
    fresh.load_state_dict(conv.state_dict())
    same_state(fresh, other)
    ids, _ = batch()
    with torch.no_grad():  # (the ops compute with what was loaded)
        assert_close(conv.eval()(input_ids=ids).logits, other.eval()(input_ids=ids).logits, torch.float32)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_save_pretrained_from_pretrained_both_ways(arch, tmp_path):
    model = tiny(arch)
    original = copy.deepcopy(model)
    conv = fo.convert(model)
    cls = type(original)
    conv.save_pretrained(tmp_path / "converted")
    same_state(cls.from_pretrained(tmp_path / "converted"), original)
    original.save_pretrained(tmp_path / "original")
    again = fo.convert(cls.from_pretrained(tmp_path / "original"))
    same_state(again, original)
    assert again.fusible_ops_report.names() == conv.fusible_ops_report.names()


# -- generation, FP8 ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_greedy_generate_same_tokens(arch):
    model = tiny(arch).eval()
    ref = copy.deepcopy(model)
    conv = fo.convert(model)
    prompt, _ = batch()
    kw = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False)
    want = ref.generate(prompt[:, :5], **kw)
    got = conv.generate(prompt[:, :5], **kw)
    assert got.shape == (B, 25)
    assert torch.equal(got, want)


def test_fp8_emulation_within_sqnr_table():
    """Float8CurrentScaling (emulated on CPU) through ``recipe=``: the experts' grouped GEMMs run
    FP8 (the router stays float32), and the loss (with the aux loss), logits and every gradient
    stay within the SQNR table against the float64 model. Format e4m3, as tests/test_convert.py
    (under "hybrid" the E5M2 gradients compound through the layers below the per-op table)."""
    recipe = fo.Float8CurrentScaling(fp8_format="e4m3")
    model = tiny("qwen3_moe")
    ref = float64_twin(model)
    conv = fo.convert(model, recipe=recipe)
    ids, labels = batch()
    loss = conv(input_ids=ids, labels=labels, output_router_logits=True).loss
    want = ref(input_ids=ids, labels=labels, output_router_logits=True).loss
    loss.backward()
    want.backward()
    fmt = recipe.fp8_format
    assert_sqnr(loss, want, SQNR_DB["output", fmt], msg="loss")
    got = grads(conv)
    for name, p in ref.named_parameters():
        assert_sqnr(got[name], p.grad, SQNR_DB["grad", fmt], msg=name)
    owners = conv.model.layers[0].mlp.fusible_weights
    assert owners["experts_gate_up_proj"].fp8_weight_casts == 1 and owners["experts_down_proj"].fp8_weight_casts == 1
    conv.eval()
    with torch.no_grad():
        assert_sqnr(conv(input_ids=ids).logits, ref(input_ids=ids).logits, SQNR_DB["output", fmt], msg="logits")
