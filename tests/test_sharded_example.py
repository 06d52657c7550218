"""The sharded-state example end to end: FSDP2 + tensor parallel on CPU over gloo
(`tierpipe.dev.fsdp_tp`), saved through the real pipeline (nats-server, SeaweedFS, a node
agent), killed, restored on the same 2x2 mesh, on a 2x1 mesh and on a 4x2 mesh.

The first run trains every step, saving every `EVERY`, then holds until it is SIGKILLed: the
steps it trained past its newest save are the uninterrupted run the resumed one must match.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import Agent, Events, finish_ranks, torchrun_env
from tierpipe.dev import free_ports
from tierpipe.schemas import ShardVerified
from tierpipe.settings import Settings

# 18 rank processes in all (4 + 4 + 2 + 8), each importing torch: a loaded 2-core machine
# takes minutes, more than the suite's 180 s per test.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS, EVERY = 8, 3  # saves at steps 3 and 6; steps 7 and 8 compare the losses
REPO = Path(__file__).parent.parent


def launch(
    settings: Settings, job: str, mesh: tuple[int, int], out: Path, *extra: str
) -> list[subprocess.Popen[bytes]]:
    """The mesh's ranks, as torchrun starts them (one node)."""
    dp, tp = mesh
    world = dp * tp
    port = free_ports(1)[0]
    procs = []
    for rank in range(world):
        env = torchrun_env(settings, rank, world, port)
        args = ["--job", job, "--dp", str(dp), "--tp", str(tp), "--out", str(out), *extra]
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tierpipe.dev.fsdp_tp", *args], env=env, cwd=REPO
            )
        )
    return procs


def finish(procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    """Every rank exits 0 within `timeout`, else all are killed and the test fails."""
    finish_ranks(procs, timeout)


def records(out: Path, event: str) -> list[dict]:
    lines = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return [r for r in lines if r["event"] == event]


def test_fsdp_tp_restores_bitwise_on_any_mesh(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events, tmp_path: Path
) -> None:
    """A 2x2 FSDP2 + TP job saved and SIGKILLed restores bitwise on the same mesh and trains on
    exactly as the uninterrupted run did; on 2x1 and 4x2 meshes its gathered full tensors are
    bitwise the saved ones."""
    agent().wait_ready()
    run1 = tmp_path / "run1.jsonl"
    ranks = launch(settings, job, (2, 2), run1, "--steps", str(STEPS), "--every", str(EVERY),
                   "--hold")  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not run1.exists() or len(records(run1, "holding")) < 4:
            assert all(p.poll() is None for p in ranks), "a rank died before the kill"
            assert time.monotonic() < deadline, "the first run did not train its steps"
            time.sleep(0.2)
        newest = STEPS // EVERY * EVERY
        for rank in range(4):  # the newest save durable on this node's NVMe
            events.wait_for(
                lambda e, r=rank: isinstance(e, ShardVerified) and (e.rank, e.step) == (r, newest),
                kind="verified",
                timeout=120,
            )
    finally:
        for p in ranks:
            p.send_signal(signal.SIGKILL)
        for p in ranks:
            p.wait()
    saved = {r["step"]: r["digests"] for r in records(run1, "saved") if r["rank"] == 0}
    rngs = {(r["rank"], r["step"]): r["rng"] for r in records(run1, "saved")}
    assert sorted(saved) == [EVERY * i for i in range(1, STEPS // EVERY + 1)]
    assert len(saved[newest]) > 50  # (every parameter and optimizer tensor, gathered)
    losses = {(r["rank"], r["step"]): r["loss"] for r in records(run1, "step")}

    # The same mesh: bitwise, then the same losses as the uninterrupted run.
    run2 = tmp_path / "run2.jsonl"
    finish(launch(settings, job, (2, 2), run2, "--resume", "--steps", str(STEPS),
                  "--every", "0"), timeout=300)  # fmt: skip
    restored = records(run2, "restored")
    assert {r["step"] for r in restored} == {newest} and len(restored) == 4, restored
    assert {r["tier"] for r in restored} == {"nvme"}
    (first,) = [r for r in restored if r["rank"] == 0]
    assert first["digests"] == saved[newest]
    assert all(r["rng"] == rngs[(r["rank"], newest)] for r in restored)
    resumed = {(r["rank"], r["step"]): r["loss"] for r in records(run2, "step")}
    assert sorted({s for _, s in resumed}) == list(range(newest + 1, STEPS + 1))
    assert resumed == {k: v for k, v in losses.items() if k[1] > newest}

    # Fewer and more ranks: the gathered full tensors are the saved ones.
    for mesh in ((2, 1), (4, 2)):
        out = tmp_path / f"run-{mesh[0]}x{mesh[1]}.jsonl"
        finish(launch(settings, job, mesh, out, "--resume", "--steps", "0", "--every", "0"),
               timeout=300)  # fmt: skip
        restored = records(out, "restored")
        assert len(restored) == mesh[0] * mesh[1] and {r["step"] for r in restored} == {newest}
        assert {r["tier"] for r in restored} == {"nvme"}
        # Values that are not DTensors (the RNG state): rank r has saved rank r % 4's.
        assert all(r["rng"] == rngs[(r["rank"] % 4, newest)] for r in restored)
        (first,) = [r for r in restored if r["rank"] == 0]
        assert first["digests"] == saved[newest], f"{mesh}: a gathered tensor differs"
