"""The open performance targets of the project's issues, checked against a run's rows.

Each target reads the rows the results page is written from (:mod:`.report`); a target whose
rows are not in the run says so rather than guessing. The page lists every target with its
measured figure and whether it holds.
"""

from __future__ import annotations

from typing import Callable, Optional

Groups = dict  # (case, config) -> {variant: row}


def _get(groups: Groups, case: str, config: str, variant: str, key: str) -> Optional[float]:
    try:
        v = float(groups[(case, config)][variant][key])
    except (KeyError, TypeError, ValueError):
        return None
    return v if v == v else None


def rate(case: str, config: str, variant: str, goal: float, key: str = "tflops", unit: str = " TFLOP/s"):
    """The variant's rate (``key``) is at least ``goal``."""
    def check(groups: Groups):
        v = _get(groups, case, config, variant, key)
        return None if v is None else (f"{v:.1f}{unit}", v >= goal)
    return check


def pct(case: str, config: str, variant: str, goal: float):
    """The variant reaches ``goal`` % of its ceiling (measured in its run)."""
    return rate(case, config, variant, goal, "pct_of_ceiling", "%")


def faster(case: str, config: str, variant: str, than: str, goal: float):
    """``than``'s time / ``variant``'s time is at least ``goal``."""
    def check(groups: Groups):
        a, b = _get(groups, case, config, variant, "median_ms"), _get(groups, case, config, than, "median_ms")
        return None if a is None or b is None else (f"{b / a:.2f}x ({a:.3f} vs {b:.3f} ms)", b / a >= goal)
    return check


def kept(case: str, config: str, variant: str, than: str, goal: float):
    """The memory ``variant``'s forward keeps for backward is at most ``goal`` times ``than``'s."""
    def check(groups: Groups):
        a, b = _get(groups, case, config, variant, "saved_mib"), _get(groups, case, config, than, "saved_mib")
        return None if a is None or not b else (f"{a / b:.2f}x ({a:.0f} vs {b:.0f} MiB)", a / b <= goal)
    return check


def fastest_of(groups: Groups, case: str, config: str, variants) -> Optional[tuple[str, float]]:
    """(name, median ms) of the fastest of ``variants`` in the run, or None where none has a time."""
    times = [(v, _get(groups, case, config, v, "median_ms")) for v in variants]
    times = [(v, ms) for v, ms in times if ms is not None]
    return min(times, key=lambda t: t[1]) if times else None


def fastest(case: str, config: str, ours, peers, goal: float):
    """The fastest of ``ours`` is at least ``goal`` times as fast as the fastest of ``peers``."""
    def check(groups: Groups):
        a, b = fastest_of(groups, case, config, ours), fastest_of(groups, case, config, peers)
        if a is None or b is None:
            return None
        return f"{b[1] / a[1]:.2f}x ({a[0]} {a[1]:.1f} vs {b[0]} {b[1]:.1f} ms)", b[1] / a[1] >= goal
    return check


def step_peak(case: str, config: str, ours, than: str, goal: float):
    """The training step's peak memory (``step_peak_mib``) of the fastest of ``ours`` is at most
    ``goal`` times ``than``'s."""
    def check(groups: Groups):
        a = fastest_of(groups, case, config, ours)
        b = _get(groups, case, config, than, "step_peak_mib")
        m = None if a is None else _get(groups, case, config, a[0], "step_peak_mib")
        if m is None or not b:
            return None
        return f"{m / b:.2f}x ({a[0]} {m / 1024:.1f} vs {than} {b / 1024:.1f} GiB)", m / b <= goal
    return check


HF_OURS_BF16 = ("fused", "fused_compile")
HF_BF16_PEERS = ("eager", "compile", "liger")
"""Ours and the peers of the ``hf_models`` bf16 targets (FP8: ``fp8_current`` vs torchao)."""


def hidden(case: str, config: str, goal: float):
    """Of the exchange's time alone (config ``<config>_comm``, variant ``comm_alone``), the fraction
    the overlap hides: ``(no_overlap - fused) / comm_alone`` is at least ``goal``."""
    def check(groups: Groups):
        a, b = _get(groups, case, config, "fused", "median_ms"), _get(groups, case, config, "no_overlap", "median_ms")
        c = _get(groups, case, f"{config}_comm", "comm_alone", "median_ms")
        if a is None or b is None or not c:
            return None
        return f"{(b - a) / c:.0%} ({b:.3f} - {a:.3f} of {c:.3f} ms)", (b - a) / c >= goal
    return check


TARGETS: list[tuple[int, str, Callable]] = [
    (44, "MoE layer E128 H1536 bf16 fwd+bwd >= 450 TFLOP/s", rate("moe_layer", "E128_k8_H1536", "fused", 450)),
    (44, "MoE layer E128 H2048 bf16 >= 520 TFLOP/s", rate("moe_layer", "E128_k8_H2048", "fused", 520)),
    (44, "MoE layer E8 H4096 bf16 >= 620 TFLOP/s", rate("moe_layer", "E8_k2_H4096", "fused", 620)),
    (44, "MoE layer E8 H4096 FP8 current >= 1.3x our bf16", faster("moe_layer", "E8_k2_H4096", "fp8_current", "fused", 1.3)),
    *[(44, f"8-expert FC1 {g}, bf16 >= 90% of the dense bf16 ceiling", pct("grouped_gemm", f"fc1_8e_{g}", "fused", 90))
      for g in ("fwd", "dgrad", "wgrad")],
    *[(44, f"8-expert FC1 {g}, FP8 >= 90% of the dense FP8 ceiling", pct("grouped_gemm", f"fc1_8e_{g}", "fp8_current", 90))
      for g in ("fwd", "dgrad", "wgrad")],
    *[(44, f"8-expert FC1 {g}, FP8 >= 1.05x torch._scaled_grouped_mm",
       faster("grouped_gemm", f"fc1_8e_{g}", "fp8_current", "torch_scaled_grouped_mm", 1.05)) for g in ("fwd", "dgrad")],
    (44, "8-expert FC1 wgrad, FP8 >= 850 TFLOP/s", rate("grouped_gemm", "fc1_8e_wgrad", "fp8_current", 850)),
    (44, "8-expert FC1 fwd, FP8 block-scaled >= 1000 TFLOP/s", rate("grouped_gemm", "fc1_8e_fwd", "fp8_block", 1000)),
    (44, "MoE layer E128 H1536: activations kept for backward <= 0.35x the eager composition's",
     kept("moe_layer", "E128_k8_H1536", "fused", "eager", 0.35)),
    (44, "grouped MLP 64e, FP8 current >= 1.25x our bf16 graphed",
     faster("grouped_mlp_64e", "uniform", "graphed_fp8", "graphed", 1.25)),
    (44, "grouped MLP 8e, FP8 block >= 1.2x our bf16", faster("grouped_mlp_8e", "uniform", "fp8_block", "fused", 1.2)),
    (42, "d=4096 stack: ours eager >= 1.03x torch.compile", faster("dense_layers", "L2_d4096", "fused", "compile", 1.03)),
    (42, "d=4096 stack: ours + compile >= 1.03x torch.compile",
     faster("dense_layers", "L2_d4096", "fused_compile", "compile", 1.03)),
    (42, "d=4096 stack: FP8 current eager >= 1.45x torch.compile bf16",
     faster("dense_layers", "L2_d4096", "fp8_current", "compile", 1.45)),
    (42, "d=4096 stack: FP8 current >= 1.2x torchao tensorwise + compile",
     faster("dense_layers", "L2_d4096", "fp8_current", "torchao_tensorwise_compile", 1.2)),
    (42, "d=2048 stack: FP8 eager >= 1.15x our bf16 eager", faster("dense_layers", "L4_d2048", "fp8_current", "fused", 1.15)),
    (42, "d=2048 stack: FP8 graphed >= 1.3x our bf16 graphed",
     faster("dense_layers", "L4_d2048", "graphed_fp8", "graphed", 1.3)),
    (64, "HF Llama-3-8B-shaped, 2 layers, bf16 step: ours (fused or fused_compile) >= 1.05x the fastest bf16 peer "
         "(HF eager, compile, Liger)", fastest("hf_models", "llama3_8b_L2", HF_OURS_BF16, HF_BF16_PEERS, 1.05)),
    (64, "HF Llama-3-8B-shaped bf16: that variant's step peak memory <= Liger's",
     step_peak("hf_models", "llama3_8b_L2", HF_OURS_BF16, "liger", 1.0)),
    (64, "HF Llama-3-8B-shaped FP8: ours (fp8_current) >= 1.2x torchao float8 tensorwise + compile",
     faster("hf_models", "llama3_8b_L2", "fp8_current", "torchao_tensorwise_compile", 1.2)),
    (64, "HF Qwen3-30B-A3B-shaped, 2 layers, bf16 step: ours >= 1.3x the fastest bf16 peer",
     fastest("hf_models", "qwen3_30b_a3b_L2", HF_OURS_BF16, HF_BF16_PEERS, 1.3)),
    (64, "HF Qwen3-30B-A3B-shaped bf16: that variant's step peak memory <= 0.7x HF eager's",
     step_peak("hf_models", "qwen3_30b_a3b_L2", HF_OURS_BF16, "eager", 0.7)),
    (46, "EP=2 step <= 1.25x the one-GPU step (per-GPU throughput >= 0.8x)",
     faster("ep_moe", "ep2", "fused", "single_gpu", 0.8)),
    (46, "EP=2: hidden fraction of the all-to-alls >= 70%", hidden("ep_moe", "ep2", 0.7)),
]
"""(issue, target, check): ``check(groups)`` gives ``(measured, met)``, or None when the rows
it needs are not in the run."""


def target_lines(groups: Groups) -> list[str]:
    """The page's table of targets: measured figure and whether it holds."""
    lines = ["| issue | target | measured | met |", "|---:|---|---|---|"]
    for issue, what, check in TARGETS:
        got = check(groups)
        measured, met = ("not in this run", "-") if got is None else (got[0], "yes" if got[1] else "**no**")
        lines.append(f"| {issue} | {what} | {measured} | {met} |")
    return lines


__all__ = ["HF_BF16_PEERS", "HF_OURS_BF16", "TARGETS", "faster", "fastest", "fastest_of", "hidden", "kept", "pct", "rate",
           "step_peak", "target_lines"]
