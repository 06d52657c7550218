"""The job-state keys each role may write under deploy/nats-server.conf's per-role permissions:
KV write is as strong as stream write (a forged head or binding misleads readers), so each role
gets the keys it writes and no more (issue 20, item 7). Own nats-server, real KV."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from tests.test_deploy import per_role_block
from tierpipe.bus.client import Bus
from tierpipe.control.kvstate import JobStore
from tierpipe.dev import NatsServer
from tierpipe.settings import Settings


def _refused(settings: Settings, key: str) -> bool:
    """Whether a put of `key` with `settings`' credentials is refused (never stored)."""

    async def main() -> bool:
        async with Bus(settings) as bus:
            store = await JobStore(bus.js, settings).open()
            try:
                with anyio.fail_after(10):
                    await store.kv.put(key, b"{}")
            except Exception:  # (the server drops it: the put's ack never comes)
                return True
            return False

    return anyio.run(main)


@pytest.mark.slow
def test_each_role_writes_only_the_job_state_keys_it_needs(
    settings: Settings, job: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job's trainers write its policy and the state a restore folds, never its object-store
    binding, its budget or another job's keys; an agent writes any job's state and binding,
    never a budget."""
    node = settings.node or ""
    block = per_role_block(job, node, settings.kv_bucket)
    monkeypatch.setenv("TIERPIPE_TRAINER_PASSWORD", "trainer-pw-51e")
    monkeypatch.setenv("TIERPIPE_AGENT_PASSWORD", "agent-pw-9b2")
    with NatsServer(tmp_path / "perm-nats", config=block) as server:
        base = settings.replace(nats_url=server.url, request_timeout_s=2.0, publish_timeout_s=2.0)
        agent = base.replace(nats_user=f"agent-{node}", nats_password="agent-pw-9b2")
        trainer = base.replace(nats_user=f"trainer-{job}", nats_password="trainer-pw-51e")

        async def make_bucket() -> None:  # (the agent's start makes it)
            async with Bus(agent) as bus:
                await JobStore(bus.js, agent).open()

        anyio.run(make_bucket)
        for key in (f"{job}.keep", f"{job}.head", f"{job}.step.3", f"{job}.lease"):
            assert not _refused(trainer, key), f"the trainer may not write {key}"
        for key in (f"{job}.location", f"{job}.budget", f"{job}-other.head"):
            assert _refused(trainer, key), f"the trainer wrote {key}"
        layout = f"{job}.layout.0123456789abcdef"  # (the nvme-write stage stores one)
        assert _refused(trainer, layout), f"the trainer wrote {layout}"
        for key in (f"{job}.location", f"{job}-other.head", f"{job}.step.3.ranks.0", layout):
            assert not _refused(agent, key), f"the agent may not write {key}"
        assert _refused(agent, f"{job}.budget"), "the agent wrote the job's budget"
