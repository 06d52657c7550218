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
    for key in ("stall_vs_memcpy_under_pressure", "replica_vs_socket"):  # (pairs: an interval)
        if r[key] is not None:
            assert r[f"{key}_lo"] <= r[key] <= r[f"{key}_hi"], key
    if r["replica_vs_socket"] is not None:
        assert r["replica_vs_socket_verdict"] in ("met", "missed", "undecided")
