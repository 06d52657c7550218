"""A step's record names its save's global layout once every rank's copy reported the same one;
older events, records and COMMIT manifests without it still decode (pure: folds and codecs)."""

from __future__ import annotations

import msgspec
import pytest

from tests.test_facts import both, written
from tests.test_jobstate import fold, lifecycle
from tierpipe.schemas import Event, ShardFlushed, ShardVerified, ShardWritten, decode_event
from tierpipe.schemas.commit import CommitManifest, decode_commit, encode_commit
from tierpipe.schemas.events import encode_event
from tierpipe.schemas.jobstate import (
    RankDigests,
    StepRecord,
    decode_record,
    encode_record,
)

LAYOUT = "0123456789abcdef"
OTHER = "fedcba9876543210"


def with_layout(events: list[Event], layout: str) -> list[Event]:
    """The events of a save whose agent named `layout` (on its NVMe copies and its object)."""
    return [
        msgspec.structs.replace(e, layout=layout)
        if isinstance(e, ShardWritten | ShardVerified | ShardFlushed)
        else e
        for e in events
    ]


def test_a_record_names_the_layout_every_rank_reported() -> None:
    """Three ranks naming one layout: the record names it (and the stored form keeps it)."""
    state = fold([e for r in range(3) for e in with_layout(lifecycle(1, r), LAYOUT)])
    rec = state.record(1)
    assert rec is not None and rec.layout == LAYOUT
    assert decode_record(encode_record(rec)).layout == LAYOUT


def test_a_record_names_no_layout_until_every_rank_reported_it() -> None:
    """A rank whose copy named none (an older agent) leaves the record without one."""
    events = [e for r in range(2) for e in with_layout(lifecycle(1, r), LAYOUT)]
    state = fold([*events, *lifecycle(1, 2)])
    rec = state.record(1)
    assert rec is not None and rec.layout == "" and state.head().s3_steps == [1]


def test_ranks_that_disagree_leave_the_record_without_a_layout() -> None:
    """Two layouts among a step's ranks: none is named, also once the others agree again."""
    events = [
        *with_layout(lifecycle(1, 0), LAYOUT),
        *with_layout(lifecycle(1, 1), OTHER),
        *with_layout(lifecycle(1, 2), LAYOUT),
    ]
    rec = fold(events).record(1)
    assert rec is not None and rec.layout == ""


def test_a_plain_step_has_no_layout_and_its_stored_record_is_as_before() -> None:
    """A save without sharded tensors: no layout, and its KV value holds no layout field."""
    state = fold([e for r in range(3) for e in lifecycle(1, r)])
    rec = state.record(1)
    assert rec is not None and rec.layout == ""
    assert b"layout" not in encode_record(rec)


def test_an_older_record_event_and_manifest_decode_without_a_layout() -> None:
    """Values written before layouts existed decode, with no layout."""
    old = b'{"step":1,"world_size":2,"nvme":"Aw=="}'
    assert decode_record(old) == StepRecord(step=1, world_size=2, nvme=b"\x03")
    event = decode_event(encode_event(written()))
    assert isinstance(event, ShardWritten) and event.layout == ""
    chunk = RankDigests(step=1, first=0, digests=b"\x01" * 32, sizes=(1).to_bytes(8, "little") * 2)
    m = CommitManifest.from_chunks("j", 1, 2, 0, [chunk])
    plain = msgspec.msgpack.encode(
        {k: v for k, v in msgspec.structs.asdict(m).items() if not k.startswith("layout")}
    )
    assert decode_commit(plain) == m and m.layout == "" and m.layout_data == b""


def test_a_manifest_carries_its_layout() -> None:
    """A COMMIT manifest round-trips its layout's digest and bytes."""
    chunk = RankDigests(step=1, first=0, digests=b"\x01" * 32, sizes=(1).to_bytes(8, "little") * 2)
    m = CommitManifest.from_chunks("j", 1, 2, 0, [chunk], layout=LAYOUT)
    m = msgspec.structs.replace(m, layout_data=b"\x82\xa6meshes")
    assert decode_commit(encode_commit(m)) == m


@pytest.mark.parametrize("bad", ["0123", "0123456789ABCDEF", "0123456789abcdeg", "x" * 40])
def test_a_malformed_layout_digest_is_refused_by_both_decodes(bad: str) -> None:
    """A layout digest is 16 lowercase hex digits or nothing: the full decode and the
    coordinator's fact decode both refuse anything else (it becomes a KV key)."""
    data = encode_event(written(layout=LAYOUT)).replace(LAYOUT.encode(), bad.encode())
    assert both(data) == (False, False)
    assert both(encode_event(written(layout=LAYOUT))) == (True, True)
