"""Jit helpers of the norm kernels (:mod:`.norm`), inlined into them: loads of the (residual-summed)
input, the affine epilogue, row statistics, dx and the dweight/dbias partials."""

from . import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    # ---- helpers, inlined into the kernels. Row tiles pass rows as [BLOCK_M, 1] (int64) and
    # cols as [1, BLOCK_N]; one-row code passes a scalar row and a [BLOCK_N] vector of columns.

    @triton.jit
    def aligned(v, ALIGN: tl.constexpr):
        # v, a multiple of ALIGN (launch.row_align), as a value the compiler knows to be one: rows
        # of 8 * k columns (k odd) then get 16-byte loads and stores instead of scalar ones
        return v // ALIGN * ALIGN

    @triton.jit
    def load_xsum(X, R, XS, rows, cols, mask, stride_x, stride_r, stride_xs,
                   HAS_RES: tl.constexpr, STORE: tl.constexpr):
        # fp32 x[rows, cols], plus the residual rounded to XS's dtype (the norm reads the rounded
        # sum), which STORE also writes to XS[rows, cols]
        x = tl.load(X + rows * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(R + rows * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
            xs = (x + r).to(XS.dtype.element_ty)
            if STORE:
                tl.store(XS + rows * stride_xs + cols, xs, mask=mask)
            x = xs.to(tl.float32)
        return x

    @triton.jit
    def affine(y, W, B, cols, col_mask, HAS_W: tl.constexpr, HAS_B: tl.constexpr, TILE: tl.constexpr):
        # y * weight + bias; cols is 1-D (TILE: y is a [BLOCK_M, BLOCK_N] tile)
        if HAS_W:
            w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
            y = y * (w[None, :] if TILE else w)
        if HAS_B:
            b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
            y = y + (b[None, :] if TILE else b)
        return y

    @triton.jit
    def store_y(y, W, B, Y, rows, cols, mask, col_mask, stride_y,
                 HAS_W: tl.constexpr, HAS_B: tl.constexpr, TILE: tl.constexpr):
        # y * weight + bias to Y[rows, cols]
        y = affine(y, W, B, cols, col_mask, HAS_W, HAS_B, TILE)
        tl.store(Y + rows * stride_y + (cols[None, :] if TILE else cols), y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def to_xhat(xs, dy, mask, mean, rstd, NO_MEAN: tl.constexpr):
        # fp32 (dy, xhat) of loaded xsum / dy with xhat = (xsum - mean) * rstd, 0 outside mask
        # (NO_MEAN: xsum * rstd, RMSNorm row tiles, whose masked-off xsum is 0 already)
        xs = xs.to(tl.float32)
        return dy.to(tl.float32), (xs * rstd if NO_MEAN else tl.where(mask, (xs - mean) * rstd, 0.0))

    @triton.jit
    def load_xhat(xs_ptr, dy_ptr, mask, mean, rstd, NO_MEAN: tl.constexpr, EVICT: tl.constexpr):
        # to_xhat of xsum / dy loaded at xs_ptr / dy_ptr (0 outside mask)
        xs = tl.load(xs_ptr, mask=mask, other=0.0, eviction_policy=EVICT)
        dy = tl.load(dy_ptr, mask=mask, other=0.0, eviction_policy=EVICT)
        return to_xhat(xs, dy, mask, mean, rstd, NO_MEAN)

    @triton.jit
    def load_tile(XS, DY, MEAN, RSTD, rows, cols, col_mask, n_rows, stride_xs, stride_dy, IS_RMS: tl.constexpr):
        # (xsum, dy) of the row tile rows x cols as stored (0 outside the tensor), its rows' mean
        # (0 for RMSNorm) and rstd: what the backward loads per tile
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        xs = tl.load(XS + rows64 * stride_xs + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_last")
        dy = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_last")
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        if IS_RMS:
            mean = tl.zeros_like(rstd)
        else:
            mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
        return xs, dy, mean, rstd

    @triton.jit
    def _add_pair(a0, b0, a1, b1):
        return a0 + a1, b0 + b1

    @triton.jit
    def sum_pair(a, b, AXIS: tl.constexpr):
        # (sum(a), sum(b)) along AXIS in one reduction (one shared-memory exchange for both)
        return tl.reduce((a, b), AXIS, _add_pair)

    @triton.jit
    def row_sums(xs_row, dy_row, W, cc, N, mean, rstd, c1, c2, HAS_W: tl.constexpr, EVICT: tl.constexpr):
        # (c1 + sum(g * xhat), c2 + sum(g)) over the columns cc of one row
        cm = cc < N
        dy_c, xhat_c = load_xhat(xs_row + cc, dy_row + cc, cm, mean, rstd, False, EVICT)
        g_c = dy_c * tl.load(W + cc, mask=cm, other=0.0).to(tl.float32) if HAS_W else dy_c
        return c1 + tl.sum(g_c * xhat_c, axis=0), c2 + tl.sum(g_c, axis=0)

    @triton.jit
    def store_dx(g, xhat, c1, c2, rstd, DXE, DX, rows, cols, mask, stride_dxe, stride_dx,
                  IS_RMS: tl.constexpr, HAS_DXE: tl.constexpr):
        # dx = rstd * (g - xhat * c1 - c2) (RMSNorm: no c2) + dxsum_extra, to DX[rows, cols]
        dx = g - xhat * c1
        if not IS_RMS:
            dx -= c2
        dx = dx * rstd
        if HAS_DXE:
            dx += tl.load(DXE + rows * stride_dxe + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)

    @triton.jit
    def row_ptrs(DY, XS, MEAN, RSTD, row, stride_dy, stride_xs, IS_RMS: tl.constexpr):
        # one row: (row as int64, xsum row pointer, dy row pointer, mean (0 for RMSNorm), rstd)
        row64 = tl.cast(row, tl.int64)
        mean = 0.0 if IS_RMS else tl.load(MEAN + row)
        return row64, XS + row64 * stride_xs, DY + row64 * stride_dy, mean, tl.load(RSTD + row)

    @triton.jit
    def acc_partials(dw, db, dy, xhat, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr):
        if NEED_DW:
            dw += dy * xhat
        if NEED_DB:
            db += dy
        return dw, db

    @triton.jit
    def store_partials(DW_PART, DB_PART, part, dw, db, mask,
                        NEED_DW: tl.constexpr, NEED_DB: tl.constexpr, SUM_ROWS: tl.constexpr):
        # this program's dweight/dbias partials at offsets part (SUM_ROWS: sum a tile's rows first)
        if NEED_DW:
            tl.store(DW_PART + part, tl.sum(dw, axis=0) if SUM_ROWS else dw, mask=mask)
        if NEED_DB:
            tl.store(DB_PART + part, tl.sum(db, axis=0) if SUM_ROWS else db, mask=mask)
