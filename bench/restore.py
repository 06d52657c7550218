"""`python -m bench restore`: loading a checkpoint back, from NVMe and from object storage,
against a plain cold read and the usual loaders (recovery planning and event replay at scale are
`python -m bench plan`).

The synthetic transformer state of `bench.common.make_state` is written once as a tierpipe shard
(`tierpipe.write_shard`, at its canonical path under a private NVMe root), and once in each
peer's own format. Target tensors (same shapes and dtypes, allocated and touched once) are reused
by every candidate and every rep. Every candidate reads cold: the page cache is dropped right
before each one. Candidates run once per rep, after one untimed warm-up each that also checks
bitwise that the targets equal the original state afterwards (targets zeroed first): first the
cold read, tierpipe's NVMe restore and the four peers back to back, then the raw GET, the S3
restore and the ranged GET, each block in that order on even reps and reversed on odd ones (a
drift costs both sides of a pair alike), then the rest in a shuffled order. Times are medians;
ratios are medians of the per-rep ratios with a 90 % interval (`bench.paired`: `_lo`,
`_hi`, and `_verdict` met / missed / undecided where there is a target).

- `nvme_restore_s`: `tierpipe.recovery.load.load_into(shard, into=targets)` with its defaults
  (reads by 4 threads in 8 MiB chunks into an arena, O_DIRECT since the page cache does not
  hold the file, every blob's xxh3-128 checked before it is copied into its targets in place,
  the arena unmapped in the background). `nvme_restore_buffered_s`: the same through the page
  cache (`direct_io=False`, the default before issue 22).
- `nvme_restore_e2e_s`: wall time of `Checkpointer.restore(into=targets)` for a 1-rank job: replay
  of the job's events from an embedded nats-server, catalog fold, the rank's `ready` report, rank 0
  planning, the load above, `loaded` report, final plan. The events (`written` + `verified` for the
  NVMe file, `flushed` for the object) come from `tierpipe reindex`
  (`tierpipe.recovery.reindex.reindex`, which re-reads and verifies the file) run once beforehand.
  No node agent runs.
- `cold_read_s`: `dd if=<shard> of=/dev/null bs=16M iflag=direct`; `restore_vs_read`: per rep
  nvme_restore_s / cold_read_s (target <= 0.95).
- Peers, each into the same targets: `torch_load_s` (`torch.load(weights_only=True)` of a
  `torch.save`d state, then `copy_` into the targets), `torch_mmap_s` (the same with `mmap=True`),
  `safetensors_s` (`safetensors.torch.load_file` of the flat tensors + `copy_`), `dcp_load_s`
  (`torch.distributed.checkpoint.load` into a state dict of the targets, single-process gloo
  group, checkpoint saved once beforehand). `best_peer_s` is the smallest of the four medians
  (`best_peer` names it); `restore_vs_best_peer`: per rep nvme_restore_s over that peer's time
  (target <= 1.0).
- `s3_restore_s`: wall time of the full `Checkpointer.restore(into=targets)` with this node's NVMe
  copy absent (the shard file is renamed away for the call, so the plan picks the object): an
  embedded SeaweedFS holds the shard (uploaded once with `S3Store.upload`), read by
  `S3Store.download` (parallel ranged GETs, 64 MiB x 4), header and every blob digest checked
  (`S3Store.read_into`), copied into the targets. The NVMe write-back that restore() starts in the
  background afterwards (a copy into a staging slot; no agent runs to write it out) is waited for
  and the slot released, untimed. Baselines on the same object: `raw_get_s`, one aioboto3
  `get_object` streamed into a fresh buffer; `raw_ranged_get_s`, parallel ranged GETs with the
  same part size and concurrency as `S3Store.download` (client creation untimed in both).
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    SCRATCH,
    SHM,
    GiB,
    MiB,
    drop_caches,
    fmt,
    fsync_path,
    log,
    make_state,
    median,
    quiesce,
    remove,
    require_free,
    scratch_dir,
    shuffled,
)
from bench.paired import alternate, paired, record

__all__ = ["run"]

JOB = "bench"
NODE = "bench-node"
STEP = 1000
BUCKET = "tierpipe-bench"
#: How long one restore may take before the benchmark gives up.
RESTORE_TIMEOUT_S = 600.0


# --- targets and trees


def _like(v: Any) -> Any:
    """`v` with every tensor replaced by a zeroed tensor of the same shape and dtype."""
    if isinstance(v, torch.Tensor):
        return torch.zeros_like(v)
    if isinstance(v, dict):
        return {k: _like(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_like(x) for x in v]
    if isinstance(v, tuple):
        return tuple(_like(x) for x in v)
    return v


def _tensors(v: Any) -> list[torch.Tensor]:
    """Every tensor of a tree, in a fixed order."""
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, dict):
        return [t for x in v.values() for t in _tensors(x)]
    if isinstance(v, list | tuple):
        return [t for x in v for t in _tensors(x)]
    return []


def _copy_tree(src: Any, dst: Any) -> None:
    """Copy every tensor of `src` into the tensor at the same place in `dst`."""
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, dict):
        for k, v in dst.items():
            _copy_tree(src[k], v)
    elif isinstance(dst, list | tuple):
        for s, d in zip(src, dst, strict=True):
            _copy_tree(s, d)


def _flat_targets(targets: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The targets under the flat names of `SyntheticState.flat` (for safetensors)."""
    flat = {f"model.{k}": v for k, v in targets["model"].items()}
    for index, st in targets["optim"]["state"].items():
        for k, v in st.items():
            flat[f"optim.state.{index}.{k}"] = v
    flat["rng.torch"] = targets["rng"]["torch"]
    return flat


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


class _Targets:
    """Preallocated targets shaped like the state; zeroing and bitwise checks."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.tree = _like(state)  # zeros_like touches every page once
        self.list = _tensors(self.tree)
        self._originals = _tensors(state)
        if len(self.list) != len(self._originals):
            raise RuntimeError("targets do not mirror the state")

    def zero(self) -> None:
        for t in self.list:
            t.zero_()

    def check(self, what: str) -> None:
        """Raise unless every target holds exactly the original bytes."""
        for i, (t, o) in enumerate(zip(self.list, self._originals, strict=True)):
            if t.shape != o.shape or t.dtype != o.dtype or not torch.equal(_bytes(t), _bytes(o)):
                raise RuntimeError(f"{what}: target tensor {i} differs from the original state")


# --- a one-node setup without an agent: nats-server, object store, settings


class _Setup:
    """Embedded nats-server and SeaweedFS, a private NVMe root (under `work`) and staging root
    (under /dev/shm), the settings that point at them, the shard file at its canonical path."""

    def __init__(self, work: Path, stack: ExitStack) -> None:
        import secrets

        from tierpipe.dev import NatsServer, S3Server
        from tierpipe.names import shard_relpath
        from tierpipe.settings import load_settings

        self.nvme_root = work / "nvme"
        self.nvme_root.mkdir()
        self.staging_root = Path(tempfile.mkdtemp(prefix="tierpipe-bench-restore-", dir=SHM))
        stack.callback(remove, self.staging_root)
        self.nats = NatsServer(work / "nats")
        stack.callback(self.nats.stop)
        self.nats.start()
        secret = secrets.token_hex(16)
        t0 = time.perf_counter()
        self.s3 = S3Server(work / "s3", access_key="bench", secret_key=secret, bucket=BUCKET)
        stack.callback(self.s3.stop)
        self.s3.start()
        log(f"  nats {self.nats.url}; SeaweedFS {self.s3.endpoint} up in "
            f"{time.perf_counter() - t0:.1f} s")  # fmt: skip
        self.settings = load_settings(
            path=None,
            env={
                "TIERPIPE_NATS_URL": self.nats.url,
                "TIERPIPE_NODE": NODE,
                "TIERPIPE_NVME_ROOT": str(self.nvme_root),
                "TIERPIPE_STAGING_ROOT": str(self.staging_root),
                "TIERPIPE_LOG_LEVEL": "warning",
                "TIERPIPE_S3_ENDPOINT": self.s3.endpoint,
                "TIERPIPE_S3_REGION": self.s3.region,
                "TIERPIPE_S3_BUCKET": BUCKET,
                "TIERPIPE_S3_ACCESS_KEY_ID": "bench",
                "TIERPIPE_S3_SECRET_ACCESS_KEY": secret,
            },
        )
        self.relpath = shard_relpath(JOB, STEP, 0, 1)
        self.shard = self.nvme_root / self.relpath
        self.key = ""

    def write_shard(self, state: dict[str, Any]) -> str:
        from tierpipe.storage.shardfile import write_shard

        self.shard.parent.mkdir(parents=True)
        return write_shard(self.shard, state, job=JOB, step=STEP, node=NODE)

    def upload(self, header_digest: str) -> float:
        """Upload the shard with `S3Store.upload`; returns its seconds."""
        import anyio

        from tierpipe.storage.s3.store import S3Store

        async def go() -> float:
            async with S3Store(self.settings) as store:
                self.key = store.key(JOB, STEP, 0, 1)
                done = await store.upload(self.shard, self.key, header_digest=header_digest)
                return done.seconds

        return anyio.run(go, backend_options={"use_uvloop": True})

    def reindex(self) -> Any:
        """`tierpipe reindex --job bench`: `written` + `verified` for the NVMe file (re-read and
        verified), `flushed` for the object."""
        import anyio

        from tierpipe.recovery.reindex import reindex

        return anyio.run(lambda: reindex(self.settings, JOB), backend_options={"use_uvloop": True})

    @contextlib.contextmanager
    def nvme_copy_absent(self) -> Any:
        """The shard file renamed away (the node lost its NVMe copy), and back afterwards."""
        away = self.shard.with_name(self.shard.name + ".away")
        os.replace(self.shard, away)
        try:
            yield
        finally:
            os.replace(away, self.shard)


# --- candidates


def _cold() -> None:
    quiesce()
    drop_caches()


def _timed(fn: Callable[[], Any]) -> float:
    _cold()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _dd_read(path: Path) -> float:
    cmd = ["dd", f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct", "status=none"]
    return _timed(lambda: subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL))


class _Restores:
    """`Checkpointer.restore()` from NVMe or object storage, each call its own restart id."""

    def __init__(self, setup: _Setup, targets: _Targets, stack: ExitStack) -> None:
        from tierpipe.trainer.checkpointer import Checkpointer

        self.setup = setup
        self.targets = targets
        self.ckpt = Checkpointer(JOB, rank=0, world_size=1, node=NODE, settings=setup.settings)
        stack.callback(self.ckpt.close)
        self.count = 0

    def one(self, tier: str) -> float:
        from tierpipe.storage.staged_image import release

        self.count += 1
        restart = f"bench-{tier}-{self.count}"
        absent = self.setup.nvme_copy_absent() if tier == "s3" else contextlib.nullcontext()
        with absent:
            _cold()
            t0 = time.perf_counter()
            restored = self.ckpt.restore(into=self.targets.tree, restart=restart)
            seconds = time.perf_counter() - t0
            # Untimed: restore() writes a shard read from object storage back through a staging
            # slot in the background; wait for it and free the slot (no agent runs here).
            self.ckpt._bus.run(self.ckpt._loader().written_back, timeout=RESTORE_TIMEOUT_S)
            release(self.setup.staging_root, JOB, 0, STEP)
        if restored.step != STEP or restored.source.tier != tier:
            raise RuntimeError(
                f"restore read step {restored.step} from {restored.source.tier}, "
                f"expected step {STEP} from {tier}"
            )
        return seconds


class _Dcp:
    """DCP save (once) and load in a single-process gloo group."""

    def __init__(self, work: Path, stack: ExitStack) -> None:
        import torch.distributed as dist

        self._dist = dist
        if not dist.is_initialized():
            store = dist.FileStore(str(work / "gloo-store"), 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
            stack.callback(dist.destroy_process_group)
        self.path = work / "dcp"

    def save(self, state: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(state, checkpoint_id=self.path)
        for f in self.path.iterdir():
            fsync_path(f)

    def load(self, targets: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.load(targets, checkpoint_id=self.path)


def _raw_get(setup: _Setup, nbytes: int, *, part: int = 0, concurrency: int = 1) -> float:
    """Wall time of a raw aioboto3 read of the whole object into a fresh buffer: one streamed
    GET (`part` 0) or ranged GETs of `part` bytes, `concurrency` at a time."""
    import aioboto3
    import anyio
    from aiobotocore.config import AioConfig

    config = AioConfig(
        max_pool_connections=max(10, concurrency * 2),
        s3={"addressing_style": "path"},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )

    async def go() -> float:
        session = aioboto3.Session()
        async with session.client("s3", **setup.s3.client_kwargs(), config=config) as client:
            await client.head_bucket(Bucket=BUCKET)  # connect before the clock starts
            _cold()
            t0 = time.perf_counter()
            buf = mmap.mmap(-1, nbytes)
            try:
                got = 0

                async def fetch(offset: int, size: int) -> None:
                    nonlocal got
                    kwargs = {"Range": f"bytes={offset}-{offset + size - 1}"} if part else {}
                    r = await client.get_object(Bucket=BUCKET, Key=setup.key, **kwargs)
                    at = offset
                    async for chunk in r["Body"].iter_chunks(MiB):
                        buf[at : at + len(chunk)] = chunk
                        at += len(chunk)
                    got += at - offset

                if not part:
                    await fetch(0, nbytes)
                else:
                    limiter = asyncio.Semaphore(concurrency)

                    async def one(offset: int) -> None:
                        async with limiter:
                            await fetch(offset, min(part, nbytes - offset))

                    await asyncio.gather(*(one(o) for o in range(0, nbytes, part)))
                elapsed = time.perf_counter() - t0
            finally:
                buf.close()
            if got != nbytes:
                raise RuntimeError(f"raw GET read {got} bytes of {nbytes}")
            return elapsed

    return anyio.run(go, backend_options={"use_uvloop": True})


# --- the run


def run(size_gib: float, reps: int) -> dict[str, Any]:
    from tierpipe.log import configure_logging

    # structlog's defaults print to stdout, which must carry only the JSON line.
    configure_logging("warning", "json", only_if_unconfigured=True)
    log(f"restore: building a {size_gib:g} GiB synthetic state")
    s = make_state(size_gib)
    log(f"  {s.tensors} tensors, {s.nbytes / GiB:.3f} GiB")
    samples: dict[str, list[float]] = {}

    with ExitStack() as stack:
        SCRATCH.mkdir(exist_ok=True)
        # At most: shard, torch.save file, safetensors file, DCP checkpoint, the object in
        # SeaweedFS (+ slack).
        require_free(SCRATCH, 5 * s.nbytes + 2 * GiB, "restore benchmark")
        work = stack.enter_context(scratch_dir("restore"))

        setup = _Setup(work, stack)
        targets = _Targets(s.state)
        log("  writing the shard (write_shard)")
        digest = setup.write_shard(s.state)
        nbytes = setup.shard.stat().st_size
        log(f"  shard file: {nbytes} bytes ({nbytes / MiB:.1f} MiB)")
        log("  uploading it (S3Store.upload)")
        up = setup.upload(digest)
        log(f"    {up:.1f} s, {nbytes / MiB / up:.0f} MiB/s")
        log("  reindex (written + verified + flushed events from the file and the object)")
        found = setup.reindex()
        if (found.nvme, found.s3) != (1, 1) or found.skipped:
            raise RuntimeError(f"reindex found {found}")

        base = work / "base"
        base.mkdir()
        log("  writing the peers' files")
        pt = base / "state.pt"
        torch.save(s.state, pt)
        fsync_path(pt)
        st = base / "state.safetensors"
        from safetensors.torch import load_file, save_file

        seen: set[int] = set()
        flat = {}
        for k, v in s.flat.items():  # safetensors refuses shared storage: clone tied tensors
            ptr = v.untyped_storage().data_ptr()
            flat[k] = v.clone() if ptr in seen else v
            seen.add(ptr)
        save_file(flat, str(st))
        fsync_path(st)
        del flat
        dcp = _Dcp(work, stack)
        dcp.save(s.state)
        flat_targets = _flat_targets(targets.tree)
        if flat_targets.keys() != s.flat.keys():
            raise RuntimeError("flat target names differ from the state's")

        from tierpipe.recovery.load import load_into

        restores = _Restores(setup, targets, stack)

        def safetensors_load() -> None:
            loaded = load_file(str(st))
            for k, t in flat_targets.items():
                t.copy_(loaded[k])

        candidates: dict[str, Callable[[], float]] = {
            "nvme_restore": lambda: _timed(lambda: load_into(str(setup.shard), into=targets.tree)),
            "nvme_restore_buffered": lambda: _timed(
                lambda: load_into(str(setup.shard), into=targets.tree, direct_io=False)
            ),
            "nvme_restore_e2e": lambda: restores.one("nvme"),
            "cold_read": lambda: _dd_read(setup.shard),
            "torch_load": lambda: _timed(
                lambda: _copy_tree(torch.load(pt, weights_only=True), targets.tree)
            ),
            "torch_mmap": lambda: _timed(
                lambda: _copy_tree(torch.load(pt, mmap=True, weights_only=True), targets.tree)
            ),
            "safetensors": lambda: _timed(safetensors_load),
            "dcp_load": lambda: _timed(lambda: dcp.load(targets.tree)),
            "s3_restore": lambda: restores.one("s3"),
            "raw_get": lambda: _raw_get(setup, nbytes),
            "raw_ranged_get": lambda: _raw_get(
                setup,
                nbytes,
                part=setup.settings.part_size_bytes,
                concurrency=setup.settings.part_concurrency,
            ),
        }
        log("  warm-up: every candidate once, targets zeroed before and checked bitwise after")
        for name, fn in candidates.items():
            targets.zero()
            t = fn()
            if name not in ("cold_read", "raw_get", "raw_ranged_get"):
                targets.check(name)
            log(f"    {name}: {t:.2f} s" + ("" if name.startswith(("cold", "raw")) else ", exact"))

        core = ["cold_read", "nvme_restore", "torch_mmap", "torch_load", "safetensors", "dcp_load"]
        s3 = ["raw_get", "s3_restore", "raw_ranged_get"]
        rest = [name for name in candidates if name not in core + s3]
        for rep in range(reps):
            order = alternate(core, rep) + alternate(s3, rep) + shuffled(rest, rep)
            log(f"rep {rep + 1}/{reps}: {' '.join(order)}")
            for name in order:
                samples.setdefault(name, []).append(candidates[name]())
            log("  " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in samples.items()))

    for name, values in samples.items():
        log(f"{name:>20}: {fmt(values)}  ({nbytes / median(values) / 1e9:.2f} GB/s)")
    m = {k: median(v) for k, v in samples.items()}
    peers = {k: m[k] for k in ("torch_load", "torch_mmap", "safetensors", "dcp_load")}
    best = min(peers, key=peers.__getitem__)
    log(f"  best peer: {best}")
    result: dict[str, Any] = {
        "nvme_restore_s": m["nvme_restore"],
        "nvme_restore_e2e_s": m["nvme_restore_e2e"],
        "nvme_restore_buffered_s": m["nvme_restore_buffered"],
        "cold_read_s": m["cold_read"],
    }
    restore = samples["nvme_restore"]
    record(result, "restore_vs_read", paired(samples["cold_read"], restore), 0.95)
    result["best_peer_s"] = peers[best]
    record(result, "restore_vs_best_peer", paired(samples[best], restore), 1.0)
    result |= {
        "best_peer": best,
        **{f"{k}_s": v for k, v in peers.items()},
        "s3_restore_s": m["s3_restore"],
        "raw_get_s": m["raw_get"],
        "raw_ranged_get_s": m["raw_ranged_get"],
        "nbytes": float(nbytes),
        "reps": float(reps),
    }
    record(result, "s3_restore_vs_raw_get", paired(samples["raw_get"], samples["s3_restore"]))
    result["size_gib"] = s.size_gib
    return result
