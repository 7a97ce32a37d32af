"""fusible_ops.convert on Hugging Face models (tiny random configs built in code: no download).

Against the unconverted model in float64 at the same weights (each step loads the converted
model's state dict into it): loss, logits and every parameter's gradient over AdamW steps within
the tolerance table (float32; bf16 judged as the table's baseline rule does: no worse than plain
PyTorch in bf16); state dicts and save_pretrained / from_pretrained both ways; greedy generate();
gradient checkpointing; FP8 emulation within the SQNR table; the fusions that run; the report.
(Plain torch models, the report's reasons and the edge cases: tests/test_convert_torch.py.)
"""

from __future__ import annotations

import copy

import pytest
import torch

import fusible_ops as fo
from fusible_ops.convert import to_original_names
from fusible_ops.convert.modules import ConvertedMLP, ConvertedRMSNorm
from fusible_ops.testing import SQNR_DB, assert_close, assert_close_norm, assert_close_scaled, assert_sqnr

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

B, S, V = 2, 16, 128


ARCHS = {  # name -> (config class, model class, config entries of its own)
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, {}),
    # MoE (tests/test_convert_moe.py): 8 experts of width 32, top-2
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(num_experts=8, moe_intermediate_size=32, num_experts_per_tok=2)),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(num_local_experts=8, intermediate_size=32, num_experts_per_tok=2)),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                       num_experts_per_tok=2)),
}


def tiny(arch: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    """A 2-layer model of ``arch`` (:data:`ARCHS`) with hidden 64, MLP 128, 4 heads of 16 (2 KV
    heads), vocab 128."""
    config_cls, model_cls, own = ARCHS[arch]
    cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=V, max_position_embeddings=64,
               attn_implementation="eager", pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg.update(own)
    cfg.update(overrides)
    torch.manual_seed(seed)
    return model_cls(config_cls(**cfg))


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, S), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # (ignored tokens)
    return ids, labels


def grads(model) -> dict:
    """Every parameter's gradient under the ORIGINAL model's names (fused gate/up split)."""
    return to_original_names(model, {n: p.grad for n, p in model.named_parameters()})


def same_state(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k, v in sa.items():
        assert v.shape == sb[k].shape and v.dtype == sb[k].dtype, k
        assert torch.equal(v, sb[k]), k


def train_against(conv, ref, kwargs=lambda step: {}, check=None, steps: int = 3) -> None:
    """``steps`` AdamW steps of the converted float32 model ``conv``; at each, ``ref`` (the
    unconverted model in float64) loads its state dict and must give the same loss, logits and
    gradients (the table's float32 entries). ``kwargs(step)``: more arguments of the step's call;
    ``check(step, out, want)``: more assertions on the two outputs. Every parameter must train."""
    opt = torch.optim.AdamW(conv.parameters(), lr=1e-2)
    before = {k: v.clone() for k, v in conv.state_dict().items()}
    for step in range(steps):
        ref.load_state_dict(conv.state_dict())
        ids, labels = batch(step)
        kw = kwargs(step)
        conv.zero_grad()
        ref.zero_grad()
        out = conv(input_ids=ids, labels=labels, **kw)
        want = ref(input_ids=ids, labels=labels, **kw)
        assert_close(out.loss, want.loss, torch.float32, msg=f"step {step} loss")
        if check is not None:
            check(step, out, want)
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


def check_state_dict_round_trips(make):
    """``make(seed)`` builds an unconverted model: the converted one's state dict is the original's
    (keys in order, shapes, dtypes, values), and ``load_state_dict`` works both ways. Returns the
    converted model and the model whose weights it loaded."""
    model = make(0)
    original = copy.deepcopy(model)
    conv = fo.convert(model)
    same_state(conv, original)
    other = make(1)  # different weights
    conv.load_state_dict(other.state_dict())
    same_state(conv, other)
    fresh = make(2)
    fresh.load_state_dict(conv.state_dict())
    same_state(fresh, other)
    return conv, other


def check_save_pretrained_both_ways(model, path) -> None:
    """``save_pretrained`` of the converted ``model`` loads into an unconverted one, and the
    original's checkpoint loads and converts to the same state and report."""
    original = copy.deepcopy(model)
    cls = type(model)
    conv = fo.convert(model)
    conv.save_pretrained(path / "converted")
    same_state(cls.from_pretrained(path / "converted"), original)
    original.save_pretrained(path / "original")
    again = fo.convert(cls.from_pretrained(path / "original"))
    same_state(again, original)
    assert again.fusible_ops_report.names() == conv.fusible_ops_report.names()


def check_fp8_step(conv, ref, fmt: str, **kwargs) -> tuple:
    """One training call with labels (and ``kwargs``) of ``conv`` (under an FP8 recipe of format
    ``fmt``) and of ``ref`` (float64): the loss and every gradient within the SQNR table. Returns
    the batch's ids and ``fmt``."""
    ids, labels = batch()
    loss, want = conv(input_ids=ids, labels=labels, **kwargs).loss, ref(input_ids=ids, labels=labels, **kwargs).loss
    loss.backward()
    want.backward()
    assert_sqnr(loss, want, SQNR_DB["output", fmt], msg="loss")
    got = grads(conv)
    for name, p in ref.named_parameters():
        assert_sqnr(got[name], p.grad, SQNR_DB["grad", fmt], msg=name)
    return ids, fmt


def check_greedy_generate(model) -> None:
    """Greedy ``generate()`` of the converted ``model`` gives the unconverted model's 20 tokens."""
    model.eval()
    ref = copy.deepcopy(model)
    conv = fo.convert(model)
    prompt, _ = batch()
    kw = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False)
    want = ref.generate(prompt[:, :5], **kw)
    got = conv.generate(prompt[:, :5], **kw)
    assert got.shape == (B, 25)
    assert torch.equal(got, want)


# -- what converts ---------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_report_names_what_converted(arch, capsys):
    model = tiny(arch)
    out = fo.convert(model, verbose=True)
    assert out is model
    report = model.fusible_ops_report
    printed = capsys.readouterr().out
    assert printed.strip() == str(report)
    mlps = [f"model.layers.{i}.mlp" for i in range(2)]
    norms = [f"model.layers.{i}.{n}" for i in range(2) for n in ("input_layernorm", "post_attention_layernorm")]
    if arch == "qwen3":  # (the q/k norms inside attention are RMSNorms over the head dim)
        norms += [f"model.layers.{i}.self_attn.{n}" for i in range(2) for n in ("q_norm", "k_norm")]
    assert sorted(report.names()) == sorted(mlps + norms + ["model.norm", "lm_head"])
    assert report.left_alone == []
    for name in mlps:
        assert isinstance(model.get_submodule(name), ConvertedMLP)
    assert all(isinstance(model.get_submodule(n), ConvertedRMSNorm) for n in norms)
    mlp_cls = {"llama": "LlamaMLP", "qwen3": "Qwen3MLP"}[arch]
    assert f"{mlp_cls} -> fo.Sequential(Linear, SwiGLU, Linear)" in printed
    # the attention stays the model's own, its linears untouched
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear


def test_fusions_run():
    """The LM head's loss runs linear_cross_entropy; an MLP with biases fuses bias and activation
    into its GEMMs; in FP8 the MLP's SwiGLU writes its output in FP8 for the next GEMM."""
    model = fo.convert(tiny("llama", mlp_bias=True))
    ids, labels = batch()
    model(input_ids=ids, labels=labels).loss.backward()
    assert [g["rule"] for g in model.lm_head.fusion_plan()] == ["linear_cross_entropy"]
    mlp = model.model.layers[0].mlp
    assert [g["rule"] for g in mlp.fusion_plan()] == ["linear_bias_activation", "linear_bias"]
    assert "activation_bias_backward" in [g["rule"] for g in mlp.fusion_plan("backward")]


# -- numerics ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen3", True)])
def test_training_matches_unconverted_float32(arch, tied):
    """Three AdamW steps of the converted float32 model; at each, the unconverted model in float64
    at the same weights gives the same loss, logits and gradients (the table's float32 entries).
    Step 2 passes ``num_items_in_batch`` (transformers' gradient-accumulation loss)."""
    model = tiny(arch, tie_word_embeddings=tied)
    ref = copy.deepcopy(model).double()
    conv = fo.convert(model)

    def no_logits(step, out, want):
        assert out.logits is None  # (training with labels: the logits are never made)

    train_against(conv, ref, lambda step: {"num_items_in_batch": torch.tensor(20)} if step == 2 else {}, no_logits)
    if tied:
        assert conv.lm_head.weight is conv.model.embed_tokens.weight


def test_training_matches_unconverted_bf16():
    """bf16: the converted model's loss and gradients against the float64 model, judged as the
    table's baseline rule judges low precision: within the bf16 entry, or no worse than
    BASELINE_FACTOR times the error of the unconverted model run in bf16."""
    model = tiny("llama")
    ref = copy.deepcopy(model).double()
    base = copy.deepcopy(model).bfloat16()
    conv = fo.convert(copy.deepcopy(model).bfloat16())
    ids, labels = batch()
    losses = [m(input_ids=ids, labels=labels).loss for m in (conv, ref, base)]
    for loss in losses:
        loss.backward()
    assert losses[0].dtype == torch.float32
    assert_close_scaled(losses[0], losses[1], torch.bfloat16, "loss", baseline=losses[2])
    got, want, plain = grads(conv), dict(ref.named_parameters()), dict(base.named_parameters())
    for name, p in want.items():
        assert got[name].dtype == torch.bfloat16, name
        assert_close_scaled(got[name], p.grad, torch.bfloat16, name, baseline=plain[name].grad)


def test_gradient_checkpointing():
    """HF gradient checkpointing on the converted model: same loss and gradients as without."""
    model = fo.convert(tiny("llama"))
    ckpt = copy.deepcopy(model)
    enable = getattr(ckpt, "activation_checkpointing_enable", None) or ckpt.gradient_checkpointing_enable
    enable()  # (transformers 5.23 renamed gradient_checkpointing_enable, which warns it is deprecated)
    assert ckpt.model.layers[0].gradient_checkpointing
    ids, labels = batch()
    for m in (model, ckpt):
        m.train()
        m(input_ids=ids, labels=labels).loss.backward()
    a, b = grads(model), grads(ckpt)
    for name, g in a.items():
        assert_close_norm(b[name], g, torch.float32, msg=name)


def test_eval_with_labels_makes_logits_and_skip_logits():
    """In eval mode labels give the logits and the model's own loss; ``skip_logits`` overrides."""
    model = tiny("llama")
    ref = copy.deepcopy(model)
    conv = fo.convert(model).eval()
    ref.eval()
    ids, labels = batch()
    with torch.no_grad():
        out, want = conv(input_ids=ids, labels=labels), ref(input_ids=ids, labels=labels)
        fused = conv(input_ids=ids, labels=labels, skip_logits=True)
        as_tuple = conv(input_ids=ids, labels=labels, skip_logits=True, return_dict=False)
    assert_close(out.logits, want.logits, torch.float32)
    assert_close(out.loss, want.loss, torch.float32)
    assert fused.logits is None and "logits" not in fused
    assert_close(fused.loss, want.loss, torch.float32)
    assert_close(as_tuple[0], want.loss, torch.float32)


# -- checkpoints --------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_state_dict_round_trips(arch):
    """Keys (in order), shapes, dtypes and values stay the original's; load_state_dict both ways."""
    conv, other = check_state_dict_round_trips(lambda seed: tiny(arch, seed=seed))
    # the converted model's own parameter names load too (the fused gate/up under its own name)
    conv2 = fo.convert(tiny(arch, seed=3))
    conv2.load_state_dict(dict(conv.named_parameters()), strict=False)
    same_state(conv2, other)


def test_partial_load_reports_missing_under_original_names():
    conv = fo.convert(tiny("llama"))
    other = tiny("llama", seed=1)
    sd = other.state_dict()
    del sd["model.layers.0.mlp.up_proj.weight"]
    result = conv.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["model.layers.0.mlp.up_proj.weight"]
    assert result.unexpected_keys == []
    got = conv.state_dict()
    assert torch.equal(got["model.layers.0.mlp.gate_proj.weight"], sd["model.layers.0.mlp.gate_proj.weight"])
    with pytest.raises(RuntimeError, match="up_proj.weight"):
        conv.load_state_dict(sd)


def test_save_pretrained_from_pretrained_both_ways(tmp_path):
    check_save_pretrained_both_ways(tiny("qwen3"), tmp_path)


def test_optimizer_built_before_convert_raises():
    model = tiny("llama")
    opt = torch.optim.AdamW(model.parameters())
    fo.convert(model)
    ids, labels = batch()
    model(input_ids=ids, labels=labels).loss.backward()
    with pytest.raises(RuntimeError, match=r"replaced \(model\.layers\.0\.mlp\.gate_proj\.weight.*build the optimizer "
                                           r"after convert"):
        opt.step()
    torch.optim.AdamW(model.parameters()).step()  # (one built after convert steps)


# -- generation, FP8 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_generate_same_tokens(arch):
    check_greedy_generate(tiny(arch))


def test_fp8_emulation_within_sqnr_table():
    """Float8CurrentScaling (emulated on CPU) through ``recipe=``: every converted GEMM runs FP8
    (the LM head's loss too) and the loss, logits and every gradient stay within the SQNR table
    against the float64 model. Format e4m3: under "hybrid" (E5M2 gradients) the gradients of this
    2-layer model measure 19-21 dB, below the per-op table's 20 (docs/convert.md)."""
    recipe = fo.Float8CurrentScaling(fp8_format="e4m3")
    model = tiny("llama")
    ref = copy.deepcopy(model).double()
    conv = fo.convert(model, recipe=recipe)
    assert conv.fusible_ops_report.recipe is recipe
    ids, fmt = check_fp8_step(conv, ref, recipe.fp8_format)
    assert conv.model.layers[0].mlp[0].fp8_weight_casts == 1 and conv.lm_head.fp8_weight_casts == 1
    conv.eval()
    with torch.no_grad():
        assert_sqnr(conv(input_ids=ids).logits, ref(input_ids=ids).logits, SQNR_DB["output", fmt], msg="logits")
        assert conv.generate(ids[:1, :4], max_new_tokens=3, do_sample=False).shape == (1, 7)  # (one-token steps)


# -- a model never tested: Gemma 2 ---------------------------------------------------------------------------
def test_gemma2_report_says_what_converted_and_why_not():
    """Gemma 2's norms scale by ``1 + weight`` and its head soft-caps the logits before the loss:
    both are left alone with that reason; its GELU(tanh) MLPs convert; the loss is unchanged."""
    model = tiny("gemma2")
    ref = copy.deepcopy(model)
    fo.convert(model)
    report = model.fusible_ops_report
    assert report.names() == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert "GEGLU" in report.converted[0].into
    reasons = {e.name: e.reason for e in report.left_alone}
    assert len(reasons) == 2 * 4 + 2
    assert "(1 + weight)" in reasons["model.norm"]
    assert "applies / to the logits" in reasons["lm_head"]
    ids, labels = batch()
    assert_close(model(input_ids=ids, labels=labels).loss, ref(input_ids=ids, labels=labels).loss, torch.float32)
    assert type(model.lm_head) is torch.nn.Linear and "forward" not in model.__dict__  # (the probe was undone)


def test_torch_compile_training_steps_no_break_no_recompile():
    """``torch.compile`` (aot_eager on CPU) of a converted model training with labels: no graph
    break, one graph over steps with new inputs, the eager model's loss and gradients."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = fo.convert(tiny("llama"))
    twin = copy.deepcopy(model)
    compiled = torch.compile(model, backend="aot_eager")
    graphs = []
    for step in range(3):
        ids, labels = batch(step)
        model.zero_grad()
        twin.zero_grad()
        loss, want = compiled(input_ids=ids, labels=labels).loss, twin(input_ids=ids, labels=labels).loss
        loss.backward()
        want.backward()
        graphs.append(counters["stats"]["unique_graphs"])
        assert_close(loss, want, torch.float32)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert graphs == [1] * 3, graphs
    got, eager = grads(model), grads(twin)
    for name, g in eager.items():
        assert_close_norm(got[name], g, torch.float32, msg=name)
    torch._dynamo.reset()
