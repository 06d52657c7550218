"""`python -m bench flush`: the flush stage, `verified -> flushed`, against plain S3 clients.

One object store for everything: an embedded SeaweedFS (`tierpipe.dev.S3Server`, its data
in a private directory under `.bench`) on the same 2 cores as everything else. A real deployment
(embedded nats-server, `python -m tierpipe.cli worker nvme-write verify flush evict` as a
subprocess, configured for that store) takes shards that a `Checkpointer` stages from the
synthetic state of `bench.common.make_state`. The evict stage runs for the job's coordinator it
hosts: the flush stage uploads only the step the coordinator names (without one, nothing goes
up). The benchmark still releases each staging slot once its shard is verified, and deletes the
uploaded object and the NVMe file once the shard is flushed (whichever of it and evict comes
first), so store and NVMe hold one shard at a time (plus the baseline file below).

- `flush_mib_s`: shard bytes / `ShardFlushed.seconds`, the flush stage's own upload time
  (`S3Store.upload`: HEAD for an existing object, abort earlier attempts, create, parts read with
  O_DIRECT + CRC32C and paced through the throttle, complete with `IfNoneMatch`, HEAD to confirm
  size and checksum), unthrottled. The `flushed` event is read from the stream (direct get of the
  newest message on `tp.bench.flushed.<node>.0`), since `SaveHandle.wait` stops at `verified`.
- `flush_direct_mib_s`: the same `S3Store.upload`, called in this process (uvloop, as the agent
  runs it) on the baseline file: the store without the stage around it.

Baselines, uploading the very same bytes: the first shard's file, moved out of the agent's NVMe
root after its flush (`baseline.shard`), to a fresh key each time, deleted afterwards:

- `boto3_mib_s`: `boto3.client("s3").upload_file` with every default (s3transfer's threaded
  multipart: 8 MiB parts, 10 threads; over plain HTTP botocore signs each part's payload with
  SHA-256 and adds a CRC32): what most users would write.
- `raw_mib_s`: a hand-written aioboto3 multipart upload (create / `upload_part` with bytes bodies
  read by `os.pread` in a thread, CRC32C per part from awscrt / complete), payload signing off as
  in `S3Store`, on uvloop. Its part size and concurrency are the best of a one-off sweep
  (16/64/128 MiB x 2/4/8; `raw_part_mib`, `raw_concurrency`). `raw_signed_mib_s`: the same with
  payload signing on (SHA-256 of every part), to show what signing costs.

Throttle accuracy: `Checkpointer.set_flush_rate` (the `tp.ctl.flush` control the
`tierpipe flush rate` command sends) at 20 and 50 MiB/s, each on its own state sized for ~13 s
of uploading; the achieved rate is the `flushed` event's nbytes / seconds, and
`throttle_<rate>_err_pct` = (achieved - target) / target * 100; `throttle_err_pct` is the larger
of the two by magnitude. The rate goes back to unlimited afterwards.

Every candidate runs once per rep, after one untimed warm-up each: boto3, the flush stage and
raw aioboto3 back to back (in that order on even reps, reversed on odd ones: a drift costs both
sides of a pair alike), then the others in a shuffled order. Times and rates are medians;
`flush_vs_boto3` and `flush_vs_raw` are medians of the per-rep rate ratios (the baseline's
seconds over the flush stage's) with a 90 % interval and a verdict against their
targets, >= 1.0 and >= 0.9 (`bench.paired`: `_lo`, `_hi`, `_verdict` met / missed /
undecided). `--quick` (`bench all --quick`): no throttle checks (`throttle_*` null) and the
raw sweep cut to 64 MiB x 4.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import secrets
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

from bench.common import (
    JOB,
    NODE,
    Deployment,
    GiB,
    MiB,
    fmt,
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

BUCKET = "tierpipe-bench"
#: Raw aioboto3 sweep: part sizes (MiB) x concurrencies, each once.
SWEEP_PARTS_MIB = (16, 64, 128)
SWEEP_CONCURRENCY = (2, 4, 8)
#: Throttle checks: target MiB/s, and how long each upload should take at that rate.
THROTTLE_RATES_MIB_S = (20, 50)
THROTTLE_TARGET_S = 13.0
THROTTLE_MIN_S = 10.0
#: SeaweedFS master request that compacts every volume holding any garbage.
_VACUUM = "/vol/vacuum?garbageThreshold=0.0001"
#: How long the benchmark waits for one shard to reach `verified` or `flushed`.
SHARD_TIMEOUT_S = 600.0


def _crc32c_b64(data: Any) -> str:
    """S3's CRC32C checksum value: base64 of the 4 big-endian bytes."""
    from awscrt import checksums

    return base64.b64encode(checksums.crc32c(data).to_bytes(4, "big")).decode()


# --- the object store


class _Store:
    """An embedded SeaweedFS S3 endpoint with one bucket, in a private directory, plus a
    synchronous boto3 client (default configuration) for the baseline and for clean-up."""

    def __init__(self, stack: ExitStack) -> None:
        import boto3

        from tierpipe.dev import S3Server

        data_dir = stack.enter_context(scratch_dir("flush-s3"))
        self.access_key = "bench"
        self.secret_key = secrets.token_hex(16)
        t0 = time.perf_counter()
        self.server = S3Server(
            data_dir, access_key=self.access_key, secret_key=self.secret_key, bucket=BUCKET
        )
        stack.callback(self.server.stop)
        self.server.start()
        log(f"  SeaweedFS up in {time.perf_counter() - t0:.1f} s at {self.server.endpoint}")
        self.client = boto3.client("s3", **self.server.client_kwargs())
        stack.callback(self.client.close)
        self._keys = 0

    def env(self) -> dict[str, str]:
        """The `TIERPIPE_*` settings that point agent and trainer at this store."""
        return {
            "TIERPIPE_S3_ENDPOINT": self.server.endpoint,
            "TIERPIPE_S3_REGION": self.server.region,
            "TIERPIPE_S3_BUCKET": BUCKET,
            "TIERPIPE_S3_ACCESS_KEY_ID": self.access_key,
            "TIERPIPE_S3_SECRET_ACCESS_KEY": self.secret_key,
        }

    def new_key(self, tag: str) -> str:
        self._keys += 1
        return f"baseline/{tag}-{self._keys:04d}"

    def size(self, key: str) -> int:
        return int(self.client.head_object(Bucket=BUCKET, Key=key)["ContentLength"])

    def delete(self, key: str) -> None:
        """Delete an object and reclaim its space at once: SeaweedFS only marks deleted bytes
        as garbage until a vacuum, so without one the store grows by a shard per upload
        (measured: 21 GB over one run)."""
        self.client.delete_object(Bucket=BUCKET, Key=key)
        master = f"http://127.0.0.1:{self.server.ports['master']}"
        try:
            with urllib.request.urlopen(f"{master}{_VACUUM}", timeout=120):
                pass
        except OSError as e:
            log(f"  WARNING: SeaweedFS vacuum failed ({e}); its directory keeps deleted bytes")

    @contextlib.contextmanager
    def uploaded(self, key: str, nbytes: int) -> Iterator[None]:
        """Around one upload: afterwards check the object's size, then delete the object (and
        abort a multipart upload a failed attempt left behind)."""
        try:
            yield
            got = self.size(key)
            if got != nbytes:
                raise RuntimeError(f"s3://{BUCKET}/{key} holds {got} bytes, expected {nbytes}")
        finally:
            with contextlib.suppress(Exception):
                self.delete(key)
            with contextlib.suppress(Exception):
                for up in self.client.list_multipart_uploads(Bucket=BUCKET, Prefix=key).get(
                    "Uploads", []
                ):
                    self.client.abort_multipart_upload(
                        Bucket=BUCKET, Key=up["Key"], UploadId=up["UploadId"]
                    )


# --- tierpipe: through the flush stage


class _Flushes:
    """Saves through a Checkpointer and follows each shard to `flushed` (read from the stream
    through a NATS connection of the benchmark's own, on an anyio portal thread)."""

    def __init__(self, dep: Deployment, store: _Store, stack: ExitStack) -> None:
        from anyio.from_thread import start_blocking_portal

        from tierpipe.bus.client import Bus

        self.dep = dep
        self.store = store
        self.ckpt = dep.checkpointer()
        stack.callback(self.ckpt.close)
        portal = stack.enter_context(start_blocking_portal())
        self.portal = portal
        self.bus = stack.enter_context(
            portal.wrap_async_context_manager(Bus(dep.settings, name="bench-flush"))
        )
        self.step = 0
        self.subject = f"tp.{JOB}.{{kind}}.{NODE}.0"

    def one(self, state: dict[str, Any], *, keep: Path | None = None) -> dict[str, float]:
        """Save `state`, wait for its `flushed` event, delete the object and the NVMe file (or
        move that file to `keep`). Returns the event's seconds and nbytes."""
        from tierpipe.storage.staged_image import release

        self.step += 1
        step = self.step
        quiesce()
        handle = self.ckpt.save(step, state)
        verified = handle.wait("verified", timeout=SHARD_TIMEOUT_S)
        assert verified is not None
        # (what evict does too: the next save need not wait for it)
        assert self.dep.staging_root is not None
        release(self.dep.staging_root, JOB, 0, step)
        key = None
        try:
            flushed = self._wait_flushed(step)
            key = flushed.key
            if flushed.nbytes != verified.nbytes:
                raise RuntimeError(f"flushed {flushed.nbytes} bytes of {verified.nbytes}")
        finally:
            if key is not None:
                self.store.delete(key)
            if keep is not None and key is not None:
                os.replace(verified.path, keep)
            else:
                remove(verified.path)
        return {"seconds": flushed.seconds, "nbytes": float(flushed.nbytes)}

    def _wait_flushed(self, step: int) -> Any:
        from tierpipe.schemas import ShardFlushed, StageFailed

        deadline = time.monotonic() + SHARD_TIMEOUT_S
        warned: set[tuple[str, int]] = set()
        while True:
            event = self.portal.call(self.bus.last_event, self.subject.format(kind="flushed"))
            if isinstance(event, ShardFlushed) and event.step == step:
                return event
            failed = self.portal.call(self.bus.last_event, self.subject.format(kind="failed"))
            if isinstance(failed, StageFailed) and failed.step == step:
                if not failed.retryable:
                    raise RuntimeError(f"step {step}: {failed.stage} failed: {failed.message}")
                if (failed.stage, failed.attempt) not in warned:
                    warned.add((failed.stage, failed.attempt))
                    log(f"  WARNING: step {step}: {failed.stage} retrying: {failed.message}")
            self.dep.check_agent()
            if time.monotonic() > deadline:
                raise TimeoutError(f"step {step} not flushed within {SHARD_TIMEOUT_S} s")
            time.sleep(0.05)

    def set_rate(self, bytes_per_s: int) -> None:
        """Re-rate the flush stage at run time (all nodes, as `tierpipe flush rate` does), then
        give the control message a moment to arrive (it travels ahead of the next shard anyway:
        staging, writing and verifying take seconds)."""
        self.ckpt.set_flush_rate(bytes_per_s)
        time.sleep(0.2)


# --- tierpipe: S3Store.upload in this process


def _direct(settings: Any, path: Path, key: str) -> float:
    """`S3Store.upload` of `path`; its own `seconds` (client creation untimed)."""
    import anyio

    from tierpipe.storage.s3.store import S3Store

    async def go() -> float:
        async with S3Store(settings) as s3:
            done = await s3.upload(path, key, header_digest="bench")
            return done.seconds

    return anyio.run(go, backend_options={"use_uvloop": True})


# --- baselines


def _boto3(store: _Store, path: Path, key: str) -> float:
    """boto3 `upload_file` with the default TransferConfig, wall time."""
    t0 = time.perf_counter()
    store.client.upload_file(str(path), BUCKET, key)
    return time.perf_counter() - t0


def _raw(
    store: _Store, path: Path, key: str, part_bytes: int, concurrency: int, *, sign: bool = False
) -> float:
    """A hand-written aioboto3 multipart upload; wall time from create to complete (client
    creation untimed)."""
    import aioboto3
    import anyio
    from aiobotocore.config import AioConfig

    nbytes = path.stat().st_size
    count = max(1, -(-nbytes // part_bytes))
    config = AioConfig(
        max_pool_connections=max(10, concurrency * 2),
        s3={"payload_signing_enabled": sign, "addressing_style": "path"},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )

    def read(fd: int, index: int) -> tuple[bytes, str]:
        data = os.pread(fd, min(part_bytes, nbytes - index * part_bytes), index * part_bytes)
        return data, _crc32c_b64(data)

    async def go() -> float:
        session = aioboto3.Session()
        kwargs = store.server.client_kwargs()
        async with session.client("s3", **kwargs, config=config) as client:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                t0 = time.perf_counter()
                created = await client.create_multipart_upload(
                    Bucket=BUCKET, Key=key, ChecksumAlgorithm="CRC32C"
                )
                upload_id = created["UploadId"]
                limiter = asyncio.Semaphore(concurrency)

                async def part(index: int) -> dict[str, Any]:
                    async with limiter:
                        data, crc = await asyncio.to_thread(read, fd, index)
                        r = await client.upload_part(
                            Bucket=BUCKET, Key=key, UploadId=upload_id, PartNumber=index + 1,
                            Body=data, ContentLength=len(data), ChecksumCRC32C=crc,
                        )  # fmt: skip
                        return {"PartNumber": index + 1, "ETag": r["ETag"], "ChecksumCRC32C": crc}

                parts = await asyncio.gather(*(part(i) for i in range(count)))
                await client.complete_multipart_upload(
                    Bucket=BUCKET, Key=key, UploadId=upload_id,
                    MultipartUpload={"Parts": list(parts)},
                )  # fmt: skip
                return time.perf_counter() - t0
            finally:
                os.close(fd)

    return anyio.run(go, backend_options={"use_uvloop": True})


# --- the run


def _throttle_state(rate_mib_s: int) -> Any:
    """A state whose shard takes about THROTTLE_TARGET_S to upload at `rate_mib_s`."""
    return make_state(rate_mib_s * MiB * THROTTLE_TARGET_S / GiB, seed=rate_mib_s)


def run(size_gib: float, reps: int, *, quick: bool = False) -> dict[str, Any]:
    log(f"flush: building a {size_gib:g} GiB synthetic state")
    s = make_state(size_gib)
    log(f"  {s.tensors} tensors, {s.nbytes / GiB:.3f} GiB")
    rates = () if quick else THROTTLE_RATES_MIB_S
    sweep_parts, sweep_conc = ((64,), (4,)) if quick else (SWEEP_PARTS_MIB, SWEEP_CONCURRENCY)
    throttle_states = {r: _throttle_state(r) for r in rates}
    for r, ts in throttle_states.items():
        log(f"  throttle {r} MiB/s: a {ts.nbytes / MiB:.0f} MiB state")
    samples: dict[str, list[float]] = {}

    def add(values: dict[str, float]) -> None:
        for k, v in values.items():
            samples.setdefault(k, []).append(v)

    with ExitStack() as stack:
        store = _Store(stack)
        dep = stack.enter_context(
            Deployment("flush", stages=("nvme-write", "verify", "flush", "evict"), env=store.env())
        )
        # At most: the baseline file + one shard on NVMe (+ slack); objects are deleted after
        # every upload.
        require_free(dep.nvme_root, 3 * s.nbytes + GiB, "flush benchmark")
        flushes = _Flushes(dep, store, stack)
        baseline = dep.nvme_root / "baseline.shard"
        log("  warm-up shard through the flush stage (kept as the baselines' file)")
        first = flushes.one(s.state, keep=baseline)
        nbytes = int(first["nbytes"])
        if baseline.stat().st_size != nbytes:
            raise RuntimeError(f"{baseline} holds {baseline.stat().st_size} bytes, not {nbytes}")
        log(f"  shard file: {nbytes} bytes ({nbytes / MiB:.1f} MiB), "
            f"warm-up flush {nbytes / MiB / first['seconds']:.1f} MiB/s")  # fmt: skip

        def timed(tag: str, fn: Callable[[Path, str], float]) -> float:
            key = store.new_key(tag)
            quiesce()
            with store.uploaded(key, nbytes):
                return fn(baseline, key)

        log("  raw aioboto3 sweep (once each, shuffled; the first run warms up)")
        timed("raw-warmup", lambda p, k: _raw(store, p, k, 64 * MiB, 4))
        sweep: dict[tuple[int, int], float] = {}
        for part_mib, conc in shuffled([(p, c) for p in sweep_parts for c in sweep_conc], 0):
            t = timed(
                "raw-sweep", partial(_raw, store, part_bytes=part_mib * MiB, concurrency=conc)
            )
            sweep[(part_mib, conc)] = t
            log(f"    part {part_mib:3d} MiB x {conc}: {t:.2f} s, {nbytes / MiB / t:.1f} MiB/s")
        best_part_mib, best_conc = min(sweep, key=sweep.__getitem__)
        log(f"  best raw configuration: part {best_part_mib} MiB x {best_conc}")

        def throttled(rate_mib_s: int) -> dict[str, float]:
            flushes.set_rate(rate_mib_s * MiB)
            try:
                r = flushes.one(throttle_states[rate_mib_s].state)
            finally:
                flushes.set_rate(0)
            achieved = r["nbytes"] / MiB / r["seconds"]
            if r["seconds"] < THROTTLE_MIN_S:
                log(f"  WARNING: throttled upload took only {r['seconds']:.1f} s")
            return {
                f"throttle_{rate_mib_s}_s": r["seconds"],
                f"throttle_{rate_mib_s}_err_pct": (achieved - rate_mib_s) / rate_mib_s * 100,
            }

        candidates: dict[str, Callable[[], dict[str, float]]] = {
            "tierpipe": lambda: {"flush": flushes.one(s.state)["seconds"]},
            "direct": lambda: {"direct": timed("direct", lambda p, k: _direct(dep.settings, p, k))},
            "boto3": lambda: {"boto3": timed("boto3", lambda p, k: _boto3(store, p, k))},
            "raw": lambda: {
                "raw": timed("raw", lambda p, k: _raw(store, p, k, best_part_mib * MiB, best_conc))
            },
            "raw_signed": lambda: {
                "raw_signed": timed(
                    "raw-signed",
                    lambda p, k: _raw(store, p, k, best_part_mib * MiB, best_conc, sign=True),
                )
            },
            **{
                f"throttle_{r}": (lambda r=r: throttled(r))  # type: ignore[misc]
                for r in rates
            },
        }
        log("  warm-up: every other baseline once")
        for name in ("direct", "boto3", "raw_signed"):
            t0 = time.perf_counter()
            candidates[name]()
            log(f"    {name}: {time.perf_counter() - t0:.2f} s")

        core = ["boto3", "tierpipe", "raw"]
        rest = [name for name in candidates if name not in core]
        for rep in range(reps):
            order = alternate(core, rep) + shuffled(rest, rep)
            log(f"rep {rep + 1}/{reps}: {' '.join(order)}")
            for name in order:
                add(candidates[name]())
                dep.check_agent()
            log("  " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in samples.items()))

    for name, values in samples.items():
        if name.endswith("_err_pct"):
            each = ", ".join(f"{v:+.2f}" for v in values)
            log(f"{name:>20}: median {median(values):+.2f} % ({each})")
        elif name.startswith("throttle_"):
            log(f"{name:>20}: {fmt(values)}")
        else:
            log(f"{name:>20}: {fmt(values)}  ({nbytes / MiB / median(values):.1f} MiB/s)")
    m = {k: median(v) for k, v in samples.items()}
    rate = {k: nbytes / MiB / m[k] for k in ("flush", "direct", "boto3", "raw", "raw_signed")}
    errs = {r: m[f"throttle_{r}_err_pct"] for r in rates}
    worst = max(errs.values(), key=abs) if errs else None
    result: dict[str, Any] = {
        "flush_mib_s": rate["flush"],
        "boto3_mib_s": rate["boto3"],
        "raw_mib_s": rate["raw"],
    }
    flush = samples["flush"]
    record(result, "flush_vs_boto3", paired(flush, samples["boto3"]), 1.0, "higher")
    record(result, "flush_vs_raw", paired(flush, samples["raw"]), 0.9, "higher")
    result |= {
        "throttle_err_pct": worst,
        **{f"throttle_{r}_err_pct": errs.get(r) for r in THROTTLE_RATES_MIB_S},
        "flush_direct_mib_s": rate["direct"],
        "raw_signed_mib_s": rate["raw_signed"],
        "raw_part_mib": float(best_part_mib),
        "raw_concurrency": float(best_conc),
        **{f"throttle_{r}_s": m.get(f"throttle_{r}_s") for r in THROTTLE_RATES_MIB_S},
        "nbytes": float(nbytes),
        "reps": float(reps),
        "size_gib": s.size_gib,
    }
    if worst is not None:
        verdict = "met" if abs(worst) <= 10 else "missed"
        log(f"throttle_err_pct = {worst:+.2f} (the worse median): {verdict} against the target "
            "|x| <= 10")  # fmt: skip
    return result
