"""Hostile input: crafted shard files, forged events naming foreign objects, bad CLI input.

Each test feeds the system something an adversary (or an accident) could produce and checks
that it is refused with a tierpipe error, or ignored without harm, never obeyed.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import boto3
import msgspec
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from tests.conftest import Agent, Events, run_cli
from tierpipe.bus.batcher import Batcher
from tierpipe.bus.client import Bus
from tierpipe.dev import S3Server
from tierpipe.errors import IntegrityError, ShardFormatError, UnsupportedStateError
from tierpipe.names import CONTROL_FLUSH, node_name, shard_relpath
from tierpipe.recovery.load import load_shard
from tierpipe.schemas import (
    BlobEntry,
    Event,
    MeshEntry,
    ShardedEntry,
    ShardFlushed,
    ShardHeader,
    ShardVerified,
    ShardWritten,
)
from tierpipe.settings import Settings
from tierpipe.storage.reader import read_head
from tierpipe.storage.s3.store import S3Store
from tierpipe.storage.shard import DTYPE_SIZES, blocks_nbytes, encode_head, file_nbytes, parse_head
from tierpipe.storage.shardfile import write_shard

# --- item 14: crafted shard files ------------------------------------------------------------


def craft(path: Path, header: ShardHeader, data: bytes = bytes(range(256)) * 64) -> Path:
    """Write `header` as a sealed shard whose data region is `data` (cut or zero-padded to the
    blob table's extent), with every blob digest and the header digest recomputed: the file
    passes every integrity check, so only the layout checks stand between it and torch."""
    data_offset = len(encode_head(header, sealed=False))
    region = bytearray(file_nbytes(data_offset, header.blobs) - data_offset)
    region[: len(data)] = data[: len(region)]
    blobs = tuple(
        BlobEntry(
            b.offset,
            b.nbytes,
            xxhash.xxh3_128_digest(bytes(region[max(b.offset, 0) : max(b.offset, 0) + b.nbytes])),
            b.blocks,
        )
        for b in header.blobs
    )
    head = encode_head(msgspec.structs.replace(header, blobs=blobs), sealed=True)
    path.write_bytes(head + region)
    return path


@pytest.fixture
def one_tensor(tmp_path: Path) -> ShardHeader:
    """The header of a genuine shard holding {"a": 4 float32s} (one tensor, one 16-byte blob)."""
    path = tmp_path / "genuine.shard"
    write_shard(path, {"a": torch.arange(4, dtype=torch.float32)}, job="j", step=1)
    return read_head(path).header


def with_tensor(header: ShardHeader, **changes: Any) -> ShardHeader:
    tree = changes.pop("tree", header.tree)
    entry = msgspec.structs.replace(header.tensors[0], **changes)
    return msgspec.structs.replace(header, tensors=(entry,), tree=tree)


def test_zero_stride_cannot_make_16_bytes_a_4_tib_tensor(
    tmp_path: Path, one_tensor: ShardHeader
) -> None:
    """A lone tensor whose zero stride would spread a 16-byte blob over 4 TiB is refused by the
    header check, before torch builds any view."""
    header = with_tensor(one_tensor, dtype="float32", shape=(1 << 40,), stride=(0,))
    path = craft(tmp_path / "4tib.shard", header)
    with pytest.raises(ShardFormatError, match="contiguous"):
        parse_head(path.read_bytes(), str(path), actual_nbytes=path.stat().st_size)
    with pytest.raises(ShardFormatError) as err:
        load_shard(path)
    assert err.value.path == str(path)


def test_numel_overflowing_int64_is_a_format_error(tmp_path: Path, one_tensor: ShardHeader) -> None:
    """A shape whose element count overflows int64 is a ShardFormatError, not torch's
    RuntimeError."""
    header = with_tensor(one_tensor, shape=(1 << 40, 1 << 40), stride=(0, 0))
    with pytest.raises(ShardFormatError, match="int64"):
        load_shard(craft(tmp_path / "numel.shard", header))


def test_unknown_device_string_in_the_tree_is_a_format_error(
    tmp_path: Path, one_tensor: ShardHeader
) -> None:
    """A state tree naming a device torch does not know is a ShardFormatError, not torch's
    RuntimeError."""
    tree = msgspec.msgpack.encode(["d", "a", ["T", 0], "dev", ["v", "garbage"]])
    with pytest.raises(ShardFormatError, match="garbled state tree"):
        load_shard(craft(tmp_path / "device.shard", with_tensor(one_tensor, tree=tree)))


def _nested(depth: int) -> bytes:
    return b"\x92\xa1l" * depth + b"\xc0"  # ["l", ["l", ... None]]


@pytest.mark.parametrize(
    "changes",
    [
        {"shape": (0, 1 << 63), "stride": (1, 1)},  # TypeError from torch before
        {"shape": (0,), "stride": (1,), "offset": (1 << 63) + 5},  # ValueError from torch before
        {"shape": (2,), "stride": (2,)},  # lone tensor not contiguous
        {"shape": (2,), "stride": (1,)},  # lone tensor not filling its blob
        {"tree": msgspec.msgpack.encode(["d", "a", ["T", -1]])},  # loaded the last tensor
        {"tree": msgspec.msgpack.encode(["d", "a", ["T", 1]])},
        {"tree": msgspec.msgpack.encode(["d", "a", ["T", True]])},
        {"tree": msgspec.msgpack.encode(["d", "a", ["T", 0], "s", ["S", "|O", bytes(8)]])},
        {"tree": msgspec.msgpack.encode(["d", "a", ["T", 0], "s", ["S", "<f8", bytes(3)]])},
        {"dtype": "bfloat16", "shape": (8,), "tree": msgspec.msgpack.encode(["N", 0])},
        {"tree": msgspec.msgpack.encode(["d", "a", ["Z", "x"]])},
        {"tree": msgspec.msgpack.encode(["d", "a", msgspec.msgpack.Ext(1, b"x")])},
        {"tree": _nested(100_000)},
        {"tree": _nested(200)},
    ],
    ids=[
        "shape-past-int64",
        "offset-past-int64",
        "lone-strided",
        "lone-short",
        "negative-reference",
        "missing-tensor",
        "bool-reference",
        "object-dtype",
        "short-scalar",
        "bfloat16-numpy",
        "size-of-str",
        "ext-type",
        "deep-tree",
        "deeper-than-writer",
    ],
)
def test_crafted_layout_or_tree_is_a_format_error(
    tmp_path: Path, one_tensor: ShardHeader, changes: dict[str, Any]
) -> None:
    """Every crafted layout or state tree is refused with a ShardFormatError naming the file."""
    path = craft(tmp_path / "crafted.shard", with_tensor(one_tensor, **changes))
    with pytest.raises(ShardFormatError) as err:
        load_shard(path)
    assert err.value.path == str(path)


_MESH = MeshEntry(shape=(2,), dims=("dp",), ranks=(0, 1), coordinate=(1,))


def _sharded(header: ShardHeader, blocks: bytes = bytes(8), **changes: Any) -> ShardHeader:
    """`header` (one 4-float32 tensor) declared the second half of an 8-element tensor sharded
    over a 2-rank mesh (S0, coordinate 1), its blob with `blocks`; `changes` forge the entry,
    its mesh (`MeshEntry` fields) or the table of meshes (`meshes`)."""
    entry = ShardedEntry(tensor=0, global_shape=(8,), offsets=(4,), mesh=0, placements=("S0",))
    mesh_fields = {k: changes.pop(k) for k in MeshEntry.__struct_fields__ if k in changes}
    meshes = changes.pop("meshes", (msgspec.structs.replace(_MESH, **mesh_fields),))
    blob = msgspec.structs.replace(header.blobs[0], blocks=blocks)
    return msgspec.structs.replace(
        header,
        blobs=(blob,),
        meshes=meshes,
        sharded=(msgspec.structs.replace(entry, **changes),),
    )


def test_consistent_sharded_entry_loads(tmp_path: Path, one_tensor: ShardHeader) -> None:
    """The genuine-looking sharded header the forgeries below start from loads (the local
    shard comes back as a plain tensor)."""
    _, state = load_shard(craft(tmp_path / "sharded.shard", _sharded(one_tensor)))
    assert state["a"].shape == (4,)


@pytest.mark.parametrize(
    ("blocks", "changes", "match"),
    [
        (bytes(16), {}, "block digests"),
        (b"", {}, "block digests"),
        (bytes(8), {"tensor": 1}, "missing tensor"),
        (bytes(8), {"tensor": -1}, "missing tensor"),
        (bytes(8), {"offsets": (6,)}, "outside"),
        (bytes(8), {"global_shape": (8, 1)}, "dimensions"),
        (bytes(8), {"ranks": (0, 1, 2)}, "mesh 0: 3 mesh ranks"),
        (bytes(8), {"ranks": (1, 1)}, "mesh ranks"),
        (bytes(8), {"ranks": (-1, 1)}, "mesh ranks"),
        (bytes(8), {"shape": (0,), "ranks": ()}, "malformed mesh"),
        (bytes(8), {"shape": (-2,), "ranks": (0, 1)}, "malformed mesh"),
        (bytes(8), {"dims": ("dp", "tp")}, "dimension names"),
        (bytes(8), {"coordinate": (2,)}, "outside the mesh"),
        (bytes(8), {"coordinate": (-1,)}, "outside the mesh"),
        (bytes(8), {"coordinate": (1, 0)}, "outside the mesh"),
        (bytes(8), {"coordinate": (0,)}, "do not give"),
        (bytes(8), {"shape": (2, 1), "dims": (), "coordinate": (1, 0)}, "mesh dimensions differ"),
        (bytes(8), {"mesh": 1}, "missing mesh 1"),
        (bytes(8), {"mesh": -1}, "missing mesh"),
        (bytes(8), {"meshes": ()}, "missing mesh 0"),
        (bytes(8), {"meshes": (_MESH, MeshEntry((2,), (), (0,), (0,)))}, "mesh 1: 1 mesh"),
        (bytes(8), {"placements": ("R",)}, "do not give"),
        (bytes(8), {"placements": ("S1",)}, "2-dim|1-dim"),
        (bytes(8), {"placements": ("X",)}, "bad placement"),
        (bytes(8), {"placements": ("S-1",)}, "bad placement"),
        (bytes(8), {"placements": ("SS0:0",)}, "bad placement"),
        (bytes(8), {"placements": ("SS0:999999999",)}, "mesh of 2 ranks"),
        (bytes(8), {"placements": ("S0 ",)}, "bad placement"),
        (bytes(8), {"placements": ("S0", "R")}, "mesh dimensions"),
    ],
    ids=[
        "too-many-blocks",
        "no-blocks",
        "tensor-out-of-range",
        "negative-tensor",
        "shard-past-global",
        "other-rank",
        "ranks-not-mesh-size",
        "duplicate-ranks",
        "negative-rank",
        "empty-mesh",
        "negative-mesh-dim",
        "mesh-names",
        "coordinate-outside",
        "negative-coordinate",
        "coordinate-not-mesh",
        "offsets-not-placements",
        "placements-not-2d-mesh",
        "mesh-index-out-of-range",
        "negative-mesh-index",
        "no-mesh-table",
        "bad-unused-mesh",
        "replicated-half",
        "shard-dim-out-of-range",
        "unknown-placement",
        "negative-dim",
        "zero-split-factor",
        "huge-split-factor",
        "placement-padding",
        "placements-not-mesh",
    ],
)
def test_forged_sharded_entry_is_a_format_error(
    tmp_path: Path, one_tensor: ShardHeader, blocks: bytes, changes: dict[str, Any], match: str
) -> None:
    """A header whose sharded entries or block tables do not hold together is refused with a
    ShardFormatError naming the file, before any byte is read into a target."""
    path = craft(tmp_path / "forged.shard", _sharded(one_tensor, blocks, **changes))
    with pytest.raises(ShardFormatError, match=match) as err:
        load_shard(path)
    assert err.value.path == str(path)


def test_block_digests_on_a_plain_blob_are_a_format_error(
    tmp_path: Path, one_tensor: ShardHeader
) -> None:
    """Block digests are only for a sharded tensor's blob: a plain blob with some is refused."""
    blob = msgspec.structs.replace(one_tensor.blobs[0], blocks=bytes(8))
    path = craft(tmp_path / "plain.shard", msgspec.structs.replace(one_tensor, blobs=(blob,)))
    with pytest.raises(ShardFormatError, match="block digests"):
        load_shard(path)


def test_two_sharded_entries_for_one_tensor_are_a_format_error(
    tmp_path: Path, one_tensor: ShardHeader
) -> None:
    """One tensor cannot be two shards."""
    header = _sharded(one_tensor)
    header = msgspec.structs.replace(header, sharded=header.sharded * 2)
    with pytest.raises(ShardFormatError, match="shares blob"):
        load_shard(craft(tmp_path / "twice.shard", header))


def test_state_deeper_than_the_reader_allows_is_refused_at_save(tmp_path: Path) -> None:
    """A state nested deeper than a shard may hold fails at save, naming its key path, so
    nothing is saved that could not be loaded."""
    state: list[Any] = []
    inner = state
    for _ in range(200):
        inner.append([])
        inner = inner[0]
    with pytest.raises(UnsupportedStateError, match="nest deeper") as err:
        write_shard(tmp_path / "deep.shard", state, job="j", step=1)
    assert len(err.value.path) == 128


# The fuzz test below mutates the header of a shard that has every kind of entry: a lone
# tensor, a blob shared by three views, a numpy array and scalar, plain values.

_BIG = [2**31, 2**32 + 1, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
_ints = st.integers(0, 8) | st.integers(-2, 40) | st.sampled_from(_BIG)
_dims = st.lists(_ints, max_size=4).map(tuple)


def _mixed_state() -> dict[str, Any]:
    base = torch.arange(24, dtype=torch.float32)
    return {
        "lone": torch.arange(6, dtype=torch.int16).view(2, 3),
        "base": base,
        "strided": base[1:20:3],
        "window": base.view(4, 6)[1:3, 2:5],
        "np": np.arange(5, dtype=np.int64),
        "np_scalar": np.float32(0.5),
        "plain": [1, "x", None, (2.5, b"\x00")],
        "size": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
    }


_leaf = (
    st.none()
    | st.booleans()
    | _ints
    | st.text(max_size=4)
    | st.binary(max_size=9)
    | st.tuples(st.sampled_from(["T", "N"]), _ints).map(list)
    | st.tuples(
        st.just("S"), st.sampled_from(["<f4", "<i8", "|O", "|b1", "V8", "x"]), st.binary(max_size=9)
    ).map(list)
    | st.tuples(
        st.sampled_from(["y", "v", "I"]), st.sampled_from(["cpu", "zz", "float32", "12"])
    ).map(list)
    | st.lists(_ints, max_size=3).map(lambda xs: ["Z", *xs])
)
_tree = st.recursive(
    _leaf,
    lambda kids: st.tuples(st.sampled_from(["d", "l", "t", "q"]), st.lists(kids, max_size=4)).map(
        lambda tk: [tk[0], *tk[1]]
    ),
    max_leaves=12,
)


@st.composite
def _hostile_header(draw: st.DrawFn, base: ShardHeader) -> ShardHeader:
    tensors = list(base.tensors)
    for _ in range(draw(st.integers(0, 3))):
        i = draw(st.integers(0, len(tensors) - 1))
        field = draw(st.sampled_from(["dtype", "shape", "stride", "offset", "blob"]))
        value: Any = {
            "dtype": lambda: draw(st.sampled_from([*DTYPE_SIZES, "object", "float128", ""])),
            "shape": lambda: draw(_dims),
            "stride": lambda: draw(_dims),
            "offset": lambda: draw(_ints),
            "blob": lambda: draw(st.integers(-1, len(base.blobs))),
        }[field]()
        tensors[i] = msgspec.structs.replace(tensors[i], **{field: value})
    blobs = list(base.blobs)
    if draw(st.integers(0, 3)) == 0:
        i = draw(st.integers(0, len(blobs) - 1))
        offset = draw(st.sampled_from([0, 100, 4096, 8192, 12288, -4096]))
        blobs[i] = BlobEntry(offset, draw(st.integers(-1, 3 * 4096)), blobs[i].digest)
    meshes = tuple(draw(st.lists(_mesh_entries(), max_size=2)))
    sharded = []
    for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):  # sharded entries, blocks to match
        i = draw(st.integers(-1, len(tensors)))
        sharded.append(draw(_sharded_entries(i, len(meshes))))
        if 0 <= i < len(tensors) and 0 <= tensors[i].blob < len(blobs) and draw(st.booleans()):
            b = blobs[tensors[i].blob]
            blobs[tensors[i].blob] = msgspec.structs.replace(
                b, blocks=bytes(blocks_nbytes(b.nbytes))
            )
    tree = msgspec.msgpack.encode(draw(_tree)) if draw(st.booleans()) else base.tree
    return msgspec.structs.replace(
        base,
        tensors=tuple(tensors),
        blobs=tuple(blobs),
        tree=tree,
        meshes=meshes,
        sharded=tuple(sharded),
    )


_placements = st.sampled_from(["R", "S0", "S1", "S3", "SS0:2", "SS1:3", "SS0:1000", "Q", "S"])


@st.composite
def _mesh_entries(draw: st.DrawFn) -> MeshEntry:
    shape = draw(st.lists(st.integers(-1, 4), max_size=3).map(tuple))
    ranks = tuple(range(max(0, math.prod(shape)))) if draw(st.booleans()) else draw(_dims)
    return MeshEntry(
        shape=shape,
        dims=tuple(draw(st.lists(st.sampled_from(["dp", "tp"]), max_size=3))),
        ranks=ranks,
        coordinate=draw(_dims),
    )


@st.composite
def _sharded_entries(draw: st.DrawFn, tensor: int, meshes: int) -> ShardedEntry:
    return ShardedEntry(
        tensor=tensor,
        global_shape=draw(_dims),
        offsets=draw(_dims),
        mesh=draw(st.integers(-1, meshes)),
        placements=tuple(draw(st.lists(_placements, max_size=3))),
    )


def _arrays(value: Any) -> list[torch.Tensor | np.ndarray]:
    if isinstance(value, torch.Tensor | np.ndarray):
        return [value]
    if isinstance(value, dict):
        return [a for k, v in value.items() for a in _arrays(k) + _arrays(v)]
    if isinstance(value, list | tuple) and not isinstance(value, torch.Size):
        return [a for v in value for a in _arrays(v)]
    return []


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[ShardHeader, bytes]:
    path = tmp_path_factory.mktemp("mixed") / "mixed.shard"
    write_shard(path, _mixed_state(), job="j", step=1)
    head = read_head(path)
    return head.header, path.read_bytes()[head.data_offset :]


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@hsettings(
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_fuzzed_headers_load_or_fail_cleanly_within_the_file(
    tmp_path: Path, mixed: tuple[ShardHeader, bytes], data: st.DataObject
) -> None:
    """Whatever a sealed header says, loading raises only ShardFormatError/IntegrityError or
    returns tensors backed by no more memory than the file holds, none larger than its blob
    unless the header declares that blob shared."""
    base, region = mixed
    header = data.draw(_hostile_header(base))
    path = craft(tmp_path / "fuzz.shard", header, region)
    try:
        loaded_header, state = load_shard(path)
    except (ShardFormatError, IntegrityError):
        return
    size = path.stat().st_size
    users = [sum(e.blob == i for e in loaded_header.tensors) for i in range(len(header.blobs))]
    for e in loaded_header.tensors:
        if users[e.blob] == 1:
            assert math.prod(e.shape) * DTYPE_SIZES[e.dtype] <= loaded_header.blobs[e.blob].nbytes
    for a in _arrays(state):
        t = torch.from_numpy(a) if isinstance(a, np.ndarray) else a
        assert t.untyped_storage().nbytes() <= size
        if max(users, default=0) <= 1:
            assert t.numel() * t.element_size() <= t.untyped_storage().nbytes()


# --- item 15: forged `flushed` events ---------------------------------------------------------


def _publish(settings: Settings, events: list[Event]) -> None:
    """Publish `events` as an agent does: per rank, and per node (what the coordinator reads;
    a forger allowed to publish a node's events can forge its batches too)."""

    async def go() -> None:
        async with Bus(settings) as bus:
            for job in {e.job for e in events}:
                await bus.ensure_stream(job)
            batches = Batcher(bus)
            for event in events:
                await bus.publish(event)
                batches.add(event)
            await batches.flush()

    anyio.run(go)


def _forged_flushed(settings: Settings, job: str, step: int, key: str) -> list[Event]:
    """A `flushed` event naming `key`, with the `written`/`verified` pair the catalog needs as
    evidence (a forger who can publish can forge those too)."""
    ident: dict[str, Any] = dict(
        job=job, node=node_name(settings.node), ts=time.time(), step=step, rank=0, world_size=1
    )
    path = f"{settings.nvme_root}/{shard_relpath(job, step, 0, 1)}"
    where = dict(path=path, nbytes=4096, header_digest=FORGED_DIGEST)
    return [
        ShardWritten(**ident, **where, tensors=1, seconds=0.1),
        ShardVerified(**ident, **where, seconds=0.1),
        _forged_flushed_only(settings, job, step, key),
    ]


def _forged_flushed_only(settings: Settings, job: str, step: int, key: str) -> ShardFlushed:
    return ShardFlushed(
        job=job,
        node=node_name(settings.node),  # claims this very node uploaded it
        ts=time.time(),
        step=step,
        rank=0,
        world_size=1,
        bucket=settings.s3_bucket,
        key=key,
        etag="0" * 32,
        checksum="AAAAAA==-1",
        header_digest=FORGED_DIGEST,
        nbytes=4096,
        seconds=0.1,
    )


FORGED_DIGEST = "ab" * 16


@pytest.mark.slow
def test_forged_flushed_events_never_delete_objects_outside_the_jobs_own_keys(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events, s3_server: S3Server
) -> None:
    """Forged `flushed` events (with the `written`/`verified` evidence a forger can forge too)
    naming another team's object and a key of another job, with retention that removes their
    steps: the coordinator removes only this job's own keys of those steps (derived from job,
    step and rank, never taken from an event), so both objects stay."""
    s3 = boto3.client("s3", **s3_server.client_kwargs())
    bucket = settings.s3_bucket
    keys = S3Store(settings)
    other_job = keys.key("other-job", 1, 0, 1)
    s3.put_object(Bucket=bucket, Key="other-team/precious.bin", Body=b"precious")
    s3.put_object(Bucket=bucket, Key=other_job, Body=b"another job's shard")
    ours = keys.key(job, 1, 0, 1)
    s3.put_object(Bucket=bucket, Key=ours, Body=b"this job's step 1")
    _publish(
        settings,
        [
            *_forged_flushed(settings, job, 1, "other-team/precious.bin"),
            *_forged_flushed(settings, job, 2, other_job),
            *_forged_flushed(settings, job, 3, keys.key(job, 3, 0, 1)),
        ],
    )
    a = agent("evict", settings=settings.replace(s3_keep_latest_k=1)).wait_ready()

    def removed() -> bool:  # this job's own key of step 1 is removed by retention
        return "Contents" not in s3.list_objects_v2(Bucket=bucket, Prefix=ours)

    _wait_until(removed, what="the coordinator to remove step 1")
    assert s3.get_object(Bucket=bucket, Key="other-team/precious.bin")["Body"].read() == (
        b"precious"
    )
    assert s3.get_object(Bucket=bucket, Key=other_job)["Body"].read() == b"another job's shard"
    assert a.proc is not None and a.proc.poll() is None, a.log()


def _wait_until(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# --- item 21: bad CLI input ---------------------------------------------------------------------


def _saved(settings: Settings, job: str, step: int = 1) -> list[Event]:
    """The `written` and `verified` events of a shard of `job` on this test's node."""
    ident: dict[str, Any] = dict(
        job=job, node=node_name(settings.node), ts=time.time(), step=step, rank=0, world_size=1
    )
    where = dict(path=f"{settings.nvme_root}/{job}/x.shard", nbytes=8192, header_digest="cd" * 16)
    return [
        ShardWritten(**ident, **where, tensors=1, seconds=0.1),
        ShardVerified(**ident, **where, seconds=0.1),
    ]


def _last_on(settings: Settings, subject: str) -> tuple[int, bytes] | None:
    async def go() -> tuple[int, bytes] | None:
        async with Bus(settings) as bus:
            return await bus.last_raw(subject)

    return anyio.run(go)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["status", "reindex"])
def test_unknown_job_is_an_error(settings: Settings, job: str, command: str) -> None:
    """`status` and `reindex` on a job with no events, no files and no objects exit non-zero
    with a message naming the job."""
    out = run_cli(settings, command, "--job", job)
    assert out.returncode != 0, out.stdout
    assert "tierpipe: error: " in out.stderr and repr(job) in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_plan_into_a_closed_pipe_exits_quietly(settings: Settings, job: str) -> None:
    """`tierpipe plan --json` whose reader has gone (`| head -c 10`) stops without a traceback
    or any other word on stderr, exiting as a filter killed by SIGPIPE would (141)."""
    from tierpipe.control.jobstate import JobState
    from tierpipe.control.kvstate import JobStore
    from tierpipe.schemas.jobstate import Keep

    saved = _saved(settings, job)
    _publish(settings, saved)
    state = JobState(job, Keep())  # the job's state, as its coordinator would store it
    for seq, event in enumerate(saved, 1):
        state.apply(seq, event)

    async def store() -> None:
        async with Bus(settings) as bus:
            await (await JobStore(bus.js, settings).open()).write(state, state.take_changes())

    anyio.run(store)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tierpipe.cli", "plan", "--job", job, "--json"],
        env={**os.environ, **settings.as_env()},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the command prints (it imports for ~1 s)
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 128 + signal.SIGPIPE, err
    assert err == ""


@pytest.mark.slow
def test_flush_command_to_an_unknown_node_is_refused(settings: Settings, uid: str) -> None:
    """`flush pause --node <typo>` exits non-zero naming the node and `--force`, and sends
    nothing."""
    typo = f"typo-{uid}"
    out = run_cli(settings, "flush", "pause", "--node", typo)
    assert out.returncode != 0 and repr(typo) in out.stderr and "--force" in out.stderr
    assert _last_on(settings, f"{CONTROL_FLUSH}.{typo}") is None


@pytest.mark.slow
def test_forced_flush_command_to_an_unknown_node_is_sent(settings: Settings, uid: str) -> None:
    """`--force` sends a flush command to a node the stream does not know yet."""
    typo = f"typo-{uid}"
    out = run_cli(settings, "flush", "pause", "--node", typo, "--force")
    assert out.returncode == 0, out.stderr
    assert _last_on(settings, f"{CONTROL_FLUSH}.{typo}") is not None


@pytest.mark.slow
def test_flush_command_to_a_node_known_by_its_events_is_sent(settings: Settings, job: str) -> None:
    """A node that has published events, though it runs no flush worker now, is accepted."""
    _publish(settings, _saved(settings, job))
    out = run_cli(settings, "flush", "resume", "--node", settings.node)
    assert out.returncode == 0, out.stderr
    assert _last_on(settings, f"{CONTROL_FLUSH}.{settings.node}") is not None
