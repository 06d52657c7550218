"""A replicated value is stored once per job: the writer rule, the shard format, and restores of
every holder from the writer's bytes (same world, another world, the writer's NVMe copy lost)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from tests.conftest import Agent, Events, gloo_ranks
from tierpipe.errors import LayoutMismatchError, ShardFormatError, ShardMissingError
from tierpipe.names import shard_relpath
from tierpipe.recovery.load import Expected, load_into
from tierpipe.reshard.assemble import assemble
from tierpipe.reshard.layout import box_of, coordinate_of
from tierpipe.reshard.reads import Origin, Tiers
from tierpipe.schemas import ShardedEntry, ShardFlushed, ShardHeader, SourceRef
from tierpipe.settings import Settings
from tierpipe.state import layout_mismatch, plan_state
from tierpipe.storage.reader import read_head
from tierpipe.storage.s3.store import S3Store
from tierpipe.storage.shard import (
    block_digests,
    encode_head,
    file_nbytes,
    parse_head,
    parse_prefix,
)
from tierpipe.storage.sharding import replica_writer

# --- the writer rule (pure)


def writers(
    shape: tuple[int, ...], mesh: tuple[int, ...], placements: tuple[str, ...], ranks: Any = None
) -> list[int | None]:
    ranks = tuple(range(len(list(_positions(mesh))))) if ranks is None else tuple(ranks)
    return [replica_writer(shape, mesh, ranks, c, placements) for c in _positions(mesh)]


def _positions(mesh: tuple[int, ...]) -> list[tuple[int, ...]]:
    n = 1
    for k in mesh:
        n *= k
    return [coordinate_of(i, mesh) for i in range(n)]


def test_the_writer_is_the_lowest_rank_holding_the_same_box() -> None:
    """1-D replicated: rank 0 for all; (S, R): the first of each row; (R, S): the first row;
    ranks not in order: the lowest global rank of each group; a sharded-only layout: each
    rank its own."""
    assert writers((8, 4), (4,), ("R",)) == [0, 0, 0, 0]
    assert writers((8, 4), (2, 2), ("S0", "R")) == [0, 0, 2, 2]
    assert writers((8, 4), (2, 2), ("R", "S1")) == [0, 1, 0, 1]
    assert writers((8, 4), (2, 2), ("S0", "R"), ranks=(7, 3, 5, 6)) == [3, 3, 5, 5]
    assert writers((8, 4), (2, 2), ("S0", "S1")) == [0, 1, 2, 3]
    assert writers((), (3,), ("R",)) == [0, 0, 0]  # (a 0-d tensor: one element)


def test_uneven_and_empty_shards() -> None:
    """Uneven shards: each its own box; an empty shard holds nothing and is no holder (None),
    so it never becomes a writer, nor does an empty replicated tensor."""
    assert writers((3, 5), (4,), ("S0",)) == [0, 1, 2, None]
    assert writers((1, 4), (2, 2), ("S0", "R")) == [0, 0, None, None]
    assert writers((0, 4), (2,), ("R",)) == [None, None]
    # (S0, S0) on 3 rows: positions (1, 1) and (1, 0)... each its own non-empty box or empty
    assert writers((3,), (2, 2), ("S0", "S0")) == [0, 1, 2, None]


@pytest.mark.parametrize(
    ("shape", "mesh", "placements"),
    [
        ((9, 7), (2, 2), ("R", "S1")),
        ((9, 7), (2, 3), ("S0", "R")),
        ((8, 6), (2, 2), ("SS0:2", "S0")),
        ((5,), (2, 2, 2), ("R", "S0", "R")),
        ((13, 3, 4), (2, 3), ("S2", "R")),
    ],
)
def test_the_writer_is_the_holder_a_restore_reads(
    shape: tuple[int, ...], mesh: tuple[int, ...], placements: tuple[str, ...]
) -> None:
    """The restore groups holders by their box (`box_of`) and reads the lowest: the writer."""
    groups: dict[Any, list[int]] = {}
    for i, c in enumerate(_positions(mesh)):
        box = box_of(shape, mesh, c, placements)
        if all(box.shape):
            groups.setdefault(box, []).append(i)
    got = writers(shape, mesh, placements)
    for members in groups.values():
        assert {got[i] for i in members} == {min(members)}, members


# --- the shard format


DDP = {"model": {"w": torch.arange(1000, dtype=torch.float32), "b": torch.zeros(0)},
       "optim": {"lr": 0.5}, "r": torch.tensor([0])}  # fmt: skip


def planned(rank: int, world: int = 2, state: Any = None) -> Any:
    return plan_state(
        DDP if state is None else state, job="j", step=3, rank=rank, world_size=world, node="n",
        replicated=frozenset({"model", "optim"}),
    )  # fmt: skip


def test_only_rank_0_stores_a_declared_replicated_value() -> None:
    """Declared keys: every rank lists the tensors (a 1-D mesh of the world, `R`, writer 0),
    only rank 0's blobs hold bytes; undeclared ones and plain values are every rank's own."""
    zero, one = planned(0), planned(1)
    for p, rank in ((zero, 0), (one, 1)):
        by_path = {e.path: p.header.blobs[e.blob].nbytes for e in p.header.tensors}
        assert by_path[("model", "w")] == (4000 if rank == 0 else 0)
        assert by_path[("r",)] == 8
        assert [s.writer for s in p.header.sharded] == [0, rank]  # (w; b is empty: its own)
        assert p.header.meshes[0].ranks == (0, 1) and p.header.meshes[0].coordinate == (rank,)
    assert zero.tensor_nbytes - one.tensor_nbytes == 4000
    assert layout_mismatch(zero.header, None) is None
    err = layout_mismatch(one.header, None)
    assert isinstance(err, LayoutMismatchError) and "stored once by rank 0" in str(err)
    assert "replicated=" in str(err)


def sealed(plan: Any, header: ShardHeader | None = None, data: dict[int, bytes] | None = None):
    """A sealed image of `plan` (its header, or `header`; blob `i`'s bytes, or `data[i]`)."""
    image = bytearray(plan.nbytes)
    plan.copy_into(plan.destinations(torch.frombuffer(image, dtype=torch.uint8)))
    start = len(plan.head)
    header = plan.header if header is None else header
    datas = [
        (data or {}).get(i, bytes(image[start + b.offset : start + b.offset + b.nbytes]))
        for i, b in enumerate(header.blobs)
    ]
    blobs = tuple(
        msgspec.structs.replace(
            b, nbytes=len(d), digest=_xxh128(d), blocks=block_digests(d) if b.blocks or (
                i in {header.tensors[s.tensor].blob for s in header.sharded}) else b"",
        )
        for i, (b, d) in enumerate(zip(header.blobs, datas, strict=True))
    )  # fmt: skip
    header = msgspec.structs.replace(header, blobs=blobs)
    head = encode_head(header, sealed=True)
    out = bytearray(file_nbytes(len(head), header.blobs))
    out[: len(head)] = head
    for b, d in zip(header.blobs, datas, strict=True):
        out[len(head) + b.offset : len(head) + b.offset + len(d)] = d
    return bytes(out)


def _xxh128(d: bytes) -> bytes:
    import xxhash

    return xxhash.xxh3_128_digest(d)


def test_the_shard_format_checks_the_writer() -> None:
    """Sealed files parse; a non-writer that claims to be the writer, or holds the writer's
    bytes, is refused; an older file (no writer field: -1) reads as every holder storing."""
    parse_head(sealed(planned(0)), "r0")
    parse_head(sealed(planned(1)), "r1")
    one = planned(1).header
    claims = msgspec.structs.replace(
        one, sharded=tuple(msgspec.structs.replace(s, writer=1) for s in one.sharded)
    )
    with pytest.raises(ShardFormatError, match="names rank 1 as its writer, the layout gives"):
        parse_head(sealed(planned(1), claims), "forged")
    zero = planned(0)  # rank 0's bytes in a file that says it is rank 1's (writer 0)
    mesh = msgspec.structs.replace(zero.header.meshes[0], coordinate=(1,))
    holds = msgspec.structs.replace(zero.header, rank=1, meshes=(mesh,))
    with pytest.raises(ShardFormatError, match="holds bytes rank 0 writes"):
        parse_head(sealed(zero, holds), "forged")
    old = msgspec.msgpack.encode([0, (4,), (0,), 0, ("R",)])
    assert msgspec.msgpack.decode(old, type=ShardedEntry).writer == -1


def test_a_plain_read_of_a_non_writer_never_invents_its_bytes(tmp_path: Path) -> None:
    """Read whole (`load_into`, as an export does), rank 1's shard gives a replica it holds no
    bytes of as a meta tensor (shape and dtype, no data), its own values as they are; into a
    target the in-place restore refuses it, naming the way that works."""
    path = tmp_path / "r1"
    path.write_bytes(sealed(planned(1)))
    state = load_into(str(path)).state
    w = state["model"]["w"]
    assert w.is_meta and w.shape == (1000,) and w.dtype == torch.float32
    assert state["optim"]["lr"] == 0.5 and not state["r"].is_meta
    with pytest.raises(LayoutMismatchError, match=r"model/w: .*replicated="):
        load_into(str(path), {"model": {"w": torch.zeros(1000)}})
    assert torch.equal(load_into(str(tmp_path / "r1"), {"r": torch.zeros(1)}).state["r"], DDP["r"])


def write(path: Path, image: bytes, rank: int, world: int = 2) -> Origin:
    path.write_bytes(image)
    digest = parse_prefix(image, str(path))[2].hex()  # (a forged file: not parsed here)
    ref = SourceRef(tier="nvme", node="n", location=str(path), nbytes=len(image),
                    header_digest=digest)  # fmt: skip
    return Origin(Expected("j", 3, rank, world, digest), len(image), [ref])


@pytest.mark.anyio
async def test_a_non_writer_reads_the_writers_bytes_and_never_a_forgery(tmp_path: Path) -> None:
    """Rank 1 (no bytes of `model/w`) restores it from rank 0's shard, into a target and
    without one; a forged rank 1 shard claiming those bytes is refused (its restore names
    why), and with the writer's shard missing the restore says so: never other bytes."""
    origins = {r: write(tmp_path / f"r{r}", sealed(planned(r)), r) for r in range(2)}

    async def origin(r: int) -> Origin:
        return origins[r]

    async with Tiers(Settings(node="n"), None, node="n") as tiers:
        target = {"model": {"w": torch.zeros(1000), "b": torch.zeros(0)}}
        got = await assemble(tiers, origin, target, rank=1, old_world=2)
        assert torch.equal(target["model"]["w"], DDP["model"]["w"])
        assert got.state["optim"]["lr"] == 0.5 and int(got.state["r"]) == 0  # (rank 1 saved 0)
        got = await assemble(tiers, origin, None, rank=1, old_world=2)
        assert torch.equal(got.state["model"]["w"], DDP["model"]["w"])
        # A forged rank 1: its own zeros as `model/w`, claiming to be the writer.
        zero = planned(0)
        mesh = msgspec.structs.replace(zero.header.meshes[0], coordinate=(1,))
        forged = msgspec.structs.replace(
            zero.header, rank=1, meshes=(mesh,),
            sharded=tuple(msgspec.structs.replace(s, writer=1) for s in zero.header.sharded),
        )  # fmt: skip
        w_blob = zero.header.tensors[0].blob
        origins[1] = write(tmp_path / "forged", sealed(zero, forged, {w_blob: bytes(4000)}), 1)
        with pytest.raises(ShardMissingError, match="ShardFormatError"):
            await assemble(tiers, origin, None, rank=1, old_world=2)
        # Rank 1 good again, the writer's shard gone.
        origins[1] = write(tmp_path / "r1", sealed(planned(1)), 1)
        os.remove(tmp_path / "r0")
        with pytest.raises(ShardMissingError):
            await assemble(tiers, origin, None, rank=1, old_world=2)


# --- end to end: gloo ranks, a real agent, object storage


def run_ranks(
    settings: Settings, job: str, world: int, tmp_path: Path, action: str
) -> list[dict[str, Any]]:
    """`tests/replicated_rank.py` as `world` processes of one gloo group; their JSON lines,
    each with its rank's warnings (`log`: e.g. why a step was abandoned, for a failed assertion
    to show)."""
    ranks = gloo_ranks(settings, "tests.replicated_rank", [job, action], world, tmp_path)
    return [
        {**json.loads(stdout.strip().splitlines()[-1]), "log": stderr[-3000:]}
        for stdout, stderr in ranks
    ]


def expected(step: int, world: int | None = None, rank: int = 0) -> dict[str, str]:
    """The full tensors' sums; with `world`: `model/w` as that saved rank's local shard."""
    from tests.replicated_rank import global_state, sha

    g = global_state(step)
    out = {f"{k}/{n}": sha(v) for k in g for n, v in g[k].items() if isinstance(v, torch.Tensor)}
    if world is not None:
        out["model/w"] = sha(torch.chunk(g["model"]["w"], world)[rank])
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)  # (gloo ranks on a loaded 2-core machine)
def test_a_replicated_value_is_stored_once_and_every_rank_restores_it(
    settings: Settings,
    job: str,
    agent: Callable[..., Agent],
    events: Events,
    tmp_path: Path,
    s3_server: Any,
) -> None:
    """Two ranks save a `Replicate` DTensor and a declared-replicated plain dict: only rank
    0's shard (on NVMe and in object storage) holds their bytes. Both ranks restore them
    bitwise on the same layout (into targets and without), on three ranks, and from object
    storage once rank 0's NVMe copy is lost; with its object gone too, the step before."""
    import boto3

    agent()
    assert [r["saved"] for r in run_ranks(settings, job, 2, tmp_path, "save")] == [0, 1]
    for step in (1, 2):
        for rank in range(2):
            events.wait_for(lambda e, s=step, r=rank: isinstance(e, ShardFlushed)
                            and (e.step, e.rank) == (s, r), kind="flushed")  # fmt: skip
    nvme = Path(settings.nvme_root).absolute()
    files = {r: nvme / shard_relpath(job, 2, r, 2) for r in range(2)}
    held = {}
    for r, path in files.items():
        header = read_head(str(path)).header
        held[r] = {"/".join(map(str, e.path)): header.blobs[e.blob].nbytes for e in header.tensors}
    replicas = {"model/norm": 1200, "ddp/emb": 3200, "ddp/n": 40}
    for name, nbytes in replicas.items():
        assert (held[0][name], held[1][name]) == (nbytes, 0), name
    assert held[0]["model/w"] == held[1]["model/w"] == 60  # (each rank's own half)
    s3 = boto3.client("s3", **s3_server.client_kwargs())
    sizes = {
        r: s3.head_object(Bucket=settings.s3_bucket, Key=S3Store(settings).key(job, 2, r, 2))[
            "ContentLength"
        ]
        for r in range(2)
    }
    assert sizes == {r: files[r].stat().st_size for r in range(2)}
    assert sizes[0] - sizes[1] >= sum(replicas.values())

    results = run_ranks(settings, job, 2, tmp_path, "restore")
    assert [(r["step"], r["r"], r["lr"]) for r in results] == [(2, 0, 0.2), (2, 1, 0.2)], results
    assert all(r["sums"] == expected(2) for r in results), results
    results = run_ranks(settings, job, 2, tmp_path, "restore-none")
    assert [r["sums"] for r in results] == [expected(2, 2, 0), expected(2, 2, 1)]
    results = run_ranks(settings, job, 3, tmp_path, "restore")
    assert [(r["step"], r["r"]) for r in results] == [(2, 0), (2, 1), (2, 0)], results
    assert all(r["sums"] == expected(2) for r in results), results
    # The writer's node lost: its NVMe copy gone, the others read its object.
    os.remove(files[0])
    results = run_ranks(settings, job, 2, tmp_path, "restore")
    assert [(r["step"], r["tier"]) for r in results] == [(2, "s3"), (2, "s3")], results
    assert all(r["sums"] == expected(2) for r in results), results
    # And its object too: no copy of step 2's replicas is left, every rank takes step 1.
    s3.delete_object(Bucket=settings.s3_bucket, Key=S3Store(settings).key(job, 2, 0, 2))
    results = run_ranks(settings, job, 2, tmp_path, "restore")
    assert [(r["step"], r["rounds"]) for r in results] == [(1, 2), (1, 2)], results
    assert all(r["sums"] == expected(1) for r in results), results
