"""``python -m fusible_ops.bench host_overhead``: host time per forward + backward call.

Host time = CPU time to issue one call (the device is synchronized before each call, then the
call is timed on the host without waiting for the device). Each workload is timed in turns (one
call of each per round) as ours in eager mode, as the same math in plain ``torch.nn`` modules in
eager mode (the issue's target: ours / that <= 1.2x; for the grouped MLP, which torch.nn has no
module for, the ``torch._grouped_mm`` composition), and as the bare functional form (``F.*`` calls,
no module: the stricter reference), and (CUDA) as ours replayed from a CUDA graph
(:func:`fusible_ops.make_graphed_callables`). Medians over ``--rep`` calls after warm-up, with p20 / p80.

FP8 rows: one Llama MLP block and the ``dense_layers`` stack (L4_d2048 on CUDA, 4 layers of d=128
on CPU), each timed in turns under bf16 and every FP8 recipe (current, delayed, block scaling),
with the kernels one call launches and the Python function calls it makes (the issue's target:
each recipe's host time <= 1.2x bf16's). On CPU the FP8 math is emulated (its time is in the host
time) and launches are the ATen ops and Triton launches the call makes.

Then one training step of a 4-block model (RMSNorm -> Linear -> SwiGLU -> Linear -> residual
add, hidden 1024; CUDA only): device time per step (forward, backward, SGD update; CUDA events)
eager vs graphed.
"""

from __future__ import annotations

import datetime
import os
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

import fusible_ops as fo

from .common import device_name, free_memory, log as _log, pin_to_one_core
from .timing import Timer, percentile


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_times_us(fn: Callable[[], None], device, warmup: int, rep: int) -> tuple[float, float, float]:
    """(median, p20, p80) host microseconds to issue ``fn()``."""
    return host_times_interleaved([fn], device, warmup, rep)[0]


def host_times_interleaved(fns: list, device, warmup: int, rep: int) -> list[tuple[float, float, float]]:
    """(median, p20, p80) host microseconds to issue each of ``fns``, timed in turns (one call
    of each per round, the order rotating) so that every function sees the same machine state:
    the ratios between them do not drift with the host's load."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    n = len(fns)
    for r in range(rep):
        for j in range(n):
            k = (j + r) % n
            _sync(device)
            t0 = time.perf_counter()
            fns[k]()
            times[k].append((time.perf_counter() - t0) * 1e6)
    _sync(device)
    out = []
    for ts in times:
        ts.sort()
        out.append((statistics.median(ts), percentile(ts, 20), percentile(ts, 80)))
    return out


def _fwd_bwd(fn, args, dy):
    def call():
        fn(*args).backward(dy)
    return call


class _SwiGLU(torch.nn.Module):
    """SwiGLU as a user writes it in plain torch.nn: ``silu(a) * b`` of the two halves."""

    def forward(self, x):
        a, b = x.chunk(2, dim=-1)
        return F.silu(a) * b


def _workloads(device, dtype, small: bool):
    """(name, shape, ours, ours_args, torch_fn, torch_args, dy, functional_fn): ``torch_fn`` is
    the plain torch.nn-module form (the target's peer), ``functional_fn`` the bare ``F.*`` form
    of the same math on the same tensors (both take ``torch_args``)."""
    kw = dict(device=device, dtype=dtype)

    def rnd(*s, rg=True):
        return torch.randn(*s, **kw).requires_grad_(rg)

    # 1. dense chain
    seq = fo.Sequential(fo.Linear(256, 256, **kw), fo.GELU(), fo.Linear(256, 256, **kw))
    ref = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256)).to(**kw)
    l1, l2 = ref[0], ref[2]

    def dense3(x):
        return F.linear(F.gelu(F.linear(x, l1.weight, l1.bias)), l2.weight, l2.bias)
    x = rnd(16, 256)
    yield "dense3", "[16, 256]", seq, (x,), ref, (x,), torch.randn(16, 256, **kw), dense3
    # (each workload's modules and tensors die before the next one is timed; names the yielded
    # functions read stay: deleting a closure's variable breaks it for a caller that keeps them all)
    del seq, ref, x
    # 2. SwiGLU
    M, N = (64, 512) if small else (16384, 16384)
    sw = fo.Sequential(fo.SwiGLU())

    def swiglu(x):
        a, b = x.chunk(2, dim=-1)
        return F.silu(a) * b
    x = rnd(M, N)
    yield "swiglu", f"[{M}, {N}]", sw, (x,), _SwiGLU(), (x,), torch.randn(M, N // 2, **kw), swiglu
    del sw, x
    # 3. residual + RMSNorm
    M, N = (64, 256) if small else (16384, 16384)
    rn = fo.Sequential(fo.AddExtraInput(), fo.RMSNorm(N, **kw))
    norm = torch.nn.RMSNorm(N, eps=1e-5, **kw)
    w = norm.weight

    def residual_norm(x, r):  # torch.nn: the block's forward adds, its RMSNorm module normalizes
        return norm(x + r)

    def rms(x, r):
        return F.rms_norm(x + r, (N,), w, 1e-5)
    x, r = rnd(M, N), rnd(M, N)
    yield "residual_rmsnorm", f"[{M}, {N}]", rn, (x, r), residual_norm, (x, r), torch.randn(M, N, **kw), rms
    del rn, x, r
    # 4. grouped MLP, 64 experts
    E, T, H, Fd = (64, 256, 64, 32) if small else (64, 16384, 2048, 1408)
    fc1 = fo.GroupedLinear(E, H, 2 * Fd, bias=False, **kw)
    fc2 = fo.GroupedLinear(E, Fd, H, bias=False, **kw)
    moe = fo.Sequential(fc1, fo.SwiGLU(), fc2)
    splits = torch.full((E,), T // E, dtype=torch.int64, device=device)
    offs = torch.cumsum(splits, 0).to(torch.int32)
    w1, w2 = fc1.weight, fc2.weight

    def grouped_mm(x):
        h = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
        a, b = h.chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(a) * b, w2.transpose(-2, -1), offs=offs)

    def loop(x):
        outs = []
        for g, xg in enumerate(torch.split(x, T // E)):
            a, b = F.linear(xg, w1[g]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(a) * b, w2[g]))
        return torch.cat(outs)
    x = rnd(T, H)
    peer = grouped_mm if device.type == "cuda" else loop  # (torch.nn has no grouped module)
    yield (f"grouped_mlp_{E}e", f"T={T} H={H} F={Fd}", moe, (x, splits, splits), peer, (x,),
           torch.randn(T, H, **kw), peer)


class _Blocks(torch.nn.Module):
    """``blocks`` x (RMSNorm -> Linear -> SwiGLU -> Linear -> + residual), one Sequential each."""

    def __init__(self, device, dtype, hidden: int, blocks: int) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.blocks = torch.nn.ModuleList(
            fo.Sequential(fo.RMSNorm(hidden, **kw), fo.Linear(hidden, 8 * hidden, **kw), fo.SwiGLU(),
                          fo.Linear(4 * hidden, hidden, **kw), fo.AddExtraInput())
            for _ in range(blocks))

    def forward(self, x):
        for b in self.blocks:
            x = b(x, x)
        return x


def run(device: torch.device, warmup: int = 20, rep: int = 200) -> list[dict]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    small = device.type != "cuda"
    rows = []
    torch.manual_seed(0)
    for name, shape, ours, ours_args, peer, peer_args, dy, functional in _workloads(device, dtype, small):
        row = {"workload": name, "shape": shape}
        fns = [_fwd_bwd(ours, ours_args, dy), _fwd_bwd(peer, peer_args, dy)]
        if functional is not peer:
            fns.append(_fwd_bwd(functional, peer_args, dy))
        times = host_times_interleaved(fns, device, warmup, rep)
        row["ours_us"], row["torch_us"] = times[0], times[1]
        row["functional_us"] = times[2] if len(times) > 2 else None
        if device.type == "cuda":
            static = tuple(a.detach().clone().requires_grad_(a.requires_grad) if a.is_floating_point() else a
                           for a in ours_args)
            graphed = fo.make_graphed_callables(ours, static)
            row["graphed_us"] = host_times_us(_fwd_bwd(graphed, static, dy), device, warmup, rep)
            del graphed, static  # (the graph and its memory pool go before the next workload)
        rows.append(row)
        del ours, peer, functional, ours_args, peer_args, dy, fns
        free_memory(device)
    from ..kernels.fp8_gemm import fp8_capable
    if device.type != "cuda" or fp8_capable(device):
        rows.extend(_fp8_host(device, warmup, rep, small))
    if device.type == "cuda":
        rows.append(_training_step(device, dtype))
    return rows


FP8_RECIPES = (("bf16", None), ("fp8_current", fo.Float8CurrentScaling()), ("fp8_delayed", fo.Float8DelayedScaling()),
               ("fp8_block", fo.Float8BlockScaling()))


def _fp8_workloads(device, small: bool):
    """(name, shape, step) of the FP8 host rows: one Llama MLP block Sequential (RMSNorm -> Linear
    -> SwiGLU -> Linear -> residual, no biases) and the ``dense_layers`` stack (its L4_d2048
    config on CUDA; 4 layers of d=128 on CPU). ``step(recipe)`` runs one forward + backward."""
    from .cases_model import DenseLayer, Stack

    kw = dict(device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    hidden, ffn, tokens = (128, 256, 128) if small else (2048, 5632, 4096)
    block = fo.Sequential(fo.RMSNorm(hidden, **kw), fo.Linear(hidden, 2 * ffn, bias=False, **kw), fo.SwiGLU(),
                          fo.Linear(ffn, hidden, bias=False, **kw), fo.AddExtraInput(from_input=True))
    x = torch.randn(tokens, hidden, **kw, requires_grad=True)
    dy = torch.randn(tokens, hidden, **kw)
    yield "llama_mlp", f"d={hidden} f={ffn} tokens={tokens}", _recipe_step(block, (x,), dy)
    del block, x, dy
    L, d, heads, f, B, S = (4, 128, 4, 128, 2, 64) if small else (4, 2048, 16, 5632, 2, 2048)
    stack = Stack([DenseLayer(d, heads, f, **kw) for _ in range(L)])
    x = torch.randn(B, S, d, **kw, requires_grad=True)
    dy = torch.randn(B, S, d, **kw)
    yield "dense_layers", f"L={L} d={d} heads={heads} f={f} B={B} S={S}", _recipe_step(stack, (x,), dy)


def _recipe_step(model, args, dy):
    def step(recipe):
        def call():
            with fo.autocast(recipe=recipe):
                y = model(*args)
            y.backward(dy)
        return call
    return step


def launches_per_call(fn, device) -> int:
    """Kernels one call of ``fn`` launches: on CUDA the profiler's device activities, on CPU the
    ATen ops and Triton launches :func:`fusible_ops.testing.count_launches` sees (the reference
    path's ops unless Triton's interpreter runs the kernels)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize(device)
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    from ..testing.launches import count_launches

    with count_launches() as n:
        fn()
    return n.launches


def _fp8_host(device, warmup: int, rep: int, small: bool) -> list[dict]:
    """Per FP8 workload: host us per fwd+bwd call under bf16 and each FP8 recipe (timed in turns;
    the issue's target: each FP8 recipe's host time <= 1.2x bf16's), with the kernels each call
    launches and the Python function calls it makes (counted on one more call each)."""
    from ..testing.launches import count_python_calls

    rows = []
    torch.manual_seed(0)
    for name, shape, step in _fp8_workloads(device, small):
        fns = [step(r) for _, r in FP8_RECIPES]
        times = host_times_interleaved(fns, device, warmup, rep)
        recipes = {}
        for (label, _), fn, t in zip(FP8_RECIPES, fns, times):
            with count_python_calls() as calls:
                fn()
            recipes[label] = {"us": t, "launches": launches_per_call(fn, device), "python_calls": calls.python_calls}
        rows.append({"workload": f"{name}_fp8_host", "shape": shape, "recipes": recipes})
        del step, fns
        free_memory(device)
    return rows


def _training_step(device, dtype, hidden: int = 1024, blocks: int = 4, tokens: int = 4096) -> dict:
    """Device time per training step (fwd + bwd + SGD), eager vs graphed, CUDA events."""
    torch.manual_seed(0)
    model = _Blocks(device, dtype, hidden, blocks)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(tokens, hidden, device=device, dtype=dtype)

    def step(fn):
        def call():
            fn(x).backward(dy)
            opt.step()
            opt.zero_grad(set_to_none=False)
        return call

    def device_ms(call):  # CUDA-event median after warm-up (the harness's timer)
        return Timer(device, 100.0, 500.0).time(lambda i: call()).median_ms

    eager_ms = device_ms(step(model))
    graphed = fo.make_graphed_callables(model, (x,))
    graphed_ms = device_ms(step(graphed))
    return {"workload": f"train_step_{blocks}x_block", "shape": f"hidden={hidden} tokens={tokens}",
            "eager_step_ms": eager_ms, "graphed_step_ms": graphed_ms, "speedup": eager_ms / graphed_ms}


def markdown(rows: list[dict], device: str) -> str:
    lines = [f"host_overhead on {device}: host us per fwd+bwd call (median [p20, p80]); plain PyTorch in "
             "torch.nn modules (the target's peer; the grouped MLP: the torch._grouped_mm composition, "
             "per-expert loop on CPU) and as bare functional calls", "",
             "| workload | shape | ours eager | torch.nn eager | ours / torch.nn | functional eager "
             "| ours / functional | ours graphed |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]

    def us(v):
        return f"{v[0]:.0f} [{v[1]:.0f}, {v[2]:.0f}]" if v else "-"
    for r in rows:
        if "ours_us" not in r:
            continue
        o, t, f = r["ours_us"], r["torch_us"], r.get("functional_us")
        ratio_f = f"{o[0] / f[0]:.2f}x" if f else "-"
        lines.append(f"| {r['workload']} | {r['shape']} | {us(o)} | {us(t)} | {o[0] / t[0]:.2f}x | {us(f)} | "
                     f"{ratio_f} | {us(r.get('graphed_us'))} |")
    fp8 = [r for r in rows if "recipes" in r]
    if fp8:
        lines += ["", "FP8 recipes: host us per fwd+bwd call (median [p20, p80]), kernels launched and Python "
                      "function calls per call" + (" (CPU: FP8 emulated, host time includes the CPU math; launches "
                                                   "= ATen ops + Triton launches)" if device.startswith("cpu") else ""),
                  "", "| workload | shape | recipe | host us | / bf16 | launches | Python calls |",
                  "|---|---|---|---:|---:|---:|---:|"]
        for r in fp8:
            base = r["recipes"]["bf16"]["us"][0]
            for label, v in r["recipes"].items():
                lines.append(f"| {r['workload']} | {r['shape']} | {label} | {us(v['us'])} | {v['us'][0] / base:.2f}x | "
                             f"{v['launches']} | {v['python_calls']} |")
    for r in rows:
        if "eager_step_ms" in r:
            lines += ["", f"{r['workload']} ({r['shape']}): eager {r['eager_step_ms']:.3f} ms/step, graphed "
                          f"{r['graphed_step_ms']:.3f} ms/step, speedup {r['speedup']:.2f}x"]
    return "\n".join(lines)


def main(args) -> int:
    """``python -m fusible_ops.bench host_overhead [--device D] [--quick] [--out DIR]``."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    quick = bool(args.quick)
    pinned = pin_to_one_core(device, getattr(args, "pin", False))
    rows = run(device, warmup=5 if quick else 20, rep=10 if quick else 200)
    table = markdown(rows, device_name(device) + pinned)
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = os.path.join(args.out, f"host_overhead_{stamp}.md")
    with open(path, "w") as f:
        f.write(table + "\n")
    print(table)
    _log(f"wrote {path}")
    return 0


__all__ = ["host_times_interleaved", "host_times_us", "launches_per_call", "main", "markdown", "run"]
