"""The examples run end to end (CPU here; the GPU run is marked ``gpu``): each exits non-zero when
its training loss does not decrease."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the example's own default paths
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)  # installed or not
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "moe_train.py"), *args], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "moe_dispatch_mlp" in out.stdout  # the plan it prints: the fused MoE rule runs
    return out.stdout


def test_moe_train_example_learns_on_cpu():
    _run("--device", "cpu")


@pytest.mark.gpu
def test_moe_train_example_learns_on_gpu():
    _run("--device", "cuda")
