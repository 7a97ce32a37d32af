"""Harness case ``lm_head``: a language model's head, ``Linear(d, V, bias=False) -> CrossEntropy``
(rule ``linear_cross_entropy``: chunked, no ``[T, V]`` logits) at T=16384, d=4096, V=128256, bf16.

Variants: ``fused`` (the default schedule: gradients in forward, 3 GEMMs), ``fused_recompute``
(logits recomputed in backward, 4 GEMMs), ``fused_512mib`` (the default schedule with 512 MiB
chunks instead of 128), ``fp8_current`` (the default schedule under
Float8CurrentScaling). Peers: eager ``F.cross_entropy(F.linear(x, W).float(), t)``, its
``torch.compile``, and Liger-Kernel's fused linear cross-entropy (``liger``) where importable. Work: the three GEMMs of
the unfused step (``6 T d V`` FLOPs), against the bf16 matmul ceiling. Rows are checked against the
eager composition (fp32 logits).
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F

import fusible_ops as fo

from ..fusion_rules import linear_ce
from .cases import CASES, FP8_REL_ERR, Bench, BenchContext, Case, _init_, _shape, _with_compile, fp8_variants, liger


def lm_head(ctx: BenchContext) -> Iterator[Bench]:
    T, d, V = ctx.size(16384, 64), ctx.size(4096, 64), ctx.size(128256, 256)
    seq = fo.Sequential(fo.Linear(d, V, bias=False, device=ctx.device, dtype=ctx.dtype), fo.CrossEntropy())
    w = seq[0].weight
    _init_(w, std=d ** -0.5)
    g = torch.Generator(device=ctx.device).manual_seed(0)

    def eager(x, t):
        return F.cross_entropy(F.linear(x, w).float(), t)

    def new_copy():
        t = torch.randint(0, V, (T,), device=ctx.device, generator=g)
        return (ctx.randn(T, d, requires_grad=True), t), torch.ones((), device=ctx.device)

    def with_setting(name, value):  # (read in forward; backward follows what forward saved)
        def call(x, t):
            old = getattr(linear_ce, name)
            setattr(linear_ce, name, value)
            try:
                return seq(x, t)
            finally:
                setattr(linear_ce, name, old)
        return call

    recompute, big_chunks = with_setting("GRAD_IN_FORWARD", False), with_setting("CHUNK_BYTES", 512 << 20)
    variants = _with_compile(ctx, {"fused": lambda x, t: seq(x, t), "fused_recompute": recompute,
                                   "fused_512mib": big_chunks, "eager": eager}, eager)
    variants.update({k: v for k, v in fp8_variants(ctx, seq).items() if k == "fp8_current"})
    lf = liger(ctx, "LigerFusedLinearCrossEntropyFunction")
    if lf is not None:
        variants["liger"] = lambda x, t: lf.apply(x, w, t)[0]
    yield Bench(
        case="lm_head", config="", shape=_shape(T, d, V), dtype=ctx.dtype, metric="flops",
        work=6.0 * T * d * V, new_copy=new_copy, params=[w], variants=variants,
        fused_module=seq, plan_args=lambda inp: inp, expected_rules=("linear_cross_entropy",),
        tolerances={"fp8_current": FP8_REL_ERR},
        notes={"fused": "linear_cross_entropy: chunks of tokens, gradients in forward (3 GEMMs)",
               "fused_recompute": "linear_cross_entropy: logits recomputed in backward (4 GEMMs)",
               "fused_512mib": "linear_cross_entropy with CHUNK_BYTES = 512 MiB (default 128 MiB)"},
    )


CASES.update({  # (registered into the harness's catalogue when fusible_ops.bench is imported)
    "lm_head": Case("Linear(4096, 128256, no bias) + CrossEntropy fwd+bwd, 16384 tokens (rule linear_cross_entropy) "
                    "vs F.cross_entropy(F.linear(x, W).float(), t), its compile and Liger's fused linear CE", lm_head),
})
