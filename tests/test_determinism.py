"""Determinism: two training runs of the convergence model (dense and MoE, bf16 and FP8) from the
same weights on the same batches give bit-equal losses and parameters, under
``torch.use_deterministic_algorithms(True)``.

Why it holds (docs/training.md, "Determinism"): no kernel of ours sums in a run-dependent order.
The grouped and dense GEMMs (forward, input and weight gradients) give each output tile to one
program that loops over K in order (no split-K, no atomics); the MoE combine and gather sums,
the LM head's chunk sums and the norms' column sums add their partial sums in a fixed order; the
router's token order is a counting sort. The only atomics are ``tl.atomic_max`` on amaxes, whose
result does not depend on order. The torch ops we call on CUDA that are nondeterministic by
default (``scatter_add_`` of the router's counts) take torch's deterministic implementation
under the flag. :func:`test_kernels_use_no_order_dependent_atomics` keeps it so.

The GPU run is a subprocess: cuBLAS reads ``CUBLAS_WORKSPACE_CONFIG`` (which the flag requires)
when its handle is made, before any test of this process may have made one.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
KERNELS = ROOT / "fusible_ops" / "kernels"
ORDER_FREE_ATOMICS = {"atomic_max", "atomic_min", "atomic_xchg", "atomic_cas"}
"""Triton atomics whose result does not depend on the order the programs reach them (amaxes)."""

VARIANTS = ("ours_bf16", "ours_fp8_current", "ours_fp8_delayed", "ours_fp8_block", "moe_bf16", "moe_fp8")

_TWO_RUNS = r"""
import sys, torch
torch.use_deterministic_algorithms(True)
from fusible_ops.bench import convergence as conv
device, steps, variants = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
cfg = conv.QUICK_CONFIG
corpus = conv.load_corpus(cfg.corpus_bytes)
for v in variants:
    a, b = (conv.train(v, cfg, steps=steps, device=device, seed=3, data_seed=5, corpus=corpus) for _ in range(2))
    assert a["status"] == "ok" and b["status"] == "ok", (v, a["status"], b["status"])
    assert a["train_loss"] == b["train_loss"], (v, a["train_loss"], b["train_loss"])
    pa, pb = a["model"].state_dict(), b["model"].state_dict()
    assert pa.keys() == pb.keys(), v
    for k in pa:
        assert torch.equal(pa[k], pb[k]), (v, k, (pa[k].double() - pb[k].double()).abs().max().item())
    print(v, "bit-equal over", steps, "steps: final loss", a["train_loss"][-1], flush=True)
"""


def _two_runs(device: str, steps: int, variants) -> str:
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8", PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)  # (the library's default paths: Triton on CUDA, torch on CPU)
    out = subprocess.run([sys.executable, "-c", _TWO_RUNS, device, str(steps), ",".join(variants)],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.gpu
def test_twenty_gpu_steps_are_bit_equal_under_the_deterministic_flag():
    text = _two_runs("cuda", 20, VARIANTS)
    assert all(f"{v} bit-equal" in text for v in VARIANTS), text


def test_cpu_steps_are_bit_equal_under_the_deterministic_flag():
    """The same on CPU (FP8 emulated), for a few steps: nothing we call raises under the flag."""
    text = _two_runs("cpu", 3, ("ours_fp8_delayed", "moe_fp8"))
    assert "ours_fp8_delayed bit-equal" in text and "moe_fp8 bit-equal" in text, text


def _atomics(path: pathlib.Path) -> set[str]:
    """The names of the ``tl.atomic_*`` calls in a kernel file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr.startswith("atomic_"):
            found.add(node.func.attr)
    return found


def test_kernels_use_no_order_dependent_atomics():
    """An atomic add (or any atomic whose result depends on the order programs reach it) would
    make a kernel's sums run-dependent: a new one needs a deterministic path under
    ``torch.are_deterministic_algorithms_enabled()`` (or an error naming the kernel), and this
    test must then name it."""
    seen = {}
    for path in sorted(KERNELS.glob("*.py")):
        bad = _atomics(path) - ORDER_FREE_ATOMICS
        if bad:
            seen[path.name] = sorted(bad)
    assert not seen, f"order-dependent atomics in kernels: {seen}"
    assert _atomics(KERNELS / "fp8_cast.py") == {"atomic_max"}  # (the scan sees the amax atomics)
