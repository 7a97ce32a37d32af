"""The results page (``BENCHMARKS.md``) written from one harness run's rows.

``python -m fusible_ops.bench --out DIR --report BENCHMARKS.md`` runs the cases and writes the page;
``python -m fusible_ops.bench --from DIR --report BENCHMARKS.md`` writes it again from the JSON lines
that run left in ``DIR`` (no timing). The page holds the run's device, driver, versions, date and
command, the ceilings measured in that run, one table per case family (every variant's time, its
rate as % of its ceiling, its peak memory, and how much faster the fused variant is), the issues'
performance targets with the measured figures, the fused variants' shortfalls (any peer faster)
and plots (matplotlib, the ``bench`` extra: PNGs under
``docs/img/`` beside the page; without matplotlib the page says so and has no plots).
"""

from __future__ import annotations

import glob
import json
import math
import os
from typing import Optional

from .common import is_fp8_variant
from .convergence_report import CASE as CONVERGENCE, convergence_section
from .targets import HF_BF16_PEERS, fastest_of, target_lines

FAMILIES = [
    ("Elementwise and normalization", ("bias_gelu", "swiglu", "residual_rmsnorm", "gelu_dropout", "layernorm",
                                       "norm_sizes")),
    ("Dense MLP blocks (bf16 and FP8)", ("mlp_block", "mlp_block_swiglu")),
    ("Grouped expert MLPs (bf16 and FP8)", ("grouped_mlp_8e", "grouped_mlp_64e")),
    ("Grouped GEMMs alone", ("grouped_gemm",)),
    ("MoE layer", ("moe_layer", "moe_copies")),
    ("Model stacks (attention + blocks, bf16 and FP8)", ("dense_layers", "moe_layers")),
    ("LM head", ("lm_head",)),
    ("Hugging Face models (training step)", ("hf_models",)),
    ("Distributed (torchrun)", ("tp_mlp", "ep_moe", "fsdp_layers")),
]
"""(title, cases) of each table, in page order; cases of no family go to a last "Other" table."""

PEER_LABELS = {"eager": "eager PyTorch", "compile": "torch.compile", "eager_loop": "per-expert loop",
               "compile_loop": "compiled loop", "grouped_mm": "torch._grouped_mm", "liger": "Liger-Kernel",
               "torch_scaled_grouped_mm": "torch._scaled_grouped_mm", "index_select": "index_select"}


def load_rows(out_dir: str) -> list[dict]:
    """Every row of the ``bench_*.jsonl`` files in ``out_dir`` (in file-name order)."""
    paths = sorted(glob.glob(os.path.join(out_dir, "bench_*.jsonl")))
    if not paths:
        raise FileNotFoundError(f"no bench_*.jsonl in {out_dir}")
    rows = []
    for p in paths:
        with open(p) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return rows


def _num(v) -> Optional[float]:
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _f(v, nd: int = 3, suffix: str = "") -> str:
    v = _num(v)
    return "" if v is None else f"{v:.{nd}f}{suffix}"


def _groups(rows: list[dict]) -> dict:
    """(case, config) -> {variant: row}, in run order."""
    out: dict = {}
    for r in rows:
        if r.get("case") in ("ceiling", CONVERGENCE):
            continue
        out.setdefault((r["case"], r.get("config") or ""), {})[r["variant"]] = r
    return out


def _base(name: str, variants: dict) -> str:
    """The variant a row's time is divided by: ``fused``, or ``fp8_current`` for an FP8 peer (an
    FP8 peer against our bf16 plan would compare recipes, not implementations)."""
    if _is_peer(name) and is_fp8_variant(name) and _num(variants.get("fp8_current", {}).get("median_ms")) is not None:
        return "fp8_current"
    return "fused"


def speedups(variants: dict) -> dict:
    """{other variant: its median / the fused median} (how much faster the fused variant is);
    FP8 peers over ``fp8_current`` instead (:func:`_base`)."""
    if _num(variants.get("fused", {}).get("median_ms")) is None:
        return {}
    return {name: _num(r.get("median_ms")) / _num(variants[_base(name, variants)]["median_ms"])
            for name, r in variants.items() if name != "fused" and _num(r.get("median_ms")) is not None}


def _is_peer(name: str) -> bool:
    """Variants that are not ours (ours: fused, unfused, fp8_*, graphed*)."""
    return name in PEER_LABELS or name.startswith(("torch", "composition", "liger", "torchao", "te_"))


def _family_table(groups: dict, cases) -> list[str]:
    lines = ["| case | config | variant | median ms | p20-p80 | host ms | rate | % of ceiling | peak MiB "
             "| saved MiB | time / fused | status |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for (case, config), variants in groups.items():
        if case not in cases:
            continue
        sp = speedups(variants)
        for name, r in variants.items():
            rate = (_f(r.get("tflops"), 1, " TFLOP/s") if r.get("metric") == "flops" else _f(r.get("gbps"), 0, " GB/s"))
            pct = _f(r.get("pct_of_ceiling"), 1, "%")
            if pct:
                pct += f" {r.get('ceiling') or ''}".rstrip()
            p = f"{_f(r.get('p20_ms'))}-{_f(r.get('p80_ms'))}" if _num(r.get("p20_ms")) is not None else ""
            ratio = f"{sp[name]:.2f}x" if name in sp else ""
            status = r.get("status") or ""
            # (a graphed variant's memory sits in its graph's pool, allocated at capture: rows measured
            # before the harness left it out show ~0 and negative figures, which measure nothing)
            peak, saved = ("", "") if "graphed" in name else (_f(r.get("peak_mib"), 0), _f(r.get("saved_mib"), 0))
            lines.append(f"| {case} | {config} | {name} | {_f(r.get('median_ms'))} | {p} | {_f(r.get('host_ms'))} "
                         f"| {rate} | {pct} | {peak} | {saved} | {ratio} "
                         f"| {status if status != 'ok' else ''} |")
    return lines


def _hf_table(groups: dict) -> list[str]:
    """The ``hf_models`` rows: one training step per row, with tokens/s, the step's peak memory,
    the loss and gradients against the float32 model, and the time against the fastest peer of
    the same precision (bf16: HF eager, compile, Liger; FP8: torchao)."""
    lines = ["`peak GiB`: the step's peak memory (parameters, gradients, activations, workspace). `loss - fp32`, "
             "`grad err`: against the same weights in float32 (global relative norm error of all gradients). "
             "`vs fastest peer`: that peer's time / the row's (above 1: the row is faster).", "",
             "| config | variant | ms/step | tokens/s | rate | % of ceiling | peak GiB | loss | loss - fp32 | grad err "
             "| vs fastest peer | status |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for (case, config), variants in groups.items():
        if case != "hf_models":
            continue
        fp8_peers = [n for n in variants if n.startswith("torchao")]
        for name, r in variants.items():
            ms = _num(r.get("median_ms"))
            best = fastest_of(groups, case, config, fp8_peers if is_fp8_variant(name) else HF_BF16_PEERS)
            vs = f"{best[1] / ms:.2f}x ({best[0]})" if best and ms else ""
            loss, ref = _num(r.get("loss")), _num(r.get("loss_ref"))
            delta = f"{loss - ref:+.4f}" if loss is not None and ref is not None else ""
            err, peak = _num(r.get("grad_rel_err")), _num(r.get("step_peak_mib"))
            pct = _f(r.get("pct_of_ceiling"), 1, "%")
            status = r.get("status") or ""
            lines.append(f"| {config} | {name} | {_f(ms, 1)} | {_f(r.get('tokens_per_s'), 0)} "
                         f"| {_f(r.get('tflops'), 1, ' TFLOP/s')} | {pct + ' ' + (r.get('ceiling') or '') if pct else ''} "
                         f"| {'' if peak is None else f'{peak / 1024:.2f}'} "
                         f"| {_f(loss, 4)} | {delta} | {'' if err is None else f'{err:.2e}'} | {vs} "
                         f"| {status if status != 'ok' else ''} |")
    return lines


def _summary(groups: dict) -> list[str]:
    lines = ["| case | config | fused ms | fused % of ceiling | peers: time / fused (fused is x faster; FP8 peers: / fp8_current) "
             "| ours unfused / FP8 / graphed: time / fused |", "|---|---|---:|---:|---|---|"]
    for (case, config), variants in groups.items():
        fused = variants.get("fused")
        if fused is None:
            continue
        sp = speedups(variants)
        peers = ", ".join(f"{PEER_LABELS.get(n, n)} {v:.2f}" for n, v in sp.items() if _is_peer(n)) or "-"
        ours = ", ".join(f"{n} {v:.2f}" for n, v in sp.items() if not _is_peer(n)) or "-"
        pct = _f(fused.get("pct_of_ceiling"), 1, "%")
        lines.append(f"| {case} | {config} | {_f(fused.get('median_ms'))} | {pct} | {peers} | {ours} |")
    return lines


def _ranges_overlap(a: dict, b: dict) -> bool:
    """Whether two rows' p20-p80 time ranges overlap (False where a row has none)."""
    lo_a, hi_a, lo_b, hi_b = (r.get(k) for r in (a, b) for k in ("p20_ms", "p80_ms"))
    if None in (lo_a, hi_a, lo_b, hi_b):
        return False
    return lo_a <= hi_b and lo_b <= hi_a


def shortfalls(groups: dict) -> list[str]:
    """One line per variant that did not run ok, per fused variant slower than a peer, and per
    fused plan slower than the same ops unfused (a defect; the line says where the two rows'
    p20-p80 ranges overlap, i.e. the gap is within the run's spread)."""
    out = []
    for (case, config), variants in groups.items():
        label = f"{case}" + (f"[{config}]" if config else "")
        for name, r in variants.items():
            status = r.get("status") or ""
            if status and status != "ok":
                out.append(f"- {label} / {name}: {status if len(status) <= 160 else status[:157] + '...'}")
        sp = speedups(variants)
        for base in ("fused", "fp8_current"):
            slower = {n: v for n, v in sp.items() if v < 1.0 and _is_peer(n) and _base(n, variants) == base}
            if slower:
                out.append(f"- {label}: {base} is slower than " +
                           ", ".join(f"{PEER_LABELS.get(n, n)} ({v:.2f}x)" for n, v in slower.items()))
        if sp.get("unfused", 1.0) < 1.0:
            spread = " (their p20-p80 ranges overlap)" if _ranges_overlap(variants["fused"], variants["unfused"]) else ""
            out.append(f"- {label}: the fused plan is slower than the same ops unfused ({sp['unfused']:.2f}x){spread}")
    return out


def _plot(groups: dict, cases, path: str, title: str) -> bool:
    """Bar chart: the fused variant's speedup over each other variant, per case/config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    bars = []
    for (case, config), variants in groups.items():
        if case in cases:
            for name, v in speedups(variants).items():
                if _is_peer(name):
                    ours = " (ours: fp8_current)" if _base(name, variants) == "fp8_current" else ""
                    bars.append((f"{case}{'[' + config + ']' if config else ''} vs {name}{ours}", v))
    if not bars:
        return False
    fig, ax = plt.subplots(figsize=(8, 0.28 * len(bars) + 1.2))
    labels, values = zip(*bars)
    colors = ["tab:green" if v >= 1.0 else "tab:red" for v in values]
    # bars start at 1 (parity) on a log axis: 0.9x and 1.1x look alike in size, and 36x fits
    ax.barh(range(len(bars)), [v - 1.0 for v in values], left=1.0, color=colors)
    ax.set_xscale("log")
    lo, hi = min(min(values), 0.9), max(max(values), 1.1)
    ax.set_xlim(lo / 1.1, hi * 1.1)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.axvline(1.0, color="black", linewidth=0.8)
    for i, v in enumerate(values):
        ax.text(max(v, 1.0) * 1.02, i, f"{v:.2f}x", va="center", fontsize=6)
    ax.set_yticks(range(len(bars)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("fused speedup over each peer (time / fused; > 1: fused is faster)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _slug(title: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in title.split(" (")[0].lower()).strip("_")


def write_report(rows: list[dict], page: str) -> str:
    """Write the results page for ``rows`` (one run) to ``page``; plots go to ``docs/img/`` beside
    it. Returns the page's path."""
    meta = next((r for r in rows if r.get("case") == "ceiling"), rows[0])
    groups = _groups(rows)
    root = os.path.dirname(os.path.abspath(page))
    img_dir = os.path.join(root, "docs", "img")
    try:
        import matplotlib  # noqa: F401

        have_plots = True  # (imported again, with a non-interactive backend, by _plot)
        os.makedirs(img_dir, exist_ok=True)
    except ImportError:
        have_plots = False
    lines = [
        "# Benchmarks",
        "",
        "Generated by the benchmark harness from the rows of the command(s) below, run on the device below; do "
        "not edit by hand. How to run and read it: [docs/benchmarks.md](docs/benchmarks.md).",
    ]
    if groups:
        lines += _timing_header(rows, meta, groups)
        lines += _family_sections(groups, img_dir if have_plots else None)
    lines += convergence_section(rows, img_dir if have_plots else None)
    if groups:
        lines += _shortfall_lines(groups)
    if not have_plots:
        lines += ["", "(Plots need matplotlib: `pip install -e \".[bench]\"`, then "
                      "`python -m fusible_ops.bench --from DIR --report BENCHMARKS.md`.)"]
    with open(page, "w") as f:
        f.write("\n".join(lines) + "\n")
    return page


def _other_devices(rows: list[dict], meta: dict) -> list[str]:
    """A line per device other than ``meta``'s that timed rows of the page, naming its cases (ratios
    compare rows of one device only: each case runs its peers in the same process)."""
    cases: dict[str, list[str]] = {}
    for r in rows:
        dev = r.get("device")
        if dev and dev != meta.get("device") and r.get("case") not in ("ceiling", CONVERGENCE):
            cases.setdefault(dev, [])
            if r["case"] not in cases[dev]:
                cases[dev].append(r["case"])
    return [f"- Device of `{'`, `'.join(names)}`: {dev} (its peers in the same run)" for dev, names in cases.items()]


def _timing_header(rows: list[dict], meta: dict, groups: dict) -> list[str]:
    """The timing rows' device, date, commands, ceilings and how to read them; summary; targets."""
    fp8 = _num(meta.get("fp8_tflops"))
    floor = _num(meta.get("autograd_floor_ms"))
    dates = sorted(r["date_utc"] for r in rows if r.get("date_utc") and r.get("case") != CONVERGENCE)
    dates = dates or [meta.get("date_utc")]
    return [
        "",
        f"- Device: {meta.get('device')}; driver {meta.get('driver') or 'n/a'}; torch {meta.get('torch_version')}, "
        f"Triton {meta.get('triton_version')}",
        *_other_devices(rows, meta),
        f"- Date (UTC): {dates[0]}" + (f" to {dates[-1]}" if dates[-1] != dates[0] else ""),
        *[f"- Command: `{c}`" for c in dict.fromkeys(r.get("command") or "python -m fusible_ops.bench"
                                                      for r in rows if r.get("case") == "ceiling")],
        f"- Ceilings measured in this run: copy {_f(meta.get('copy_gbps'), 0)} GB/s (read + write), bf16 matmul "
        f"{_f(meta.get('matmul_tflops'), 1)} TFLOP/s" + (f", FP8 matmul {fp8:.1f} TFLOP/s" if fp8 else "") +
        (f"; autograd floor {floor:.3f} ms" if floor else ""),
        "- Every row is one forward + backward; median of CUDA-event times after warm-up, inputs rotated past "
        "the L2 cache; every variant's output and gradients were checked against the case's reference before "
        "timing, and the fused plan's rules were checked. `time / fused`: the row's time over the fused (bf16) "
        "variant's: above 1 the fused variant is that much faster; an FP8 or graphed row below 1 is that much "
        "faster than fused bf16. FP8 peers (torchao) are divided by our `fp8_current` instead. `peak MiB`: peak "
        "memory of one call above what was allocated before it. `saved MiB`: memory one forward keeps for its "
        "backward (allocated with the output alive, less the output; empty in rows of runs before it was "
        "measured). Both are empty for graphed variants, whose memory sits in the graph's pool from capture.",
        "",
        "## Summary",
        "",
        *_summary(groups),
        "",
        "## Targets",
        "",
        "The open issues' performance targets (`fusible_ops/bench/targets.py`) against these rows:",
        "",
        *target_lines(groups),
    ]


def _family_sections(groups: dict, img_dir: Optional[str]) -> list[str]:
    """One section per case family: its plot (``img_dir`` None: none) and table."""
    lines: list[str] = []
    families = list(FAMILIES)
    known = {c for _, cases in FAMILIES for c in cases}
    other = tuple(sorted({case for case, _ in groups} - known))
    if other:
        families.append(("Other", other))
    for title, cases in families:
        if not any(case in cases for case, _ in groups):
            continue
        lines += ["", f"## {title}", ""]
        if img_dir is not None:
            name = f"bench_{_slug(title)}.png"
            if _plot(groups, cases, os.path.join(img_dir, name), title):
                lines += [f"![{title}](docs/img/{name})", ""]
        lines += _hf_table(groups) if cases == ("hf_models",) else _family_table(groups, cases)
    return lines


def _shortfall_lines(groups: dict) -> list[str]:
    """The "Known shortfalls" section (:func:`shortfalls`, and the cases not in the run)."""
    sf = shortfalls(groups)
    from .cases import CASES

    missing = [c for c in CASES if c not in {case for case, _ in groups}]
    if missing:
        sf.append("- not in this run: " + ", ".join(f"`{c}`" for c in missing))
    return ["", "## Known shortfalls", ""] + (sf or ["- none in this run: every fused variant beat every peer."])


__all__ = ["FAMILIES", "load_rows", "shortfalls", "speedups", "write_report"]
