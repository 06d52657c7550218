"""`python -m bench reshard`: a sharded (DTensor) state saved by 4 ranks and restored by 2, 4 and
8, tierpipe against PyTorch DCP loading the same state saved by DCP, in the same run.

The state: `PAIRS` pairs of 2-D tensors (a bf16 weight and an fp32 moment of the same global
shape, `COLS` columns, about `size_gib` GiB in all) plus a plain step counter. Every tensor is a
DTensor on a 2-D mesh `(dp, tp)` with placements `(Shard(0), Shard(1))`; its values are a
function of the global index (`_pattern`), so any rank of any mesh knows what its local shard
must hold. One node: an embedded nats-server and SeaweedFS, one node agent (`tierpipe worker
all`), rank processes on this machine (`python -m bench.reshard --rank`, gloo).

1. DDP: 4 ranks each save a replicated model (`DDP_MIB` MiB, identical on every rank,
   plain tensors as `DistributedDataParallel.state_dict()` gives them) as a job of its own,
   flushed to object storage, twice: declared replicated (`Checkpointer(replicated=("model",))`:
   rank 0 alone stores its bytes) and, as before that existed, not declared (every rank its own
   copy: `DDP_EACH_JOB`). `ddp_object_bytes_over_one_replica` = the bytes of the declared step's
   objects over one replica's tensor bytes (4.0 would mean every rank stored its own copy);
   `ddp_nvme_bytes_per_node` and `ddp_object_bytes_per_job` are the raw figures, the `ddp_each_`
   ones the undeclared job's. Every rank then restores the declared model into zeroed tensors
   (rank 0's bytes, from this node's NVMe) and checks it bitwise (untimed).
2. World 4 (a 2x2 mesh): untimed warm-up save, then `reps` saves, each timed against a memcpy
   (`copy_` into preallocated tensors) of the same local shards, taken just before it on even
   steps and just after its staging slot was released on odd ones; every save waits (untimed)
   for its staging slot to be released before the next. Uploads are paused
   from here on (`Checkpointer.pause_flush`): the restores below read NVMe, and uploads would
   load the machine while they are timed. `sharded_stall_vs_memcpy`: per save the slowest
   rank's stall over the slowest rank's memcpy (target <= 1.05). The same state is then saved
   with `torch.distributed.checkpoint.save` into a local folder (fsynced).
3. Restores at world 4 (same mesh, 2x2), 2 (2x1) and 8 (4x2): targets are zeroed DTensors of the
   new mesh; each rep runs tierpipe's `Checkpointer.restore(into=...)` and `dcp.load` in a
   shuffled order, each cold (every file of both checkpoints dropped from the page cache with
   `posix_fadvise(DONTNEED)` by rank 0, no root needed), timed from a barrier to a barrier, and
   checked bitwise afterwards (untimed). One untimed warm-up each first. The two run in order on
   even reps, reversed on odd ones (a drift costs both alike). `reshard_4to2_vs_dcp`,
   `reshard_4to8_vs_dcp` and `same_mesh_vs_dcp` (4->4): per rep tierpipe's time over DCP's;
   `reshard_vs_dcp` is the worse of 4->2 and 4->8 (the higher median, with its interval;
   target <= 1.0: met when both are, missed when either is).

Every ratio is the median of its per-pair ratios with a 90 % interval (`_lo`, `_hi`)
and, given a target, a verdict (`_verdict`: met / missed / undecided; `bench.paired`).

A candidate the build cannot run (e.g. a restore into another world size before resharding
exists) is reported as null with its error, and the others still run.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import _T0 as T0
from bench.common import REPO, GiB, MiB, log, median, scratch_dir
from bench.paired import MIN_PAIRS, Paired, Verdict, alternate, paired, record, verdict

__all__ = ["run"]

JOB, DDP_JOB, DDP_EACH_JOB, NODE = "bench", "bench-ddp", "bench-ddp-each", "bench-node"
BUCKET = "tierpipe-bench"
PAIRS, COLS = 4, 4096
#: The DDP job's replica (one model), full and `--quick`.
DDP_MIB, QUICK_DDP_MIB = 128, 4
QUICK_GIB = 1 / 32
#: (world, mesh) of the restores: the same mesh first, then fewer and more ranks.
MESHES = ((4, (2, 2)), (2, (2, 1)), (8, (4, 2)))
SAVE_MESH = (2, 2)
RANK_TIMEOUT_S = 900.0


# --- the state (in the rank processes)


def _shapes(size_gib: float) -> tuple[int, int]:
    """Global (rows, cols) of every tensor: rows a multiple of 64 (every mesh divides it)."""
    rows = int(size_gib * GiB / (PAIRS * COLS * (2 + 4))) // 64 * 64
    return max(64, rows), COLS


def _pattern(index: int, box: tuple[slice, slice], dtype: Any) -> Any:
    """The values of tensor `index` over `box` of the global tensor: a function of the global
    position (computed in row chunks, converted elementwise: the same bytes on every mesh)."""
    import torch

    rows, cols = box
    out = torch.empty(rows.stop - rows.start, cols.stop - cols.start, dtype=dtype)
    c = torch.arange(cols.start, cols.stop, dtype=torch.int64)[None, :] * 104729
    for r0 in range(rows.start, rows.stop, 256):
        r1 = min(rows.stop, r0 + 256)
        r = torch.arange(r0, r1, dtype=torch.int64)[:, None] * 7919 + index * 31
        v = ((r + c) % 65521).to(torch.float32) / 65521.0
        out[r0 - rows.start : r1 - rows.start] = v.to(dtype)
    return out


def _state(size_gib: float, mesh: Any, *, zeros: bool) -> dict[str, Any]:
    """This rank's part of the state on `mesh` (zeroed targets, or the values themselves)."""
    import torch
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape = _shapes(size_gib)
    placements = (Shard(0), Shard(1))
    local, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    box = (slice(offset[0], offset[0] + local[0]), slice(offset[1], offset[1] + local[1]))
    state: dict[str, Any] = {"step": 0}
    for i in range(2 * PAIRS):
        dtype = torch.bfloat16 if i % 2 == 0 else torch.float32
        t = torch.zeros(local, dtype=dtype) if zeros else _pattern(i, box, dtype)
        state[f"t{i}"] = DTensor.from_local(t, mesh, placements, run_check=False)
    return state


def _locals(state: dict[str, Any]) -> list[Any]:
    return [v.to_local() for k, v in sorted(state.items()) if k != "step"]


def _check(state: dict[str, Any], expected: list[Any], what: str) -> None:
    import torch

    for got, want in zip(_locals(state), expected, strict=True):
        if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
            raise RuntimeError(f"{what}: a restored local shard differs from the saved values")


def _drop(paths: list[Path]) -> None:
    """Drop every file under `paths` from the page cache (written and fsynced before)."""
    for root in paths:
        for f in root.rglob("*"):
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


# --- the rank process (`python -m bench.reshard --rank CONFIG`)


def _say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def _rank_main(cfg: dict[str, Any]) -> None:
    import faulthandler
    import signal
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tierpipe.log import configure_logging
    from tierpipe.settings import load_settings
    from tierpipe.trainer.checkpointer import Checkpointer

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # (the stacks of a hang)
    torch.set_num_threads(1)
    configure_logging("warning", "json", only_if_unconfigured=True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=RANK_TIMEOUT_S))

    def progress(msg: str) -> None:
        _progress(cfg, msg)

    mesh = init_device_mesh("cpu", tuple(cfg["mesh"]), mesh_dim_names=("dp", "tp"))
    settings = load_settings(path=None, env=cfg["env"])

    def checkpointer(job: str, replicated: tuple[str, ...] = ()) -> Any:
        return Checkpointer(job, rank=rank, world_size=world, node=NODE, settings=settings,
                            local_rank=rank, local_world_size=world,
                            replicated=replicated)  # fmt: skip

    if cfg["save"]:
        state = _state(cfg["size_gib"], mesh, zeros=False)
        progress("  DDP saves (declared replicated, then every rank its own)")
        with checkpointer(DDP_JOB, ("model",)) as ckpt:
            _save_ddp(cfg, ckpt, rank, DDP_JOB)
            _restore_ddp(cfg, ckpt)
        with checkpointer(DDP_EACH_JOB) as ckpt:
            _save_ddp(cfg, ckpt, rank, DDP_EACH_JOB)
        progress("  DDP objects flushed; sharded saves")
        with checkpointer(JOB) as ckpt:
            _save_sharded(cfg, ckpt, state, rank)
        progress("  sharded saves verified; DCP save")
        dist.barrier()
        _save_dcp(cfg, state, rank)
        expected = _locals(state)
        del state
    else:
        expected = _locals(_state(cfg["size_gib"], mesh, zeros=False))
    targets = _state(cfg["size_gib"], mesh, zeros=True)
    progress(f"  restores at world {world}")
    with checkpointer(JOB) as ckpt:
        progress("  checkpointer open")
        _restores(cfg, ckpt, targets, expected, rank)
        progress("  restores done")
    dist.barrier()
    # (its lines are out; tearing gloo and torch down takes seconds per process, for nothing)
    sys.stdout.flush()
    os._exit(0)


def _progress(cfg: dict[str, Any], msg: str) -> None:
    """Rank 0's progress on stderr, on the harness's clock."""
    if os.environ["RANK"] == "0":
        print(f"[{time.time() - cfg['t0']:7.1f}s] {msg}", file=sys.stderr, flush=True)


def _timed(fn: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _save_sharded(cfg: dict[str, Any], ckpt: Any, state: dict[str, Any], rank: int) -> None:
    import torch
    import torch.distributed as dist

    if rank == 0:  # (the restores read NVMe; uploads would load the machine: every job's)
        ckpt.pause_flush(this_node_only=True)
    ckpt.reserve(state)
    shards = _locals(state)
    copies = [torch.empty_like(t) for t in shards]
    slots = Path(cfg["env"]["TIERPIPE_STAGING_ROOT"], JOB, f"rank-{rank:05d}")
    handles = []

    def memcpy() -> float:
        t0 = time.perf_counter()
        for c, t in zip(copies, shards, strict=True):
            c.copy_(t)
        return time.perf_counter() - t0

    for step in range(1, cfg["reps"] + 2):
        state["step"] = step
        before = step % 2 == 0  # (memcpy then save on even steps, save then memcpy on odd)
        memcpy_s = memcpy() if before else 0.0
        t0 = time.perf_counter()
        handles.append(ckpt.save(step, state))
        stall = time.perf_counter() - t0
        deadline = time.monotonic() + RANK_TIMEOUT_S
        while any(".step-" in n for n in os.listdir(slots)):  # (its slot free again)
            if time.monotonic() > deadline:
                raise TimeoutError("staging slot not released")
            time.sleep(0.01)
        if not before:  # (after the slot's release: the agent no longer reads it)
            memcpy_s = memcpy()
        if step > 1:  # (the first is a warm-up)
            _say(event="saved", rank=rank, step=step, stall_s=stall, memcpy_s=memcpy_s)
        dist.barrier()
    for handle in handles:  # (raises what made a save fail)
        handle.wait("verified", timeout=RANK_TIMEOUT_S)


def _save_dcp(cfg: dict[str, Any], state: dict[str, Any], rank: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    path = Path(cfg["dcp"])
    t = _timed(lambda: dcp.save(state, checkpoint_id=path))
    if rank == 0:
        for f in path.iterdir():
            fd = os.open(f, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        _say(event="dcp_saved", seconds=t)
    dist.barrier()


def _ddp_model(mib: float) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(0)  # (every rank the same replica)
    n = int(mib * MiB) // 4 // 8
    return {f"layer{i}.weight": torch.randn(n, generator=gen) for i in range(8)}


def _save_ddp(cfg: dict[str, Any], ckpt: Any, rank: int, job: str) -> None:
    import torch.distributed as dist

    model = _ddp_model(cfg["ddp_mib"])
    ckpt.save(1, {"model": model, "step": 1}).wait("verified", timeout=RANK_TIMEOUT_S)
    if rank == 0:  # (every rank's object in the bucket before the restores are timed)
        world = int(os.environ["WORLD_SIZE"])
        deadline = time.monotonic() + RANK_TIMEOUT_S
        while (found := _objects(cfg["env"], job))[0] < world:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{found[0]} of {world} DDP shards in object storage")
            time.sleep(0.2)
        replica = sum(t.nbytes for t in model.values())
        _say(event="ddp_saved", job=job, replica_bytes=replica, object_bytes=found[1])
    dist.barrier()


def _restore_ddp(cfg: dict[str, Any], ckpt: Any) -> None:
    """The declared model restored into zeroed tensors on every rank (the others' from rank
    0's bytes), checked bitwise."""
    import torch

    expected = _ddp_model(cfg["ddp_mib"])
    target = {k: torch.zeros_like(v) for k, v in expected.items()}
    ckpt.restore({"model": target})
    if bad := [k for k, v in expected.items() if not torch.equal(target[k], v)]:
        raise AssertionError(f"DDP model restored with other bytes: {bad}")


def _objects(env: dict[str, str], job: str) -> tuple[int, int]:
    """The number and bytes of `job`'s objects in the bucket."""
    import boto3

    client = boto3.client(
        "s3", endpoint_url=env["TIERPIPE_S3_ENDPOINT"], region_name=env["TIERPIPE_S3_REGION"],
        aws_access_key_id=env["TIERPIPE_S3_ACCESS_KEY_ID"],
        aws_secret_access_key=env["TIERPIPE_S3_SECRET_ACCESS_KEY"],
    )  # fmt: skip
    sizes = [
        o["Size"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
        for o in page.get("Contents", [])
        if f"{job}/step-" in o["Key"]
    ]
    return len(sizes), sum(sizes)


def _restores(
    cfg: dict[str, Any], ckpt: Any, targets: dict[str, Any], expected: list[Any], rank: int
) -> None:
    import torch.distributed.checkpoint as dcp

    from tierpipe.errors import TierpipeError

    world = int(os.environ["WORLD_SIZE"])
    files = [Path(cfg["env"]["TIERPIPE_NVME_ROOT"], JOB), Path(cfg["dcp"])]
    count = 0

    def tierpipe() -> None:
        nonlocal count
        count += 1
        ckpt.restore(into=targets, restart=f"bench-w{world}-{count}")

    candidates = {"tierpipe": tierpipe, "dcp": lambda: dcp.load(targets, checkpoint_id=cfg["dcp"])}
    for name in list(candidates):  # warm-up, checked
        for t in _locals(targets):
            t.zero_()
        try:
            candidates[name]()
        except TierpipeError as e:  # (every rank meets the same refusal: a build without it)
            del candidates[name]
            if rank == 0:
                _say(event="unavailable", candidate=name, error=f"{type(e).__name__}: {e}")
            continue
        _check(targets, expected, f"{name} at world {world}")
    _progress(cfg, "  warm-up done")
    for rep in range(cfg["reps"]):
        for name in alternate(list(candidates), rep):
            for t in _locals(targets):
                t.zero_()
            if rank == 0:
                _drop(files)
            seconds = _timed(candidates[name])
            _check(targets, expected, f"{name} at world {world}")
            if rank == 0:
                _say(event="restored", candidate=name, world=world, seconds=seconds)


# --- the harness


def _launch(cfg: dict[str, Any], world: int, mesh: tuple[int, int]) -> list[dict[str, Any]]:
    """Run `world` rank processes on `mesh` to the end; every JSON line they printed."""
    from tierpipe.dev import free_ports

    port = free_ports(1)[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERPIPE_")}
    arg = json.dumps({**cfg, "mesh": mesh})
    procs = []
    for rank in range(world):
        renv = {**env, "RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # fmt: skip
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "bench.reshard", "--rank", arg], cwd=REPO, env=renv,
            stdout=subprocess.PIPE, text=True,
        ))  # fmt: skip
    lines: list[dict[str, Any]] = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=RANK_TIMEOUT_S)
            lines += [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if bad := [p.returncode for p in procs if p.returncode]:
        raise RuntimeError(f"world {world}: rank processes exited with {bad} (stderr above)")
    return lines


def run(size_gib: float, reps: int, *, quick: bool = False) -> dict[str, Any]:
    """The benchmark; the JSON line's dict."""
    from bench.common import Deployment
    from tierpipe.dev import S3Server
    from tierpipe.log import configure_logging

    configure_logging("warning", "json", only_if_unconfigured=True)
    if quick:
        size_gib, reps = min(size_gib, QUICK_GIB), min(reps, 2)
    rows, cols = _shapes(size_gib)
    nbytes = 2 * PAIRS * rows * cols * 3  # (bf16 + fp32 per pair: 6 bytes over 2 tensors)
    ddp_mib = QUICK_DDP_MIB if quick else DDP_MIB
    log(f"reshard: {2 * PAIRS} tensors of {rows}x{cols} ({nbytes / GiB:.3f} GiB), {reps} reps; "
        f"saved at world 4 ({SAVE_MESH[0]}x{SAVE_MESH[1]})")  # fmt: skip
    secret = secrets.token_hex(16)
    with (
        scratch_dir("reshard") as work,
        S3Server(work / "s3", access_key="bench", secret_key=secret, bucket=BUCKET) as s3,
    ):
        s3_env = {
            "TIERPIPE_S3_ENDPOINT": s3.endpoint, "TIERPIPE_S3_REGION": s3.region,
            "TIERPIPE_S3_BUCKET": BUCKET, "TIERPIPE_S3_ACCESS_KEY_ID": "bench",
            "TIERPIPE_S3_SECRET_ACCESS_KEY": secret,
        }  # fmt: skip
        with Deployment("reshard", env=s3_env) as dep:
            assert dep.staging_root is not None
            for ddp_job in (DDP_JOB, DDP_EACH_JOB):
                (dep.staging_root / ddp_job).mkdir()
            cfg = {"size_gib": size_gib, "reps": reps, "ddp_mib": ddp_mib,
                   "dcp": str(work / "dcp"), "env": dep.settings.as_env(),
                   "t0": time.time() - (time.perf_counter() - T0)}  # fmt: skip
            lines: list[dict[str, Any]] = []
            for world, mesh in MESHES:
                log(f"world {world} ({mesh[0]}x{mesh[1]})" + (": save, then" if world == 4 else
                    ":") + " restores")  # fmt: skip
                lines += _launch({**cfg, "save": world == 4}, world, mesh)
                dep.check_agent()
            nvme = {
                j: sum(f.stat().st_size for f in (dep.nvme_root / j).rglob("*.shard"))
                for j in (DDP_JOB, DDP_EACH_JOB)
            }
    return _summary(lines, nbytes=nbytes, reps=reps, nvme=nvme)


def _summary(
    lines: list[dict[str, Any]], *, nbytes: int, reps: int, nvme: dict[str, int]
) -> dict[str, Any]:
    for line in lines:
        if line["event"] == "unavailable":
            log(f"  not measured: {line['candidate']}: {line['error']}")
    saves: dict[int, list[dict[str, Any]]] = {}
    for line in lines:
        if line["event"] == "saved":
            saves.setdefault(line["step"], []).append(line)
    stalls = [max(x["stall_s"] for x in s) for _, s in sorted(saves.items())]
    memcpys = [max(x["memcpy_s"] for x in s) for _, s in sorted(saves.items())]
    times: dict[tuple[str, int], list[float]] = {}
    for line in lines:  # (rank 0's lines, in the order the reps ran: the i-th of each a pair)
        if line["event"] == "restored":
            times.setdefault((line["candidate"], line["world"]), []).append(line["seconds"])
    m = {k: median(v) for k, v in times.items()}

    def ratio(world: int) -> Paired | None:
        t, d = times.get(("tierpipe", world)), times.get(("dcp", world))
        return None if t is None or d is None else paired(d, t)

    ddp = {x["job"]: x for x in lines if x["event"] == "ddp_saved"}
    replica, objects = ddp[DDP_JOB]["replica_bytes"], ddp[DDP_JOB]["object_bytes"]
    each = ddp[DDP_EACH_JOB]["object_bytes"]
    result: dict[str, Any] = {
        "size_gib": nbytes / GiB,
        "reps": reps,
        **{f"{c}_load_s_world{w}": v for (c, w), v in sorted(m.items())},
    }
    for key, world, target in (("reshard_4to2_vs_dcp", 2, None), ("reshard_4to8_vs_dcp", 8, None),
                               ("same_mesh_vs_dcp", 4, 1.0)):  # fmt: skip
        if (p := ratio(world)) is not None:
            record(result, key, p, target)
        else:
            result |= {key: None, f"{key}_lo": None, f"{key}_hi": None}
            log(f"{key}: not measured")
    result |= {
        "sharded_stall_s": median(stalls),
        "memcpy_s": median(memcpys),
        "dcp_save_s": next(x["seconds"] for x in lines if x["event"] == "dcp_saved"),
        "ddp_replica_bytes": replica,
        "ddp_nvme_bytes_per_node": nvme[DDP_JOB],
        "ddp_object_bytes_per_job": objects,
        "ddp_each_nvme_bytes_per_node": nvme[DDP_EACH_JOB],
        "ddp_each_object_bytes_per_job": each,
        "ddp_each_object_bytes_over_one_replica": each / replica,
    }
    _worse(result, [ratio(2), ratio(8)], target=1.0)
    record(result, "sharded_stall_vs_memcpy", paired(memcpys, stalls), 1.05)
    result["ddp_object_bytes_over_one_replica"] = objects / replica
    return result


def _worse(result: dict[str, Any], ratios: list[Paired | None], *, target: float) -> None:
    """`reshard_vs_dcp`: the worse of 4->2 and 4->8 (the higher median, with its interval),
    met when both are, missed when either is, else undecided (null if one was not measured)."""
    key = "reshard_vs_dcp"
    if any(p is None for p in ratios):
        result |= {key: None, f"{key}_lo": None, f"{key}_hi": None, f"{key}_verdict": None}
        log(f"{key}: not measured")
        return
    ps = [p for p in ratios if p is not None]
    worse = max(ps, key=lambda p: p.median)
    each: list[Verdict] = [
        "undecided"
        if p.n < MIN_PAIRS or p.lo is None or p.hi is None
        else verdict(p.lo, p.hi, target)
        for p in ps
    ]
    v: Verdict = ("missed" if "missed" in each else
                  "met" if all(x == "met" for x in each) else "undecided")  # fmt: skip
    result |= {key: worse.median, f"{key}_lo": worse.lo, f"{key}_hi": worse.hi,
               f"{key}_verdict": v}  # fmt: skip
    log(f"{key} = {worse.median:.3f} (the worse of 4->2 and 4->8; their verdicts "
        f"{' and '.join(each)}): {v} against the target <= {target:g}")  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"] and len(sys.argv) == 3:
        _rank_main(json.loads(sys.argv[2]))
        sys.exit(0)
    sys.exit("usage: python -m bench reshard (this module's --rank is the benchmark's rank)")
