"""`tierpipe import --from dcp`: a job started from an existing torch.distributed.checkpoint.

The DCP checkpoint is read whole in this process (`tierpipe.interop.dcp.read_dcp`: its
`.metadata` through an allow-list, every value with `torch.load(weights_only=True)`, every
sharded tensor assembled into its full tensor) and saved as one step of the job through the
normal pipeline: a `Checkpointer` per rank of `world_size` (1 by default) saves the full state
and waits until this node's agent has verified it on NVMe; its flush to object storage then
goes on in the agent, as for any save (`tierpipe status --job J` shows it). A trainer of the
job restores the step as usual: at world 1 as saved; into DTensor targets, each rank reads its
part of every full tensor (a resharded restore); with `world_size` N, each of N ranks holds the
full state, for a job that restores plain (replicated, e.g. DDP) state on N ranks as saved.

The state comes back nested as DCP recorded it (`planner_data`): DCP turns every dict key into
a string when it flattens a state (`optim.state.0.exp_avg`), so an optimizer's state saved with
int keys comes back keyed "0", "1", ...; load it as DCP's users do, with torch's
`set_optimizer_state_dict`, or map the keys back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import anyio
import structlog
import torch

from tierpipe.bus.client import Bus
from tierpipe.control.advert import HINT, read_node
from tierpipe.control.folded import folded_head
from tierpipe.control.kvstate import JobStore
from tierpipe.errors import ConfigError, UnavailableError
from tierpipe.interop.dcp import METADATA_NAME, read_dcp, read_metadata
from tierpipe.interop.merge import leaves
from tierpipe.names import job_subjects, node_name
from tierpipe.settings import Settings

__all__ = ("Imported", "import_dcp")

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Imported:
    """What an import saved."""

    job: str
    step: int
    world_size: int
    tensors: int
    nbytes: int
    seconds: float


def import_dcp(
    settings: Settings,
    folder: Path,
    job: str,
    *,
    step: int | None = None,
    world_size: int = 1,
    timeout_s: float = 600.0,
) -> Imported:
    """Save the DCP checkpoint in `folder` as step `step` of `job` (default 0), verified on
    this node's NVMe.

    Raises:
        ConfigError: `folder` is no DCP checkpoint; the job already has a step at or after
            `step`; no node agent serves this node.
        ShardFormatError: the checkpoint is damaged or holds a value that needs code to load.
        UnavailableError: the node agent did not verify the step within `timeout_s`.
    """
    from tierpipe.trainer.checkpointer import Checkpointer

    t0 = time.perf_counter()
    if world_size < 1:
        raise ConfigError(f"--world must be at least 1 (got {world_size})")
    if not folder.is_dir():
        raise ConfigError(f"{folder}: no such directory")
    if not (folder / METADATA_NAME).is_file():
        raise ConfigError(f"{folder}: not a DCP checkpoint (no {METADATA_NAME} in it)")
    read_metadata(folder)  # (a hostile or damaged one refused before anything else)
    chosen = anyio.run(_target, settings, job, step)
    state = read_dcp(folder)
    tensors = [v for _, v in leaves(state) if isinstance(v, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    log.info("dcp_read", job=job, step=chosen, path=str(folder), tensors=len(tensors),
             nbytes=nbytes)  # fmt: skip
    for rank in range(world_size):
        with Checkpointer(job, rank=rank, world_size=world_size, settings=settings) as ckpt:
            handle = ckpt.save(chosen, state)
            try:
                handle.wait("verified", timeout=timeout_s)
            except TimeoutError:
                raise UnavailableError(
                    f"rank {rank} of step {chosen} of {job} not verified on NVMe within "
                    f"{timeout_s:g} s (is this node's agent running? {HINT})"
                ) from None
    log.info("dcp_imported", job=job, step=chosen, world_size=world_size)
    return Imported(job, chosen, world_size, len(tensors), nbytes, time.perf_counter() - t0)


async def _target(settings: Settings, job: str, step: int | None) -> int:
    """The step to save: `step`, or 0 for a new job; refused if the job already has it or a
    newer one, or if no agent serves this node (nothing would write the step)."""
    async with Bus(settings, name="tierpipe-cli") as bus:
        node = node_name(settings.node)
        why = (await read_node(bus, settings, node)).absent()
        if why:
            raise ConfigError(f"{why}: nothing would write the imported step ({HINT})")
        store = await JobStore.opened(bus)
        newest = None
        if await store.head(job) is not None or await bus.newest_seq(job_subjects(job)) > 0:
            head, _ = await folded_head(bus, store, job)
            newest = max([*head.steps, *head.nvme_steps, *head.s3_steps], default=None)
    if newest is not None and (step is None or step <= newest):
        raise ConfigError(
            f"job {job!r} already has steps up to {newest}: import as a newer step "
            f"(--step {newest + 1} or more), or into a new job"
        )
    return 0 if step is None else step
