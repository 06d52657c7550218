"""bench.paired: per-pair ratios, their 90 % interval, verdicts and the interleaving."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from bench.paired import MIN_PAIRS, alternate, paired, record, run_pairs, verdict


def test_the_median_is_that_of_the_per_pair_ratios_not_a_ratio_of_medians() -> None:
    """B / A pair by pair, then the median: a slow pair for both sides cancels out."""
    a = [1.0, 2.0, 10.0]
    b = [1.1, 2.4, 10.0]
    p = paired(a, b)
    assert p.ratios == pytest.approx((1.1, 1.2, 1.0))
    assert p.median == pytest.approx(1.1)
    assert p.median != pytest.approx(np.median(b) / np.median(a))  # (1.2)


def test_an_even_number_of_pairs_takes_the_mean_of_the_middle_two() -> None:
    """Four ratios 0.5, 1, 2, 4: the median is 1.5."""
    assert paired([2.0, 1.0, 1.0, 1.0], [1.0, 1.0, 2.0, 4.0]).median == pytest.approx(1.5)


def test_the_interval_contains_the_median_and_narrows_with_more_pairs() -> None:
    """The same noise, 8 pairs then 200: a narrower interval around the median each time."""
    rng = np.random.default_rng(7)
    widths = []
    for n in (8, 200):
        a = rng.uniform(1.0, 2.0, n)
        b = a * rng.normal(1.1, 0.1, n)
        p = paired(a.tolist(), b.tolist())
        assert p.lo is not None and p.hi is not None
        assert p.lo <= p.median <= p.hi
        assert p.lo < p.hi
        widths.append(p.hi - p.lo)
    assert widths[1] < widths[0] / 2


def test_the_interval_is_reproducible() -> None:
    """A fixed seed: the same samples give the same bounds."""
    a, b = [1.0, 1.2, 0.9, 1.1, 1.3], [1.1, 1.0, 1.2, 1.4, 1.0]
    assert paired(a, b) == paired(a, b)


def test_one_pair_has_no_interval_and_no_verdict() -> None:
    """A single ratio says nothing about the spread: bounds None, verdict undecided."""
    p = paired([2.0], [1.0])
    assert (p.median, p.lo, p.hi, p.half_width) == (0.5, None, None, None)
    result: dict[str, object] = {}
    record(result, "x_vs_y", p, 1.0)
    assert result == {"x_vs_y": 0.5, "x_vs_y_lo": None, "x_vs_y_hi": None,
                      "x_vs_y_verdict": "undecided"}  # fmt: skip


def test_bad_inputs_are_refused() -> None:
    """No pairs, unequal lengths or a zero baseline time are errors, not a ratio."""
    for a, b, match in (
        ([], [], "at least one"),
        ([1.0], [1.0, 2.0], "as many"),
        ([0.0, 1.0], [1.0, 1.0], "must be > 0"),
    ):
        with pytest.raises(ValueError, match=match):
            paired(a, b)


@pytest.mark.parametrize(
    ("lo", "hi", "target", "better", "expected"),
    [
        (0.90, 0.98, 1.0, "lower", "met"),
        (0.90, 1.00, 1.0, "lower", "met"),
        (1.01, 1.10, 1.0, "lower", "missed"),
        (0.95, 1.05, 1.0, "lower", "undecided"),
        (1.01, 1.10, 1.0, "higher", "met"),
        (0.80, 0.89, 0.9, "higher", "missed"),
        (0.85, 0.95, 0.9, "higher", "undecided"),
    ],
)
def test_the_verdict_is_judged_on_the_whole_interval(
    lo: float, hi: float, target: float, better: str, expected: str
) -> None:
    """Met or missed only when the interval lies on one side of the target."""
    assert verdict(lo, hi, target, better) == expected  # type: ignore[arg-type]


def test_record_adds_the_bounds_and_the_verdict() -> None:
    """`key`, `key_lo`, `key_hi`, `key_verdict`, and the interval's bounds around the median."""
    result: dict[str, object] = {"other": 1}
    record(result, "stall_vs_memcpy", paired([1.0] * 5, [0.9, 0.92, 0.95, 0.91, 0.93]), 1.05)
    assert result["stall_vs_memcpy_verdict"] == "met"
    lo, hi = result["stall_vs_memcpy_lo"], result["stall_vs_memcpy_hi"]
    assert isinstance(lo, float) and isinstance(hi, float)
    assert lo <= result["stall_vs_memcpy"] <= hi <= 0.95  # type: ignore[operator]
    assert result["other"] == 1


def test_too_few_pairs_get_an_interval_but_no_verdict() -> None:
    """All pairs well below the target: met with `MIN_PAIRS` of them, undecided with one less."""
    for n, expected in ((MIN_PAIRS - 1, "undecided"), (MIN_PAIRS, "met")):
        result: dict[str, object] = {}
        record(result, "r", paired([1.0] * n, [0.5 + 0.01 * i for i in range(n)]), 1.0)
        assert result["r_hi"] is not None and result["r_hi"] < 1.0  # type: ignore[operator]
        assert result["r_verdict"] == expected


def test_a_paired_figure_maps_through_an_increasing_function() -> None:
    """A ratio's interval as an overhead percentage: the same order, every figure mapped."""
    p = paired([1.0, 1.0, 1.0], [1.02, 1.04, 1.10])
    pct = p.map(lambda r: (r - 1) * 100)
    assert pct.median == pytest.approx(4.0)
    assert pct.lo == pytest.approx((p.lo - 1) * 100)  # type: ignore[operator]
    assert pct.hi == pytest.approx((p.hi - 1) * 100)  # type: ignore[operator]


def test_pairs_alternate_a_b_then_b_a() -> None:
    """Pair 0 runs A then B, pair 1 B then A, pair 2 A then B."""
    assert alternate(["a", "b"], 0) == ["a", "b"]
    assert alternate(["a", "b", "c"], 1) == ["c", "b", "a"]
    calls: list[str] = []

    def timed(name: str) -> float:
        calls.append(name)
        return 1.0

    a_s, b_s = run_pairs(lambda: timed("A"), lambda: timed("B"), pairs=3)
    assert calls == ["A", "B", "B", "A", "A", "B"]
    assert (a_s, b_s) == ([1.0] * 3, [1.0] * 3)


def test_run_pairs_adds_pairs_until_the_interval_is_narrow_enough() -> None:
    """Steady times stop at the minimum; ever-noisy ones at `max_pairs`; `on_pair` sees each."""
    a_s, _ = run_pairs(lambda: 1.0, lambda: 1.1, pairs=3, max_pairs=50, half_width=0.02)
    assert len(a_s) == 3
    noise = itertools.cycle([0.5, 2.0, 1.0, 3.0, 0.7])
    seen: list[int] = []
    a_s, b_s = run_pairs(
        lambda: 1.0, lambda: next(noise), pairs=3, max_pairs=12, half_width=0.02,
        on_pair=lambda i, a, b: seen.append(i),
    )  # fmt: skip
    assert len(a_s) == len(b_s) == 12 and seen == list(range(12))
    hw = paired(a_s, b_s).half_width
    assert hw is not None and hw > 0.02


def test_run_pairs_stops_at_its_time_budget() -> None:
    """A spent time budget ends the run after the minimum pairs, however wide the interval."""
    noise = itertools.cycle([0.5, 2.0, 1.0])
    a_s, _ = run_pairs(
        lambda: 1.0, lambda: next(noise), pairs=2, max_pairs=100, half_width=0.0, budget_s=0.0
    )
    assert len(a_s) == 2


@pytest.mark.parametrize("n", [5, 7, 9, 12, 30])
def test_the_90_percent_interval_covers_the_true_median_at_least_90_percent_of_the_time(
    n: int,
) -> None:
    """Coverage, simulated: per-pair ratios drawn from a known distribution (median 1.0), the
    share of runs whose interval holds 1.0. A bootstrap of the median covered 81-89 % at 5-30
    pairs (its resampled medians take only the sample's middle values), so two runs on the
    same machine gave intervals that did not overlap."""
    rng = np.random.default_rng(11)
    runs, covered = 2000, 0
    for _ in range(runs):
        a = rng.uniform(0.5, 2.0, n)
        b = a * np.exp(rng.normal(0.0, 0.1, n))  # (ratios log-normal around 1.0)
        p = paired(a.tolist(), b.tolist())
        assert p.lo is not None and p.hi is not None
        covered += p.lo <= 1.0 <= p.hi
    assert covered / runs >= 0.89, (n, covered / runs)
