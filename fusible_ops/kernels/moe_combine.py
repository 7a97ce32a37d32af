"""Token-copy gather-sum kernels of a MoE layer (Triton), beside pure-torch ``*_ref`` twins.

A routed layer holds ``k`` copies of each of ``T`` tokens in an expert-ordered ``[N, H]`` tensor
(``N = T * k``): copy ``j`` of token ``t`` is row ``index[t, j]`` (``index`` [T, k] int64, a
permutation of ``0..N-1``, e.g. :class:`~fusible_ops.ops.moe_routing.Routing`'s ``inv_perm`` viewed as
[T, k]).

* :func:`gather_sum` -- ``out[t] = sum_j w[t, j] * src[index[t, j]]`` (``w`` None: weights 1).
  :class:`~fusible_ops.ops.moe.Combine`'s forward (``w`` = the router probabilities) and
  :class:`~fusible_ops.ops.moe.Dispatch`'s backward (no weights). One pass: the [T, k, H]
  copy in token order is never written.
* :func:`combine_bwd` -- Combine's backward in one pass over ``dy``:
  ``dsrc[index[t, j]] = w[t, j] * dy[t]`` and ``dprobs[t, j] = <dy[t], src[index[t, j]]>``
  (either can be skipped).
* :func:`rows_scale_dot` -- the probabilities' side of a Combine fused with the GEMM before it
  (:mod:`fusible_ops.fusion_rules.moe_combine`), on expert-ordered rows ``r`` holding copy
  ``c = perm[r]``: ``dprobs.flat[c] = <g[r], a[r]>``, ``dx[r] = p.flat[c] * g[r]`` and
  ``a_scaled[r] = p.flat[c] * a[r]`` (either output can be skipped), one pass; or with the
  activation before the GEMM recomputed from its input (``a = act(h)``) and ``dx`` taken through
  it (the activation's backward in the same pass).
* :func:`gather_rows` -- gathered rows (``x[index]``, any dtype, bytes moved):
  :class:`~fusible_ops.ops.moe.Dispatch`'s forward, the token copies in expert order.
* :func:`scatter_copies` -- the same copies as ``gather_rows(x, perm // k)`` placed from the
  tokens' side (``out[index[t, j]] = x[t]``, ``index`` = ``inv_perm`` as [T, k]): each token row
  is read once, where the gather reads it ``k`` times.
* :func:`gather_rows_t` -- gathered rows, transposed (``x[index].T``, any dtype, bytes moved):
  the column-wise FP8 token copies FC1's FP8 weight gradient reads.

Math in float32 (float64 for float64 inputs, which run the ``*_ref``); the sum over ``j`` runs
in a fixed order (deterministic, no atomics); no host sync; one launch each. ``w`` stays float32
(the router's precision), the outputs take the activations' dtype (``dprobs``: float32).
What must hold (not checked: a check would sync): ``index`` values are in ``[0, N)``; for
:func:`combine_bwd` ``index`` is a permutation (every row of ``dsrc`` is written exactly once).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import HAS_TRITON, interpreter_enabled, use_triton
from .act_table import ACT_IDS, GLU_BASE, act_and_grad_ref, dact_ref
from .launch import TRITON_DTYPES, DirectKernel, as_rows, cdiv, compute_dtype, geometry_cache, kernel_op, next_pow2, \
    remember

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .act_table import act_and_grad, dact

    @triton.jit
    def _gather_sum_kernel(
        src_ptr, idx_ptr, w_ptr, out_ptr,  # src [N, H] (row stride s_src), idx/w [T, K], out [T, H]
        T, H, s_src, s_out,
        K: tl.constexpr, HAS_W: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
    ):
        """Grid (cdiv(T, BT), cdiv(H, BH)): out[t, h-block] = sum_j w[t, j] * src[idx[t, j], h-block]."""
        offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
        offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
        tmask = offs_t < T
        mask = tmask[:, None] & (offs_h < H)[None, :]
        t64 = offs_t.to(tl.int64)
        acc = tl.zeros((BT, BH), dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(idx_ptr + t64 * K + j, mask=tmask, other=0)
            v = tl.load(src_ptr + row.to(tl.int64)[:, None] * s_src + offs_h[None, :], mask=mask, other=0.0)
            if HAS_W:
                w = tl.load(w_ptr + t64 * K + j, mask=tmask, other=0.0)
                acc += v.to(tl.float32) * w[:, None]
            else:
                acc += v.to(tl.float32)
        tl.store(out_ptr + t64[:, None] * s_out + offs_h[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _combine_bwd_kernel(
        dy_ptr, src_ptr, idx_ptr, w_ptr, dsrc_ptr, dp_ptr,  # dy [T, H], src/dsrc [N, H], idx/w/dp [T, K]
        T, H, s_dy, s_src, s_dsrc,
        K: tl.constexpr, KP: tl.constexpr, DSRC: tl.constexpr, DPROBS: tl.constexpr,
        BT: tl.constexpr, BH: tl.constexpr,
    ):
        """Grid (cdiv(T, BT),): each program walks its tokens' rows of dy once (h-blocks), writing
        the k scaled copies and accumulating the k dot products."""
        offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
        tmask = offs_t < T
        t64 = offs_t.to(tl.int64)
        cols = tl.arange(0, KP)
        dp = tl.zeros((BT, KP), dtype=tl.float32)
        for h0 in range(0, H, BH):
            offs_h = h0 + tl.arange(0, BH)
            mask = tmask[:, None] & (offs_h < H)[None, :]
            g = tl.load(dy_ptr + t64[:, None] * s_dy + offs_h[None, :], mask=mask, other=0.0).to(tl.float32)
            for j in tl.static_range(K):
                row = tl.load(idx_ptr + t64 * K + j, mask=tmask, other=0).to(tl.int64)
                if DSRC:
                    w = tl.load(w_ptr + t64 * K + j, mask=tmask, other=0.0)
                    tl.store(dsrc_ptr + row[:, None] * s_dsrc + offs_h[None, :],
                             (g * w[:, None]).to(dsrc_ptr.dtype.element_ty), mask=mask)
                if DPROBS:
                    v = tl.load(src_ptr + row[:, None] * s_src + offs_h[None, :], mask=mask, other=0.0)
                    d = tl.sum(v.to(tl.float32) * g, axis=1)
                    dp = tl.where(cols[None, :] == j, dp + d[:, None], dp)
        if DPROBS:
            tl.store(dp_ptr + t64[:, None] * K + cols[None, :], dp, mask=tmask[:, None] & (cols < K)[None, :])

    @triton.jit
    def _scatter_copies_kernel(x_ptr, idx_ptr, out_ptr, T, H, K, s_x, s_o, BT: tl.constexpr, BH: tl.constexpr):
        """Grid (cdiv(T, BT), cdiv(H, BH)): out[idx[t, j], h-block] = x[t, h-block] for the block's
        tokens and every j < K: each token's row is read once and written K times."""
        offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
        offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
        tmask = offs_t < T
        mask = tmask[:, None] & (offs_h < H)[None, :]
        t64 = offs_t.to(tl.int64)
        v = tl.load(x_ptr + t64[:, None] * s_x + offs_h[None, :], mask=mask)
        for j in range(K):
            rows = tl.load(idx_ptr + t64 * K + j, mask=tmask, other=0).to(tl.int64)
            tl.store(out_ptr + rows[:, None] * s_o + offs_h[None, :], v, mask=mask)

    @triton.jit
    def _gather_rows_t_kernel(x_ptr, idx_ptr, out_ptr, M, K, s_x, s_o, BM: tl.constexpr, BK: tl.constexpr):
        """Grid (cdiv(M, BM), cdiv(K, BK)): out[k-block, m-block] = x[idx[m-block], k-block]^T. The
        tile is loaded as [BK, BM] (contiguous along k) and stored contiguous along m: Triton
        moves it through shared memory between the two layouts."""
        offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
        offs_k = tl.program_id(1) * BK + tl.arange(0, BK)
        mmask = offs_m < M
        mask = (offs_k < K)[:, None] & mmask[None, :]
        rows = tl.load(idx_ptr + offs_m, mask=mmask, other=0).to(tl.int64)
        v = tl.load(x_ptr + rows[None, :] * s_x + offs_k[:, None], mask=mask)
        tl.store(out_ptr + offs_k.to(tl.int64)[:, None] * s_o + offs_m[None, :], v, mask=mask)

    @triton.jit
    def _gather_rows_kernel(x_ptr, idx_ptr, out_ptr, M, K, s_x, s_o, BM: tl.constexpr, BK: tl.constexpr):
        """Grid (cdiv(M, BM), cdiv(K, BK)): out[m-block, k-block] = x[idx[m-block], k-block]."""
        offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
        offs_k = tl.program_id(1) * BK + tl.arange(0, BK)
        mmask = offs_m < M
        mask = mmask[:, None] & (offs_k < K)[None, :]
        rows = tl.load(idx_ptr + offs_m, mask=mmask, other=0).to(tl.int64)
        v = tl.load(x_ptr + rows[:, None] * s_x + offs_k[None, :], mask=mask)
        tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * s_o + offs_k[None, :], v, mask=mask)

    @triton.jit
    def _rows_scale_dot_kernel(
        g_ptr, a_ptr, p_ptr, perm_ptr, dx_ptr, as_ptr, dp_ptr,  # g/as [N, F]; a/dx [N, F] or [N, 2F]; p/dp [N] (flat [T, k])
        N, F, s_g, s_a, s_dx, s_as,
        DX: tl.constexpr, AS: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr,
        BT: tl.constexpr, BH: tl.constexpr, SOFT_BF16: tl.constexpr = False,
    ):
        """Grid (cdiv(N, BT),): each program walks its rows once (column blocks): the values v (a,
        or act(a) recomputed, rounded as the forward stored them), their dot with g, the scaled
        gradient (through the activation when ACT >= 0) and p * v."""
        offs_r = tl.program_id(0) * BT + tl.arange(0, BT)
        rmask = offs_r < N
        r64 = offs_r.to(tl.int64)
        c = tl.load(perm_ptr + r64, mask=rmask, other=0).to(tl.int64)
        p = tl.load(p_ptr + c, mask=rmask, other=0.0).to(tl.float32)[:, None]
        acc = tl.zeros((BT,), dtype=tl.float32)
        for f0 in range(0, F, BH):
            offs_f = f0 + tl.arange(0, BH)
            mask = rmask[:, None] & (offs_f < F)[None, :]
            g = tl.load(g_ptr + r64[:, None] * s_g + offs_f[None, :], mask=mask, other=0.0).to(tl.float32)
            a_ptrs = a_ptr + r64[:, None] * s_a + offs_f[None, :]
            z = tl.load(a_ptrs, mask=mask, other=0.0).to(tl.float32)
            if ACT >= 0:
                act, dz = act_and_grad(z, ACT)
                if GATED:
                    b = tl.load(a_ptrs + F, mask=mask, other=0.0).to(tl.float32)
                    v = act * b
                else:
                    v = act
                if SOFT_BF16:  # (Triton's interpreter truncates fp32 -> bf16: round to nearest even here)
                    bits = v.to(tl.uint32, bitcast=True)
                    v = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
                else:
                    v = v.to(a_ptr.dtype.element_ty).to(tl.float32)  # (the forward's stored output)
            else:
                v = z
            acc += tl.sum(tl.where(mask, g * v, 0.0), axis=1)
            if DX:
                gs = g * p
                dx_ptrs = dx_ptr + r64[:, None] * s_dx + offs_f[None, :]
                if ACT < 0:
                    tl.store(dx_ptrs, gs.to(dx_ptr.dtype.element_ty), mask=mask)
                elif GATED:
                    tl.store(dx_ptrs, dact(gs * b, z, dz, ACT).to(dx_ptr.dtype.element_ty), mask=mask)
                    tl.store(dx_ptrs + F, (gs * act).to(dx_ptr.dtype.element_ty), mask=mask)
                else:
                    tl.store(dx_ptrs, dact(gs, z, dz, ACT).to(dx_ptr.dtype.element_ty), mask=mask)
            if AS:
                tl.store(as_ptr + r64[:, None] * s_as + offs_f[None, :], (v * p).to(as_ptr.dtype.element_ty), mask=mask)
        tl.store(dp_ptr + c, acc, mask=rmask)

    _GATHER_SUM = DirectKernel(_gather_sum_kernel)
    _GATHER_ROWS = DirectKernel(_gather_rows_kernel)
    _COMBINE_BWD = DirectKernel(_combine_bwd_kernel)
    _GATHER_ROWS_T = DirectKernel(_gather_rows_t_kernel)
    _SCATTER_COPIES = DirectKernel(_scatter_copies_kernel)
    _ROWS_SCALE_DOT = DirectKernel(_rows_scale_dot_kernel)

GATHER_TILE = 4096  # elements per gather-sum program (tests shrink the tiles to get many programs)
BWD_TILE = 2048
MAX_BH = 256
_GEOMETRY = geometry_cache()


def _geometry(kind: str, t: int, h: int, on_cpu: bool) -> tuple:
    """(BT, BH, num_warps) per (kind, T, H): ``BH`` columns of ``BT`` tokens per step."""
    key = (kind, t, h, on_cpu)
    g = _GEOMETRY.get(key)
    if g is None:
        cap = 16 if on_cpu else MAX_BH
        bh = max(16, min(next_pow2(h), cap))
        bt = max(1, min(next_pow2(max(t, 1)), (GATHER_TILE if kind == "fwd" else BWD_TILE) // bh))
        g = remember(_GEOMETRY, key, (bt, bh, 8 if bt * bh >= 4096 else 4))
    return g


def _check(index: torch.Tensor, n_rows: int, *others) -> tuple[int, int]:
    if index.dim() != 2 or index.dtype != torch.int64:
        raise ValueError(f"index must be [T, k] int64, got {list(index.shape)} {index.dtype}")
    t, k = index.shape
    if t * k != n_rows:
        raise ValueError(f"index [T, k] = {list(index.shape)} does not match the {n_rows} copies")
    for o in others:
        if o is not None and o.shape != index.shape:
            raise ValueError(f"weights/probabilities must have index's shape {list(index.shape)}, got {list(o.shape)}")
    return t, k


@kernel_op("fusible_ops::moe_gather_sum", mutates_args=())
def _gather_sum_op(src: torch.Tensor, index: torch.Tensor, weight: Optional[torch.Tensor]) -> torch.Tensor:
    t, k = index.shape
    h = src.shape[1]
    out = torch.empty((t, h), dtype=src.dtype, device=src.device)
    if t == 0 or h == 0:
        return out
    bt, bh, warps = _geometry("fwd", t, h, not src.is_cuda)
    idx, w = index.contiguous(), None if weight is None else weight.contiguous()
    args = (src, idx, idx if w is None else w, out, t, h, src.stride(0), out.stride(0))
    meta = dict(K=k, HAS_W=w is not None, BT=bt, BH=bh, num_warps=warps)
    key = (src.device, src.dtype, args[2].dtype, t, h, src.stride(0), *meta.values())
    _GATHER_SUM((cdiv(t, bt), cdiv(h, bh)), key, args, meta)
    return out


@_gather_sum_op.register_fake
def _(src, index, weight):
    return src.new_empty((index.shape[0], src.shape[1]))


@kernel_op("fusible_ops::moe_combine_bwd", mutates_args=())
def _combine_bwd_op(dy: torch.Tensor, src: Optional[torch.Tensor], index: torch.Tensor,
                    weight: Optional[torch.Tensor], n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    t, k = index.shape
    h = dy.shape[1]
    dsrc = torch.empty((n_rows if weight is not None else 0, h), dtype=dy.dtype, device=dy.device)
    dp = torch.empty((t, k) if src is not None else (0, k), dtype=torch.float32, device=dy.device)
    if t == 0 or h == 0 or (weight is None and src is None):
        return dsrc, dp.zero_()  # (dprobs of zero features: exact zeros)
    bt, bh, warps = _geometry("bwd", t, h, not dy.is_cuda)
    idx = index.contiguous()
    # placeholders for what a flag leaves unread: real (non-empty) tensors, never a null pointer
    w = idx if weight is None else weight.contiguous()
    s = dy if src is None else src
    ds = dy if weight is None else dsrc
    args = (dy, s, idx, w, ds, dp if src is not None else w, t, h, dy.stride(0), s.stride(0), ds.stride(0))
    meta = dict(K=k, KP=max(2, next_pow2(k)), DSRC=weight is not None, DPROBS=src is not None, BT=bt, BH=bh,
                num_warps=warps)
    key = (dy.device, dy.dtype, s.dtype, w.dtype, t, h, dy.stride(0), s.stride(0), ds.stride(0), *meta.values())
    _COMBINE_BWD((cdiv(t, bt),), key, args, meta)
    return dsrc, dp


@_combine_bwd_op.register_fake
def _(dy, src, index, weight, n_rows):
    t, k = index.shape
    return (dy.new_empty((n_rows if weight is not None else 0, dy.shape[1])),
            dy.new_empty((t, k) if src is not None else (0, k), dtype=torch.float32))


@kernel_op("fusible_ops::moe_rows_scale_dot", mutates_args=())
def _rows_scale_dot_op(g: torch.Tensor, a: torch.Tensor, probs: torch.Tensor, perm: torch.Tensor, dx: bool,
                       scaled_a: bool, act: Optional[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, f = g.shape
    out_dx = g.new_empty((n if dx else 0, a.shape[1]))
    out_as = a.new_empty((n if scaled_a else 0, f))
    dp = torch.empty(probs.shape, dtype=torch.float32, device=g.device)
    if n == 0 or f == 0:
        return out_dx, out_as, dp.zero_()  # (dot products of zero features: exact zeros)
    bt, bh, warps = _geometry("bwd", n, f, not g.is_cuda)
    p = probs.contiguous()
    pm = perm.contiguous()
    ddx = out_dx if dx else g  # placeholders for what a flag leaves unwritten: real tensors
    das = out_as if scaled_a else g
    args = (g, a, p, pm, ddx, das, dp, n, f, g.stride(0), a.stride(0), ddx.stride(0), das.stride(0))
    base = GLU_BASE.get(act, act)
    meta = dict(DX=dx, AS=scaled_a, ACT=-1 if act is None else ACT_IDS[base], GATED=act in GLU_BASE, BT=bt, BH=bh,
                SOFT_BF16=a.dtype == torch.bfloat16 and interpreter_enabled(), num_warps=warps)
    key = (g.device, g.dtype, a.dtype, p.dtype, n, f, *args[-4:], *meta.values())
    _ROWS_SCALE_DOT((cdiv(n, bt),), key, args, meta)
    return out_dx, out_as, dp


@_rows_scale_dot_op.register_fake
def _(g, a, probs, perm, dx, scaled_a, act):
    n, f = g.shape
    return (g.new_empty((n if dx else 0, a.shape[1])), a.new_empty((n if scaled_a else 0, f)),
            g.new_empty(probs.shape, dtype=torch.float32))


ROWS_TILE = 8192  # bytes per row-gather program


def _rows_geometry(m: int, k: int, itemsize: int, on_cpu: bool) -> tuple:
    """(BM, BK): BK the widest power of 2 up to 1024 elements dividing the row (no masked column
    lanes), BM rows to fill ``ROWS_TILE`` bytes."""
    key = ("rows", m, k, itemsize, on_cpu, ROWS_TILE)
    g = _GEOMETRY.get(key)
    if g is None:
        bk = min(16 if on_cpu else 1024, next_pow2(k))
        while bk > 16 and k % bk:
            bk //= 2
        bm = max(1, min(ROWS_TILE // (bk * itemsize), next_pow2(max(m, 1))))
        g = remember(_GEOMETRY, key, (bm, bk))
    return g


def _launch_rows(x: torch.Tensor, index: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``x[index]`` ([M, K]) or its transpose ([K, M]), one launch."""
    m, k = index.shape[0], x.shape[1]
    out = torch.empty((k, m) if transposed else (m, k), dtype=x.dtype, device=x.device)
    if m == 0 or k == 0:
        return out
    if transposed:
        bm = bk = 16 if not x.is_cuda else 64
        kernel = _GATHER_ROWS_T
    else:
        bm, bk = _rows_geometry(m, k, x.element_size(), not x.is_cuda)
        kernel = _GATHER_ROWS
    args = (x, index, out, m, k, x.stride(0), out.stride(0))
    kernel((cdiv(m, bm), cdiv(k, bk)), (x.device, x.dtype, m, k, x.stride(0), bm, bk), args,
           dict(BM=bm, BK=bk, num_warps=4))
    return out


@kernel_op("fusible_ops::moe_gather_rows", mutates_args=())
def _gather_rows_op(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return _launch_rows(x, index, False)


@_gather_rows_op.register_fake
def _(x, index):
    return x.new_empty((index.shape[0], x.shape[1]))


@kernel_op("fusible_ops::moe_gather_rows_t", mutates_args=())
def _gather_rows_t_op(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return _launch_rows(x, index, True)


@_gather_rows_t_op.register_fake
def _(x, index):
    return x.new_empty((x.shape[1], index.shape[0]))


@kernel_op("fusible_ops::moe_scatter_copies", mutates_args=())
def _scatter_copies_op(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    (t, k), h = index.shape, x.shape[1]
    out = torch.empty((t * k, h), dtype=x.dtype, device=x.device)
    if out.numel():
        bt, bh = _rows_geometry(t, h, x.element_size(), not x.is_cuda)
        _SCATTER_COPIES((cdiv(t, bt), cdiv(h, bh)), (x.device, x.dtype, t, h, k, x.stride(0), bt, bh),
                        (x, index, out, t, h, k, x.stride(0), out.stride(0)), dict(BT=bt, BH=bh, num_warps=4))
    return out


@_scatter_copies_op.register_fake
def _(x, index):
    return x.new_empty((index.numel(), x.shape[1]))


# ----------------------------------------------------------------------------- public API
def gather_sum(src: torch.Tensor, index: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out[t] = sum_j weight[t, j] * src[index[t, j]]`` ([T, H] in src's dtype; module doc).

    src [N, H] with ``N = T * k``, index [T, k] int64 (values in [0, N)), weight [T, k] (float32,
    the router's probabilities) or None for a plain sum of the k copies.
    """
    src = as_rows(src)
    _check(index, src.shape[0], weight)
    if use_triton(src, index, weight) and src.dtype in TRITON_DTYPES:
        return _gather_sum_op(src, index, weight)
    return gather_sum_ref(src, index, weight)


def combine_bwd(dy: torch.Tensor, src: Optional[torch.Tensor], index: torch.Tensor,
                weight: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Combine's backward (module doc): ``(dsrc [N, H] in dy's dtype, dprobs [T, k] float32)``.

    dy [T, H]; src [N, H] (Combine's input; None: no ``dprobs``); index [T, k] int64, a
    permutation of the N = T * k rows; weight [T, k] (None: no ``dsrc``).
    """
    dy = as_rows(dy)
    t, k = _check(index, dy.shape[0] * index.shape[1], weight)
    if src is not None:
        src = as_rows(src)
        if src.shape != (t * k, dy.shape[1]):
            raise ValueError(f"src must be [{t * k}, {dy.shape[1]}], got {list(src.shape)}")
    if use_triton(dy, src, index, weight) and dy.dtype in TRITON_DTYPES:
        dsrc, dp = _combine_bwd_op(dy, src, index, weight, t * k)
        return (dsrc if weight is not None else None), (dp if src is not None else None)
    return combine_bwd_ref(dy, src, index, weight)


def rows_scale_dot(g: torch.Tensor, a: torch.Tensor, probs: torch.Tensor, perm: torch.Tensor, *, dx: bool = True,
                   scaled_a: bool = True, act: Optional[str] = None
                   ) -> tuple[Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor]]:
    """``(dx in g's dtype, dprobs [T, k] float32, a_scaled [N, F] in a's dtype)`` (module doc).

    g [N, F] expert-ordered rows (N = T * k): the gradient reaching the values ``v``; probs [T, k]
    (float32, the router's probabilities); perm [N] int64 (row r holds copy ``perm[r] = t * k + j``,
    a permutation: every ``dprobs`` entry is written once). ``act`` None: ``a`` [N, F] are the
    values, ``dx = p * g``. ``act`` an activation kind (:data:`~.act_table.ACT_IDS` or a gated kind
    of :data:`~.act_table.GLU_BASE`): ``a`` is the activation's input ([N, F], gated [N, 2F]),
    ``v = act(a)`` rounded to a's dtype (as the forward stored it), ``dx`` the gradient of ``a``
    for the upstream gradient ``p * g`` (a's shape). ``dx`` / ``scaled_a`` False: that output is
    skipped (None).
    """
    g, a = as_rows(g), as_rows(a)
    if act is not None and act not in ACT_IDS and act not in GLU_BASE:
        raise ValueError(f"rows_scale_dot: unknown activation {act!r}")
    width = 2 * g.shape[1] if act in GLU_BASE else g.shape[1]
    if a.shape != (g.shape[0], width):
        raise ValueError(f"rows_scale_dot: a must be [{g.shape[0]}, {width}] for g {list(g.shape)} and act={act!r}, "
                         f"got {list(a.shape)}")
    if perm.dim() != 1 or perm.dtype != torch.int64 or perm.shape[0] != g.shape[0] or probs.numel() != g.shape[0]:
        raise ValueError(f"rows_scale_dot: perm must be [{g.shape[0]}] int64 and probs hold {g.shape[0]} values, got "
                         f"{list(perm.shape)} {perm.dtype} and {list(probs.shape)}")
    if use_triton(g, a, probs, perm) and g.dtype in TRITON_DTYPES and a.dtype in TRITON_DTYPES:
        out_dx, out_as, dp = _rows_scale_dot_op(g, a, probs, perm, dx, scaled_a, act)
        return (out_dx if dx else None), dp, (out_as if scaled_a else None)
    return rows_scale_dot_ref(g, a, probs, perm, dx=dx, scaled_a=scaled_a, act=act)


def _rows_call(x: torch.Tensor, index: torch.Tensor, op, ref, index_dims: int = 1) -> torch.Tensor:
    """Run a row-moving op on ``x``'s bytes (values are never converted: FP8 stays bit-exact)."""
    x = as_rows(x)
    if index.dim() != index_dims or index.dtype != torch.int64:
        raise ValueError(f"index must be {index_dims}-D int64, got {list(index.shape)} {index.dtype}")
    if index_dims == 2 and index.shape[0] != x.shape[0]:
        raise ValueError(f"index [T, k] = {list(index.shape)} must have a row per row of x ({x.shape[0]})")
    if use_triton(x, index) and x.element_size() in (1, 2, 4):
        view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()]
        return op(x.view(view), index.contiguous()).view(x.dtype)
    return ref(x, index)


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x.index_select(0, index)`` ([M, K], x's dtype) in one pass at copy bandwidth: a MoE
    layer's token copies in expert order. Any dtype (bytes are moved, never converted); x [N, K],
    index [M] int64 with values in [0, N) (not checked: a check would sync)."""
    return _rows_call(x, index, _gather_rows_op, gather_rows_ref)


def scatter_copies(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``out[index[t, j]] = x[t]`` ([T * k, H], x's dtype): ``k`` copies of each row of x [T, H]
    placed by ``index`` [T, k] int64, one pass that reads each row of x once. With a MoE layer's
    ``inv_perm`` viewed as [T, k] it is ``gather_rows(x, perm // k)`` (the token copies in expert
    order), which reads each token ``k`` times. Any dtype (bytes are moved). ``index`` must be a
    permutation of ``0 .. T * k - 1`` (not checked: a check would sync; rows it misses are left
    unwritten)."""
    return _rows_call(x, index, _scatter_copies_op, scatter_copies_ref, index_dims=2)


def gather_rows_t(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x.index_select(0, index).t().contiguous()`` in one pass ([K, M], x's dtype): the column-wise
    layout of gathered rows, e.g. a MoE layer's FP8 token copies for an FP8 weight gradient (which
    needs both operands contiguous along the rows), with no gathered copy in between. Any dtype
    (bytes are moved, never converted: FP8 data stay bit-exact); x [N, K], index [M] int64 with
    values in [0, N) (not checked)."""
    return _rows_call(x, index, _gather_rows_t_op, gather_rows_t_ref)


# ----------------------------------------------------------------------------- references
def gather_rows_ref(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Pure-torch twin of :func:`gather_rows`."""
    return x.index_select(0, index)


def scatter_copies_ref(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Pure-torch twin of :func:`scatter_copies` (1-byte dtypes as bytes: torch has no FP8 index_copy_)."""
    t, k = index.shape
    v = x.view(torch.uint8) if x.element_size() == 1 else x
    return v.new_empty((t * k, x.shape[1])).index_copy_(0, index.reshape(-1), v.repeat_interleave(k, 0)).view(x.dtype)


def gather_rows_t_ref(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Pure-torch twin of :func:`gather_rows_t`."""
    return x.index_select(0, index).t().contiguous()


def gather_sum_ref(src: torch.Tensor, index: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Pure-torch twin of :func:`gather_sum` (the [T, k, H] copy is materialized)."""
    t, k = index.shape
    acc = compute_dtype(src.dtype)
    rows = src.index_select(0, index.reshape(-1)).view(t, k, src.shape[1]).to(acc)
    if weight is not None:
        rows = rows * weight.to(acc).unsqueeze(-1)
    return rows.sum(1).to(src.dtype)


def combine_bwd_ref(dy: torch.Tensor, src: Optional[torch.Tensor], index: torch.Tensor,
                    weight: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Pure-torch twin of :func:`combine_bwd`."""
    t, k = index.shape
    acc = compute_dtype(dy.dtype)
    h = dy.shape[1]
    g = dy.to(acc).unsqueeze(1)  # [T, 1, H]
    dsrc = dprobs = None
    if weight is not None:
        copies = (weight.to(acc).unsqueeze(-1) * g).reshape(t * k, h).to(dy.dtype)
        dsrc = torch.empty_like(copies).index_copy_(0, index.reshape(-1), copies)
    if src is not None:
        rows = src.index_select(0, index.reshape(-1)).view(t, k, h).to(acc)
        dprobs = (rows * g).sum(-1).to(torch.float32 if acc == torch.float32 else acc)
    return dsrc, dprobs


def rows_scale_dot_ref(g: torch.Tensor, a: torch.Tensor, probs: torch.Tensor, perm: torch.Tensor, *, dx: bool = True,
                       scaled_a: bool = True, act: Optional[str] = None):
    """Pure-torch twin of :func:`rows_scale_dot`."""
    acc = compute_dtype(g.dtype)
    p = probs.reshape(-1).index_select(0, perm).to(acc).unsqueeze(-1)  # each row's probability
    gf, z = g.to(acc), a.to(acc)
    base = GLU_BASE.get(act, act)
    if act is None:
        v = z
    else:
        f = g.shape[1]
        za, zb = (z[:, :f], z[:, f:]) if act in GLU_BASE else (z, None)
        act_a, dz = act_and_grad_ref(za, base)
        v = (act_a if zb is None else act_a * zb).to(a.dtype).to(acc)  # (the forward's stored output)
    dp = torch.empty(probs.numel(), dtype=torch.float32 if acc == torch.float32 else acc, device=g.device)
    dp.index_copy_(0, perm, (gf * v).sum(-1).to(dp.dtype))
    out_dx = None
    if dx:
        gs = gf * p
        if act is None:
            out_dx = gs
        elif zb is None:
            out_dx = dact_ref(gs, za, dz, base)
        else:
            out_dx = torch.cat([dact_ref(gs * zb, za, dz, base), gs * act_a], dim=1)
        out_dx = out_dx.to(g.dtype)
    return out_dx, dp.view(probs.shape), ((v * p).to(a.dtype) if scaled_a else None)


__all__ = ["combine_bwd", "combine_bwd_ref", "rows_scale_dot", "rows_scale_dot_ref", "gather_rows", "gather_rows_ref", "gather_rows_t", "gather_rows_t_ref", "gather_sum", "gather_sum_ref"]
