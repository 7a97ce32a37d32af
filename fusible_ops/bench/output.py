"""The rows of a harness run as files: the CSV and JSON-lines rows and the run's markdown table
(the results page is :mod:`.report`)."""

from __future__ import annotations

import csv
import json
import math
import os
from typing import Any

FIELDS = [
    "device", "torch_version", "triton_version", "date_utc", "case", "config", "variant", "shape", "dtype",
    "status", "median_ms", "p20_ms", "p80_ms", "host_ms", "queue_ahead", "pinned", "n_iters", "n_copies", "metric",
    "bytes", "flops", "gbps",
    "tflops", "ceiling", "pct_of_ceiling", "speedup_vs_eager", "speedup_vs_grouped_mm", "rel_err",
    "rules_forward", "rules_backward", "expected_rules", "first_call_s", "copy_gbps", "matmul_tflops",
    "autograd_floor_ms", "fp8_tflops", "peak_mib", "saved_mib", "driver", "command", "quick", "note",
    "tokens_per_s", "loss", "loss_ref", "grad_rel_err", "step_peak_mib",
]
"""The columns of a row (CSV header order)."""


def _fmt(v: Any, nd: int = 3) -> str:
    if v is None or v == "":
        return ""
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:.{nd}f}"
    return str(v)


def markdown_table(rows: list[dict], meta: dict) -> str:
    lines = [
        f"Device: {meta['device']}; torch {meta['torch_version']}, triton {meta['triton_version']}; "
        f"{meta['date_utc']}{' (--quick shapes)' if meta.get('quick') else ''}",
        "",
        f"Ceilings (same run): copy {meta['copy_gbps']:.0f} GB/s (read + write), "
        f"bf16 matmul {meta['matmul_tflops']:.1f} TFLOP/s ({meta['matmul_n']}^3 torch.mm)"
        + ("." if meta.get("autograd_floor_ms") is None else
           f"; autograd floor {meta['autograd_floor_ms']:.3f} ms (one op's forward + backward as issued, "
           "x * 1.5 on one element: no row timed as issued can be faster; a row whose device time is "
           "below it is host-bound whatever implements it)."),
        ("Host: pinned to one CPU core (--pin). " if meta.get("pinned") else "") + (
            "Times: device time, each call queued behind a GPU spin (--queue-ahead); host ms = host time to "
            "issue one call while the device is busy (not the eager host cost: see host_overhead)."
            if meta.get("queue_ahead") else
            "Times: as issued (a row whose host ms reaches its median ms is host-bound); host ms = host time "
            "to issue one call."),
        "",
        "| case | config | variant | shape | median ms | p20-p80 ms | host ms | GB/s | TFLOP/s | % of ceiling "
        "| vs eager | vs _grouped_mm | rules (fwd / bwd) | status |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        rules = ""
        if r["variant"] == "fused":
            fwd = ", ".join(r.get("rules_forward") or []) or "-"
            bwd = ", ".join(r.get("rules_backward") or []) or "-"
            rules = f"{fwd} / {bwd}"
        p = ""
        if r.get("p20_ms") is not None:
            p = f"{r['p20_ms']:.3f}-{r['p80_ms']:.3f}"
        spd = lambda v: "" if v is None else f"{v:.2f}x"  # noqa: E731
        pct = "" if r.get("pct_of_ceiling") is None else f"{r['pct_of_ceiling']:.1f}%"
        lines.append(
            f"| {r['case']} | {r.get('config') or ''} | {r['variant']} | {r.get('shape') or ''} "
            f"| {_fmt(r.get('median_ms'))} | {p} | {_fmt(r.get('host_ms'))} | {_fmt(r.get('gbps'), 0)} "
            f"| {_fmt(r.get('tflops'), 1)} | {pct} "
            f"| {spd(r.get('speedup_vs_eager'))} | {spd(r.get('speedup_vs_grouped_mm'))} | {rules} | {r['status']} |"
        )
    return "\n".join(lines)


def write_jsonl(rows: list[dict], path: str) -> None:
    """The rows as JSON lines (also written after every bench while a run goes on, so a run cut
    short keeps the rows it finished)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            clean = {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()}
            f.write(json.dumps(clean, default=str) + "\n")


def write_outputs(rows: list[dict], out_dir: str, stamp: str, table: str) -> dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"bench_{stamp}")
    paths = {"csv": base + ".csv", "jsonl": base + ".jsonl", "md": base + ".md"}
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (";".join(v) if isinstance(v, (list, tuple)) else ("" if v is None else v))
                        for k, v in r.items()})
    write_jsonl(rows, paths["jsonl"])
    with open(paths["md"], "w") as f:
        f.write(table + "\n")
    return paths


__all__ = ["FIELDS", "markdown_table", "write_jsonl", "write_outputs"]
