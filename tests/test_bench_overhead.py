"""`python -m bench overhead` runs end to end (small and short here) and reports what it says."""

from __future__ import annotations

import pytest

from bench import overhead

pytestmark = pytest.mark.slow


def test_the_overhead_bench_reports_overhead_and_what_explains_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(overhead, "STEPS", 40)
    monkeypatch.setattr(overhead, "EVERY", 20)
    r = overhead.run(0.005, 1)
    assert r["saves_per_run"] == 2 and r["base_s"] > 0
    for mode in ("blocking", "overlapped"):
        assert isinstance(r[f"overhead_pct_{mode}"], float)
        assert 0 < r[f"stall_s_per_save_{mode}"] < r["base_s"]
        assert set(r[f"explained_pct_{mode}"]) == {"stall", "agent_cpu"}
    assert r["agent_cpu_s_per_save"] > 0  # (the agent wrote and verified every save)
