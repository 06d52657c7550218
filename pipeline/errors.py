"""The one error tree of tierpipe.

`TierpipeError` is the root. Stages and the runner decide what to do by branch:
`RetryableError` (nak with growing delay) or `PermanentError` (terminate and report). Leaves carry
typed fields and build their message once. Third-party exceptions are translated at the
boundary (bus, storage) and kept as `__cause__`.
"""

from __future__ import annotations

__all__ = (
    "EVIDENCE_ERRORS",
    "AgentLockedError",
    "BucketMissingError",
    "BusAuthError",
    "BusError",
    "BusUnavailableError",
    "ConfigError",
    "DuplicateEventError",
    "IntegrityError",
    "InvalidNameError",
    "JobBusyError",
    "JobStateMissingError",
    "LayoutMismatchError",
    "LeaseLostError",
    "MissingCredentialError",
    "NoCheckpointError",
    "NoSpaceError",
    "PeerAuthError",
    "PeerUnavailableError",
    "PermanentError",
    "ResourceExhaustedError",
    "RestoreTimeoutError",
    "RetryableError",
    "ShardFailedError",
    "ShardFormatError",
    "ShardMissingError",
    "SlotTimeoutError",
    "SourceUnreachableError",
    "StagingGoneError",
    "StaleStepError",
    "StorageAuthError",
    "StorageConflictError",
    "StorageUnavailableError",
    "StorageUnsupportedError",
    "StoreMismatchError",
    "TierpipeError",
    "UnavailableError",
    "UnsupportedStateError",
    "WorldSizeMismatchError",
    "leaves",
)

#: Error classes that prove a copy bad (as opposed to unreachable, missing or refused): only
#: these mark a copy corrupt (the job state, a restore's loader).
EVIDENCE_ERRORS = frozenset({"IntegrityError", "ShardFormatError"})


class TierpipeError(Exception):
    """Root of every error tierpipe raises on purpose."""


class RetryableError(TierpipeError):
    """A failure that may go away by itself (outage, full disk): retry with growing delay."""

    #: The most the next try should wait, where the raiser knows when it may succeed (None: the
    #: runner's growing delay alone; e.g. a partner missing from a job's ring is looked for again
    #: at its next heartbeat, not after minutes).
    retry_after_s: float | None = None


class PermanentError(TierpipeError):
    """A failure that retrying cannot fix (bad input, corrupt data, bad configuration)."""


class UnavailableError(RetryableError):
    """A service tierpipe depends on (NATS, the object store) is down or not answering.

    Stages retry these with capped backoff for as long as the outage lasts, never giving up:
    "unreachable" is not "corrupt" and not "failed".
    """


class ResourceExhaustedError(UnavailableError):
    """This process ran out of a resource (memory, memory mappings, file descriptors, threads)
    while moving a copy's bytes: the attempt fails and is retried like an outage, and the copy
    is never judged by it (only a digest or identity mismatch is evidence of a bad copy)."""

    def __init__(self, where: str, resource: str) -> None:
        self.where = where
        self.resource = resource
        super().__init__(
            f"{where}: ran out of {resource}; not a sign of a bad copy, nothing was marked: "
            "free some (or raise the limit) and try again"
        )


class ConfigError(PermanentError, ValueError):
    """Settings or arguments are invalid."""


class InvalidNameError(ConfigError):
    """A job or node name is not a safe subject token and path part."""

    def __init__(self, what: str, value: object, *, reserved: bool = False) -> None:
        self.what = what
        self.value = value
        if reserved:
            super().__init__(f"{what} name {value!r} is reserved (control subjects use it)")
        else:
            super().__init__(f"{what} name must match [A-Za-z0-9_-]{{1,64}} (got {value!r})")


class UnsupportedStateError(PermanentError, TypeError):
    """The state to save holds a value tierpipe cannot store without pickle."""

    def __init__(self, path: tuple[str | int, ...], reason: str) -> None:
        self.path = path
        self.reason = reason
        where = "/".join(map(str, path)) or "<root>"
        super().__init__(f"cannot checkpoint state at {where!r}: {reason}")


class ShardFormatError(PermanentError):
    """A shard file (or staging image) is truncated, garbled or not a shard at all."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"bad shard file {path}: {reason}")


class IntegrityError(PermanentError):
    """Bytes read back do not match their recorded digest."""

    def __init__(self, path: str, what: str, expected: str, actual: str) -> None:
        self.path = path
        self.what = what
        self.expected = expected
        self.actual = actual
        super().__init__(f"digest mismatch in {path} ({what}): expected {expected}, got {actual}")


class ShardMissingError(PermanentError):
    """A copy is not where the catalog says (a file or an object that is gone): not corrupt,
    just unusable; the reader moves to its next source."""

    def __init__(self, location: str, reason: str = "does not exist") -> None:
        self.location = location
        self.reason = reason
        super().__init__(f"{location}: {reason}")


class StagingGoneError(PermanentError):
    """The staging copy an event refers to no longer holds that shard."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"staging copy {path} is gone: {reason}")


class NoSpaceError(RetryableError):
    """The target filesystem cannot take the shard (checked before any byte is written)."""

    def __init__(self, path: str, needed: int, free: int, reserve: int) -> None:
        self.path = path
        self.needed = needed
        self.free = free
        self.reserve = reserve
        super().__init__(
            f"no room for {needed} bytes under {path}: {free} bytes free, {reserve} bytes reserved"
        )


class SlotTimeoutError(TierpipeError, TimeoutError):
    """No staging slot became free in time (policy `wait`)."""

    def __init__(
        self, job: str, rank: int, timeout_s: float, busy: list[int], *, why: str = ""
    ) -> None:
        self.job = job
        self.rank = rank
        self.timeout_s = timeout_s
        self.busy = busy
        #: Why the slots stay busy, as far as the trainer could see ("": not known).
        self.why = why
        super().__init__(
            f"no free staging slot for job {job!r} rank {rank} within {timeout_s:g} s "
            f"(slots hold unreleased steps {busy}): "
            + (why or "is this node's agent running (`tierpipe worker all`)?")
        )


class ShardFailedError(TierpipeError):
    """A stage reported a permanent failure for a shard this process saved."""

    def __init__(self, stage: str, error: str, message: str) -> None:
        self.stage = stage
        self.error = error
        self.message = message
        super().__init__(f"{stage} failed permanently: {error}: {message}")


class StorageUnavailableError(UnavailableError):
    """The object store is down, slow or failing (5xx, timeouts, refused connections)."""


class PeerUnavailableError(RetryableError):
    """A node's peer endpoint did not answer, or could not take or serve a copy now (its NVMe
    full, its source unreachable): tried again later, or another copy is read."""

    def __init__(self, url: str, reason: str) -> None:
        self.url, self.reason = url, reason
        super().__init__(f"peer endpoint {url}: {reason}")


class PeerAuthError(PermanentError):
    """A node's peer endpoint refused the request: the agents' `peer_token` settings differ."""

    def __init__(self, url: str) -> None:
        self.url = url
        super().__init__(
            f"peer endpoint {url} refused the token (set the same peer_token on every agent)"
        )


class AgentLockedError(ConfigError):
    """Another agent process already serves this stage of this node (one agent per node)."""

    def __init__(self, path: str, holder: str) -> None:
        self.path = path
        self.holder = holder
        super().__init__(
            f"another agent already holds {path} ({holder}); one agent per node name: stop it "
            "or give this one another `node` / `nvme_root`"
        )


class StaleStepError(ConfigError):
    """A save would go back in a job's history without saying so (a run restarted from scratch
    under the same job name): restore first, or pass `overwrite=True`."""

    def __init__(self, job: str, rank: int, step: int, newest: int) -> None:
        self.job = job
        self.rank = rank
        self.step = step
        self.newest = newest
        super().__init__(
            f"job {job!r} rank {rank} already saved step {newest}; saving step {step} from a "
            "process that did not restore would be shadowed by it. Call restore() first, use a "
            "new job name, or pass Checkpointer(..., overwrite=True) to supersede every step "
            f"from {step} on"
        )


class StorageAuthError(PermanentError):
    """The object store refused the request: credentials, permissions or a missing bucket."""


class MissingCredentialError(StorageAuthError):
    """No credential for the object store was found anywhere (a configuration gap, not an
    outage: the store was never asked)."""

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(
            f"missing credential for the object store ({detail}): set s3_access_key_id and "
            "s3_secret_access_key (TIERPIPE_S3_ACCESS_KEY_ID / TIERPIPE_S3_SECRET_ACCESS_KEY, "
            "which `tierpipe up` writes to .tierpipe/env), AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY, a profile or an instance role"
        )


class StorageUnsupportedError(StorageAuthError):
    """The object store does not implement a request tierpipe relies on (a conditional write)."""

    def __init__(self, key: str, detail: str) -> None:
        self.key = key
        self.detail = detail
        super().__init__(
            f"the object store does not support a request on {key} ({detail}); tierpipe needs "
            "conditional writes (If-None-Match / If-Match) on complete and delete"
        )


class StorageConflictError(PermanentError):
    """A write-once key already holds different content."""

    def __init__(self, location: str, reason: str) -> None:
        self.location = location
        self.reason = reason
        super().__init__(f"{location}: {reason}")


class BusError(TierpipeError):
    """A NATS/JetStream request was refused (bad stream config, API error)."""


class BusUnavailableError(UnavailableError):
    """NATS could not be reached or did not answer in time."""


class BucketMissingError(BusUnavailableError):
    """No server answered a read of the KV bucket `bucket`: it does not exist (or none of its
    servers is up)."""

    def __init__(self, bucket: str, what: str) -> None:
        self.bucket = bucket
        self.what = what
        super().__init__(f"{what}: no server answers for KV bucket {bucket!r} (is it made?)")


class BusAuthError(BusError, PermanentError):
    """A NATS server refused this client: credentials, permissions, or the TLS handshake.
    Retrying with the same settings cannot help."""

    def __init__(self, url: str, reason: str) -> None:
        self.url = url
        self.reason = reason
        super().__init__(f"NATS at {url} refused this client: {reason}")


# --- restoring


class NoCheckpointError(TierpipeError):
    """No step of the job can be restored with the surviving copies (the message says why,
    step by step; on ranks other than 0 it is rank 0's, prefixed `rank 0:`)."""


class WorldSizeMismatchError(ConfigError):
    """The checkpoint was saved with another world size (resharding is not supported)."""


class LayoutMismatchError(ConfigError):
    """A saved tensor cannot be loaded into its target: another global shape or dtype, a
    target that is sharded where the saved value is not (or the reverse), or a layout no
    resharding rule covers (the message names the key path and both layouts)."""


class RestoreTimeoutError(TierpipeError, TimeoutError):
    """The ranks of a restart did not all show up (or rank 0 never planned) in time."""

    def __init__(self, job: str, restart: str, timeout_s: float, waiting_for: str) -> None:
        self.job = job
        self.restart = restart
        self.timeout_s = timeout_s
        self.waiting_for = waiting_for
        super().__init__(
            f"restore of job {job!r} (restart {restart!r}) timed out after {timeout_s:g} s: "
            f"{waiting_for}"
        )


class SourceUnreachableError(UnavailableError):
    """A copy did not answer within the restore's deadline: skipped for this restore only (not
    corrupt), so the next restore tries it again."""

    def __init__(self, location: str) -> None:
        self.location = location
        super().__init__(f"{location}: no answer within this restore's deadline")


class LeaseLostError(BusError):
    """This agent no longer coordinates the job: another agent took its lease over (this one
    was paused past the lease's expiry, or cut off), and wrote `key` since."""

    def __init__(self, job: str, key: str) -> None:
        self.job = job
        self.key = key
        super().__init__(f"lost the coordinator lease of job {job!r} ({key} changed under it)")


# --- the job's object store


class StoreMismatchError(ConfigError):
    """This agent's object store is not the one the job's objects are bound to (the job's
    `<job>.location` in KV): it writes and deletes none of them. Both locations are named
    (bucket, prefix, endpoint; never a credential)."""

    def __init__(self, job: str, bound: str, here: str) -> None:
        self.job = job
        self.bound = bound
        self.here = here
        super().__init__(
            f"job {job!r} keeps its objects in {bound}, but this agent's object store is {here} "
            "(settings s3_endpoint, s3_bucket, s3_prefix): it writes and deletes none of the "
            "job's objects"
        )


# --- retention and removal


class DuplicateEventError(PermanentError):
    """The server dropped an event as a duplicate of an earlier one with the same message id
    (within its duplicate window), where nothing else will report it: a stage downstream would
    never see that copy, so the save (or repair) fails for good and its staging slot goes back."""

    def __init__(self, kind: str, msg_id: str) -> None:
        self.kind = kind
        self.msg_id = msg_id
        super().__init__(
            f"the server dropped this {kind} event ({msg_id}) as a duplicate of an earlier one "
            "within its duplicate window: nothing downstream would see it"
        )


class JobStateMissingError(ConfigError):
    """The job has no state in KV (lost, never written, or a name nothing knows): nothing is
    removed on its say, and nothing read from it can be shown (`tierpipe` exits 1)."""

    def __init__(self, job: str, detail: str = "") -> None:
        self.job, self.detail = job, detail  # (detail: what the reader found instead)
        super().__init__(
            detail
            or f"job {job!r} has no state in KV (lost, or never written): nothing is "
            f"removed without it; `tierpipe reindex --job {job}` rebuilds it from the shards"
        )


class JobBusyError(ConfigError):
    """A job is still in use (its coordinator's lease is live, or it had events lately): it is
    not deleted unless forced."""

    def __init__(self, job: str, reasons: list[str]) -> None:
        self.job = job
        self.reasons = reasons
        super().__init__(
            f"job {job!r} looks in use ({'; '.join(reasons)}): not deleted (--force deletes "
            "it anyway)"
        )


def leaves(group: BaseExceptionGroup) -> list[BaseException]:
    """The exceptions of a (nested) exception group, in order."""
    found: list[BaseException] = []
    stack: list[BaseException] = [group]
    while stack:
        e = stack.pop()
        if isinstance(e, BaseExceptionGroup):
            stack.extend(reversed(e.exceptions))
        else:
            found.append(e)
    return found
