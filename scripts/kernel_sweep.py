"""Fwd / bwd device time of the elementwise and norm kernels at [16384, 16384] bf16 vs a copy of
the same bytes (CUDA events, median of 20 after warm-up)."""
import torch
from _timing import inputs, ms
from fusible_ops.kernels import activation as A, norm as N, dropout as D
dev = "cuda"
x, dy, b, w, y = inputs()
copy = ms(lambda: y.copy_(x))
gbs = 2 * x.numel() * 2 / copy / 1e6
print(f"copy {copy:.3f} ms = {gbs:.0f} GB/s")
E = x.numel() * 2
def rep(name, t, nbytes):
    print(f"{name:34s} {t:.3f} ms  {nbytes / t / 1e6:6.0f} GB/s  {100 * nbytes / t / 1e6 / gbs:5.1f}% of copy")
seed = torch.tensor([1234], device=dev)
for kind in ("relu", "silu", "gelu_tanh", "gelu"):
    rep(f"bias+{kind} fwd", ms(lambda: A.bias_act_fwd(x, b, kind)), 2 * E)
    rep(f"bias+{kind} bwd (dbias)", ms(lambda: A.bias_act_bwd(dy, x, b, kind, True)), 3 * E)
rep("gelu+dropout fwd", ms(lambda: A.bias_act_fwd(x, None, "gelu", dropout_p=0.1, seed=seed)), 2 * E)
rep("gelu+dropout bwd", ms(lambda: A.bias_act_bwd(dy, x, None, "gelu", False, dropout_p=0.1, seed=seed)), 3 * E)
rep("bias+gelu+dropout bwd (dbias)", ms(lambda: A.bias_act_bwd(dy, x, b, "gelu", True, dropout_p=0.1, seed=seed)), 3 * E)
rep("relu+dropout fwd", ms(lambda: A.bias_act_fwd(x, None, "relu", dropout_p=0.1, seed=seed)), 2 * E)
rep("dropout fwd", ms(lambda: D.dropout_fwd(x, 0.1, seed)), 2 * E)
yy, mean, rstd, _ = N.layernorm_fwd(x, w, b, 1e-5)
rep("layernorm fwd", ms(lambda: N.layernorm_fwd(x, w, b, 1e-5)), 2 * E)
rep("layernorm bwd (dw, db)", ms(lambda: N.layernorm_bwd(dy, x, w, mean, rstd, True, True)), 3 * E)
rep("layernorm bwd (no dw/db)", ms(lambda: N.layernorm_bwd(dy, x, w, mean, rstd, False, False)), 3 * E)
yr, rs, _ = N.rmsnorm_fwd(x, w, 1e-5)
rep("rmsnorm fwd", ms(lambda: N.rmsnorm_fwd(x, w, 1e-5)), 2 * E)
rep("rmsnorm bwd (dw)", ms(lambda: N.rmsnorm_bwd(dy, x, w, rs, True)), 3 * E)
