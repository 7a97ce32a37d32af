"""``python -m fusible_ops.bench convergence``: does a model built from our ops train like the same
model in plain PyTorch, and do the FP8 recipes train like bf16?

A byte-level decoder-only language model (vocabulary 256) learns the Python standard library's own
source (:mod:`.convergence_data`: split by file into train and validation). Every variant starts
from the SAME weights (drawn once in float32 from the seed, then cast) and sees the same batches
in the same order (random windows of ``seq + 1`` bytes drawn from the data seed):

* ``torch_bf16``: the plain ``torch.nn`` model (``nn.Embedding``, ``nn.RMSNorm``, ``nn.Linear``,
  ``F.silu(a) * b``, head ``nn.Linear`` + ``F.cross_entropy`` on float32 logits);
* ``ours_bf16``: the same model from our ops (:class:`.cases_model.DenseLayer`: attention in
  plain PyTorch, ``F.scaled_dot_product_attention`` causal, between ``fo.Sequential``\\ s; the
  head ``Sequential(RMSNorm, Linear, CrossEntropy)``, rule ``linear_cross_entropy``);
* ``ours_fp8_current``, ``ours_fp8_delayed``, ``ours_fp8_block``: ours, the whole forward under
  ``fo.autocast`` with that recipe (every dense linear in FP8, the LM head too: fused under
  current scaling, unfused under delayed and block scaling; attention, norms and the loss stay
  bf16 / float32);
* ``moe_bf16``, ``moe_fp8``: the MLPs replaced by MoE blocks of ours
  (:class:`.cases_model.MoELayer`: RMSNorm, Router, Dispatch, GroupedLinear, SwiGLU,
  GroupedLinear, Combine, AddExtraInput), the routers' load-balancing loss added to the loss;
  ``moe_fp8`` under current scaling.

Precision, the same for every variant: the model's parameters, activations and gradients in bf16;
float32 master weights that ``torch.optim.AdamW`` updates (each step the bf16 gradients are copied
into the masters' float32 ``.grad``, clipped by global norm, stepped, and the masters copied back
into the bf16 parameters). Learning rate: linear warm-up, then cosine decay to
``min_lr_ratio`` of its peak. Weight decay on matrices only. Validation: the mean loss over a
fixed set of windows evenly spaced over the validation bytes, every ``steps / val_points`` steps
and at the end, evaluated in bf16 for every variant (FP8 variants too: every variant's weights
are judged by the same arithmetic, so the validation loss measures what training made of them).

Sizes: :data:`GPU_CONFIG` (default on CUDA): d=1024, 8 layers, 16 heads, SwiGLU f=2560 (a multiple
of 512, so block-scaled GEMMs run in FP8 on CUDA, not emulated), 97M parameters; MoE: 8 experts
of f=1280, top-2 (the same active parameters; 286M in all); seq 512, batch 16: 8192 tokens per
step, 16.4M per 2000-step run. A dense step is about 5.0 TFLOP (6 x 8192 x 97M, plus causal
attention 7 B S^2 d per layer): ~12 ms at 400 TFLOP/s, ~25 s of GEMMs per 2000-step bf16 run;
the seven variants are sized to finish in about 8 minutes on one H100 (an estimate: not yet
timed on a GPU). :data:`QUICK_CONFIG` (``--quick``, CPU; the test suite's config):
d=128, 2 layers, f=256, 4 experts of f=128, seq 64, batch 4 (every dim a multiple of 128, as
block scaling needs): 256 tokens per step.

Output: one JSON-lines row per variant under ``--out`` (``bench_convergence_<stamp>.jsonl``, read
by ``--from DIR --report PAGE`` with the timing rows): the curves, final validation loss, tokens/s
(training steps only, after the first ``timing_skip``; CUDA: synchronized at the segment ends),
peak memory (CUDA), and the figures against the variant's reference with pass / fail
(:mod:`.convergence_metrics`). ``--report PAGE`` writes the page's "Convergence" section and plot
(:mod:`.convergence_report`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import math
import os
import sys
import time
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import fusible_ops as fo

from .cases import EPS
from .cases_model import DenseLayer, MoELayer, PlainDenseLayer, _shared_linear, _shared_norm
from ..kernels import set_process_mode
from .common import device_name, driver_version, free_memory, log as _log, versions
from .convergence_data import Corpus, load_corpus, train_offsets, val_offsets, windows
from .convergence_metrics import judge_rows
from .output import write_jsonl

VOCAB = 256


@dataclasses.dataclass(frozen=True)
class Config:
    """Model, data and optimizer sizes of one convergence configuration."""

    name: str
    d: int
    layers: int
    heads: int
    f: int  # dense SwiGLU width (FC1 is d -> 2f)
    experts: int
    top_k: int
    expert_f: int
    seq: int
    batch: int
    steps: int
    lr: float
    corpus_bytes: int
    min_lr_ratio: float = 0.1
    warmup_fraction: float = 0.05
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.95)
    clip: float = 1.0
    val_points: int = 20
    val_batches: int = 4
    log_every: int = 100
    timing_skip: int = 10

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq

    def describe(self) -> str:
        return (f"d={self.d} L={self.layers} heads={self.heads} f={self.f} (MoE: E={self.experts} k={self.top_k} "
                f"f={self.expert_f}) seq={self.seq} batch={self.batch}")


GPU_CONFIG = Config("gpu", d=1024, layers=8, heads=16, f=2560, experts=8, top_k=2, expert_f=1280, seq=512, batch=16,
                    steps=2000, lr=6e-4, corpus_bytes=32 << 20, val_batches=8)
QUICK_CONFIG = Config("quick", d=128, layers=2, heads=4, f=256, experts=4, top_k=2, expert_f=128, seq=64, batch=4,
                      steps=40, lr=3e-3, corpus_bytes=2 << 20, val_points=10, val_batches=4, log_every=20,
                      timing_skip=2)


@dataclasses.dataclass(frozen=True)
class Variant:
    kind: str  # "dense" or "moe"
    plain: bool  # the plain torch.nn model (dense only)
    recipe: Optional[Callable] = None  # returns the FP8 recipe; None: bf16
    head_fp8: bool = True  # the LM head under the recipe too (False: bf16, fo.autocast(None) around it)
    kernels: Optional[str] = None  # the run's kernel backend (kernels.set_process_mode), None: as the process has it
    perturb: float = 0.0  # start from the weights times 1 + perturb * N(0, 1) (seed + 1): a rounding-sized twin
    diagnostic: bool = False  # run only when named (--variants): a probe of why a variant misses, not a target


VARIANTS = {
    "torch_bf16": Variant("dense", True),
    "ours_bf16": Variant("dense", False),
    "ours_fp8_current": Variant("dense", False, fo.Float8CurrentScaling),
    "ours_fp8_delayed": Variant("dense", False, fo.Float8DelayedScaling),
    "ours_fp8_block": Variant("dense", False, fo.Float8BlockScaling),
    "moe_bf16": Variant("moe", False),
    "moe_fp8": Variant("moe", False, fo.Float8CurrentScaling),
    # Diagnostics: each changes one thing of a variant that misses its targets.
    "torch_bf16_perturbed": Variant("dense", True, perturb=2.0**-8, diagnostic=True),
    "ours_fp8_current_e4m3": Variant("dense", False, functools.partial(fo.Float8CurrentScaling, fp8_format="e4m3"),
                                     diagnostic=True),
    "ours_fp8_current_bf16head": Variant("dense", False, fo.Float8CurrentScaling, head_fp8=False, diagnostic=True),
    "ours_fp8_current_refkernels": Variant("dense", False, fo.Float8CurrentScaling, kernels="reference",
                                           diagnostic=True),
    "ours_fp8_delayed_e4m3": Variant("dense", False, functools.partial(fo.Float8DelayedScaling, fp8_format="e4m3"),
                                     diagnostic=True),
    "ours_fp8_delayed_bf16head": Variant("dense", False, fo.Float8DelayedScaling, head_fp8=False, diagnostic=True),
    "moe_fp8_e4m3": Variant("moe", False, functools.partial(fo.Float8CurrentScaling, fp8_format="e4m3"),
                            diagnostic=True),
    "moe_fp8_bf16head": Variant("moe", False, fo.Float8CurrentScaling, head_fp8=False, diagnostic=True),
}
"""Every variant, in run order (a reference before the variants judged against it). A plain run
trains those without ``diagnostic``; the diagnostics (named in ``--variants``) each change one
thing of a variant that misses its targets: the bf16 noise floor (``torch_bf16_perturbed``: torch
from weights perturbed by bf16's rounding, judged against ``torch_bf16``), the gradients' format
(``*_e4m3``: E4M3 gradients, not E5M2), the LM head in bf16 (``*_bf16head``) and the kernels
(``*_refkernels``: every kernel's pure-torch ``*_ref``; the FP8 GEMMs are ``torch._scaled_mm``
either way)."""


def recipe_name(variant: str) -> Optional[str]:
    """The row's ``recipe``: ``repr`` of the variant's recipe (its class and fields), None for bf16."""
    factory = VARIANTS[variant].recipe
    return None if factory is None else repr(factory())


# ------------------------------------------------------------------------------------- the models
class ByteLM(nn.Module):
    """Ours: ``nn.Embedding`` -> layers (:class:`.cases_model.DenseLayer` or :class:`.cases_model.MoELayer`)
    -> ``Sequential(RMSNorm, Linear(d, 256), CrossEntropy)``. ``forward(x, y)`` returns (mean loss,
    the MoE layers' summed load-balancing loss or None)."""

    def __init__(self, cfg: Config, kind: str, **factory) -> None:
        super().__init__()
        self.d = cfg.d
        self.embed = nn.Embedding(VOCAB, cfg.d, **factory)
        if kind == "dense":
            layers = [DenseLayer(cfg.d, cfg.heads, cfg.f, **factory) for _ in range(cfg.layers)]
        elif kind == "moe":
            layers = [MoELayer(cfg.d, cfg.heads, cfg.expert_f, cfg.experts, cfg.top_k, **factory)
                      for _ in range(cfg.layers)]
        else:
            raise ValueError(f"convergence: kind must be 'dense' or 'moe', got {kind!r}")
        self.layers = nn.ModuleList(layers)
        self.head = fo.Sequential(fo.RMSNorm(cfg.d, eps=EPS, **factory),
                                  fo.Linear(cfg.d, VOCAB, bias=False, **factory), fo.CrossEntropy())
        self.head_fp8 = True  # (False: the head runs in bf16 under an FP8 autocast)

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        h = self.embed(x)
        aux = None
        for layer in self.layers:
            if isinstance(layer, MoELayer):  # (MoELayer.forward drops the load-balancing loss)
                h = layer.attn(h)
                h, a = layer.moe(h, h)
                aux = a if aux is None else aux + a
            else:
                h = layer(h)
        if self.head_fp8:
            return self.head(h.reshape(-1, self.d), y.reshape(-1)), aux
        with fo.autocast(None):
            return self.head(h.reshape(-1, self.d), y.reshape(-1)), aux

    def output_projections(self) -> list[torch.Tensor]:
        """The weights that write into the residual stream (initialized smaller, see :func:`initial_state`)."""
        out = []
        for layer in self.layers:
            out.append(layer.attn.proj[0].weight)
            out.append(layer.moe[5].weight if isinstance(layer, MoELayer) else layer.mlp[3].weight)
        return out


class PlainByteLM(nn.Module):
    """:class:`ByteLM` (dense) in plain ``torch.nn`` on ``ours``' parameters
    (:class:`.cases_model.PlainDenseLayer`; the head ``nn.RMSNorm``, ``nn.Linear`` and
    ``F.cross_entropy`` of float32 logits)."""

    def __init__(self, ours: ByteLM) -> None:
        super().__init__()
        self.embed = ours.embed
        self.layers = nn.ModuleList(PlainDenseLayer(layer) for layer in ours.layers)
        self.norm = _shared_norm(ours.head[0].weight)
        self.lm = _shared_linear(ours.head[1].weight)

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        logits = self.lm(self.norm(h)).float()
        return F.cross_entropy(logits.view(-1, VOCAB), y.reshape(-1)), None


def initial_state(cfg: Config, kind: str, seed: int) -> dict:
    """The float32 initial weights of a ``kind`` model (CPU), from ``seed``: norms 1, every matrix
    N(0, 0.02^2), the output projections (attention out, FC2) N(0, (0.02 / sqrt(2 L))^2) (GPT-2's
    scaling). Drawn in parameter-name order from one generator: the global RNG is not touched."""
    with torch.random.fork_rng(devices=[]):
        model = ByteLM(cfg, kind, dtype=torch.float32)
    g = torch.Generator(device="cpu").manual_seed(seed)
    small = {id(w) for w in model.output_projections()}
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                std = 0.02 / math.sqrt(2 * cfg.layers) if id(p) in small else 0.02
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def build_model(variant: str, cfg: Config, device, state: dict, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """``variant``'s model in ``dtype`` on ``device``, holding ``state``'s weights."""
    spec = VARIANTS[variant]
    with torch.random.fork_rng(devices=[]):
        ours = ByteLM(cfg, spec.kind, device=device, dtype=dtype)
    if spec.perturb:
        g = torch.Generator(device="cpu").manual_seed(1)
        state = {k: v * (1 + spec.perturb * torch.randn(v.shape, generator=g)) for k, v in sorted(state.items())}
    ours.load_state_dict(state)
    ours.head_fp8 = spec.head_fp8
    return PlainByteLM(ours) if spec.plain else ours


def lr_at(step: int, steps: int, cfg: Config) -> float:
    """The learning rate of optimizer step ``step`` (0-based) of ``steps``: linear warm-up over
    ``warmup_fraction`` of them (at least 1), then cosine down to ``min_lr_ratio * lr`` at the last."""
    warm = max(1, round(cfg.warmup_fraction * steps))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = (step - warm) / max(1, steps - 1 - warm)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


# ---------------------------------------------------------------------------------------- training
class _Clock:
    """Training time, excluding evaluations: ``start`` / ``stop`` around segments (synchronized)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.total, self.t0 = device, 0.0, None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self._sync()
        self.t0 = time.perf_counter()

    def stop(self) -> None:
        if self.t0 is not None:
            self._sync()
            self.total += time.perf_counter() - self.t0
            self.t0 = None


def evaluate(model: nn.Module, stream: torch.Tensor, offsets: torch.Tensor, seq: int) -> float:
    """Mean loss over the windows of ``stream`` at ``offsets`` [batches, batch] (no gradient, no
    autocast: bf16; one host read at the end)."""
    total = torch.zeros((), dtype=torch.float32, device=stream.device)
    with torch.no_grad():
        for b in range(offsets.shape[0]):
            x, y = windows(stream, offsets[b], seq)
            total += model(x, y)[0].float()
    return (total / offsets.shape[0]).item()


def train(variant: str, cfg: Config, steps: Optional[int] = None, device="cpu", seed: int = 0, data_seed: int = 0,
          corpus: Optional[Corpus] = None, state: Optional[dict] = None, log: Optional[Callable] = None,
          dtype: torch.dtype = torch.bfloat16) -> dict:
    """Train ``variant`` for ``steps`` (default ``cfg.steps``) on ``device`` from the weights of
    ``seed`` (or ``state``, from :func:`initial_state`) on the batches of ``data_seed``.
    ``dtype``: of the parameters, activations and gradients (the variants are named for the
    default, bf16; float32 measures the rounding noise floor of
    :data:`.convergence_metrics.CI_TARGETS`).

    Returns a dict: ``train_loss`` (one float per step: the language-model loss, without the MoE
    load-balancing loss), ``val_steps`` / ``val_loss`` (the validations, after that many steps),
    ``grad_norm`` (per step, before clipping), ``final_val_loss``, ``tokens_per_s``, ``train_s``,
    ``peak_mib`` (CUDA: peak allocated during the run above what was allocated before it; else
    None), ``params`` / ``active_params``, ``status`` (``"ok"`` or why the run stopped) and
    ``model`` (the trained model). Two calls with the same arguments on CPU give identical curves
    and weights. The host reads the loss every ``cfg.log_every`` steps and at each validation only."""
    device = torch.device(device)
    spec = VARIANTS[variant]
    steps = cfg.steps if steps is None else int(steps)
    if steps < 1:
        raise ValueError(f"convergence: steps must be >= 1, got {steps}")
    corpus = corpus if corpus is not None else load_corpus(cfg.corpus_bytes)
    state = state if state is not None else initial_state(cfg, spec.kind, seed)
    log = log or (lambda msg: None)
    if device.type == "cuda":
        free_memory(device)
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0

    model = build_model(variant, cfg, device, state, dtype)
    params = list(model.parameters())
    master = [p.detach().to(torch.float32, copy=True) for p in params]
    for m in master:
        m.grad = torch.zeros_like(m)
    groups = [{"params": [m for m in master if m.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [m for m in master if m.dim() < 2], "weight_decay": 0.0}]
    impl = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=1e-8, **impl)
    recipe = spec.recipe() if spec.recipe is not None else None
    previous_kernels = set_process_mode(spec.kernels) if spec.kernels is not None else None
    try:
        return _train_loop(variant, cfg, steps, device, data_seed, model, params, master, opt, recipe, corpus, log,
                           base)
    finally:
        if previous_kernels is not None:
            set_process_mode(previous_kernels)


def _train_loop(variant, cfg, steps, device, data_seed, model, params, master, opt, recipe, corpus, log, base) -> dict:
    """:func:`train`'s steps, validations and result, from the built model and optimizer."""
    train_stream, val_stream = corpus.train.to(device), corpus.val.to(device)
    offsets = train_offsets(train_stream.numel(), cfg.seq, cfg.batch, steps, data_seed).to(device)
    voffsets = val_offsets(val_stream.numel(), cfg.seq, cfg.val_batches * cfg.batch).view(cfg.val_batches, cfg.batch)
    voffsets = voffsets.to(device)
    val_every = max(1, steps // cfg.val_points)
    losses = torch.zeros(steps, dtype=torch.float32, device=device)
    gnorms = torch.zeros(steps, dtype=torch.float32, device=device)
    val_steps, val_loss = [], []
    status, done = "ok", steps
    clock = _Clock(device)
    skip = min(cfg.timing_skip, steps // 5)

    for step in range(steps):
        if step == skip:
            clock.start()
        x, y = windows(train_stream, offsets[step], cfg.seq)
        with fo.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext():
            loss, aux = model(x, y)
        (loss if aux is None else loss + aux).backward()
        grads = [p.grad for p in params]
        if step == 0 and any(g is None for g in grads):
            names = [n for n, p in model.named_parameters() if p.grad is None]
            raise RuntimeError(f"convergence: {variant}: parameters without a gradient: {names}")
        torch._foreach_copy_([m.grad for m in master], grads)
        gnorms[step] = torch.nn.utils.clip_grad_norm_(master, cfg.clip, foreach=True)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, cfg)
        opt.step()
        with torch.no_grad():
            torch._foreach_copy_(params, master)
        model.zero_grad(set_to_none=True)
        losses[step] = loss.detach()

        n = step + 1
        if n % cfg.log_every == 0 or n % val_every == 0 or n == steps:
            cur = losses[step].item()
            if not math.isfinite(cur):
                status, done = f"error: non-finite loss ({cur}) at step {n}", n
                break
            if n % val_every == 0 or n == steps:
                clock.stop()
                val_steps.append(n)
                val_loss.append(evaluate(model, val_stream, voffsets, cfg.seq))
                if n < steps and n > skip:
                    clock.start()
            if n % cfg.log_every == 0 or n == steps:
                log(f"{variant}: step {n}/{steps} loss {cur:.4f}" + (f" val {val_loss[-1]:.4f}" if val_loss else ""))
    clock.stop()

    timed = done - skip
    n_params = sum(p.numel() for p in params)
    expert_params = sum(layer.moe[i].weight.numel() for layer in getattr(model, "layers", [])
                        if isinstance(layer, MoELayer) for i in (3, 5))
    return {
        "variant": variant, "status": status, "steps": steps,
        "train_loss": losses[:done].tolist(), "grad_norm": gnorms[:done].tolist(),
        "val_steps": val_steps, "val_loss": val_loss,
        "final_val_loss": val_loss[-1] if val_loss and status == "ok" else None,
        "train_s": clock.total,
        "tokens_per_s": timed * cfg.tokens_per_step / clock.total if timed > 0 and clock.total > 0 else None,
        "peak_mib": (torch.cuda.max_memory_allocated(device) - base) / 2**20 if device.type == "cuda" else None,
        "params": n_params, "active_params": n_params - expert_params + expert_params * cfg.top_k // cfg.experts,
        "model": model,
    }


# ------------------------------------------------------------------------------------------- rows
def make_row(result: dict, cfg: Config, meta: dict, setup: dict) -> dict:
    """The JSON row of one :func:`train` result (its model left out)."""
    row = dict(meta)
    row.update({k: v for k, v in result.items() if k != "model"})
    row.update(case="convergence", config=cfg.name, shape=cfg.describe(), dtype="bfloat16", setup=setup,
               tokens_per_step=cfg.tokens_per_step, recipe=recipe_name(result["variant"]))
    return row


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fusible_ops.bench convergence",
                                description="Train the same byte-level LM as plain torch, as ours in bf16 and under "
                                            "each FP8 recipe (and a MoE pair), and compare their loss curves.")
    p.add_argument("--variants", default="", help="comma list (default: all but the diagnostics): "
                                                  + ", ".join(VARIANTS))
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the config's)")
    p.add_argument("--quick", action="store_true", help="the CPU-sized config (default on CPU)")
    p.add_argument("--device", default=None, help="device (default: cuda if available, else cpu)")
    p.add_argument("--seed", type=int, default=0, help="initial weights' seed")
    p.add_argument("--data-seed", type=int, default=0, help="batch order's seed")
    p.add_argument("--out", default="bench_results", help="output folder for the JSON lines")
    p.add_argument("--report", metavar="PAGE", help="also write a page from this run's rows (plot under docs/img/ beside it)")
    p.add_argument("--shared-device", action="store_true",
                   help="other processes share the device (e.g. variants split over concurrent runs): the rows keep "
                        "their throughput, but the page does not show it as a speed")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m fusible_ops.bench convergence [--variants a,b] [--steps N] [--quick] ...``;
    exit code 1 when a variant failed to run or missed its targets."""
    argv = list(sys.argv[2:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cfg = QUICK_CONFIG if args.quick or device.type != "cuda" else GPU_CONFIG
    names = [v.strip() for v in args.variants.split(",") if v.strip()] or [
        v for v, spec in VARIANTS.items() if not spec.diagnostic]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        print(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    names = [v for v in VARIANTS if v in names]
    steps = cfg.steps if args.steps is None else args.steps
    tv, trv = versions()
    now = datetime.datetime.now(datetime.timezone.utc)
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    meta = dict(device=device_name(device), torch_version=tv, triton_version=trv,
                date_utc=now.isoformat(timespec="seconds"), driver=driver_version(device), quick=cfg is QUICK_CONFIG,
                shared_device=bool(args.shared_device),
                command=" ".join(["python -m fusible_ops.bench convergence", *argv]))
    corpus = load_corpus(cfg.corpus_bytes)
    setup = dict(dataclasses.asdict(cfg), steps=steps, seed=args.seed, data_seed=args.data_seed,
                 corpus=corpus.describe())
    _log(f"convergence on {meta['device']} (torch {tv}, triton {trv}): config {cfg.name} ({cfg.describe()}), "
         f"{steps} steps of {cfg.tokens_per_step} tokens; corpus {corpus.describe()}")
    path = os.path.join(args.out, f"bench_convergence_{stamp}.jsonl")
    states: dict = {}
    rows: list[dict] = []
    t_all = time.perf_counter()
    for name in names:
        kind = VARIANTS[name].kind
        if kind not in states:
            states[kind] = initial_state(cfg, kind, args.seed)
        t0 = time.perf_counter()
        try:
            result = train(name, cfg, steps, device, args.seed, args.data_seed, corpus, states[kind], log=_log)
        except Exception as e:  # (a broken variant: its row says why, the others still run)
            msg = f"{type(e).__name__}: {e}".replace("\n", " ")[:300]
            result = dict(variant=name, status=f"error: {msg}", steps=steps, train_loss=[], val_steps=[], val_loss=[],
                          final_val_loss=None, tokens_per_s=None, peak_mib=None)
        rows.append(make_row(result, cfg, meta, setup))
        del result
        free_memory(device)
        _log(f"{name}: {rows[-1]['status']}, final val {rows[-1]['final_val_loss']}, "
             f"{time.perf_counter() - t0:.1f} s")
        judge_rows(rows)
        write_jsonl(rows, path)
    from .convergence_report import convergence_table

    table = "\n".join(convergence_table(rows))
    with open(os.path.join(args.out, f"bench_convergence_{stamp}.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    _log(f"wrote {path} (total {time.perf_counter() - t_all:.1f} s)")
    if args.report:
        from .report import write_report

        _log(f"wrote {write_report(rows, args.report)}")
    failed = [r for r in rows if r["status"] != "ok" or r.get("passed") is False]
    return 1 if failed else 0


__all__ = ["Config", "GPU_CONFIG", "QUICK_CONFIG", "VARIANTS", "Variant", "recipe_name", "ByteLM", "PlainByteLM", "build_model", "evaluate",
           "initial_state", "lr_at", "main", "train"]
