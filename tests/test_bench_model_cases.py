"""CPU smoke tests of the model-level benchmark cases (``dense_layers``, ``moe_layers``): every
variant that runs on CPU passes its float64 update check, rows carry the usual fields, and the
fused plans show the declared rules. No timing is asserted."""

import glob
import json
import math
import os
import torch

from fusible_ops.bench import CASES, main
from fusible_ops.bench.cases_model import DENSE_QUICK, MOE_QUICK, expected_rules, fp8_stack_tolerance
from fusible_ops.bench.harness import REL_ERR_TOL

QUICK = ["--quick", "--no-compile", "--device", "cpu", "--warmup-ms", "1", "--rep-ms", "5"]
CUDA_ONLY = {"graphed", "graphed_fp8", "torchao_tensorwise_compile", "torchao_rowwise_compile"}


def _rows(out_dir: str) -> list[dict]:
    (path,) = glob.glob(os.path.join(out_dir, "bench_*.jsonl"))
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r["case"] != "ceiling"]


def _tolerance(variant: str) -> float:
    return fp8_stack_tolerance(2) if "fp8" in variant.split("_") else REL_ERR_TOL


def test_registered():
    assert "dense_layers" in CASES and "moe_layers" in CASES


def test_quick_rows_pass_the_float64_update_check(tmp_path):
    out = str(tmp_path / "res")
    assert main(["dense_layers", "moe_layers", "--out", out, *QUICK]) == 0
    rows = _rows(out)
    by = {(r["case"], r["variant"]): r for r in rows}
    for case in ("dense_layers", "moe_layers"):
        assert {(case, "eager"), (case, "fused"), (case, "fp8_current")} <= set(by)
    assert {("dense_layers", "fp8_delayed"), ("dense_layers", "fp8_block")} <= set(by)
    for r in rows:
        assert r["variant"] not in CUDA_ONLY and "compile" not in r["variant"]  # CPU, --no-compile
        assert r["status"] == "ok", r
        err = float(r["rel_err"])
        assert math.isfinite(err) and 0 < err < _tolerance(r["variant"]), r  # eager is checked too (> 0)
        assert r["metric"] == "flops" and r["flops"] > 0 and r["tflops"] > 0 and r["median_ms"] > 0
        assert "peak_mib" in r  # (None on CPU: peak memory is measured on CUDA only)
    for case in ("dense_layers", "moe_layers"):
        fused = by[(case, "fused")]
        want = expected_rules(case, torch.device("cpu"), DENSE_QUICK if case == "dense_layers" else MOE_QUICK)
        assert fused["expected_rules"] == list(want) and len(want) == (1 if case == "dense_layers" else 2)
        for rule in want:
            assert rule in fused["rules_forward"] + fused["rules_backward"], (rule, fused["rules_forward"])


def test_dense_layers_fused_compile(tmp_path):
    """torch.compile of our stack on CPU (~20 s of compiling at the quick sizes)."""
    out = str(tmp_path / "res")
    args = [a for a in QUICK if a != "--no-compile"]
    assert main(["dense_layers", "--variants", "fused_compile", "--out", out, *args]) == 0
    by = {r["variant"]: r for r in _rows(out)}
    assert set(by) == {"eager", "fused_compile"}
    assert by["fused_compile"]["status"] == "ok" and float(by["fused_compile"]["rel_err"]) < REL_ERR_TOL
