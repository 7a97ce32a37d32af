"""Counter-based dropout: the keep mask is regenerated from ``(seed, p)``, never stored.

Mask definition (shared by every kernel family that fuses dropout; one Philox call per 8
elements):

* View the tensor the mask applies to as contiguous row-major ``[rows, cols]`` (cols = the
  last dim; a 0-dim tensor is ``[1, 1]``) and let ``C8 = ceil(cols / 8)``.
* Element ``(r, c)`` uses the counter ``r * C8 + c // 8``: ``tl.randint4x(seed, counter)`` --
  Triton's Philox 4x32 with 10 rounds, key = the 64-bit seed's 32-bit words ``(lo, hi)``
  (``hi = 0`` for the seeds ``Dropout`` draws), counter ``(counter_lo, counter_hi, 0, 0)`` --
  gives 4 words ``w0..w3``, and the element takes the 16-bit half ``k = c % 8`` of them: the low
  half of word ``k // 2`` for even ``k``, the high half for odd ``k``.
* ``keep = half >= t`` with ``t = drop_threshold(p)`` (``p * 2**16`` rounded half up): the drop
  probability is ``p`` rounded to a multiple of ``2**-16`` (so ``p < 2**-17`` drops nothing). 16-bit
  decisions need half the Philox work of 32-bit uniforms, which dominated the fused passes.
* ``y = x * m`` with ``m = float32(1 / (1 - p))`` where kept and ``0`` where dropped: a
  multiplication, like ``torch.nn.functional.dropout``, so a NaN or +-Inf input stays NaN even
  where dropped (``inf * 0``); ``p == 1`` multiplies by 0.
* Counters are int32 when ``rows * C8 < 2**31``, else int64 (same values either way).

Kernels get the mask of a ``[BLOCK_R, BLOCK_C]`` tile from :func:`keep_tile` (the tile's
first column must be a multiple of ``BLOCK_C``, a power of two ``>= 8``). The ``*_ref`` path
re-implements that Philox stream in pure torch (int64 arithmetic with 32-bit masking,
:func:`philox4_ref`), so CPU references and GPU kernels draw bit-identical masks.

Seeds are **tensors**: one int64 element on the data's device (``Dropout`` draws it with
``torch.randint`` from that device's default generator, so CUDA-graph replays draw new seeds and
``torch.compile`` traces it). Kernels load it from a pointer (no host read); the ``*_ref`` twins
use it with tensor ops only (no ``.item()``), so they trace under ``torch.compile`` too. The
Philox key is the seed's 64 bits (words ``(lo, hi)``) on both paths, so any value gives the same
mask on both; ``Dropout`` draws from ``[0, 2**31 - 1)``. The public functions also accept a
Python int in ``[0, 2**31)`` (checked on the host). ``p`` is a float in ``[0, 1]``.

Layout: Triton kernels, launcher + custom op, then the pure-torch reference twins.
"""

from typing import Optional, Union

import torch

from fusible_ops.kernels import HAS_TRITON, use_triton
from fusible_ops.kernels.launch import (RECORDER, DirectKernel, as_rows, cdiv, compute_dtype, elementwise_config, geometry_cache,
                                        kernel_op, needs_int64, remember)

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def keep_tile(
        seed,  # Philox key: an integer scalar (int64 seeds use both 32-bit words)
        rows,  # [BLOCK_R] row indices (int32 or int64) in the [n_rows, n_cols] view
        col_block_start,  # first column of the tile: a multiple of BLOCK_C
        n_cols,  # cols of the view the mask applies to
        drop_t,  # fp32 holding the integer drop_threshold(p), in [0, 2**16]
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,  # power of two >= 8
        OFF64: tl.constexpr,  # int64 counters (n_rows * ceil(n_cols / 8) >= 2**31)
    ):
        """[BLOCK_R, BLOCK_C] keep mask of the module's mask contract (one Philox per 8 columns).

        Out-of-range rows / columns get arbitrary values: callers mask their loads and stores.
        """
        tl.static_assert(BLOCK_C >= 8, "dropout tiles need BLOCK_C >= 8")
        c8 = (n_cols + 7) // 8
        q = col_block_start // 8 + tl.arange(0, BLOCK_C // 8)
        if OFF64:
            cnt = rows.to(tl.int64)[:, None] * c8 + q.to(tl.int64)[None, :]
        else:
            cnt = rows.to(tl.int32)[:, None] * c8 + q[None, :]
        w0, w1, w2, w3 = tl.randint4x(seed, cnt)
        # join(x, y) appends a minor dim of size 2 ([..., 0] = x, [..., 1] = y), so in
        # join(join(join(h0, h4), join(h2, h6)), join(join(h1, h5), join(h3, h7)))[i, j, a, b, c]
        # = h_{4a+2b+c}[i, j] the row-major reshape puts half k = 4a + 2b + c of counter j at
        # column 8 j + k (h_k: the low half of word k // 2 for even k, the high half for odd k)
        lo = tl.join(tl.join(w0 & 0xFFFF, w2 & 0xFFFF), tl.join(w1 & 0xFFFF, w3 & 0xFFFF))
        hi = tl.join(tl.join(w0 >> 16, w2 >> 16), tl.join(w1 >> 16, w3 >> 16))
        h = tl.reshape(tl.join(lo, hi), (BLOCK_R, BLOCK_C)).to(tl.int32, bitcast=True)
        return h >= tl.cast(drop_t, tl.int32)

    @triton.jit
    def _dropout_kernel(
        X,  # [n_rows, n_cols], row stride stride_xr, column stride 1
        Y,  # [n_rows, n_cols], contiguous
        n_rows,
        n_cols,
        stride_xr,
        drop_t,  # fp32 drop_threshold(p)
        scale,  # fp32 1 / (1 - p)
        SEED,  # [1] int64 Philox key, read on the device
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,  # power of two >= 8
        OFF64: tl.constexpr,  # int64 RNG counters (n_rows * ceil(n_cols / 8) >= 2**31)
    ):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        col0 = tl.program_id(1) * BLOCK_C
        cols = col0 + tl.arange(0, BLOCK_C)
        mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * stride_xr + cols[None, :], mask=mask, other=0.0)
        keep = keep_tile(tl.load(SEED), rows, col0, n_cols, drop_t, BLOCK_R, BLOCK_C, OFF64)
        y = x.to(tl.float32) * tl.where(keep, scale, 0.0)  # a product: NaN/Inf stay NaN where dropped
        tl.store(Y + rows64[:, None] * n_cols + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- launchers


def _check_p(p: float) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")


Seed = Union[torch.Tensor, int]  # an integer tensor with one element (canonical), or a Python int


def _check_int_seed(seed) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
        raise ValueError(
            f"dropout seed must be an int64 tensor with one element or an int in [0, 2**31), got {seed}"
        )


def seed_tensor(seed: Seed, device) -> torch.Tensor:
    """``seed`` (an integer tensor with one element, or a Python int in ``[0, 2**31)``) as the
    int64 tensor of shape ``[1]`` on ``device`` that kernels read. Only metadata is checked (no
    host sync); a tensor already in that form is returned as is."""
    if isinstance(seed, torch.Tensor):
        if seed.numel() != 1 or seed.dtype.is_floating_point or seed.dtype.is_complex or seed.dtype == torch.bool:
            raise ValueError(f"dropout seed must be an integer tensor with one element, got {seed.dtype} "
                             f"{list(seed.shape)}")
        return seed.reshape(1).to(device=device, dtype=torch.int64)
    _check_int_seed(seed)
    return torch.tensor([seed], dtype=torch.int64, device=device)


def check_p_seed(p: float, seed: Optional[Seed]) -> None:
    """p in [0, 1]; a seed is needed when p > 0 (an int seed is range-checked on the host)."""
    if p == 0.0 and seed is None:  # no dropout (every kernel call without it: host time)
        return
    _check_p(p)
    if p > 0.0 and seed is None:
        raise ValueError(f"dropout with p={p} > 0 needs a seed (an int64 tensor with one element)")
    if seed is not None and not isinstance(seed, torch.Tensor):
        _check_int_seed(seed)


def kernel_seed(p: float, seed: Optional[Seed], device) -> Optional[torch.Tensor]:
    """Checked ``(p, seed)`` of a kernel call with optional dropout: the seed as the int64 ``[1]``
    tensor the kernels read when ``p > 0``, else None."""
    check_p_seed(p, seed)
    if p > 0.0 and RECORDER[0] is not None:  # (a new mask per call: never a replayed constant)
        RECORDER[0].fail("dropout draws a seed per call")
    return seed_tensor(seed, device) if p > 0.0 else None


def drop_threshold(p: float) -> int:
    """The mask contract's ``t``: a 16-bit half ``h`` is kept when ``h >= t``; ``p * 2**16``
    rounded half up (``2**16`` for ``p == 1``: everything is dropped)."""
    return min(1 << 16, int(p * 65536.0 + 0.5))


def keep_scale(p: float) -> float:
    """Scale applied to kept values (0.0 when p == 1: everything is dropped)."""
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def _dropout_launch(x: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    """Triton dropout of ``x`` (any shape/strides); returns a contiguous tensor of x's shape.
    seed: [1] int64 on x's device (read by the kernel)."""
    key = (x.shape, x.stride(), x.dtype, x.device)
    geo = _GEOMETRY.get(key)
    if geo is None:
        n_rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else (1 if x.dim() == 0 else 0)
        n_cols = x.shape[-1] if x.dim() else 1
        block_r, block_c, num_warps = elementwise_config(n_rows, n_cols)
        geo = remember(_GEOMETRY, key, ((cdiv(n_rows, block_r), cdiv(n_cols, block_c)), dict(
            BLOCK_R=block_r, BLOCK_C=block_c, OFF64=needs_int64(n_rows, n_cols), num_warps=num_warps)))
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel() == 0:
        return y
    grid, meta = geo
    x2 = as_rows(x)
    _DROPOUT(grid, key, (x2, y, x2.shape[0], x2.shape[1], x2.stride(0), float(drop_threshold(p)), keep_scale(p), seed),
             meta)
    return y


_GEOMETRY = geometry_cache()
if HAS_TRITON:
    _DROPOUT = DirectKernel(_dropout_kernel)


@kernel_op("fusible_ops::dropout", mutates_args=())
def _dropout_op(x: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    """Custom-op wrapper of the Triton dropout (forward and backward share it)."""
    return _dropout_launch(x, p, seed)


@_dropout_op.register_fake
def _dropout_op_fake(x: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


# ----------------------------------------------------------------------------- public API


def dropout_fwd(x: torch.Tensor, p: float, seed: Optional[Seed] = None) -> torch.Tensor:
    """Dropout with a counter-based mask: ``y = x * (keep / (1 - p))``.

    x: any shape, strides and floating dtype. Returns y with x's shape and dtype
    (contiguous). ``keep = dropout_keep_mask(x.shape, p, seed, x.device)``; the product is
    computed in fp32 (fp64 for fp64 inputs on the ref path); dropped NaN/Inf inputs give NaN,
    as in ``torch.nn.functional.dropout``. ``p == 0`` returns ``x`` itself (no copy, no seed
    needed); ``p == 1`` multiplies by zero. seed: an int64 tensor with one element (see the
    module docstring; a Python int in ``[0, 2**31)`` is accepted too).
    """
    check_p_seed(p, seed)
    if p == 0.0:
        return x
    seed = seed_tensor(seed, x.device)
    if use_triton(x):
        return _dropout_op(x, float(p), seed)
    return dropout_fwd_ref(x, p, seed)


def dropout_bwd(dy: torch.Tensor, p: float, seed: Optional[Seed] = None) -> torch.Tensor:
    """Gradient of :func:`dropout_fwd`: ``dx = dy * (keep / (1 - p))``, mask regenerated.

    dy: the output gradient (shape of the forward's x, any strides). Returns dx with dy's
    shape and dtype. ``p == 0`` returns ``dy`` itself; ``p == 1`` multiplies by zero.
    """
    check_p_seed(p, seed)
    if p == 0.0:
        return dy
    seed = seed_tensor(seed, dy.device)
    if use_triton(dy):
        return _dropout_op(dy, float(p), seed)
    return dropout_bwd_ref(dy, p, seed)


# ----------------------------------------------------------------------------- references

_M32 = 0xFFFFFFFF
_PHILOX_KEY_A = 0x9E3779B9
_PHILOX_KEY_B = 0xBB67AE85
_PHILOX_ROUND_A = 0xD2511F53
_PHILOX_ROUND_B = 0xCD9E8D57
_UINT_TO_FLOAT_SCALE = 4.6566127342e-10  # triton.language.random.uint_to_uniform_float (32-bit)
_CHUNK = 1 << 20  # counters per chunk in the torch Philox (bounds int64 temporaries)


def _mulhilo32(a: int, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of the 64-bit product ``a * c`` (a: uint32 int, c: uint32 in int64).

    One int64 product whose two's-complement wrap-around keeps its low 64 bits exact (what
    torch's CPU/CUDA kernels and inductor's generated code compute; the tests check the words
    bit-exactly against ``tl.rand4x``, eager and compiled). Reading ``c`` once matters under
    ``torch.compile``: inductor inlines pointwise chains into their consumers and only realizes
    an intermediate once it reads enough buffers, re-expanding every reuse meanwhile. With a
    constant seed and ``arange`` counters nothing in the 10 rounds reads a buffer, so a 16-bit
    split (each word read ~4 times per round) cost ~4**10 re-expansions per node and compiling a
    dropout block never finished; one product per word keeps that small (the tensor seed that
    ``Dropout`` passes is a buffer read, which lets inductor realize the rounds anyway).
    """
    prod = a * c
    return (prod >> 32) & _M32, prod & _M32


def _key_words(seed: Seed, device):
    """(k0, k1): the low and high 32-bit words of the 64-bit seed; ints for an int seed, 0-dim
    int64 tensors on ``device`` for a tensor seed (tensor ops only: traceable, no host read)."""
    if isinstance(seed, torch.Tensor):
        s = seed.reshape(()).to(device=device, dtype=torch.int64)
        return s & _M32, (s >> 32) & _M32
    return int(seed) & _M32, (int(seed) >> 32) & _M32


def philox4_ref(counters: torch.Tensor, seed: Seed) -> tuple[torch.Tensor, ...]:
    """Pure-torch twin of ``tl.randint4x(seed, counters)``: its 4 uint32 words, in int64 tensors.

    counters: integer tensor of non-negative counters (< 2**63), any shape and device.
    seed: an integer tensor with one element (any device; used with tensor ops only, so this
    traces under ``torch.compile``) or a Python int. Returns ``(w0, w1, w2, w3)``, each of
    counters' shape: Triton's Philox 4x32-10 (key ``(seed lo, seed hi)``, counter
    ``(lo, hi, 0, 0)``); bit-identical to Triton.
    """
    off = counters.to(torch.int64)
    c0 = off & _M32
    c1 = (off >> 32) & _M32
    c2 = torch.zeros_like(off)
    c3 = torch.zeros_like(off)
    k0, k1 = _key_words(seed, off.device)
    for _ in range(10):
        hi_b, lo_b = _mulhilo32(_PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mulhilo32(_PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _PHILOX_KEY_A) & _M32
        k1 = (k1 + _PHILOX_KEY_B) & _M32
    return c0, c1, c2, c3


def philox_rand4_ref(counters: torch.Tensor, seed: Seed) -> tuple[torch.Tensor, ...]:
    """Pure-torch twin of ``tl.rand4x(seed, counters)``: 4 float32 tensors of uniforms in ``[0, 1)``,
    the words of :func:`philox4_ref` through ``uint_to_uniform_float``; bit-identical to Triton."""
    words = philox4_ref(counters, seed)
    scale = torch.tensor(_UINT_TO_FLOAT_SCALE, dtype=torch.float32, device=words[0].device)
    # uint_to_uniform_float: bitcast uint32 -> int32, then x < 0 -> ~x; i.e. c ^ M32 for c >= 2**31
    return tuple(torch.where(c >= 2**31, c ^ _M32, c).to(torch.float32) * scale for c in words)


def philox_rand_ref(offsets: torch.Tensor, seed: Seed) -> torch.Tensor:
    """Pure-torch twin of ``tl.rand(seed, offsets)`` (the first word of :func:`philox_rand4_ref`).

    offsets: integer tensor of non-negative counters (< 2**63), any shape and device.
    Returns float32 uniforms in ``[0, 1)`` of offsets' shape.
    """
    return philox_rand4_ref(offsets, seed)[0]


def _rows_cols(shape) -> tuple[int, int]:
    """(rows, cols) of the contiguous ``[rows, cols]`` view the mask contract uses."""
    if len(shape) == 0:
        return 1, 1
    cols = shape[-1]
    numel = 1
    for s in shape:
        numel *= s
    return (numel // cols if cols else 0), cols


def _keep8(start: int, end: int, t: int, seed: Seed, device) -> torch.Tensor:
    """[end - start, 8] keep bits of counters start..end-1 (16-bit half k in column k)."""
    cnt = torch.arange(start, end, dtype=torch.int64, device=device)
    halves = [h for w in philox4_ref(cnt, seed) for h in (w & 0xFFFF, w >> 16)]
    return torch.stack(halves, -1) >= t


def dropout_keep_mask(shape, p: float, seed: Optional[Seed], device) -> torch.Tensor:
    """The keep mask (bool tensor of ``shape`` on ``device``) used by every dropout kernel.

    With ``[rows, cols]`` the contiguous view of ``shape``, ``C8 = ceil(cols / 8)``, ``k = c % 8``
    and ``w = philox4_ref(r * C8 + c // 8, seed)[k // 2]``:
    ``keep[r, c] = (w >> (16 * (k % 2))) & 0xFFFF >= drop_threshold(p)``.
    All True for ``p == 0``, all False for ``p == 1``. seed: as for :func:`dropout_fwd` (a
    tensor seed is read with tensor ops only: no host sync, traceable by ``torch.compile``).
    """
    check_p_seed(p, seed)
    shape = tuple(shape)
    if p == 0.0:
        return torch.ones(shape, dtype=torch.bool, device=device)
    if p >= 1.0:
        return torch.zeros(shape, dtype=torch.bool, device=device)
    rows, cols = _rows_cols(shape)
    c8 = (cols + 7) // 8
    n_cnt = rows * c8
    t = drop_threshold(p)
    if torch.compiler.is_compiling() or n_cnt <= _CHUNK:  # one pass (a traced graph has no loop)
        keep8 = _keep8(0, n_cnt, t, seed, device)
    else:  # eager and large: chunks bound the int64 temporaries
        keep8 = torch.empty((n_cnt, 8), dtype=torch.bool, device=device)  # [counter, half]
        for start in range(0, n_cnt, _CHUNK):
            end = min(start + _CHUNK, n_cnt)
            keep8[start:end] = _keep8(start, end, t, seed, device)
    return keep8.reshape(rows, 8 * c8)[:, :cols].reshape(shape)


def _apply_mask_ref(x: torch.Tensor, p: float, seed: Seed) -> torch.Tensor:
    cd = compute_dtype(x.dtype)
    keep = dropout_keep_mask(x.shape, p, seed, x.device)
    m = torch.where(keep, torch.tensor(keep_scale(p), dtype=cd, device=x.device),
                    torch.zeros((), dtype=cd, device=x.device))
    return (x.to(cd) * m).to(x.dtype)  # a product, as in the kernel: NaN/Inf stay NaN where dropped


def dropout_fwd_ref(x: torch.Tensor, p: float, seed: Optional[Seed] = None) -> torch.Tensor:
    """Pure-torch :func:`dropout_fwd` (same mask, fp32 math; fp64 for fp64 inputs)."""
    check_p_seed(p, seed)
    if p == 0.0:
        return x
    return _apply_mask_ref(x, p, seed)


def dropout_bwd_ref(dy: torch.Tensor, p: float, seed: Optional[Seed] = None) -> torch.Tensor:
    """Pure-torch :func:`dropout_bwd` (same mask, fp32 math; fp64 for fp64 inputs)."""
    check_p_seed(p, seed)
    if p == 0.0:
        return dy
    return _apply_mask_ref(dy, p, seed)


__all__ = [
    "check_p_seed",
    "kernel_seed",
    "dropout_bwd",
    "dropout_bwd_ref",
    "dropout_fwd",
    "dropout_fwd_ref",
    "dropout_keep_mask",
    "drop_threshold",
    "keep_scale",
    "philox4_ref",
    "philox_rand4_ref",
    "philox_rand_ref",
    "seed_tensor",
]
