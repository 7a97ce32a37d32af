"""Host us per call of each layer of residual + RMSNorm (CUDA, bf16): plain PyTorch, a C++
autograd node, a bare Python autograd Function, the floor (one Function issuing our two
launchers), the fuser's autograd function on its cached plan, the fuser, ``Sequential``, and the
launchers, kernel API and fused op alone. Each call is synced before it, the process pinned to one
core; two orders: every call in turns (60 rounds), then each call alone (80 in a row). Medians.

    PYTHONPATH=. python3 scripts/host_norm_layers.py [ROWS]      # default 16384 rows of 16384
"""
import os
import sys
import time

import torch

import fusible_ops as fo
from fusible_ops.fuser import _RAW_APPLY
from fusible_ops.kernels import norm as N
from fusible_ops.op import OperationContext
from host_floor_bench import Rms as Floor  # (our two launchers in one bare Function; scripts/ is on sys.path)


class Identity(torch.autograd.Function):
    """A Python autograd Function that does nothing: its own cost."""

    @staticmethod
    def forward(ctx, x, r, w):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return dy, dy, None


def _calls(rows: int, n: int = 16384) -> dict:
    kw = dict(device="cuda", dtype=torch.bfloat16)
    x, r = torch.randn(rows, n, **kw).requires_grad_(), torch.randn(rows, n, **kw).requires_grad_()
    dy = torch.randn(rows, n, **kw)
    seq = fo.Sequential(fo.AddExtraInput(), fo.RMSNorm(n, **kw))
    w = seq[1].weight
    norm = torch.nn.RMSNorm(n, eps=1e-5, **kw)
    seq(x, r).backward(dy)
    fuser = seq._only
    plan = fuser._plans[fuser.last_key]
    fused = plan.forward[0].op
    xs, rs, wd = x.detach(), r.detach(), w.detach()
    _, _, rstd, xsum = N._norm_fwd_launch(xs, wd, None, 1e-5, rs, True)

    def ctxs():
        return [OperationContext(True, True, True), OperationContext(True, True, True)]

    return {
        "plain fwd+bwd": lambda: norm(x + r).backward(dy),
        "plain fwd": lambda: norm(x + r),
        "C++ node fwd+bwd": lambda: x.view_as(x).backward(dy),
        "bare Function fwd+bwd": lambda: Identity.apply(x, r, w).backward(dy),
        "floor fwd+bwd": lambda: Floor.apply(x, r, w).backward(dy),
        "floor fwd": lambda: Floor.apply(x, r, w),
        "fuser Function fwd+bwd": lambda: _RAW_APPLY(x, fuser, plan, 1, r, w)[0].backward(dy),
        "fuser Function fwd": lambda: _RAW_APPLY(x, fuser, plan, 1, r, w),
        "fuser fwd+bwd": lambda: fuser(x, r).backward(dy),
        "Sequential fwd+bwd": lambda: seq(x, r).backward(dy),
        "Sequential fwd": lambda: seq(x, r),
        "_norm_fwd_launch": lambda: N._norm_fwd_launch(xs, wd, None, 1e-5, rs, True),
        "rmsnorm_fwd (kernel API)": lambda: N.rmsnorm_fwd(xs, wd, 1e-5, rs),
        "fused op fuser_forward": lambda: fused.fuser_forward(ctxs(), xs, extra_inputs=[(rs,), ()],
                                                              basic_op_kwargs=plan.op_kwargs),
        "_norm_bwd_launch": lambda: N._norm_bwd_launch(dy, xsum, wd, rstd, rstd, True, False, None, True),
        "rmsnorm_bwd (kernel API)": lambda: N.rmsnorm_bwd(dy, xsum, wd, rstd, True),
        "empty_like": lambda: torch.empty_like(xs),
        "new_empty(rows, fp32)": lambda: xs.new_empty(rows, dtype=torch.float32),
        "x + r (no grad)": lambda: xs + rs,
    }


def _one(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - t0) / 1e3


def _show(res: dict, order: str) -> None:
    print(f"--- {order}: host us per call, median [p20, p80]")
    for name, ts in res.items():
        ts.sort()
        print(f"{name:26s} {ts[len(ts) // 2]:7.1f} [{ts[len(ts) // 5]:.1f}, {ts[4 * len(ts) // 5]:.1f}]")


def main() -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    calls = _calls(int(sys.argv[1]) if len(sys.argv) > 1 else 16384)
    for fn in calls.values():
        for _ in range(5):
            fn()
    turns = {k: [] for k in calls}
    for _ in range(60):
        for k, fn in calls.items():
            turns[k].append(_one(fn))
    _show(turns, "in turns")
    _show({k: [_one(fn) for _ in range(80)] for k, fn in calls.items()}, "alone")


if __name__ == "__main__":
    main()
