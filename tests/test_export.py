"""`tierpipe export`: a step written as torch, safetensors and DCP checkpoints, each loaded back
with that format's own loader and compared bit for bit with what was saved; from NVMe, and from
object storage once the NVMe copy is gone. A sharded step (ranks whose headers carry
`ShardedEntry`s: DTensor local shards on a 2x2 mesh, replicated along one of its dimensions,
shards of uneven and empty extent) exports as one DCP checkpoint that `dcp.load` reads in one
process into full tensors and in two gloo processes into DTensors sharded otherwise, and as the
merged full model (torch; safetensors split with an index)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from tests.conftest import Agent, Events
from tierpipe import Checkpointer
from tierpipe.dev.process import free_ports
from tierpipe.names import shard_relpath
from tierpipe.schemas import MeshEntry, ShardedEntry, ShardFlushed
from tierpipe.settings import Settings
from tierpipe.state import plan_state
from tierpipe.storage.aligned import aligned_buffer
from tierpipe.storage.shard import blocks_nbytes, encode_head
from tierpipe.storage.shardfile import seal_image

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parent.parent


def run_cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    """`tierpipe <args>` as an operator runs it (conftest's, with room for a loaded machine:
    an export or import reads and writes whole checkpoints)."""
    return subprocess.run(
        [sys.executable, "-m", "tierpipe.cli", *args],
        env={**os.environ, **settings.as_env()},
        capture_output=True,
        text=True,
        timeout=240,
    )


def saved_state() -> dict[str, Any]:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    optim.step()
    return {
        "model": model.state_dict(),
        "optim": optim.state_dict(),
        "step": 7,
        "note": "hello",
        "rng": torch.get_rng_state(),
        "half": torch.randn(5, dtype=torch.bfloat16),
    }


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1), b.view(-1))


def flat(state: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(state, dict):
        return {
            k: v for key, value in state.items() for k, v in flat(value, f"{prefix}{key}.").items()
        }
    if isinstance(state, list | tuple):
        return {
            k: v for i, value in enumerate(state) for k, v in flat(value, f"{prefix}{i}.").items()
        }
    return {prefix[:-1]: state}


def check(loaded: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(loaded) == set(want), set(loaded) ^ set(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert same(loaded[key], value), key
        else:
            assert loaded[key] == value, key


def load_each(out: Path, fmt: str) -> dict[str, Any]:
    """What each format's own loader gives back, flattened to dotted keys."""
    if fmt == "torch":
        return flat(torch.load(out / "rank-00000-of-00001.pt", weights_only=True))
    if fmt == "safetensors":
        return load_safetensors(out / "rank-00000-of-00001.safetensors")
    import torch.distributed.checkpoint as dcp

    template = _zeros(saved_state())  # (what a user passes: a state shaped like the saved one)
    dcp.load(template, checkpoint_id=str(out), no_dist=True)
    return flat(template)


def load_safetensors(path: Path) -> dict[str, Any]:
    """A safetensors file's tensors and the plain values in its metadata, by dotted key."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    assert json.loads(meta["tierpipe.checkpoint"])["step"] == 1
    return {**tensors, **json.loads(meta["tierpipe.values"])}


def _zeros(state: Any) -> Any:
    """A template of `state`: zeros for its tensors, None for its plain values."""
    if isinstance(state, dict):
        return {k: _zeros(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_zeros(v) for v in state]
    if isinstance(state, tuple):
        return None
    return torch.zeros_like(state) if isinstance(state, torch.Tensor) else None  # (DCP sets it)


def test_a_step_exports_to_torch_safetensors_and_dcp_bit_for_bit(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events, tmp_path: Path
) -> None:
    agent().wait_ready()
    state = saved_state()
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as ckpt:
        ckpt.save(1, state).wait("verified", timeout=30)
    events.wait_for(lambda e: isinstance(e, ShardFlushed), kind="flushed")
    want = flat(state)
    for fmt in ("torch", "safetensors", "dcp"):
        out = run_cli(settings, "export", "--job", job, "--to", fmt, str(tmp_path / fmt))
        assert out.returncode == 0, out.stderr
        assert f"exported step 1 of {job} (1 ranks) as {fmt}" in out.stdout
        if fmt == "dcp":
            assert sorted(os.listdir(tmp_path / fmt)) == [".metadata", "__0_0.distcp"]
        loaded = load_each(tmp_path / fmt, fmt)
        check(loaded, want)  # (every format by dotted key path: lists by index)

    Path(settings.nvme_root, shard_relpath(job, 1, 0, 1)).unlink()  # (object storage then)
    out = run_cli(settings, "export", "--job", job, "--step", "1", "--to", "torch",
                  str(tmp_path / "from-s3"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    check(
        flat(torch.load(tmp_path / "from-s3" / "rank-00000-of-00001.pt", weights_only=True)), want
    )
    out = run_cli(settings, "export", "--job", job, "--to", "safetensors", "--merged",
                  str(tmp_path / "merged-from-s3"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert os.listdir(tmp_path / "merged-from-s3") == ["model.safetensors"]
    check(load_safetensors(tmp_path / "merged-from-s3" / "model.safetensors"), want)

    out = run_cli(settings, "export", "--job", job, "--step", "9", "--to", "torch", str(tmp_path))
    assert out.returncode == 1 and "step 9" in out.stderr and "no record" in out.stderr


# --- a sharded step: DTensor local shards, as a 4-rank (2 dp x 2 tp) save writes them

#: Global tensors and how each is laid out on the (dp, tp) mesh: per mesh dimension, the
#: tensor dimension it is split along (torch.chunk's extents), or None (replicated).
LAYOUT: dict[tuple[str | int, ...], tuple[int | None, int | None]] = {
    ("model", "W"): (0, 1),  # 8x6: a 4x3 block each
    ("model", "b"): (None, 0),  # 8: halves along tp, replicated along dp (written once)
    ("model", "V"): (0, None),  # 5x2: 3 rows and 2 (uneven), replicated along tp
    ("model", "Z"): (0, None),  # 1x4: 1 row and an empty shard
    ("optim", "state", 0, "exp_avg"): (0, 1),
}


def global_state() -> dict[tuple[str | int, ...], torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        ("model", "W"): torch.randn(8, 6, generator=g),
        ("model", "b"): torch.randn(8, generator=g).to(torch.bfloat16),
        ("model", "V"): torch.randn(5, 2, generator=g, dtype=torch.float64),
        ("model", "Z"): torch.randn(1, 4, generator=g),
        ("optim", "state", 0, "exp_avg"): torch.randn(8, 6, generator=g),
    }


def local_box(
    shape: tuple[int, ...], dims: tuple[int | None, int | None], coord: tuple[int, int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of the local shard at mesh coordinate `coord` (torch.chunk's split)."""
    offsets, sizes = [0] * len(shape), list(shape)
    for mesh_dim, tensor_dim in enumerate(dims):
        if tensor_dim is None:
            continue
        extent = sizes[tensor_dim]
        step = -(-extent // 2)
        start = min(coord[mesh_dim] * step, extent)
        offsets[tensor_dim] += start
        sizes[tensor_dim] = min(step, extent - start)
    return tuple(offsets), tuple(sizes)


def rank_state(rank: int, full: dict) -> tuple[dict[str, Any], dict]:
    """Rank `rank`'s state (its local shards, its plain values) and its sharded entries."""
    coord = (rank // 2, rank % 2)
    state: dict[str, Any] = {
        "model": {},
        "optim": {"state": {0: {"step": torch.tensor(3.0)}},
                  "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}]},
        "step": 7,
        "note": "hello",
        "rng": torch.full((4,), rank, dtype=torch.uint8),  # (differs: rank 0's is taken)
    }  # fmt: skip
    shards = {}
    for path, dims in LAYOUT.items():
        offsets, sizes = local_box(tuple(full[path].shape), dims, coord)
        local = full[path][tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))]
        node = state
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = local.clone()
        placements = tuple("R" if d is None else f"S{d}" for d in dims)
        shards[path] = (tuple(full[path].shape), offsets, placements, coord)
    return state, shards


def write_sharded(
    path: Path, state: Any, shards: dict, *, job: str, step: int, rank: int, world_size: int,
    node: str,
) -> str:  # fmt: skip
    """A sealed shard file of `state` whose header marks the tensors in `shards` as local
    shards of global tensors (`ShardedEntry`), as a DTensor save writes it."""
    plan = plan_state(state, job=job, step=step, rank=rank, world_size=world_size, node=node)
    index = {tuple(t.path): i for i, t in enumerate(plan.header.tensors)}
    # (one mesh entry per coordinate a tensor claims: the gap case claims another rank's)
    coords = sorted({coord for *_, coord in shards.values()})
    meshes = tuple(MeshEntry((2, 2), ("dp", "tp"), (0, 1, 2, 3), c) for c in coords)
    entries = tuple(
        ShardedEntry(
            tensor=index[p],
            global_shape=shape,
            offsets=offsets,
            mesh=coords.index(coord),
            placements=placements,
        )
        for p, (shape, offsets, placements, coord) in shards.items()
    )
    blobs = list(plan.header.blobs)
    for e in entries:  # (a sharded blob carries a block digest table: zeros until sealed)
        i = plan.header.tensors[e.tensor].blob
        blobs[i] = msgspec.structs.replace(blobs[i], blocks=bytes(blocks_nbytes(blobs[i].nbytes)))
    header = msgspec.structs.replace(
        plan.header, sharded=entries, meshes=meshes, blobs=tuple(blobs)
    )
    head = encode_head(header, sealed=False)
    old = aligned_buffer(plan.nbytes)
    old[: len(plan.head)] = plan.head
    plan.copy_into(plan.destinations(torch.frombuffer(old, dtype=torch.uint8)))
    image = aligned_buffer(len(head) + plan.nbytes - len(plan.head))
    image[: len(head)] = head
    image[len(head) :] = old[len(plan.head) :]
    path.parent.mkdir(parents=True, exist_ok=True)
    with memoryview(image) as view:
        return seal_image(view, os.fspath(path)).header_digest


def save_sharded_step(settings: Settings, job: str, step: int = 1, *, gap: bool = False) -> dict:
    """Step `step` of `job` as four ranks' shard files on this node's NVMe, made known to the
    job state by `tierpipe reindex` (as a DTensor save's would be); the global tensors.
    `gap`: rank 3 holds the shard of W that rank 1 holds, so a part of W has none."""
    full = global_state()
    for rank in range(4):
        state, shards = rank_state(rank, full)
        if gap and rank == 3:  # (it says it is at (0, 1), as rank 1 is: nobody holds (1, 1))
            shape, _, placements, _ = shards["model", "W"]
            offsets, _ = local_box(shape, LAYOUT["model", "W"], (0, 1))
            shards["model", "W"] = (shape, offsets, placements, (0, 1))
        path = Path(settings.nvme_root, shard_relpath(job, step, rank, 4))
        write_sharded(path, state, shards, job=job, step=step, rank=rank, world_size=4,
                      node=settings.node)  # fmt: skip
    out = run_cli(settings, "reindex", "--job", job)
    assert out.returncode == 0 and "republished 4 NVMe shards" in out.stdout, out.stderr
    out = run_cli(settings, "status", "--job", job, "--json")  # (once the job state has it)
    assert out.returncode == 0, out.stderr
    return full


def merged_want(full: dict) -> dict[str, Any]:
    """The merged step by dotted key: the global tensors, rank 0's plain values."""
    want = flat(rank_state(0, full)[0])
    want.update({".".join(map(str, path)): t for path, t in full.items()})
    return want


def test_a_sharded_step_exports_to_one_dcp_checkpoint_that_loads_in_any_layout(
    settings: Settings, job: str, agent: Callable[..., Agent], tmp_path: Path
) -> None:
    """One `.metadata` and a data file per rank that adds a shard (the replicated shards
    written once); `dcp.load` in one process gives the global tensors and rank 0's values,
    and in two gloo processes fills DTensors laid out otherwise than the save."""
    import torch.distributed.checkpoint as dcp

    agent().wait_ready()
    full = save_sharded_step(settings, job)
    out = run_cli(settings, "export", "--job", job, "--to", "dcp", str(tmp_path / "dcp"))
    assert out.returncode == 0, out.stderr
    assert f"exported step 1 of {job} (4 ranks) as dcp" in out.stdout
    files = sorted(os.listdir(tmp_path / "dcp"))
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
    metadata = dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata()
    chunks = {k: len(v.chunks) for k, v in metadata.state_dict_metadata.items()
              if hasattr(v, "chunks")}  # fmt: skip
    assert chunks["model.W"] == 4 and chunks["model.b"] == 2 and chunks["model.V"] == 2
    assert chunks["optim.state.0.exp_avg"] == 4 and chunks["rng"] == 1

    template = {"model": {k: torch.zeros_like(full["model", k]) for k in "WbVZ"},
                "optim": {"state": {0: {"exp_avg": torch.zeros(8, 6), "step": torch.tensor(0.0)}},
                          "param_groups": [{"lr": None, "betas": None, "params": None}]},
                "step": None, "note": None, "rng": torch.zeros(4, dtype=torch.uint8)}  # fmt: skip
    dcp.load(template, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    check(flat(template), merged_want(full))

    torch.save({".".join(map(str, p)): t for p, t in full.items()}, tmp_path / "want.pt")
    run_ranks(settings, [str(tmp_path / "dcp"), str(tmp_path / "want.pt")], "resharded load ok")


def test_a_sharded_step_exports_merged_as_torch_and_as_split_safetensors(
    settings: Settings, job: str, agent: Callable[..., Agent], tmp_path: Path
) -> None:
    """`--merged`: one model.pt of the global tensors and rank 0's values; safetensors above
    the size limit split into files with a Hugging Face index naming each tensor's file;
    without it, the per-rank files hold each rank's local shards."""
    from safetensors.torch import load_file

    agent().wait_ready()
    full = save_sharded_step(settings, job)
    want = merged_want(full)
    out = run_cli(settings, "export", "--job", job, "--to", "torch", "--merged",
                  str(tmp_path / "pt"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "(4 ranks) as torch (merged)" in out.stdout
    assert os.listdir(tmp_path / "pt") == ["model.pt"]
    check(flat(torch.load(tmp_path / "pt" / "model.pt", weights_only=True)), want)

    out = run_cli(settings, "export", "--job", job, "--to", "safetensors", "--merged",
                  "--max-file-size", "200", str(tmp_path / "st"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    index = json.loads((tmp_path / "st" / "model.safetensors.index.json").read_text())
    names = sorted(set(index["weight_map"].values()))
    assert len(names) > 2 and names[0] == f"model-00001-of-{len(names):05d}.safetensors"
    loaded: dict[str, Any] = {}
    for name in names:
        part = load_file(tmp_path / "st" / name)
        assert all(index["weight_map"][k] == name for k in part)
        loaded.update(part)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in loaded.values())
    loaded.update(json.loads(index["metadata"]["tierpipe.values"]))
    check(loaded, want)

    out = run_cli(settings, "export", "--job", job, "--to", "torch", str(tmp_path / "ranks"))
    assert out.returncode == 0, out.stderr
    three = torch.load(tmp_path / "ranks" / "rank-00003-of-00004.pt", weights_only=True)
    assert same(three["model"]["W"], full["model", "W"][4:, 3:].contiguous())


def test_an_export_that_cannot_be_made_fails_with_a_clear_error(
    settings: Settings, job: str, agent: Callable[..., Agent], tmp_path: Path
) -> None:
    """Shards that leave part of a tensor uncovered, --merged with dcp, a DIR that is a
    file and an unknown job: exit status 2 and a line that says why, and no `.metadata`."""
    agent().wait_ready()
    save_sharded_step(settings, job, gap=True)
    for fmt in ("dcp", "torch"):
        merged = ["--merged"] if fmt == "torch" else []
        out = run_cli(settings, "export", "--job", job, "--to", fmt, *merged, str(tmp_path / fmt))
        assert out.returncode == 2, out.stderr
        assert "model.W" in out.stderr and "shards" in out.stderr, out.stderr
    assert not (tmp_path / "dcp" / ".metadata").exists()
    out = run_cli(settings, "export", "--job", job, "--to", "dcp", "--merged", str(tmp_path / "x"))
    assert out.returncode == 2 and "--merged is for torch and safetensors" in out.stderr
    (tmp_path / "file").write_text("")
    out = run_cli(settings, "export", "--job", job, "--to", "torch", str(tmp_path / "file"))
    assert out.returncode == 2 and "not a directory" in out.stderr, out.stderr
    out = run_cli(settings, "export", "--job", "nosuchjob", "--step", "1", "--to", "torch",
                  str(tmp_path / "y"))  # fmt: skip
    assert out.returncode == 1 and "unknown job 'nosuchjob'" in out.stderr, out.stderr


def test_dtensors_saved_by_two_ranks_export_to_dcp_and_merged_safetensors(
    settings: Settings, job: str, agent: Callable[..., Agent], tmp_path: Path
) -> None:
    """DTensors saved through two Checkpointers on a gloo mesh come out of `--to dcp` (loaded
    by `dcp.load` in one process) and of `--to safetensors --merged` as the full tensors that
    `full_tensor()` gathered at the save."""
    import torch.distributed.checkpoint as dcp

    agent().wait_ready()
    want_path = tmp_path / "want.pt"
    run_ranks(settings, ["save", job, str(want_path)], "dtensor saved")
    want = {**torch.load(want_path, weights_only=True), "step": 3}
    out = run_cli(settings, "export", "--job", job, "--step", "1", "--to", "dcp",
                  str(tmp_path / "dcp"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    template = {"model": {k.split(".")[1]: torch.zeros_like(v) for k, v in want.items()
                          if k.startswith("model.")}, "step": None}  # fmt: skip
    dcp.load(template, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    check(flat(template), want)
    out = run_cli(settings, "export", "--job", job, "--step", "1", "--to", "safetensors",
                  "--merged", str(tmp_path / "st"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    got = load_safetensors(tmp_path / "st" / "model.safetensors")
    check(got, want)


def run_ranks(settings: Settings, args: list[str], done: str) -> None:
    """`python -m tests.test_export ARGS` as two gloo ranks with `settings` in their
    environment; both must print `done`."""
    port = free_ports(1)[0]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.test_export", *args],
            env={
                **os.environ,
                **settings.as_env(),
                "RANK": str(r),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
        )
        for r in range(2)
    ]
    for p in procs:
        output, _ = p.communicate(timeout=150)
        assert p.returncode == 0 and done in output, output


def sharded_header(rank: int, state: Any, shards: dict) -> Any:
    """The header a save of `state` by `rank` of 4 writes, with `shards` marked sharded."""
    plan = plan_state(state, job="j", step=1, rank=rank, world_size=4, node="n")
    index = {tuple(t.path): i for i, t in enumerate(plan.header.tensors)}
    entries = tuple(
        ShardedEntry(
            tensor=index[p], global_shape=shape, offsets=offsets, mesh=0, placements=("S0",)
        )
        for p, (shape, offsets) in shards.items()
    )
    meshes = (MeshEntry((4,), (), (0, 1, 2, 3), (rank,)),)
    return msgspec.structs.replace(plan.header, sharded=entries, meshes=meshes)


@pytest.mark.parametrize(
    ("boxes", "why"),
    [
        ([((0,), (4,)), ((4,), (4,))], ""),
        ([((0,), (4,)), ((4,), (4,)), ((0,), (4,))], ""),  # (a replica: written once)
        ([((0,), (4,)), ((4,), (3,))], "no shard covers dimension 0 from 7 to 8"),
        ([((0,), (4,)), ((5,), (3,))], "a gap at 5 along dimension 0"),
        ([((0,), (5,)), ((4,), (4,))], "overlapping shards at 4 along dimension 0"),
        ([((0,), (4,)), ((6,), (4,))], "outside the global shape"),
    ],
)
def test_the_merge_takes_each_shard_once_and_refuses_a_layout_that_does_not_tile(
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], why: str
) -> None:
    """Shards that tile the global tensor merge (a repeated one is taken once); a gap, an
    overlap or a shard outside the tensor is a LayoutMismatchError that says where."""
    from tierpipe.errors import LayoutMismatchError
    from tierpipe.interop.merge import Merge

    def merged() -> int:
        merge, taken = Merge(), 0
        for rank, (offsets, sizes) in enumerate(boxes):
            state = {"w": torch.zeros(sizes), "step": rank}
            header = sharded_header(rank, state, {("w",): ((8,), offsets)})
            taken += len(merge.add_rank(rank, header, state))
            assert merge.first(rank, ("step",)) == (rank == 0)
        merge.check()
        return taken

    if why:
        with pytest.raises(LayoutMismatchError, match=why):
            merged()
    else:
        assert merged() == 2


def test_a_tensor_plain_on_one_rank_and_sharded_on_another_does_not_merge(tmp_path: Path) -> None:
    """Rank 0 holds `w` whole, rank 1 a shard of it: a LayoutMismatchError names `w`."""
    from tierpipe.errors import LayoutMismatchError
    from tierpipe.interop.dcp import DcpWriter

    writer = DcpWriter(tmp_path)
    state0 = {"w": torch.zeros(8)}
    writer.add(0, sharded_header(0, state0, {}), state0)
    state1 = {"w": torch.zeros(4)}
    with pytest.raises(LayoutMismatchError, match="w: plain on a lower rank"):
        writer.add(1, sharded_header(1, state1, {("w",): ((8,), (4,))}), state1)


def _resharded_load(folder: str, want_path: str) -> None:
    """One of two gloo processes: load the export into DTensors on a 1-d mesh of 2, each
    tensor laid out otherwise than the 2x2 save, and compare the full tensors."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    want = torch.load(want_path, weights_only=True)
    layouts = {"W": Shard(1), "b": Replicate(), "V": Shard(1), "Z": Shard(1)}
    model = {k: distribute_tensor(torch.zeros_like(want[f"model.{k}"]), mesh, [p])
             for k, p in layouts.items()}  # fmt: skip
    dcp.load({"model": model}, checkpoint_id=folder)
    for k, t in model.items():
        assert same(t.full_tensor(), want[f"model.{k}"]), k
    dist.barrier()  # (no rank leaves while its peer is inside DCP's last collective)
    dist.destroy_process_group()
    print("resharded load ok")


def _dtensor_save(job: str, want_path: str) -> None:
    """One of two gloo ranks: save DTensors on a 1-d mesh of 2 through a Checkpointer (rows
    split, uneven, one rank's shard empty, one tensor replicated) and, on rank 0, their full
    tensors to `want_path`."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from tierpipe.settings import load_settings

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(9)
    full = {"w": torch.randn(6, 4, generator=g), "v": torch.randn(5, 2, generator=g),
            "z": torch.randn(1, 3, generator=g), "b": torch.randn(4, generator=g)}  # fmt: skip
    place = {"w": Shard(0), "v": Shard(0), "z": Shard(0), "b": Replicate()}
    model = {k: distribute_tensor(t, mesh, [place[k]]) for k, t in full.items()}
    state = {"model": model, "step": 3}
    with Checkpointer(job, rank=rank, world_size=2, settings=load_settings()) as ckpt:
        ckpt.save(1, state).wait("verified", timeout=120)
    gathered = {f"model.{k}": t.full_tensor() for k, t in model.items()}
    if rank == 0:
        torch.save(gathered, want_path)
    dist.barrier()
    dist.destroy_process_group()
    print("dtensor saved")


if __name__ == "__main__":
    if sys.argv[1] == "save":
        _dtensor_save(sys.argv[2], sys.argv[3])
    else:
        _resharded_load(sys.argv[1], sys.argv[2])
