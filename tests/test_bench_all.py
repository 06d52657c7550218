"""`python -m bench all --quick`: which benches it runs, how, its argument checks, and one real
dispatch (the fastest bench) with its JSON line."""

from __future__ import annotations

import sys

import pytest

from bench.__main__ import BENCHMARKS, QUICK, main, quick_runs
from tests.conftest import run_bench


def test_all_quick_runs_each_quick_bench_in_its_own_process_with_its_options() -> None:
    """Every quick bench is a known one, run as `python -m bench <name> <its options>`."""
    runs = quick_runs()
    assert [name for name, _ in runs] == list(QUICK)
    assert set(QUICK) <= set(BENCHMARKS)
    for name, cmd in runs:
        assert cmd[:4] == [sys.executable, "-m", "bench", name]
        assert cmd[4:] == list(QUICK[name])


def test_only_picks_a_subset_in_the_usual_order() -> None:
    """`--only overhead,stall` runs stall then overhead; an unknown name is refused."""
    assert [n for n, _ in quick_runs("overhead, stall")] == ["stall", "overhead"]
    for bad in ("", "stall,reshard", "nope"):
        with pytest.raises(ValueError, match="quick benches"):
            quick_runs(bad)


@pytest.mark.parametrize(
    "argv",
    [
        ["all"],  # (needs --quick)
        ["all", "--quick", "--size-gib", "1"],
        ["all", "--quick", "--reps", "3"],
        ["all", "--quick", "--only", "reshard"],
        ["stall", "--only", "stall"],
        ["stall", "--quick"],
    ],
)
def test_bad_all_arguments_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """A usage error (exit 2) before anything runs, and nothing on stdout."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert capsys.readouterr().out == ""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_all_quick_dispatches_and_prints_one_json_line_per_bench() -> None:
    """`all --quick --only plan` runs the bench and prints its figures under its name."""
    r, stderr = run_bench("all", "--quick", "--only", "plan", timeout=280)
    assert r["bench"] == "plan" and "error" not in r
    assert r["plan_s_1024x20"] > 0
    assert "all: -m bench plan" in stderr
