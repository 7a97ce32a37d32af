"""Why the dropout mask takes 16-bit decisions (BENCHMARKS.md, "Dropout: 8 keep decisions per Philox call").

A copy kernel (optionally with exact GELU) times four masks at [16384, 16384] bf16, p = 0.1: MODE 0
the contract before 2026-11-26 (tl.rand4x, one 32-bit uniform per element, float compare), 1 the
same mask through an integer threshold on the words (no float conversion), 2 the current contract
(8 decisions per Philox call, 16-bit halves), 3 no mask. Usage: python3 scripts/dropout_mask_ab.py
"""
import torch, triton, triton.language as tl, numpy as np
from _timing import ms
from fusible_ops.kernels.dropout import drop_threshold, keep_tile
from fusible_ops.kernels.launch import elementwise_config
from fusible_ops.kernels.act_table import act_and_grad

@triton.jit
def mask_tile(seed, rows, col0, n_cols, p, T32, T16, MODE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    if MODE == 0:  # the contract before 2026-11-26
        c4 = (n_cols + 3) // 4
        q = col0 // 4 + tl.arange(0, BLOCK_C // 4)
        cnt = rows.to(tl.int32)[:, None] * c4 + q[None, :]
        u0, u1, u2, u3 = tl.rand4x(seed, cnt)
        u = tl.reshape(tl.join(tl.join(u0, u2), tl.join(u1, u3)), (BLOCK_R, BLOCK_C))
        return u >= p
    elif MODE == 1:  # integer threshold, same mask
        c4 = (n_cols + 3) // 4
        q = col0 // 4 + tl.arange(0, BLOCK_C // 4)
        cnt = rows.to(tl.int32)[:, None] * c4 + q[None, :]
        w0, w1, w2, w3 = tl.randint4x(seed, cnt)
        w = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (BLOCK_R, BLOCK_C)).to(tl.int32, bitcast=True)
        w = w ^ (w >> 31)
        return w >= T32
    elif MODE == 2:  # the current contract
        return keep_tile(seed, rows, col0, n_cols, T16, BLOCK_R, BLOCK_C, False)
    else:
        return tl.full((BLOCK_R, BLOCK_C), 1, tl.int1)

@triton.jit
def k_drop(X, Y, n_rows, n_cols, p, T32, T16, scale, SEED, MODE: tl.constexpr, ACT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    col0 = tl.program_id(1) * BLOCK_C
    cols = col0 + tl.arange(0, BLOCK_C)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * n_cols + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if ACT >= 0:
        x, _ = act_and_grad(x, ACT)
    keep = mask_tile(tl.load(SEED), rows, col0, n_cols, p, T32, T16, MODE, BLOCK_R, BLOCK_C)
    y = x * tl.where(keep, scale, 0.0)
    tl.store(Y + rows64[:, None] * n_cols + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)

def t32_for(p):
    # least x' in [0, 2**31) with fl(fl(x') * scale) >= p (float32)
    s = np.float32(4.6566127342e-10); p = np.float32(p)
    lo, hi = 0, 2**31
    while lo < hi:
        mid = (lo + hi) // 2
        if np.float32(np.float32(mid) * s) >= p: hi = mid
        else: lo = mid + 1
    return lo

def run(mode, act, x, y, seed, p, cfg):
    R, C = x.shape; br, bc, nw = cfg
    grid = (triton.cdiv(R, br), triton.cdiv(C, bc))
    k_drop[grid](x, y, R, C, p, t32_for(p), float(drop_threshold(p)), 1 / (1 - p), seed, MODE=mode, ACT=act, BLOCK_R=br, BLOCK_C=bc, num_warps=nw)

def bench(fn):
    return ms(fn, 50)

R, C = 16384, 16384
x = torch.randn(R, C, device="cuda", dtype=torch.bfloat16)
y = torch.empty_like(x); seed = torch.tensor([1234], device="cuda", dtype=torch.int64)
p = 0.1
# mask equality: mode 1 == mode 0 on ones
ones = torch.ones(R, C, device="cuda", dtype=torch.float32); y0 = torch.empty_like(ones); y1 = torch.empty_like(ones); y2 = torch.empty_like(ones)
cfg = elementwise_config(R, C)
run(0, -1, ones, y0, seed, p, cfg); run(1, -1, ones, y1, seed, p, cfg); run(2, -1, ones, y2, seed, p, cfg)
print("mode1 == mode0:", torch.equal(y0, y1), " drop rates:", (y0 == 0).float().mean().item(), (y2 == 0).float().mean().item())
del ones, y0, y1, y2
copy = bench(lambda: y.copy_(x))
print(f"copy {copy*1e3:.1f} us; cfg {cfg}")
ACT_GELU = 1  # fusible_ops.kernels.act_table.ACT_IDS["gelu"]
for act in (-1, ACT_GELU):
    for mode in (3, 0, 1, 2):
        for c in (cfg, (8, 512, 8), (4, 1024, 4), (16, 512, 8)):
            t = bench(lambda: run(mode, act, x, y, seed, p, c))
            print(f"act {act:2d} mode {mode} cfg {c}: {t*1e3:7.1f} us  {copy/t*100:5.1f}% of copy")
