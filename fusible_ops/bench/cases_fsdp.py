"""Harness case ``fsdp_layers``: training steps of the ``dense_layers`` model (Llama-style layers,
:class:`.cases_model.DenseLayer`) sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``), one
process per rank: ``torchrun --nproc-per-node N -m fusible_ops.bench fsdp_layers``. Without
torchrun (or under ``--nproc-per-node 1``) it runs at world 1, on a process group of one it makes
itself (NCCL on CUDA, gloo on CPU) and ends after its last config.

The sharding is torchtitan's: ``fully_shard`` per layer (``reshard_after_forward`` on all but the
last, whose backward starts at once), then on the stack (the root), with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)`` over float32 master weights; a
compiled variant compiles each layer before sharding it. Variants, each a fresh model with the same
initial weights (every rank builds them from one seed):

* peers: ``torch_fsdp2`` (the baseline: the plain ``torch.nn`` model, :class:`.cases_model.PlainDenseLayer`,
  eager), ``torch_fsdp2_compile`` (compiled), ``torchao_fsdp2_compile`` (torchao
  ``convert_to_float8_training``, tensorwise, compiled) and ``torchao_fsdp2_compile_fp8_all_gather``
  (``enable_fsdp_float8_all_gather=True``, ``precompute_float8_dynamic_scale_for_fsdp`` after each
  optimizer step; CUDA 8.9+ with torchao importable);
* ours: ``fused`` (bf16), ``fused_compile``, ``fp8_current``, ``fp8_current_fp8_all_gather``
  (``fo.quantization.enable_fp8_all_gather`` before sharding, ``precompute_fp8_scales`` after each
  optimizer step), ``fp8_delayed``, ``fp8_block``. FP8 under ``fo.autocast(recipe)`` with no amax
  reduction group: activation and gradient scales per rank, as torchao's; the weights' scales are
  the same on every rank (the gathered weight, or with FP8 all-gather the global amax).

One timed call is one training step as torchtitan's loop runs it, less gradient clipping and the LR
schedule: forward, the loss ``mean((update - target)^2)`` (``update``: the stack's output less its
input, as ``dense_layers`` checks), ``backward()`` (FSDP2 reduce-scatters the gradients), AdamW
``step()``, ``zero_grad(set_to_none=True)`` and the FP8 all-gather variants' scale precompute. The
input needs a gradient (as an embedding's output would).

Checks, before timing, on the first call of each variant (every rank decides alike: the figures
are reduced over the ranks): the loss (the mean over the ranks) against a float64 run of the plain
model from the same float32 weights on each rank's rows, and every parameter's gradient after the
reduce-scatter (gathered whole) and the input's against that run's (the parameters' averaged over
the ranks, as FSDP2 averages), each by its relative norm error, within the harness's bound (FP8:
:func:`.cases_model.fp8_stack_tolerance`, as ``dense_layers``). Rows have ``grad_rel_err`` (the
worst tensor's, named in the note), ``loss`` / ``loss_ref``, ``tokens_per_s`` (this rank's
tokens) and on CUDA ``step_peak_mib`` (the peak of one step above what the case holds: the
model's shards, optimizer state, gradients, activations). Work per rank: that of ``dense_layers``
on its rows (the optimizer's is not counted). The fusion plan checked is one unsharded bf16
layer's (sharding changes no op).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

import fusible_ops as fo

from .cases import CASES, Bench, BenchContext, Case, Lazy
from .cases_hf import _ModelRun
from .cases_model import (DENSE_CONFIGS, DENSE_QUICK, DenseLayer, LayerPlans, PlainDenseLayer, Stack, _fp8_capable,
                          expected_rules, fp8_stack_tolerance, torchao_float8)
from .common import free_memory, is_fp8_variant, log
from .harness import REL_ERR_TOL, rel_norm_err

SEED = 0
LR = 1e-4
"""AdamW (torchtitan's betas and weight decay): small enough that the weights stay near their
initial values over a timed run."""


def join_group(device: torch.device) -> tuple[int, int, bool]:
    """(rank, world, whether this call made the group): the process group torchrun's launch made,
    or a group of one (NCCL on CUDA, gloo on CPU) where there is none."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), False
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return 0, 1, True


def _unwrapped(name: str) -> str:
    return name.replace("_orig_mod.", "")  # (a compiled layer's parameters carry its wrapper's prefix)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float()


class _LazyPlans:
    """The harness's ``fused_module``: the plans of one unsharded bf16 layer, built at the first
    ``fusion_plan`` call (a config the run leaves out costs nothing)."""

    def __init__(self, ctx: BenchContext, cfg: dict) -> None:
        self.ctx, self.cfg, self.plans = ctx, cfg, None

    def fusion_plan(self, pass_: str, x: torch.Tensor) -> list[dict]:
        if self.plans is None:
            c = self.cfg
            self.plans = LayerPlans(DenseLayer(c["d"], c["heads"], c["f"], device=self.ctx.device, dtype=self.ctx.dtype))
        return self.plans.fusion_plan(pass_, x)


class FsdpRun:
    """One config: the models, the float64 reference (loss and gradients), the variant being
    checked, and each variant's figures for its row."""

    def __init__(self, ctx: BenchContext, cfg: dict, world: int) -> None:
        self.ctx, self.cfg, self.world, self.device = ctx, cfg, world, ctx.device
        self.mesh = None
        self.loss_ref: Optional[torch.Tensor] = None
        self.ref_grads: Optional[dict] = None  # the ours-model parameter name (or "input") -> float32 gradient
        self.pending: Optional[tuple] = None  # (variant, model, name map) between its build and its first step
        self.captured: Optional[dict] = None  # that step's gradients, full tensors
        self.results: dict = {}
        self.base = 0

    # -- models
    def ours(self) -> Stack:
        """Our stack in float32 (the master weights), the same on every rank."""
        c = self.cfg
        torch.manual_seed(SEED)
        return Stack([DenseLayer(c["d"], c["heads"], c["f"], device=self.device, dtype=torch.float32)
                      for _ in range(c["layers"])])

    def plain(self) -> tuple[Stack, dict]:
        """The plain ``torch.nn`` stack on the same initial weights, and its parameter names ->
        ours' (the names the reference gradients are kept under)."""
        ours = self.ours()
        by_id = {id(p): n for n, p in ours.named_parameters()}
        plain = Stack([PlainDenseLayer(layer) for layer in ours.layers])
        return plain, {n: by_id[id(p)] for n, p in plain.named_parameters()}

    def shard(self, model: Stack, compile_layers: bool) -> Stack:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if self.mesh is None:
            self.mesh = init_device_mesh(self.device.type, (self.world,))
        policy = MixedPrecisionPolicy(param_dtype=self.ctx.dtype, reduce_dtype=torch.float32)
        last = len(model.layers) - 1
        for i, layer in enumerate(model.layers):
            if compile_layers:
                layer = model.layers[i] = self.ctx.compiled(layer)
            fully_shard(layer, mesh=self.mesh, mp_policy=policy, reshard_after_forward=i < last)
        fully_shard(model, mesh=self.mesh, mp_policy=policy)
        return model

    # -- the reference
    def prepare(self, inputs: tuple) -> None:
        """Before a variant is built: memory freed; the reference made on the first call (on
        ``inputs``, the copy every check uses)."""
        self.pending = self.captured = None
        torch._dynamo.reset()
        free_memory(self.device)
        if self.ref_grads is None:
            self._reference(*inputs)
            free_memory(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)

    def _reference(self, x: torch.Tensor, target: torch.Tensor) -> None:
        plain, names = self.plain()
        with torch.no_grad():  # (the weights the GEMMs read: the master weights in param_dtype)
            for p in plain.parameters():
                p.data = p.data.to(self.ctx.dtype).double()
        x64 = x.detach().double().requires_grad_()
        loss = (plain(x64) - target.double()).square().mean()
        loss.backward()
        grads = {"input": x64.grad.float()}
        for n, p in plain.named_parameters():
            g = p.grad
            dist.all_reduce(g)  # (float64: the sum over the ranks, then the mean FSDP2 takes)
            grads[names[n]] = (g / self.world).float()
        loss = loss.detach()
        dist.all_reduce(loss)
        self.loss_ref = (loss / self.world).float()
        self.ref_grads = grads
        log(f"fsdp_layers: float64 reference loss {self.loss_ref.item():.5f} ({self.world} ranks)")

    # -- variants
    def variant(self, name: str, build: Callable[[], tuple], recipe=None, after_step: Optional[Callable] = None) -> Lazy:
        """A variant built when the harness reaches it: ``build()`` gives (sharded model, its
        parameter names -> ours'); each call is one training step (see the module docstring)."""
        def make(inputs):
            self.prepare(inputs)
            model, names = build()
            opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
            self.pending = (name, model, names)

            def step(x, target):
                x = x.detach().requires_grad_()
                with fo.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext():
                    y = model(x)
                loss = (y.float() - target.float()).square().mean()
                loss.backward()
                if self.pending is not None and self.pending[1] is model:  # (the check's call)
                    loss = self._capture(model, names, x, loss)
                opt.step()
                opt.zero_grad(set_to_none=True)
                if after_step is not None:
                    after_step(model)
                return loss.detach()
            return step
        return Lazy(make)

    def _capture(self, model, names: dict, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        """The first step's gradients (whole) and its loss, the mean over the ranks."""
        grads = {"input": x.grad.float()}
        for n, p in model.named_parameters():
            key = names.get(_unwrapped(n), _unwrapped(n))
            grads[key] = None if p.grad is None else _full(p.grad)
        self.captured = grads
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        return loss / self.world

    def reference(self, inputs: tuple, y: torch.Tensor) -> torch.Tensor:
        return self.loss_ref

    def check(self, inputs: tuple, y: torch.Tensor) -> Optional[str]:
        """After a variant's first step: every gradient against the reference's, the worst
        relative norm error (the max over the ranks) within the variant's bound."""
        name = self.pending[0]
        grads, self.pending, self.captured = self.captured, None, None
        keys = list(self.ref_grads)
        errs = torch.tensor([rel_norm_err(grads.get(k), self.ref_grads[k]) if k in grads else float("inf")
                             for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(errs, op=dist.ReduceOp.MAX)  # (the input's gradient is per rank)
        worst = int(errs.argmax())
        err = float(errs[worst])
        bound = fp8_stack_tolerance(self.cfg["layers"]) if is_fp8_variant(name) else REL_ERR_TOL
        unknown = sorted(set(grads) - set(keys))
        self.results[name] = {"loss": float(y), "loss_ref": float(self.loss_ref), "grad_rel_err": err,
                              "note": f"worst gradient {keys[worst]} {err:.2e}"}
        if unknown:
            return f"gradients of parameters the reference has not: {unknown[:3]}"
        if not err < bound:
            return f"gradients vs float64: rel norm err {err:.3g} >= {bound:.3g} ({keys[worst]})"
        return None

    extra = _ModelRun.extra  # (the figures hf_models' rows have: loss, loss_ref, grad_rel_err, step_peak_mib)

    def finish(self) -> None:
        self.pending = self.captured = self.loss_ref = self.ref_grads = None
        torch._dynamo.reset()
        free_memory(self.device)


# ----------------------------------------------------------------------------------- the variants
def fsdp_variants(ctx: BenchContext, run: FsdpRun) -> tuple[dict, dict]:
    """(variants, notes) of one config, the baseline first."""
    skipped = []
    notes = {"torch_fsdp2": "plain torch.nn model (F.scaled_dot_product_attention) under FSDP2",
             "torch_fsdp2_compile": "the plain model, each layer torch.compile'd, then FSDP2",
             "torchao_fsdp2_compile": "torchao convert_to_float8_training (tensorwise), each layer compiled, FSDP2",
             "torchao_fsdp2_compile_fp8_all_gather": "the same with enable_fsdp_float8_all_gather=True and "
                                                     "precompute_float8_dynamic_scale_for_fsdp after each step",
             "fused": "ours (fo.Sequential) under FSDP2, bf16",
             "fused_compile": "ours, each layer torch.compile'd, then FSDP2",
             "fp8_current": "ours under Float8CurrentScaling",
             "fp8_current_fp8_all_gather": "Float8CurrentScaling, weights gathered in FP8 "
                                           "(enable_fp8_all_gather; precompute_fp8_scales after each step)",
             "fp8_delayed": "ours under Float8DelayedScaling", "fp8_block": "ours under Float8BlockScaling"}

    def plain(compile_layers: bool, convert=None):
        def build():
            model, names = run.plain()
            if convert is not None:
                convert(model)
            return run.shard(model, compile_layers), names
        return build

    def ours(compile_layers: bool = False, fp8_all_gather: bool = False):
        def build():
            model = run.ours()
            if fp8_all_gather:
                fo.quantization.enable_fp8_all_gather(model)
            return run.shard(model, compile_layers), {}
        return build

    v = {"torch_fsdp2": run.variant("torch_fsdp2", plain(False))}
    if ctx.compile:
        v["torch_fsdp2_compile"] = run.variant("torch_fsdp2_compile", plain(True))
    float8, why = torchao_float8(ctx)
    if float8 is not None:
        def to_fp8(all_gather: bool):
            config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather)  # (tensorwise)
            return lambda m: float8.convert_to_float8_training(m, config=config)
        v["torchao_fsdp2_compile"] = run.variant("torchao_fsdp2_compile", plain(True, to_fp8(False)))
        v["torchao_fsdp2_compile_fp8_all_gather"] = run.variant(
            "torchao_fsdp2_compile_fp8_all_gather", plain(True, to_fp8(True)),
            after_step=float8.precompute_float8_dynamic_scale_for_fsdp)
    else:
        skipped.append(why)
    v["fused"] = run.variant("fused", ours())
    if ctx.compile:
        v["fused_compile"] = run.variant("fused_compile", ours(compile_layers=True))
    else:
        skipped.append("compiled variants skipped (--no-compile)")
    if _fp8_capable(ctx):
        current = fo.Float8CurrentScaling()
        v["fp8_current"] = run.variant("fp8_current", ours(), recipe=current)
        v["fp8_current_fp8_all_gather"] = run.variant("fp8_current_fp8_all_gather", ours(fp8_all_gather=True),
                                                      recipe=current, after_step=fo.quantization.precompute_fp8_scales)
        v["fp8_delayed"] = run.variant("fp8_delayed", ours(), recipe=fo.Float8DelayedScaling())
        v["fp8_block"] = run.variant("fp8_block", ours(), recipe=fo.Float8BlockScaling())
    else:
        skipped.append("FP8 variants need compute capability 8.9+")
    if skipped:
        notes["torch_fsdp2"] += "; " + "; ".join(skipped)
    return v, {k: notes[k] for k in v}


# -------------------------------------------------------------------------------------- the case
def fsdp_layers(ctx: BenchContext) -> Iterator[Bench]:
    rank, world, made = join_group(ctx.device)
    try:
        for name, cfg in ({"quick": DENSE_QUICK} if ctx.quick else DENSE_CONFIGS).items():
            L, d, H, f, B, S = (cfg[k] for k in ("layers", "d", "heads", "f", "B", "S"))
            run = FsdpRun(ctx, cfg, world)
            variants, notes = fsdp_variants(ctx, run)
            g = torch.Generator(device=ctx.device).manual_seed(SEED + 1 + rank)  # (each rank its own rows)

            def new_copy(g=g, shape=(B, S, d)):
                x = torch.randn(*shape, device=ctx.device, dtype=ctx.dtype, generator=g)
                return (x, torch.randn(*shape, device=ctx.device, dtype=ctx.dtype, generator=g)), None

            T = B * S
            bench = Bench(
                case="fsdp_layers", config=f"{name}_w{world}",
                shape=f"L={L} B={B} S={S} d={d} heads={H} f={f} per rank, FSDP2 over {world} rank(s)",
                dtype=ctx.dtype, metric="flops", work=L * (6 * T * (4 * d * d + 3 * d * f) + 7 * B * S * S * d),
                new_copy=new_copy, params=[], variants=variants, fused_module=_LazyPlans(ctx, cfg),
                plan_args=lambda inp: (inp[0].detach().requires_grad_(),), expected_rules=expected_rules("dense_layers", ctx.device, cfg),
                baseline="torch_fsdp2", reference=run.reference, check_output=run.check, notes=notes,
                tolerances={n: fp8_stack_tolerance(L) for n in variants if is_fp8_variant(n)}, tokens=T,
                extra=run.extra,
            )
            yield bench
            del bench, variants
            run.finish()
    finally:
        if made:
            dist.destroy_process_group()


CASES.update({  # (registered into the harness's catalogue when fusible_ops.bench is imported)
    "fsdp_layers": Case("torchrun (or world 1): training steps of the dense_layers model under FSDP2, bf16 and FP8 "
                        "(with and without FP8 all-gather) vs plain torch.nn + FSDP2 (+ compile) and torchao float8 "
                        "+ FSDP2 + compile; configs " + ", ".join(DENSE_CONFIGS), fsdp_layers),
})
