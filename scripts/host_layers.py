"""Host cost of each layer of a call (CUDA): no_grad forwards of SwiGLU and residual + RMSNorm
on small shapes (so the GPU never limits), from the bare launcher up to ``Sequential``, with
plain PyTorch beside them. Minimum over 7 runs of 300 calls after warm-up (host noise only
adds time), process pinned to one core.

    PYTHONPATH=. python3 scripts/host_layers.py
"""
import os
import time

import torch
import torch.nn.functional as F

import fusible_ops as fo
from fusible_ops.kernels import activation as A
from fusible_ops.kernels import norm as N
from fusible_ops.op import OperationContext


def _us(fn, n: int = 300) -> float:
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return min(runs)


def main() -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    kw = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(256, 1024, **kw)
    sw = fo.Sequential(fo.SwiGLU())
    r1, r2 = torch.randn(8, 16384, **kw), torch.randn(8, 16384, **kw)
    rn = fo.Sequential(fo.AddExtraInput(), fo.RMSNorm(16384, **kw))
    w = rn[1].weight
    with torch.no_grad():
        sw(x), rn(r1, r2)
        op = sw._only.ops[0]

        def swiglu(t):
            a, b = t.chunk(2, dim=-1)
            return F.silu(a) * b
        rows = [
            ("swiglu: plain F.silu(a) * b", lambda: swiglu(x)),
            ("swiglu: launcher (_act_fwd_launch)", lambda: A._act_fwd_launch(x, None, None, "swiglu", 0.0, None)),
            ("swiglu: + kernel API (bias_act_fwd)", lambda: A.bias_act_fwd(x, None, "swiglu")),
            ("swiglu: + op (op_forward)", lambda: op.op_forward(OperationContext(), x)),
            ("swiglu: + fuser", lambda: sw._only(x)),
            ("swiglu: + Sequential", lambda: sw(x)),
            ("rmsnorm: plain F.rms_norm(x + r)", lambda: F.rms_norm(r1 + r2, (16384,), w, 1e-5)),
            ("rmsnorm: launcher (_norm_fwd_launch)", lambda: N._norm_fwd_launch(r1, w, None, 1e-5, r2, True)),
            ("rmsnorm: + kernel API (rmsnorm_fwd)", lambda: N.rmsnorm_fwd(r1, w, 1e-5, r2)),
            ("rmsnorm: + fuser and op", lambda: rn._only(r1, r2)),
            ("rmsnorm: + Sequential", lambda: rn(r1, r2)),
        ]
        for name, fn in rows:
            print(f"{name:42s} {_us(fn):7.2f} us", flush=True)


if __name__ == "__main__":
    main()
