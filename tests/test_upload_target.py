"""Object storage keeps the newest, job-wide (issue 22, item 1): the job names one step for object
storage at a time (`Floors.upload`), the newest complete on NVMe once the previous one is done;
every node uploads that step (and the steps `s3_keep_period` keeps) and no other. The rule alone,
then through real agents on several nodes, nats-server and SeaweedFS, one node throttled to a
quarter of the others' upload rate while the trainers save faster than it can upload."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import torch

from tests.conftest import Agent, Events
from tests.test_jobstate import lifecycle
from tierpipe.control.jobstate import JobState
from tierpipe.control.upload import Later, next_upload, safe_step, settled, targets
from tierpipe.retention.kept import upload_wanted
from tierpipe.schemas import Event, ShardEvicted, ShardFlushed, ShardVerified
from tierpipe.schemas.jobstate import Floors, Keep
from tierpipe.settings import Settings
from tierpipe.trainer.checkpointer import Checkpointer

WORLD = 3  # (tests.test_jobstate's fold: ranks 0-2 on nodes a, b, c)
KEEP = Keep(nvme_keep_latest_k=1000, s3_keep_latest_k=1000)


class Fold:
    """A job state fed step by step: `save` (written and verified on NVMe), `flush`, `evict`."""

    def __init__(self, keep: Keep = KEEP, *, now: float = 0.0) -> None:
        self.state, self.seq = JobState("j", keep), 0
        #: The events' time (the fold's clock: `Keep.s3_every_s` counts in it).
        self.now = now

    def feed(self, events: list[Event]) -> Fold:
        for e in events:
            self.seq += 1
            self.state.apply(self.seq, msgspec.structs.replace(e, ts=self.now))
        return self

    def at(self, now: float) -> Fold:
        self.now = now
        return self

    def save(self, *steps: int) -> Fold:
        return self.feed([e for t in steps for r in range(WORLD) for e in lifecycle(t, r)[:2]])

    def flush(self, step: int, ranks: range = range(WORLD)) -> Fold:
        return self.feed([lifecycle(step, r)[2] for r in ranks])

    def evict(self, step: int, rank: int) -> Fold:
        v = lifecycle(step, rank)[1]
        return self.feed([ShardEvicted(job="j", node=v.node, ts=0.0, step=step, rank=rank,
                                       world_size=WORLD, tier="nvme", location=v.path or "",
                                       reason="test")])  # fmt: skip

    @property
    def upload(self) -> int:
        return self.state.floors().upload


def test_the_target_is_the_newest_complete_nvme_step_once_the_last_is_in_object_storage() -> None:
    job = Fold().save(1)
    assert job.upload == 1  # (none yet: the first complete step)
    job.save(2, 3)
    assert job.upload == 1  # (not done with step 1: the steps in between are not named)
    job.flush(1, range(2))
    assert job.upload == 1
    job.flush(1)
    floors = job.state.floors()
    assert (floors.upload, floors.safe) == (3, 1)  # newest complete on NVMe; 1 is safe
    job.save(4).flush(3)
    assert (job.upload, job.state.floors().safe) == (4, 3)


def test_cadence_by_steps() -> None:
    job = Fold(Keep(nvme_keep_latest_k=1000, s3_keep_latest_k=1000, s3_every_steps=3)).save(1)
    assert job.upload == 1
    job.flush(1).save(2, 3)
    assert job.upload == 1  # (3 < 1 + 3)
    job.save(4)
    assert job.upload == 4
    job.save(5, 6).flush(4)
    assert job.upload == 4  # (done with, but 6 < 4 + 3)
    job.save(7, 8)
    assert job.upload == 7  # (due as step 7 completed)
    job.flush(7, range(2)).save(9, 10).flush(7)
    assert job.upload == 10  # (the newest complete once step 7 is done with)


def test_cadence_by_seconds_in_the_events_time() -> None:
    """The fold's clock is the newest event's `ts`: a fold of the same events names the same
    targets (the KV equals a fresh fold of the stream), and a target is due with the next
    event once the cadence allows."""
    job = Fold(Keep(nvme_keep_latest_k=1000, s3_keep_latest_k=1000, s3_every_s=10), now=100)
    job.save(1)
    assert (job.upload, job.state.floors().upload_ts) == (1, 100)
    job.flush(1).save(2)
    job.at(105).save(3)
    assert job.upload == 1  # (5 s after it was named)
    job.at(110).save(4)
    assert (job.upload, job.state.floors().upload_ts) == (4, 110)
    # A coordinator taking over keeps the cadence: the time is in the floors it loads.
    taken = JobState("j", job.state.keep, head=job.state.head(), floors=job.state.floors(),
                     records=job.state.records())  # fmt: skip
    assert (taken.floors().upload, taken.floors().upload_ts) == (4, 110)
    # The same events folded afresh name the same targets at the same times.
    again = Fold(job.state.keep, now=100).save(1).flush(1).save(2)
    again.at(105).save(3).at(110).save(4)
    assert again.state.floors() == job.state.floors()


def test_a_target_that_can_never_complete_is_skipped() -> None:
    """A rank's copy of the target lost before it was uploaded (evicted, corrupt, its node gone):
    the job names the newest complete NVMe step instead of waiting for it forever."""
    job = Fold().save(1, 2)
    assert job.upload == 1
    job.flush(1, range(1))  # rank 0 is in object storage: its NVMe copy may go
    job.evict(1, 0)
    assert job.upload == 1  # (still complete on one tier or the other: it can complete)
    job.evict(1, 2)  # rank 2's only copy: step 1 can never complete
    assert job.upload == 2


def test_a_target_never_goes_down() -> None:
    """Done with (complete in object storage) but newer than anything complete on NVMe now:
    the target stays; the next one is newer."""
    floors = Floors(upload=5, upload_ts=1.0)
    complete = {"nvme": [1, 3], "s3": [1, 5], None: [1, 3, 5]}
    assert settled(5, floors, complete)  # type: ignore[arg-type]
    assert next_upload(floors, floors, complete, Keep(), 100.0) == (5, 1.0)  # type: ignore[arg-type]
    complete = {"nvme": [1, 3, 6], "s3": [1, 5], None: [1, 3, 5, 6]}
    assert next_upload(floors, floors, complete, Keep(), 100.0) == (6, 100.0)  # type: ignore[arg-type]


def test_a_target_below_the_object_storage_floor_is_done_with() -> None:
    complete = {"nvme": [4, 6], None: [4, 6]}
    assert not settled(4, Floors(), complete)  # type: ignore[arg-type]
    assert settled(4, Floors(s3=5), complete)  # type: ignore[arg-type]
    floors = targets(Floors(s3=5), Floors(upload=4), complete, Keep(), 0.0)  # type: ignore[arg-type]
    assert floors.upload == 6


def test_the_safe_step_is_the_newest_complete_in_object_storage_or_on_peers() -> None:
    assert safe_step({"nvme": [5]}) == -1
    assert safe_step({"s3": [1, 3], "nvme": [5]}) == 3
    assert safe_step({"s3": [1, 3], "peer": [4, 5]}) == 5


def test_only_the_target_and_period_steps_are_wanted() -> None:
    floors = Floors(upload=7, s3=3)
    assert upload_wanted(7, floors, Keep())
    assert not upload_wanted(6, floors, Keep()) and not upload_wanted(8, floors, Keep())
    assert upload_wanted(6, floors, Keep(s3_keep_period=2))
    assert not upload_wanted(2, floors, Keep(s3_keep_period=2))  # (below the floor: removed)


# --- through real agents


def node_settings(base: Settings, tmp: Path, name: str, **changes: object) -> Settings:
    return base.replace(
        node=f"{base.node}-{name}",
        nvme_root=str(tmp / f"nvme-{name}"),
        staging_root=f"{base.staging_root}-{name}",
        **changes,
    )


def train(job: str, nodes: list[Settings], steps: int, every_s: float, state_mib: int) -> None:
    """One rank per node, each saving `steps` steps every `every_s`, in threads."""

    def rank(r: int) -> None:
        with Checkpointer(job, rank=r, world_size=len(nodes), settings=nodes[r]) as c:
            for step in range(1, steps + 1):
                t0 = time.monotonic()
                c.save(step, {"w": torch.full((state_mib << 18,), float(step * 10 + r))})
                time.sleep(max(0.0, every_s - (time.monotonic() - t0)))
            c.wait_until_finished(timeout=120)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)


def complete_in_s3(flushed: list[ShardFlushed], world: int) -> list[tuple[float, int]]:
    """(when, step) of each step once every rank of it was flushed, in that order."""
    ranks: dict[int, dict[int, float]] = {}
    for e in flushed:
        ranks.setdefault(e.step, {}).setdefault(e.rank, e.ts)
    done = [(max(r.values()), t) for t, r in ranks.items() if len(r) == world]
    return sorted(done)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_throttled_node_still_gets_the_newest_steps_into_object_storage(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events, tmp_path: Path
) -> None:
    """Three nodes, one rank each, a 4 MiB save every 0.5 s; node c uploads at 2 MiB/s (a step
    in 2 s: one step in four), the others at 8 MiB/s. Complete steps still reach object
    storage, each newer than the last, while training goes on; and no `flushed` goes to a
    step that was not a target (so none to a step retention deletes at once)."""
    s = settings.replace(lease_ttl_s=2.0, coordinator_flush_s=0.05, nvme_keep_latest_k=2,
                         s3_keep_latest_k=2)  # fmt: skip
    fast, slow = 8 << 20, 2 << 20
    nodes = [
        node_settings(s, tmp_path, n, flush_max_bytes_per_s=rate)
        for n, rate in (("a", fast), ("b", fast), ("c", slow))
    ]
    for ns in nodes:
        agent(settings=ns).wait_ready(60)
    steps = 20
    t0 = time.time()
    train(job, nodes, steps, 0.5, 4)
    trained = time.time()
    # Object storage catches up with the newest step once the saves stop.
    events.wait_for(
        lambda e: isinstance(e, ShardFlushed) and e.step == steps and e.rank == 2,
        kind="flushed",
        timeout=120,
    )
    flushed = [e for e in events.all("flushed") if isinstance(e, ShardFlushed)]
    done = complete_in_s3(flushed, len(nodes))
    during = [t for ts, t in done if ts <= trained]
    assert len(during) >= 2, f"complete in object storage while training: {done}"
    steps_done = [t for _, t in done]
    assert steps_done == sorted(steps_done), f"not newest-first: {done}"
    # Node c takes 2 s a step: every step uploaded costs ~4 saves. Uploading every step (as
    # main did), object storage would lag further behind each save; here the lag stays small.
    assert steps - during[-1] <= 10, f"object storage fell behind: {done} ({trained - t0:.0f} s)"
    flushed_steps = {e.step for e in flushed}
    assert len(flushed_steps) <= steps // 2, f"uploaded steps {sorted(flushed_steps)}"
    # Every node uploaded the same steps: none went to a step another node did not upload.
    by_rank = {r: {e.step for e in flushed if e.rank == r} for r in range(len(nodes))}
    assert by_rank[0] == by_rank[1] == by_rank[2], by_rank


@pytest.mark.slow
def test_an_upload_is_cancelled_once_the_job_names_a_newer_target(
    settings: Settings, job: str, s3_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job names a newer target while this node uploads the old one (it can never complete:
    another rank's copy was lost): the upload is cancelled, its multipart upload aborted, and
    nothing is reported flushed."""
    import boto3

    from tests.test_flush_kept import flush_one, objects, verified_copy
    from tierpipe.stages import flush as flush_stage

    monkeypatch.setattr(flush_stage, "KEPT_RECHECK_S", 0.2)
    slow = settings.replace(flush_max_bytes_per_s=1 << 20)
    event = verified_copy(slow, job, 1, mib=4)  # ~4 s at 1 MiB/s
    s3 = boto3.client("s3", **s3_server.client_kwargs())

    def uploading() -> bool:
        return bool(s3.list_multipart_uploads(Bucket=slow.s3_bucket).get("Uploads"))

    t0 = time.monotonic()
    assert flush_one(slow, event, uploading, passed=Floors(upload=3)) is None
    assert time.monotonic() - t0 < 4.0  # (well before the upload could have completed)
    assert objects(slow, s3_server) == {} and not uploading()


def test_a_rewound_run_gets_a_lower_target_and_its_held_shards_are_kept_for_it() -> None:
    """A target superseded by a rewind can never complete: the rewound run's newest step is
    named, lower; a node holds its shard of it until then, whatever else the floors say."""
    last = Floors(upload=20, upload_ts=5.0)
    complete = {"nvme": [10], "s3": [], None: [10]}  # (the old 20 no longer counts)
    assert next_upload(last, last, complete, Keep(), 9.0) == (10, 9.0)  # type: ignore[arg-type]
    later = Later()
    assert later.due("j", Floors(upload=20)) == []  # (the target the node saw named)
    v = lifecycle(10, 0)[1]
    assert isinstance(v, ShardVerified)
    later.hold(v)
    assert later.due("j", Floors(upload=20)) == [] and len(later) == 1
    assert later.due("j", Floors(upload=20, nvme=9)) == [] and len(later) == 1
    assert later.due("j", Floors(upload=10)) == [v] and len(later) == 0
    later.hold(v)
    assert later.due("j", Floors(upload=12)) == [] and len(later) == 0  # (a new, newer target)


def test_a_lower_target_is_told_apart() -> None:
    """The flush stage finds a lower target's shards again from its events (a rewind made the
    last target never to complete, and the shards of the lower one were let go when that one
    passed them): `Later.named` says what was named before."""
    from tierpipe.control.upload import Later

    later = Later()
    assert later.named("j") is None
    later.due("j", Floors(upload=20))
    assert later.named("j") == 20
    later.due("j", Floors(upload=16))
    assert later.named("j") == 16


def test_a_target_older_than_a_restored_step_is_done_with() -> None:
    """A node lost with the target's upload in flight: no event says its NVMe copies went, so
    the target still looks completable, and object storage would wait for it for ever (the demo
    met it: nothing reached S3 after the restart). Once a restart loaded a newer step, the job
    names the newest complete NVMe step instead."""
    from tierpipe.schemas import RestoreReport

    job = Fold().save(1, 2, 3)
    assert job.upload == 1
    job.flush(1, range(2))  # rank 2's upload dies with its node
    assert job.upload == 1
    loaded = [RestoreReport(job="j", node="a", ts=0.0, restart="r", rank=r, world_size=WORLD,
                            phase="loaded", step=3, tier="nvme") for r in range(WORLD)]  # fmt: skip
    job.feed(loaded)
    assert job.upload == 3
    # A restore of the target itself: a replaced node's ranks read it from a peer's replica (or
    # object storage) and never upload it, so object storage would wait for it for ever (CI met
    # it: test_chaos's final step never reached S3). It stays named until a newer step is
    # complete on NVMe, then the job names that one.
    job = Fold().save(1, 2)
    assert job.upload == 1
    job.flush(1, range(2))  # rank 2's node is lost; its replacement loads step 1 from a peer
    job.feed([RestoreReport(job="j", node="a", ts=0.0, restart="r", rank=r, world_size=WORLD,
                            phase="loaded", step=1, tier="peer" if r == 2 else "nvme")
              for r in range(WORLD)])  # fmt: skip
    assert job.upload == 2
    job = Fold().save(1)
    job.feed([RestoreReport(job="j", node="a", ts=0.0, restart="r", rank=0, world_size=WORLD,
                            phase="loaded", step=1, tier="nvme")])  # fmt: skip
    assert job.upload == 1  # (no newer step yet)
    job.save(2)
    assert job.upload == 2
