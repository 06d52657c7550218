"""The object-storage tier: shard files uploaded to any S3-compatible store, write-once.

A shard's key is made and read in one place (`tierpipe.storage.s3.keys`): a step's objects
spread over 256 hash prefixes.

One long-lived aioboto3 client per process. An upload is a multipart upload streamed from the
NVMe file: each part is read with O_DIRECT (the page cache stays clean), its CRC32C computed
(awscrt, ~16 GB/s, off the event loop) and sent with that checksum, which the store verifies;
the bytes go out in ~1 MiB pieces through the shared `Throttle` (see `parts`). The final key
is write-once (`IfNoneMatch="*"`); an object already there with the same size and header digest
counts as done, and only an abandoned timeline's object (a rewound run's older epoch) may be
replaced (see `once`). Size and checksum are confirmed with a HEAD after completion. Objects
record which node uploaded them, and retention deletes only its own node's (`delete_owned`).
Every request goes through `Requests` (`retry`): a throttled one backs off with jitter and
shrinks the store's concurrency limit. botocore's exceptions stop here (see `errors`): callers
see `StorageUnavailableError` (retryable) or `StorageAuthError` / `StorageConflictError` /
`IntegrityError` (permanent).
"""

from __future__ import annotations

import base64
import mmap
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import anyio
import structlog
from aiobotocore.config import AioConfig

from tierpipe.errors import (
    ShardFormatError,
    ShardMissingError,
    StorageAuthError,
    StorageConflictError,
)
from tierpipe.names import node_name, validate_token
from tierpipe.settings import Settings
from tierpipe.storage.aligned import close_quietly
from tierpipe.storage.reader import check_image, deliver_image, image_head
from tierpipe.storage.resources import translated
from tierpipe.storage.s3 import delete as s3_delete
from tierpipe.storage.s3.client import (
    CompletedPart,
    CompletedUpload,
    Condition,
    ObjectHead,
    S3Client,
)
from tierpipe.storage.s3.errors import NotFound, first_error
from tierpipe.storage.s3.keys import HASH_PREFIXES, ShardKey, object_key, parse_object_key
from tierpipe.storage.s3.once import Save, confirm, existing
from tierpipe.storage.s3.parts import Hold, composite_checksum, download_parts, upload_parts
from tierpipe.storage.s3.retry import ConcurrencyLimit, Requests
from tierpipe.storage.s3.uploads import abort, abort_earlier, abort_orphans
from tierpipe.storage.store import BlobSink, ReadBack, SealedFile, VerifyResult
from tierpipe.throttle import Throttle

__all__ = ("S3Store", "Uploaded")

log = structlog.get_logger(__name__)

#: Listings of one job's hash prefixes in flight at once.
_LIST_LANES = 16


@dataclass(frozen=True, slots=True)
class Uploaded:
    bucket: str
    key: str
    etag: str
    checksum: str
    nbytes: int
    seconds: float
    #: The object was already there with this content (a redelivered event).
    existed: bool

    @property
    def location(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    def fields(self) -> dict[str, str | int | float]:
        """What a `flushed` event says of the object."""
        return {
            "bucket": self.bucket, "key": self.key, "etag": self.etag,
            "checksum": self.checksum, "nbytes": self.nbytes, "seconds": round(self.seconds, 6),
        }  # fmt: skip


class S3Store:
    """Async context manager: one S3 client for the life of a worker."""

    def __init__(
        self,
        settings: Settings,
        *,
        throttle: Throttle | None = None,
        read_slot: Hold | None = None,
    ) -> None:
        """`throttle` paces uploads; `read_slot` is held around each GET of `read_into` (the
        per-node cap on concurrent reads during a restart), entered in a worker thread."""
        self.settings = settings
        self.bucket = settings.s3_bucket
        self.prefix = settings.s3_prefix.strip("/")
        self.throttle = throttle or Throttle(None)
        self.read_slot = read_slot
        #: How many requests may be in flight now (lowered by throttling, see `retry`).
        self.limit = ConcurrencyLimit(settings.s3_max_concurrent_requests)
        #: The aiobotocore client while the store is entered.
        self.client: S3Client | None = None
        self._requests: Requests | None = None
        self._stack = AsyncExitStack()

    async def __aenter__(self) -> S3Store:
        import aioboto3  # deferred: importing boto costs ~0.3 s, trainers never need it

        s = self.settings
        config = AioConfig(
            connect_timeout=s.s3_connect_timeout_s,
            read_timeout=s.s3_read_timeout_s,
            # No retries inside botocore: `Requests` retries (a dropped connection once, quickly;
            # a throttled request with jittered backoff under a shrinking concurrency limit),
            # which botocore's policy, blind to that limit, would otherwise answer first.
            retries={"total_max_attempts": 1, "mode": "standard"},
            max_pool_connections=max(10, s.part_concurrency * 2),
            # The CRC32C we send is a signed header and the store verifies it, so signing the
            # payload too (SHA-256, ~1 GB/s of CPU) adds nothing but cost on plain-HTTP stores.
            s3={"payload_signing_enabled": False, "addressing_style": "path"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        session = aioboto3.Session(
            aws_access_key_id=s.s3_access_key_id,
            aws_secret_access_key=s.s3_secret_access_key,
            region_name=s.s3_region,
        )
        # aiobotocore is untyped: its client is taken as the `S3Client` it implements.
        client: S3Client = await self._stack.enter_async_context(
            session.client("s3", endpoint_url=s.s3_endpoint, config=config)
        )
        self.client = client
        self._requests = Requests(client, self.limit, s)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()
        self.client = self._requests = None

    @property
    def requests(self) -> Requests:
        """Where every request of this store goes (see `retry`)."""
        if self._requests is None:
            raise RuntimeError("S3Store used outside `async with`")
        return self._requests

    def key(self, job: str, step: int, rank: int, world_size: int) -> str:
        """The object key of a shard under this store's prefix (see `object_key`)."""
        return object_key(self.prefix, job, step, rank, world_size)

    def shard_of(self, key: str) -> ShardKey | None:
        """The shard whose object `key` is, or None (see `parse_object_key`)."""
        return parse_object_key(self.prefix, key)

    # --- the ShardStore contract (see `store`)

    def locate(self, job: str, step: int, rank: int, world_size: int) -> str:
        return f"s3://{self.bucket}/{self.key(job, step, rank, world_size)}"

    async def write(
        self, source: SealedFile, location: str, *, rewind_to: int | None = None
    ) -> Uploaded:
        """`upload` the sealed file, as this node's."""
        key, digest = self._key(location), source.header_digest
        return await self.upload(source.path, key, header_digest=digest, epoch=source.epoch,
                                 step=source.step, rewind_to=rewind_to)  # fmt: skip

    async def verify(self, location: str, *, header_digest: str, nbytes: int) -> VerifyResult:
        """Download the object and check it whole, as a file on NVMe is checked."""
        t0, key = time.perf_counter(), self._key(location)
        if (found := await self.head(key)) is None or found["ContentLength"] != nbytes:
            got = "missing" if found is None else f"{found['ContentLength']} bytes"
            raise ShardFormatError(location, f"object is {got}, {nbytes} bytes written")
        image = await self.download(key, nbytes)
        try:
            with translated(location):
                await anyio.to_thread.run_sync(check_image, image, location, header_digest, nbytes)
        finally:
            close_quietly(image)
        return VerifyResult(location, nbytes, header_digest, time.perf_counter() - t0)

    async def read_into(self, location: str, sink: BlobSink, *, nbytes: int) -> ReadBack:
        """Download the object (ranged GETs, each under `read_slot`) and hand it to `sink` from
        memory; the image comes back with the result (the sink may hold views of it)."""
        t0 = time.perf_counter()
        image = await self.download(self._key(location), nbytes, hold=self.read_slot)
        try:
            head = image_head(image, location, nbytes)
            with translated(location):
                await anyio.to_thread.run_sync(deliver_image, image, head, location, sink)
        except BaseException:
            close_quietly(image)
            raise
        return ReadBack(head, time.perf_counter() - t0, image)

    async def delete(self, location: str, *, header_digest: str) -> bool:
        """`delete_owned` as this node (the settings' node name)."""
        node = node_name(self.settings.node)
        return await self.delete_owned(self._key(location), node=node, header_digest=header_digest)

    def _key(self, location: str) -> str:
        """The key of `s3://<bucket>/<key>`; ShardMissingError if not in the configured bucket."""
        bucket, _, key = location.removeprefix("s3://").partition("/")
        if not location.startswith("s3://") or bucket != self.bucket or not key:
            raise ShardMissingError(location, f"not in the configured bucket {self.bucket}")
        return key

    # --- uploads

    async def upload(
        self,
        path: Path,
        key: str,
        *,
        header_digest: str,
        node: str | None = None,
        epoch: int = 0,
        step: int | None = None,
        rewind_to: int | None = None,
    ) -> Uploaded:
        """Upload a shard file to `key`, write-once, and confirm it.

        The object's metadata records the shard's header digest, the uploading node and the
        save's epoch: eviction deletes only objects this node uploaded, and a rewound run may
        replace an abandoned timeline's object (see `once.existing`).

        Args:
            node: the uploading node (default: this node's name from the settings).
            epoch, step, rewind_to: the save's timeline, from its events.

        Raises:
            StorageUnavailableError: the store is down or timing out (retry later).
            StorageAuthError: credentials are refused.
            StorageConflictError: another object with different content holds the key.
            IntegrityError: the store's checksum or size disagrees after completion.
        """
        t0 = time.perf_counter()
        nbytes = (await anyio.Path(path).stat()).st_size
        save = Save(header_digest, nbytes, epoch, step, rewind_to)
        location = f"s3://{self.bucket}/{key}"
        metadata = {
            "tp-header-digest": header_digest,
            "tp-node": node or node_name(self.settings.node),
            "tp-epoch": str(epoch),
        }
        # An abandoned timeline's object can appear at the key between the HEAD and the
        # complete (its own agent still flushing it): then look again and replace that one.
        for attempt in range(3):
            found = existing(await self.head(key), save, location)
            if found is not None and not found.superseded:
                return Uploaded(
                    self.bucket, key, found.etag, found.checksum, nbytes,
                    time.perf_counter() - t0, True,
                )  # fmt: skip
            # Write-once, except over the abandoned object seen just now (and only that one).
            condition: Condition = {"IfMatch": f'"{found.etag}"'} if found else {"IfNoneMatch": "*"}
            try:
                done, parts = await self._put(path, key, nbytes, metadata, condition)
            except StorageConflictError:
                if attempt == 2:
                    raise
                continue
            if found is not None:
                log.warning(
                    "superseded_object_replaced",
                    key=key,
                    bucket=self.bucket,
                    old_epoch=found.epoch,
                    old_header_digest=found.header_digest,
                    epoch=epoch,
                    rewind_to=rewind_to,
                )
            expected = composite_checksum([base64.b64decode(crc) for _, _, crc in parts])
            checksum = confirm(await self.head(key), nbytes, expected, location)
            etag = done.get("ETag", "").strip('"')
            return Uploaded(
                self.bucket, key, etag, checksum, nbytes, time.perf_counter() - t0, False
            )
        raise AssertionError("unreachable")

    async def _put(
        self, path: Path, key: str, nbytes: int, metadata: dict[str, str], condition: Condition
    ) -> tuple[CompletedUpload, list[tuple[int, str, str]]]:
        """One conditional multipart upload of `path` to `key` (aborted on any failure).

        Raises:
            StorageConflictError: the condition failed (the key changed since it was looked at).
        """
        requests = self.requests
        await abort_earlier(requests, self.bucket, key)
        created = await requests(
            key,
            lambda: requests.client.create_multipart_upload(
                Bucket=self.bucket, Key=key, ChecksumAlgorithm="CRC32C", Metadata=metadata
            ),
        )
        upload_id = created["UploadId"]
        try:
            parts = await upload_parts(
                requests,
                self.bucket,
                key,
                upload_id,
                path,
                nbytes,
                part_size_bytes=self.settings.part_size_bytes,
                concurrency=self.settings.part_concurrency,
                throttle=self.throttle,
            )
            sent: list[CompletedPart] = [
                {"PartNumber": n, "ETag": e, "ChecksumCRC32C": crc} for n, e, crc in parts
            ]
            done = await requests(
                key,
                lambda: requests.client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": sent},
                    **condition,
                ),
            )
        except BaseException:
            with anyio.CancelScope(shield=True):
                await abort(requests, self.bucket, key, upload_id)
            raise
        return done, parts

    async def head(self, key: str) -> ObjectHead | None:
        """The object's HEAD (with its checksum), or None if there is none."""
        requests = self.requests
        try:
            return await requests(
                key,
                lambda: requests.client.head_object(
                    Bucket=self.bucket, Key=key, ChecksumMode="ENABLED"
                ),
            )
        except NotFound:
            return None

    # --- orphans and removal

    async def abort_orphans(self, owned: Callable[[str], bool], *, max_age_s: float) -> int:
        """Abort multipart uploads under the prefix that this node owns (`owned(key)`), or that
        are older than `max_age_s` whoever started them. Returns how many were aborted."""
        prefix = self.prefix + "/" if self.prefix else ""
        return await abort_orphans(self.requests, self.bucket, prefix, owned, max_age_s=max_age_s)

    async def download(self, key: str, nbytes: int, *, hold: Hold | None = None) -> mmap.mmap:
        """Fetch an object with parallel ranged GETs into a page-aligned buffer.

        Args:
            hold: a context manager factory taken around each GET (the per-node cap on
                concurrent reads during a restart); entered in a worker thread.

        Raises:
            ShardMissingError: there is no object at `key`.
            StorageUnavailableError: the store failed or the object is shorter than `nbytes`.
            StorageAuthError: the store refused the request (credentials, permissions).
        """
        return await download_parts(
            self.requests,
            self.bucket,
            key,
            nbytes,
            part_size_bytes=self.settings.part_size_bytes,
            concurrency=self.settings.part_concurrency,
            hold=hold,
        )

    async def list_objects(self, prefix: str) -> list[tuple[str, int]]:
        """(key, size) of every object under `prefix`."""
        requests = self.requests

        async def listing() -> list[tuple[str, int]]:
            found: list[tuple[str, int]] = []
            paginator = requests.client.get_paginator("list_objects_v2")
            async for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
                found += [(o["Key"], o["Size"]) for o in page.get("Contents", [])]
            return found

        return await requests(prefix, listing)

    async def list_job(self, job: str) -> list[tuple[str, int]]:
        """(key, size) of every object under the job's folder of each of the 256 hash
        prefixes, sorted by key (what `reindex` finds; `shard_of` says which are shards)."""
        validate_token("job", job)
        found: list[tuple[str, int]] = []
        lanes = anyio.Semaphore(_LIST_LANES)

        async def one(spread: str) -> None:
            async with lanes:
                found.extend(await self.list_objects(self._join(spread, job) + "/"))

        try:
            async with anyio.create_task_group() as tg:
                for spread in HASH_PREFIXES:
                    tg.start_soon(one, spread)
        except BaseExceptionGroup as group:
            raise first_error(group) from group
        return sorted(found)

    def _join(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    async def remove(self, key: str) -> None:
        """Remove an object (idempotent), whoever uploaded it."""
        await s3_delete.remove(self.requests, self.bucket, key)

    async def delete_owned(self, key: str, *, node: str, header_digest: str) -> bool:
        """Remove the object at `key` only if `node` uploaded it with `header_digest` (see
        `s3_delete.delete_owned`)."""
        return await s3_delete.delete_owned(
            self.requests, self.bucket, key, await self.head(key), node, header_digest
        )

    async def delete_many(self, keys: list[str]) -> None:
        """Remove objects, 1,000 keys a request (see `s3_delete.delete_many`)."""
        await s3_delete.delete_many(self.requests, self.bucket, keys)

    async def check(self) -> None:
        """Fail fast on a missing bucket or refused credentials (at worker start).

        Raises:
            StorageAuthError: the bucket does not exist or the credentials are refused.
            StorageUnavailableError: the store cannot be reached.
        """
        requests = self.requests
        try:
            await requests(self.bucket, lambda: requests.client.head_bucket(Bucket=self.bucket))
        except NotFound:
            raise StorageAuthError(
                f"bucket {self.bucket!r} does not exist (check s3_bucket)"
            ) from None
