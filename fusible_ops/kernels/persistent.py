"""Persistent grouped-GEMM machinery, shared by the grouped GEMMs (:mod:`.grouped_gemm`) and the
GLU-epilogue grouped GEMMs (:mod:`.grouped_glu`).

Grouping contract: rows of a [M, K] operand are split into G consecutive groups by
``split_sizes`` (1-D int64, length G, on the operand's device); group g covers rows
[off_g, off_g + m_g), off = exclusive cumsum. Empty groups and M == 0 are valid. The kernels
clamp groups to M (never read or write out of bounds); rows past the sum stay unwritten.

No host sync: every program loads the split sizes and builds the group table itself
(:func:`group_table`); the launch grid depends only on M, N, K, G and the SM count
(:func:`persistent_grid`), so a launch can be captured in a CUDA graph and replayed with other
split sizes of the same total. A persistent program walks the global tile space of all groups
(:func:`tile_space`, :func:`tile_coords`): per group cdiv(m_g, BM) * cdiv(N, BN) tiles, with a
GROUP_M swizzle inside a group. :func:`mainloop` accumulates one [BM, BN] tile, through TMA
tensor descriptors on Hopper (:func:`tma_ok`) or masked pointer loads.
"""

from __future__ import annotations

import os
import threading

import torch

from . import interpreter_enabled
from .launch import SM_RESERVE, DirectKernel, cdiv, next_pow2, num_sms

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    HAS_TRITON = False

INTERP_MN = {"BM": 16, "BN": 16, "BK": 16, "GROUP_M": 2}
"""Meta-parameters of the tile-space kernels under Triton's interpreter (tiny: loops really loop)."""
INTERP_WG = {"BN": 16, "BK": 16, "BR": 16, "GROUP_N": 2, "PPS": 1}
"""Meta-parameters of the weight-gradient kernels under the interpreter (persistent: the tile loop
really loops)."""
INTERP_PROGS = 3
"""Persistent programs under the interpreter."""

if HAS_TRITON:

    @triton.jit
    def group_table(split_ptr, G, M, G_P2: tl.constexpr):
        """Per-group (index, row start, rows) as [G_P2] int32 vectors, clamped to [0, M]."""
        gi = tl.arange(0, G_P2)
        m = tl.load(split_ptr + gi, mask=gi < G, other=0).to(tl.int32)
        m = tl.maximum(m, 0)
        end_raw = tl.cumsum(m, 0)
        start = tl.minimum(end_raw - m, M)
        end = tl.minimum(end_raw, M)
        return gi, start, end - start

    @triton.jit
    def pick(vec, sel):
        """The element of int vector ``vec`` where boolean vector ``sel`` is true (one place)."""
        return tl.sum(tl.where(sel, vec, 0), 0)

    @triton.jit
    def group_rows(split_ptr, g, G, M, G_P2: tl.constexpr):
        """(row start, rows) of group ``g``."""
        gi, start, m = group_table(split_ptr, G, M, G_P2)
        sel = gi == g
        return pick(start, sel), pick(m, sel)

    @triton.jit
    def tile_space(split_ptr, G, M, NOUT, G_P2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        """The global tile space of all groups: (gi, start, m, tiles, tile_end, total, TILES_N)."""
        TILES_N = tl.cdiv(NOUT, BN)
        gi, start, m = group_table(split_ptr, G, M, G_P2)
        tiles = tl.cdiv(m, BM) * TILES_N
        tile_end = tl.cumsum(tiles, 0)
        total = tl.sum(tiles, 0)
        return gi, start, m, tiles, tile_end, total, TILES_N

    @triton.jit
    def locate_tile(t, gi, start, m, tile_end, tiles, TILES_N, BM: tl.constexpr, GROUP_M: tl.constexpr):
        """Global tile index t -> (group, group row start, group rows, m-tile, n-tile)."""
        g = tl.sum((tile_end <= t).to(tl.int32), 0)
        sel = gi == g
        r0 = pick(start, sel)
        mg = pick(m, sel)
        local = t - pick(tile_end - tiles, sel)
        # GROUP_M swizzle inside the group: GROUP_M m-tiles share the weight tiles in L2.
        num_m = tl.cdiv(mg, BM)
        width = GROUP_M * TILES_N
        first_m = (local // width) * GROUP_M
        gsz = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (local % width) % gsz
        pid_n = (local % width) // gsz
        return g, r0, mg, pid_m, pid_n

    @triton.jit
    def tile_coords(t, gi, start, m, tile_end, tiles, TILES_N, NOUT,
                    BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
        """Tile t -> (group, first row of the tile, rows [BM] int32, row mask, n0, columns [BN],
        column mask)."""
        g, r0, mg, pid_m, pid_n = locate_tile(t, gi, start, m, tile_end, tiles, TILES_N, BM, GROUP_M)
        local_m = pid_m * BM + tl.arange(0, BM)
        n0 = pid_n * BN
        offs_n = n0 + tl.arange(0, BN)
        return g, r0 + pid_m * BM, r0 + local_m, local_m < mg, n0, offs_n, offs_n < NOUT

    @triton.jit
    def split_cols(acc, BM: tl.constexpr, BN: tl.constexpr):
        """[BM, BN] -> ([BM, BN/2] columns [0, BN/2), [BM, BN/2] columns [BN/2, BN))."""
        return tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))

    @triton.jit
    def operand_descs(a_ptr, b_ptr, M, KIN, NOUT, G, s_am, s_bg, s_bk, s_bn, B_KMAJOR: tl.constexpr,
                      USE_TMA: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """(A, B) as :func:`mainloop` reads them: TMA descriptors of A [M, KIN] and of B
        [G, NOUT, KIN] (``B_KMAJOR``) or [G, KIN, NOUT], or the plain pointers."""
        if USE_TMA:
            a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, KIN], strides=[s_am, 1], block_shape=[BM, BK])
            if B_KMAJOR:
                b_desc = tl.make_tensor_descriptor(b_ptr, shape=[G, NOUT, KIN], strides=[s_bg, s_bn, 1],
                                                   block_shape=[1, BN, BK])
            else:
                b_desc = tl.make_tensor_descriptor(b_ptr, shape=[G, KIN, NOUT], strides=[s_bg, s_bk, 1],
                                                   block_shape=[1, BK, BN])
        else:
            a_desc = a_ptr
            b_desc = b_ptr
        return a_desc, b_desc

    @triton.jit
    def mainloop(acc, a_ptr, a_desc, b_ptr, b_desc, g, row0, rows, rmask, n0, offs_n, nmask,
                 KIN, s_am, s_ak, s_bg, s_bk, s_bn,
                 B_KMAJOR: tl.constexpr, USE_TMA: tl.constexpr, PREC: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr):
        """acc[BM, BN] += A[rows, :KIN] @ B_g[:KIN, n0:n0+BN] (fp32 accumulate)."""
        if USE_TMA:
            for k0 in range(0, KIN, BK):
                a = a_desc.load([row0, k0])
                if B_KMAJOR:
                    b = tl.trans(tl.reshape(b_desc.load([g, n0, k0]), (BN, BK)))
                else:
                    b = tl.reshape(b_desc.load([g, k0, n0]), (BK, BN))
                acc = tl.dot(a, b, acc, input_precision=PREC)
        else:
            a_row = a_ptr + rows.to(tl.int64)[:, None] * s_am
            b_base = b_ptr + g.to(tl.int64) * s_bg + offs_n.to(tl.int64)[None, :] * s_bn
            for k0 in range(0, KIN, BK):
                offs_k = k0 + tl.arange(0, BK)
                kmask = offs_k < KIN
                a = tl.load(a_row + offs_k.to(tl.int64)[None, :] * s_ak, mask=rmask[:, None] & kmask[None, :], other=0.0)
                b = tl.load(b_base + offs_k.to(tl.int64)[:, None] * s_bk, mask=kmask[:, None] & nmask[None, :],
                            other=0.0)
                acc = tl.dot(a, b, acc, input_precision=PREC)
        return acc

    @triton.jit
    def wgrad_tile(pid, gi, start, m, N, K, BN: tl.constexpr, BK: tl.constexpr, GROUP_N: tl.constexpr):
        """(g, row start, rows, n0, k0, offs_n [BN], offs_k [BK], nmask, kmask) of weight-gradient
        tile ``pid`` of G * cdiv(N, BN) * cdiv(K, BK), group-major, with a GROUP_N swizzle of the n
        tiles inside a group; the group's rows from its table (``gi, start, m``: :func:`group_table`
        or a layout's own, read once per program)."""
        tiles_n = tl.cdiv(N, BN)
        tiles_k = tl.cdiv(K, BK)
        per_g = tiles_n * tiles_k
        g = pid // per_g
        local = pid % per_g
        width = GROUP_N * tiles_k
        first_n = (local // width) * GROUP_N
        gsz = tl.minimum(tiles_n - first_n, GROUP_N)
        pid_n = first_n + (local % width) % gsz
        pid_k = (local % width) // gsz
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_k = pid_k * BK + tl.arange(0, BK)
        sel = gi == g
        return g, pick(start, sel), pick(m, sel), pid_n * BN, pid_k * BK, offs_n, offs_k, offs_n < N, offs_k < K

    @triton.jit
    def wgrad_schedule(N, K, G, BN: tl.constexpr, BK: tl.constexpr, PPS: tl.constexpr):
        """(first tile, tile count, stride) of this weight-gradient program: G * cdiv(N, BN) *
        cdiv(K, BK) tiles; ``PPS`` 0: one tile per program, else persistent (the grid is
        :func:`wgrad_grid`'s, each program strides over the tiles)."""
        total = G * tl.cdiv(N, BN) * tl.cdiv(K, BK)
        if PPS:
            step = tl.num_programs(0)
        else:
            step = total
        return tl.program_id(0), total, step

    @triton.jit
    def wgrad_out_desc(out_ptr, G, N, K, s_og, s_on, OUT_TMA: tl.constexpr, TMA_STORE: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr):
        """TMA descriptor of the weight gradient [G, N, K] where the launcher allows one
        (``OUT_TMA``) and the config asks for it (``TMA_STORE``), else the plain pointer."""
        if OUT_TMA and TMA_STORE:
            return tl.make_tensor_descriptor(out_ptr, shape=[G, N, K], strides=[s_og, s_on, 1],
                                             block_shape=[1, BN, BK])
        else:
            return out_ptr

    @triton.jit
    def wgrad_store(acc, o_base, offs_n, nmask, c0, K, mg, s_on, s_ok, ACCUMULATE: tl.constexpr, BC: tl.constexpr):
        """Store (or add into) out[g][n-tile, c0:c0+BC] from the fp32 tile ``acc``."""
        offs_k = c0 + tl.arange(0, BC)
        o_ptrs = o_base + offs_n.to(tl.int64)[:, None] * s_on + offs_k.to(tl.int64)[None, :] * s_ok
        if ACCUMULATE:
            K = tl.where(mg > 0, K, 0)  # empty groups stay untouched
        omask = nmask[:, None] & (offs_k < K)[None, :]
        if ACCUMULATE:
            acc += tl.load(o_ptrs, mask=omask, other=0.0).to(tl.float32)
        tl.store(o_ptrs, acc.to(o_base.dtype.element_ty), mask=omask)

    @triton.jit
    def wgrad_epilogue(acc, out_ptr, o_desc, g, s_og, n0, offs_n, nmask, k0, K, mg, s_on, s_ok,
                       ACCUMULATE: tl.constexpr, OUT_TMA: tl.constexpr, TMA_STORE: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr):
        """Group ``g``'s [BN, BK] tile at (``n0``, ``k0``) into the weight gradient: a TMA store
        through ``o_desc`` (:func:`wgrad_out_desc`; asynchronous, the next tile's loads overlap
        it), else :func:`wgrad_store`; an accumulating store of a wide tile goes in two column
        halves (register pressure of the read-modify-write)."""
        if OUT_TMA and TMA_STORE:
            tl.static_assert(not ACCUMULATE, "the TMA epilogue only overwrites")
            o_desc.store([g, n0, k0], tl.reshape(acc.to(out_ptr.dtype.element_ty), (1, BN, BK)))
        else:
            o_base = out_ptr + g.to(tl.int64) * s_og
            if ACCUMULATE and BK >= 128:
                acc0, acc1 = split_cols(acc, BN, BK)
                wgrad_store(acc0, o_base, offs_n, nmask, k0, K, mg, s_on, s_ok, ACCUMULATE, BK // 2)
                wgrad_store(acc1, o_base, offs_n, nmask, k0 + BK // 2, K, mg, s_on, s_ok, ACCUMULATE, BK // 2)
            else:
                wgrad_store(acc, o_base, offs_n, nmask, k0, K, mg, s_on, s_ok, ACCUMULATE, BK)

    @triton.jit
    def _splits_valid(split_ptr, G, rows, G_P2: tl.constexpr):
        """Every one of the G split sizes >= 0 and their sum == rows (a scalar bool)."""
        gi = tl.arange(0, G_P2)
        m = tl.load(split_ptr + gi, mask=gi < G, other=0)
        return (tl.min(m, 0) >= 0) & (tl.sum(m, 0) == rows)

    @triton.jit
    def _splits_ok_kernel(split_ptr, G, rows, ok_ptr, G_P2: tl.constexpr):
        tl.store(ok_ptr, _splits_valid(split_ptr, G, rows, G_P2))

    @triton.jit(debug=True)  # (Triton compiles device_assert only into debug kernels)
    def _splits_assert_kernel(split_ptr, G, rows, G_P2: tl.constexpr):
        tl.device_assert(_splits_valid(split_ptr, G, rows, G_P2),
                         "split sizes must be non-negative and sum to the input's rows")

    @triton.jit(debug=True)
    def _splits_equal_assert_kernel(a_ptr, b_ptr, G, G_P2: tl.constexpr):
        gi = tl.arange(0, G_P2)
        a = tl.load(a_ptr + gi, mask=gi < G, other=0)
        b = tl.load(b_ptr + gi, mask=gi < G, other=0)
        tl.device_assert(tl.sum((a != b).to(tl.int32), 0) == 0, "the second split sizes must equal the first")

    def mn_config(bm, bn, bk, warps, stages, pps=1, flat=False):
        """A config of a tile-space kernel; ``pps`` programs per SM (read by the grid), ``flat``:
        the persistent tile loop flattened with the K loop (only for kernels with FLATTEN)."""
        meta = {"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8, "PPS": pps}
        if flat:
            meta["FLATTEN"] = True
        return triton.Config(meta, num_warps=warps, num_stages=stages)

    def wgrad_config(bn, bk, br, warps, stages, pps=0, tma_out=False):
        """A config of a weight-gradient kernel: ``pps`` 0 one tile per program, else that many
        persistent programs per SM (:func:`wgrad_grid`); ``tma_out``: TMA-store epilogue where the
        launcher allows it (an overwritten, TMA-aligned output)."""
        return triton.Config({"BN": bn, "BK": bk, "BR": br, "GROUP_N": 8, "PPS": pps, "TMA_STORE": tma_out},
                             num_warps=warps, num_stages=stages)


def group_p2(G: int) -> int:
    """The power of two >= G (>= 2) that sizes the in-kernel group table."""
    return max(2, next_pow2(max(G, 1)))


def persistent_sms(device: torch.device, interpreter_programs: int = INTERP_PROGS) -> int:
    """:func:`~fusible_ops.kernels.launch.num_sms` less the SMs
    :func:`~fusible_ops.kernels.launch.reserve_sms` keeps free (at least 1)."""
    n = num_sms(device, interpreter_programs)
    return n if device.type != "cuda" else max(1, n - SM_RESERVE[0])


def persistent_grid(M: int, G: int, n_cols: int, device: torch.device):
    """Persistent grid: min(#SMs x programs per SM, upper bound of the tile count over any split
    of M rows into G groups); the SMs :func:`~fusible_ops.kernels.launch.reserve_sms` keeps free
    are left out."""
    progs = persistent_sms(device)

    def grid(meta):
        max_tiles = (cdiv(M, meta["BM"]) + G) * cdiv(n_cols, meta["BN"])
        return (max(1, min(progs * meta.get("PPS", 1), max_tiles)),)
    return grid


def wgrad_grid(G: int, N: int, K: int, device: torch.device):
    """Grid of a weight-gradient kernel (:func:`wgrad_schedule`): one program per tile, or with
    ``PPS`` > 0 min(tiles, persistent SMs x PPS) programs."""
    progs = persistent_sms(device)

    def grid(meta):
        tiles = G * cdiv(N, meta["BN"]) * cdiv(K, meta["BK"])
        pps = meta.get("PPS", 0)
        return (max(1, min(tiles, progs * pps)) if pps else tiles,)
    return grid


def wgrad_tma_out(out: torch.Tensor, accumulate: bool) -> bool:
    """Whether a weight-gradient kernel may store ``out`` through TMA (:func:`wgrad_epilogue`): an
    overwritten (not accumulated) 16-bit output that :func:`tma_ok` accepts. (fp32 outputs keep
    the pointer epilogue: the TMA one was measured only on 16-bit outputs.)"""
    return not accumulate and out.element_size() == 2 and tma_ok(out)


_CAPABILITY: dict[int, tuple] = {}
_allocator_set = threading.local()


def tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether TMA descriptors can serve these operands: CUDA sm90+, Triton with
    ``tl.make_tensor_descriptor``, a contiguous last dim, 16-byte aligned base and strides, rows
    of >= 16 bytes. :data:`TMA` False (``FUSIBLE_OPS_GGEMM_TMA=0`` at import) turns TMA off; never
    under the interpreter."""
    if not (TMA and _TMA_API) or interpreter_enabled():
        return False
    for t in tensors:
        if not t.is_cuda or t.data_ptr() % 16:
            return False
        strides, es = t.stride(), t.element_size()
        if strides[-1] != 1 or t.shape[-1] * es < 16 or not t.numel():
            return False
        for s in strides[:-1]:
            if (s * es) % 16:
                return False
        idx = t.get_device()
        cap = _CAPABILITY.get(idx)
        if cap is None:
            cap = _CAPABILITY[idx] = torch.cuda.get_device_capability(idx)
        if cap[0] < 9:
            return False
    # Device-side descriptors need a global scratch allocation (graph-capturable torch.empty).
    # Triton keeps the allocator per thread (autograd runs backward on its own threads): set it
    # once in each thread that launches.
    if not getattr(_allocator_set, "done", False):
        triton.set_allocator(_tma_scratch)
        _allocator_set.done = True
    return True


TMA = os.environ.get("FUSIBLE_OPS_GGEMM_TMA", "1") != "0"
"""Use TMA descriptors where :func:`tma_ok` allows (``FUSIBLE_OPS_GGEMM_TMA=0`` at import, or
setting this to False, forces masked pointer loads everywhere)."""
_TMA_API = HAS_TRITON and hasattr(tl, "make_tensor_descriptor") and hasattr(triton, "set_allocator")


def _tma_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def check_splits(split_sizes: torch.Tensor, G: int, *tensors: torch.Tensor) -> None:
    """Host-known checks of a grouped call: split sizes 1-D int64 of length G, every tensor on
    one device."""
    dev = tensors[0].device
    if split_sizes.dim() != 1 or split_sizes.shape[0] != G:
        raise ValueError(f"split_sizes must be 1-D of length G={G}, got {tuple(split_sizes.shape)}")
    if split_sizes.dtype != torch.int64:
        raise TypeError(f"split_sizes must be int64, got {split_sizes.dtype}")
    for t in (split_sizes, *tensors):
        if t is not None and t.device != dev:
            raise ValueError(f"all tensors must be on {dev}; got one on {t.device}")


_SPLITS_OK = DirectKernel(_splits_ok_kernel) if HAS_TRITON else None
_SPLITS_ASSERT = DirectKernel(_splits_assert_kernel) if HAS_TRITON else None
_SPLITS_EQUAL_ASSERT = DirectKernel(_splits_equal_assert_kernel) if HAS_TRITON else None


def _splits_key(split_sizes: torch.Tensor, rows: int) -> tuple:
    """The launch key of the split-size checks: what Triton specializes on (G itself fixes G_P2
    and G's integer class)."""
    G = split_sizes.shape[0]
    return (split_sizes.device, split_sizes.dtype, G, rows == 1, rows % 16 == 0, -2**31 <= rows < 2**31)


def splits_ok(split_sizes: torch.Tensor, rows: int) -> torch.Tensor:
    """0-dim bool on the split sizes' (CUDA) device: every size >= 0 and they sum to ``rows``.
    One launch, no host sync (the torch-op form of this check costs five)."""
    ok = torch.empty((), dtype=torch.bool, device=split_sizes.device)
    G = split_sizes.shape[0]
    _SPLITS_OK((1,), _splits_key(split_sizes, rows), (split_sizes, G, rows, ok), dict(G_P2=group_p2(G)))
    return ok


def splits_assert(split_sizes: torch.Tensor, rows: int) -> None:
    """Assert on the device that every split size is >= 0 and they sum to ``rows``: one launch, no
    output, no host sync. A failure is a device-side assert, as ``torch._assert_async`` gives (the
    error surfaces at the next synchronization and ends the CUDA context); :func:`splits_ok`
    followed by ``torch._assert_async`` would take two launches and an allocation."""
    G = split_sizes.shape[0]
    _SPLITS_ASSERT((1,), _splits_key(split_sizes, rows), (split_sizes, G, rows), dict(G_P2=group_p2(G)))


def splits_equal_assert(a: torch.Tensor, b: torch.Tensor) -> None:
    """Assert on the device that two int64 split-size tensors of one length hold the same values:
    one launch, no output, no host sync (``device_check((a == b).all(), ...)`` takes three launches
    and two allocations). A failure is a device-side assert, as in :func:`splits_assert`."""
    G = a.shape[0]
    _SPLITS_EQUAL_ASSERT((1,), (a.device, a.dtype, b.dtype, G), (a, b, G), dict(G_P2=group_p2(G)))


def same_dtype(a: torch.Tensor, b: torch.Tensor) -> None:
    """GEMM operands must share a dtype."""
    if a.dtype != b.dtype:
        raise TypeError(f"operands must share a dtype, got {a.dtype} and {b.dtype}")


__all__ = ["INTERP_MN", "INTERP_PROGS", "INTERP_WG", "check_splits", "group_p2", "persistent_grid", "persistent_sms", "same_dtype",
           "splits_assert", "splits_equal_assert", "splits_ok", "tma_ok", "wgrad_grid",
           "wgrad_tma_out"] + (
               ["group_rows", "group_table", "locate_tile", "mainloop", "mn_config", "operand_descs", "pick", "split_cols",
                "tile_coords", "tile_space", "wgrad_config", "wgrad_out_desc", "wgrad_schedule", "wgrad_store",
                "wgrad_tile"] if HAS_TRITON else [])
