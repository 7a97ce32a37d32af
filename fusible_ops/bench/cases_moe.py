"""The MoE layer case: ``Router -> Dispatch -> GroupedLinear -> SwiGLU -> GroupedLinear -> Combine`` as
one ``fo.Sequential`` against the plain-PyTorch composition a user would write (router GEMM,
softmax, top-k, stable sort by expert, ``index_select``, ``torch._grouped_mm``, SwiGLU,
``torch._grouped_mm``, probability-weighted ``index_add_``), eager and under ``torch.compile``,
reading the same weights. Ours also with every fusion rule disabled, under FP8 current scaling and
graph-replayed. Top-k probabilities renormalised. Ours also computes its load-balancing loss (the
composition does not; neither is differentiated: the timed backward starts from the layer's output).

Work counted: the expert GEMMs, forward ``6 * T * k * H * F``, backward twice that.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F

import fusible_ops as fo

from ..kernels.moe_combine import gather_rows, scatter_copies
from .cases import CASES, FP8_REL_ERR, Bench, BenchContext, Case, _with_compile, graphed, tuned, unfused

SHAPES = [(24576, 1536, 256, 128, 8), (32768, 2048, 768, 128, 8), (16384, 4096, 14336, 8, 2)]
"""(tokens, hidden, expert ffn, experts, top_k): a fine-grained, a Qwen3-30B-A3B-like and a
coarse (Mixtral-like) layer."""


def moe_sequential(H: int, Fd: int, E: int, k: int, ep_group=None, local=None, **factory) -> fo.Sequential:
    """The layer as one ``fo.Sequential`` (expert parallel with ``ep_group``: ``local`` experts per
    rank), weights drawn at 1/sqrt(fan-in)."""
    g = E if local is None else local
    seq = fo.Sequential(fo.Router(H, E, top_k=k, score="softmax", normalize=True, **factory),
                        fo.Dispatch(ep_group=ep_group), fo.GroupedLinear(g, H, 2 * Fd, bias=False, **factory),
                        fo.SwiGLU(), fo.GroupedLinear(g, Fd, H, bias=False, **factory), fo.Combine())
    with torch.no_grad():
        seq[2].weight.normal_(0, H ** -0.5)
        seq[4].weight.normal_(0, Fd ** -0.5)
    return seq


def grouped_mm_moe(x: torch.Tensor, wr, w1, w2, k: int, record=None) -> torch.Tensor:
    """The plain-PyTorch MoE layer on [T, H] rows: router logits in float32 (as ours), softmax,
    top-k renormalised, a stable sort by expert, ``torch._grouped_mm`` for both expert GEMMs.
    ``record(expert_ids)``, if given, sees the top-k choice."""
    E = w1.shape[0]
    p, eid = F.linear(x.float(), wr.float()).softmax(-1).topk(k, dim=-1)
    if record is not None:
        record(eid)
    p = p / p.sum(-1, keepdim=True)
    flat = eid.flatten()
    order = flat.argsort(stable=True)
    counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0).to(torch.int32)
    tok = order // k
    a, b = torch._grouped_mm(x.index_select(0, tok), w1.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(a) * b, w2.transpose(-2, -1), offs=offs)
    y = y * p.flatten().index_select(0, order)[:, None].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, tok, y)


def composition(seq: fo.Sequential, k: int):
    """The plain-PyTorch MoE layer (:func:`grouped_mm_moe`) on ``seq``'s own parameters."""
    wr, w1, w2 = seq[0].weight, seq[2].weight, seq[4].weight
    return lambda x: grouped_mm_moe(x, wr, w1, w2, k)


def moe_layer(ctx: BenchContext) -> Iterator[Bench]:
    for T, H, Fd, E, k in SHAPES:
        T, H, Fd = ctx.size(T, 32), ctx.size(H, 32), ctx.size(Fd, 32)
        seq = moe_sequential(H, Fd, E, k, device=ctx.device, dtype=ctx.dtype)

        def fused(x, seq=seq):
            return seq(x)[0]

        def fp8_current(x, seq=seq):
            with fo.autocast(recipe=fo.Float8CurrentScaling()):
                return seq(x)[0]

        eager = composition(seq, k)
        variants = {"fused": fused, **unfused(ctx, fused, fp8=True), "fp8_current": fp8_current, "eager": eager}
        _with_compile(ctx, variants, eager)
        variants.update(graphed(ctx, seq, lambda inp: inp))
        variants.update(tuned(ctx, seq, lambda inp: inp, out=lambda y: y[0]))

        def new_copy(T=T, H=H):
            return (ctx.randn(T, H, requires_grad=True),), ctx.randn(T, H)

        yield Bench(
            case="moe_layer", config=f"E{E}_k{k}_H{H}", shape=f"T={T} H={H} F={Fd} E={E} k={k}", dtype=ctx.dtype,
            metric="flops", work=18 * T * k * H * Fd, new_copy=new_copy,
            params=[seq[0].weight, seq[2].weight, seq[4].weight], variants=variants, fused_module=seq,
            plan_args=lambda inp: (inp[0],),
            # (training on CUDA: the expert MLP's cost hint declines it; SwiGLU, FC2 and Combine fuse where
            # the expert width is below the hidden size (moe_act_combine's cost hint). On CPU
            # moe_dispatch_mlp takes FC2.)
            expected_rules=("moe_act_combine",) if ctx.device.type == "cuda" and Fd < H else (),
            tolerances=dict.fromkeys(("fp8_current", "fp8_unfused", "fp8_no_hints"), FP8_REL_ERR),
            notes={"eager": "plain-PyTorch composition (torch._grouped_mm)", "unfused": "every fusion rule disabled",
                   "no_hints": "the rules' cost hints ignored (moe_dispatch_mlp where the bf16 hint declines it; then Combine "
                                "runs unfused)",
                   "graphed": "fo.make_graphed_callables (includes copying x into the static input)",
                   "tuned": "plans chosen by fo.tune on the first input copy (prefer='speed')"},
        )
        del seq, variants, eager, fused, fp8_current, new_copy


def moe_copies(ctx: BenchContext) -> Iterator[Bench]:
    """The layer's token copies in expert order alone (Dispatch's forward; ``moe_act_combine``
    makes the same copies of ``dy``), forward only, at each layer shape with a fixed random
    top-k routing: ``fused`` :func:`~fusible_ops.kernels.moe_combine.scatter_copies` (each token
    read once, placed ``k`` times), ``gather_rows`` (each copy gathered: a token read ``k``
    times) and ``index_select`` (the baseline). Work: the bytes of the tokens read once and the
    copies written, against the run's copy bandwidth."""
    for T, H, _, E, k in SHAPES:
        T, H = ctx.size(T, 32), ctx.size(H, 32)
        g = torch.Generator(device="cpu").manual_seed(0)
        perm = torch.sort(torch.rand(T, E, generator=g).topk(k, dim=1).indices.flatten(), stable=True).indices
        inv = torch.argsort(perm).view(T, k).to(ctx.device)
        tokens = torch.div(perm, k, rounding_mode="floor").to(ctx.device)

        def new_copy(T=T, H=H):
            return (ctx.randn(T, H),), None

        yield Bench(
            case="moe_copies", config=f"E{E}_k{k}_H{H}", shape=f"T={T} H={H} E={E} k={k}", dtype=ctx.dtype,
            metric="bytes", work=(T + T * k) * H * torch.tensor([], dtype=ctx.dtype).element_size(),
            new_copy=new_copy, params=[], fused_module=None, plan_args=lambda inp: inp, baseline="index_select",
            variants={"fused": lambda x, inv=inv: scatter_copies(x, inv),
                      "gather_rows": lambda x, tokens=tokens: gather_rows(x, tokens),
                      "index_select": lambda x, tokens=tokens: x.index_select(0, tokens)},
            notes={"fused": "scatter_copies (each token read once)", "gather_rows": "gather_rows (each copy gathered)",
                   "index_select": "torch index_select"})


CASES.update({  # (registered into the harness's catalogue when fusible_ops.bench is imported)
    "moe_copies": Case("the MoE layer's token copies in expert order alone (Dispatch's forward): scatter_copies vs "
                       "gather_rows vs index_select", moe_copies),
    "moe_layer": Case("Router, Dispatch, GroupedLinear, SwiGLU, GroupedLinear, Combine vs the torch._grouped_mm "
                      "composition; configs per (E, top_k, hidden): " +
                      ", ".join(f"T={t} H={h} F={f} E={e} k={k}" for t, h, f, e, k in SHAPES), moe_layer),
})
