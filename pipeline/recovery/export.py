"""`tierpipe export`: one step of a job, rank by rank, in a format other tools load.

Each rank's shard is read from this node's NVMe copy when it is there and matches the header
digest the job state recorded, else from object storage; every digest is checked before a byte
is used (as a restore does). Then, per rank, into `<dir>`:

- `torch`: `rank-<r>-of-<w>.pt`, `torch.save` of the state (nested dicts and lists, tensors,
  plain values), loadable with `torch.load(path, weights_only=True)`.
- `safetensors`: `rank-<r>-of-<w>.safetensors`, the tensors under their dotted key paths
  (`model.0.weight`); the other values and the checkpoint's identity in its metadata as JSON
  (`tierpipe.values`, `tierpipe.checkpoint`). Tensors that shared storage are written apart.
- `dcp`: `rank-<r>-of-<w>/`, a torch.distributed.checkpoint directory of the rank's state
  dict (`dcp.load` into a state dict of the same shape).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import structlog
import torch

from tierpipe.control.bitmap import has_rank
from tierpipe.control.kvstate import JobStore
from tierpipe.errors import ConfigError, NoCheckpointError
from tierpipe.names import shard_relpath
from tierpipe.recovery.load import Expected, load_image, load_into
from tierpipe.settings import Settings
from tierpipe.storage.reader import image_head
from tierpipe.storage.s3.store import S3Store

__all__ = ("FORMATS", "export_step", "read_rank", "write_rank")

log = structlog.get_logger(__name__)

FORMATS = ("torch", "safetensors", "dcp")


async def export_step(
    settings: Settings, store: JobStore, job: str, step: int, fmt: str, out: Path
) -> list[Path]:
    """Write every rank of `step` to `out` as `fmt`; the paths written, in rank order.

    Raises:
        NoCheckpointError: the step has no record, or a rank has no copy this node can read.
        ConfigError: an unknown format.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"unknown format {fmt!r} (one of {', '.join(FORMATS)})")
    rec = await store.record(job, step)
    if rec is None:
        head = await store.head(job)
        kept = ", ".join(map(str, head.steps)) if head else "none"
        raise NoCheckpointError(f"step {step} of job {job!r} has no record (kept: {kept})")
    await anyio.Path(out).mkdir(parents=True, exist_ok=True)
    written = []
    async with S3Store(settings) as s3:
        for rank in range(rec.world_size):
            found = await store.rank_digest(job, step, rank)
            if found is None:
                raise NoCheckpointError(f"rank {rank} of step {step} has no verified copy")
            expected = Expected(job, step, rank, rec.world_size, found[0])
            in_s3 = has_rank(rec.s3, rank) and not rec.s3_removed
            state = await read_rank(settings, s3 if in_s3 else None, expected, found[1])
            written.append(await anyio.to_thread.run_sync(write_rank, fmt, state, out, expected))
            log.info("rank_exported", job=job, step=step, rank=rank, format=fmt)
    return written


async def read_rank(settings: Settings, s3: S3Store | None, expected: Expected, nbytes: int) -> Any:
    """One rank's state: this node's NVMe copy if it is the recorded one, else the object."""
    e = expected
    path = Path(settings.nvme_root) / shard_relpath(e.job, e.step, e.rank, e.world_size)
    if await anyio.Path(path).exists():
        try:
            loaded = await anyio.to_thread.run_sync(partial(load_into, str(path), expected=e))
            return loaded.state
        except Exception as err:  # (not the recorded copy, or damaged: the object then)
            log.warning("nvme_copy_skipped", path=str(path), error=str(err))
    if s3 is None:
        raise NoCheckpointError(
            f"rank {e.rank} of step {e.step}: no good copy on this node's NVMe ({path}) and none "
            "in object storage (run the export on the node that holds it, or after its flush)"
        )
    location = s3.locate(e.job, e.step, e.rank, e.world_size)
    # (the state's tensors are views of the image: it stays open for as long as they live)
    image = await s3.download(s3.key(e.job, e.step, e.rank, e.world_size), nbytes)
    head = image_head(image, location, nbytes)
    return load_image(memoryview(image), head, location, expected=expected).state


def write_rank(fmt: str, state: Any, out: Path, e: Expected) -> Path:
    """Write one rank's state to `out` as `fmt`; the path written."""
    name = f"rank-{e.rank:05d}-of-{e.world_size:05d}"
    identity = {"job": e.job, "step": e.step, "rank": e.rank, "world_size": e.world_size,
                "header_digest": e.header_digest}  # fmt: skip
    if fmt == "safetensors":
        try:
            import safetensors  # noqa: F401
        except ImportError:
            raise ConfigError(
                "--to safetensors needs the safetensors package: pip install "
                "'tierpipe[safetensors]'"
            ) from None
    if fmt == "torch":
        path = out / f"{name}.pt"
        torch.save(state, path)
    elif fmt == "safetensors":
        from safetensors.torch import save_file

        path = out / f"{name}.safetensors"
        tensors, values = {}, {}
        for key, leaf in _leaves(state):
            value = _tensor_of(leaf)
            if isinstance(value, torch.Tensor):
                tensors[key] = value.detach().contiguous().clone()  # (apart from any sharer)
            else:
                values[key] = value
        metadata = {
            "tierpipe.checkpoint": json.dumps(identity),
            "tierpipe.values": json.dumps(values, default=str),
        }
        save_file(tensors, os.fspath(path), metadata=metadata)
    else:
        import torch.distributed.checkpoint as dcp

        path = out / name
        dcp.save(_dcp_safe(state), checkpoint_id=os.fspath(path), no_dist=True)
    return path


def _leaves(state: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key path, value) of every leaf of nested dicts and lists."""
    if isinstance(state, dict):
        for k, v in state.items():
            yield from _leaves(v, f"{prefix}{k}.")
    elif isinstance(state, list | tuple):
        for i, v in enumerate(state):
            yield from _leaves(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], state


def _dcp_safe(state: Any) -> Any:
    """DCP takes nested dicts with string keys: lists and tuples become dicts keyed by index,
    numpy arrays tensors."""
    if isinstance(state, dict):
        return {str(k): _dcp_safe(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return {str(i): _dcp_safe(v) for i, v in enumerate(state)}
    return _tensor_of(state)


def _tensor_of(value: Any) -> Any:
    """A numpy array as a tensor (sharing its memory); anything else as it is."""
    if type(value).__module__ == "numpy" and hasattr(value, "shape"):
        return torch.from_numpy(value)
    return value
