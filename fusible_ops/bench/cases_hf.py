"""Harness case ``hf_models``: one training step (forward with labels, the loss, backward) of
transformers' own modeling code, random init, bf16, against the same model converted by
:func:`fusible_ops.convert`.

Configs (2 layers each, sdpa attention, untied embeddings, no KV cache):

* ``llama3_8b_L2``: Llama-3-8B's shapes, d=4096, f=14336, 32 heads, 8 KV heads, vocab 128256, B=2,
  S=4096;
* ``qwen3_30b_a3b_L2``: Qwen3-30B-A3B's shapes, d=2048, 32 heads of 128, 4 KV heads, 128 experts of
  width 768, top-8 (``norm_topk_prob``), vocab 151936, B=2, S=4096, no router auxiliary loss
  (the model's own default, ``output_router_logits=False``);
* ``--quick``: ``llama_quick``, ``qwen3_moe_quick`` (d=64, 2x32 tokens; the CPU smoke run).

Variants, one process, each a fresh model built from the config and loaded with the same bf16
state dict (so every loss and gradient is comparable):

* ``eager``: the HF model as built. The MoE model's ``experts_implementation`` is ``grouped_mm``
  (:data:`EXPERTS_IMPLEMENTATION`): of transformers 5.23's options, ``eager`` loops over experts
  on the host, ``batched_mm`` gathers one weight copy per (token, expert) pair (65536 x 4.7 MiB
  here), and ``sonicmoe`` / ``deepgemm`` load their kernels from the Hugging Face Hub at run time,
  which the device cannot reach;
* ``compile``: ``torch.compile(model, dynamic=False)``;
* ``liger``: ``liger_kernel.transformers.apply_liger_kernel_to_llama`` / ``..._qwen3_moe``
  (``model=``, defaults: RoPE, RMSNorm, SwiGLU / fused MoE experts, fused linear cross-entropy;
  CUDA, where liger-kernel imports). Its module-level patches of transformers are undone before
  the next variant is built;
* ``torchao_tensorwise_compile``: ``torchao.float8.convert_to_float8_training`` (tensorwise:
  every ``nn.Linear``, the LM head too), then compiled (CUDA with FP8 matmuls, torchao importable);
* ``fused``: ``fo.convert(model)`` (whatever it converts now: norms, dense MLPs, the head; MoE
  blocks once a converter for them is registered); ``fused_compile``: that, compiled;
* ``fp8_current``: ``fo.convert(model, recipe=fo.Float8CurrentScaling())`` (CPU: emulated).

One timed call is ``zero_grad(set_to_none=True)``, ``model(input_ids, labels=input_ids).loss``,
``loss.backward()`` (no optimizer step, as the other model cases). It returns the loss.

Checks, before timing: the loss and every parameter's gradient against the same model in float32
(built with the same state dict, experts ``eager``, TF32 off, one batch row at a time: the mean
over all tokens is the mean of the rows' means). The loss within the harness's bound (2e-2
relative, FP8: ``FP8_REL_ERR``); the gradients' global relative norm error within
:data:`GRAD_TOL` (FP8: :func:`fp8_grad_tolerance`) or twice the ``eager`` variant's own error,
whichever is larger; on the MoE model at least :data:`ROUTED_GRAD_TOL` (top-k routing flips
near-tied expert choices between any two roundings). The reference gradients are kept in bf16
(2^-9 relative). Gradients are matched to the reference through the state dict's keys (a
converted model keeps them), so conversions that fuse or re-layout parameters compare too.

Each row also has ``tokens_per_s``, ``loss`` / ``loss_ref``, ``grad_rel_err`` and (CUDA)
``step_peak_mib``: the peak memory of one step above what the case itself holds (the state dict,
the reference gradients, the rotated inputs), i.e. the model's parameters, gradients, activations
and workspace, as a training script sees it. Work: ``6 x tokens`` per weight of every linear (the
head included; experts ``x top_k / E``, the router) plus causal attention ``7 x B x S^2 x heads x
head_dim`` per layer.
"""

from __future__ import annotations

import contextlib
import copy
import math
import sys
from collections import Counter
from typing import Callable, Iterator, Optional

import torch

import fusible_ops as fo

from .cases import CASES, FP8_REL_ERR, Bench, BenchContext, Case, Lazy
from .cases_model import _fp8_capable, torchao_float8
from .common import free_memory, is_fp8_variant, log
from .harness import REL_ERR_TOL

HF_CONFIGS = {
    "llama3_8b_L2": dict(arch="llama", layers=2, d=4096, f=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256,
                         B=2, S=4096),
    "qwen3_30b_a3b_L2": dict(arch="qwen3_moe", layers=2, d=2048, heads=32, kv_heads=4, head_dim=128, E=128, k=8, f=768,
                             vocab=151936, B=2, S=4096),
}
HF_QUICK = {  # (dims and tokens multiples of 16: the FP8 variant runs, emulated on CPU)
    "llama_quick": dict(arch="llama", layers=2, d=64, f=128, heads=4, kv_heads=2, head_dim=16, vocab=256, B=2, S=32),
    "qwen3_moe_quick": dict(arch="qwen3_moe", layers=2, d=64, heads=4, kv_heads=2, head_dim=32, E=8, k=2, f=32,
                            vocab=256, B=2, S=32),
}
EXPERTS_IMPLEMENTATION = "grouped_mm"
SEED = 0

GRAD_TOL = REL_ERR_TOL
"""Bound on a bf16 variant's global gradient error against float32 (the harness's bound)."""

ROUTED_GRAD_TOL = 0.5
"""The least bound of any variant of a model with top-k routing (the MoE config). Between two
roundings a near-tied k-th expert flips for a share of the tokens; each flip moves two experts'
gradients by that token's whole contribution. Estimated (not measured) at Qwen3-30B-A3B's shapes
(128 experts, router logits of std ~0.9, so ~0.06 between the 8th and 9th; bf16 moves them by
~0.01): ~20% of the tokens flip per layer and the expert gradients move by ~15% in bf16, several
times that in FP8. The float32 reference cannot replay each variant's choice in a model it does
not own, so on such a model the gradient check catches gross errors only (a lost or mis-scaled
gradient, garbage); the conversion tests (tests/test_convert*.py) check converted modules against
the unconverted model at tiny sizes."""


def fp8_grad_tolerance(layers: int) -> float:
    """Bound on an FP8 variant's global gradient error: ``FP8_REL_ERR`` (one quantized block) times
    sqrt(2 x layers + 1), the blocks in series (attention and MLP per layer, the head), whose noise
    powers add."""
    return FP8_REL_ERR * math.sqrt(2 * layers + 1)


# ------------------------------------------------------------------------------- the HF models
def hf_config(cfg: dict):
    """The transformers config of ``cfg`` (one of :data:`HF_CONFIGS` / :data:`HF_QUICK`)."""
    import transformers

    common = dict(vocab_size=cfg["vocab"], hidden_size=cfg["d"], num_hidden_layers=cfg["layers"],
                  num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"], head_dim=cfg["head_dim"],
                  max_position_embeddings=max(cfg["S"], 4096), use_cache=False, tie_word_embeddings=False,
                  attention_dropout=0.0)
    if cfg["arch"] == "llama":
        return transformers.LlamaConfig(intermediate_size=cfg["f"], rms_norm_eps=1e-5, rope_theta=500000.0, **common)
    return transformers.Qwen3MoeConfig(
        intermediate_size=8 * cfg["f"], moe_intermediate_size=cfg["f"], num_experts=cfg["E"],
        num_experts_per_tok=cfg["k"], norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        output_router_logits=False, rms_norm_eps=1e-6, rope_theta=1000000.0, **common)


def step_flops(cfg: dict) -> float:
    """FLOPs of one forward + backward (see the module docstring)."""
    B, S, d, L, H, hd = (cfg[k] for k in ("B", "S", "d", "layers", "heads", "head_dim"))
    attn = 2 * d * H * hd + 2 * d * cfg["kv_heads"] * hd
    mlp = d * cfg["E"] + cfg["k"] * 3 * d * cfg["f"] if "E" in cfg else 3 * d * cfg["f"]
    return 6.0 * B * S * (L * (attn + mlp) + d * cfg["vocab"]) + 7.0 * B * S * S * H * hd * L


def _shape(cfg: dict) -> str:
    moe = f" E={cfg['E']} k={cfg['k']}" if "E" in cfg else ""
    return (f"L={cfg['layers']} B={cfg['B']} S={cfg['S']} d={cfg['d']} heads={cfg['heads']}/{cfg['kv_heads']}x"
            f"{cfg['head_dim']} f={cfg['f']}{moe} V={cfg['vocab']}")


class _Undo:
    """Restores the attributes of modules / classes as they were at construction (undoes a
    monkey patch such as Liger-Kernel's of transformers' modeling module)."""

    def __init__(self, *targets) -> None:
        self.saved = [(t, dict(vars(t))) for t in targets]

    def restore(self) -> None:
        for target, saved in self.saved:
            for name in [n for n in vars(target) if n not in saved]:
                delattr(target, name)
            for name, value in saved.items():
                if vars(target).get(name) is not value:
                    setattr(target, name, value)


@contextlib.contextmanager
def _fp32_matmuls():
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


def grads_by_key(model: torch.nn.Module) -> dict:
    """``{state-dict key: gradient}`` of every parameter in the state dict: a key whose tensor
    is a view of a parameter (a fused gate/up weight's halves) gets the same view of that
    parameter's gradient; None where the parameter has no gradient. Keys that are no parameter's
    (buffers, copies) are left out."""
    by_storage: dict = {}
    for p in model.parameters():
        by_storage.setdefault(p.untyped_storage().data_ptr(), []).append(p)
    out = {}
    for key, t in model.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            continue
        for p in by_storage.get(t.untyped_storage().data_ptr(), ()):
            lo = t.storage_offset() - p.storage_offset()
            if not p.is_contiguous() or lo < 0 or lo + t.numel() > p.numel():
                continue
            g = p.grad
            if g is not None and t is not p:
                g = g.contiguous()
                g = g.as_strided(t.shape, t.stride(), g.storage_offset() + lo)
            out[key] = g
            break
    return out


# ------------------------------------------------------------------------------------ one config
class _ModelRun:
    """One config's models: the bf16 state dict every variant loads, the float32 reference
    (loss and gradients), the variant being checked, and each variant's figures for its row.
    Everything heavy is built when the first variant is (a config left out by ``CASE:CONFIG``
    costs nothing)."""

    def __init__(self, ctx: BenchContext, cfg: dict) -> None:
        import transformers

        self.ctx, self.cfg, self.device = ctx, cfg, ctx.device
        self.moe = cfg["arch"] == "qwen3_moe"
        self.cls = transformers.Qwen3MoeForCausalLM if self.moe else transformers.LlamaForCausalLM
        self.hf_cfg = hf_config(cfg)
        self.master: Optional[dict] = None
        self.loss_ref: Optional[torch.Tensor] = None
        self.ref_grads: Optional[dict] = None  # state-dict key -> bf16 gradient; None: loss only
        self.ref_note = ""
        self.ref_error: Optional[str] = None
        self.undo: list = []
        self.current: Optional[tuple] = None  # (variant, raw model) between its build and its check
        self.results: dict = {}  # variant -> figures for its row
        self.base = 0  # memory allocated before a variant's model is built (CUDA)

    # -- models
    def build(self, dtype: torch.dtype, experts: Optional[str] = EXPERTS_IMPLEMENTATION) -> torch.nn.Module:
        """A fresh model (random init) in ``dtype`` on the device, in training mode."""
        kw = {"experts_implementation": experts} if self.moe and experts else {}
        with torch.device(self.device):
            model = self.cls._from_config(copy.deepcopy(self.hf_cfg), dtype=dtype, attn_implementation="sdpa", **kw)
        return model.train()

    def fresh(self) -> torch.nn.Module:
        model = self.build(torch.bfloat16)
        model.load_state_dict(self.master)
        return model

    def prepare(self, inputs: tuple) -> None:
        """Before a variant is built: the previous one's patches undone and memory freed; the
        state dict and the float32 reference made on the first call (on ``inputs``, the batch
        every check uses)."""
        self.current = None
        while self.undo:
            self.undo.pop().restore()
        torch._dynamo.reset()
        free_memory(self.device)
        if self.ref_error is not None:
            raise RuntimeError(f"the float32 reference failed: {self.ref_error}")
        if self.master is None:
            torch.manual_seed(SEED)
            model = self.build(torch.bfloat16)
            self.master = {k: v.detach().clone() for k, v in model.state_dict().items()}
            del model
            try:
                self._reference(*inputs)
            except Exception as e:
                self.ref_error = f"{type(e).__name__}: {e}"[:300]
                raise
            free_memory(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)

    def _reference(self, ids: torch.Tensor, labels: torch.Tensor) -> None:
        """Loss and gradients of the float32 model, one batch row at a time; where that runs out
        of memory, the loss alone (no_grad) and no gradient check."""
        try:
            self.loss_ref, self.ref_grads = self._reference_pass(ids, labels, grads=True)
            self.ref_note = "float32 reference: loss and gradients"
        except torch.OutOfMemoryError:
            pass  # (the failed pass's tensors go with the exception, at the end of this block)
        if self.loss_ref is None:
            free_memory(self.device)
            self.loss_ref, self.ref_grads = self._reference_pass(ids, labels, grads=False)
            self.ref_note = "float32 reference: loss only (its backward ran out of memory; gradients not checked)"
        log(f"hf_models: {self.ref_note}, loss {self.loss_ref.item():.5f}")

    def _reference_pass(self, ids, labels, grads: bool):
        model = self.build(torch.float32, experts="eager")
        model.load_state_dict(self.master)
        B = ids.shape[0]
        total = torch.zeros((), device=self.device)
        with _fp32_matmuls(), torch.set_grad_enabled(grads):
            for b in range(B):
                loss = model(input_ids=ids[b:b + 1], labels=labels[b:b + 1]).loss / B
                if grads:
                    loss.backward()
                total += loss.detach()
        ref = None
        if grads:
            ref = {k: (torch.zeros_like(self.master[k]) if g is None else g.to(torch.bfloat16))
                   for k, g in grads_by_key(model).items()}
        return total, ref

    # -- variants
    def variant(self, name: str, wrap: Callable) -> Lazy:
        """A variant built when the harness reaches it: a fresh model, ``wrap(model)`` gives the
        callable that runs it (the model itself, converted, patched or compiled)."""
        def make(inputs):
            self.prepare(inputs)
            model = self.fresh()
            run = wrap(model)
            self.current = (name, model)
            params = [p for p in model.parameters() if p.requires_grad]

            def step(ids, labels):
                for p in params:
                    p.grad = None
                loss = run(input_ids=ids, labels=labels).loss
                loss.backward()
                return loss.detach().float()
            return step
        return Lazy(make)

    def reference(self, inputs: tuple, y: torch.Tensor) -> torch.Tensor:
        return self.loss_ref

    def check(self, inputs: tuple, y: torch.Tensor) -> Optional[str]:
        """After a variant's first step: its gradients against the reference's (see the module
        docstring); records its figures. Returns a problem or None."""
        name, model = self.current
        self.current = None
        res = self.results[name] = {"loss": float(y), "loss_ref": float(self.loss_ref), "note": ""}
        report = getattr(model, "fusible_ops_report", None)
        if report is not None:
            what = Counter(e.source for e in report.converted)
            res["note"] = (f"fo.convert: {', '.join(f'{s} x{n}' for s, n in what.items()) or 'nothing'} converted, "
                           f"{len(report.left_alone)} left alone")
        if self.ref_grads is None:
            res["note"] = "; ".join(filter(None, [res["note"], self.ref_note]))
            return None
        err, worst, missing = self._grad_error(grads_by_key(model))
        res["grad_rel_err"] = err
        res["note"] = "; ".join(filter(None, [res["note"], f"worst gradient {worst}",
                                              f"no gradient compared for {missing}" if missing else ""]))
        fp8 = is_fp8_variant(name)
        bound = fp8_grad_tolerance(self.cfg["layers"]) if fp8 else GRAD_TOL
        if self.moe:
            bound = max(bound, ROUTED_GRAD_TOL)
        eager = self.results.get("eager", {}).get("grad_rel_err")
        if name == "eager":
            bound = math.inf  # (the reference implementation: its error sets the slack of the others)
        elif eager is not None and math.isfinite(eager):
            bound = max(bound, 2 * eager)
        if not (err < bound) or not math.isfinite(err):
            return f"gradients vs float32: global rel norm err {err:.3g} >= {bound:.3g} (worst {worst})"
        return None

    def _grad_error(self, grads: dict) -> tuple[float, str, str]:
        """(global relative norm error, the worst tensor and its error, the reference keys that had
        no counterpart); a missing gradient counts as zeros."""
        num = den = 0.0
        worst, worst_err, missing = "", -1.0, []
        for key, r in self.ref_grads.items():
            if key not in grads:
                missing.append(key)
                continue
            r = r.float()
            g = grads[key]
            d2 = float(torch.linalg.vector_norm(r if g is None else g.float() - r) ** 2)
            r2 = float(torch.linalg.vector_norm(r) ** 2)
            if g is not None and not bool(torch.isfinite(g).all()):
                d2 = math.inf
            num, den = num + d2, den + r2
            e = math.sqrt(d2 / r2) if r2 > 0 else (0.0 if d2 == 0 else math.inf)
            if e > worst_err:
                worst, worst_err = key, e
        err = math.sqrt(num / den) if den > 0 else math.inf
        left = f"{len(missing)} of {len(self.ref_grads)} tensors ({missing[0]}, ...)" if missing else ""
        return err, f"{worst} {worst_err:.2e}", left

    def extra(self, name: str, row: dict) -> dict:
        """The variant's figures for its row (the harness calls this after its check and timing)."""
        res = dict(self.results.get(name, {}))
        note = res.pop("note", "")
        out = {k: res.get(k) for k in ("loss", "loss_ref", "grad_rel_err")}
        out["note"] = "; ".join(filter(None, [row.get("note", ""), note]))
        if self.device.type == "cuda" and row.get("median_ms") is not None:
            # (the peak of the harness's last call, the peak-memory one: nothing ran since)
            out["step_peak_mib"] = (torch.cuda.max_memory_allocated(self.device) - self.base) / 2**20
        return out

    def finish(self) -> None:
        """After the config's last variant: patches undone, everything released."""
        self.current = None
        while self.undo:
            self.undo.pop().restore()
        self.master = self.loss_ref = self.ref_grads = None
        torch._dynamo.reset()
        free_memory(self.device)


# ----------------------------------------------------------------------------------- the peers
def _liger_apply(ctx: BenchContext, arch: str) -> tuple[Optional[Callable], str]:
    """Liger-Kernel's ``apply_liger_kernel_to_*`` for ``arch``, or (None, why)."""
    if ctx.device.type != "cuda":
        return None, "liger needs CUDA"
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama, apply_liger_kernel_to_qwen3_moe
    except ImportError as e:
        return None, f"liger skipped: liger-kernel not importable ({e})"
    except Exception as e:  # (installed, but does not load with this torch / Triton / transformers)
        return None, f"liger skipped: liger_kernel.transformers does not import ({type(e).__name__}: {e})"[:300]
    return (apply_liger_kernel_to_llama if arch == "llama" else apply_liger_kernel_to_qwen3_moe), ""


def _torchao_convert(ctx: BenchContext) -> tuple[Optional[Callable], str]:
    float8, why = torchao_float8(ctx)
    if float8 is None:
        return None, why
    config = float8.Float8LinearConfig.from_recipe_name("tensorwise")
    return (lambda model: float8.convert_to_float8_training(model, config=config)), ""


def _variants(ctx: BenchContext, run: _ModelRun) -> tuple[dict, dict]:
    """(variants, notes) of one config, in the order they run (``eager`` first: its gradient
    error sets the others' slack)."""
    notes = {"eager": "transformers' modeling code, sdpa attention"
                      + (f", experts_implementation={EXPERTS_IMPLEMENTATION}" if run.moe else ""),
             "compile": "torch.compile(model, dynamic=False)",
             "liger": f"apply_liger_kernel_to_{run.cfg['arch']}(model=...): RoPE, RMSNorm, SwiGLU"
                      + (" / fused MoE experts" if run.moe else "") + ", fused linear cross-entropy",
             "torchao_tensorwise_compile": "torchao convert_to_float8_training (tensorwise, every nn.Linear), "
                                           "torch.compile",
             "fused": "fo.convert(model)", "fused_compile": "torch.compile(fo.convert(model), dynamic=False)",
             "fp8_current": "fo.convert(model, recipe=fo.Float8CurrentScaling())"}
    skipped = []
    v = {"eager": run.variant("eager", lambda m: m)}
    if ctx.compile:
        v["compile"] = run.variant("compile", ctx.compiled)
    apply, why = _liger_apply(ctx, run.cfg["arch"])
    if apply is not None:
        def liger(model, apply=apply):
            run.undo.append(_Undo(sys.modules[type(model).__module__], type(model)))
            apply(model=model)
            return model
        v["liger"] = run.variant("liger", liger)
    else:
        skipped.append(why)
    to_fp8, why = _torchao_convert(ctx)
    if to_fp8 is not None:
        v["torchao_tensorwise_compile"] = run.variant("torchao_tensorwise_compile",
                                                      lambda m: ctx.compiled(to_fp8(m) or m))
    else:
        skipped.append(why)
    v["fused"] = run.variant("fused", fo.convert)
    if ctx.compile:
        v["fused_compile"] = run.variant("fused_compile", lambda m: ctx.compiled(fo.convert(m)))
    else:
        skipped.append("compiled variants skipped (--no-compile)")
    if _fp8_capable(ctx):
        v["fp8_current"] = run.variant("fp8_current", lambda m: fo.convert(m, recipe=fo.Float8CurrentScaling()))
    else:
        skipped.append("FP8 variants need compute capability 8.9+")
    if skipped:
        notes["eager"] += "; " + "; ".join(skipped)
    return v, {k: notes[k] for k in v}


# -------------------------------------------------------------------------------------- the case
def hf_models(ctx: BenchContext) -> Iterator[Bench]:
    try:
        import transformers
    except ImportError:
        log("hf_models: skipped, transformers is not importable (pip install -e '.[hf]')")
        return
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        for name, cfg in (HF_QUICK if ctx.quick else HF_CONFIGS).items():
            run = _ModelRun(ctx, cfg)
            variants, notes = _variants(ctx, run)
            g = torch.Generator(device=ctx.device).manual_seed(SEED + 1)

            def new_copy(cfg=cfg, g=g):
                ids = torch.randint(0, cfg["vocab"], (cfg["B"], cfg["S"]), device=ctx.device, generator=g)
                return (ids, ids), None  # (labels are the inputs: the model shifts them)

            bench = Bench(
                case="hf_models", config=name, shape=_shape(cfg), dtype=torch.bfloat16, metric="flops",
                work=step_flops(cfg), new_copy=new_copy, params=[], variants=variants, fused_module=None,
                plan_args=lambda inp: inp, reference=run.reference, check_output=run.check, notes=notes,
                tolerances={n: FP8_REL_ERR for n in variants if is_fp8_variant(n)},
                tokens=cfg["B"] * cfg["S"], extra=run.extra,
            )
            yield bench
            del bench, variants
            run.finish()
    finally:
        transformers.logging.set_verbosity(verbosity)


CASES.update({  # (registered into the harness's catalogue when fusible_ops.bench is imported)
    "hf_models": Case("training step of transformers' Llama-3-8B- and Qwen3-30B-A3B-shaped models (2 layers): HF "
                      "eager, compile, Liger, torchao float8 vs fo.convert (eager, compiled, FP8)", hf_models),
})
