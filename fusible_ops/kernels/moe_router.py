"""MoE router kernels (Triton), beside pure-torch ``*_ref`` twins: the routing of a layer in three
launches, its logits' gradient in one.

A router scores ``T`` tokens over ``E`` experts (``logits`` [T, E] float32) and sends each token to
``k`` of them. :func:`route` turns the logits into everything the layer needs:

* ``ids`` [T, k] int64 (the top-k of the scores, best first; ties go to the lower expert index),
  ``probs`` [T, k] float32 (the selected scores, divided by their sum with ``normalize``);
* ``counts`` [E] int64: token copies per expert;
* ``perm`` [T * k] int64: copy positions ``t * k + j`` sorted by expert, stably (tokens of one
  expert keep token order), and ``inv_perm``, its inverse;
* ``score_sum`` [E] float32: the column sums of the balancing probabilities (the scores for
  softmax, the scores normalised over the experts for sigmoid) for the load-balancing loss;
  ``zsum``: ``sum_t logsumexp(logits_t) ** 2`` (float32 scalar) for the z-loss. Each only when asked.

Scores: ``"softmax"`` (``softmax(logits)``) or ``"sigmoid"``; selection by the top-k of
``scores + bias`` (``bias`` [E] float32, DeepSeek-V3's balancing bias) when a bias is given.

The Triton path is a counting sort, with no host sync and no atomics (deterministic):

1. ``_route_topk_kernel``, one program per block of ``BT`` tokens: scores, top-k by ``k`` rounds of
   an arg-max, probabilities, and the block's copies per expert (``[blocks, E]`` int32), score sums
   and z partials;
2. ``_block_scan_kernel``, one program per expert: the expert's copies in the earlier blocks (an
   exclusive scan down its column) and in all (``counts``);
3. ``_route_sort_kernel``, one program per block: the expert's start (a scan of ``counts``), plus
   its copies in earlier blocks, plus the copy's rank among the block's copies of its expert
   gives each copy's sorted position.

(``torch.cumsum`` down the ``[blocks, E]`` counts, the first version of step 2, took 0.56 ms on
an H200 at T=24576, E=128, k=8: a scan along the outer dimension with few columns.)

:func:`router_dlogits` is the logits' gradient from the probabilities' gradient and the
auxiliary loss's (load balancing and z-loss), in one pass over the logits (it recomputes the
scores rather than keeping them).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import HAS_TRITON, use_triton
from .launch import DirectKernel, cdiv, geometry_cache, kernel_op, next_pow2, remember

SCORES = ("softmax", "sigmoid")

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _scores(x, cmask, SOFTMAX: tl.constexpr):
        """Scores of a [BT, EP] tile of logits (padding columns: 0), and the rows' logsumexp."""
        m = tl.max(x, 1)
        e = tl.where(cmask[None, :], tl.exp(x - m[:, None]), 0.0)
        den = tl.sum(e, 1)
        if SOFTMAX:
            s = e / den[:, None]
        else:
            s = tl.where(cmask[None, :], 1.0 / (1.0 + tl.exp(-x)), 0.0)
        return s, m + tl.log(den)

    @triton.jit
    def _route_topk_kernel(
        logits_ptr, bias_ptr, ids_ptr, probs_ptr, bcount_ptr, psum_ptr, zpart_ptr,
        T, E, s_l,
        K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr, BT: tl.constexpr, SOFTMAX: tl.constexpr,
        NORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr, PSUM: tl.constexpr, ZSUM: tl.constexpr,
    ):
        """Grid (cdiv(T, BT),): top-k of BT tokens; the block's copies per expert, score sums and
        z partial (row ``pid`` of bcount/psum, element ``pid`` of zpart)."""
        pid = tl.program_id(0)
        rows = pid * BT + tl.arange(0, BT)
        cols = tl.arange(0, EP)
        rmask, cmask = rows < T, cols < E
        r64 = rows.to(tl.int64)
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(logits_ptr + r64[:, None] * s_l + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        x = tl.where(rmask[:, None], x, 0.0)  # (padding rows: finite, never stored)
        s, lse = _scores(x, cmask, SOFTMAX)
        sel = s
        if HAS_BIAS:
            sel = s + tl.load(bias_ptr + cols, mask=cmask, other=0.0)[None, :]
        sel = tl.where(cmask[None, :], sel, float("-inf"))
        kcols = tl.arange(0, KP)
        vals = tl.zeros((BT, KP), dtype=tl.float32)
        chosen = tl.zeros((BT, EP), dtype=tl.int32)
        for j in tl.static_range(K):
            idx = tl.argmax(sel, 1, tie_break_left=True)
            hit = cols[None, :] == idx[:, None]
            vals = tl.where(kcols[None, :] == j, vals + tl.sum(tl.where(hit, s, 0.0), 1)[:, None], vals)
            sel = tl.where(hit, float("-inf"), sel)
            chosen += hit.to(tl.int32)
            tl.store(ids_ptr + r64 * K + j, idx.to(tl.int64), mask=rmask)
        if NORMALIZE:
            vals = vals / tl.sum(vals, 1)[:, None]
        tl.store(probs_ptr + r64[:, None] * K + kcols[None, :], vals, mask=rmask[:, None] & (kcols < K)[None, :])
        chosen = tl.where(rmask[:, None], chosen, 0)
        tl.store(bcount_ptr + pid * E + cols, tl.sum(chosen, 0), mask=cmask)
        if PSUM:
            p = s
            if not SOFTMAX:
                p = s / tl.sum(s, 1)[:, None]
            tl.store(psum_ptr + pid * E + cols, tl.sum(tl.where(rmask[:, None], p, 0.0), 0), mask=cmask)
        if ZSUM:
            tl.store(zpart_ptr + pid, tl.sum(tl.where(rmask, lse * lse, 0.0), 0))

    @triton.jit
    def _block_scan_kernel(bcount_ptr, excl_ptr, counts_ptr, NB, E, CH: tl.constexpr):
        """Grid (E,): expert e's copies in the blocks before each block (``excl`` [NB, E] int32,
        an exclusive scan down column e of ``bcount``) and in all blocks (``counts[e]``, int64)."""
        e = tl.program_id(0)
        carry = tl.zeros((), dtype=tl.int32)
        for b0 in range(0, NB, CH):
            b = b0 + tl.arange(0, CH)
            v = tl.load(bcount_ptr + b * E + e, mask=b < NB, other=0)
            tl.store(excl_ptr + b * E + e, carry + tl.cumsum(v, 0) - v, mask=b < NB)
            carry += tl.sum(v, 0)
        tl.store(counts_ptr + e, carry.to(tl.int64))

    @triton.jit
    def _route_sort_kernel(
        ids_ptr, excl_ptr, counts_ptr, perm_ptr, inv_ptr, N, E,
        BC: tl.constexpr, BCP: tl.constexpr, EP: tl.constexpr,
    ):
        """Grid (cdiv(N, BC),): sorted positions of the block's BC copies (BCP: BC padded to a
        power of 2): the expert's start, plus its copies in earlier blocks, plus the earlier
        copies of the expert in this block."""
        pid = tl.program_id(0)
        lane = tl.arange(0, BCP)
        c = pid * BC + lane
        cols = tl.arange(0, EP)
        cmask = (lane < BC) & (c < N)
        e = tl.load(ids_ptr + c, mask=cmask, other=0).to(tl.int32)  # (32-bit from here: half the registers)
        same = (e[:, None] == e[None, :]) & (lane[None, :] < lane[:, None]) & cmask[None, :]
        rank = tl.sum(same.to(tl.int32), 1)
        counts = tl.load(counts_ptr + cols, mask=cols < E, other=0).to(tl.int32)
        start = tl.cumsum(counts, 0) - counts  # each expert's first sorted position
        mine = tl.sum(tl.where(e[:, None] == cols[None, :], start[None, :], 0), 1)
        pos = (mine + tl.load(excl_ptr + pid * E + e, mask=cmask, other=0) + rank).to(tl.int64)
        c64 = c.to(tl.int64)
        tl.store(perm_ptr + pos, c64, mask=cmask)
        tl.store(inv_ptr + c64, pos, mask=cmask)

    @triton.jit
    def _router_dlogits_kernel(
        logits_ptr, ids_ptr, dp_ptr, counts_ptr, daux_ptr, out_ptr,
        T, E, s_l, s_o, aux_scale, z_scale,
        K: tl.constexpr, EP: tl.constexpr, BT: tl.constexpr, SOFTMAX: tl.constexpr, NORMALIZE: tl.constexpr,
        HAS_DP: tl.constexpr, AUX: tl.constexpr, Z: tl.constexpr,
    ):
        """Grid (cdiv(T, BT),): d(loss)/d(logits) of BT tokens (math: :func:`router_dlogits_ref`)."""
        rows = tl.program_id(0) * BT + tl.arange(0, BT)
        cols = tl.arange(0, EP)
        rmask, cmask = rows < T, cols < E
        r64 = rows.to(tl.int64)
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(logits_ptr + r64[:, None] * s_l + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        x = tl.where(rmask[:, None], x, 0.0)
        s, lse = _scores(x, cmask, SOFTMAX)
        ds = tl.zeros((BT, EP), dtype=tl.float32)
        if HAS_DP:
            total = tl.zeros((BT,), dtype=tl.float32)
            dot = tl.zeros((BT,), dtype=tl.float32)
            if NORMALIZE:  # d/dv of v / sum(v): (dp - <dp, v> / total) / total
                for j in tl.static_range(K):
                    idx = tl.load(ids_ptr + r64 * K + j, mask=rmask, other=0)
                    dp = tl.load(dp_ptr + r64 * K + j, mask=rmask, other=0.0)
                    v = tl.sum(tl.where(cols[None, :] == idx[:, None], s, 0.0), 1)
                    total += v
                    dot += dp * v
            for j in tl.static_range(K):
                idx = tl.load(ids_ptr + r64 * K + j, mask=rmask, other=0)
                dp = tl.load(dp_ptr + r64 * K + j, mask=rmask, other=0.0)
                if NORMALIZE:
                    dp = (dp - dot / total) / total
                ds += tl.where(cols[None, :] == idx[:, None], dp[:, None], 0.0)
        if AUX or Z:
            daux = tl.load(daux_ptr).to(tl.float32)
        if AUX:
            g = tl.load(counts_ptr + cols, mask=cmask, other=0).to(tl.float32) * (aux_scale * daux)
            if SOFTMAX:
                ds += g[None, :]
            else:  # P uses s normalised over the experts
                tot = tl.sum(s, 1)
                ds += (g[None, :] - (tl.sum(s * g[None, :], 1) / tot)[:, None]) / tot[:, None]
        if SOFTMAX:
            dl = s * (ds - tl.sum(ds * s, 1)[:, None])
        else:
            dl = ds * s * (1.0 - s)
        if Z:
            sm = tl.exp(x - lse[:, None])
            dl += (z_scale * daux) * lse[:, None] * sm
        tl.store(out_ptr + r64[:, None] * s_o + cols[None, :], dl.to(out_ptr.dtype.element_ty), mask=mask)

    _TOPK = DirectKernel(_route_topk_kernel)
    _SCAN = DirectKernel(_block_scan_kernel)
    _SORT = DirectKernel(_route_sort_kernel)
    _DLOGITS = DirectKernel(_router_dlogits_kernel)

TILE = 2048  # [tokens, experts] elements per program (tests shrink it to get many programs)
SORT_COPIES = 64  # copies per sort program at most (its rank tile is [copies, copies])
SCAN_CHUNK = 256  # blocks per step of the scan down each expert's column
_GEOMETRY = geometry_cache()


class Route(NamedTuple):
    """What :func:`route` returns (module doc)."""

    ids: torch.Tensor
    probs: torch.Tensor
    counts: torch.Tensor
    perm: torch.Tensor
    inv_perm: torch.Tensor
    score_sum: Optional[torch.Tensor]
    zsum: Optional[torch.Tensor]


def _geometry(t: int, e: int, k: int) -> tuple:
    """(BT, EP, KP, warps, sort warps): tokens per program (the top-k's and the sort's blocks are
    the same), padded experts and top-k. The sort compares each of a block's copies with every
    other, so its blocks hold at most ``SORT_COPIES`` copies."""
    key = (t, e, k, TILE, SORT_COPIES)
    g = _GEOMETRY.get(key)
    if g is None:
        ep, kp = max(2, next_pow2(e)), max(2, next_pow2(k))
        bt = max(1, min(TILE // ep, SORT_COPIES // kp, next_pow2(max(t, 1))))
        g = remember(_GEOMETRY, key, (bt, ep, kp, 8 if bt * ep >= 4096 else 4, 8 if bt * kp * ep >= 16384 else 4))
    return g


@kernel_op("fusible_ops::moe_route", mutates_args=())
def _route_op(logits: torch.Tensor, bias: Optional[torch.Tensor], k: int, softmax: bool, normalize: bool,
              psum: bool, zsum: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                               torch.Tensor, torch.Tensor, torch.Tensor]:
    t, e = logits.shape
    dev = logits.device
    bt, ep, kp, warps, sort_warps = _geometry(t, e, k)
    nb = cdiv(t, bt)
    ids = torch.empty((t, k), dtype=torch.int64, device=dev)
    probs = torch.empty((t, k), dtype=torch.float32, device=dev)
    bcount = torch.empty((nb, e), dtype=torch.int32, device=dev)
    ps = torch.empty((nb, e) if psum else (0,), dtype=torch.float32, device=dev)
    zp = torch.empty((nb,) if zsum else (0,), dtype=torch.float32, device=dev)
    args = (logits, logits if bias is None else bias, ids, probs, bcount, ps if psum else probs, zp if zsum else probs,
            t, e, logits.stride(0))
    meta = dict(K=k, KP=kp, EP=ep, BT=bt, SOFTMAX=softmax, NORMALIZE=normalize, HAS_BIAS=bias is not None,
                PSUM=psum, ZSUM=zsum, num_warps=warps)
    _TOPK((nb,), (dev, t, e, logits.stride(0), *meta.values()), args, meta)
    excl = torch.empty_like(bcount)
    counts = torch.empty(e, dtype=torch.int64, device=dev)
    meta = dict(CH=SCAN_CHUNK, num_warps=4)
    _SCAN((e,), (dev, nb, e, SCAN_CHUNK), (bcount, excl, counts, nb, e), meta)
    n = t * k
    perm = torch.empty(n, dtype=torch.int64, device=dev)
    inv = torch.empty(n, dtype=torch.int64, device=dev)
    meta = dict(BC=bt * k, BCP=next_pow2(bt * k), EP=ep, num_warps=sort_warps)
    _SORT((nb,), (dev, n, e, *meta.values()), (ids, excl, counts, perm, inv, n, e), meta)
    return (ids, probs, counts, perm, inv, ps.sum(0) if psum else ps, zp.sum() if zsum else zp)


@_route_op.register_fake
def _(logits, bias, k, softmax, normalize, psum, zsum):
    t, e = logits.shape
    i64 = dict(dtype=torch.int64)
    return (logits.new_empty((t, k), **i64), logits.new_empty((t, k)), logits.new_empty((e,), **i64),
            logits.new_empty((t * k,), **i64), logits.new_empty((t * k,), **i64),
            logits.new_empty((e,) if psum else (0,)), logits.new_empty(() if zsum else (0,)))


def _check_logits(logits: torch.Tensor, k: int, score: str, bias: Optional[torch.Tensor]) -> None:
    if logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError(f"route: logits must be a floating [T, E] tensor, got {list(logits.shape)} {logits.dtype}")
    if not 1 <= k <= logits.shape[1]:
        raise ValueError(f"route: top_k must be in [1, {logits.shape[1]}], got {k}")
    if score not in SCORES:
        raise ValueError(f"route: score must be one of {SCORES}, got {score!r}")
    if bias is not None and bias.shape != (logits.shape[1],):
        raise ValueError(f"route: bias must be [{logits.shape[1]}], got {list(bias.shape)}")


def route(logits: torch.Tensor, k: int, *, score: str = "softmax", normalize: bool = False,
          bias: Optional[torch.Tensor] = None, score_sum: bool = False, zsum: bool = False) -> Route:
    """A MoE layer's routing from its router logits [T, E] (module doc): top-k ids and
    probabilities, copies per expert, the stable sort of the copies by expert and its inverse,
    and on request the balancing probabilities' column sums and the z-loss sum. float32 logits on
    CUDA run the three Triton kernels; anything else runs :func:`route_ref`."""
    _check_logits(logits, k, score, bias)
    t, e = logits.shape
    if t and logits.dtype == torch.float32 and use_triton(logits, bias):
        b = None if bias is None else bias.to(torch.float32).contiguous()
        ids, probs, counts, perm, inv, ps, zs = _route_op(logits, b, k, score == "softmax", normalize, score_sum, zsum)
        return Route(ids, probs, counts, perm, inv, ps if score_sum else None, zs if zsum else None)
    return route_ref(logits, k, score=score, normalize=normalize, bias=bias, score_sum=score_sum, zsum=zsum)


def expert_counts_ref(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Token copies per expert from the expert ids [T, k]: int64 [E] on ids' device (``scatter_add_``,
    no host sync)."""
    flat = ids.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))


def sort_by_expert_ref(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(perm, inv_perm): copy positions ``t * k + j`` sorted by expert (a stable ``argsort``), and
    its inverse."""
    perm = torch.argsort(ids.reshape(-1), stable=True)
    inv = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
    return perm, inv


def route_ref(logits: torch.Tensor, k: int, *, score: str = "softmax", normalize: bool = False,
              bias: Optional[torch.Tensor] = None, score_sum: bool = False, zsum: bool = False) -> Route:
    """Pure-torch twin of :func:`route` (``torch.topk``, ``scatter_add_``, a stable ``argsort``)."""
    _check_logits(logits, k, score, bias)
    s = torch.softmax(logits, -1) if score == "softmax" else torch.sigmoid(logits)
    sel = s if bias is None else s + bias.to(s.dtype)
    ids = torch.topk(sel, k, dim=-1).indices
    probs = s.gather(1, ids)
    if normalize:
        probs = probs / probs.sum(-1, keepdim=True)
    counts = expert_counts_ref(ids, logits.shape[1])
    perm, inv = sort_by_expert_ref(ids)
    ps = zs = None
    if score_sum:
        ps = (s if score == "softmax" else s / s.sum(-1, keepdim=True)).sum(0)
    if zsum:
        zs = torch.logsumexp(logits, -1).square().sum()
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return Route(ids, probs.to(acc), counts, perm, inv, None if ps is None else ps.to(acc),
                 None if zs is None else zs.to(acc))


# ----------------------------------------------------------------------------- logits' gradient
@kernel_op("fusible_ops::moe_router_dlogits", mutates_args=())
def _dlogits_op(logits: torch.Tensor, ids: torch.Tensor, dprobs: Optional[torch.Tensor], counts: torch.Tensor,
                daux: Optional[torch.Tensor], softmax: bool, normalize: bool, aux_scale: float, z_scale: float,
                out_dtype: torch.dtype) -> torch.Tensor:
    t, e = logits.shape
    k = ids.shape[1]
    out = torch.empty((t, e), dtype=out_dtype, device=logits.device)
    if t == 0:
        return out
    bt, ep, _, warps, _ = _geometry(t, e, k)
    aux, z = daux is not None and aux_scale != 0.0, daux is not None and z_scale != 0.0
    args = (logits, ids, logits if dprobs is None else dprobs, counts, logits if daux is None else daux, out,
            t, e, logits.stride(0), out.stride(0), float(aux_scale), float(z_scale))
    meta = dict(K=k, EP=ep, BT=bt, SOFTMAX=softmax, NORMALIZE=normalize, HAS_DP=dprobs is not None, AUX=aux, Z=z,
                num_warps=warps)
    _DLOGITS((cdiv(t, bt),), (logits.device, out_dtype, t, e, logits.stride(0), *meta.values()), args, meta)
    return out


@_dlogits_op.register_fake
def _(logits, ids, dprobs, counts, daux, softmax, normalize, aux_scale, z_scale, out_dtype):
    return logits.new_empty(logits.shape, dtype=out_dtype)


def router_dlogits(logits: torch.Tensor, ids: torch.Tensor, dprobs: Optional[torch.Tensor], counts: torch.Tensor,
                   daux: Optional[torch.Tensor], *, score: str = "softmax", normalize: bool = False,
                   aux_coeff: float = 0.0, z_coeff: float = 0.0, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """d(loss)/d(logits) [T, E] (in ``out_dtype``, default the logits') of a router with ``score``
    and ``normalize``, from ``dprobs`` [T, k] (the probabilities' gradient, or None) and ``daux``
    (the auxiliary loss's gradient, a scalar tensor, or None), given the forward's ``ids`` [T, k]
    and ``counts`` [E]. The auxiliary loss is
    ``aux_coeff * E * sum_e f_e * P_e + z_coeff * mean_t(logsumexp(logits_t) ** 2)`` (Router doc)."""
    _check_logits(logits, ids.shape[1], score, None)
    out_dtype = out_dtype or logits.dtype
    t, e = logits.shape
    k = ids.shape[1]
    aux_scale = aux_coeff * e / (t * t * k) if t else 0.0
    z_scale = 2.0 * z_coeff / t if t else 0.0
    if logits.dtype == torch.float32 and use_triton(logits, dprobs, daux):
        dp = None if dprobs is None else dprobs.to(torch.float32).contiguous()
        return _dlogits_op(logits, ids.contiguous(), dp, counts, daux, score == "softmax", normalize, aux_scale,
                           z_scale, out_dtype)
    return router_dlogits_ref(logits, ids, dprobs, counts, daux, score=score, normalize=normalize,
                              aux_coeff=aux_coeff, z_coeff=z_coeff).to(out_dtype)


def router_dlogits_ref(logits: torch.Tensor, ids: torch.Tensor, dprobs: Optional[torch.Tensor], counts: torch.Tensor,
                       daux: Optional[torch.Tensor], *, score: str = "softmax", normalize: bool = False,
                       aux_coeff: float = 0.0, z_coeff: float = 0.0) -> torch.Tensor:
    """Pure-torch twin of :func:`router_dlogits` (in the logits' dtype)."""
    tokens, e = logits.shape
    k = ids.shape[1]
    softmax = score == "softmax"
    s = torch.softmax(logits, -1) if softmax else torch.sigmoid(logits)
    ds = torch.zeros_like(logits)
    if dprobs is not None:
        vals = s.gather(1, ids)
        dprobs = dprobs.to(s.dtype)
        if normalize:
            total = vals.sum(-1, keepdim=True)
            dprobs = (dprobs - (dprobs * vals).sum(-1, keepdim=True) / total) / total
        ds.scatter_add_(1, ids, dprobs)
    if daux is not None and tokens and aux_coeff:
        g = counts.to(s.dtype) * (aux_coeff * e / (tokens * tokens * k)) * daux  # dP_e / T
        if softmax:
            ds = ds + g
        else:  # P uses s normalized over the experts
            total = s.sum(-1, keepdim=True)
            ds = ds + (g - (s * g).sum(-1, keepdim=True) / total) / total
    dl = s * (ds - (ds * s).sum(-1, keepdim=True)) if softmax else ds * s * (1 - s)
    if daux is not None and tokens and z_coeff:
        lse = torch.logsumexp(logits, -1, keepdim=True)
        dl = dl + (2 * z_coeff / tokens) * daux * lse * torch.softmax(logits, -1)
    return dl


__all__ = ["Route", "expert_counts_ref", "route", "route_ref", "router_dlogits", "router_dlogits_ref",
           "sort_by_expert_ref"]
