"""The coordinator's fast decode (`decode_fact`) accepts exactly what the full decode accepts."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierpipe.schemas import (
    NodeBatch,
    ShardEvicted,
    ShardFlushed,
    ShardReplicated,
    ShardVerified,
    ShardWritten,
    StageFailed,
    decode_event,
)
from tierpipe.schemas.events import encode_event
from tierpipe.schemas.facts import BatchFact, decode_fact, fact_of

DIGEST = "0123456789abcdef" * 2


def written(rank: int = 0, **kw: object) -> ShardWritten:
    fields: dict[str, object] = dict(
        job="j", node="n", ts=1.0, step=3, rank=rank, world_size=4, path="/p", nbytes=9,
        header_digest=DIGEST, tensors=1, seconds=0.5,
    )  # fmt: skip
    return ShardWritten(**{**fields, **kw})  # type: ignore[arg-type]


def batch(*events: ShardWritten) -> bytes:
    return encode_event(NodeBatch(job="j", node="n", ts=1.0, batch="written", events=list(events)))


def both(data: bytes) -> tuple[bool, bool]:
    """Whether the full decode and the fact decode accept `data`."""
    out = []
    for decode in (decode_event, decode_fact):
        try:
            decode(data)
            out.append(True)
        except (msgspec.ValidationError, msgspec.DecodeError):
            out.append(False)
    return out[0], out[1]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (b'"job":"j"', b'"job":"j\\n"'),  # a name with a line break: a subject-injection risk
        (b'"node":"n"', b'"node":"n\\n"'),
        (DIGEST.encode(), DIGEST.encode() + b"\\n"),
    ],
)
def test_a_trailing_line_break_is_no_valid_name_or_digest(old: bytes, new: bytes) -> None:
    """`$` in a pattern also matches before a final newline: names and digests must not."""
    data = encode_event(written()).replace(old, new, 1)
    assert data != encode_event(written())
    assert both(data) == (False, False)


@pytest.mark.parametrize("source", [b'"m\\n"', b'"m.n"', b'""'])
def test_a_replicas_source_is_a_name(source: bytes) -> None:
    """A `replicated` whose source node is no valid name is refused by both decodes."""
    data = _SAMPLES[-1].replace(b'"source":"m"', b'"source":' + source, 1)
    assert data != _SAMPLES[-1] and both(_SAMPLES[-1]) == (True, True)
    assert both(data) == (False, False)


def test_a_batch_decodes_to_the_same_facts() -> None:
    """The facts of a batch are the fields of its events, the same values."""
    data = batch(written(0), written(1, header_digest="f" * 32))
    fact = decode_fact(data)
    assert isinstance(fact, BatchFact)
    assert [(e.rank, e.header_digest, e.path) for e in fact.events] == [
        (0, DIGEST, "/p"),
        (1, "f" * 32, "/p"),
    ]
    assert fact_of(decode_event(data)) == fact


# Single-byte edits of valid events: whatever the full decode refuses, the fact decode refuses.
_SAMPLES = [
    batch(written(0), written(3)),
    encode_event(written(2, rewind_to=1, epoch=7)),
    encode_event(
        ShardVerified(
            job="j",
            node="n",
            ts=1.0,
            step=3,
            rank=1,
            world_size=4,
            path="/p",
            nbytes=9,
            header_digest=DIGEST,
            seconds=0.1,
        )
    ),
    encode_event(
        ShardEvicted(
            job="j",
            node="n",
            ts=1.0,
            step=3,
            rank=1,
            world_size=4,
            tier="nvme",
            location="/p",
            reason="r",
        )
    ),
]
_SAMPLES += [
    encode_event(
        ShardFlushed(
            job="j",
            node="n",
            ts=1.0,
            step=3,
            rank=1,
            world_size=4,
            bucket="b",
            key="k",
            etag="e",
            checksum="c",
            header_digest=DIGEST,
            nbytes=9,
            seconds=0.2,
            origin="reindex",
        )
    ),
    encode_event(
        StageFailed(
            job="j",
            node="n",
            ts=1.0,
            stage="verify",
            error="IntegrityError",
            message="m",
            retryable=False,
            attempt=2,
            step=3,
            rank=1,
            world_size=4,
            tier="nvme",
            epoch=5,
            generation=7,
        )
    ),
]
_SAMPLES += [
    encode_event(
        ShardReplicated(
            job="j",
            node="n",
            ts=1.0,
            step=3,
            rank=1,
            world_size=4,
            source="m",
            path="/p",
            nbytes=9,
            header_digest=DIGEST,
            seconds=0.2,
        )
    ),
]
_EDITS = b'"-:,{}[]0129afAFjnv\\ \n.Zxtrue'


@settings(max_examples=600, deadline=None)
@given(
    st.sampled_from(_SAMPLES),
    st.integers(0, 10_000),
    st.sampled_from([_EDITS[i : i + 1] for i in range(len(_EDITS))]),
    st.booleans(),
)
def test_the_fact_decode_refuses_whatever_the_full_decode_refuses(
    data: bytes, at: int, char: bytes, insert: bool
) -> None:
    """An edited event the full decode refuses is refused by the fact decode, and one it accepts
    gives the same facts."""
    i = at % len(data)
    edited = data[:i] + char + data[i + (0 if insert else 1) :]
    full, fact = both(edited)
    assert fact == full
    if full:
        assert decode_fact(edited) == fact_of(decode_event(edited))


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (b'"rank":3', b'"rank":4'),  # rank == world size
        (b'"events":[{', b'"events":[],"x":[{'),  # an empty batch
        (b'"node":"n","ts":1.0,"step":3,"rank":3', b'"node":"m","ts":1.0,"step":3,"rank":3'),
        (b'"kind":"written","v":1,"job":"j","node":"n","ts":1.0,"step":3,"rank":3',
         b'"kind":"written","v":2,"job":"j","node":"n","ts":1.0,"step":3,"rank":3'),
        (b'"batch":"written"', b'"batch":"verified"'),  # events of another kind
    ],
)  # fmt: skip
def test_a_batch_the_full_decode_refuses_is_refused(old: bytes, new: bytes) -> None:
    """What `NodeBatch` and `ShardEvent` check beyond the types, the fact decode checks too."""
    data = batch(written(0), written(3))
    assert old in data, data
    assert both(data.replace(old, new, 1)) == (False, False)
