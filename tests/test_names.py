"""Names, subjects, message ids and event decoding: unsafe input never becomes a subject or path."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import msgspec
import pytest

from tierpipe.errors import InvalidNameError
from tierpipe.names import (
    event_subject,
    filter_subject,
    flush_control_subject,
    job_subjects,
    msg_id,
    shard_relpath,
    stream_name,
    subject_job,
    validate_token,
)
from tierpipe.schemas import ShardEvicted, ShardWritten, StageFailed, decode_event, encode_event


def written(**kw: object) -> ShardWritten:
    fields = dict(
        job="j1",
        node="n1",
        ts=time.time(),
        step=12,
        rank=3,
        world_size=8,
        path="/x",
        nbytes=4096,
        header_digest="0" * 32,
        tensors=2,
        seconds=0.5,
    )
    fields.update(kw)
    return ShardWritten(**fields)  # type: ignore[arg-type]


def test_subjects_and_ids_follow_the_design() -> None:
    """Subjects are tp.<job>.<kind>.<node>.<rank>; msg ids dedupe per shard, kind, node, epoch
    and tier."""
    e = written()
    assert event_subject(e) == "tp.j1.written.n1.3"
    # + header digest: new content, new id
    assert msg_id(e) == "j1/12/3/written/n1/0/000000000000"
    # Another node's copy of the same shard (a write-back after a restore) is its own fact.
    assert msg_id(written(node="n2")) != msg_id(e)
    assert msg_id(written(epoch=7)) == "j1/12/3/written/n1/7/000000000000"
    ev = ShardEvicted(
        job="j1",
        node="n1",
        ts=0,
        step=12,
        rank=3,
        world_size=8,
        tier="nvme",
        location="/x",
        reason="retention",
    )
    assert msg_id(ev) == "j1/12/3/evicted/n1/0/nvme"
    f = StageFailed(
        job="j1",
        node="n1",
        ts=0,
        stage="verify",
        error="E",
        message="m",
        retryable=False,
        attempt=2,
        step=12,
        rank=3,
        world_size=8,
    )
    # A failure of no message (a restore's report, verify's rewrite) is its own each time.
    assert msg_id(f) == "j1/12/3/failed/n1/verify/2/0" and event_subject(f) == "tp.j1.failed.n1.3"
    assert msg_id(msgspec.structs.replace(f, ts=1.5)) == "j1/12/3/failed/n1/verify/2/1500000"
    assert msg_id(msgspec.structs.replace(f, stream_seq=9)) == "j1/12/3/failed/n1/verify/2/9"


def test_shard_paths_are_zero_padded_keys() -> None:
    """One shard's key on every tier."""
    assert str(shard_relpath("j1", 12, 3, 8)) == "j1/step-000000000012/rank-00003-of-00008.shard"
    with pytest.raises(ValueError, match="rank"):
        shard_relpath("j1", 1, 8, 8)


@pytest.mark.parametrize("bad", ["a.b", "a*", ">", "", "a/b", "..", "x" * 65, 5, None])
def test_unsafe_tokens_are_rejected(bad: object) -> None:
    """Anything but [A-Za-z0-9_-]{1,64} is refused, with the value in the message."""
    with pytest.raises(InvalidNameError, match="job name must match"):
        validate_token("job", bad)


def test_decoding_validates_names_and_ranges() -> None:
    """Events with unsafe names or impossible ranks do not decode."""
    good = encode_event(written())
    assert decode_event(good) == msgspec.json.decode(good, type=ShardWritten)
    for bad in (written(job="a.b"), written(node="*"), written(header_digest="zz")):
        with pytest.raises(msgspec.ValidationError):
            decode_event(encode_event(bad))
    with pytest.raises(msgspec.ValidationError, match="out of range"):
        decode_event(good.replace(b'"rank":3', b'"rank":8'))
    with pytest.raises(ValueError, match="out of range"):
        written(rank=8)  # not even constructible
    with pytest.raises(msgspec.ValidationError):
        decode_event(b'{"kind":"bogus","job":"j"}')


@pytest.mark.parametrize("version", [0, 2, 99])
def test_unknown_schema_versions_are_refused_not_guessed(version: int) -> None:
    """An event of a schema version this build does not read fails to decode, naming the version,
    instead of being processed as version 1."""
    good = encode_event(written())
    assert b'"v":1' in good
    with pytest.raises(msgspec.ValidationError, match=f"schema version {version} is not supported"):
        decode_event(good.replace(b'"v":1', f'"v":{version}'.encode()))


def test_filters_cover_what_their_readers_need() -> None:
    """Filters for a job (its stream's subjects), one kind on one node, every shard event, and
    the flush commands (every node or one); the stream of each."""
    assert job_subjects("j1") == "tp.j1.>" and stream_name("TIERPIPE", "j1") == "TIERPIPE_j1"
    assert subject_job("tp.j1.batch.n1.verified") == "j1" and subject_job("tp.ctl.flush") == "ctl"
    for no_job in ("tp.*.staged.n1.0", "tp.>", "x.j1.staged", "tp"):
        with pytest.raises(InvalidNameError):
            subject_job(no_job)
    assert filter_subject("verified", node="n1") == "tp.*.batch.n1.verified"  # per node
    assert filter_subject("failed", node="n1") == "tp.*.failed.n1.*"  # per rank
    assert filter_subject("*", node="*") == "tp.*.*.*.*"
    assert (flush_control_subject(), flush_control_subject("n1")) == (
        "tp.ctl.flush",
        "tp.ctl.flush.n1",
    )


ROOT = Path(__file__).parent.parent
#: Modules other parts of issue 9 are moving that still spell their subjects inline; remove
#: each once it uses `job_subjects`, `filter_subject` or `flush_control_subject`.
NOT_YET: set[str] = set()


def inline_subjects(path: Path) -> list[str]:
    """Where `path` builds a subject itself: an f-string on `SUBJECT_ROOT` or `CONTROL_FLUSH`,
    or a string that starts like one (`"tp."`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.JoinedStr):
            names = {v.value.id for v in node.values if isinstance(v, ast.FormattedValue)
                     and isinstance(v.value, ast.Name)}  # fmt: skip
            if names & {"SUBJECT_ROOT", "CONTROL_FLUSH"}:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith("tp.")
        ):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_subjects_are_built_only_in_names() -> None:
    """No module of the library, the stages or the schemas spells out a subject: names.py
    builds every one."""
    modules = [p for d in ("pipeline", "stages", "schemas") for p in (ROOT / d).rglob("*.py")]
    checked = [p for p in modules if str(p.relative_to(ROOT)) not in NOT_YET]
    assert len(checked) > 20 and (ROOT / "pipeline/names.py") in checked
    found = [hit for p in checked if p.name != "names.py" for hit in inline_subjects(p)]
    assert found == []
    # The check finds what it looks for (names.py itself is where subjects are built).
    assert inline_subjects(ROOT / "pipeline/names.py")
