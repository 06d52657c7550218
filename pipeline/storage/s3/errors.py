"""Where botocore's exceptions stop: the object store's failures in the project's error tree.

Every S3 call runs inside `translate_errors(key)`: a refusal of credentials or a missing bucket
is `StorageAuthError` (permanent), no credential at all its leaf `MissingCredentialError` (the
store was never asked: not an outage), a failed write-once condition `StorageConflictError`, a
request the store does not implement `StorageUnsupportedError`, an outage or timeout
`StorageUnavailableError` (retryable), each with botocore's exception kept as the cause; a
throttling reply (503 `SlowDown` and kin) is its subclass `Throttled`, which `retry` backs off
from. A missing object is `NotFound`, which the store turns into its own answer (None, False,
`ShardMissingError`) and which never leaves it. Concurrent part transfers fail as exception
groups; `first_error` and `download_error` pick the one error a caller sees.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import aiohttp
import anyio
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    NoCredentialsError,
    PartialCredentialsError,
)

from tierpipe.errors import (
    MissingCredentialError,
    ShardMissingError,
    StorageAuthError,
    StorageConflictError,
    StorageUnavailableError,
    StorageUnsupportedError,
    TierpipeError,
    leaves,
)
from tierpipe.storage.resources import resource_error

__all__ = ("NotFound", "Throttled", "download_error", "first_error", "translate_errors")

_AUTH_CODES = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AccessDenied",
    "InvalidToken",
    "ExpiredToken",
    "AuthorizationHeaderMalformed",
    "Forbidden",
    "403",
}
_CONFIG_CODES = {"NoSuchBucket", "InvalidBucketName", "PermanentRedirect"}
#: A store asking for fewer requests (S3: 503 SlowDown; a HEAD's error has no body, only "503").
_THROTTLE_CODES = {
    "SlowDown",
    "RequestLimitExceeded",
    "Throttling",
    "ThrottlingException",
    "TooManyRequestsException",
    "RequestThrottled",
    "503",
    "429",
}
_THROTTLE_STATUSES = {429, 503}


class NotFound(Exception):
    """No object (or multipart upload) at a key: the S3 store's private signal, never raised
    to its callers."""


class Throttled(StorageUnavailableError):
    """The store asked for fewer requests: `retry` backs off and lowers its concurrency;
    callers see it (as the outage it is) only once those retries ran out."""


@contextlib.asynccontextmanager
async def translate_errors(key: str) -> AsyncIterator[None]:
    """Translate botocore's exceptions into the project's error tree."""
    try:
        yield
    except ClientError as e:
        err = e.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        message = err.get("Message") or code
        if code in ("NoSuchKey", "NoSuchUpload", "404", "NotFound") or (
            status == 404 and code not in _CONFIG_CODES
        ):
            raise NotFound(key) from e
        if code in _AUTH_CODES or status == 403:
            raise StorageAuthError(
                f"object store refused the credentials ({code}): {message}"
            ) from e
        if code in ("PreconditionFailed", "412") or status == 412:
            raise StorageConflictError(key, "an object already exists at this key") from e
        if code in _CONFIG_CODES:
            raise StorageAuthError(f"{code}: {message} (check s3_bucket / s3_endpoint)") from e
        if code == "NotImplemented" or status == 501:  # not an outage: it will never work
            raise StorageUnsupportedError(key, f"{code or status}: {message}") from e
        if code in _THROTTLE_CODES or status in _THROTTLE_STATUSES:
            raise Throttled(f"object store throttled {key} ({code or status}): {message}") from e
        if status >= 500 or code in ("RequestTimeout", "BadDigest", "InternalError"):
            raise StorageUnavailableError(f"object store error on {key} ({code}): {message}") from e
        raise StorageAuthError(
            f"object store refused a request on {key} ({code}): {message}"
        ) from e
    except (NoCredentialsError, PartialCredentialsError) as e:
        raise MissingCredentialError(str(e)) from e  # (the store was never asked)
    except (BotoCoreError, OSError, TimeoutError, aiohttp.ClientError) as e:
        raise StorageUnavailableError(f"object store unreachable ({type(e).__name__}): {e}") from e


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The error that sank a group of part uploads (a project error if there is one)."""
    errors = leaves(group)
    return next((e for e in errors if isinstance(e, TierpipeError)), errors[0])


def download_error(group: BaseExceptionGroup, location: str) -> BaseException:
    """The one error a failed download raises: a missing object first, then the project's
    own errors, else the first cause as an outage; never a private class or a group."""
    errors = leaves(group)
    for kind in (ShardMissingError, TierpipeError):
        found = next((e for e in errors if isinstance(e, kind)), None)
        if found is not None:
            return found
    for leaf in errors:  # (e.g. no thread left for a worker: this process, not the store)
        if (short := resource_error(leaf, location)) is not None:
            return short
    first = errors[0]
    if not isinstance(first, Exception) or isinstance(first, anyio.get_cancelled_exc_class()):
        return first  # cancellation and interpreter exits pass through as they are
    return StorageUnavailableError(f"{location}: download failed ({type(first).__name__}: {first})")
