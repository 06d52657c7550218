"""COMMIT manifests in object storage: written once a step is complete there, read by reindex.

Key: `<prefix>/commit/<job>/step-<n:012d>/COMMIT` (`commit_key`). It follows from (job, step)
alone, and a job's commits sit under one prefix of their own (`commits_prefix`), so one listing
finds them all, in step order, without touching the shard objects (those live under the 256
two-hex-digit prefixes, which `commit` never is). A step commits at checkpoint cadence, so the
one prefix sees a trivial request rate.

The coordinator creates a manifest with `IfNoneMatch="*"` (SeaweedFS honours it on PutObject, as
S3 does: 412 on an existing key): it is never overwritten, but by a newer timeline's manifest of
the same step (a rewound run saved the step again; its objects replaced the old ones the same
way, see `once`; the epoch is in the object's metadata too), and then only with `IfMatch` on
the old one's ETag. Retention removes a step's COMMIT before its objects, so a manifest never
outlives an object it names but by a failure in between, which `check_objects` (a HEAD of each
object) catches when it is read.
Every request goes through the store's `Requests` (`retry`).
"""

from __future__ import annotations

import re

import anyio
import msgspec
import structlog

from tierpipe.errors import StorageConflictError
from tierpipe.names import validate_token
from tierpipe.schemas.commit import CommitManifest, decode_commit, encode_commit
from tierpipe.storage.s3.client import Condition, ObjectHead
from tierpipe.storage.s3.errors import NotFound, first_error
from tierpipe.storage.s3.store import S3Store

__all__ = (
    "check_objects",
    "commit_key",
    "commits_prefix",
    "put_commit",
    "read_commit",
    "read_commits",
    "remove_commit",
)

log = structlog.get_logger(__name__)

#: The folder of every job's commits, below the store's prefix.
COMMIT_ROOT = "commit"
#: HEADs in flight at once when checking a step's objects (the store's limit still applies).
_HEAD_LANES = 64
_STEP = re.compile(r"step-(\d{12})/COMMIT")


def commits_prefix(prefix: str, job: str) -> str:
    """The prefix every COMMIT of `job` is under (ends with `/`)."""
    validate_token("job", job)
    return "/".join(p for p in (prefix, COMMIT_ROOT, job) if p) + "/"


def commit_key(prefix: str, job: str, step: int) -> str:
    """`<prefix>/commit/<job>/step-<n:012d>/COMMIT`."""
    if not 0 <= step < 10**12:
        raise ValueError(f"step out of range: {step}")
    return f"{commits_prefix(prefix, job)}step-{step:012d}/COMMIT"


def _step_of(prefix: str, job: str, key: str) -> int | None:
    """The step whose COMMIT `key` is, or None."""
    m = _STEP.fullmatch(key.removeprefix(commits_prefix(prefix, job)))
    return int(m.group(1)) if m and key.startswith(commits_prefix(prefix, job)) else None


async def put_commit(store: S3Store, manifest: CommitManifest) -> bool:
    """Create the step's COMMIT; whether it was written (False: one was there already, of the
    same or a newer timeline).

    Raises:
        StorageUnavailableError, StorageAuthError: as for any request (the caller retries later).
    """
    key = commit_key(store.prefix, manifest.job, manifest.step)
    body = encode_commit(manifest)
    try:
        await _put(store, key, body, manifest.epoch, {"IfNoneMatch": "*"})
        return True
    except StorageConflictError:
        pass
    # A HEAD, not a GET: the epoch is in the metadata (a manifest is ~2 MB at 80,000 ranks, and a
    # new coordinator completes the steps in its window again, finding their COMMITs there).
    head = await store.head(key)
    if head is None:  # (removed in between: retention got there first, nothing to commit)
        return False
    found = head.get("Metadata", {}).get("tp-epoch", "")
    if not found.isdigit() or int(found) >= manifest.epoch:
        if not found.isdigit() or int(found) > manifest.epoch:
            log.warning("commit_kept", key=key, epoch=manifest.epoch, found_epoch=found)
        return False
    try:
        await _put(store, key, body, manifest.epoch, {"IfMatch": head.get("ETag", "")})
    except StorageConflictError:
        return False  # (changed again in between: whoever replaced it was newer)
    log.warning("superseded_commit_replaced", key=key, old_epoch=int(found), epoch=manifest.epoch)
    return True


async def _put(store: S3Store, key: str, body: bytes, epoch: int, condition: Condition) -> None:
    requests = store.requests
    await requests(
        key,
        lambda: requests.client.put_object(
            Bucket=store.bucket, Key=key, Body=body, ChecksumAlgorithm="CRC32C",
            ContentType="application/msgpack", Metadata={"tp-epoch": str(epoch)}, **condition,
        ),
    )  # fmt: skip


async def _get(store: S3Store, key: str) -> tuple[bytes, str] | None:
    """(body, ETag) of an object, or None if there is none."""
    requests = store.requests

    async def get() -> tuple[bytes, str]:
        reply = await requests.client.get_object(Bucket=store.bucket, Key=key)
        async with reply["Body"] as body:
            return await body.read(), str(reply.get("ETag", ""))

    try:
        return await requests(key, get)
    except NotFound:
        return None


async def read_commit(store: S3Store, job: str, step: int) -> CommitManifest | None:
    """The step's COMMIT, or None if there is none or it does not decode (logged)."""
    key = commit_key(store.prefix, job, step)
    found = await _get(store, key)
    if found is None:
        return None
    try:
        manifest = decode_commit(found[0])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        log.warning("commit_unreadable", key=key, error=str(e))
        return None
    if manifest.job != job or manifest.step != step:
        log.warning("commit_unreadable", key=key, error=f"names {manifest.job} {manifest.step}")
        return None
    return manifest


async def read_commits(store: S3Store, job: str) -> list[CommitManifest]:
    """Every readable COMMIT of `job`, oldest step first (one listing, then a GET each)."""
    listed = await store.list_objects(commits_prefix(store.prefix, job))
    steps = sorted(s for key, _ in listed if (s := _step_of(store.prefix, job, key)) is not None)
    out = []
    for step in steps:
        manifest = await read_commit(store, job, step)
        if manifest is not None:
            out.append(manifest)
    return out


async def remove_commit(store: S3Store, job: str, step: int) -> None:
    """Remove the step's COMMIT (idempotent)."""
    await store.remove(commit_key(store.prefix, job, step))


async def check_objects(
    store: S3Store, manifest: CommitManifest
) -> tuple[dict[int, ObjectHead], dict[int, str]]:
    """HEAD each object the manifest names (no download).

    Returns:
        rank -> the HEAD of its object, for each rank whose object is there with the size the
        manifest gives and (if its metadata says one) the same header digest; and rank -> why
        not, for the others.

    Raises:
        StorageUnavailableError, StorageAuthError: as for any request.
    """
    good: dict[int, ObjectHead] = {}
    bad: dict[int, str] = {}
    ranks = iter(range(manifest.world_size))

    async def lane() -> None:  # (a few lanes, not a task a rank: 80,000 ranks stay cheap)
        for rank in ranks:
            await one(rank)

    async def one(rank: int) -> None:
        expected = manifest.of(rank)
        key = store.key(manifest.job, manifest.step, rank, manifest.world_size)
        head = await store.head(key)
        theirs = head.get("Metadata", {}).get("tp-header-digest") if head is not None else None
        if expected is None:
            bad[rank] = "no digest in the COMMIT"
        elif head is None:
            bad[rank] = f"{key}: missing"
        elif head.get("ContentLength") != expected[1]:
            bad[rank] = f"{key}: {head.get('ContentLength')} bytes, COMMIT says {expected[1]}"
        elif theirs is not None and theirs != expected[0]:
            bad[rank] = f"{key}: header digest {theirs}, COMMIT says {expected[0]}"
        else:
            good[rank] = head

    try:
        async with anyio.create_task_group() as tg:
            for _ in range(min(_HEAD_LANES, manifest.world_size)):
                tg.start_soon(lane)
    except BaseExceptionGroup as group:
        raise first_error(group) from group
    return good, bad
