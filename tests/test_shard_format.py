"""The shard file format: exact round-trips of training state, and clear errors for bad files."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from tierpipe.errors import IntegrityError, ShardFormatError, UnsupportedStateError
from tierpipe.recovery.load import load_shard
from tierpipe.schemas import (
    ALIGN,
    BLOCK_BYTES,
    BlobEntry,
    MeshEntry,
    ShardedEntry,
    ShardHeader,
    TensorEntry,
)
from tierpipe.storage.reader import read_head
from tierpipe.storage.shard import (
    PREFIX_NBYTES,
    block_digests,
    blocks_nbytes,
    encode_head,
    parse_head,
    seal_header,
)
from tierpipe.storage.shardfile import write_shard

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]


def roundtrip(tmp_path: Path, state: Any, name: str = "s.shard") -> Any:
    path = tmp_path / name
    write_shard(path, state, job="j", step=7, rank=1, world_size=4)
    header, loaded = load_shard(path)
    assert (header.job, header.step, header.rank, header.world_size) == ("j", 7, 1, 4)
    return loaded


def assert_same(a: Any, b: Any) -> None:
    """Equal in structure, types, dtypes, shapes and bits."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
        assert torch.equal(
            a.view(torch.uint8) if a.dtype == torch.bool else a,
            b.view(torch.uint8) if b.dtype == torch.bool else b,
        )
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b or (a != a and b != b)  # NaN


def test_model_and_adamw_state_round_trip(tmp_path: Path) -> None:
    """A real model's and AdamW's state dicts come back bit-identical, int keys and all."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    for _ in range(3):
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    loaded = roundtrip(tmp_path, state)
    assert_same({k: dict(v) for k, v in state.items()}, loaded)
    fresh = torch.optim.AdamW(
        torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)
        ).parameters()
    )
    fresh.load_state_dict(loaded["optim"])  # loads like the original


def test_objects_with_state_dict_are_stored_as_their_state(tmp_path: Path) -> None:
    """Modules and optimizers passed directly are stored as their state dicts."""
    model = torch.nn.Linear(3, 2)
    loaded = roundtrip(tmp_path, {"model": model})
    assert_same(dict(model.state_dict()), loaded["model"])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips(tmp_path: Path, dtype: torch.dtype) -> None:
    """Each supported dtype comes back with the same bits, including 0-dim and empty tensors."""
    full = (torch.randn(5, 3) * 100).to(dtype)
    state = {"full": full, "scalar": full[0, 0].clone(), "empty": torch.empty(0, 3, dtype=dtype)}
    loaded = roundtrip(tmp_path, state)
    assert_same(state, loaded)
    assert loaded["scalar"].dim() == 0


def test_non_contiguous_views_and_shared_storage(tmp_path: Path) -> None:
    """Views come back with their values; tensors sharing storage come back sharing it."""
    base = torch.arange(24, dtype=torch.float32)
    transposed = torch.randn(4, 6).t()
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    state = {
        "t": transposed,
        "base": base,
        "strided": base[1:20:3],
        "window": base.view(4, 6)[1:3, 2:5],
        "embed": emb.state_dict()["weight"],
        "head": head.state_dict()["weight"],
    }
    loaded = roundtrip(tmp_path, state)
    for k in state:
        assert torch.equal(state[k], loaded[k]), k
    assert loaded["embed"].data_ptr() == loaded["head"].data_ptr()
    # Views of one base share its storage; writing through the base shows in the views.
    loaded["base"][4] = -1
    assert loaded["strided"][1] == -1 and loaded["window"][0, 2] == 10
    # An unrelated tensor does not alias anything.
    assert loaded["t"].untyped_storage().data_ptr() != loaded["base"].untyped_storage().data_ptr()


def test_rng_and_plain_state_round_trip(tmp_path: Path) -> None:
    """RNG states of torch, random and numpy and dataloader-like dicts come back exactly."""
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    state = {
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state(),
        "numpy_gen": np.random.default_rng(5).bit_generator.state,
        "loader": {"epoch": 3, "index": 1024, "files": ["a.bin", "b.bin"], "seed": 2**40, 7: None},
        "misc": (1.5, float("nan"), float("-inf"), b"\x00\xff", True, None, 2**100, -(2**70)),
        "np_scalar": np.float32(0.25),
        "shape": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
    }
    loaded = roundtrip(tmp_path, state)
    assert_same(state, loaded)

    def draws(rngs: dict[str, Any]) -> list[float]:
        random.setstate(rngs["python_rng"])
        np.random.set_state(rngs["numpy_rng"])
        torch.set_rng_state(rngs["torch_rng"])
        return [random.random(), float(np.random.rand()), torch.rand(1).item()]

    assert draws(loaded) == draws(state)


def test_tensor_data_is_4k_aligned(tmp_path: Path) -> None:
    """Every blob starts on a 4 KiB boundary of the file (O_DIRECT and mmap friendly)."""
    path = tmp_path / "a.shard"
    write_shard(
        path, {"a": torch.ones(3), "b": torch.zeros(5000, dtype=torch.int8)}, job="j", step=0
    )
    head = read_head(path)
    assert head.data_offset % ALIGN == 0 and os.path.getsize(path) % ALIGN == 0
    assert all(b.offset % ALIGN == 0 for b in head.header.blobs)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (object(), "type object"),
        ({(1, 2): torch.ones(1)}, "not a str or int"),
        (torch.ones(2).to_sparse(), "dense strided"),
        (lambda: 0, "type function"),
    ],
    ids=["object", "tuple-key", "sparse", "lambda"],
)
def test_unsupported_values_fail_clearly(tmp_path: Path, value: Any, match: str) -> None:
    """A value that cannot be stored without pickle is rejected, naming its key path."""
    with pytest.raises(UnsupportedStateError, match=match) as err:
        write_shard(tmp_path / "x.shard", {"outer": {"bad": value}}, job="j", step=0)
    assert err.value.path == ("outer", "bad")
    assert not (tmp_path / "x.shard").exists()


def test_reference_cycle_is_rejected(tmp_path: Path) -> None:
    """A self-referencing state is an error, not infinite recursion."""
    state: dict[str, Any] = {"a": 1}
    state["me"] = state
    with pytest.raises(UnsupportedStateError, match="cycle"):
        write_shard(tmp_path / "x.shard", state, job="j", step=0)


@pytest.fixture
def shard(tmp_path: Path) -> Path:
    path = tmp_path / "good.shard"
    write_shard(path, {"w": torch.arange(4096, dtype=torch.float32), "step": 1}, job="j", step=1)
    return path


def test_truncated_file_names_the_file(shard: Path) -> None:
    """Cutting a shard anywhere gives a ShardFormatError naming the file, never a tensor."""
    size = shard.stat().st_size
    for cut in (0, 10, PREFIX_NBYTES + 5, size // 2, size - 1):
        data = shard.read_bytes()[:cut]
        bad = shard.with_name(f"cut-{cut}.shard")
        bad.write_bytes(data)
        with pytest.raises(ShardFormatError) as err:
            load_shard(bad)
        assert str(bad) in str(err.value)


def test_flipped_data_byte_fails_the_digest(shard: Path) -> None:
    """A flipped bit in tensor data is caught before it reaches a tensor, naming the tensor."""
    head = read_head(shard)
    raw = bytearray(shard.read_bytes())
    raw[head.data_offset + head.header.blobs[0].offset + 100] ^= 0x01
    shard.write_bytes(raw)
    with pytest.raises(IntegrityError) as err:
        load_shard(shard)
    e = err.value
    assert e.path == str(shard) and e.what == "tensor w" and e.expected != e.actual


def test_garbled_header_and_magic(shard: Path) -> None:
    """A garbled header fails its digest; a wrong magic says it is not a shard."""
    raw = bytearray(shard.read_bytes())
    raw[PREFIX_NBYTES + 3] ^= 0xFF
    shard.write_bytes(raw)
    with pytest.raises(IntegrityError) as err:
        load_shard(shard)
    assert err.value.what == "header"
    raw[:8] = b"NOTSHARD"
    shard.write_bytes(raw)
    with pytest.raises(ShardFormatError, match="not a tierpipe shard"):
        load_shard(shard)


def test_random_garbage_never_crashes(tmp_path: Path) -> None:
    """Random bytes with a valid-looking prefix fail with a tierpipe error, not a crash."""
    rng = random.Random(0)
    good = tmp_path / "g.shard"
    write_shard(good, {"a": torch.ones(10)}, job="j", step=1)
    raw = good.read_bytes()
    for i in range(50):
        data = bytearray(raw)
        for _ in range(8):
            data[rng.randrange(len(data))] = rng.randrange(256)
        bad = tmp_path / f"r{i}.shard"
        bad.write_bytes(data)
        try:
            load_shard(bad)
        except (ShardFormatError, IntegrityError):
            pass


plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text()
    | st.binary(),
    lambda children: (
        st.lists(children, max_size=4)
        | st.tuples(children, children)
        | st.dictionaries(st.text(max_size=5) | st.integers(), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=60, deadline=None)
@given(value=plain, shape=st.lists(st.integers(0, 4), max_size=3))
def test_any_nested_plain_state_round_trips(
    tmp_path_factory: pytest.TempPathFactory, value: Any, shape: list[int]
) -> None:
    """Arbitrary nesting of plain values and tensors round-trips exactly."""
    state = {"v": value, "t": torch.randn(shape) if shape else torch.tensor(1.0)}
    tmp = tmp_path_factory.mktemp("h")
    assert_same(state, roundtrip(tmp, state))


# --- sharded tensors: their layout and block digests in the header ----------------------------


def _sharded_header(nbytes: int) -> ShardHeader:
    """A header whose one tensor (a float32 local shard of `nbytes`) is rank (1, 0)'s part of a
    global tensor on a 2x2 mesh, FSDP2 + TP style."""
    n = nbytes // 4
    return ShardHeader(
        job="j", step=3, rank=2, world_size=4, node="n", created=0.0,
        tree=msgspec.msgpack.encode(["d", "w", ["T", 0]]),
        tensors=(TensorEntry(("w",), "float32", (n, 1), (1, 1), 0, 0),),
        blobs=(BlobEntry(0, nbytes, bytes(16), bytes(blocks_nbytes(nbytes))),),
        meshes=(MeshEntry((2, 2), ("dp", "tp"), (0, 1, 2, 3), (1, 0)),),
        sharded=(ShardedEntry(0, (4 * n, 1), (n, 0), 0, ("SS0:2", "S0")),),
    )  # fmt: skip


@pytest.mark.parametrize("nbytes", [0, 4, BLOCK_BYTES, BLOCK_BYTES + 4, 3 * BLOCK_BYTES - 4])
def test_sharded_entries_and_block_digests_round_trip_through_sealing(nbytes: int) -> None:
    """A staged head with a sharded entry and zero block digests parses; sealing fills in the
    block digests without moving the data region, and the sealed head parses back equal."""
    header = _sharded_header(nbytes)
    head = encode_head(header, sealed=False)
    staged = parse_head(head, "<staged>", sealed=False).header
    assert staged.sharded == header.sharded and staged.blobs == header.blobs
    assert staged.meshes == header.meshes
    data = bytes(range(256)) * (nbytes // 256) + bytes(nbytes % 256)
    blocks = block_digests(data)
    assert len(blocks) == blocks_nbytes(nbytes) == -(-nbytes // BLOCK_BYTES) * 8
    sealed = seal_header(header, [xxhash.xxh3_128_digest(data)], [blocks])
    sealed_head = encode_head(sealed, sealed=True)
    assert len(sealed_head) == len(head)
    back = parse_head(sealed_head, "<sealed>").header
    assert back.blobs[0].blocks == blocks and back.sharded == header.sharded


def test_sharded_entries_of_one_mesh_hold_its_ranks_once() -> None:
    """Sharded entries refer to their mesh in the header's table: on a 1024-rank mesh, each
    entry costs the header tens of bytes, not a copy of the mesh's ranks."""
    dp, tp, n = 128, 8, 64
    mesh = MeshEntry((dp, tp), ("dp", "tp"), tuple(range(dp * tp)), (1, 1))

    def header(entries: int) -> ShardHeader:
        return ShardHeader(
            job="j", step=1, rank=9, world_size=dp * tp, node="n", created=0.0,
            tree=msgspec.msgpack.encode(["l", *(["T", i] for i in range(entries))]),
            tensors=tuple(TensorEntry((str(i),), "float32", (n, 4), (4, 1), i, 0)
                          for i in range(entries)),
            blobs=tuple(BlobEntry(i * 4096, n * 16, bytes(16), bytes(8)) for i in range(entries)),
            meshes=(mesh,),
            sharded=tuple(ShardedEntry(i, (n * dp * tp, 4), (129 * n, 0), 0, ("SS0:8", "S0"))
                          for i in range(entries)),
        )  # fmt: skip

    one, many = encode_head(header(1), sealed=False), encode_head(header(101), sealed=False)
    assert len(one) > 2 * dp * tp  # (the ranks, once)
    per_entry = (len(many) - len(one)) / 100
    assert per_entry < 120, per_entry  # (tensor + blob + sharded entries, tree reference)
    back = parse_head(many, "<staged>", sealed=False).header
    assert back.meshes == (mesh,) and back.sharded == header(101).sharded


@settings(max_examples=40, deadline=None)
@given(
    nbytes=st.integers(0, 3 * BLOCK_BYTES + 5),
    cuts=st.lists(st.integers(0, 3 * BLOCK_BYTES + 5), max_size=6),
)
def test_block_digests_of_a_blob_read_in_pieces_are_those_of_the_whole(
    nbytes: int, cuts: list[int]
) -> None:
    """The verify engine's block digests, from a blob read in pieces cut anywhere (reads of any
    size), equal `block_digests` of the whole: a good file verifies, whatever the chunking."""
    from tierpipe.storage.reader import _BlockHasher

    data = os.urandom(nbytes)
    hasher = _BlockHasher()
    at = 0
    for cut in [*sorted({min(c, nbytes) for c in cuts}), nbytes]:
        hasher.update(memoryview(data)[at:cut])
        at = max(at, cut)
    assert hasher.digest() == block_digests(data)
