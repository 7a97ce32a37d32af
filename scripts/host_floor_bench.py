"""Host-time floor of the design (CUDA): per ``host_overhead`` workload, one custom
``autograd.Function`` that issues exactly our kernels (no Sequential, fuser, op layer or
validation), timed in turns with ours and with plain PyTorch, the process pinned to one CPU core.

``ours / floor`` is what the framework's Python costs; ``floor / plain`` what a Python-issued
custom Function with our launchers costs against plain PyTorch's C++ autograd.

    PYTHONPATH=. python3 scripts/host_floor_bench.py
"""
import os

import torch
import torch.nn.functional as F

from fusible_ops.bench.host import _workloads, host_times_interleaved
from fusible_ops.kernels import activation as A
from fusible_ops.kernels import norm as N

class Dense3(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2):
        z = F.linear(x, w1)
        h = A._act_fwd_launch(z, b1, None, "gelu", 0.0, None)
        y = F.linear(h, w2, b2)
        ctx.save_for_backward(x, z, h, w1, w2, b1)
        return y
    @staticmethod
    def backward(ctx, dy):
        x, z, h, w1, w2, b1 = ctx.saved_tensors
        db2 = dy.sum(0)
        dh = torch.mm(dy, w2)
        dw2 = torch.mm(dy.t(), h)
        dz, db1, _ = A._act_bwd_launch(dh, z, b1, None, "gelu", True, False, 0.0, None)
        return torch.mm(dz, w1), torch.mm(dz.t(), x), db1, dw2, db2
class Swi(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return A._act_fwd_launch(x, None, None, "swiglu", 0.0, None)
    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return A._act_bwd_launch(dy, x, None, None, "swiglu", False, False, 0.0, None)[0]
class Rms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, r, w):
        y, _, rstd, xsum = N._norm_fwd_launch(x, w, None, 1e-5, r, True)
        ctx.save_for_backward(xsum, w, rstd)
        return y
    @staticmethod
    def backward(ctx, dy):
        xsum, w, rstd = ctx.saved_tensors
        dx, dw, _ = N._norm_bwd_launch(dy, xsum, w, rstd, rstd, True, False, None, True)
        return dx, dx, dw
def main() -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    dev = torch.device("cuda")
    torch.manual_seed(0)
    for name, shape, ours, oargs, peer, pargs, dy, _ in _workloads(dev, torch.bfloat16, False):
        floor = _floor(name, ours, oargs, dy)
        if floor is None:
            continue
        calls = [lambda: ours(*oargs).backward(dy), lambda: peer(*pargs).backward(dy), floor]
        for _ in range(2):
            o, p, f = host_times_interleaved(calls, dev, 20, 200)
            print(f"{name} {shape}: ours {o[0]:.0f} [{o[1]:.0f}, {o[2]:.0f}]  plain {p[0]:.0f} [{p[1]:.0f}, "
                  f"{p[2]:.0f}]  floor {f[0]:.0f} [{f[1]:.0f}, {f[2]:.0f}] us;  ours/plain {o[0] / p[0]:.2f}x  "
                  f"floor/plain {f[0] / p[0]:.2f}x  ours/floor {o[0] / f[0]:.2f}x", flush=True)


def _floor(name, ours, oargs, dy):
    """fwd+bwd of the workload's floor Function, or None (no floor for this workload)."""
    if name == "dense3":
        l1, l2 = ours[0], ours[2]
        return lambda: Dense3.apply(oargs[0], l1.weight, l1.bias, l2.weight, l2.bias).backward(dy)
    if name == "swiglu":
        return lambda: Swi.apply(oargs[0]).backward(dy)
    if name == "residual_rmsnorm":
        w = ours[1].weight
        return lambda: Rms.apply(oargs[0], oargs[1], w).backward(dy)
    return None


if __name__ == "__main__":
    main()
