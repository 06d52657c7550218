"""Removing objects: one, one only if this node uploaded it, or many at once.

Retention's coordinator removes a step's objects with `delete_many` (DeleteObjects, 1,000 keys
a request); `delete_owned` is the careful single removal the `ShardStore` contract's `delete`
makes (a HEAD of the object's metadata, then a delete conditional on its ETag). Each request
goes through the store's `Requests` (`retry`).
"""

from __future__ import annotations

import contextlib
import functools

import structlog

from tierpipe.errors import StorageConflictError, StorageUnavailableError, StorageUnsupportedError
from tierpipe.storage.s3.client import DeletedObjects, ObjectHead
from tierpipe.storage.s3.errors import NotFound
from tierpipe.storage.s3.retry import Requests

__all__ = ("delete_many", "delete_owned", "remove")

log = structlog.get_logger(__name__)

#: Keys per DeleteObjects request (the S3 API's limit).
BATCH = 1000


async def remove(requests: Requests, bucket: str, key: str) -> None:
    """Remove an object (idempotent), whoever uploaded it."""
    with contextlib.suppress(NotFound):
        await requests(key, lambda: requests.client.delete_object(Bucket=bucket, Key=key))


async def delete_owned(
    requests: Requests,
    bucket: str,
    key: str,
    head: ObjectHead | None,
    node: str,
    header_digest: str,
) -> bool:
    """Remove the object at `key` (as `head`, a HEAD of it, shows it) only if its metadata
    says `node` uploaded it with `header_digest`: never another node's or team's object. The
    delete is conditional on that ETag, so an object replaced in between is left alone too.

    Returns:
        True if the object is gone (deleted now, or already absent); False if it was left in
        place because it is not the shard this node uploaded (logged at warning).
    """
    if head is None:
        return True
    meta = head.get("Metadata", {})
    owner, theirs = meta.get("tp-node"), meta.get("tp-header-digest")
    if owner != node or theirs != header_digest:
        log.warning(
            "object_delete_refused", bucket=bucket, key=key, uploaded_by=owner,
            header_digest=theirs, expected_node=node, expected_header_digest=header_digest,
        )  # fmt: skip
        return False
    try:
        with contextlib.suppress(NotFound):
            etag = head.get("ETag", "")
            try:
                await requests(
                    key, lambda: requests.client.delete_object(Bucket=bucket, Key=key, IfMatch=etag)
                )
            except StorageUnsupportedError:
                # A store without conditional deletes: the HEAD just now is the check.
                await remove(requests, bucket, key)
    except StorageConflictError:
        log.warning("object_delete_refused", bucket=bucket, key=key, reason="replaced")
        return False
    return True


async def delete_many(requests: Requests, bucket: str, keys: list[str]) -> None:
    """Remove objects, `BATCH` keys a request (DeleteObjects); absent ones count as removed.

    Raises:
        StorageUnavailableError, StorageAuthError: as for any request; or the store refused
            some keys (the first one's error, naming how many).
    """
    for i in range(0, len(keys), BATCH):
        batch = keys[i : i + BATCH]
        one = functools.partial(_delete_objects, requests, bucket, batch)
        reply = await requests(batch[0], one)
        errors = [e for e in reply.get("Errors", []) if e.get("Code") != "NoSuchKey"]
        if errors:
            first = errors[0]
            raise StorageUnavailableError(
                f"s3://{bucket}/{first.get('Key')}: {first.get('Code')}: "
                f"{first.get('Message')} ({len(errors)} of {len(batch)} keys not removed)"
            )


async def _delete_objects(requests: Requests, bucket: str, keys: list[str]) -> DeletedObjects:
    """One DeleteObjects request."""
    return await requests.client.delete_objects(
        Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True}
    )
