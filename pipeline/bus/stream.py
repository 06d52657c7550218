"""A job's stream (`<stream>_<job>`, subjects `tp.<job>.>`): its configuration from the
settings, created or brought up to date in place (`Bus.ensure_stream`), and created again when a
publish finds it gone. Each job has its own stream, with its own age and size limits, so one
job's history never pushes out another's, and a cluster spreads the jobs' stream leaders over
its servers."""

from __future__ import annotations

import anyio
import nats.js.errors
import structlog
from nats.js import JetStreamContext, api

from tierpipe.bus.errors import translate
from tierpipe.errors import BusUnavailableError
from tierpipe.names import job_subjects, stream_name
from tierpipe.settings import Settings

__all__ = ("STREAM_FIELDS", "ensure_stream", "recreate_if_missing", "stream_config")

log = structlog.get_logger(__name__)


def stream_config(s: Settings, job: str) -> api.StreamConfig:
    """`job`'s stream as the settings want it."""
    return api.StreamConfig(
        name=stream_name(s.stream, job),
        description=f"tierpipe: the events of job {job} (the audit log; the stages' trigger)",
        subjects=[job_subjects(job)],
        retention=api.RetentionPolicy.LIMITS,
        storage=api.StorageType.FILE,
        discard=api.DiscardPolicy.OLD,
        # No per-subject cap: `evicted` subjects fill three times faster than `written`, so a
        # cap would drop a removal while the events that created the copy remain. Age and
        # size limits drop the oldest events first, keeping a suffix of the history.
        max_msgs_per_subject=-1,
        max_age=s.stream_max_age_s,
        max_bytes=s.stream_max_bytes,
        max_consumers=s.stream_max_consumers,
        duplicate_window=s.duplicate_window_s,
        num_replicas=s.stream_replicas,
        allow_direct=True,
        deny_delete=True,
    )


#: The stream settings compared to decide whether the stream needs an update.
STREAM_FIELDS = (
    "subjects",
    "max_msgs_per_subject",
    "max_age",
    "max_bytes",
    "max_consumers",
    "duplicate_window",
    "num_replicas",
    "allow_direct",
    "deny_delete",
    "discard",
    "description",
)


async def ensure_stream(
    js: JetStreamContext, s: Settings, job: str, *, update: bool = True
) -> None:
    """Create `job`'s stream, or update it if its settings changed (idempotent).

    Trainers pass `update=False`: they create a missing stream but leave the agent's alone.

    Raises:
        BusError: the server refused the config (e.g. a change it cannot apply in place).
    """
    name = stream_name(s.stream, job)
    want = stream_config(s, job)
    with translate(f"stream {name}"):
        try:
            info = await js.stream_info(name)
        except nats.js.errors.NotFoundError:
            await js.add_stream(want)
            log.info("stream_created", stream=name)
            return
        have = info.config
        if update and any(getattr(have, f) != getattr(want, f) for f in STREAM_FIELDS):
            await js.update_stream(want)
            log.info("stream_updated", stream=name)


async def recreate_if_missing(js: JetStreamContext, s: Settings, job: str, timeout: float) -> None:
    """Create `job`'s stream (with the settings at hand) if JetStream says it does not exist."""
    name = stream_name(s.stream, job)
    try:
        with anyio.fail_after(timeout):
            await js.stream_info(name)
    except nats.js.errors.NotFoundError:
        log.warning("publish_found_no_stream", stream=name)
        try:
            await ensure_stream(js, s, job, update=False)
        except BusUnavailableError as e:
            log.debug("stream_not_recreated", error=str(e))
    except Exception as e:  # unknown (an outage, an election): keep trying the publish
        log.debug("stream_check_failed", error=str(e) or type(e).__name__)
