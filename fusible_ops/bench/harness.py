"""Ceilings, checks, runs and output for ``python -m fusible_ops.bench`` (the timer: :mod:`.timing`).

* Timing: one timed call is what the case says (forward + backward through
  ``torch.autograd.grad``, so no ``.grad`` accumulation pass is timed). Inputs are rotated among
  ``n_copies`` copies so the L2 cache does not flatter a case (enough copies that the rotated
  set exceeds 2x L2, at least 2). CUDA: one pair of ``torch.cuda.Event`` per call after a
  warm-up of ``--warmup-ms``, for ``--rep-ms``; median, p20 and p80 of the per-call times, and
  the median host time to issue one call (``host ms``: a row whose host ms reaches its median is
  host-bound, and its event times are the host's, jitter included; a device-bound row's host ms
  can include waits on a full launch queue).
  ``--queue-ahead``: each timed call is queued behind a GPU spin (``torch.cuda._sleep``) that
  outlasts three times its host issue time, so its kernels run back to back and the events time
  the device work alone (the kernels' own time, for host-bound rows too; host time is what
  ``host_overhead`` measures).
  CPU: the same loop with ``time.perf_counter`` (for smoke tests only).
* Ceilings, measured in the same run: device-to-device copy bandwidth (``dst.copy_(src)`` of
  1 GiB, bytes read + written) and the dense bf16 matmul rate (8192^3 ``torch.mm`` on random
  data). Elementwise / norm cases report % of the copy bandwidth, GEMM cases % of the matmul rate.
  And the autograd floor (:func:`measure_autograd_floor`): the least time any row timed as
  issued can take on this host.
* Before timing, every variant's output and gradients are compared once with the case's
  reference (relative norm error < ``REL_ERR_TOL``), and the fused variant's plan must contain
  the case's expected rules: a broken kernel cannot post a time.
* Output: per (case, config, variant) one CSV row and one JSON object (JSON lines) under
  ``--out``, plus a Markdown table printed at the end (and saved beside them). Row status:
  ``ok``; ``error: ...`` (fused or eager broken, or an expected rule absent: no time, exit
  code 1); ``unavailable: ...`` (a baseline that cannot run here, e.g. ``torch._grouped_mm``);
  ``mismatch: ...`` (a baseline whose result disagrees with the reference: no time).
  ``FUSIBLE_OPS_BENCH_TRACEBACK=1`` prints tracebacks of failing variants.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import time
import traceback
from typing import Optional, Sequence

import torch

from .common import device_name, driver_version, free_memory, is_fp8_variant, log as _log, pin_to_one_core
from .common import versions as _versions
from .cases import Lazy
from .output import FIELDS, markdown_table, write_jsonl, write_outputs
from .timing import Timer, Timing, n_copies_for

DEFAULT_WARMUP_MS = 200.0
DEFAULT_REP_MS = 600.0
REL_ERR_TOL = 2e-2
COPY_CEILING_BYTES = 2**30  # the source of the copy ceiling (read + write = 2 GiB moved)
MM_CEILING_N = 8192

# --------------------------------------------------------------------------------------- ceilings
@dataclasses.dataclass
class Ceilings:
    copy_gbps: float
    matmul_tflops: float
    copy_timing: Timing
    matmul_timing: Timing
    copy_bytes: int
    matmul_n: int
    floor_timing: Optional[Timing] = None  # see measure_autograd_floor
    fp8_tflops: Optional[float] = None  # per-tensor FP8 matmul rate (torch._scaled_mm), CUDA 8.9+ only

    @property
    def autograd_floor_ms(self) -> Optional[float]:
        return None if self.floor_timing is None else self.floor_timing.median_ms


def measure_autograd_floor(device: torch.device, timer: Timer) -> Timing:
    """The least time a row timed as issued can take on this host: one autograd op's forward and
    backward (``x * 1.5`` on one element, one kernel each way, ``torch.autograd.grad`` as every
    row calls it), timed as issued (never queued ahead). A row whose device time is below it is
    host-bound whatever implements it: its median is the host's issue time, jitter included."""
    x = torch.ones(1, device=device, requires_grad=True)
    dy = torch.ones(1, device=device)

    def call(i):
        torch.autograd.grad(x * 1.5, (x,), dy)

    call(0)
    return Timer(device, timer.warmup_ms, timer.rep_ms).time(call)


def measure_ceilings(device: torch.device, timer: Timer, quick: bool = False) -> Ceilings:
    """Copy bandwidth (GB/s, bytes read + written), dense bf16 matmul rate (TFLOP/s) and the
    autograd floor (:func:`measure_autograd_floor`)."""
    nbytes = COPY_CEILING_BYTES if not quick else 16 * 2**20
    t_copy = _time_copy(device, timer, nbytes)
    copy_gbps = 2 * nbytes / (t_copy.median_ms * 1e-3) / 1e9
    n = MM_CEILING_N if not quick else 256
    t_mm = _time_mm(device, timer, n)
    tflops = 2 * n**3 / (t_mm.median_ms * 1e-3) / 1e12
    fp8 = _fp8_mm_tflops(device, timer, n)
    free_memory(device)
    return Ceilings(copy_gbps, tflops, t_copy, t_mm, nbytes, n, measure_autograd_floor(device, timer), fp8)


def _fp8_mm_tflops(device: torch.device, timer: Timer, n: int) -> Optional[float]:
    """Dense per-tensor FP8 matmul rate (``torch._scaled_mm``, E4M3, bf16 out), the ceiling of the
    FP8 variants; None where FP8 matmuls do not run (CPU, compute capability < 8.9)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return None
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)
    t = timer.time(lambda i: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    return 2 * n**3 / (t.median_ms * 1e-3) / 1e12


def _time_copy(device: torch.device, timer: Timer, nbytes: int) -> Timing:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    return timer.time(lambda i: dst.copy_(src))


def _time_mm(device: torch.device, timer: Timer, n: int) -> Timing:
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    c = torch.empty(n, n, dtype=torch.bfloat16, device=device)
    return timer.time(lambda i: torch.mm(a, b, out=c))


# ----------------------------------------------------------------------------------- correctness
def rel_norm_err(actual: Optional[torch.Tensor], expected: Optional[torch.Tensor]) -> float:
    """||actual - expected|| / ||expected|| in fp32 (None counts as zeros; 0/0 is 0)."""
    if actual is None and expected is None:
        return 0.0
    if actual is None:
        actual = torch.zeros_like(expected)
    if expected is None:
        expected = torch.zeros_like(actual)
    if actual.shape != expected.shape:
        return float("inf")
    a = actual.detach().float()
    e = expected.detach().float()
    if not bool(torch.isfinite(a).all()):
        return float("inf")
    err = torch.linalg.vector_norm(a - e).item()
    den = torch.linalg.vector_norm(e).item()
    if den == 0.0:
        return 0.0 if err == 0.0 else float("inf")
    return err / den


# ------------------------------------------------------------------------------------------ rows
# ------------------------------------------------------------------------------------------- run
def _short_err(e: BaseException) -> str:
    s = f"{type(e).__name__}: {e}".replace("\n", " ")
    return s[:300]


def _grad_targets(inputs: tuple, params: list[torch.Tensor]) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in (*inputs, *params):
        if isinstance(t, torch.Tensor) and t.requires_grad and id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _fwd_bwd(fn, inputs, dy, targets):
    y = fn(*inputs)
    if not targets:  # (a forward-only bench: nothing requires grad, e.g. one GEMM alone)
        return y, ()
    grads = torch.autograd.grad(y, targets, dy, allow_unused=True)
    return y, grads


def _check_variant(bench, name: str, fn, inputs, dy, targets, device) -> tuple[float, float, Optional[str]]:
    """One call of ``fn`` compared with the bench's reference. Returns (first_call_s, rel_err, problem)."""
    t0 = time.perf_counter()
    y, grads = _fwd_bwd(fn, inputs, dy, targets)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    first = time.perf_counter() - t0
    problem = None
    if bench.check_output is not None:
        problem = bench.check_output(inputs, y)
    if bench.reference is None and name == bench.baseline:
        return first, 0.0, problem
    ref_fn = bench.reference if bench.reference is not None else (lambda inp, _y: bench.variants[bench.baseline](*inp))
    y_ref = ref_fn(inputs, y)
    g_ref = torch.autograd.grad(y_ref, targets, dy, allow_unused=True) if targets else ()
    errs = [rel_norm_err(y, y_ref)] + [rel_norm_err(a, b) for a, b in zip(grads, g_ref)]
    err = max(errs)
    tol = bench.tolerances.get(name, REL_ERR_TOL)
    if err >= tol and problem is None:
        labels = ["output"] + [f"grad[{k}]" for k in range(len(grads))]
        worst = labels[errs.index(err)]
        problem = f"mismatch vs reference: rel norm err {err:.3g} ({worst}) >= {tol}"
    del y, grads, y_ref, g_ref
    return first, err, problem


def _peak_mib(call, device: torch.device) -> Optional[float]:
    """Peak memory of one more call above what was allocated before it (MiB; CUDA only)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    call(0)
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def _saved_mib(fn, inputs: tuple, targets: list, device: torch.device) -> Optional[float]:
    """Memory one forward keeps for its backward (MiB; CUDA only): allocated with the output and its
    autograd graph alive, above what was allocated before, less the output itself. None for a
    forward-only bench."""
    if device.type != "cuda" or not targets:
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    try:
        y = fn(*inputs)
    except Exception as e:  # (the variant was timed already: its row keeps its time)
        _log(f"saved-memory forward failed: {_short_err(e)}")
        return None
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device) - base
    outs = y if isinstance(y, (tuple, list)) else (y,)
    held -= sum(t.numel() * t.element_size() for t in outs if isinstance(t, torch.Tensor))
    del y, outs
    return held / 2**20


def _plan_rules(bench) -> tuple[list[str], list[str]]:
    if bench.fused_module is None:  # (a case that times kernels alone: no plan)
        return [], []
    args = bench.plan_args(bench.copies[0][0])
    fwd = [r["rule"] for r in bench.fused_module.fusion_plan("forward", *args) if r.get("rule")]
    bwd = [r["rule"] for r in bench.fused_module.fusion_plan("backward", *args) if r.get("rule")]
    return fwd, bwd


def run_bench(bench, timer: Timer, ceilings: Ceilings, meta: dict, device: torch.device,
              variant_filter: Optional[set], progress: str) -> list[dict]:
    """Check and time every variant of one bench; returns its rows."""
    first_inputs, first_dy = bench.new_copy()
    copy_bytes = sum(t.numel() * t.element_size() for t in (*first_inputs, first_dy) if isinstance(t, torch.Tensor))
    n_copies = n_copies_for(copy_bytes, device)
    bench.copies = [(first_inputs, first_dy)] + [bench.new_copy() for _ in range(n_copies - 1)]
    targets = [_grad_targets(inp, bench.params) for inp, _ in bench.copies]

    fwd_rules, bwd_rules = _plan_rules(bench)
    used = set(fwd_rules) | set(bwd_rules)
    missing = [r for r in bench.expected_rules if r not in used]

    ceiling_name = "copy_bw" if bench.metric == "bytes" else "bf16_mm"
    rows = []
    for name, fn in bench.variants.items():
        if variant_filter and name not in variant_filter and name != bench.baseline:
            continue
        row = dict(meta)
        row.update(
            case=bench.case, config=bench.config, variant=name, shape=bench.shape, dtype=str(bench.dtype).replace("torch.", ""),
            status="ok", median_ms=None, p20_ms=None, p80_ms=None, n_iters=None, n_copies=n_copies,
            metric=bench.metric, bytes=bench.work if bench.metric == "bytes" else None,
            flops=bench.work if bench.metric == "flops" else None, gbps=None, tflops=None, ceiling=ceiling_name,
            pct_of_ceiling=None, speedup_vs_eager=None, speedup_vs_grouped_mm=None, rel_err=None,
            rules_forward=fwd_rules if name == "fused" else [], rules_backward=bwd_rules if name == "fused" else [],
            expected_rules=list(bench.expected_rules) if name == "fused" else [], first_call_s=None,
            note=bench.notes.get(name, ""),
        )
        label = f"{progress} {bench.case}{'[' + bench.config + ']' if bench.config else ''} / {name}"
        if name == "fused" and missing:
            row["status"] = f"error: expected rule(s) absent from the plan: {missing}"
            _log(f"{label}: {row['status']}")
            rows.append(row)
            continue
        inputs0, dy0 = bench.copies[0]
        pooled = isinstance(fn, Lazy) and fn.pooled  # (no peak / saved memory: a graph's pool is allocated at capture)
        try:
            if isinstance(fn, Lazy):
                fn = fn.make(inputs0)
            first, err, problem = _check_variant(bench, name, fn, inputs0, dy0, targets[0], device)
        except Exception as e:  # a baseline that cannot run here, or a broken fused op
            kind = "error" if name in ("fused", bench.baseline) else "unavailable"
            row["status"] = f"{kind}: {_short_err(e)}"
            _log(f"{label}: {row['status']}")
            if os.environ.get("FUSIBLE_OPS_BENCH_TRACEBACK"):
                traceback.print_exc()
            rows.append(row)
            free_memory(device)
            continue
        row["first_call_s"] = round(first, 3)
        row["rel_err"] = err
        if problem is not None:
            row["status"] = ("error: " if name == "fused" else "mismatch: ") + problem
            _log(f"{label}: {row['status']}")
            if bench.extra is not None:
                row.update(bench.extra(name, row))
            rows.append(row)
            free_memory(device)
            continue

        def call(i, fn=fn):
            inp, dy = bench.copies[i % n_copies]
            _fwd_bwd(fn, inp, dy, targets[i % n_copies])

        try:
            t = timer.time(call)
        except Exception as e:
            row["status"] = f"error: {_short_err(e)}"
            _log(f"{label}: {row['status']}")
            rows.append(row)
            del fn, call  # (the variant's model and memory go before the next is built)
            free_memory(device)
            continue
        row.update(median_ms=t.median_ms, p20_ms=t.p20_ms, p80_ms=t.p80_ms, n_iters=t.n_iters, host_ms=t.host_ms,
                   queue_ahead=timer.queue_ahead, peak_mib=None if pooled else _peak_mib(call, device),
                   saved_mib=None if pooled else _saved_mib(fn, bench.copies[0][0], targets[0], device))
        if bench.tokens:
            row["tokens_per_s"] = bench.tokens / (t.median_ms * 1e-3)
        if bench.extra is not None:
            row.update(bench.extra(name, row))
        if bench.metric == "bytes":
            row["gbps"] = bench.work / (t.median_ms * 1e-3) / 1e9
            row["pct_of_ceiling"] = 100.0 * row["gbps"] / ceilings.copy_gbps
            rate = f"{row['gbps']:.0f} GB/s"
        else:
            row["tflops"] = bench.work / (t.median_ms * 1e-3) / 1e12
            if is_fp8_variant(name) and ceilings.fp8_tflops:
                row["ceiling"] = ceiling_name = "fp8_mm"
                row["pct_of_ceiling"] = 100.0 * row["tflops"] / ceilings.fp8_tflops
            else:
                row["ceiling"] = ceiling_name = "bf16_mm"
                row["pct_of_ceiling"] = 100.0 * row["tflops"] / ceilings.matmul_tflops
            rate = f"{row['tflops']:.1f} TFLOP/s"
        _log(
            f"{label}: {t.median_ms:.3f} ms (p20 {t.p20_ms:.3f}, p80 {t.p80_ms:.3f}, host {t.host_ms:.3f}, "
            f"{t.n_iters} iters, {n_copies} copies) {rate} = {row['pct_of_ceiling']:.1f}% of {ceiling_name}; "
            f"rel err {err:.2e}; first call {first:.2f} s"
        )
        rows.append(row)
        del fn, call
        free_memory(device)

    by_name = {r["variant"]: r for r in rows}
    base = by_name.get(bench.baseline)
    gmm = by_name.get("grouped_mm")
    for r in rows:
        if r["median_ms"] is None:
            continue
        if base is not None and base["median_ms"] is not None:
            r["speedup_vs_eager"] = base["median_ms"] / r["median_ms"]
        if gmm is not None and gmm["median_ms"] is not None:
            r["speedup_vs_grouped_mm"] = gmm["median_ms"] / r["median_ms"]
    bench.copies = None
    return rows


def build_parser() -> argparse.ArgumentParser:
    from .cases import CASES

    p = argparse.ArgumentParser(
        prog="python -m fusible_ops.bench",
        description="Time fused fusible_ops Sequentials against the same ops in eager PyTorch and torch.compile.",
    )
    p.add_argument("cases", nargs="*", metavar="CASE",
                   help=f"cases to run (default: all); CASE or CASE:CONFIG (e.g. grouped_mlp_8e:skewed). "
                        f"Cases: {', '.join(CASES)}")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--out", default="bench_results", help="output folder (default: bench_results/)")
    p.add_argument("--warmup-ms", type=float, default=DEFAULT_WARMUP_MS, help="warm-up per variant (ms)")
    p.add_argument("--rep-ms", type=float, default=DEFAULT_REP_MS, help="timed duration per variant (ms)")
    p.add_argument("--quick", action="store_true", help="small shapes (CPU smoke runs)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines")
    p.add_argument("--variants", default="",
                   help="comma list of variants to run (the case's eager baseline always runs), "
                        "e.g. fused,grouped_mm")
    p.add_argument("--device", default=None, help="device (default: cuda if available, else cpu)")
    p.add_argument("--queue-ahead", action="store_true",
                   help="CUDA: queue each timed call behind a GPU spin longer than its host issue time, so the "
                        "events time the device work alone (host-bound rows then show their kernels' time)")
    p.add_argument("--report", metavar="PAGE",
                   help="also write a results page (e.g. BENCHMARKS.md) from this run's rows, with plots under "
                        "docs/img/ beside it (needs the bench extra: matplotlib)")
    p.add_argument("--from", dest="from_dir", metavar="DIR",
                   help="with --report: render the page from the JSON lines already in DIR (no timing)")
    p.add_argument("--pin", action="store_true",
                   help="CUDA: pin this process to one CPU core (Linux) for steadier host times")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .cases import CASES, BenchContext

    if (sys.argv[1:2] if argv is None else list(argv)[:1]) == ["convergence"]:  # (its own options)
        from .convergence import main as convergence_main

        return convergence_main(sys.argv[2:] if argv is None else list(argv)[1:])
    args = build_parser().parse_args(argv)
    if args.from_dir:
        from .report import load_rows, write_report

        if not args.report:
            print("--from needs --report PAGE", file=sys.stderr)
            return 2
        write_report(load_rows(args.from_dir), args.report)
        return 0
    if args.list:
        for name, case in CASES.items():
            print(f"{name:20s} {case.description}")
        print(f"{'host_overhead':20s} host us per fwd+bwd call: ours eager vs PyTorch eager vs ours graphed "
              f"(run alone: python -m fusible_ops.bench host_overhead)")
        print(f"{'convergence':20s} loss curves of a byte-level LM: plain torch vs ours bf16 vs the FP8 recipes, MoE "
              f"bf16 vs FP8 (run alone: python -m fusible_ops.bench convergence --help)")
        return 0
    if args.cases == ["host_overhead"]:
        from .host import main as host_main

        return host_main(args)
    rank = _init_distributed(args.device)
    from .cases_dist import DIST_CASES, distributed

    selected: list[tuple[str, Optional[str]]] = []
    default = [c for c in CASES if (c in DIST_CASES) == distributed()]  # torchrun: the distributed cases
    for spec in args.cases or default:
        name, _, config = spec.partition(":")
        if name not in CASES:
            print(f"unknown case {name!r}; known: {', '.join(CASES)}", file=sys.stderr)
            return 2
        selected.append((name, config or None))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if distributed() and torch.distributed.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    variant_filter = {v.strip() for v in args.variants.split(",") if v.strip()} or None

    torch.manual_seed(0)
    tv, trv = _versions()
    now = datetime.datetime.now(datetime.timezone.utc)
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    timer = Timer(device, args.warmup_ms, args.rep_ms, queue_ahead=args.queue_ahead,
                  agree=_agree_counts if distributed() else None)
    t_start = time.perf_counter()
    pinned = pin_to_one_core(device, args.pin)
    _log(f"fusible_ops.bench on {device_name(device)}{pinned} (torch {tv}, triton {trv}); measuring ceilings ...")
    ceilings = measure_ceilings(device, timer, quick=args.quick)
    _log(f"ceilings: copy {ceilings.copy_gbps:.0f} GB/s, bf16 matmul {ceilings.matmul_tflops:.1f} TFLOP/s, "
         f"autograd floor {ceilings.autograd_floor_ms:.3f} ms")
    meta = dict(
        device=device_name(device), torch_version=tv, triton_version=trv, date_utc=now.isoformat(timespec="seconds"),
        copy_gbps=ceilings.copy_gbps, matmul_tflops=ceilings.matmul_tflops,
        autograd_floor_ms=ceilings.autograd_floor_ms, fp8_tflops=ceilings.fp8_tflops, quick=bool(args.quick),
        queue_ahead=timer.queue_ahead, pinned=bool(pinned), driver=driver_version(device),
        command=" ".join(["python -m fusible_ops.bench", *(sys.argv[1:] if argv is None else argv)]),
    )
    rows: list[dict] = []
    for variant, t, value, metric in (("copy_bandwidth", ceilings.copy_timing, ceilings.copy_gbps, "bytes"),
                                      ("bf16_matmul", ceilings.matmul_timing, ceilings.matmul_tflops, "flops")):
        r = {k: None for k in FIELDS}
        r.update(meta)
        r.update(case="ceiling", config="", variant=variant, dtype="bfloat16", status="ok",
                 shape=(f"[{ceilings.copy_bytes // 2}]" if metric == "bytes" else f"[{ceilings.matmul_n}]^3"),
                 median_ms=t.median_ms, p20_ms=t.p20_ms, p80_ms=t.p80_ms, n_iters=t.n_iters, n_copies=1,
                 metric=metric, ceiling="copy_bw" if metric == "bytes" else "bf16_mm", pct_of_ceiling=100.0,
                 bytes=2 * ceilings.copy_bytes if metric == "bytes" else None,
                 flops=2 * ceilings.matmul_n**3 if metric == "flops" else None,
                 gbps=value if metric == "bytes" else None, tflops=value if metric == "flops" else None,
                 rules_forward=[], rules_backward=[], expected_rules=[], note="")
        rows.append(r)
    t = ceilings.floor_timing
    rows.append(dict({k: None for k in FIELDS}, **meta) | dict(
        case="ceiling", config="", variant="autograd_floor", shape="[1]", dtype="float32", status="ok",
        median_ms=t.median_ms, p20_ms=t.p20_ms, p80_ms=t.p80_ms, host_ms=t.host_ms, n_iters=t.n_iters, n_copies=1,
        queue_ahead=False, metric="time", ceiling="autograd_floor", rules_forward=[], rules_backward=[],
        expected_rules=[], note="x * 1.5 forward + torch.autograd.grad, as issued"))

    ctx = BenchContext(device=device, quick=args.quick, compile=not args.no_compile)
    n_failed = 0
    for ci, (name, config) in enumerate(selected):
        case = CASES[name]
        progress = f"[{ci + 1}/{len(selected)}]"
        t_case = time.perf_counter()
        gen = case.build(ctx)
        while True:
            try:
                bench = next(gen)
            except StopIteration:
                break
            except Exception as e:
                _log(f"{progress} {name}: setup failed: {_short_err(e)}")
                r = {k: None for k in FIELDS}
                r.update(meta)
                r.update(case=name, config=config or "", variant="fused", status=f"error: setup: {_short_err(e)}",
                         rules_forward=[], rules_backward=[], expected_rules=[], note="")
                rows.append(r)
                n_failed += 1
                break
            if config is not None and bench.config != config:
                del bench
                continue
            try:
                bench_rows = run_bench(bench, timer, ceilings, meta, device, variant_filter, progress)
            except Exception as e:
                _log(f"{progress} {name}: failed: {_short_err(e)}")
                bench_rows = [dict(meta, case=name, config=bench.config, variant="fused",
                                   status=f"error: {_short_err(e)}")]
            del bench
            for r in bench_rows:
                full = {k: None for k in FIELDS}
                full.update(r)
                rows.append(full)
                if str(full["status"]).startswith("error"):
                    n_failed += 1
            if not rank:
                write_jsonl(rows, os.path.join(args.out, f"bench_{stamp}.jsonl"))
            free_memory(device)
            _reset_compile()
        del gen
        free_memory(device)
        _log(f"{progress} {name}: done in {time.perf_counter() - t_case:.1f} s")

    meta_md = dict(meta, matmul_n=ceilings.matmul_n)
    table = markdown_table([r for r in rows if r["case"] != "ceiling"], meta_md)
    if rank:  # (torchrun: rank 0 writes)
        return 1 if n_failed else 0
    paths = write_outputs(rows, args.out, stamp, table)
    print(table)
    _log(f"wrote {paths['csv']}, {paths['jsonl']}, {paths['md']} (total {time.perf_counter() - t_start:.1f} s)")
    if args.report:
        from .report import write_report

        _log(f"wrote {write_report(rows, args.report)}")
    return 1 if n_failed else 0


def _init_distributed(device: Optional[str]) -> int:
    """Under torchrun (WORLD_SIZE > 1): join the NCCL group on this process's GPU, or with
    ``--device cpu`` (or no GPU) the gloo group on the CPU. Returns the rank."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0
    import torch.distributed as dist

    if not dist.is_initialized():
        if (device or "").startswith("cpu") or not torch.cuda.is_available():
            dist.init_process_group("gloo")
        else:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl")
    return dist.get_rank()


def _agree_counts(n_warm: int, n_rep: int) -> tuple[int, int]:
    """The largest warm-up and timed iteration counts of all ranks (calls hold collectives)."""
    import torch.distributed as dist

    t = torch.tensor([n_warm, n_rep], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t[0]), int(t[1])


def _reset_compile() -> None:
    try:
        torch._dynamo.reset()
    except Exception:  # pragma: no cover
        pass
