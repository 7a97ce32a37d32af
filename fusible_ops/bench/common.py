"""Helpers shared by the benchmark modules (below :mod:`.harness` and :mod:`.host`, which both use
them): logging, the device's name, versions, freeing memory between cases, pinning to one core."""

from __future__ import annotations

import gc
import os
import platform
import sys

import torch


FP8_PEERS = ("torchao", "torch_scaled")
"""Name prefixes of peer variants that train in FP8."""


def is_fp8_variant(name: str) -> bool:
    """A variant that runs its GEMMs in FP8: ours (``fp8_current``, ``graphed_fp8``, ...) or an FP8
    peer (:data:`FP8_PEERS`). Rated against the FP8 matmul ceiling, held to the FP8 tolerance."""
    return "fp8" in name.split("_") or name.startswith(FP8_PEERS)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def versions() -> tuple[str, str]:
    try:
        import triton

        tv = triton.__version__
    except Exception:  # pragma: no cover
        tv = "none"
    return torch.__version__, tv


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} threads)"


def driver_version(device: torch.device) -> str:
    """The NVIDIA driver's version (``nvidia-smi``), or "" where there is none."""
    if device.type != "cuda":
        return ""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.split("\n")[0].strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def pin_to_one_core(device: torch.device, enabled: bool) -> str:
    """``--pin`` (CUDA, Linux): run this process on one CPU core, for steadier host times (on CPU
    the math's intra-op threads would share that core, so it is not done there). Returns a note
    for the report (empty when not pinned)."""
    if not enabled or device.type != "cuda" or not hasattr(os, "sched_setaffinity"):
        return ""
    core = max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    return f", pinned to CPU {core}"
