"""`python -m bench reshard --quick` runs end to end (a small sharded state saved at world 4,
restored at 4, 2 and 8 against DCP; a DDP state in object storage) and its last JSON line has
the figures the issue names (the targets are the full run's business)."""

from __future__ import annotations

import pytest

from tests.conftest import run_bench

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

FIGURES = (
    "reshard_vs_dcp",
    "same_mesh_vs_dcp",
    "sharded_stall_vs_memcpy",
    "ddp_object_bytes_over_one_replica",
)


def test_bench_reshard_quick_reports_every_figure() -> None:
    """Every figure is a positive number, each candidate timed at every world size."""
    r, stderr = run_bench("reshard", "--quick", timeout=540)
    for key in FIGURES:
        assert isinstance(r.get(key), float) and r[key] > 0, (key, r.get(key, "missing"))
    for world in (2, 4, 8):
        for candidate in ("tierpipe", "dcp"):
            assert r[f"{candidate}_load_s_world{world}"] > 0
    # Declared replicated, the model is stored once per job (4 ranks, one replica and 4
    # headers); undeclared, every rank stores its own copy.
    assert 1.0 <= r["ddp_object_bytes_over_one_replica"] < 1.5
    assert r["ddp_nvme_bytes_per_node"] >= r["ddp_replica_bytes"]
    assert r["ddp_each_object_bytes_over_one_replica"] >= 4.0
    assert "the target" in stderr
