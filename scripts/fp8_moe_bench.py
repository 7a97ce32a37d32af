"""FP8 grouped MLP vs bf16 (issue 12): ``GroupedLinear -> SwiGLU -> GroupedLinear``, forward +
backward, same run. Variants: ours FP8 per recipe (per-tensor: the fused GLU-epilogue MLP, and with current scaling
also the rule disabled: FP8 grouped GEMMs with the GLU as its own kernel), ours bf16 (the fused GLU-epilogue
grouped MLP), the ``torch._grouped_mm`` bf16 composition eager and under ``torch.compile``; ours
also graph-replayed (``fo.make_graphed_callables``). Then each grouped GEMM on its own (FC1 of
the first shape: forward, input gradient, weight gradient into fp32 main_grad), ours FP8 vs ours
bf16 vs ``torch._scaled_grouped_mm`` (FP8 rowwise, forward) where the installed torch has it, and
the dense FP8 ceiling measured here (``torch._scaled_mm`` at 8192^3).

Run on the GPU: ``PYTHONPATH=. python scripts/fp8_moe_bench.py [--quick]``. Prints markdown
tables (median ms of CUDA events after warm-up; TFLOP/s = 3 x forward FLOPs / time).
"""
import argparse
import contextlib
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from _timing import ms  # noqa: E402

import fusible_ops as fo  # noqa: E402
from fusible_ops.bench.cases import routing_splits  # noqa: E402
from fusible_ops.kernels import fp8_grouped_gemm as FG  # noqa: E402
from fusible_ops.kernels import grouped_gemm as GG  # noqa: E402
from fusible_ops.quantization.casting import cached_weight, quantize  # noqa: E402

BF = dict(device="cuda", dtype=torch.bfloat16)
RECIPES = {"fp8 current": fo.Float8CurrentScaling(), "fp8 delayed": fo.Float8DelayedScaling(),
           "fp8 block": fo.Float8BlockScaling()}
SHAPES = [(8, 16384, 4096, 7168), (64, 16384, 2048, 1408)]


def mlp(E, H, Fd):
    seq = fo.Sequential(fo.GroupedLinear(E, H, 2 * Fd, bias=False, **BF), fo.SwiGLU(),
                        fo.GroupedLinear(E, Fd, H, bias=False, **BF))
    with torch.no_grad():
        seq[0].weight.normal_(0, H ** -0.5)
        seq[2].weight.normal_(0, Fd ** -0.5)
    return seq


def _rules(fused):
    """The fused grouped MLP rule on, or off (the GLU then runs as its own kernel)."""
    return contextlib.nullcontext() if fused else fo.fusion_rules.disabled("grouped_mlp")


def eager_step(seq, x, dy, splits, recipe, fused=True):
    def run():
        with fo.autocast(recipe=recipe), _rules(fused):
            y = seq(x, splits, splits)
        y.backward(dy)
    return run


def graphed_step(E, H, Fd, x, dy, splits, recipe, fused=True):
    seq = mlp(E, H, Fd)
    with fo.autocast(recipe=recipe), _rules(fused):
        g = fo.make_graphed_callables(seq, (x, splits, splits))

    def run():
        g(x, splits, splits).backward(dy)
    return run


def grouped_mm_step(w1, w2, x, dy, offs, compiled):
    def f(x):
        h = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
        a, b = h.chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(a) * b, w2.transpose(-2, -1), offs=offs)
    fn = torch.compile(f) if compiled else f

    def run():
        fn(x).backward(dy)
    return run


def mlp_table(quick):
    print("\n| experts, routing | variant | eager ms | TFLOP/s | graph-replayed ms | vs our bf16 (eager / graphed) |")
    print("|---|---|---:|---:|---:|---:|")
    for E, T, H, Fd in SHAPES:
        flops = 3 * (2 * T * H * 2 * Fd + 2 * T * Fd * H)
        for routing in ("uniform",) if quick else ("uniform", "skewed"):
            splits = torch.tensor(routing_splits(E, T, routing), device="cuda")
            offs = torch.cumsum(splits, 0).to(torch.int32)
            x = torch.randn(T, H, **BF, requires_grad=True)
            dy = torch.randn(T, H, **BF)
            seq = mlp(E, H, Fd)
            rows = {}
            variants = [("ours bf16", None, True), *[(n, r, True) for n, r in RECIPES.items()],
                        ("fp8 current, GLU unfused", RECIPES["fp8 current"], False)]
            for name, recipe, fused in variants:
                t = ms(eager_step(seq, x, dy, splits, recipe, fused), n=10)
                try:
                    tg = ms(graphed_step(E, H, Fd, x, dy, splits, recipe, fused), n=10)
                except Exception as e:  # report, do not hide
                    print(f"<!-- graph {name}: {type(e).__name__}: {e} -->")
                    tg = float("nan")
                rows[name] = (t, tg)
            w1 = seq[0].weight.detach().requires_grad_()
            w2 = seq[2].weight.detach().requires_grad_()
            for name, comp in (("torch._grouped_mm eager", False), ("torch._grouped_mm compiled", True)):
                try:
                    rows[name] = (ms(grouped_mm_step(w1, w2, x, dy, offs, comp), n=10), float("nan"))
                except Exception as e:
                    print(f"<!-- {name}: {type(e).__name__}: {str(e)[:200]} -->")
            base, base_g = rows["ours bf16"]
            for name, (t, tg) in rows.items():
                print(f"| {E}, {routing} | {name} | {t:.2f} | {flops / t / 1e9:.0f} | {tg:.2f} | "
                      f"{base / t:.2f}x / {base_g / tg:.2f}x |")
            del seq, x, dy, w1, w2
            torch.cuda.empty_cache()


def gemm_table():
    E, T, H, Fd = SHAPES[0]
    N = 2 * Fd
    splits = torch.tensor(routing_splits(E, T, "uniform"), device="cuda")
    x = torch.randn(T, H, **BF)
    dy = torch.randn(T, N, **BF)
    w = torch.randn(E, N, H, **BF) * H ** -0.5
    main = torch.zeros(E, N, H, device="cuda")
    r = fo.Float8CurrentScaling()
    xq = quantize(x, r, "input", transposed=True)
    dyq = quantize(dy, r, "grad_output", transposed=True)
    wq = quantize(w.reshape(E * N, H), r, "weight")
    w8 = (wq.rowwise[0].view(E, N, H), wq.rowwise[1])
    w8t = (w8[0].view(torch.uint8).transpose(1, 2).contiguous().view(w8[0].dtype), w8[1])
    fl = 2 * T * H * N
    rows = [
        ("forward", "ours fp8", lambda: FG.fp8_grouped_mm(xq.rowwise, w8, splits, torch.bfloat16)),
        ("forward", "ours bf16", lambda: GG.grouped_gemm_fwd(x, w, splits)),
        ("dgrad", "ours fp8", lambda: FG.fp8_grouped_mm(dyq.rowwise, w8t, splits, torch.bfloat16)),
        ("dgrad", "ours bf16", lambda: GG.grouped_gemm_dgrad(dy, w, splits)),
        ("wgrad (+= fp32)", "ours fp8", lambda: FG.fp8_grouped_wgrad(dyq.colwise, xq.colwise, splits, out=main,
                                                                    accumulate=True)),
        ("wgrad (+= fp32)", "ours bf16", lambda: GG.grouped_gemm_wgrad(dy, x, splits, out=main, accumulate=True)),
    ]
    rb = fo.Float8BlockScaling()  # 1x128 / 128x128 scales; weight-gradient operands cast after pad_groups
    xb, dyb = quantize(x, rb, "input"), quantize(dy, rb, "grad_output")
    wb = cached_weight(torch.nn.Module(), w, rb, transposed=True, grouped=True)
    xbt = quantize(FG.pad_groups(x, splits), rb, "input", transposed=True).colwise
    dybt = quantize(FG.pad_groups(dy, splits), rb, "grad_output", transposed=True).colwise
    rows += [
        ("forward", "ours fp8 block", lambda: FG.fp8_grouped_mm(xb.rowwise, wb.rowwise, splits, torch.bfloat16)),
        ("dgrad", "ours fp8 block", lambda: FG.fp8_grouped_mm(dyb.rowwise, wb.colwise, splits, torch.bfloat16)),
        ("wgrad (+= fp32)", "ours fp8 block", lambda: FG.fp8_grouped_wgrad(dybt, xbt, splits, out=main,
                                                                          accumulate=True)),
    ]
    if hasattr(torch, "_scaled_grouped_mm"):
        offs = torch.cumsum(splits, 0).to(torch.int32)
        sa = torch.ones(T, device="cuda")
        sb = torch.ones(E, N, device="cuda")
        b = w8[0].transpose(1, 2)  # [E, H, N], column-major per group

        def scaled():
            return torch._scaled_grouped_mm(xq.rowwise[0], b, sa, sb, offs=offs, out_dtype=torch.bfloat16)
        rows.append(("forward", "torch._scaled_grouped_mm (rowwise)", scaled))
    a8 = torch.randn(8192, 8192, **BF).to(torch.float8_e4m3fn)
    b8 = torch.randn(8192, 8192, **BF).to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    ceil_ms = ms(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    ceiling = 2 * 8192 ** 3 / ceil_ms / 1e9
    print(f"\ndense FP8 ceiling (torch._scaled_mm 8192^3, per-tensor): {ceiling:.0f} TFLOP/s")
    print(f"\nFC1 of E={E} T={T} H={H} F={Fd} (uniform), each GEMM alone:\n")
    print("| GEMM | variant | ms | TFLOP/s | % of dense FP8 ceiling |\n|---|---|---:|---:|---:|")
    for gemm, name, fn in rows:
        try:
            t = ms(fn)
            print(f"| {gemm} | {name} | {t:.3f} | {fl / t / 1e9:.0f} | {100 * fl / t / 1e9 / ceiling:.0f}% |")
        except Exception as e:
            print(f"| {gemm} | {name} | error: {type(e).__name__}: {str(e)[:100]} | | |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="uniform routing only")
    p.add_argument("--gemms-only", action="store_true")
    a = p.parse_args()
    torch.manual_seed(0)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16 model")
    gemm_table()
    if not a.gemms_only:
        mlp_table(a.quick)


if __name__ == "__main__":
    main()
