"""The results page's target table (fusible_ops.bench.targets): measured, met or not, and rows
missing from a run said so (never a guess)."""

from fusible_ops.bench import targets as tg


def _groups(**rows):
    return {("c", "x"): rows}


def test_rate_pct_and_faster_read_the_rows():
    g = _groups(fused={"tflops": 500.0, "median_ms": 2.0, "pct_of_ceiling": 91.0}, peer={"median_ms": 2.2})
    assert tg.rate("c", "x", "fused", 450)(g) == ("500.0 TFLOP/s", True)
    assert tg.rate("c", "x", "fused", 520)(g)[1] is False
    assert tg.pct("c", "x", "fused", 90)(g) == ("91.0%", True)
    measured, met = tg.faster("c", "x", "fused", "peer", 1.05)(g)
    assert met and measured.startswith("1.10x")
    assert tg.faster("c", "x", "fused", "peer", 1.2)(g)[1] is False


def test_kept_memory_is_lower_is_better():
    g = _groups(fused={"saved_mib": 30.0}, eager={"saved_mib": 100.0})
    assert tg.kept("c", "x", "fused", "eager", 0.35)(g) == ("0.30x (30 vs 100 MiB)", True)
    assert tg.kept("c", "x", "fused", "eager", 0.25)(g)[1] is False
    assert tg.kept("c", "x", "fused", "other", 0.35)(g) is None


def test_hidden_fraction_of_the_exchange():
    g = {("ep_moe", "ep2"): {"fused": {"median_ms": 7.0}, "no_overlap": {"median_ms": 10.0}},
         ("ep_moe", "ep2_comm"): {"comm_alone": {"median_ms": 4.0}}}
    assert tg.hidden("ep_moe", "ep2", 0.7)(g) == ("75% (10.000 - 7.000 of 4.000 ms)", True)
    assert tg.hidden("ep_moe", "ep2", 0.8)(g)[1] is False
    del g[("ep_moe", "ep2_comm")]
    assert tg.hidden("ep_moe", "ep2", 0.7)(g) is None


def test_missing_rows_are_not_guessed():
    g = _groups(fused={"tflops": None, "median_ms": "nan"})
    assert tg.rate("c", "x", "fused", 1)(g) is None
    assert tg.faster("c", "x", "fused", "peer", 1)(g) is None
    assert tg.rate("other", "x", "fused", 1)(g) is None
    lines = tg.target_lines({})
    assert len(lines) == 2 + len(tg.TARGETS)
    assert all("not in this run" in line for line in lines[2:])


def test_saved_mib_is_the_forward_memory_less_the_output(monkeypatch):
    """The harness's kept-activation figure, with CUDA's memory counter stood in for (CPU run)."""
    import torch

    from fusible_ops.bench import harness

    readings = iter([10 * 2**20, 10 * 2**20 + 3 * 2**20 + 4096])  # before, after the forward
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: next(readings))
    out = torch.empty(1024)  # 4096 bytes: the output is not counted as kept

    def fwd(x):
        return out

    x = torch.ones(1, requires_grad=True)
    assert harness._saved_mib(fwd, (x,), [x], torch.device("cuda")) == 3.0
    assert harness._saved_mib(fwd, (x,), [], torch.device("cuda")) is None  # forward-only bench
    assert harness._saved_mib(fwd, (x,), [x], torch.device("cpu")) is None
