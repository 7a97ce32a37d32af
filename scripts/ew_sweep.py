"""Tile sweep of the elementwise activation kernels (fwd and bwd) at [16384, 16384] bf16 on CUDA:
monkeypatches the tiling and prints device ms (CUDA events). Backs BENCHMARKS.md (issue 9)."""
import itertools
import torch, triton
from _timing import inputs, ms
from fusible_ops.kernels import activation as A
from fusible_ops.kernels.launch import clear_geometry_caches
dev = "cuda"
x, dy, b, _, y = inputs()
seed = torch.tensor([7], device=dev)
print("copy", ms(lambda: y.copy_(x)))
orig = A.elementwise_config
for tile, maxc, warps in itertools.product((4096, 8192, 16384), (512, 1024, 2048, 4096), (4, 8, 16)):
    if maxc > tile or tile // warps > 2048 or tile // warps < 128:
        continue
    def cfg(n_rows, n_cols, tile=tile, maxc=maxc, warps=warps):
        bc = max(4, min(triton.next_power_of_2(max(n_cols, 1)), maxc))
        br = max(1, min(triton.next_power_of_2(max(n_rows, 1)), tile // bc))
        return br, bc, warps
    A.elementwise_config = cfg
    clear_geometry_caches()
    t1 = ms(lambda: A.bias_act_fwd(x, b, "gelu"))
    t2 = ms(lambda: A.bias_act_fwd(x, None, "gelu", dropout_p=0.1, seed=seed))
    t3 = ms(lambda: A.bias_act_fwd(x, None, "relu"))
    print(f"fwd tile {tile} maxc {maxc} warps {warps}: gelu+bias {t1:.3f} gelu+drop {t2:.3f} relu {t3:.3f}")
A.elementwise_config = orig
for tile, maxc, pps in itertools.product((2048, 4096, 8192), (256, 512, 1024), (4, 8, 16, 24)):
    if maxc > tile:
        continue
    A._BWD_TILE, A._BWD_MAX_BLOCK_C, A._PROGS_PER_SM = tile, maxc, pps
    clear_geometry_caches()
    t1 = ms(lambda: A.bias_act_bwd(dy, x, b, "gelu", True))
    t2 = ms(lambda: A.bias_act_bwd(dy, x, None, "gelu", False, dropout_p=0.1, seed=seed))
    print(f"bwd tile {tile} maxc {maxc} pps {pps}: gelu+dbias {t1:.3f} gelu+drop {t2:.3f}")
