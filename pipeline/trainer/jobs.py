"""A trainer's job: made by its first save, never by a look; a name without state met with the
names of similar jobs.

A `Checkpointer` connects and listens when it opens, and creates nothing: the job's stream, its
retention policy in KV (which makes the coordinators take it up) and its staging folder (which
makes the node's agent serve it) come with the first save (`open_job`, and the staging slots).
`latest_step()` and `restore()` of a job that has no state (`has_state`: no policy or head
in KV, no event in its stream) create nothing either; they name the jobs whose names are close
(`similar_jobs`), since a typo in a job name would otherwise start training from scratch
without a word. Also here:
what counts as a step (`as_step`), and a rank's place among its node's (`local_group`).
"""

from __future__ import annotations

import difflib
import operator
import os
import time

import structlog

from tierpipe.bus.client import Bus
from tierpipe.control.confirm import confirmed_list
from tierpipe.control.kvstate import JobStore
from tierpipe.errors import ConfigError, TierpipeError
from tierpipe.names import local_jobs
from tierpipe.recovery.survey import current_head, own_events
from tierpipe.schemas.jobstate import Keep
from tierpipe.settings import Settings

__all__ = (
    "as_step",
    "complete_steps",
    "has_state",
    "known_job",
    "local_group",
    "no_state",
    "open_job",
    "similar_jobs",
    "unknown_job",
)

log = structlog.get_logger(__name__)


def as_step(step: object) -> int:
    """`step` as an int: any integral number (int, a numpy integer, a 0-dim torch integer
    tensor), never a bool (JSON would carry `true`, which no agent takes as a step).

    Raises:
        ValueError: a bool, a negative number, or no integer at all.
    """
    if isinstance(step, bool) or str(getattr(step, "dtype", "")) in ("bool", "torch.bool"):
        raise ValueError(f"step must be a non-negative integer, not a bool (got {step!r})")
    try:
        if getattr(step, "ndim", 0) != 0:
            raise TypeError("not a scalar")
        value = operator.index(step)  # type: ignore[arg-type]
    except (TypeError, RuntimeError):
        value = -1
    if value < 0:
        raise ValueError(f"step must be a non-negative integer (got {step!r})")
    return value


async def open_job(bus: Bus, store: JobStore, *, job: str, rank: int, keep: Keep | None) -> None:
    """Make the job, on its first save: its stream, and (rank 0) its retention policy, which
    makes the coordinators take it up. The other ranks make no JetStream API request (tens of
    thousands would overflow the server's queue): their first read that finds no stream
    makes it."""
    if rank == 0:
        await bus.ensure_stream(job, update=False)
        await store.open()
        await store.register(job, keep)
    else:
        bus.ensure_stream_on_first_miss()


async def has_state(bus: Bus, store: JobStore, job: str) -> bool:
    """Whether `job` has state: in KV, a retention policy (its rank 0 saved) or a head (its
    coordinator folded a save), two direct gets; else events in its stream (a job state not
    folded yet, or a KV bucket lost: the stream is folded again, never taken for a new job),
    one JetStream API request, made only when KV has nothing of the job."""
    if await store.keep(job) is not None or await store.head(job) is not None:
        return True
    made = await bus.stream_made(job)
    return made is not None and made[1] > 0


async def similar_jobs(
    store: JobStore, settings: Settings, job: str, *, ask_kv: bool
) -> tuple[list[str], int]:
    """The names of other jobs close to `job`, closest first, and how many jobs were looked
    at: the jobs with a folder under this node's staging or NVMe root and (`ask_kv`, one rank
    of a job: it reads every job's head) the jobs in KV."""
    names = local_jobs(settings.staging_root, settings.nvme_root)
    if ask_kv:
        try:
            names |= set(await store.heads())
        except TierpipeError as e:  # (the local names still answer)
            log.debug("job_heads_unread", error=str(e))
    names.discard(job)
    return difflib.get_close_matches(job, sorted(names), n=5, cutoff=0.6), len(names)


def no_state(job: str, similar: list[str]) -> str:
    """What to say of a job without state (`similar`: close names)."""
    text = f"job {job!r} has no saved state: no checkpoint was ever saved under this name"
    if similar:
        text += f"; jobs with similar names: {', '.join(similar)} (a typo in the job name?)"
    return text


async def known_job(bus: Bus, store: JobStore, job: str) -> bool:
    """Whether `job` has state (`has_state`); then its stream exists, or the first read that
    misses it makes it, as the agent's settings would."""
    if not await has_state(bus, store, job):
        return False
    bus.ensure_stream_on_first_miss()
    return True


async def unknown_job(store: JobStore, settings: Settings, job: str, *, rank: int) -> str:
    """What to say of `job`, which has no state: logged as `job_unknown` (a warning where jobs
    of similar names exist; rank 0 asks KV too) and returned."""
    similar, seen = await similar_jobs(store, settings, job, ask_kv=rank == 0)
    text = no_state(job, similar)
    say = log.warning if similar else log.info
    say("job_unknown", job=job, rank=rank, nearest=similar, jobs_seen=seen, message=text)
    return text


async def complete_steps(
    bus: Bus, store: JobStore, settings: Settings, *, job: str, node: str, rank: int
) -> list[int]:
    """The job's steps complete on NVMe or in object storage and still kept, ascending, from
    its state in KV once it folded this rank's newest events; [] for a job without state
    (`unknown_job` says so)."""
    if not await known_job(bus, store, job):
        await unknown_job(store, settings, job, rank=rank)
        return []
    head = await current_head(
        bus,
        store,
        settings,
        job=job,
        holder=f"{node}-rank-{rank}",
        deadline=time.monotonic() + settings.lease_ttl_s + 5,
        own=own_events(job, node, rank),
        ranks=[rank],
    )
    return await confirmed_list(store, job, head, rank=rank)  # (a forged head is not believed)


def local_group(
    rank: int, world_size: int, local_rank: int | None, local_world_size: int | None
) -> tuple[int, int]:
    """(local rank, local world size): as given, else from torchrun's environment where both
    are set and fit the world, else a node of its own (0, 1).

    Raises:
        ConfigError: the given values do not fit the world.
    """
    if local_rank is None and local_world_size is None:
        env_rank, env_size = os.environ.get("LOCAL_RANK"), os.environ.get("LOCAL_WORLD_SIZE")
        if env_rank is None or env_size is None:
            return 0, 1
        local_rank, local_world_size = int(env_rank), int(env_size)
        if not _fits(rank, world_size, local_rank, local_world_size):
            log.warning("local_group_ignored", rank=rank, world_size=world_size,
                        local_rank=local_rank, local_world_size=local_world_size)  # fmt: skip
            return 0, 1
        return local_rank, local_world_size
    local_rank = 0 if local_rank is None else local_rank
    local_world_size = 1 if local_world_size is None else local_world_size
    if not _fits(rank, world_size, local_rank, local_world_size):
        raise ConfigError(
            f"local rank {local_rank} of {local_world_size} does not fit rank {rank} of "
            f"world size {world_size}"
        )
    return local_rank, local_world_size


def _fits(rank: int, world_size: int, local_rank: int, local_world_size: int) -> bool:
    first = rank - local_rank
    return 0 <= local_rank < local_world_size and 0 <= first <= world_size - local_world_size
