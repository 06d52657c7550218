"""`python -m bench rpo --quick` runs end to end (one small trial per mode) and its last JSON line
has the figures the issue names, of the right types (the targets are the full run's business)."""

from __future__ import annotations

import pytest

from tests.conftest import run_bench

pytestmark = pytest.mark.slow

#: The keys the issue names, and what each may be (None: not measurable in this build).
FIGURES = {
    "lost_intervals_max_replicas_on": (int,),
    "lost_s_over_upload_s_max_replicas_off": (float,),
    "nvme_highwater_ckpts_max": (int,),
    "stall_vs_memcpy_under_pressure": (float,),
    "replica_vs_socket": (float, type(None)),
    "restore_s_median_replicas_on": (float,),
}


def test_bench_rpo_quick_reports_every_figure() -> None:
    r, stderr = run_bench("rpo", "--quick", "--seed", "7", timeout=420)
    for key, types in FIGURES.items():
        assert isinstance(r.get(key, "missing"), types), (key, r.get(key, "missing"))
    assert r["seed"] == 7 and "seed 7" in stderr  # (the kill moments' RNG, printed)
    for mode in ("replicas_off", "replicas_on"):
        lost = r[f"lost_intervals_{mode}"]
        assert len(lost) == r["trials"] == 1 and all(isinstance(x, int) and x >= 0 for x in lost)
        assert all(s >= 0 for s in r[f"lost_s_{mode}"])
        assert all(0 < s < 120 for s in r[f"restore_s_{mode}"])
        assert r[f"nvme_highwater_ckpts_{mode}"][0] >= 1  # (the sampler saw the saves)
        assert r[f"upload_s_{mode}"] > 0
    assert r["lost_intervals_max_replicas_on"] == max(r["lost_intervals_replicas_on"])
    assert r["nvme_highwater_ckpts_max"] == max(
        r["nvme_highwater_ckpts_replicas_off"] + r["nvme_highwater_ckpts_replicas_on"]
    )
    assert isinstance(r["socket_mib_s"], float) and r["socket_mib_s"] > 0
    assert "trial rpo-on-0: rank" in stderr and "the target" in stderr
    for key in ("stall_vs_memcpy_under_pressure", "replica_vs_socket", "stall_late_vs_early"):
        if r[key] is not None:
            assert r[f"{key}_lo"] <= r[key] <= r[f"{key}_hi"], key
    for key in ("replica_vs_socket", "stall_late_vs_early"):  # (judged on the interval)
        if r[key] is not None:
            assert r[f"{key}_verdict"] in ("met", "missed", "undecided"), key


def test_late_saves_are_paired_with_early_saves_of_the_same_rank() -> None:
    """`stall_late_vs_early` is judged on pairs (a rank's i-th save of the run's first half, its
    i-th of the second half), so it gets an interval and a verdict only where the spread allows
    one: a ratio of two medians passed or failed its target by chance (1.27-1.70 over four runs
    of the same commit)."""
    from bench.rpo import WARMUP_SAVES, _late_vs_early

    saved = [{"step": s, "rank": r, "stall_s": (1.0 + r) * (2.0 if s >= 6 else 1.0)}
             for s in range(WARMUP_SAVES, 10) for r in (0, 1)]  # fmt: skip
    saved.append({"step": 9, "rank": 2, "stall_s": 9.0})  # (a rank with no early save: no pair)
    pairs = _late_vs_early([{"step": s, "rank": 0, "stall_s": 1.0} for s in range(WARMUP_SAVES)]
                           + saved)  # fmt: skip
    assert sorted(pairs) == sorted([(1.0, 2.0)] * 4 + [(2.0, 4.0)] * 4)
    assert _late_vs_early(saved[:4]) == []  # (too few steps to halve)
