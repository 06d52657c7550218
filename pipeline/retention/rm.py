"""`tierpipe rm`: delete a job whole (its stream, its keys in the job-state KV, its objects and
COMMITs, and this node's NVMe and staging files).

A dry run by default (`apply=False`): it counts what would go. It refuses a job that looks in
use, unless forced: its coordinator's lease is live (an agent coordinates it), or its newest
event is younger than `idle_s` (a trainer or an agent is still at work). An agent that served
the job holds its coordinator lease for as long as it runs, so a job is deleted once those
agents stopped, or with `force`; a running agent that still serves the job may then make its
stream again (empty) and take a new lease, which a later `rm --apply --force` removes.

Other nodes' files: each node's NVMe and staging folders are its own, so `rm` runs on every node
that held copies of the job (each run removes that node's files; the shared parts, gone with
the first run, count 0 on the others). The objects go before the stream and the KV keys, the
COMMITs before the shards, the KV keys last (the policy key first of them): a run cut short
leaves a job whose state still names what is left, and running it again finishes it.
"""

from __future__ import annotations

import functools
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import msgspec
import structlog

from tierpipe.bus.client import Bus
from tierpipe.control.kvstate import JobStore
from tierpipe.errors import JobBusyError
from tierpipe.names import job_subjects, node_name, validate_token
from tierpipe.retention.gc import job_objects
from tierpipe.settings import Settings
from tierpipe.storage.s3.commit import commits_prefix
from tierpipe.storage.s3.store import S3Store

__all__ = ("IDLE_S", "RmReport", "rm")

log = structlog.get_logger(__name__)

#: A job whose newest event is younger than this looks in use.
IDLE_S = 600.0


@dataclass(slots=True)
class RmReport:
    """What `rm` deleted (`applied`), or would delete."""

    job: str
    applied: bool
    #: The job's stream: (messages, bytes), or None if it has none.
    stream: tuple[int, int] | None = None
    kv_keys: list[str] = field(default_factory=list)
    #: (key, bytes) of each object: shards and COMMITs.
    objects: list[tuple[str, int]] = field(default_factory=list)
    #: (files, bytes) under this node's NVMe and staging folders of the job.
    nvme: tuple[int, int] = (0, 0)
    staging: tuple[int, int] = (0, 0)
    #: Why the job looks in use (empty: it does not).
    busy: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """For a terminal: what goes, part by part."""
        verb = "deleted" if self.applied else "would delete"
        stream = "no stream" if self.stream is None else (
            f"stream {self.stream[0]} events, {self.stream[1]} B"
        )  # fmt: skip
        out = [
            f"{self.job}: {verb}",
            f"  {stream}",
            f"  {len(self.kv_keys)} job-state keys",
            f"  {len(self.objects)} objects, {sum(n for _, n in self.objects)} B",
            f"  this node's NVMe: {self.nvme[0]} files, {self.nvme[1]} B",
            f"  this node's staging: {self.staging[0]} files, {self.staging[1]} B",
        ]
        out += [f"  in use: {why}" for why in self.busy]
        if not self.applied:
            out.append("(a dry run: --apply deletes it; --force too, while it is in use)")
        else:
            out.append("other nodes' NVMe and staging files stay: run `tierpipe rm` there too")
        return out

    def json_lines(self) -> list[str]:
        body = {
            "job": self.job, "applied": self.applied,
            "stream_messages": self.stream[0] if self.stream else 0,
            "stream_bytes": self.stream[1] if self.stream else 0,
            "kv_keys": len(self.kv_keys), "objects": len(self.objects),
            "object_bytes": sum(n for _, n in self.objects),
            "nvme_files": self.nvme[0], "nvme_bytes": self.nvme[1],
            "staging_files": self.staging[0], "staging_bytes": self.staging[1],
            "busy": self.busy,
        }  # fmt: skip
        return [msgspec.json.encode(body).decode()]


async def rm(
    settings: Settings, job: str, *, apply: bool = False, force: bool = False,
    idle_s: float = IDLE_S,
) -> RmReport:  # fmt: skip
    """Count, and with `apply` delete, everything of `job` (see the module docstring).

    Raises:
        JobBusyError: `apply` without `force` while the job looks in use.
        BusUnavailableError, StorageUnavailableError: NATS or the object store is unreachable.
    """
    validate_token("job", job)
    report = RmReport(job, apply)
    nvme_dir = Path(settings.nvme_root, job)  # (settings' paths are absolute)
    staging_dir = Path(settings.staging_root, job)
    async with Bus(settings, name=f"tierpipe-rm-{node_name(settings.node)}") as bus:
        store = await JobStore.opened(bus)
        report.stream = await bus.stream_size(job)
        report.kv_keys = await store.keys(job)
        report.busy = await _in_use(bus, store, job, idle_s, has_stream=report.stream is not None)
        async with await job_objects(settings, store, job) as objects:
            shards = await objects.list_job(job)
            commits = await objects.list_objects(commits_prefix(objects.prefix, job))
            report.objects = commits + shards
            report.nvme = await anyio.to_thread.run_sync(_tree_size, nvme_dir)
            report.staging = await anyio.to_thread.run_sync(_tree_size, staging_dir)
            if not apply:
                return report
            if report.busy and not force:
                raise JobBusyError(job, report.busy)
            await _delete_objects(objects, [k for k, _ in commits])  # (COMMITs first)
            await _delete_objects(objects, [k for k, _ in shards])
        if report.stream is not None:
            await bus.delete_stream(job)
        # (the policy first: coordinators follow it)
        await store.purge(sorted(report.kv_keys, key=lambda k: not k.endswith(".keep")))
    for folder in (nvme_dir, staging_dir):
        await anyio.to_thread.run_sync(functools.partial(shutil.rmtree, folder, ignore_errors=True))
    log.info("job_removed", job=job, objects=len(report.objects), kv_keys=len(report.kv_keys),
             nvme_files=report.nvme[0], forced=bool(report.busy))  # fmt: skip
    return report


async def _in_use(
    bus: Bus, store: JobStore, job: str, idle_s: float, *, has_stream: bool
) -> list[str]:
    """Why the job looks in use: a live coordinator lease, or a recent event."""
    busy = []
    now = time.time()
    lease = await store.lease(job)
    if lease is not None and lease.expires > now:
        busy.append(
            f"{lease.holder} holds its coordinator lease (for {lease.expires - now:.0f} s more)"
        )
    newest = await bus.last_event(job_subjects(job)) if has_stream else None
    if newest is not None and now - newest.ts < idle_s:
        busy.append(f"its newest event is {now - newest.ts:.0f} s old (under {idle_s:g} s)")
    return busy


async def _delete_objects(objects: S3Store, keys: list[str]) -> None:
    if keys:
        await objects.delete_many(keys)


def _tree_size(root: Path) -> tuple[int, int]:
    """(files, bytes) under `root` (none if it does not exist)."""
    files = size = 0
    for folder, _, names in os.walk(root):
        for name in names:
            try:
                size += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                continue
            files += 1
    return files, size
