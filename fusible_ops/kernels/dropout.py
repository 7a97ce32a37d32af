"""Counter-based dropout: the keep mask is regenerated from ``(seed, p)``, never stored.

Mask definition (shared by every kernel family that fuses dropout):

* Draw ``u = tl.rand(seed, offset)`` -- Triton's Philox 4x32 with 10 rounds, key
  ``(seed, 0)``, counter ``(offset_lo, offset_hi, 0, 0)``, first output word turned into
  a float32 in ``[0, 1)`` by ``uint_to_uniform_float`` -- where ``offset`` is the flat
  element index in the contiguous (row-major) view of the tensor the mask applies to.
* ``keep = u >= float32(p)``; kept values are scaled by ``float32(1 / (1 - p))``.

The ``*_ref`` path re-implements that Philox stream in pure torch (int64 arithmetic
with 32-bit masking), so CPU references and GPU kernels draw bit-identical masks.
Seeds are Python ints in ``[0, 2**31)``; ``p`` is a float in ``[0, 1]``.

Layout: Triton kernel, launcher + custom op, then the pure-torch reference twins.
"""

import torch

from fusible_ops.kernels import HAS_TRITON, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _dropout_kernel(
        X,  # [n_rows, n_cols], row stride stride_xr, column stride 1
        Y,  # [n_rows, n_cols], contiguous
        n_rows,
        n_cols,
        stride_xr,
        p,  # fp32 drop probability
        scale,  # fp32 1 / (1 - p)
        seed,  # int32 Philox key
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
        OFF64: tl.constexpr,  # int64 RNG counters (n_rows * n_cols >= 2**31)
    ):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * stride_xr + cols[None, :], mask=mask, other=0.0)
        if OFF64:
            offs = rows64[:, None] * n_cols + cols[None, :]
        else:
            offs = rows[:, None] * n_cols + cols[None, :]
        keep = tl.rand(seed, offs) >= p
        y = tl.where(keep, x.to(tl.float32) * scale, 0.0)
        tl.store(Y + rows64[:, None] * n_cols + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- launchers


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """A 2-D ``[rows, cols]`` view of ``x`` (row-major order kept) with column stride 1.

    Views when the strides allow it; otherwise copies (``reshape`` / ``contiguous``).
    """
    x2 = x.reshape(1, -1) if x.dim() == 0 else x.reshape(-1, x.shape[-1])
    if x2.shape[1] > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    return x2


def _check_p_seed(p: float, seed: int) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    if not 0 <= int(seed) < 2**31:
        raise ValueError(f"dropout seed must be in [0, 2**31), got {seed}")


def _keep_scale(p: float) -> float:
    """Scale applied to kept values (0.0 when p == 1: everything is dropped)."""
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


_EW_MAX_BLOCK_C = 1024  # tile caps of elementwise passes (tests shrink them to get many programs)
_EW_TILE = 4096


def _elementwise_config(n_rows: int, n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, num_warps) for a memory-bound elementwise pass: ~4096-element tiles."""
    block_c = min(triton.next_power_of_2(max(n_cols, 1)), _EW_MAX_BLOCK_C)
    block_r = max(1, min(triton.next_power_of_2(max(n_rows, 1)), _EW_TILE // block_c))
    num_warps = 8 if block_r * block_c >= 4096 else 4
    return block_r, block_c, num_warps


def _dropout_launch(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """Triton dropout of ``x`` (any shape/strides); returns a contiguous tensor of x's shape."""
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return y
    x2 = _as_rows(x)
    n_rows, n_cols = x2.shape
    block_r, block_c, num_warps = _elementwise_config(n_rows, n_cols)
    grid = (triton.cdiv(n_rows, block_r), triton.cdiv(n_cols, block_c))
    _dropout_kernel[grid](
        x2, y, n_rows, n_cols, x2.stride(0), float(p), _keep_scale(p), int(seed),
        BLOCK_R=block_r, BLOCK_C=block_c, OFF64=x.numel() >= 2**31, num_warps=num_warps,
    )
    return y


@torch.library.custom_op("fusible_ops::dropout", mutates_args=())
def _dropout_op(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """Custom-op wrapper of the Triton dropout (forward and backward share it)."""
    return _dropout_launch(x, p, seed)


@_dropout_op.register_fake
def _dropout_op_fake(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


# ----------------------------------------------------------------------------- public API


def dropout_fwd(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """Dropout with a counter-based mask: ``y = x * keep / (1 - p)``.

    x: any shape, strides and floating dtype. Returns y with x's shape and dtype
    (contiguous). ``keep = dropout_keep_mask(x.shape, p, seed, x.device)``; the product is
    computed in fp32 (fp64 for fp64 inputs on the ref path). ``p == 0`` returns ``x``
    itself (no copy); ``p == 1`` returns zeros. seed: int in ``[0, 2**31)``.
    """
    _check_p_seed(p, seed)
    if p == 0.0:
        return x
    if use_triton(x):
        return _dropout_op(x, float(p), int(seed))
    return dropout_fwd_ref(x, p, seed)


def dropout_bwd(dy: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """Gradient of :func:`dropout_fwd`: ``dx = dy * keep / (1 - p)``, mask regenerated.

    dy: the output gradient (shape of the forward's x, any strides). Returns dx with dy's
    shape and dtype. ``p == 0`` returns ``dy`` itself; ``p == 1`` returns zeros.
    """
    _check_p_seed(p, seed)
    if p == 0.0:
        return dy
    if use_triton(dy):
        return _dropout_op(dy, float(p), int(seed))
    return dropout_bwd_ref(dy, p, seed)


# ----------------------------------------------------------------------------- references

_M32 = 0xFFFFFFFF
_PHILOX_KEY_A = 0x9E3779B9
_PHILOX_KEY_B = 0xBB67AE85
_PHILOX_ROUND_A = 0xD2511F53
_PHILOX_ROUND_B = 0xCD9E8D57
_UINT_TO_FLOAT_SCALE = 4.6566127342e-10  # triton.language.random.uint_to_uniform_float (32-bit)
_CHUNK = 1 << 22  # counters per chunk in the torch Philox (bounds int64 temporaries)


def _mulhilo32(a: int, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of the 64-bit product ``a * c`` (a: uint32 int, c: uint32 in int64)."""
    t_lo = a * (c & 0xFFFF)  # < 2**48
    t_hi = a * (c >> 16)  # < 2**48
    hi = (t_hi + (t_lo >> 16)) >> 16
    lo = (((t_hi & 0xFFFF) << 16) + t_lo) & _M32
    return hi, lo


def philox_rand_ref(offsets: torch.Tensor, seed: int) -> torch.Tensor:
    """Pure-torch twin of ``tl.rand(seed, offsets)``: float32 uniforms in ``[0, 1)``.

    offsets: integer tensor of non-negative counters (< 2**63), any shape and device.
    Bit-identical to Triton's Philox 4x32-10 + ``uint_to_uniform_float`` for seeds in
    ``[0, 2**31)``.
    """
    off = offsets.to(torch.int64)
    c0 = off & _M32
    c1 = (off >> 32) & _M32
    c2 = torch.zeros_like(off)
    c3 = torch.zeros_like(off)
    k0, k1 = int(seed) & _M32, (int(seed) >> 32) & _M32
    for _ in range(10):
        hi_b, lo_b = _mulhilo32(_PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mulhilo32(_PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _PHILOX_KEY_A) & _M32
        k1 = (k1 + _PHILOX_KEY_B) & _M32
    x = torch.where(c0 >= 2**31, c0 - 2**32, c0)  # bitcast uint32 -> int32
    x = torch.where(x < 0, ~x, x)  # in [0, 2**31)
    return x.to(torch.float32) * torch.tensor(_UINT_TO_FLOAT_SCALE, dtype=torch.float32, device=x.device)


def dropout_keep_mask(shape, p: float, seed: int, device) -> torch.Tensor:
    """The keep mask (bool tensor of ``shape`` on ``device``) used by every dropout kernel.

    ``keep[i] = philox_rand_ref(i, seed) >= float32(p)`` with ``i`` the flat row-major
    index. All True for ``p == 0``, all False for ``p == 1``.
    """
    _check_p_seed(p, seed)
    shape = tuple(shape)
    numel = 1
    for s in shape:
        numel *= int(s)
    if p == 0.0:
        return torch.ones(shape, dtype=torch.bool, device=device)
    if p >= 1.0:
        return torch.zeros(shape, dtype=torch.bool, device=device)
    keep = torch.empty(numel, dtype=torch.bool, device=device)
    p32 = torch.tensor(p, dtype=torch.float32, device=device)
    for start in range(0, numel, _CHUNK):
        offs = torch.arange(start, min(start + _CHUNK, numel), dtype=torch.int64, device=device)
        keep[start : start + offs.numel()] = philox_rand_ref(offs, seed) >= p32
    return keep.reshape(shape)


def _apply_mask_ref(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    keep = dropout_keep_mask(x.shape, p, seed, x.device)
    scale = torch.tensor(_keep_scale(p), dtype=cd, device=x.device)
    y = torch.where(keep, x.to(cd) * scale, torch.zeros((), dtype=cd, device=x.device))
    return y.to(x.dtype)


def dropout_fwd_ref(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """Pure-torch :func:`dropout_fwd` (same mask, fp32 math; fp64 for fp64 inputs)."""
    _check_p_seed(p, seed)
    if p == 0.0:
        return x
    return _apply_mask_ref(x, p, seed)


def dropout_bwd_ref(dy: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """Pure-torch :func:`dropout_bwd` (same mask, fp32 math; fp64 for fp64 inputs)."""
    _check_p_seed(p, seed)
    if p == 0.0:
        return dy
    return _apply_mask_ref(dy, p, seed)


__all__ = [
    "dropout_bwd",
    "dropout_bwd_ref",
    "dropout_fwd",
    "dropout_fwd_ref",
    "dropout_keep_mask",
    "philox_rand_ref",
]
