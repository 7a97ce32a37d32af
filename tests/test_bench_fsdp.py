"""CPU smoke tests of the harness case ``fsdp_layers`` (the ``dense_layers`` model under FSDP2):
at world 1 in this process (the case makes its own gloo group of one and ends it), every variant;
at world 2 under ``torchrun`` (gloo, ``--device cpu``; rank 0 writes the rows), the baseline and
FP8 with FP8 all-gather (the variant with the most communication: the global amax all-reduce and
the FP8 all-gather; starting two processes that import torch is most of that test's time). Every variant that runs on CPU
passes its float64 loss and gradient checks, and the check rejects a wrong gradient. No timing is
asserted."""

import math
import os
import subprocess
import sys

import torch
import torch.distributed as dist

from fusible_ops.bench import CASES, main
from fusible_ops.bench.cases import BenchContext
from fusible_ops.bench.cases_dist import DIST_CASES
from fusible_ops.bench.cases_fsdp import fsdp_layers
from fusible_ops.bench.cases_model import DENSE_QUICK, fp8_stack_tolerance
from fusible_ops.bench.harness import REL_ERR_TOL
from test_bench_model_cases import _rows  # (the rows of the run's one JSON-lines file, ceilings left out)

QUICK = ["--quick", "--no-compile", "--device", "cpu", "--warmup-ms", "1", "--rep-ms", "5"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _check_rows(rows: list[dict], world: int) -> dict:
    by = {r["variant"]: r for r in rows}
    assert len(by) == len(rows)
    fp8_bound = fp8_stack_tolerance(DENSE_QUICK["layers"])
    for r in rows:
        assert r["case"] == "fsdp_layers" and r["config"] == f"quick_w{world}", r
        assert r["status"] == "ok", r
        fp8 = "fp8" in r["variant"].split("_")
        # loss (the mean over the ranks) and gradients against the float64 run; > 0: really compared
        assert 0 < float(r["rel_err"]) < (fp8_bound if fp8 else REL_ERR_TOL), r
        assert 0 < r["grad_rel_err"] < (fp8_bound if fp8 else REL_ERR_TOL), r
        assert "worst gradient" in r["note"]
        assert r["loss_ref"] == rows[0]["loss_ref"] and math.isfinite(r["loss"])
        assert r["median_ms"] > 0 and r["tokens_per_s"] > 0 and r["flops"] > 0
    fused = by.get("fused")
    if fused is not None:
        assert fused["expected_rules"] == ["linear_add"] and "linear_add" in fused["rules_forward"]
    return by


def test_registered():
    assert "fsdp_layers" in CASES and "fsdp_layers" in DIST_CASES


def test_world_1_in_process(tmp_path):
    out = str(tmp_path / "res")
    assert main(["fsdp_layers", "--out", out, *QUICK]) == 0
    assert not dist.is_initialized()  # (the case ended the group it made)
    by = _check_rows(_rows(out), 1)
    assert set(by) == {"torch_fsdp2", "fused", "fp8_current", "fp8_current_fp8_all_gather", "fp8_delayed",
                       "fp8_block"}
    assert "torchao float8 peers need a CUDA GPU" in by["torch_fsdp2"]["note"]
    # FP8 all-gather gathers the bytes the unsharded weight's cast makes: the same first step
    a, b = by["fp8_current"], by["fp8_current_fp8_all_gather"]
    assert (a["loss"], a["grad_rel_err"]) == (b["loss"], b["grad_rel_err"])


def test_world_2_under_torchrun(tmp_path):
    out = str(tmp_path / "res")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "fusible_ops.bench", "fsdp_layers", "--variants", "fp8_current_fp8_all_gather",
           "--out", out, *QUICK]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    by = _check_rows(_rows(out), 2)  # (one file: rank 0's)
    assert set(by) == {"torch_fsdp2", "fp8_current_fp8_all_gather"}  # (the baseline always runs)


def test_the_check_rejects_a_wrong_gradient():
    """A variant whose reduced gradient of one weight is 10% off fails its check, naming it."""
    gen = fsdp_layers(BenchContext(device=torch.device("cpu"), quick=True, compile=False))
    try:
        bench = next(gen)
        inputs, _ = bench.new_copy()
        step = bench.variants["fused"].make(inputs)
        loss = step(*inputs)
        run = bench.check_output.__self__
        run.captured["layers.1.mlp.3.weight"] *= 1.1
        problem = bench.check_output(inputs, loss)
        assert problem is not None and "layers.1.mlp.3.weight" in problem, problem
        step = bench.variants["fused"].make(inputs)  # (a fresh model: the same first step passes)
        assert bench.check_output(inputs, step(*inputs)) is None
    finally:
        gen.close()
    assert not dist.is_initialized()
