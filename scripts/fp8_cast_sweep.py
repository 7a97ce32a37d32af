"""Launch-config sweep of the FP8 cast kernels on [16384, 4096] bf16, against a copy of the same
tensor (GB/s counts bytes read + written; device time, calls queued: ``_timing.queued_ms``). Run on
the GPU: ``PYTHONPATH=. python scripts/fp8_cast_sweep.py``."""
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _timing import queued_ms as ms  # noqa: E402

from fusible_ops.kernels import fp8_cast as C  # noqa: E402

x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
scale = torch.ones(1, device="cuda")
amax = torch.zeros(1, device="cuda")
copy = ms(lambda: x.clone())
copy_gbs = 4 * x.numel() / copy / 1e6
print(f"copy {copy:.4f} ms, {copy_gbs:.0f} GB/s")


def report(name, cfg, fn, out_per_elem):
    try:
        t = ms(fn)
    except Exception as e:  # a config that does not compile (registers, shared memory)
        print(f"{name} {cfg}: {type(e).__name__}")
        return
    gbs = x.numel() * (2 + out_per_elem) / t / 1e6
    print(f"{name} {cfg}: {t:.4f} ms {gbs:.0f} GB/s {100 * gbs / copy_gbs:.0f}%")


for tr in (False, True):
    for bm, bn, w in itertools.product((32, 64), (128, 256), (4, 8)):
        C.TENSOR_CFG[tr] = (bm, bn, w)
        report(f"tensor T={tr}", (bm, bn, w), lambda: C.cast_tensor(x, scale, torch.float8_e4m3fn, tr, amax),
               2 if tr else 1)
for sq, tr in itertools.product((False, True), (False, True)):
    if not (sq or tr):
        cands = [(bm, w) for bm in (16, 32, 64, 128) for w in (4, 8, 16)]
    else:
        cands = [(128, w) for w in (4, 8, 16)]
    for cfg in cands:
        C.BLOCK_CFG[sq, tr] = cfg
        report(f"block sq={sq} T={tr}", cfg, lambda: C.cast_block(x, sq, False, tr), 2 if tr else 1)
