"""`python -m bench overhead` runs end to end (small and short here) and reports what it says."""

from __future__ import annotations

import pytest

from bench import overhead

pytestmark = pytest.mark.slow


def test_the_overhead_bench_reports_overhead_and_what_explains_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Paired rounds: each mode's overhead with its interval and verdict, and what explains it."""
    monkeypatch.setattr(overhead, "STEPS", 40)
    monkeypatch.setattr(overhead, "EVERY", 20)
    monkeypatch.setattr(overhead, "MAX_ROUNDS", 3)
    r = overhead.run(0.005, 2)
    assert r["saves_per_run"] == 2 and r["base_s"] > 0
    assert 2 <= r["reps"] <= 3
    assert isinstance(r["interval_reached"], bool)
    for mode in ("blocking", "overlapped"):
        pct = r[f"overhead_pct_{mode}"]
        assert isinstance(pct, float)
        assert r[f"overhead_pct_{mode}_lo"] <= pct <= r[f"overhead_pct_{mode}_hi"]
        assert r[f"overhead_pct_{mode}_verdict"] in ("met", "missed", "undecided")
        assert 0 < r[f"stall_s_per_save_{mode}"] < r["base_s"]
        assert set(r[f"explained_pct_{mode}"]) == {"stall", "agent_cpu"}
    assert r["agent_cpu_s_per_save"] > 0  # (the agent wrote and verified every save)


def test_a_spent_time_budget_ends_the_run_after_two_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """No time left: two rounds (an interval), not the five asked for, and the figures still."""
    monkeypatch.setattr(overhead, "STEPS", 20)
    monkeypatch.setattr(overhead, "EVERY", 10)
    monkeypatch.setattr(overhead, "BUDGET_S", 0.0)
    r = overhead.run(0.005, 5)
    assert r["reps"] == 2
    assert r["overhead_pct_blocking_lo"] is not None
    assert r["overhead_pct_blocking_verdict"] == "undecided"  # (fewer than 5 pairs)
