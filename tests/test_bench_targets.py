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


def test_missing_rows_are_not_guessed():
    g = _groups(fused={"tflops": None, "median_ms": "nan"})
    assert tg.rate("c", "x", "fused", 1)(g) is None
    assert tg.faster("c", "x", "fused", "peer", 1)(g) is None
    assert tg.rate("other", "x", "fused", 1)(g) is None
    lines = tg.target_lines({})
    assert len(lines) == 2 + len(tg.TARGETS)
    assert all("not in this run" in line for line in lines[2:])
