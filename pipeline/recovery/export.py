"""`tierpipe export`: one step of a job, in a format other tools load.

Each rank's shard is read from this node's NVMe copy when it is there and matches the header
digest the job state recorded, else from object storage; every digest is checked before a byte
is used (as a restore does). Ranks are read one at a time, in order. Into `<dir>`:

- `dcp`: one torch.distributed.checkpoint checkpoint of the whole step (every rank's shards,
  one `.metadata`: `tierpipe.interop.dcp`), which `dcp.load` reads into any world size.
- `torch` and `safetensors` with `merged`: the full model as one file set (`model.pt`:
  `tierpipe.interop.merged`; `model.safetensors`, or split files with an index, written in
  place after a first pass over the ranks' headers: `tierpipe.interop.hfsplit`).
- `torch` and `safetensors` per rank:
  - `torch`: `rank-<r>-of-<w>.pt`, `torch.save` of the rank's state (nested dicts and lists,
    tensors, plain values; a DTensor's local shard as a plain tensor), loadable with
    `torch.load(path, weights_only=True)`.
  - `safetensors`: `rank-<r>-of-<w>.safetensors`, the tensors under their dotted key paths
    (`model.0.weight`); the other values and the checkpoint's identity in its metadata as JSON
    (`tierpipe.values`, `tierpipe.checkpoint`). Tensors that shared storage are written apart.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import structlog
import torch

from tierpipe.control.bitmap import has_rank
from tierpipe.control.kvstate import JobStore
from tierpipe.errors import ConfigError, NoCheckpointError, TierpipeError
from tierpipe.interop.dcp import DcpWriter
from tierpipe.interop.hfsplit import MAX_FILE_BYTES, SafetensorsWriter
from tierpipe.interop.merge import key_name, leaves
from tierpipe.interop.merged import MergedWriter, tensor_of
from tierpipe.names import shard_relpath
from tierpipe.recovery.load import Expected, Loaded, check_head, load_image, load_into
from tierpipe.schemas import ShardHeader
from tierpipe.settings import Settings
from tierpipe.storage.reader import image_head, read_head
from tierpipe.storage.s3.store import S3Store

__all__ = ("FORMATS", "Exported", "export_step", "read_header", "read_rank", "write_rank")

log = structlog.get_logger(__name__)

FORMATS = ("torch", "safetensors", "dcp")


@dataclass(frozen=True, slots=True)
class Exported:
    """What an export wrote."""

    world_size: int
    paths: list[Path]


async def export_step(
    settings: Settings,
    store: JobStore,
    job: str,
    step: int,
    fmt: str,
    out: Path,
    *,
    merged: bool = False,
    max_file_bytes: int = MAX_FILE_BYTES,
) -> Exported:
    """Write `step` to `out` as `fmt`: per rank, or merged (always so for `dcp`).

    Raises:
        NoCheckpointError: the step has no record, or a rank has no copy this node can read.
        ConfigError: an unknown format, `out` is no folder, safetensors is not installed.
        LayoutMismatchError: the ranks' shards do not make whole tensors.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"unknown format {fmt!r} (one of {', '.join(FORMATS)})")
    if fmt == "safetensors":
        _need_safetensors()
    rec = await store.record(job, step)
    if rec is None:
        head = await store.head(job)
        kept = ", ".join(map(str, head.steps)) if head else "none"
        raise NoCheckpointError(f"step {step} of job {job!r} has no record (kept: {kept})")
    try:
        await anyio.Path(out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot write into {out}: {e.strerror or e}") from e
    identity = {"job": job, "step": step, "world_size": rec.world_size}
    sink: DcpWriter | MergedWriter | SafetensorsWriter | None = None
    if fmt == "dcp":
        sink = DcpWriter(out)
    elif merged and fmt == "torch":
        sink = MergedWriter(out)
    elif merged:
        sink = SafetensorsWriter(out, identity, max_file_bytes=max_file_bytes)
    async with S3Store(settings) as s3:
        sources = []
        for rank in range(rec.world_size):
            found = await store.rank_digest(job, step, rank)
            if found is None:
                raise NoCheckpointError(f"rank {rank} of step {step} has no verified copy")
            in_s3 = has_rank(rec.s3, rank) and not rec.s3_removed
            expected = Expected(job, step, rank, rec.world_size, found[0])
            sources.append((expected, s3 if in_s3 else None, found[1]))
        try:
            if isinstance(sink, SafetensorsWriter):  # (a first pass: the headers alone)
                for rank, (expected, source, nbytes) in enumerate(sources):
                    header = await read_header(settings, source, expected, nbytes)
                    await anyio.to_thread.run_sync(sink.plan, rank, header)
                await anyio.to_thread.run_sync(sink.open)
            written = await _each_rank(settings, sources, fmt, out, sink)
        finally:
            if isinstance(sink, SafetensorsWriter):
                sink.close()
    return Exported(rec.world_size, written)


async def _each_rank(
    settings: Settings,
    sources: list[tuple[Expected, S3Store | None, int]],
    fmt: str,
    out: Path,
    sink: DcpWriter | MergedWriter | SafetensorsWriter | None,
) -> list[Path]:
    """Read the ranks one at a time into `sink` (None: a file each); the paths written."""
    written = []
    for rank, (expected, s3, nbytes) in enumerate(sources):
        loaded = await read_rank(settings, s3, expected, nbytes)
        if sink is None:
            path = await anyio.to_thread.run_sync(write_rank, fmt, loaded.state, out, expected)
            written.append(path)
        else:
            await anyio.to_thread.run_sync(sink.add, rank, loaded.header, loaded.state)
        del loaded  # (one rank at a time)
        log.info("rank_exported", job=expected.job, step=expected.step, rank=rank, format=fmt,
                 merged=sink is not None)  # fmt: skip
    if sink is not None:
        written = await anyio.to_thread.run_sync(sink.finish)
    return written


def _need_safetensors() -> None:
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise ConfigError(
            "--to safetensors needs the safetensors package: pip install 'tierpipe[safetensors]'"
        ) from None


async def read_rank(
    settings: Settings, s3: S3Store | None, expected: Expected, nbytes: int
) -> Loaded:
    """One rank's shard: this node's NVMe copy if it is the recorded one, else the object."""
    e = expected
    path = Path(settings.nvme_root) / shard_relpath(e.job, e.step, e.rank, e.world_size)
    if await anyio.Path(path).exists():
        try:
            return await anyio.to_thread.run_sync(partial(load_into, str(path), expected=e))
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
    return load_image(memoryview(image), head, location, expected=expected)


async def read_header(
    settings: Settings, s3: S3Store | None, expected: Expected, nbytes: int
) -> ShardHeader:
    """One rank's header: from this node's NVMe copy's head if it is the recorded one (its
    digest checked), else from a whole read (`read_rank`)."""
    e = expected
    path = Path(settings.nvme_root) / shard_relpath(e.job, e.step, e.rank, e.world_size)
    try:
        head = await anyio.to_thread.run_sync(read_head, path)
        check_head(head, expected, str(path))
        return head.header
    except (TierpipeError, OSError) as err:  # (not there, or not the recorded copy)
        log.debug("nvme_head_skipped", path=str(path), error=str(err))
    return (await read_rank(settings, s3, expected, nbytes)).header


def write_rank(fmt: str, state: Any, out: Path, e: Expected) -> Path:
    """Write one rank's state to `out` as `fmt` (`torch` or `safetensors`); the path written."""
    name = f"rank-{e.rank:05d}-of-{e.world_size:05d}"
    identity = {"job": e.job, "step": e.step, "rank": e.rank, "world_size": e.world_size,
                "header_digest": e.header_digest}  # fmt: skip
    if fmt == "torch":
        path = out / f"{name}.pt"
        torch.save(state, path)
        return path
    from safetensors.torch import save_file

    path = out / f"{name}.safetensors"
    tensors, values = {}, {}
    for key, leaf in leaves(state):
        value = tensor_of(leaf)
        if isinstance(value, torch.Tensor):
            tensors[key_name(key)] = value.detach().contiguous().clone()  # (apart from any sharer)
        else:
            values[key_name(key)] = value
    metadata = {
        "tierpipe.checkpoint": json.dumps(identity),
        "tierpipe.values": json.dumps(values, default=str),
    }
    save_file(tensors, os.fspath(path), metadata=metadata)
    return path
