"""The compacted job state: the same verdicts as a fold of the whole history, in bounded memory."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.oracle_catalog import Catalog
from tierpipe.control import jobstate
from tierpipe.control.bitmap import bitmap, has_rank, is_full, ranks_of
from tierpipe.control.jobstate import JobState
from tierpipe.schemas import (
    Event,
    RestoreReport,
    ShardEvicted,
    ShardFlushed,
    ShardReplicated,
    ShardStaged,
    ShardVerified,
    ShardWritten,
    StageFailed,
)
from tierpipe.schemas.jobstate import Keep, StepRecord, decode_record, encode_record

NODES = ("a", "b", "c")
WORLD = 3
TIERS = ["nvme", "s3", "peer"]
EVERYTHING = Keep(nvme_keep_latest_k=1000, s3_keep_latest_k=1000)


def digest(step: int, rank: int, salt: int = 0) -> str:
    return f"{step:010x}{rank:06x}{salt:016x}"


def ident(step: int, rank: int, node: str, epoch: int = 0) -> dict[str, object]:
    return dict(job="j", node=node, ts=0.0, step=step, rank=rank, world_size=WORLD, epoch=epoch)


def path(step: int, rank: int, node: str) -> str:
    return f"/nvme/{node}/j/step-{step}/rank-{rank}.shard"


def lifecycle(step: int, rank: int, node: str | None = None, *, salt: int = 0) -> list[Event]:
    node = node or NODES[rank % len(NODES)]
    d, p = digest(step, rank, salt), path(step, rank, node)
    return [
        ShardWritten(**ident(step, rank, node), path=p, nbytes=4096, header_digest=d, tensors=1,
                     seconds=0),
        ShardVerified(**ident(step, rank, node), path=p, nbytes=4096, header_digest=d, seconds=0),
        ShardFlushed(**ident(step, rank, node), bucket="b", key=f"j/{step}/{rank}", etag="e",
                     checksum="c", header_digest=d, nbytes=4096, seconds=0),
    ]  # fmt: skip


def fold(events: list[Event], keep: Keep = EVERYTHING) -> JobState:
    state = JobState("j", keep)
    for seq, event in enumerate(events, 1):
        state.apply(seq, event)
    return state


def test_bitmaps() -> None:
    bits = bitmap([0, 3, 9], 10)
    assert len(bits) == 2 and ranks_of(bits) == [0, 3, 9]
    assert has_rank(bits, 3) and not has_rank(bits, 4) and not has_rank(bits, 100)
    assert is_full(bitmap(range(10), 10), 10) and not is_full(bits, 10)
    assert not is_full(bitmap(range(10), 16), 16)


@given(st.integers(1, 5000), st.data())
@settings(max_examples=60, deadline=None)
def test_a_stored_record_round_trips(world: int, data: st.DataObject) -> None:
    """Whatever the bitmaps (full, empty, sparse, random), the KV form decodes to the record."""
    ranks = data.draw(st.one_of(st.just(range(world)), st.sets(st.integers(0, world - 1))))
    rec = StepRecord(step=7, world_size=world, epoch=3, nvme=bitmap(ranks, world),
                     s3=bitmap(range(0, world, 3), world), s3_removed=world % 2 == 0)  # fmt: skip
    assert decode_record(encode_record(rec)) == rec


def test_a_full_record_of_80000_ranks_is_small_and_a_bad_one_is_refused() -> None:
    """A complete step of 80,000 ranks: 20 KiB of bitmaps, stored in ~100 B (every restarting
    node reads a few records). A deflated bitmap holding more ranks than the world size, or
    garbled, is no record."""
    full = bitmap(range(80_000), 80_000)
    rec = StepRecord(step=1, world_size=80_000, nvme=full, s3=full)
    assert len(encode_record(rec)) < 200 < len(msgspec.json.encode(rec)) // 100
    small = encode_record(StepRecord(step=1, world_size=8, nvme=full, s3=b""))
    with pytest.raises(msgspec.ValidationError, match="inflates past"):
        decode_record(small)
    garbled = encode_record(rec).replace(b'"nvme_z":"', b'"nvme_z":"AAAA')
    with pytest.raises(msgspec.ValidationError, match="not deflated"):
        decode_record(garbled)


def test_a_step_completes_tier_by_tier() -> None:
    events = [e for rank in range(WORLD) for e in lifecycle(5, rank)[:2]]
    state = fold(events)
    head = state.head()
    assert head.nvme_steps == [5] and head.s3_steps == [] and head.world_size == WORLD
    rec = state.record(5)
    assert rec is not None and is_full(rec.nvme, WORLD) and ranks_of(rec.s3) == []
    for rank in range(WORLD):
        state.apply(100 + rank, lifecycle(5, rank)[2])
    assert state.head().s3_steps == [5]


def test_a_stream_made_again_keeps_what_the_old_one_proved() -> None:
    """The stream deleted and made again numbers from 1 again: the state notices (the stream's
    make time, or, for a head that never named one, sequences that went back), keeps the
    complete steps as records, leaves a step whose evidence went with the old stream partial,
    and folds the new stream's steps from its first event; a coordinator taking over from the
    stored state reads the new stream from its start."""
    done = [e for rank in range(WORLD) for e in lifecycle(1, rank)]
    partial = [e for rank in range(WORLD) for e in lifecycle(2, rank)[:2]]  # (not flushed yet)
    state = fold(done + partial)
    assert not state.on_stream("t0", last_seq=state.seq)  # (first look: that stream is it)
    assert not state.on_stream("t0", last_seq=state.seq + 5)
    assert state.on_stream("t1", last_seq=0)  # (made again: a new make time)
    head = state.head()
    assert (head.seq, head.resume_seq, head.stream) == (0, 0, "t1")
    assert head.nvme_steps == [1, 2] and head.s3_steps == [1]
    for seq, e in enumerate([lifecycle(2, r)[2] for r in range(WORLD)], 1):
        state.apply(seq, e)  # (no verified copy in the new stream backs them: counts nothing)
    for seq, e in enumerate([e for rank in range(WORLD) for e in lifecycle(3, rank)], 10):
        state.apply(seq, e)
    head = state.head()
    assert head.s3_steps == [1, 3] and head.nvme_steps == [1, 2, 3] and head.seq == 18
    assert head.resume_seq == 10 and head.window == 3
    taken = JobState("j", EVERYTHING, head=head, floors=state.floors(), records=state.records())
    assert taken.head().s3_steps == [1]  # (step 3 is folded again from seq 10 of the new one)

    old = fold(done)  # (stored before heads named their stream)
    assert not old.on_stream("t0", last_seq=old.seq) and old.head().seq == len(done)
    old = fold(done)
    assert old.on_stream("t0", last_seq=2) and old.head().seq == 0  # (sequences went back)


def test_the_head_carries_its_candidates_records_as_far_as_they_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A restart reads the candidate steps' records with the head (one read, one snapshot);
    records that do not fit in `HEAD_RECORD_BYTES` are left to their own keys."""
    events = [e for step in (1, 2, 3, 4, 5) for rank in range(WORLD) for e in lifecycle(step, rank)]
    state = fold(events[:-1])  # (step 5's last rank not flushed yet)
    head = state.head()
    assert head.candidates() == [5, 4, 3] and [r.step for r in head.records] == [5, 4, 3]
    assert [r.record() for r in head.records] == [state.record(t) for t in (5, 4, 3)]
    monkeypatch.setattr(jobstate, "HEAD_RECORD_BYTES", 2)  # (each of these is 1 or 2 bytes)
    carried = fold(events[:-1]).head().records
    assert 0 < len(carried) < 3 and sum(r.nbytes for r in carried) <= 2


def test_forged_verified_and_flushed_count_for_nothing() -> None:
    node = "a"
    forged = [
        ShardVerified(**ident(7, r, node), path=path(7, r, node), nbytes=1,
                      header_digest=digest(7, r), seconds=0)
        for r in range(WORLD)
    ] + [
        ShardFlushed(**ident(7, r, node), bucket="b", key="k", etag="e", checksum="c",
                     header_digest=digest(7, r), nbytes=1, seconds=0)
        for r in range(WORLD)
    ]  # fmt: skip
    state = fold(forged)
    assert state.head().nvme_steps == [] and state.head().s3_steps == []


def test_floors_follow_the_policy_and_drop_what_no_tier_keeps() -> None:
    keep = Keep(nvme_keep_latest_k=2, s3_keep_latest_k=3, s3_keep_period=4)
    state = JobState("j", keep)
    seq = 0
    removed: set[int] = set()
    for step in range(1, 11):
        for rank in range(WORLD):
            for event in lifecycle(step, rank):
                seq += 1
                state.apply(seq, event)
        changes = state.take_changes()
        removed |= set(changes.s3_removed)
    floors = state.floors()
    assert (floors.nvme, floors.s3) == (9, 8)
    # Objects of steps below the floor go, but for the period's steps (4, 8).
    assert removed == {1, 2, 3, 5, 6, 7}
    head = state.head()
    # (no node removed its NVMe copies yet: every step still held counts there too)
    assert head.s3_steps == [4, 8, 9, 10] and head.nvme_steps == [4, 8, 9, 10]
    # Steps below both floors leave memory and the KV; the period's steps stay.
    assert head.steps == [4, 8, 9, 10]
    assert set(state._ledger.steps()) <= {4, 8, 9, 10}


def test_the_newest_complete_step_of_a_tier_is_kept_below_the_floor() -> None:
    """NVMe complete up to step 6, object storage only up to step 2: step 2 stays everywhere."""
    keep = Keep(nvme_keep_latest_k=2, s3_keep_latest_k=1)
    events: list[Event] = []
    for step in range(1, 7):
        for rank in range(WORLD):
            events += lifecycle(step, rank)[: 3 if step <= 2 else 2]
    state = fold(events, keep)
    floors = state.floors()
    assert (floors.nvme, floors.s3) == (5, 2) and 2 in floors.keep
    assert 2 in state.head().steps and state.head().s3_steps == [2]


def test_an_object_confirmed_after_its_step_was_removed_is_removed_and_announced_too() -> None:
    """Step 1's objects are removed while rank 2's upload is still on its way (the fold has
    ranks 0 and 1 in object storage); its `flushed` comes after. That object is removed too
    (`s3_late`), once, and the record says rank 2 was there. Before: the late `flushed` was
    ignored, so its removal was never announced (`test_flush`'s retention test, 1 run in 4), and
    an object uploaded after the step's removal was left in the bucket."""
    state = JobState("j", Keep(nvme_keep_latest_k=10, s3_keep_latest_k=1))
    seq = 0

    def apply(events: list[Event]) -> None:
        nonlocal seq
        for event in events:
            seq += 1
            state.apply(seq, event)

    late = lifecycle(1, 2)
    apply([e for r in (0, 1) for e in lifecycle(1, r)] + late[:2])
    apply([e for r in range(WORLD) for e in lifecycle(2, r)])
    changes = state.take_changes()
    assert ranks_of(changes.s3_removed[1].s3) == [0, 1] and not changes.s3_late

    apply(late[2:])
    changes = state.take_changes()
    assert set(changes.s3_late) == {1} and ranks_of(changes.s3_late[1].s3) == [2]
    assert changes.s3_late[1].world_size == WORLD and 1 in changes.put
    record = state.record(1)
    assert record is not None and record.s3_removed and ranks_of(record.s3) == [0, 1, 2]
    assert 1 not in state.head().s3_steps  # (removed: never counted complete there)

    apply(late[2:])  # the same event again (redelivered): nothing more to remove
    assert not state.take_changes().s3_late


# --- property: the compact state says what the whole-history catalog says


@st.composite
def histories(draw: st.DrawFn) -> list[Event]:
    events: list[Event] = []
    for _ in range(draw(st.integers(1, 40))):
        step = draw(st.integers(0, 4))
        rank = draw(st.integers(0, WORLD - 1))
        node = draw(st.sampled_from(NODES))
        salt = draw(st.integers(0, 1))
        epoch = draw(st.sampled_from([0, 0, 0, 5]))
        kind = draw(st.sampled_from(
            ["life", "life", "w", "v", "f", "evict", "bad", "rewind", "fail", "loaded", "reindex",
             "rep", "rep"]
        ))  # fmt: skip
        d, p = digest(step, rank, salt), path(step, rank, node)
        i = ident(step, rank, node, epoch)
        if kind == "life":
            events += [e for e in lifecycle(step, rank, node, salt=salt)
                       if draw(st.booleans()) or not isinstance(e, ShardFlushed)]  # fmt: skip
        elif kind == "w":
            events.append(ShardWritten(**i, path=p, nbytes=4096, header_digest=d, tensors=1,
                                       seconds=0))  # fmt: skip
        elif kind == "v":
            events.append(ShardVerified(**i, path=p, nbytes=4096, header_digest=d, seconds=0))
        elif kind == "f":
            events.append(ShardFlushed(**i, bucket="b", key="k", etag="e", checksum="c",
                                       header_digest=d, nbytes=4096, seconds=0))  # fmt: skip
        elif kind == "rep":  # a replica on `node` of a copy of `source` (itself: forged)
            source = draw(st.sampled_from(NODES))
            events.append(ShardReplicated(**i, source=source, path=f"/peer{p}",
                                          nbytes=draw(st.sampled_from([4096, 4096, 1])),
                                          header_digest=d, seconds=0))  # fmt: skip
        elif kind == "evict":
            tier = draw(st.sampled_from(["nvme", "s3", "peer"]))
            events.append(ShardEvicted(**i, tier=tier, location=p, reason="test"))
        elif kind == "bad":
            tier = draw(st.sampled_from(["nvme", "s3", "peer"]))
            events.append(StageFailed(job="j", node=node, ts=0.0, stage="restore",
                                      error="IntegrityError", message="x", retryable=False,
                                      attempt=1, step=step, rank=rank, world_size=WORLD,
                                      tier=tier, epoch=epoch))  # fmt: skip
        elif kind == "fail":  # any stage's verdict, final or not, evidence or not
            events.append(StageFailed(job="j", node=node, ts=0.0,
                                      stage=draw(st.sampled_from(["verify", "flush"])),
                                      error=draw(st.sampled_from(["IntegrityError", "OSError"])),
                                      message="x", retryable=draw(st.booleans()), attempt=1,
                                      step=step, rank=rank, world_size=WORLD, epoch=epoch,
                                      tier=draw(st.sampled_from([None, "nvme", "s3", "peer"])),
                                      ))  # fmt: skip
        elif kind == "loaded":
            events.append(RestoreReport(job="j", node=node, ts=0.0, restart="r", rank=rank,
                                        world_size=WORLD, phase="loaded", round=1, step=step,
                                        tier=draw(st.sampled_from(TIERS))))  # fmt: skip
        elif kind == "reindex":
            events.append(ShardFlushed(**i, bucket="b", key="k", etag="e", checksum="c",
                                       header_digest=d, nbytes=4096, seconds=0,
                                       origin="reindex"))  # fmt: skip
        else:
            events.append(ShardStaged(**ident(step, rank, node, 9), staging_path="/s",
                                      slot=0, nbytes=1, tensors=1, stall_s=0,
                                      rewind_to=step - 1))  # fmt: skip
    return events


def catalog_bits(catalog: Catalog, step: int, tier: str) -> list[int]:
    return [
        r for r in range(WORLD)
        if (s := catalog.shard("j", step, r)) is not None and s.world_size == WORLD
        and s.usable(tier)  # type: ignore[arg-type]
    ]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(histories())
def test_the_state_agrees_with_a_fold_of_the_whole_history(events: list[Event]) -> None:
    catalog = Catalog()
    for event in events:
        catalog.apply(event)
    state = fold(events)
    for step in range(5):
        rec = state.record(step)
        for tier in ("nvme", "s3", "peer"):
            want = catalog_bits(catalog, step, tier)
            got = ranks_of(getattr(rec, tier)) if rec is not None else []
            assert got == want, (step, tier)
    head = state.head()
    assert head.nvme_steps == catalog.complete_steps("j", ("nvme",))
    assert head.s3_steps == catalog.complete_steps("j", ("s3",))
    assert head.peer_steps == catalog.complete_steps("j", ("peer",))
    # (complete on some tier, each rank on any: the steps the floors keep the newest of)
    assert state._complete[None] == catalog.complete_steps("j", ("nvme", "s3", "peer"))


@settings(max_examples=200, deadline=None)
@given(histories(), st.data())
def test_a_coordinator_taking_over_never_claims_more_than_the_history(
    events: list[Event], data: st.DataObject
) -> None:
    """A new coordinator starts from the stored state and folds again from `resume_seq`: it
    agrees with the fold of everything on the window, and never claims a copy it would not."""
    keep = Keep(nvme_keep_latest_k=2, s3_keep_latest_k=2)
    cut = data.draw(st.integers(0, len(events)))
    first = fold(events[:cut], keep)
    head, floors, records = first.head(), first.floors(), first.records()
    second = JobState("j", keep, head=head, floors=floors, records=records)
    for seq in range(max(head.resume_seq, 1), len(events) + 1):
        second.apply(seq, events[seq - 1])
    whole = fold(events, keep)
    assert second.floors().nvme <= whole.floors().nvme or second.floors() == floors
    for step, rec in second.records().items():
        full = whole.record(step)
        for tier in ("nvme", "s3", "peer"):
            got = set(ranks_of(getattr(rec, tier)))
            want = set(ranks_of(getattr(full, tier))) if full is not None else set()
            if step >= head.window:
                assert got == want, (step, tier)
            else:
                assert got <= want or full is None, (step, tier)


def test_a_rewind_lowers_the_floors_the_abandoned_branch_raised() -> None:
    """Floors only rise, but a restart that restored step 2 branches the history there: the
    abandoned branch's steps 3-6 no longer count, and the new branch's step 3 must not be below
    an NVMe floor they raised (evict removed it as superseded while flush was uploading it:
    CI's test_chaos saw `flush` fail "no longer on NVMe" for the restarted run's saves)."""
    from tierpipe.schemas import RestoreReport, ShardStaged, ShardVerified, ShardWritten

    keep = Keep(nvme_keep_latest_k=2, s3_keep_latest_k=2)
    events: list = [e for t in range(1, 7) for r in range(WORLD) for e in lifecycle(t, r)[:2]]
    events += [RestoreReport(job="j", node=NODES[r], ts=0.0, restart="r", rank=r,
                             world_size=WORLD, phase="loaded", round=1, step=2, tier="nvme")
               for r in range(WORLD)]  # fmt: skip
    state = fold(events, keep)
    assert state.floors().nvme == 5
    for r in range(WORLD):
        node, d, p = NODES[r], digest(3, r, 7), path(3, r, NODES[r])
        for e in (
            ShardStaged(**ident(3, r, node, 9), staging_path="/s", slot=0, nbytes=1, tensors=1,
                        stall_s=0, rewind_to=2),
            ShardWritten(**ident(3, r, node, 9), path=p, nbytes=4096, header_digest=d,
                         tensors=1, seconds=0),
            ShardVerified(**ident(3, r, node, 9), path=p, nbytes=4096, header_digest=d,
                          seconds=0),
        ):  # fmt: skip
            events.append(e)
            state.apply(len(events), e)
    floors = state.floors()
    assert floors.nvme <= 3 and state.head().nvme_steps[-1] == 3, (floors, state.head())


def replay(events: list[Event], keep: Keep, *, hold: bool) -> tuple[JobState, JobState]:
    """(the fold of `events`, a fold taking over from what it stored: the events from its
    `resume_seq` on folded again; `hold`: as a restart's catch-up, which removes nothing)."""
    first = fold(events, keep)
    head = first.head()
    second = JobState("j", keep, head=head, floors=first.floors(), records=first.records())
    second.pin((), hold=hold)
    for seq in range(max(head.resume_seq, 1), len(events) + 1):
        second.apply(seq, events[seq - 1])
    return first, second


@pytest.mark.parametrize("hold", [True, False], ids=["catch-up", "coordinator"])
def test_a_fold_from_the_stored_state_brings_back_no_step_that_state_removed(hold: bool) -> None:
    """A fold taking over replays the events from `resume_seq`: those of step 1 on, with one of
    step 0, which the stored state had removed (below the floors step 1 raised). A rewind
    (staging step 2) lowered the floors again after, so step 0 is no longer below them. The
    replay does not make step 0 again: its records are deleted in the KV, and a write bringing
    one back is refused (`kv.revision`). A restart's catch-up fold failed so in CI."""
    keep = Keep(nvme_keep_latest_k=1, s3_keep_latest_k=1)
    written = lifecycle(1, 0)[:1] + lifecycle(0, 0)[:1]
    rest = [e for r in range(WORLD) for e in lifecycle(1, r)]
    rewind = ShardStaged(**ident(2, 0, "a", 9), staging_path="/s", slot=0, nbytes=1, tensors=1,
                         stall_s=0, rewind_to=-1)  # fmt: skip
    first, second = replay(written + rest[1:] + [rewind], keep, hold=hold)
    head = first.head()
    assert head.steps == [1, 2] and head.resume_seq == 1 and first.floors().nvme == -1
    changes = second.take_changes()
    assert 0 not in changes.put and 0 not in {t for t, _ in changes.digests}, changes
    assert second.head().steps == [1, 2]


@settings(max_examples=300, deadline=None)
@given(st.lists(histories(), min_size=1, max_size=4), st.booleans())
def test_a_fold_taking_over_puts_only_steps_the_stored_state_lists(
    parts: list[list[Event]], hold: bool
) -> None:
    """Whatever the history, folding again what the stored state folded changes no record of a
    step it does not list."""
    events = [e for part in parts for e in part]
    first, second = replay(events, Keep(nvme_keep_latest_k=1, s3_keep_latest_k=1), hold=hold)
    listed = set(first.head().steps)
    changes = second.take_changes()
    assert changes.put <= listed and {t for t, _ in changes.digests} <= listed, changes
