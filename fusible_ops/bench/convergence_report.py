"""The results page's "Convergence" section, from the rows of ``python -m fusible_ops.bench
convergence`` (``case == "convergence"``): per configuration a table (each variant against its
reference, :mod:`.convergence_metrics`, recomputed from the rows' curves) and a plot of the loss
curves (matplotlib; ``convergence.png`` for the first configuration, GPU first,
``convergence_<config>.png`` for others).
"""

from __future__ import annotations

import copy
import os
from typing import Optional

from .convergence_metrics import judge_rows, smooth, smooth_window, targets_text

CASE = "convergence"
CONFIG_ORDER = ("gpu", "quick")


def latest(rows: list[dict]) -> dict[str, dict[str, dict]]:
    """config -> {variant: row} of the convergence rows, a later row replacing an earlier one of
    the same config and variant (as the timing tables do); configs in :data:`CONFIG_ORDER` first."""
    out: dict[str, dict[str, dict]] = {}
    for r in rows:
        if r.get("case") == CASE:
            out.setdefault(r.get("config") or "", {})[r["variant"]] = r
    order = {c: i for i, c in enumerate(CONFIG_ORDER)}
    return dict(sorted(out.items(), key=lambda kv: order.get(kv[0], len(order))))


def _f(v, nd: int, suffix: str = "", sign: bool = False) -> str:
    if v is None:
        return ""
    return f"{v:+.{nd}f}{suffix}" if sign else f"{v:.{nd}f}{suffix}"


def convergence_table(rows: list[dict]) -> list[str]:
    """Markdown lines: per configuration, what it ran and one row per variant."""
    lines: list[str] = []
    for config, variants in latest(rows).items():
        judged = [copy.copy(r) for r in variants.values()]
        judge_rows(judged)
        any_row = judged[0]
        setup = any_row.get("setup") or {}
        corpus = setup.get("corpus") or {}
        lines += [
            f"Config `{config}`: {any_row.get('shape')}; {setup.get('steps')} steps of "
            f"{any_row.get('tokens_per_step')} tokens; corpus {corpus.get('train_bytes')} train / "
            f"{corpus.get('val_bytes')} validation bytes ({corpus.get('train_files')} / {corpus.get('val_files')} "
            f"files, digest {corpus.get('digest')}); {any_row.get('device')}, torch {any_row.get('torch_version')}, "
            f"Triton {any_row.get('triton_version')}; {any_row.get('date_utc')}; `{any_row.get('command')}`",
            "",
            "| variant | reference | final val loss | val vs ref | AUC vs ref (last half) | Pearson (smoothed) "
            "| tokens/s | peak MiB | target | result |",
            "|---|---|---:|---:|---:|---:|---:|---:|---|---|",
        ]
        for r in judged:
            if r.get("status") != "ok":
                result = str(r.get("status"))[:160]
            elif r.get("reference") is None:
                result = "reference"
            elif r.get("passed") is None:
                result = "reference not in this run"
            else:
                result = "pass" if r["passed"] else "**fail**: " + "; ".join(r.get("failures") or [])
            lines.append(
                f"| {r['variant']} | {r.get('reference') or ''} | {_f(r.get('final_val_loss'), 4)} "
                f"| {_f(r.get('val_diff_pct'), 3, '%', True)} | {_f(r.get('auc_diff_pct'), 3, '%', True)} "
                f"| {_f(r.get('pearson'), 5)} | {'shared' if r.get('shared_device') else _f(r.get('tokens_per_s'), 0)} | {_f(r.get('peak_mib'), 0)} "
                f"| {targets_text(r['targets']) if r.get('targets') else ''} | {result} |")
        lines.append("")
    return lines


def plot_convergence(variants: dict[str, dict], path: str, title: str) -> bool:
    """The train curves (smoothed, :func:`.convergence_metrics.smooth`) as lines and the
    validation losses as points, one colour per variant; left the whole run, right its last half
    (where the variants' differences show). False when no row has a curve."""
    runs = {n: r for n, r in variants.items() if r.get("train_loss")}
    if not runs:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, r) in enumerate(runs.items()):
        curve = r["train_loss"]
        sm = smooth(curve, smooth_window(len(curve)))
        c = colors[i % len(colors)]
        for k, ax in enumerate(axes):
            start = 0 if k == 0 else len(sm) // 2
            ax.plot(range(start + 1, len(sm) + 1), sm[start:], color=c, linewidth=1.0, label=name if k == 0 else None)
            pts = [(s, v) for s, v in zip(r.get("val_steps") or [], r.get("val_loss") or []) if s > start]
            if pts:
                ax.plot(*zip(*pts), "o", color=c, markersize=3.5)
    half = [v for r in runs.values() for v in smooth(r["train_loss"], smooth_window(len(r["train_loss"])))[
        len(r["train_loss"]) // 2:]]
    half += [v for r in runs.values() for s, v in zip(r.get("val_steps") or [], r.get("val_loss") or [])
             if s > len(r["train_loss"]) // 2]
    if half:
        lo, hi = min(half), max(half)
        pad = 0.05 * (hi - lo or 1.0)
        axes[1].set_ylim(lo - pad, hi + pad)
    from matplotlib.ticker import MaxNLocator

    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_title("whole run", fontsize=9)
    axes[1].set_title("last half", fontsize=9)
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("loss (nats / byte): train smoothed, validation dots")
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def convergence_section(rows: list[dict], img_dir: Optional[str]) -> list[str]:
    """The page's "Convergence" section (empty when ``rows`` hold none); plots into ``img_dir``
    (None: no plots)."""
    groups = latest(rows)
    if not groups:
        return []
    lines = ["", "## Convergence", "",
             "`python -m fusible_ops.bench convergence` ([docs/benchmarks.md](docs/benchmarks.md#convergence)): "
             "the same byte-level LM trained from the same weights on the same batches, as plain torch, as ours in "
             "bf16 and under each FP8 recipe, and as a MoE pair. `val vs ref`: final validation loss against the "
             "reference's; `AUC vs ref`: area under the train-loss curve over the last half of the steps; "
             "`Pearson`: correlation of the smoothed train curves; `peak MiB`: CUDA only.", ""]
    for i, (config, variants) in enumerate(groups.items()):
        if img_dir is not None:
            name = "convergence.png" if i == 0 else f"convergence_{config}.png"
            any_row = next(iter(variants.values()))
            title = f"convergence, config {config} ({any_row.get('shape')}), {any_row.get('device')}"
            if plot_convergence(variants, os.path.join(img_dir, name), title):
                lines += [f"![convergence {config}](docs/img/{name})", ""]
        lines += convergence_table([r for r in rows if r.get("case") == CASE and (r.get("config") or "") == config])
    return lines


__all__ = ["CASE", "convergence_section", "convergence_table", "latest", "plot_convergence"]
