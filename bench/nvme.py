"""`python -m bench nvme`: the node agent's NVMe tier, `staged -> written -> verified`.

A real deployment (embedded nats-server, `python -m tierpipe.cli worker all` as a subprocess:
nvme-write, verify and evict stages) takes shards that a `Checkpointer` stages from the
synthetic transformer state of `bench.common.make_state`. Per shard:

- `write_s`: `ShardWritten.seconds`, the nvme-write stage's own time (open, fallocate, O_DIRECT
  writes at queue depth 4 while hashing every blob with xxh3-128, seal the header, fsync,
  rename, fsync the directory); `write_e2e_s`: wall time from `save()` returning (`staged`
  published) to `handle.wait("written")` returning, i.e. plus event delivery both ways.
- `verify_s`: `ShardVerified.seconds`, the verify stage's own time (O_DIRECT re-read at queue
  depth 4, hashing, digest checks); `verify_e2e_s`: from `written` to `verified` seen by the
  trainer.

Baselines on the same filesystem and directory (the NVMe root), same byte count (the shard
file's size), interleaved with the shards rep by rep: each rep runs the dd pair and a shard back
to back (dd first on even reps, the shard first on odd ones: a drift costs both sides alike),
then the others in a shuffled order; times are medians; `write_vs_dd` (write_s / dd_write_s)
and `verify_vs_dd_read` (verify_s / dd_read_s) are medians of the per-rep ratios with a
90 % interval and a verdict against their target <= 1.0 (`bench.paired`: `_lo`,
`_hi`, `_verdict` met / missed / undecided):

- `dd_write_s`: `dd if=/dev/zero of=F bs=16M count=<nbytes> iflag=count_bytes oflag=direct`
  (wall time of the process; no fsync, as specified).
- `dd_read_s`: after dropping the page cache, `dd if=F of=/dev/null bs=16M iflag=direct`.
- `torch_save_s`: `torch.save` of the same state + fsync; `safetensors_s`: safetensors
  `save_file` of its tensors (flat names; the non-tensor state does not fit) + fsync.

Extra context keys: `dd_write_data_fsync_s` (dd of the real staged image bytes from the
/dev/shm slot, `oflag=direct conv=fsync`: the like-for-like job of nvme-write minus hashing)
and `dd_read_shard_s` (dd direct read of the sealed shard file itself, cache dropped first).
"""

from __future__ import annotations

import subprocess
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    Deployment,
    GiB,
    MiB,
    drop_caches,
    fmt,
    fsync_path,
    log,
    make_state,
    median,
    quiesce,
    remove,
    require_free,
    shuffled,
)
from bench.paired import alternate, paired, record

__all__ = ["run"]

_BS = "16M"


def _dd(*args: str) -> float:
    """Wall time of one dd run."""
    cmd = ["dd", *args, f"bs={_BS}", "status=none"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL)
    return time.perf_counter() - t0


class _Shards:
    """Saves through a Checkpointer and follows each shard to `verified`."""

    def __init__(self, dep: Deployment, stack: ExitStack) -> None:
        self.dep = dep
        self.ckpt = dep.checkpointer()
        stack.callback(self.ckpt.close)
        self.step = 0
        self.nbytes = 0

    def slot_file(self) -> Path:
        assert self.dep.staging_root is not None
        slots = sorted((self.dep.staging_root / "bench" / "rank-00000").glob("slot-?"))
        if not slots:
            raise RuntimeError("no staging slot file")
        return slots[0]

    def one(self, state: dict[str, Any]) -> dict[str, float]:
        self.step += 1
        quiesce()
        handle = self.ckpt.save(self.step, state)
        t_staged = time.perf_counter()
        written = handle.wait("written", timeout=600)
        t_written = time.perf_counter()
        verified = handle.wait("verified", timeout=600)
        t_verified = time.perf_counter()
        self.nbytes = verified.nbytes
        try:
            drop_caches()
            read_shard = _dd(f"if={verified.path}", "of=/dev/null", "iflag=direct")
        finally:
            remove(verified.path)
        self.dep.wait_released()
        return {
            "write": written.seconds,
            "verify": verified.seconds,
            "write_e2e": t_written - t_staged,
            "verify_e2e": t_verified - t_written,
            "dd_read_shard": read_shard,
        }


def _dd_zero(path: Path, nbytes: int) -> dict[str, float]:
    quiesce()
    try:
        write = _dd("if=/dev/zero", f"of={path}", f"count={nbytes}", "iflag=count_bytes",
                    "oflag=direct")  # fmt: skip
        if path.stat().st_size != nbytes:
            raise RuntimeError(f"dd wrote {path.stat().st_size} bytes, expected {nbytes}")
        drop_caches()
        read = _dd(f"if={path}", "of=/dev/null", "iflag=direct")
    finally:
        remove(path)
    return {"dd_write": write, "dd_read": read}


def _dd_data(src: Path, path: Path, nbytes: int) -> dict[str, float]:
    quiesce()
    try:
        write = _dd(f"if={src}", f"of={path}", f"count={nbytes}", "iflag=count_bytes",
                    "oflag=direct", "conv=fsync")  # fmt: skip
    finally:
        remove(path)
    return {"dd_write_data_fsync": write}


def _torch_save(state: dict[str, Any], path: Path) -> dict[str, float]:
    quiesce()
    try:
        t0 = time.perf_counter()
        torch.save(state, path)
        fsync_path(path)
        return {"torch_save": time.perf_counter() - t0}
    finally:
        remove(path)


def _safetensors(flat: dict[str, torch.Tensor], path: Path) -> dict[str, float]:
    from safetensors.torch import save_file

    quiesce()
    try:
        t0 = time.perf_counter()
        save_file(flat, str(path), metadata={"step": "1000"})
        fsync_path(path)
        return {"safetensors": time.perf_counter() - t0}
    finally:
        remove(path)


def run(size_gib: float, reps: int) -> dict[str, Any]:
    log(f"nvme: building a {size_gib:g} GiB synthetic state")
    s = make_state(size_gib)
    log(f"  {s.tensors} tensors, {s.nbytes / GiB:.3f} GiB")
    samples: dict[str, list[float]] = {}

    def add(values: dict[str, float]) -> None:
        for k, v in values.items():
            samples.setdefault(k, []).append(v)

    with ExitStack() as stack:
        dep = stack.enter_context(Deployment("nvme"))
        base = dep.nvme_root / "baselines"
        base.mkdir()
        # At most: one shard + one baseline file (+ slack); each is deleted after its rep.
        require_free(base, 3 * s.nbytes + GiB, "nvme benchmark")
        shards = _Shards(dep, stack)
        log("  warm-up shard (maps the staging slot)")
        shards.one(s.state)
        nbytes = shards.nbytes
        log(f"  shard file: {nbytes} bytes ({nbytes / MiB:.1f} MiB)")
        slot = shards.slot_file()

        candidates = {
            "tierpipe": lambda: add(shards.one(s.state)),
            "dd_zero": lambda: add(_dd_zero(base / "dd.bin", nbytes)),
            "dd_data": lambda: add(_dd_data(slot, base / "dd-data.bin", nbytes)),
            "torch_save": lambda: add(_torch_save(s.state, base / "state.pt")),
            "safetensors": lambda: add(_safetensors(s.flat, base / "state.safetensors")),
        }
        log("  warm-up: every baseline once")
        for name, fn in candidates.items():
            if name != "tierpipe":
                t0 = time.perf_counter()
                fn()
                log(f"    {name}: {time.perf_counter() - t0:.2f} s")
        samples.clear()

        core = ["dd_zero", "tierpipe"]
        rest = [name for name in candidates if name not in core]
        for rep in range(reps):
            order = alternate(core, rep) + shuffled(rest, rep)
            log(f"rep {rep + 1}/{reps}: {' '.join(order)}")
            for name in order:
                candidates[name]()
                dep.check_agent()
            log("  " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in samples.items()))

    for name, values in samples.items():
        log(f"{name:>20}: {fmt(values)}  ({nbytes / median(values) / 1e9:.2f} GB/s)")
    m = {k: median(v) for k, v in samples.items()}
    result: dict[str, Any] = {
        "write_s": m["write"],
        "verify_s": m["verify"],
        "dd_write_s": m["dd_write"],
        "dd_read_s": m["dd_read"],
    }
    record(result, "write_vs_dd", paired(samples["dd_write"], samples["write"]), 1.0)
    record(result, "verify_vs_dd_read", paired(samples["dd_read"], samples["verify"]), 1.0)
    result |= {
        "write_e2e_s": m["write_e2e"],
        "verify_e2e_s": m["verify_e2e"],
        "torch_save_s": m["torch_save"],
        "safetensors_s": m["safetensors"],
        "nbytes": float(nbytes),
        "reps": float(reps),
        "dd_write_data_fsync_s": m["dd_write_data_fsync"],
        "dd_read_shard_s": m["dd_read_shard"],
        "size_gib": s.size_gib,
    }
    return result
