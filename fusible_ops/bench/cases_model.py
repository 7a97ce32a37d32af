"""Model-level cases: stacks of transformer layers written as a user would, attention in plain
PyTorch (``F.scaled_dot_product_attention``, causal) between fusible ``fo.Sequential``\\ s.

* ``dense_layers``: Llama-style layers. Attention sub-block ``Sequential(RMSNorm, Linear(d, 3d))``
  -> q, k, v -> SDPA -> ``Sequential(Linear(d, d), AddExtraInput)`` called as ``proj(attn, h)``;
  MLP sub-block ``Sequential(RMSNorm, Linear(d, 2f), SwiGLU, Linear(f, d), AddExtraInput)`` called
  as ``mlp(h, h)``. No bias anywhere.
* ``moe_layers``: the same attention sub-block, then a Qwen3-30B-A3B-like MoE block
  ``Sequential(RMSNorm, Router, Dispatch, GroupedLinear, SwiGLU, GroupedLinear, Combine,
  AddExtraInput)`` (the MoE ops as :func:`.cases_moe.moe_sequential` builds them).

The baseline ``eager`` is the same model in plain ``torch.nn`` (``nn.RMSNorm``, ``nn.Linear``,
``F.silu(a) * b``; for MoE the ``torch._grouped_mm`` composition of :mod:`.cases_moe`) holding
the SAME ``Parameter`` objects as ours (the harness checks every variant's gradients of our
parameters, so the peers must compute with them). Peers ``compile`` (of the plain model) and,
where torchao imports and FP8 matmuls run, ``torchao_{tensorwise,rowwise}_compile`` (a copy of
the plain model, sharing the parameters, converted by ``torchao.float8.convert_to_float8_training``,
then compiled). Ours: ``fused``, ``fused_compile`` (dense), ``graphed``, the FP8 recipes (MoE: current
scaling), ``graphed_fp8``.

Accuracy: every variant returns the stack's update ``out - x`` (so the residual stream's large
values cannot hide an error in what the layers add), and is checked against the same update from
a float64 run of the plain model on the same parameters (cast to float64 inside the reference, so
its gradients flow back to the parameters the harness checks; the reference's gradients come back
rounded to bf16 once, ~2^-9 relative). The ``eager`` baseline is checked against it too. MoE
layers replay the checked variant's expert choice (:class:`RoutingLog`). FP8 rows: see
:func:`fp8_stack_tolerance`.

Work counted per call (forward + backward): every linear ``6 * tokens * params`` (MoE experts:
``6 * tokens * top_k * params of one expert``; the router GEMM included), plus causal attention:
forward ``2 * 2 * B * S^2 * d / 2`` (QK^T and PV, half the score matrix), backward 2.5x forward,
so ``7 * B * S^2 * d`` per layer.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import fusible_ops as fo

from .cases import CASES, EPS, FP8_REL_ERR, Bench, BenchContext, Case, Lazy, _with_compile, fp8_variants, graphed, tuned
from .cases_moe import grouped_mm_moe, moe_sequential
from .common import is_fp8_variant
from ..ops.moe_routing import record_routing

DENSE_CONFIGS = {
    "L2_d4096": dict(layers=2, d=4096, heads=32, f=14336, B=2, S=4096),
    "L4_d2048": dict(layers=4, d=2048, heads=16, f=5632, B=2, S=2048),
}
DENSE_QUICK = dict(layers=2, d=128, heads=4, f=128, B=2, S=64)  # (FP8 block scaling: dims of 128)
MOE_CONFIGS = {"L2_d2048_E128": dict(layers=2, d=2048, heads=16, f=768, E=128, k=8, B=2, S=4096)}
MOE_QUICK = dict(layers=2, d=64, heads=4, f=96, E=8, k=2, B=2, S=64)

SELECTION_SLACK = 0.5
"""The float64 reference replays each variant's top-k choice (see :class:`RoutingLog`) after
checking it: no unchosen expert's float64 logit may exceed the lowest chosen one of its token by
more than SELECTION_SLACK standard deviations of the logits (FP8 upstream error moves logits by
~0.1 std; a wrong choice, e.g. an off-by-one expert index, by ~1 and more)."""

REF_ATTN_ELEMS = 2**28
"""The float64 reference runs SDPA's math path (score matrix materialised) over as many heads at
once as keep one score matrix at this many elements (2 GiB), each chunk recomputed in backward."""


def fp8_stack_tolerance(layers: int) -> float:
    """Bound on an FP8 variant's error for a stack of ``layers``: :data:`.cases.FP8_REL_ERR` (one
    quantized block against float64) times sqrt(2 * layers): each layer has two quantized
    sub-blocks in series (attention, MLP or MoE) and their noise powers add. (Measured on CPU, 2 layers: 0.11-0.17;
    4 layers: 0.16-0.21; a flat FP8_REL_ERR would fail every FP8 row.)"""
    return FP8_REL_ERR * math.sqrt(2 * layers)


def _fp8_capable(ctx: BenchContext) -> bool:
    """FP8 variants run: on CPU as emulation, on CUDA from compute capability 8.9."""
    return ctx.device.type != "cuda" or torch.cuda.get_device_capability(ctx.device) >= (8, 9)


# ------------------------------------------------------------------------------------- the model
def attention(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    """Causal self-attention of ``qkv`` [B, S, 3d] (q, k, v in this order along the last dim) with
    ``heads`` heads; returns [B, S, d]. A float64 input (the reference) runs in head chunks of at
    most REF_ATTN_ELEMS score elements, each checkpointed."""
    B, S, d3 = qkv.shape
    d = d3 // 3
    q, k, v = (t.view(B, S, heads, d // heads).transpose(1, 2) for t in qkv.split(d, dim=-1))
    chunk = heads if qkv.dtype != torch.float64 else max(1, REF_ATTN_ELEMS // (B * S * S))
    if chunk >= heads:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        out = torch.cat([checkpoint(F.scaled_dot_product_attention, q[:, i:i + chunk], k[:, i:i + chunk],
                                    v[:, i:i + chunk], is_causal=True, use_reentrant=False)
                         for i in range(0, heads, chunk)], dim=1)
    return out.transpose(1, 2).reshape(B, S, d)


def _init_linear(*weights: torch.Tensor) -> None:
    """Weights at std 1/sqrt(fan-in): each sub-block's update is of the residual stream's size."""
    with torch.no_grad():
        for w in weights:
            w.normal_(0, w.shape[-1] ** -0.5)


def _init_norm(*weights: torch.Tensor) -> None:
    with torch.no_grad():
        for w in weights:
            w.uniform_(0.8, 1.2)


class Attention(nn.Module):
    """Ours: ``Sequential(RMSNorm, Linear(d, 3d))`` -> SDPA -> ``Sequential(Linear(d, d), AddExtraInput)``."""

    def __init__(self, d: int, heads: int, **factory) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = fo.Sequential(fo.RMSNorm(d, eps=EPS, **factory), fo.Linear(d, 3 * d, bias=False, **factory))
        self.proj = fo.Sequential(fo.Linear(d, d, bias=False, **factory), fo.AddExtraInput())
        _init_norm(self.qkv[0].weight)
        _init_linear(self.qkv[1].weight, self.proj[0].weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(attention(self.qkv(h), self.heads), h)


class DenseLayer(nn.Module):
    """Ours: :class:`Attention`, then ``Sequential(RMSNorm, Linear(d, 2f), SwiGLU, Linear(f, d), AddExtraInput)``."""

    def __init__(self, d: int, heads: int, f: int, **factory) -> None:
        super().__init__()
        self.attn = Attention(d, heads, **factory)
        self.mlp = fo.Sequential(fo.RMSNorm(d, eps=EPS, **factory), fo.Linear(d, 2 * f, bias=False, **factory),
                                 fo.SwiGLU(), fo.Linear(f, d, bias=False, **factory), fo.AddExtraInput())
        _init_norm(self.mlp[0].weight)
        _init_linear(self.mlp[1].weight, self.mlp[3].weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.attn(h)
        return self.mlp(h, h)

    def plans(self, h: torch.Tensor) -> list[tuple[str, fo.Sequential, tuple]]:
        """(name, Sequential, its call's arguments for an input like ``h``) of each Sequential."""
        return [("attn.qkv", self.attn.qkv, (h,)), ("attn.proj", self.attn.proj, (h, h)), ("mlp", self.mlp, (h, h))]


class MoELayer(nn.Module):
    """Ours: :class:`Attention`, then ``Sequential(RMSNorm, Router, Dispatch, GroupedLinear, SwiGLU,
    GroupedLinear, Combine, AddExtraInput)`` called as ``moe(h, h)`` (its load-balancing loss, the
    Router's extra output, is dropped: not differentiated, as in ``moe_layer``)."""

    def __init__(self, d: int, heads: int, f: int, E: int, k: int, **factory) -> None:
        super().__init__()
        self.attn = Attention(d, heads, **factory)
        core = moe_sequential(d, f, E, k, **factory)
        self.moe = fo.Sequential(fo.RMSNorm(d, eps=EPS, **factory), *(core[i] for i in range(len(core))),
                                 fo.AddExtraInput())
        _init_norm(self.moe[0].weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.attn(h)
        return self.moe(h, h)[0]

    def plans(self, h: torch.Tensor) -> list[tuple[str, fo.Sequential, tuple]]:
        return [("attn.qkv", self.attn.qkv, (h,)), ("attn.proj", self.attn.proj, (h, h)), ("moe", self.moe, (h, h))]


def _shared_linear(w: nn.Parameter) -> nn.Linear:
    """An ``nn.Linear`` (no bias) whose weight IS ``w`` (no copy)."""
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
    lin.weight = w
    return lin


def _shared_norm(w: nn.Parameter) -> nn.RMSNorm:
    norm = nn.RMSNorm(w.shape[0], eps=EPS, device="meta")
    norm.weight = w
    return norm


class PlainAttention(nn.Module):
    """:class:`Attention` in plain ``torch.nn``, on ``ours``' parameters."""

    def __init__(self, ours: Attention) -> None:
        super().__init__()
        self.heads = ours.heads
        self.norm = _shared_norm(ours.qkv[0].weight)
        self.qkv = _shared_linear(ours.qkv[1].weight)
        self.proj = _shared_linear(ours.proj[0].weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(attention(self.qkv(self.norm(h)), self.heads)) + h


class PlainDenseLayer(nn.Module):
    """:class:`DenseLayer` in plain ``torch.nn`` (SwiGLU as ``fo.SwiGLU``: the first half is gated)."""

    def __init__(self, ours: DenseLayer) -> None:
        super().__init__()
        self.attn = PlainAttention(ours.attn)
        self.norm = _shared_norm(ours.mlp[0].weight)
        self.fc1 = _shared_linear(ours.mlp[1].weight)
        self.fc2 = _shared_linear(ours.mlp[3].weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.attn(h)
        a, b = self.fc1(self.norm(h)).chunk(2, dim=-1)
        return self.fc2(F.silu(a) * b) + h


class RoutingLog:
    """The experts each MoE layer chose in a variant's last call, which the float64 reference
    replays (after checking it, see SELECTION_SLACK). Upstream rounding (bf16, FP8) flips a near-tied
    k-th choice for a few percent of the tokens; each flip changes the update by that expert's
    share: an error of the routing's discontinuity, not of the numerics (the project's own
    references replay :func:`fusible_ops.ops.moe_routing.record_routing` logs for the same reason).

    :meth:`recorded` wraps a variant: our Routers log through ``record_routing``, the plain
    layers through :meth:`add`. With ``source``: a variant whose Python does not run per call (CUDA
    graph replay) takes the choice of ``source`` (the eager module whose kernels the graph
    replays), which the reference runs once."""

    def __init__(self) -> None:
        self.ids: Optional[list] = None  # expert ids [T, k] per layer, in call order
        self.source: Optional[Callable] = None
        self.replay: list = []  # what the float64 layers take, in order
        self._open: Optional[list] = None

    def add(self, ids: torch.Tensor) -> None:
        if self._open is not None:
            self._open.append(ids)

    def recorded(self, fn: Callable, source: Optional[Callable] = None) -> Callable:
        def call(*inputs):
            if source is not None:
                self.ids, self.source = None, source
                return fn(*inputs)
            self._open = []
            try:
                with record_routing() as log:
                    y = fn(*inputs)
            finally:
                plain, self._open = self._open, None
            self.ids, self.source = (log or plain), None
            return y
        return call

    def choice(self, x: torch.Tensor) -> list:
        """The last call's expert ids per layer (running ``source``, as trained: grad enabled)."""
        if self.ids is None and self.source is not None:
            with record_routing() as log:
                self.source(x)
            self.ids = log
        return list(self.ids or [])


def _experts_f64(x: torch.Tensor, wr, w1, w2, k: int, ids: Optional[torch.Tensor]) -> torch.Tensor:
    """The MoE block (Router .. Combine) on [T, H] float64 rows, per expert (``torch._grouped_mm``
    has no float64): softmax router, top-k (``ids`` when given, checked against SELECTION_SLACK),
    renormalised probabilities, as ours."""
    logits = F.linear(x, wr)
    if ids is None:
        ids = logits.topk(k, dim=-1).indices
    else:
        ids = ids.to(x.device)
        sel = logits.detach()
        chosen = sel.gather(1, ids).min(-1).values
        others = sel.scatter(1, ids, float("-inf")).max(-1).values
        excess = (others - chosen).max().item() / sel.std().item()
        if excess > SELECTION_SLACK:
            raise AssertionError(f"the run's expert choice is not a top-{k} of the float64 router logits: an "
                                 f"unchosen expert scores {excess:.2f} std above a chosen one (> {SELECTION_SLACK})")
    p = logits.softmax(-1).gather(1, ids)
    p = p / p.sum(-1, keepdim=True)
    y = torch.zeros_like(x)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        a, b = F.linear(x.index_select(0, tok), w1[e]).chunk(2, dim=-1)
        y = y.index_add(0, tok, F.linear(F.silu(a) * b, w2[e]) * p[tok, slot, None])
    return y


class PlainMoELayer(nn.Module):
    """:class:`MoELayer` in plain PyTorch on ``ours``' parameters: :class:`PlainAttention`,
    ``nn.RMSNorm``, the ``torch._grouped_mm`` composition (:func:`_plain_moe`; float64: the per-expert
    :func:`_experts_f64` on ``log``'s replayed choice)."""

    def __init__(self, ours: MoELayer, log: RoutingLog) -> None:
        super().__init__()
        self.attn = PlainAttention(ours.attn)
        self.norm = _shared_norm(ours.moe[0].weight)
        self.router_weight, self.w1, self.w2 = ours.moe[1].weight, ours.moe[3].weight, ours.moe[5].weight
        self.k = ours.moe[1].top_k
        self.log = log

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.attn(h)
        x = self.norm(h).reshape(-1, h.shape[-1])
        if x.dtype == torch.float64:
            ids = self.log.replay.pop(0) if self.log.replay else None
            y = _experts_f64(x, self.router_weight, self.w1, self.w2, self.k, ids)
        else:
            y = grouped_mm_moe(x, self.router_weight, self.w1, self.w2, self.k, self.log.add)
        return y.view_as(h) + h


class Stack(nn.Module):
    """``layers`` applied in order; ``update=True``: returns ``stack(x) - x`` (what every variant
    returns, so the error is measured on what the layers add to the residual stream)."""

    def __init__(self, layers, update: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.update = update

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.layers:
            h = layer(h)
        return h - x if self.update else h


class LayerPlans:
    """The harness's ``fused_module``: ``fusion_plan`` of every Sequential of one layer (the
    layers are alike), each row with the Sequential's name under ``"module"``."""

    def __init__(self, layer) -> None:
        self.layer = layer

    def fusion_plan(self, pass_: str, x: torch.Tensor) -> list[dict]:
        return [dict(row, module=name) for name, seq, args in self.layer.plans(x)
                for row in seq.fusion_plan(pass_, *args)]


def float64_reference(plain: nn.Module, log: Optional[RoutingLog] = None) -> Callable:
    """``reference(inputs, y)``: ``plain``'s output (the update) in float64, on its parameters
    cast to float64 inside the call (differentiable back to them); MoE layers replay the checked
    variant's expert choice from ``log``."""
    def reference(inputs, _y):
        (x,) = inputs
        if log is not None:
            log.replay = log.choice(x)
        params = {name: p.to(torch.float64) for name, p in plain.named_parameters()}
        try:
            return torch.func.functional_call(plain, params, (x.to(torch.float64),))
        finally:
            if log is not None:
                log.replay = []
    return reference


def torchao_float8(ctx: BenchContext):
    """(``torchao.float8``, "") where its peers can run here, else (None, why not): CPU, no FP8
    matmuls, ``--no-compile`` (the peers are compiled), torchao not importable."""
    if ctx.device.type != "cuda" or not _fp8_capable(ctx):
        return None, "torchao float8 peers need a CUDA GPU with FP8 matmuls (8.9+)"
    if not ctx.compile:
        return None, "torchao float8 peers skipped (--no-compile)"
    try:
        import torchao.float8 as float8
    except ImportError as e:
        return None, f"torchao float8 peers skipped: torchao not importable ({e})"
    return float8, ""


def torchao_variants(ctx: BenchContext, plain: nn.Module) -> tuple[dict, str]:
    """``torchao_{tensorwise,rowwise}_compile``: a copy of ``plain`` sharing its parameters,
    converted by ``torchao.float8.convert_to_float8_training`` and compiled; ({}, why) where they
    cannot run (:func:`torchao_float8`)."""
    float8, why = torchao_float8(ctx)
    if float8 is None:
        return {}, why
    import copy

    out = {}
    for recipe in ("tensorwise", "rowwise"):
        model = copy.deepcopy(plain, {id(p): p for p in plain.parameters()})
        float8.convert_to_float8_training(model, config=float8.Float8LinearConfig.from_recipe_name(recipe))
        out[f"torchao_{recipe}_compile"] = ctx.compiled(model)
    return out, ""


# ------------------------------------------------------------------------------------- the cases
def _stack_bench(ctx: BenchContext, case: str, config: str, shape: str, work: float, cfg: dict,
                 ours: Stack, plain: Stack, fp8: Optional[tuple], peers: bool,
                 log: Optional[RoutingLog] = None) -> Bench:
    """One configuration: ours (``Stack`` of our layers) against ``plain`` (the same parameters).
    ``fp8``: the FP8 variants to keep (``None``: all of :func:`.cases.fp8_variants`); ``peers``:
    add the torchao float8 peers; ``log``: the MoE layers' :class:`RoutingLog` (every variant
    records its expert choice there for the reference)."""
    B, S, d = cfg["B"], cfg["S"], cfg["d"]
    notes = {"eager": "plain torch.nn model on the same parameters (F.scaled_dot_product_attention)",
             "fused_compile": "torch.compile(dynamic=False) of ours",
             "graphed": "fo.make_graphed_callables of the whole stack (includes copying x into the static input)",
             "graphed_fp8": "graphed under Float8CurrentScaling"}
    variants = {"eager": plain, "fused": ours}
    _with_compile(ctx, variants, plain)
    if log is None:
        _with_compile(ctx, variants, ours, "fused_compile")
    elif ctx.compile:
        # A Router's routing log is a side effect inside the fused Sequential's traced region,
        # which dynamo refuses; the eager choice is no stand-in (compiled rounding upstream flips
        # near-tied choices, and causal attention spreads a flip to the later tokens)
        notes["fused"] = "fused_compile not run: its expert choice cannot be recorded for the float64 check"
    fp8_rows = {n: f for n, f in fp8_variants(ctx, ours).items() if fp8 is None or n in fp8}
    variants.update(fp8_rows)
    variants.update(graphed(ctx, ours, lambda inp: inp))
    if "fp8_current" in variants:
        variants.update(graphed(ctx, ours, lambda inp: inp, recipe=fo.Float8CurrentScaling()))
    if log is None:  # (dense: a tuned copy's MoE routers would not log the expert choice the check replays)
        variants.update(tuned(ctx, ours, lambda inp: inp))
    skipped = []
    if peers:
        ao, why = torchao_variants(ctx, plain)
        variants.update(ao)
        if why:
            skipped.append(why)
    if fp8 is not None:
        skipped.append(f"FP8 recipes other than {', '.join(fp8)} not run")
    if not fp8_rows:
        skipped.append("FP8 variants need compute capability 8.9+")
    if skipped:
        notes["eager"] += "; " + "; ".join(skipped)
    if log is not None:
        # graph replay runs no Python: the graphed variants take the choice of the eager module
        # running the same kernels
        variants = _recording(variants, log, sources={"graphed": ours, "graphed_fp8": variants.get("fp8_current")})
    fp8_names = [n for n in variants if is_fp8_variant(n)]

    def new_copy():
        return (ctx.randn(B, S, d, requires_grad=True),), ctx.randn(B, S, d)

    return Bench(
        case=case, config=config, shape=shape, dtype=ctx.dtype, metric="flops", work=work, new_copy=new_copy,
        params=list(ours.parameters()), variants=variants, fused_module=LayerPlans(ours.layers[0]),
        plan_args=lambda inp: (inp[0],), expected_rules=expected_rules(case, ctx.device, cfg),
        reference=float64_reference(plain, log), notes=notes,
        tolerances=dict.fromkeys(fp8_names, fp8_stack_tolerance(cfg["layers"])),
    )


def _recording(variants: dict, log: RoutingLog, sources: dict) -> dict:
    """``variants`` each wrapped by ``log.recorded`` (a :class:`~.cases.Lazy` one once built;
    those named in ``sources`` take that callable's choice)."""
    out = {}
    for name, fn in variants.items():
        src = sources.get(name)
        if isinstance(fn, Lazy):
            out[name] = Lazy(lambda inp, make=fn.make, src=src: log.recorded(make(inp), src), pooled=fn.pooled)
        else:
            out[name] = log.recorded(fn, src)
    return out


def expected_rules(case: str, device: torch.device, cfg: dict) -> tuple:
    """The rules the fused stack must apply. The residual add after each output projection goes into
    its GEMM (linear_add); the add that ends a sub-block and the norm that starts the next sit in
    different Sequentials (residual_norm needs both in one), and no rule fuses a norm into a linear.
    MoE: on CPU moe_dispatch_mlp takes the experts; in training on CUDA its cost hint declines it
    and moe_act_combine fuses SwiGLU, FC2 and Combine where the expert width is below d (its own
    cost hint)."""
    if case == "dense_layers":
        return ("linear_add",)
    if device.type != "cuda":
        return ("linear_add", "moe_dispatch_mlp")
    return ("linear_add", "moe_act_combine") if cfg["f"] < cfg["d"] else ("linear_add",)


def dense_layers(ctx: BenchContext) -> Iterator[Bench]:
    configs = {"quick": DENSE_QUICK} if ctx.quick else DENSE_CONFIGS
    factory = dict(device=ctx.device, dtype=ctx.dtype)
    for name, cfg in configs.items():
        L, d, H, f, B, S = (cfg[k] for k in ("layers", "d", "heads", "f", "B", "S"))
        ours = Stack([DenseLayer(d, H, f, **factory) for _ in range(L)])
        plain = Stack([PlainDenseLayer(layer) for layer in ours.layers])
        T = B * S
        work = L * (6 * T * (4 * d * d + 3 * d * f) + 7 * B * S * S * d)
        yield _stack_bench(ctx, "dense_layers", name, f"L={L} B={B} S={S} d={d} heads={H} f={f}", work, cfg,
                           ours, plain, fp8=None, peers=True)
        del ours, plain


def moe_layers(ctx: BenchContext) -> Iterator[Bench]:
    configs = {"quick": MOE_QUICK} if ctx.quick else MOE_CONFIGS
    factory = dict(device=ctx.device, dtype=ctx.dtype)
    for name, cfg in configs.items():
        L, d, H, f, E, k, B, S = (cfg[n] for n in ("layers", "d", "heads", "f", "E", "k", "B", "S"))
        ours = Stack([MoELayer(d, H, f, E, k, **factory) for _ in range(L)])
        log = RoutingLog()
        plain = Stack([PlainMoELayer(layer, log) for layer in ours.layers])
        T = B * S
        work = L * (6 * T * (4 * d * d + d * E) + 18 * T * k * d * f + 7 * B * S * S * d)
        yield _stack_bench(ctx, "moe_layers", name, f"L={L} B={B} S={S} d={d} heads={H} F={f} E={E} k={k}", work,
                           cfg, ours, plain, fp8=("fp8_current",), peers=False, log=log)
        del ours, plain, log


CASES.update({  # (registered into the harness's catalogue when fusible_ops.bench is imported)
    "dense_layers": Case("Llama-style layers (RMSNorm+QKV, causal SDPA in torch, proj+residual, SwiGLU MLP+residual) "
                         "vs the plain torch.nn model; configs " + ", ".join(DENSE_CONFIGS), dense_layers),
    "moe_layers": Case("attention + Qwen3-30B-A3B-like MoE block (RMSNorm, Router .. Combine, residual) vs plain "
                       "attention + the torch._grouped_mm composition; config " + ", ".join(MOE_CONFIGS), moe_layers),
})
