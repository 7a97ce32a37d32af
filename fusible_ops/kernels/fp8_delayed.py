"""Delayed-scaling state updates of many tensors in one launch: :func:`delayed_update_many`.

The state of ``n`` owners lives in one buffer pair (:mod:`fusible_ops.quantization.delayed`):
``hist`` fp32 [n, L + 2, 3] (rows ``0..L-1``: each owner's amax history, newest first, columns
input, weight, grad_output; row ``L``: the entry the last update dropped; row ``L + 1``: the
scale before the last update) and ``scale`` fp32 [n, 3]. One update of role column ``r`` for the
owners listed in ``idx`` does, per owner, what :func:`~fusible_ops.kernels.fp8_cast.delayed_update`
does for one: the scale from the history's max (``max_algo``) or newest entry (kept where that
is 0), then the column rolled down by one with a new newest entry 0 (the cast that follows
raises it to its tensor's amax). Rows ``L`` and ``L + 1`` keep what the update overwrote, so
:func:`delayed_undo_ref` can take an update back for an owner whose cast did not run.

The Triton kernel and the ``*_ref`` twin agree bit for bit (both compute the scale with one
correctly rounded fp32 division, as the casts do). While ``torch.compile`` traces, the ref runs.
"""

from __future__ import annotations

import torch

from . import HAS_TRITON, use_triton
from .fp8_cast import scale_from_amax_ref
from .launch import DirectKernel, generic_key

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .fp8_cast import _scale_of

    @triton.jit
    def _delayed_update_many_kernel(HIST, SCALE, IDX, L, r, FMAX: tl.constexpr, MAX_ALGO: tl.constexpr,
                                    BLOCK_L: tl.constexpr):
        # Program k: owner e = IDX[k]; its column r of HIST [n, L + 2, 3] and SCALE[e, r].
        e = tl.load(IDX + tl.program_id(0)).to(tl.int64)
        h = HIST + e * (L + 2) * 3 + r
        s = SCALE + e * 3 + r
        i = tl.arange(0, BLOCK_L)
        live = i < L
        col = tl.load(h + i * 3, mask=live, other=0.0)
        amax = tl.max(col, 0) if MAX_ALGO else tl.load(h)
        old = tl.load(s)
        tl.store(h + L * 3, tl.load(h + (L - 1) * 3))  # (what the roll drops, and the old scale: for an undo)
        tl.store(h + (L + 1) * 3, old)
        tl.store(s, tl.where(amax > 0.0, _scale_of(amax, FMAX, False), old))
        tl.debug_barrier()  # every entry read before any is overwritten
        tl.store(h + (i + 1) * 3, col, mask=(i + 1) < L)
        tl.store(h, 0.0)


_UPDATE_MANY = DirectKernel(_delayed_update_many_kernel) if HAS_TRITON else None


class UpdateMany:
    """:func:`delayed_update_many` with its arguments fixed: made once, then each call is one
    launch with no per-call Python beyond the dispatch check (the fuser's batched updates)."""

    __slots__ = ("hist", "scale", "idx", "r", "fmax", "max_algo", "grid", "key", "args", "meta")

    def __init__(self, hist: torch.Tensor, scale: torch.Tensor, idx: torch.Tensor, r: int, fmax: float,
                 max_algo: bool) -> None:
        self.hist, self.scale, self.idx, self.r, self.fmax, self.max_algo = hist, scale, idx, r, fmax, max_algo
        L = hist.shape[1] - 2
        self.grid = (idx.shape[0],)
        self.args = (hist, scale, idx, L, r)
        self.meta = dict(FMAX=float(fmax), MAX_ALGO=bool(max_algo), BLOCK_L=max(16, 1 << (L - 1).bit_length()),
                         num_warps=4)
        self.key = generic_key(self.args, self.meta)

    def __call__(self) -> None:
        if not self.grid[0]:
            return
        if HAS_TRITON and use_triton(self.hist) and not torch.compiler.is_compiling():
            _UPDATE_MANY(self.grid, self.key, self.args, self.meta)
        else:
            delayed_update_many_ref(self.hist, self.scale, self.idx, self.r, self.fmax, self.max_algo)


def delayed_update_many(hist: torch.Tensor, scale: torch.Tensor, idx: torch.Tensor, r: int, fmax: float,
                        max_algo: bool) -> None:
    """One delayed-scaling update of role column ``r`` for every owner in ``idx`` (int32 [m], on
    the state's device, no repeats), in one launch, in place, no host sync. ``hist`` [n, L + 2, 3]
    and ``scale`` [n, 3] fp32, contiguous (layout in the module doc); ``fmax``: the role's FP8
    maximum divided by ``2**margin``."""
    UpdateMany(hist, scale, idx, r, fmax, max_algo)()


def delayed_update_many_ref(hist, scale, idx, r, fmax, max_algo) -> None:
    """Pure-torch twin of :func:`delayed_update_many` (a constant number of ops, whatever ``idx``'s length)."""
    L = hist.shape[1] - 2
    idx = idx.long()
    col = hist[:, :, r]  # [n, L + 2] (a view)
    cols = col.index_select(0, idx)  # [m, L + 2]
    old = scale[:, r].index_select(0, idx)
    a = cols[:, :L].amax(1) if max_algo else cols[:, 0]
    new = torch.where(a > 0, scale_from_amax_ref(a, fmax), old)
    rolled = torch.cat([torch.zeros_like(cols[:, :1]), cols[:, : L - 1], cols[:, L - 1 : L], old[:, None]], 1)
    col.index_copy_(0, idx, rolled)
    scale[:, r].index_copy_(0, idx, new)


def delayed_undo_ref(hist: torch.Tensor, scale: torch.Tensor, e: int, r: int) -> None:
    """Take back the last :func:`delayed_update_many` of owner ``e``'s column ``r`` (its cast did not
    run): the column rolled back up with the dropped entry restored, the old scale restored. Plain
    torch ops (a rare path: an exception inside a call, or a call that cast fewer tensors than
    the plan's earlier calls)."""
    L = hist.shape[1] - 2
    col = hist[e, :, r]
    col[:L].copy_(torch.cat([col[1:L], col[L : L + 1]]))
    scale[e, r : r + 1].copy_(col[L + 1 : L + 2])


__all__ = ["UpdateMany", "delayed_undo_ref", "delayed_update_many", "delayed_update_many_ref"]
