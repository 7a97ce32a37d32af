"""CPU smoke test of the benchmark harness machinery (no timing is asserted)."""

import csv
import glob
import json
import os

import pytest
import torch

from fusible_ops.bench import CASES, FIELDS, main, percentile, routing_splits
from fusible_ops.bench import cases as bench_cases
from fusible_ops.bench.harness import measure_autograd_floor, n_copies_for

QUICK = ["--quick", "--no-compile", "--device", "cpu", "--warmup-ms", "1", "--rep-ms", "5"]


def _read(out_dir):
    (csv_path,) = glob.glob(os.path.join(out_dir, "bench_*.csv"))
    (jsonl_path,) = glob.glob(os.path.join(out_dir, "bench_*.jsonl"))
    assert glob.glob(os.path.join(out_dir, "bench_*.md"))
    with open(csv_path, newline="") as f:
        csv_rows = list(csv.DictReader(f))
    with open(jsonl_path) as f:
        json_rows = [json.loads(line) for line in f if line.strip()]
    return csv_rows, json_rows


def test_quick_run_writes_rows_with_all_fields(tmp_path, capsys):
    out = str(tmp_path / "res")
    rc = main(["bias_gelu", "swiglu", "--out", out, *QUICK])
    assert rc == 0
    csv_rows, json_rows = _read(out)
    assert len(csv_rows) == len(json_rows)
    for r in csv_rows:
        assert list(r) == FIELDS
    for r in json_rows:
        assert set(FIELDS) <= set(r)
    got = {(r["case"], r["variant"]) for r in json_rows}
    assert {("ceiling", "copy_bandwidth"), ("ceiling", "bf16_matmul"), ("ceiling", "autograd_floor")} <= got
    assert {("bias_gelu", "fused"), ("bias_gelu", "eager"), ("swiglu", "fused"), ("swiglu", "eager")} <= got
    assert not any(r["variant"] == "compile" for r in json_rows)  # --no-compile
    floor = next(r for r in json_rows if r["variant"] == "autograd_floor")
    assert floor["metric"] == "time" and 0 < floor["p20_ms"] <= floor["median_ms"] <= floor["p80_ms"]
    assert floor["pct_of_ceiling"] is None and floor["queue_ahead"] is False
    for r in json_rows:
        assert r["autograd_floor_ms"] == floor["median_ms"]
        if r is floor:
            continue
        assert r["status"] == "ok", r
        assert r["device"] and r["torch_version"] == torch.__version__ and r["date_utc"]
        assert r["median_ms"] > 0 and r["p20_ms"] <= r["median_ms"] <= r["p80_ms"]
        assert r["pct_of_ceiling"] > 0 and r["queue_ahead"] is False
        if r["case"] != "ceiling":
            assert 0 < r["host_ms"] <= r["p80_ms"]  # (CPU: the host time is the time)
        if r["case"] != "ceiling":
            assert r["metric"] == "bytes" and r["gbps"] > 0 and r["speedup_vs_eager"] > 0
            assert r["rel_err"] < 2e-2 and r["dtype"] == "bfloat16"
    fused = next(r for r in json_rows if (r["case"], r["variant"]) == ("bias_gelu", "fused"))
    assert "bias_activation" in fused["rules_forward"]
    assert "activation_bias_backward" in fused["rules_backward"]
    table = capsys.readouterr().out
    assert "| bias_gelu |" in table and "| median ms |" in table and "| host ms |" in table
    assert "autograd floor" in table


def test_missing_rule_blocks_timing(tmp_path, monkeypatch):
    def build(ctx):
        for b in bench_cases.bias_gelu(ctx):
            b.expected_rules = ("no_such_rule",)
            yield b

    monkeypatch.setitem(CASES, "bias_gelu", bench_cases.Case("patched", build))
    out = str(tmp_path / "res")
    assert main(["bias_gelu", "--out", out, *QUICK]) == 1
    _, rows = _read(out)
    fused = next(r for r in rows if (r["case"], r["variant"]) == ("bias_gelu", "fused"))
    assert fused["status"].startswith("error") and fused["median_ms"] is None


class _FakeCuda:
    """Stands in for the CUDA calls of :class:`Timer`, logging their order (no GPU needed)."""

    def __init__(self, monkeypatch, host_ms: float):
        self.log = []
        self.host_ms = host_ms
        self.now = 0.0
        log = self.log

        class Event:
            def __init__(self, enable_timing=False):
                self.id = len([e for e in log if e[0] == "new_event"])
                log.append(("new_event", self.id))

            def record(self):
                log.append(("record", self.id))

            def elapsed_time(self, other):
                return 1.0  # 1 ms between any two events

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append(("sleep", cycles)))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append(("sync",)))

    def call(self, i):  # a call whose host issue takes host_ms on the (fake) host clock
        self.log.append(("call", i))
        self.now += self.host_ms * 1e-3


@pytest.mark.parametrize("queue_ahead", [False, True])
def test_queue_ahead_queues_each_timed_call_behind_a_spin(monkeypatch, queue_ahead):
    """``--queue-ahead`` (structure, not timing): every timed call is issued between its two events
    right after a GPU spin long enough to cover 3x its measured host issue time plus the margin, so
    the device runs the call's kernels back to back; without it no spin is issued."""
    import time as _time

    from fusible_ops.bench import timing

    fake = _FakeCuda(monkeypatch, host_ms=2.0)
    monkeypatch.setattr(_time, "perf_counter", lambda: fake.now)
    timer = timing.Timer(torch.device("cuda"), warmup_ms=5.0, rep_ms=20.0, queue_ahead=queue_ahead)
    assert timer.queue_ahead is queue_ahead
    t = timer.time(fake.call)
    log = fake.log
    calls = [k for k, e in enumerate(log) if e[0] == "call"]
    timed = calls[-t.n_iters:]
    spins = [e[1] for e in log if e[0] == "sleep"]
    if not queue_ahead:
        assert not spins
    else:
        cycles_per_ms = timer.spin_cycles_per_ms()
        want = int((3 * 2.0 + timing.SPIN_MARGIN_MS) * cycles_per_ms)
        for k in timed:  # sleep, start event, the call, end event
            assert log[k - 2] == ("sleep", want) and log[k - 1][0] == "record" and log[k + 1][0] == "record", log[k - 2:k + 2]
        assert want >= 3 * 2.0 * cycles_per_ms
    assert t.host_ms == pytest.approx(2.0)
    assert timing.Timer(torch.device("cpu"), 1.0, 1.0, queue_ahead=True).queue_ahead is False


def test_list_and_unknown_case(capsys):
    assert main(["--list"]) == 0
    listed = capsys.readouterr().out
    for name in CASES:
        assert name in listed
    assert main(["no_such_case", "--out", "unused"]) == 2


def test_helpers():
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([1.0, 2.0], 20) == pytest.approx(1.2)
    assert n_copies_for(10**9, torch.device("cpu")) == 2
    for E, T in [(8, 16384), (64, 16384), (64, 512)]:
        for routing in ("uniform", "skewed"):
            s = routing_splits(E, T, routing)
            assert len(s) == E and sum(s) == T and min(s) >= 0
        s = routing_splits(E, T, "skewed")
        assert max(s) == min(T, 8 * T // E) and 0 in s


def test_host_overhead_case_runs_on_cpu(tmp_path, capsys):
    """``python -m fusible_ops.bench host_overhead`` on CPU: a table with every workload (no figure
    is asserted: this is a smoke test of the machinery)."""
    out = str(tmp_path / "host")
    assert main(["host_overhead", "--quick", "--device", "cpu", "--out", out]) == 0
    (path,) = glob.glob(os.path.join(out, "host_overhead_*.md"))
    table = open(path).read()
    for name in ("dense3", "swiglu", "residual_rmsnorm", "grouped_mlp_64e"):
        assert f"| {name} |" in table
    for name in ("llama_mlp_fp8_host", "dense_layers_fp8_host"):  # FP8 rows: every recipe, with launches
        for recipe in ("bf16", "fp8_current", "fp8_delayed", "fp8_block"):
            assert any(line.startswith(f"| {name} |") and f"| {recipe} |" in line for line in table.splitlines())
    assert "host_overhead on cpu" in capsys.readouterr().out


def test_host_workloads_stay_callable_when_collected():
    """The scripts (host_ab_bench, host_profile) collect every ``host_overhead`` workload before
    timing: each workload's functions (ours, torch.nn, functional) must still run and agree then."""
    from fusible_ops.bench.host import _workloads

    torch.manual_seed(0)
    workloads = list(_workloads(torch.device("cpu"), torch.float32, small=True))
    assert [w[0] for w in workloads] == ["dense3", "swiglu", "residual_rmsnorm", "grouped_mlp_64e"]
    for name, _, ours, ours_args, peer, peer_args, _, functional in workloads:
        y_peer = peer(*peer_args)
        torch.testing.assert_close(functional(*peer_args), y_peer, msg=name)
        assert ours(*ours_args).shape == y_peer.shape, name


def test_model_cases_and_report_page(tmp_path, monkeypatch):
    """The MoE layer and the FP8 variants run as harness cases (quick, CPU: FP8 as emulation), and
    ``--report`` writes the results page from the run; ``--from`` writes it again from the JSON
    lines alone. Without matplotlib the page has no plots and says how to get them."""
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (as on a core install: no plots)
    out, page = str(tmp_path / "res"), str(tmp_path / "BENCHMARKS.md")
    assert main(["mlp_block", "moe_layer:E8_k2_H128", "--out", out, "--report", page, *QUICK]) == 0
    _, rows = _read(out)
    by = {(r["case"], r["variant"]): r for r in rows}
    for key in [("mlp_block", "fused"), ("mlp_block", "fp8_current"), ("mlp_block", "fp8_block"),
                ("moe_layer", "fused"), ("moe_layer", "unfused"), ("moe_layer", "fp8_current"), ("moe_layer", "eager")]:
        assert by[key]["status"] == "ok", by[key]
        assert by[key]["command"].startswith("python -m fusible_ops.bench mlp_block")
    assert "moe_dispatch_mlp" in by[("moe_layer", "fused")]["rules_forward"]
    assert not any(r["variant"] == "graphed" for r in rows)  # (CUDA only)
    text = open(page).read()
    for needle in ("# Benchmarks", "Command: `python -m fusible_ops.bench mlp_block", "## Summary",
                   "## Dense MLP blocks", "## MoE layer", "| moe_layer | E8_k2_H128 | fp8_current |",
                   "## Known shortfalls", "pip install -e \".[bench]\""):
        assert needle in text, needle
    assert len(text.splitlines()) <= 400
    again = str(tmp_path / "again.md")
    assert main(["--from", out, "--report", again]) == 0
    assert open(again).read() == text


def test_shortfalls_name_failed_variants_slower_fused_and_fused_slower_than_unfused():
    """The page's "Known shortfalls": a variant that did not run (unavailable too), a peer faster
    than the fused variant, and a fused plan slower than the same ops unfused each get a line;
    a case where fused wins everywhere gets none."""
    from fusible_ops.bench.report import shortfalls

    ok = lambda ms: {"median_ms": ms, "status": "ok"}  # noqa: E731
    groups = {
        ("moe_layer", "E8"): {"fused": ok(10.0), "unfused": ok(9.0), "eager": ok(20.0),
                              "graphed_fp8": {"median_ms": None, "status": "unavailable: RuntimeError: x" * 20}},
        ("swiglu", ""): {"fused": ok(1.0), "eager": ok(0.5), "compile": ok(2.0)},
        ("bias_gelu", ""): {"fused": ok(1.0), "eager": ok(2.0), "unfused": ok(1.5)},
        ("moe_layer", "E128"): {"fused": {**ok(10.0), "p20_ms": 9.5, "p80_ms": 10.5},
                                "unfused": {**ok(9.9), "p20_ms": 9.0, "p80_ms": 9.6}},
    }
    lines = shortfalls(groups)
    assert any(s.startswith("- moe_layer[E8] / graphed_fp8: unavailable: RuntimeError") and len(s) < 200 for s in lines)
    assert "- moe_layer[E8]: the fused plan is slower than the same ops unfused (0.90x)" in lines
    assert "- swiglu: fused is slower than eager PyTorch (0.50x)" in lines
    assert "- moe_layer[E128]: the fused plan is slower than the same ops unfused (0.99x) (their p20-p80 ranges overlap)" in lines
    assert not any("bias_gelu" in s for s in lines)
    assert len(lines) == 4


def test_grouped_gemm_case_times_each_gemm_forward_only(tmp_path):
    """grouped_gemm: forward-only benches (nothing requires grad), ours against torch._grouped_mm
    for the forward, input-gradient and weight-gradient GEMMs; the outputs agree."""
    out = str(tmp_path / "res")
    assert main(["grouped_gemm", "--out", out, *QUICK]) == 0
    _, rows = _read(out)
    rows = [r for r in rows if r["case"] == "grouped_gemm"]
    configs = {r["config"] for r in rows}
    assert configs == {f"{s}_{k}" for s in ("fc1_8e", "fc1_64e", "fc1_128e") for k in ("fwd", "dgrad", "wgrad")} | {
        "fc1_128e_fwd_gather"}
    for r in rows:
        assert r["status"] == "ok", r
        assert r["variant"] in ("fused", "grouped_mm", "gather_then_fused") and r["metric"] == "flops" and r["tflops"] > 0
        assert r["rel_err"] < 2e-2
    assert {r["variant"] for r in rows if r["config"] == "fc1_128e_fwd_gather"} == {"fused", "grouped_mm",
                                                                                   "gather_then_fused"}


def test_moe_copies_case_checks_each_variant_against_index_select(tmp_path):
    """moe_copies: the token copies by scatter_copies and gather_rows at each MoE layer shape,
    forward only, each checked against index_select before timing."""
    out = str(tmp_path / "res")
    assert main(["moe_copies", "--out", out, *QUICK]) == 0
    _, rows = _read(out)
    rows = [r for r in rows if r["case"] == "moe_copies"]
    assert {r["variant"] for r in rows} == {"fused", "gather_rows", "index_select"} and len(rows) == 9
    for r in rows:
        assert r["status"] == "ok" and r["metric"] == "bytes" and r["gbps"] > 0, r
        assert r["rel_err"] == 0, r


def test_a_run_cut_short_keeps_the_rows_it_finished(tmp_path, monkeypatch):
    """The JSON lines are rewritten after every bench: a run killed mid-way (a device call's time
    limit) leaves the rows of the benches it finished."""
    from fusible_ops.bench import harness

    real, calls = harness.run_bench, []

    def cut(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # (not an Exception: the harness does not catch it)
        return real(*args, **kwargs)

    monkeypatch.setattr(harness, "run_bench", cut)
    out = str(tmp_path / "r")
    with pytest.raises(KeyboardInterrupt):
        main(["bias_gelu", "swiglu", "--out", out, *QUICK])
    (path,) = glob.glob(os.path.join(out, "bench_*.jsonl"))
    rows = [json.loads(line) for line in open(path)]
    assert {r["case"] for r in rows} == {"ceiling", "bias_gelu"}
    assert {r["variant"] for r in rows if r["case"] == "bias_gelu"} >= {"fused", "eager"}


def test_page_names_each_device_that_timed_rows():
    """Rows of one page timed on two devices: the header names the second and its cases (the
    ceilings and convergence rows do not count)."""
    from fusible_ops.bench.report import _other_devices

    meta = {"device": "H200"}
    rows = [{"case": "swiglu", "device": "H200"}, {"case": "hf_models", "device": "H100"},
            {"case": "hf_models", "device": "H100"}, {"case": "ceiling", "device": "H100"},
            {"case": "convergence", "device": "A100"}, {"case": "lm_head", "device": "H100"}]
    assert _other_devices(rows, meta) == ["- Device of `hf_models`, `lm_head`: H100 (its peers in the same run)"]
    assert _other_devices(rows[:1], meta) == []
