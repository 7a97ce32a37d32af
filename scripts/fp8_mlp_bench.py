"""FP8 MLP block vs our bf16 (issue 11): ``Linear -> GELU -> Linear`` and ``Linear -> SwiGLU -> Linear``
at T=16384, H=4096, F=16384, forward + backward, per recipe, same run. Also the ceilings measured in
this run: the block's six GEMMs alone in bf16 (``torch.mm``) and in per-tensor FP8
(``torch._scaled_mm``), and the cast kernels against a copy of the same tensor (device time, calls
queued behind a GPU spin: a ~0.1 ms kernel timed alone would include its launch).

Run on the GPU: ``python scripts/fp8_mlp_bench.py [--t 16384 --h 4096 --f 16384]``. Prints a
markdown table (median ms of CUDA events after warm-up).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _timing import ms, queued_ms  # noqa: E402

import fusible_ops as fo  # noqa: E402
from fusible_ops.kernels import fp8_cast as C  # noqa: E402

RECIPES = {"current": fo.Float8CurrentScaling(), "delayed": fo.Float8DelayedScaling(),
           "block": fo.Float8BlockScaling()}


def block(kind, h, f):
    dt = dict(device="cuda", dtype=torch.bfloat16)
    if kind == "gelu":
        return fo.Sequential(fo.Linear(h, f, **dt), fo.GELU(), fo.Linear(f, h, **dt))
    return fo.Sequential(fo.Linear(h, 2 * f, **dt), fo.SwiGLU(), fo.Linear(f, h, **dt))


def step_fn(seq, x, dy, recipe):
    def run():
        with fo.autocast(recipe=recipe):
            y = seq(x)
        y.backward(dy)
    return run


def gemm_ceiling(t, h, f):
    """Six GEMMs of the GELU block (fprop, dgrad, wgrad of both linears) in bf16 and FP8."""
    bf = dict(device="cuda", dtype=torch.bfloat16)
    shapes = [(t, h, f), (t, f, h), (f, t, h), (t, f, h), (t, h, f), (h, t, f)]  # (M, K, N)
    a16 = [torch.randn(m, k, **bf) for m, k, n in shapes]
    b16 = [torch.randn(n, k, **bf) for m, k, n in shapes]
    a8 = [a.to(torch.float8_e4m3fn) for a in a16]
    b8 = [b.to(torch.float8_e4m3fn) for b in b16]
    one = torch.ones((), device="cuda")
    bf_ms = ms(lambda: [a @ b.t() for a, b in zip(a16, b16)], n=10)
    f8_ms = ms(lambda: [torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
                        for a, b in zip(a8, b8)], n=10)
    return bf_ms, f8_ms


def cast_bandwidth(t, h):
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    scale = torch.ones(1, device="cuda")
    copy = queued_ms(lambda: x.clone())
    rows = []
    for name, fn in [("per-tensor cast", lambda: C.cast_tensor(x, scale, torch.float8_e4m3fn)),
                     ("per-tensor cast + transpose", lambda: C.cast_tensor(x, scale, torch.float8_e4m3fn, True)),
                     ("1x128 cast", lambda: C.cast_block(x, False)),
                     ("1x128 cast + transpose", lambda: C.cast_block(x, False, transposed=True)),
                     ("128x128 cast", lambda: C.cast_block(x, True)),
                     ("128x128 cast + transpose", lambda: C.cast_block(x, True, transposed=True))]:
        t_ms = queued_ms(fn)
        out_bytes = x.numel() * (2 if "transpose" in name else 1)
        moved = x.numel() * 2 + out_bytes
        rows.append((name, t_ms, moved / t_ms / 1e6, (2 * x.numel() * 2) / copy / 1e6))
    return copy, rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--t", type=int, default=16384)
    p.add_argument("--h", type=int, default=4096)
    p.add_argument("--f", type=int, default=16384)
    a = p.parse_args()
    torch.manual_seed(0)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, T={a.t} H={a.h} F={a.f} bf16")
    print("\n| block | bf16 ms | " + " | ".join(f"{r} ms (speedup)" for r in RECIPES) + " |")
    print("|---|---:|" + "---:|" * len(RECIPES))
    for kind in ("gelu", "swiglu"):
        seq = block(kind, a.h, a.f)
        x = torch.randn(a.t, a.h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(a.t, a.h, device="cuda", dtype=torch.bfloat16)
        base = ms(step_fn(seq, x, dy, None), n=10)
        cells = []
        for name, recipe in RECIPES.items():
            try:
                t = ms(step_fn(seq, x, dy, recipe), n=10)
                cells.append(f"{t:.2f} ({base / t:.2f}x)")
            except Exception as e:  # report, do not hide: a recipe the installed torch cannot run
                cells.append(f"error: {type(e).__name__}: {str(e)[:80]}")
        print(f"| Linear -> {kind.upper()} -> Linear | {base:.2f} | " + " | ".join(cells) + " |")
        del seq, x, dy
        torch.cuda.empty_cache()
    bf_ms, f8_ms = gemm_ceiling(a.t, a.h, a.f)
    print(f"\nceiling, the GELU block's six GEMMs alone: bf16 {bf_ms:.2f} ms, per-tensor FP8 _scaled_mm {f8_ms:.2f} ms "
          f"({bf_ms / f8_ms:.2f}x)")
    copy, rows = cast_bandwidth(a.t, a.h)
    print(f"\ncast kernels on [{a.t}, {a.h}] bf16 (copy {copy:.3f} ms):\n\n| kernel | ms | GB/s | % of copy GB/s |\n|---|---:|---:|---:|")
    for name, t_ms, gbs, copy_gbs in rows:
        print(f"| {name} | {t_ms:.3f} | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% |")


if __name__ == "__main__":
    main()
