"""Multipart uploads in progress: the earlier attempts at a key, and this node's orphans.

An upload aborts the unfinished attempts at its own key before it starts (a killed or failed
uploader's), and the flush stage aborts at start the uploads this node left anywhere under the
prefix (and any too old to be anyone's live upload), so none keeps its parts forever. A failed
abort is logged, never raised: the next attempt or start tries again.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

import structlog

from tierpipe.errors import TierpipeError
from tierpipe.storage.s3.client import UploadInfo
from tierpipe.storage.s3.errors import NotFound
from tierpipe.storage.s3.retry import Requests

__all__ = ("abort", "abort_earlier", "abort_orphans", "list_uploads")

log = structlog.get_logger(__name__)


async def list_uploads(requests: Requests, bucket: str, prefix: str) -> list[UploadInfo]:
    """In-progress multipart uploads under `prefix`."""

    async def listing() -> list[UploadInfo]:
        uploads: list[UploadInfo] = []
        paginator = requests.client.get_paginator("list_multipart_uploads")
        async for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
            uploads += page.get("Uploads", [])
        return uploads

    return await requests(prefix, listing)


async def abort_earlier(requests: Requests, bucket: str, key: str) -> None:
    """Abort earlier attempts at this very key (a killed or failed uploader's)."""
    for upload in await list_uploads(requests, bucket, key):
        if upload["Key"] == key:
            await abort(requests, bucket, key, upload["UploadId"])


async def abort_orphans(
    requests: Requests,
    bucket: str,
    prefix: str,
    owned: Callable[[str], bool],
    *,
    max_age_s: float,
) -> int:
    """Abort multipart uploads under `prefix` that this node owns (`owned(key)`), or that are
    older than `max_age_s` whoever started them. Returns how many were aborted."""
    now = datetime.now(UTC)
    aborted = 0
    for upload in await list_uploads(requests, bucket, prefix):
        started = upload.get("Initiated")
        old = started is not None and (now - started).total_seconds() > max_age_s
        if owned(upload["Key"]) or old:
            await abort(requests, bucket, upload["Key"], upload["UploadId"])
            aborted += 1
    if aborted:
        log.info("orphan_uploads_aborted", count=aborted, bucket=bucket)
    return aborted


async def abort(requests: Requests, bucket: str, key: str, upload_id: str) -> None:
    """Abort one multipart upload; a failure is logged, not raised."""
    try:
        await requests(
            key,
            lambda: requests.client.abort_multipart_upload(
                Bucket=bucket, Key=key, UploadId=upload_id
            ),
        )
    except (NotFound, TierpipeError) as e:
        log.warning("upload_abort_failed", key=key, error=str(e))
