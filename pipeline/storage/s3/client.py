"""The S3 client as tierpipe uses it: a `Protocol` of the aiobotocore client's methods that the
store calls, with their keyword parameters as sent and their replies as `TypedDict`s.

aiobotocore is untyped; `S3Store` holds its client as an `S3Client`, so mypy checks every request
and every field read from a reply. Only the parameters and reply fields tierpipe uses are named
(a reply carries more). Parameter names are the S3 API's (`Bucket`, `Key`, ...), as botocore
takes them.
"""

from __future__ import annotations

from collections.abc import AsyncIterable
from datetime import datetime
from types import TracebackType
from typing import Literal, NotRequired, Protocol, TypedDict, TypeVar, overload

__all__ = (
    "CompletedPart",
    "CompletedParts",
    "CompletedUpload",
    "Condition",
    "CreatedUpload",
    "DeleteError",
    "DeleteRequest",
    "DeletedObjects",
    "GotObject",
    "ObjectHead",
    "ObjectKey",
    "ObjectSummary",
    "ObjectsPage",
    "Paginator",
    "ReadBody",
    "S3Client",
    "StreamingBody",
    "UploadInfo",
    "UploadedPart",
    "UploadsPage",
)

_Page_co = TypeVar("_Page_co", covariant=True)


class Condition(TypedDict, total=False):
    """A conditional write's precondition: write-once (`IfNoneMatch="*"`) or replace only the
    object with this ETag (`IfMatch`)."""

    IfMatch: str
    IfNoneMatch: str


class ObjectHead(TypedDict):
    """A HeadObject reply (with `ChecksumMode="ENABLED"`)."""

    ContentLength: int
    ETag: str
    LastModified: datetime
    #: The object's user metadata (`tp-header-digest`, `tp-node`, `tp-epoch`).
    Metadata: NotRequired[dict[str, str]]
    #: Of a multipart object: the composite checksum, `<base64>-<part count>`.
    ChecksumCRC32C: NotRequired[str]


class CreatedUpload(TypedDict):
    """A CreateMultipartUpload reply."""

    UploadId: str


class UploadedPart(TypedDict):
    """An UploadPart reply."""

    ETag: str
    ChecksumCRC32C: NotRequired[str]


class CompletedPart(TypedDict):
    """One part as CompleteMultipartUpload names it."""

    PartNumber: int
    ETag: str
    ChecksumCRC32C: str


class CompletedParts(TypedDict):
    """CompleteMultipartUpload's `MultipartUpload`."""

    Parts: list[CompletedPart]


class CompletedUpload(TypedDict, total=False):
    """A CompleteMultipartUpload reply."""

    ETag: str


class ReadBody(Protocol):
    """An object's body once entered: read whole."""

    async def read(self) -> bytes: ...


class StreamingBody(Protocol):
    """A GetObject reply's body: read in chunks, or entered and read whole."""

    def iter_chunks(self, chunk_size: int = ...) -> AsyncIterable[bytes]: ...

    async def __aenter__(self) -> ReadBody: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None: ...


class GotObject(TypedDict):
    """A GetObject reply."""

    Body: StreamingBody
    ETag: NotRequired[str]


class ObjectKey(TypedDict):
    """One key as DeleteObjects names it."""

    Key: str


class DeleteRequest(TypedDict):
    """DeleteObjects' `Delete`."""

    Objects: list[ObjectKey]
    Quiet: bool


class DeleteError(TypedDict, total=False):
    """A key DeleteObjects did not remove."""

    Key: str
    Code: str
    Message: str


class DeletedObjects(TypedDict, total=False):
    """A DeleteObjects reply (quiet: only the errors)."""

    Errors: list[DeleteError]


class ObjectSummary(TypedDict):
    """An object in a ListObjectsV2 page."""

    Key: str
    Size: int


class ObjectsPage(TypedDict, total=False):
    """One ListObjectsV2 page."""

    Contents: list[ObjectSummary]


class UploadInfo(TypedDict):
    """A multipart upload in progress, in a ListMultipartUploads page."""

    Key: str
    UploadId: str
    Initiated: NotRequired[datetime]


class UploadsPage(TypedDict, total=False):
    """One ListMultipartUploads page."""

    Uploads: list[UploadInfo]


class Paginator(Protocol[_Page_co]):
    """A botocore paginator: the pages of a listing, requested as they are iterated."""

    def paginate(self, *, Bucket: str, Prefix: str) -> AsyncIterable[_Page_co]: ...


class S3Client(Protocol):
    """The aiobotocore S3 client's methods that tierpipe calls (`session.client("s3")`)."""

    async def head_bucket(self, *, Bucket: str) -> object: ...

    async def head_object(
        self, *, Bucket: str, Key: str, ChecksumMode: str = ...
    ) -> ObjectHead: ...

    async def get_object(self, *, Bucket: str, Key: str, Range: str = ...) -> GotObject: ...

    async def put_object(
        self,
        *,
        Bucket: str,
        Key: str,
        Body: bytes,
        Metadata: dict[str, str] = ...,
        ChecksumAlgorithm: str = ...,
        ContentType: str = ...,
        IfMatch: str = ...,
        IfNoneMatch: str = ...,
    ) -> object: ...

    async def delete_object(self, *, Bucket: str, Key: str, IfMatch: str = ...) -> object: ...

    async def delete_objects(self, *, Bucket: str, Delete: DeleteRequest) -> DeletedObjects: ...

    async def create_multipart_upload(
        self, *, Bucket: str, Key: str, ChecksumAlgorithm: str, Metadata: dict[str, str]
    ) -> CreatedUpload: ...

    async def upload_part(
        self,
        *,
        Bucket: str,
        Key: str,
        UploadId: str,
        PartNumber: int,
        Body: object,
        ContentLength: int,
        ChecksumCRC32C: str,
    ) -> UploadedPart: ...

    async def complete_multipart_upload(
        self,
        *,
        Bucket: str,
        Key: str,
        UploadId: str,
        MultipartUpload: CompletedParts,
        IfMatch: str = ...,
        IfNoneMatch: str = ...,
    ) -> CompletedUpload: ...

    async def abort_multipart_upload(self, *, Bucket: str, Key: str, UploadId: str) -> object: ...

    @overload
    def get_paginator(
        self, operation_name: Literal["list_objects_v2"]
    ) -> Paginator[ObjectsPage]: ...

    @overload
    def get_paginator(
        self, operation_name: Literal["list_multipart_uploads"]
    ) -> Paginator[UploadsPage]: ...
