"""How the convergence case judges a training run against its reference: the metrics, the
references and the targets, in one place (used by :mod:`.convergence` when it runs and by the
results page, which recomputes them from the rows' curves).

Every metric compares two runs of the same steps on the same data in the same order, from the
same initial weights; a curve is a list of floats, one per step (train loss) or per evaluation
(validation loss).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

REFERENCES = {
    "ours_bf16": "torch_bf16",
    "ours_fp8_current": "ours_bf16",
    "ours_fp8_delayed": "ours_bf16",
    "ours_fp8_block": "ours_bf16",
    "moe_fp8": "moe_bf16",
    "torch_bf16_perturbed": "torch_bf16",
    "ours_fp8_current_e4m3": "ours_bf16",
    "ours_fp8_current_bf16head": "ours_bf16",
    "ours_fp8_current_refkernels": "ours_bf16",
    "ours_fp8_delayed_e4m3": "ours_bf16",
    "ours_fp8_delayed_bf16head": "ours_bf16",
    "moe_fp8_e4m3": "moe_bf16",
    "moe_fp8_bf16head": "moe_bf16",
}
"""The run each variant is judged against (``torch_bf16`` and ``moe_bf16`` are references only;
the diagnostics of :data:`.convergence.VARIANTS` against the reference of the variant they vary)."""

TARGETS = {
    "bf16": {"val_pct": 0.5},
    "fp8": {"val_pct": 1.0, "auc_pct": 1.0, "pearson": 0.999},
}
"""The issue's targets (issue 63), by the kind of comparison (:func:`kind_of`): ``val_pct``: the
final validation loss within this many % of the reference's; ``auc_pct``: the area under the
train-loss curve over the last half of training within this many %; ``pearson``: the
correlation of the smoothed train curves at least this."""

BF16_NOISE = {"val_pct": 0.17, "auc_pct": 0.12, "one_minus_r": 7.7e-5}
"""The bf16 noise floor of the CI-sized run (``QUICK_CONFIG``, 40 steps, CPU, torch 2.13): the
largest |figure| over eight pairs of runs that differ by rounding alone (same batches, same
weights to within bf16). Measured (val %, AUC %, 1 - r): torch_bf16 against the float32 model
from the float32 weights (0.08, 0.01, 1.1e-5) and from the bf16-rounded ones (0.17, 0.12,
6.7e-5); ours_bf16 against torch_bf16 (0.08, 0.03, 5.0e-6) and against float32 (0.16, 0.04,
9.0e-6); float32 from the two starts (0.09, 0.11, 6.0e-5); torch_bf16 from its weights times
``1 + 2^-8 N(0, 1)``, three seeds (<= 0.15, <= 0.04, <= 7.7e-5)."""

FP8_OVER_BF16 = 2.0**-4 / 2.0**-8
"""Unit roundoff of E4M3 (3 stored mantissa bits: 2^-4; every recipe's forward format, block
scaling's gradients too) over bf16's (7 bits: 2^-8): 16."""

CI_TARGETS = {
    "bf16": {"val_pct": max(TARGETS["bf16"]["val_pct"], 2 * BF16_NOISE["val_pct"])},
    "fp8": {"val_pct": round(FP8_OVER_BF16 * BF16_NOISE["val_pct"], 1),
            "auc_pct": round(FP8_OVER_BF16 * BF16_NOISE["auc_pct"], 1),
            "pearson": round(1 - FP8_OVER_BF16**2 * BF16_NOISE["one_minus_r"], 3)},
}
"""The bounds of the CI-sized run (tests/test_convergence.py), derived from :data:`BF16_NOISE`:

* bf16 (ours against torch): each bf16 run lies within the noise floor of the exact one, so two
  of them within twice it (0.34%); below the issue's 0.5%, which is kept: 0.5%.
* FP8 (against ours bf16): the figures scaled by how much coarser FP8 rounds than bf16,
  linearly for the differences (x16: val 2.7%, AUC 1.9%), and for 1 - r, which grows with the
  square of the noise, x256 (r >= 0.980). Linear scaling bounds what was measured: the weights
  of torch_bf16 perturbed by ``2^-4 N(0, 1)`` instead of ``2^-8 N(0, 1)`` (three seeds each) moved
  the final validation loss about as much (<= 0.30%), the AUC 10x (<= 0.40%) and 1 - r 11x
  (<= 8.8e-4).

Why looser than the issue's: 40 steps of 256 tokens end while the loss still falls steeply (from
5.5 to 3.1), so each figure is one sample of what the 2000-step run averages down, and the curves
are not smoothed (the window rounds to 1 step). Measured at this size: ours_bf16 -0.08% val;
the FP8 recipes and moe_fp8 val +0.02 to +0.34%, AUC +0.20 to +0.56%, r 0.9983 to 0.9993. A
defect that changes training beyond FP8-sized noise fails: every attention QKV weight's gradient
lost gives val -7.0%, AUC -4.8%."""

SMOOTH_FRACTION = 0.02
"""Smoothing window of the train curves, as a fraction of the steps (at least 1 step):
:func:`smooth` over 40 steps of a 2000-step run."""


def kind_of(variant: str) -> str:
    """``"fp8"`` for a variant whose GEMMs run in FP8 (judged on all three metrics), else
    ``"bf16"`` (judged on the final validation loss: ours against plain torch)."""
    return "fp8" if "fp8" in variant.split("_") else "bf16"


def smooth(curve: Sequence[float], window: int) -> list[float]:
    """Trailing moving average: entry i is the mean of ``curve[max(0, i - window + 1) : i + 1]``
    (the first ``window - 1`` entries average what there is). ``window`` >= 1."""
    if window < 1:
        raise ValueError(f"smooth: window must be >= 1, got {window}")
    out, acc = [], 0.0
    for i, v in enumerate(curve):
        acc += v
        if i >= window:
            acc -= curve[i - window]
        out.append(acc / min(i + 1, window))
    return out


def smooth_window(steps: int) -> int:
    """The smoothing window for a run of ``steps`` (:data:`SMOOTH_FRACTION`, at least 1)."""
    return max(1, round(SMOOTH_FRACTION * steps))


def _area(curve: Sequence[float]) -> float:
    """Trapezoid area under ``curve`` at unit spacing (one point: the point itself)."""
    if len(curve) == 1:
        return float(curve[0])
    return sum(curve) - 0.5 * (curve[0] + curve[-1])


def auc_diff_pct(curve: Sequence[float], ref: Sequence[float], start_fraction: float = 0.5) -> float:
    """Signed difference in % of the area under ``curve`` from the area under ``ref`` (trapezoids,
    one point per step), over the steps from ``start_fraction`` of the run to its end (the last
    half by default: the early drop, where any two runs agree, would dilute the difference).
    Positive: ``curve`` lies above ``ref`` (trains slower)."""
    if len(curve) != len(ref) or not curve:
        raise ValueError(f"auc_diff_pct: curves of {len(curve)} and {len(ref)} points (need the same, > 0)")
    start = min(int(len(ref) * start_fraction), len(ref) - 1)
    a, b = _area(curve[start:]), _area(ref[start:])
    return 100.0 * (a - b) / b


def pearson(a: Sequence[float], b: Sequence[float]) -> float:
    """Pearson correlation of two curves of the same length (1.0 when both are constant and
    equal, 0.0 when only one is constant)."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"pearson: curves of {len(a)} and {len(b)} points (need the same, >= 2)")
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    da, db = [x - ma for x in a], [y - mb for y in b]
    saa, sbb = sum(x * x for x in da), sum(y * y for y in db)
    if saa == 0.0 or sbb == 0.0:
        return 1.0 if saa == sbb and list(a) == list(b) else 0.0
    return sum(x * y for x, y in zip(da, db)) / math.sqrt(saa * sbb)


def smoothed_pearson(curve: Sequence[float], ref: Sequence[float], window: Optional[int] = None) -> float:
    """:func:`pearson` of the two train curves after :func:`smooth` (window
    :func:`smooth_window` of their length unless given): the per-step noise of the batches, the
    same in both runs, would otherwise dominate."""
    w = smooth_window(len(ref)) if window is None else window
    return pearson(smooth(curve, w), smooth(ref, w))


def final_diff_pct(value: float, ref: float) -> float:
    """Signed difference in % of ``value`` from ``ref`` (the final validation losses)."""
    return 100.0 * (value - ref) / ref


def compare(run: dict, ref: dict) -> dict:
    """The three figures of ``run`` against ``ref`` (each a dict with ``train_loss`` and
    ``val_loss`` curves): ``val_diff_pct`` (final validation loss), ``auc_diff_pct`` (last half
    of the train curve) and ``pearson`` (smoothed train curves)."""
    return {"val_diff_pct": final_diff_pct(run["val_loss"][-1], ref["val_loss"][-1]),
            "auc_diff_pct": auc_diff_pct(run["train_loss"], ref["train_loss"]),
            "pearson": smoothed_pearson(run["train_loss"], ref["train_loss"])}


def judge(figures: dict, bounds: dict) -> tuple[bool, list[str]]:
    """Whether ``figures`` (from :func:`compare`) meet ``bounds`` (keys of :data:`TARGETS`:
    ``val_pct`` and ``auc_pct`` bound the absolute differences, ``pearson`` is a minimum); returns
    (passed, the failures as text). A non-finite figure fails."""
    fails = []
    for key, figure in (("val_pct", "val_diff_pct"), ("auc_pct", "auc_diff_pct")):
        if key in bounds:
            v = figures[figure]
            if not (math.isfinite(v) and abs(v) <= bounds[key]):
                fails.append(f"{figure} {v:+.3f}% beyond {bounds[key]}%")
    if "pearson" in bounds:
        v = figures["pearson"]
        if not (math.isfinite(v) and v >= bounds["pearson"]):
            fails.append(f"pearson {v:.5f} < {bounds['pearson']}")
    return not fails, fails


def targets_for(config: Optional[str]) -> dict:
    """The bounds a configuration is judged by: :data:`CI_TARGETS` for the CPU-sized ``quick``
    (what they were derived for), the issue's :data:`TARGETS` for every other."""
    return CI_TARGETS if config == "quick" else TARGETS


def judge_rows(rows: list[dict]) -> None:
    """Fill each row's figures against its reference (:data:`REFERENCES`, the row of the same
    ``config``) in place: ``reference``, ``val_diff_pct``, ``auc_diff_pct``, ``pearson``,
    ``targets`` (the bounds applied, :func:`targets_for` the config), ``passed`` and
    ``failures``. The figures and ``passed`` stay None where the reference is not among ``rows``,
    either run did not finish, or the two ran another ``setup`` (sizes, steps, seeds, corpus)."""
    by = {(r.get("config"), r["variant"]): r for r in rows}
    for r in rows:
        ref_name = REFERENCES.get(r["variant"])
        r.update(reference=ref_name, val_diff_pct=None, auc_diff_pct=None, pearson=None, passed=None,
                 targets=None, failures=[])
        ref = by.get((r.get("config"), ref_name))
        if ref_name is None or ref is None:
            continue
        if r.get("status") != "ok" or ref.get("status") != "ok" or r.get("setup") != ref.get("setup"):
            continue
        bounds = targets_for(r.get("config"))[kind_of(r["variant"])]
        figures = compare(r, ref)
        passed, fails = judge(figures, bounds)
        r.update(figures, passed=passed, failures=fails, targets=bounds)


def targets_text(bounds: dict) -> str:
    """``bounds`` as the page states them (no ``|``: they go in a table cell), e.g. ``val
    within 1%, AUC within 1%, r >= 0.999``."""
    parts = []
    if "val_pct" in bounds:
        parts.append(f"val within {bounds['val_pct']:g}%")
    if "auc_pct" in bounds:
        parts.append(f"AUC within {bounds['auc_pct']:g}%")
    if "pearson" in bounds:
        parts.append(f"r >= {bounds['pearson']:g}")
    return ", ".join(parts)


__all__ = ["BF16_NOISE", "CI_TARGETS", "FP8_OVER_BF16", "REFERENCES", "SMOOTH_FRACTION", "TARGETS", "auc_diff_pct", "compare", "final_diff_pct", "judge",
           "judge_rows", "kind_of", "pearson", "smooth", "smooth_window", "smoothed_pearson", "targets_for", "targets_text"]
