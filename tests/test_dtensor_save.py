"""DTensor values in the state: saved as local shards with their global layout and block digests,
restored in place into targets of the same layout, refused clearly otherwise."""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import torch.distributed as dist
import xxhash
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from tests.conftest import Agent, Events
from tierpipe.errors import IntegrityError, LayoutMismatchError, UnsupportedStateError
from tierpipe.recovery.load import load_into, load_shard
from tierpipe.schemas import BLOCK_BYTES, MeshEntry, ShardedEntry, ShardFlushed, ShardHeader
from tierpipe.settings import Settings
from tierpipe.state import layout_mismatch
from tierpipe.storage.nvme import NvmeStore
from tierpipe.storage.reader import check_image, read_head
from tierpipe.storage.shard import block_digests, encode_head, mesh_of
from tierpipe.storage.shardfile import write_shard
from tierpipe.storage.sharding import local_box

# --- the layout arithmetic, against torch's own sharding --------------------------------------


def _torch_indices(n: int, mesh_shape: list[int], coord: list[int], placements: list[str], d: int):
    """The global indices of tensor dim `d` (of size n) a coordinate holds, as torch splits them."""
    idx = torch.arange(n)
    for size, at, text in zip(mesh_shape, coord, placements, strict=True):
        if text == "R" or int(text.lstrip("S").split(":")[0]) != d:
            continue
        if text.startswith("SS"):
            placement: Any = _StridedShard(0, split_factor=int(text.split(":")[1]))
        else:
            placement = Shard(0)
        shards, _ = placement._split_tensor(idx, size, with_padding=False)
        idx = shards[at]
    return idx.tolist()


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[tuple[int, ...], list[int], list[int], list[str]]:
    shape = tuple(draw(st.lists(st.integers(0, 13), min_size=1, max_size=3)))
    mesh = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    coord = [draw(st.integers(0, n - 1)) for n in mesh]
    kinds = st.sampled_from(["R", "S", "SS"])
    placements = []
    for _ in mesh:
        kind, dim = draw(kinds), draw(st.integers(0, len(shape) - 1))
        placements.append(
            "R"
            if kind == "R"
            else f"S{dim}"
            if kind == "S"
            else f"SS{dim}:{draw(st.integers(1, math.prod(mesh)))}"
        )
    return shape, mesh, coord, placements


@given(_layouts())
def test_local_box_is_where_torch_puts_the_shard(
    layout: tuple[tuple[int, ...], list[int], list[int], list[str]],
) -> None:
    """`local_box` gives the box torch's sharding puts a coordinate's shard in (an empty shard at
    the dimension's end, as `compute_local_shape_and_global_offset`), or None exactly where the
    indices it holds are not one run."""
    shape, mesh, coord, placements = layout
    box = local_box(shape, tuple(mesh), tuple(coord), tuple(placements))
    runs = [_torch_indices(n, mesh, coord, placements, d) for d, n in enumerate(shape)]
    contiguous = all(r == list(range(r[0], r[0] + len(r))) for r in runs if r)
    if not contiguous:
        assert box is None
        return
    assert box is not None
    offsets, local = box
    assert local == tuple(len(r) for r in runs)
    assert offsets == tuple(r[0] if r else n for r, n in zip(runs, shape, strict=True))


# --- one process: a world-1 gloo group ---------------------------------------------------------


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DeviceMesh]:
    """A 1-rank gloo group (destroyed afterwards: other tests in this process must not see it)
    and its 1-D mesh."""
    store = tmp_path_factory.mktemp("gloo") / "store"
    dist.init_process_group("gloo", store=dist.FileStore(str(store), 1), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    finally:
        dist.destroy_process_group()


def test_dtensor_is_saved_as_its_local_shard_with_its_layout(
    tmp_path: Path, mesh: DeviceMesh
) -> None:
    """A DTensor is stored as its local tensor with a sharded entry (global shape, offsets, mesh,
    placements) and per-block digests of exactly its bytes; its mesh is listed once however
    many DTensors lie on it; it loads back, without a target, as the local shard."""
    torch.manual_seed(0)
    dt = distribute_tensor(torch.randn((3 * BLOCK_BYTES) // 8 + 5, 2), mesh, [Shard(0)])
    rep = distribute_tensor(torch.arange(6.0), mesh, [Replicate()])
    path = tmp_path / "s.shard"
    write_shard(path, {"w": dt, "r": rep, "plain": torch.ones(3)}, job="j", step=1)
    header = read_head(path).header
    by_path = {header.tensors[s.tensor].path: s for s in header.sharded}
    assert set(by_path) == {("w",), ("r",)}
    w = by_path[("w",)]
    assert (w.global_shape, w.offsets, w.placements) == (tuple(dt.shape), (0, 0), ("S0",))
    assert header.meshes == (MeshEntry((1,), ("dp",), (0,), (0,)),)
    assert mesh_of(header, w) == header.meshes[0] and by_path[("r",)].mesh == w.mesh == 0
    assert by_path[("r",)].placements == ("R",)
    local = dt.to_local().contiguous().view(torch.uint8).numpy().tobytes()
    blob = header.blobs[header.tensors[w.tensor].blob]
    assert blob.blocks == block_digests(local) and len(blob.blocks) == 4 * 8
    assert blob.digest == xxhash.xxh3_128_digest(local)
    plain = next(e for e in header.tensors if e.path == ("plain",))
    assert header.blobs[plain.blob].blocks == b""
    _, state = load_shard(path)
    assert type(state["w"]) is torch.Tensor and torch.equal(state["w"], dt.to_local())
    assert torch.equal(state["r"], rep.to_local())


def test_each_mesh_is_listed_once_and_entries_name_theirs(tmp_path: Path, mesh: DeviceMesh) -> None:
    """DTensors on two meshes (and on a second, equal mesh object): the header lists each mesh
    once, with this rank's coordinate, and each sharded entry names its own."""
    grid = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    again = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    state = {
        "a": distribute_tensor(torch.ones(4), mesh, [Shard(0)]),
        "b": distribute_tensor(torch.ones(4, 2), grid, [Shard(0), Shard(1)]),
        "c": distribute_tensor(torch.ones(3), again, [Replicate()]),
        "d": distribute_tensor(torch.ones(2), grid, [Replicate(), Shard(0)]),
    }
    path = tmp_path / "s.shard"
    write_shard(path, state, job="j", step=1)
    header = read_head(path).header
    assert header.meshes == (
        MeshEntry((1,), ("dp",), (0,), (0,)),
        MeshEntry((1, 1), ("dp", "tp"), (0,), (0, 0)),
    )
    by_path = {header.tensors[s.tensor].path[0]: s.mesh for s in header.sharded}
    assert by_path == {"a": 0, "b": 1, "c": 0, "d": 1}
    _, back = load_shard(path)
    assert all(torch.equal(back[k], v.to_local()) for k, v in state.items())


def test_local_shard_sharing_storage_gets_a_blob_of_its_own(
    tmp_path: Path, mesh: DeviceMesh
) -> None:
    """A DTensor whose local tensor shares memory with another tensor of the state still gets a
    blob of its own (its block digests describe exactly its bytes); both load back equal."""
    dt = distribute_tensor(torch.arange(40.0).view(8, 5), mesh, [Shard(1)])
    alias = dt.to_local()[2:4]
    path = tmp_path / "s.shard"
    write_shard(path, {"w": dt, "alias": alias}, job="j", step=1)
    header = read_head(path).header
    assert len({e.blob for e in header.tensors}) == 2
    _, state = load_shard(path)
    assert torch.equal(state["w"], dt.to_local()) and torch.equal(state["alias"], alias)


def test_partial_placement_is_refused_naming_the_key_path(mesh: DeviceMesh) -> None:
    """A Partial DTensor (a pending reduction) is refused at save, naming where it is."""
    pending = DTensor.from_local(torch.ones(4), mesh, [Partial()])
    with pytest.raises(UnsupportedStateError, match="Partial") as err:
        write_shard("/nonexistent/never.shard", {"opt": {"m": pending}}, job="j", step=1)
    assert err.value.path == ("opt", "m")


def test_dtensor_target_of_the_same_layout_is_filled_in_place(
    tmp_path: Path, mesh: DeviceMesh
) -> None:
    """A DTensor target with the saved layout gets the bytes in its own local memory; the
    restored state holds that very DTensor."""
    saved = distribute_tensor(torch.randn(64, 3), mesh, [Shard(0)])
    write_shard(tmp_path / "s.shard", {"w": saved}, job="j", step=1)
    target = distribute_tensor(torch.zeros(64, 3), mesh, [Shard(0)])
    ptr = target.to_local().data_ptr()
    assert layout_mismatch(read_head(tmp_path / "s.shard").header, {"w": target}) is None
    loaded = load_into(str(tmp_path / "s.shard"), {"w": target})
    assert torch.equal(target.to_local(), saved.to_local())
    assert target.to_local().data_ptr() == ptr and loaded.in_place == 1
    assert isinstance(loaded.state["w"], DTensor)


def _saved_as_second_half(path: Path) -> None:
    """Rewrite the shard at `path` (one (4, 3) float32 tensor at m/w) as rank 1's half of an
    (8, 3) tensor sharded on dim 0 over a 2-rank mesh, sealed again: a shard of a layout no
    one-process mesh has."""
    head = read_head(path)
    data = path.read_bytes()[head.data_offset :]
    blob = head.header.blobs[0]
    entry = ShardedEntry(0, (8, 3), (4, 0), 0, ("S0",))
    blocks = block_digests(data[blob.offset : blob.offset + blob.nbytes])
    header = msgspec.structs.replace(
        head.header,
        blobs=(msgspec.structs.replace(blob, blocks=blocks),),
        meshes=(MeshEntry((2,), ("dp",), (0, 1), (1,)),),
        sharded=(entry,),
    )
    sealed = encode_head(header, sealed=True)
    assert len(sealed) == head.data_offset
    path.write_bytes(sealed + data)


@pytest.mark.parametrize(
    "target",
    [
        lambda mesh: distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)]),
        lambda mesh: distribute_tensor(torch.zeros(8, 3), mesh, [Replicate()]),
        lambda mesh: torch.zeros(4, 3),
        lambda mesh: torch.zeros(8, 3),
    ],
    ids=["other-global-shape", "replicated-whole", "plain-of-local-shape", "plain-of-global-shape"],
)
def test_target_of_another_layout_is_a_layout_mismatch(
    tmp_path: Path, mesh: DeviceMesh, target: Callable[[DeviceMesh], torch.Tensor]
) -> None:
    """A target whose layout is not the saved one raises LayoutMismatchError naming the key path
    and both layouts, and no byte reaches it."""
    path = tmp_path / "s.shard"
    write_shard(path, {"m": {"w": torch.randn(4, 3)}}, job="j", step=1)
    _saved_as_second_half(path)
    t = target(mesh)
    with pytest.raises(
        LayoutMismatchError, match=r"m/w: saved as a shard of shape \(4, 3\) at \(4, 0\) of a"
    ) as err:
        load_into(str(path), {"m": {"w": t}})
    found = layout_mismatch(read_head(path).header, {"m": {"w": t}})  # (the choice to reshard)
    assert found is not None and str(found) == str(err.value)
    local = t.to_local() if isinstance(t, DTensor) else t
    assert not local.any()


def test_dtensor_target_of_another_dtype_is_a_layout_mismatch(
    tmp_path: Path, mesh: DeviceMesh
) -> None:
    """A DTensor target of the saved layout but another dtype: LayoutMismatchError."""
    saved = distribute_tensor(torch.randn(64, 3), mesh, [Shard(0)])
    write_shard(tmp_path / "s.shard", {"w": saved}, job="j", step=1)
    target = distribute_tensor(torch.zeros(64, 3, dtype=torch.float64), mesh, [Shard(0)])
    with pytest.raises(LayoutMismatchError, match=r"\(float32\), the target is .* \(float64\)"):
        load_into(str(tmp_path / "s.shard"), {"w": target})


def test_whole_tensors_go_between_plain_and_dtensor_targets_in_place(
    tmp_path: Path, mesh: DeviceMesh
) -> None:
    """Where the saved tensor and the target both hold the whole global tensor (a plain tensor,
    a replicated DTensor, a DTensor on a mesh of one), the bytes go into the target in place,
    whichever of them is the DTensor."""
    saved_d = distribute_tensor(torch.randn(16, 3), mesh, [Shard(0)])
    saved_p = torch.randn(5)
    write_shard(tmp_path / "s.shard", {"d": saved_d, "p": saved_p}, job="j", step=1)
    plain = torch.zeros(16, 3)
    replicated = distribute_tensor(torch.zeros(5), mesh, [Replicate()])
    loaded = load_into(str(tmp_path / "s.shard"), {"d": plain, "p": replicated})
    assert torch.equal(plain, saved_d.to_local()) and torch.equal(replicated.to_local(), saved_p)
    assert loaded.in_place == 2


def _dmodel(mesh: DeviceMesh, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 2))
    for m in model:
        m.weight = torch.nn.Parameter(distribute_tensor(m.weight.detach(), mesh, [Shard(0)]))
        m.bias = torch.nn.Parameter(distribute_tensor(m.bias.detach(), mesh, [Replicate()]))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x = distribute_tensor(torch.randn(4, 6), model[0].weight.device_mesh, [Replicate()])
    model(x).to_local().square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _local_sums(state: Any) -> dict[str, str]:
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update({f"{k}/{kk}": vv for kk, vv in _local_sums(v).items()})
        elif isinstance(v, torch.Tensor):
            local = v.to_local() if isinstance(v, DTensor) else v
            data = local.detach().reshape(-1).contiguous().view(torch.uint8).numpy()
            out[str(k)] = hashlib.sha256(data).hexdigest()
    return out


@pytest.mark.parametrize("fresh_optimizer", [False, True], ids=["stepped", "fresh"])
def test_module_and_optimizer_of_dtensors_restore_in_place(
    tmp_path: Path, mesh: DeviceMesh, fresh_optimizer: bool
) -> None:
    """A module whose parameters are DTensors is restored in place (no `load_state_dict` needed:
    its own local memory holds the bytes), and an optimizer's DTensor states are filled in
    place; a fresh optimizer (no state yet) is given its state first, so it ends up with
    DTensor states equal to the saved ones and steps on."""
    model, optimizer = _dmodel(mesh, 0)
    _step(model, optimizer)
    write_shard(tmp_path / "s.shard", {"model": model, "optim": optimizer}, job="j", step=1)
    expected = _local_sums({"model": model.state_dict(), "optim": optimizer.state_dict()})
    fresh, fresh_opt = _dmodel(mesh, 5)
    if not fresh_optimizer:
        _step(fresh, fresh_opt)
    ptrs = {k: v.to_local().data_ptr() for k, v in fresh.state_dict().items()}
    loaded = load_into(str(tmp_path / "s.shard"), {"model": fresh, "optim": fresh_opt})
    got = _local_sums({"model": fresh.state_dict(), "optim": fresh_opt.state_dict()})
    assert got == expected
    assert {k: v.to_local().data_ptr() for k, v in fresh.state_dict().items()} == ptrs
    assert all(isinstance(s["exp_avg"], DTensor) for s in fresh_opt.state_dict()["state"].values())
    assert loaded.in_place == len(expected)
    _step(fresh, fresh_opt)  # it trains on


@pytest.mark.parametrize("chunk_bytes", [12 << 10, 1 << 20, 8 << 20])
def test_verify_passes_a_sharded_shard_read_in_any_chunks(
    tmp_path: Path, mesh: DeviceMesh, chunk_bytes: int
) -> None:
    """A sharded tensor's blob verifies (whole and block digests) whatever the read size, also
    where reads cut blocks in two (its blob starts 4 KiB-aligned, after another tensor's)."""
    state = {"a": torch.ones(1000), "w": distribute_tensor(torch.randn(700_000), mesh, [Shard(0)])}
    path = tmp_path / "s.shard"
    digest = write_shard(path, state, job="j", step=1)
    with NvmeStore(tmp_path, chunk_bytes=chunk_bytes, direct_io=False) as store:
        store.verify_file(path, header_digest=digest, nbytes=path.stat().st_size)


def test_verify_checks_block_digests(tmp_path: Path, mesh: DeviceMesh) -> None:
    """A file whose whole-blob digests are right but whose block digests are not (a writer bug
    a ranged read would trip over) fails verification, naming the tensor and the block."""
    dt = distribute_tensor(torch.randn(3 * BLOCK_BYTES // 4), mesh, [Shard(0)])
    path = tmp_path / "s.shard"
    write_shard(path, {"w": dt}, job="j", step=1)
    head = read_head(path)
    blob = head.header.blobs[0]
    forged_blocks = blob.blocks[:8] + bytes(8) + blob.blocks[16:]
    header: ShardHeader = msgspec.structs.replace(
        head.header, blobs=(msgspec.structs.replace(blob, blocks=forged_blocks),)
    )
    sealed = encode_head(header, sealed=True)
    assert len(sealed) == head.data_offset
    with open(path, "r+b") as f:
        f.write(sealed)
    digest = read_head(path).header_digest.hex()
    with NvmeStore(tmp_path) as store, pytest.raises(IntegrityError) as err:
        store.verify_file(path, header_digest=digest, nbytes=path.stat().st_size)
    assert err.value.what == "tensor w block 1"
    # An object's verify checks the image in memory (the mapping is left to the GC: the
    # error's traceback holds views of it).
    with open(path, "rb") as f:
        image = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with pytest.raises(IntegrityError, match=r"\(tensor w block 1\)"):
        check_image(image, str(path), digest, path.stat().st_size)


# --- four processes: FSDP2 + tensor parallel on a 2x2 mesh, through the real pipeline ---------


def _run_ranks(settings: Settings, mode: str, job: str, world: int, store: Path) -> list[dict]:
    env = {**os.environ, **settings.as_env(), "TIERPIPE_LOG_LEVEL": "warning"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.dtensor_rank",
                mode,
                job,
                str(rank),
                str(world),
                str(store),
            ],
            env=env,
            cwd=Path(__file__).parent.parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-4000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_fsdp2_tp_state_saves_and_restores_in_place_bitwise(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events, tmp_path: Path
) -> None:
    """Four ranks of an FSDP2 + tensor-parallel model (2x2 mesh, strided shards included) save
    their model and AdamW state through the pipeline; restored on the same mesh into a model
    and optimizer of other values, every local shard is bitwise the saved one, in the memory it
    already had."""
    agent()
    world = 4
    saved = _run_ranks(settings, "save", job, world, tmp_path / "save-store")
    for r in range(world):
        events.wait_for(
            lambda e, r=r: isinstance(e, ShardFlushed) and e.step == 2 and e.rank == r,
            kind="flushed",
            timeout=120,
        )
    restored = _run_ranks(settings, "restore", job, world, tmp_path / "restore-store")
    for rank, (s, r) in enumerate(zip(saved, restored, strict=True)):
        assert "error" not in r, r
        assert r["step"] == 2 and r["moved"] == [], (rank, r)
        assert r["sums"] == s["sums"], rank
    header = read_head(Path(settings.nvme_root) / _relpath(job, 2, 1, world)).header
    placements = {header.tensors[s.tensor].path: s.placements for s in header.sharded}
    assert placements[("model", "0.weight")] == ("SS0:2", "S0")
    assert placements[("optim", "state", 2, "exp_avg")] == ("S0", "S1")
    # (rank 1 is (0, 1) of the 2x2 mesh; the LayerNorm, not tensor parallel, lies on the dp
    # mesh alone: ranks 1 and 3 there)
    assert set(header.meshes) == {
        MeshEntry((2, 2), ("dp", "tp"), (0, 1, 2, 3), (0, 1)),
        MeshEntry((2,), ("dp",), (1, 3), (0,)),
    }


def _relpath(job: str, step: int, rank: int, world: int) -> Any:
    from tierpipe.names import shard_relpath

    return shard_relpath(job, step, rank, world)


def test_a_plain_state_saves_while_another_thread_imports_torch_distributed_tensor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`torch.distributed.tensor` is in `sys.modules` before it defines `DTensor` (another thread
    of the trainer is importing it): a plain tensor is still no DTensor, and its state encodes
    (CI's fault model failed a save with "partially initialized module ... no attribute
    'DTensor'")."""
    import types

    from tierpipe.tree import encode_tree, is_dtensor

    monkeypatch.setitem(
        sys.modules, "torch.distributed.tensor", types.ModuleType("torch.distributed.tensor")
    )
    assert not is_dtensor(torch.zeros(3))
    assert encode_tree({"w": torch.zeros(3), "step": 1})
