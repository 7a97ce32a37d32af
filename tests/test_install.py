"""What a plain install meets: ``import fusible_ops`` and a CPU training call work without Triton
(a CPU-only install does not need it: pyproject puts it in the ``test`` extra), and importing the
package prints no warning."""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-W", "error", "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=300)


def test_cpu_training_call_without_triton():
    proc = _run("""
        import sys

        class NoTriton:  # as on a CPU-only install
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError("triton is not installed")

        sys.meta_path.insert(0, NoTriton())
        import torch
        import fusible_ops as fo

        seq = fo.Sequential(fo.RMSNorm(32), fo.Linear(32, 64), fo.SwiGLU(), fo.Linear(32, 32), fo.AddExtraInput())
        x = torch.randn(4, 32, requires_grad=True)
        seq(x, x).sum().backward()
        assert x.grad is not None and "triton" not in sys.modules
        assert "linear_bias_activation" in [g["rule"] for g in seq.fusion_plan()]
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_import_prints_no_warning():
    proc = _run("import fusible_ops")  # (-W error: any warning fails the import)
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr


def test_dependencies():
    """Core: torch and numpy (without numpy, ``import torch`` warns "Failed to initialize NumPy").
    Triton only in the test extra (the interpreter; torch's CUDA wheels bring their own); matplotlib
    and the peers the harness times (torchao, liger-kernel) only in the bench extra."""
    tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    names = lambda reqs: {r.split(";")[0].split(">")[0].split("=")[0].strip() for r in reqs}  # noqa: E731
    assert names(project["dependencies"]) == {"torch", "numpy"}
    assert "triton" in names(project["optional-dependencies"]["test"])
    assert names(project["optional-dependencies"]["bench"]) == {"matplotlib", "torchao", "liger-kernel"}
