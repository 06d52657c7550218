"""`python -m bench stall`: how long `Checkpointer.save()` blocks the training loop.

Measured on one synthetic transformer state (`bench.common.make_state`: bf16 weights, fp32 Adam
moments and step counters, a step counter, torch and Python RNG state; CPU tensors, ~200 of
them), against baselines on the very same tensors in the same run, medians reported. Each rep
runs memcpy, tierpipe and the two DCP candidates back to back, in that order on even reps and
reversed on odd ones (so tierpipe's neighbours are memcpy and the reused-stager DCP either way,
and a drift costs both sides of a pair alike), then the others in a shuffled order. The ratios
are medians of the per-rep ratios with a 90 % interval (`bench.paired`), each judged
met / missed / undecided against its target:

- `stall_s`: wall time of `Checkpointer.save(step, state)` (blocking mode) with a real node
  agent subprocess and an embedded nats-server. Between reps (untimed) the benchmark waits for
  `verified`, deletes the shard file and waits until the evict stage released the staging slot,
  so every timed save finds a free, already mapped slot (two warm-up saves come first: the
  first one allocates and maps the slot).
- `memcpy_s`: `copy_` of every tensor into preallocated tensors (allocated, touched, reused).
- `torch_save_s`: `torch.save` to a file on the repository's filesystem, then fsync.
- `dcp_async_blocking_s`: how long `torch.distributed.checkpoint.async_save` blocks with its
  default stager (a fresh `DefaultStager`, fresh staging memory per call), single-process gloo
  group; its future is completed (untimed) before anything else runs.
- `dcp_reused_stager_blocking_s`: the same with one `DefaultStager` created once and reused,
  so its cached staging storages are copied into instead of allocated. Options as the default
  (synchronous staging, no pinning, no shared memory): on CPU pinned memory and non-blocking
  copies need an accelerator, and asynchronous staging returns before the copy is done (that
  is the analogue of tierpipe's overlapped mode, not of a blocking save).
- Overlapped mode: `overlap_return_s` is how long `save(step, state, blocking=False)` takes to
  return; then a ~0.5 s CPU matmul loop stands for compute (its standalone time is `compute_s`,
  its time while the copy and the agent run is `overlap_compute_s`), then `optimizer.step()` on
  a small SGD optimizer guarded with `ckpt.guard(optimizer)`. `overlap_exposed_s` is the wait
  inside the guard, measured directly: a step pre-hook registered before the guard and one
  registered after it take timestamps (hooks run in registration order), so it is exactly the
  time the guard's barrier blocked, free of the optimizer's own step time.

Extra keys: `stall_internal_s` (the stall the Checkpointer reports itself in `stats`),
`compute_s`, `overlap_compute_s`, `overlap_copy_s` (from the save() call until the background
copy finished: the `staged` event's `stall_s`), `state_bytes`, `first_stall_s` (the very first
save, which allocates and maps the staging slot; not part of `stall_s`).

Ratios (each with `_lo`, `_hi` and `_verdict`): `stall_vs_memcpy` (stall_s / memcpy_s per rep,
target <= 1.05), `stall_vs_dcp_best` (stall_s over the DCP candidate with the lower median, per
rep, target <= 1.0).
"""

from __future__ import annotations

import concurrent.futures
import cProfile
import io
import pstats
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    Compute,
    Deployment,
    GiB,
    SyntheticState,
    fmt,
    fsync_path,
    log,
    make_state,
    median,
    quiesce,
    remove,
    require_free,
    scratch_dir,
    shuffled,
)
from bench.paired import alternate, paired, record

__all__ = ["run"]


class _Dcp:
    """DCP `async_save` in a single-process gloo group, with a reused `DefaultStager`."""

    def __init__(self, work: Path) -> None:
        import torch.distributed as dist
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.work = work
        self._dist = dist
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            store = dist.FileStore(str(work / "gloo-store"), 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        # The options async_save uses for its own default stager; created once, reused.
        self.stager = DefaultStager(StagingOptions(False, False, False, False))
        self._count = 0

    def save(self, state: dict[str, Any], *, reused: bool) -> float:
        """Blocking time of one async_save; its write completes (untimed) before returning."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

        self._count += 1
        path = self.work / f"dcp-{self._count}"
        quiesce()
        t0 = time.perf_counter()
        if reused:
            future = dcp.async_save(state, checkpoint_id=path, async_stager=self.stager)
        else:
            future = dcp.async_save(state, checkpoint_id=path)
        blocked = time.perf_counter() - t0
        # The write's future: bare with synchronous staging (these options), in an
        # AsyncSaveResponse with asynchronous staging.
        written = future.upload_completion if isinstance(future, AsyncSaveResponse) else future
        try:
            written.result(timeout=600)
        finally:
            if not written.done():  # interrupted: let the writer thread stop touching `path`
                concurrent.futures.wait([written], timeout=120)
            remove(path)
        return blocked

    def close(self) -> None:
        self.stager.close()
        if self._owns_group and self._dist.is_initialized():
            self._dist.destroy_process_group()


class _Tierpipe:
    """A Checkpointer against a live deployment, plus a guarded SGD optimizer."""

    def __init__(self, dep: Deployment, stack: ExitStack) -> None:
        self.dep = dep
        self.ckpt = dep.checkpointer()
        stack.callback(self.ckpt.close)
        self.step = 0
        self.param = torch.nn.Parameter(torch.zeros(4096))
        self.param.grad = torch.full((4096,), 1e-3)
        self.opt = torch.optim.SGD([self.param], lr=0.1)
        self._marks: dict[str, float] = {}
        self.opt.register_step_pre_hook(lambda *_: self._mark("before_guard"))
        self.ckpt.guard(self.opt)
        self.opt.register_step_pre_hook(lambda *_: self._mark("after_guard"))

    def _mark(self, name: str) -> None:
        self._marks[name] = time.perf_counter()

    def _settle(self, handle: Any) -> None:
        """Untimed: wait for `verified`, delete the shard file, wait for the slot's release."""
        event = handle.wait("verified", timeout=600)
        remove(event.path)
        self.dep.wait_released()

    def blocking(self, state: dict[str, Any]) -> tuple[float, float]:
        """(wall time of save(), the Checkpointer's own stall_s)."""
        self.step += 1
        quiesce()
        t0 = time.perf_counter()
        handle = self.ckpt.save(self.step, state)
        stall = time.perf_counter() - t0
        internal = self.ckpt.stats.last_stall_s
        self._settle(handle)
        return stall, internal

    def overlapped(
        self, state: dict[str, Any], compute: Compute
    ) -> tuple[float, float, float, float]:
        """(return time of save(blocking=False), compute time meanwhile, guard wait, time
        from the save() call until the background copy finished)."""
        self.step += 1
        self._marks.clear()
        quiesce()
        t0 = time.perf_counter()
        handle = self.ckpt.save(self.step, state, blocking=False)
        returned = time.perf_counter() - t0
        compute_s = compute()
        self.opt.step()
        exposed = self._marks["after_guard"] - self._marks["before_guard"]
        handle.wait_staged(timeout=600)
        # For an overlapped save the Checkpointer's stall_s is the background copy's duration.
        copy_s = handle.wait("staged", timeout=600).stall_s
        self._settle(handle)
        return returned, compute_s, exposed, copy_s

    def profile(self, state: dict[str, Any]) -> str:
        """cProfile of one blocking save (top functions by cumulative time)."""
        self.step += 1
        quiesce()
        prof = cProfile.Profile()
        prof.enable()
        handle = self.ckpt.save(self.step, state)
        prof.disable()
        self._settle(handle)
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(25)
        return out.getvalue()


def _memcpy(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    quiesce()
    t0 = time.perf_counter()
    for dst, src in pairs:
        dst.copy_(src)
    return time.perf_counter() - t0


def _torch_save(state: dict[str, Any], path: Path) -> float:
    quiesce()
    try:
        t0 = time.perf_counter()
        torch.save(state, path)
        fsync_path(path)
        return time.perf_counter() - t0
    finally:
        remove(path)


def run(size_gib: float, reps: int, *, profile: bool = False) -> dict[str, Any]:
    log(f"stall: building a {size_gib:g} GiB synthetic state")
    s: SyntheticState = make_state(size_gib)
    log(f"  {s.tensors} tensors, {s.nbytes / GiB:.3f} GiB, d_model {s.dim}, {s.layers} layers; "
        f"torch threads {torch.get_num_threads()}")  # fmt: skip
    compute = Compute(0.5)
    log(f"  compute loop: {compute.iters} matmuls, standalone {fmt(compute.standalone)}")
    samples: dict[str, list[float]] = {
        k: []
        for k in (
            "memcpy", "torch_save", "dcp_default", "dcp_reused", "stall", "stall_internal",
            "overlap_return", "overlap_compute", "overlap_exposed", "overlap_copy",
        )
    }  # fmt: skip
    with ExitStack() as stack:
        dep = stack.enter_context(Deployment("stall"))
        work = stack.enter_context(scratch_dir("stall-baselines"))
        require_free(work, 3 * s.nbytes + GiB, "stall benchmark")
        log("  preallocating memcpy destinations")
        pairs = [(torch.empty_like(t), t) for t in s.flat.values()]
        _memcpy(pairs)  # touches every destination page
        dcp = _Dcp(work)
        stack.callback(dcp.close)
        tp = _Tierpipe(dep, stack)

        candidates: dict[str, Any] = {
            "memcpy": lambda: samples["memcpy"].append(_memcpy(pairs)),
            "torch_save": lambda: samples["torch_save"].append(
                _torch_save(s.state, work / "torch_save.pt")
            ),
            "dcp_default": lambda: samples["dcp_default"].append(dcp.save(s.state, reused=False)),
            "dcp_reused": lambda: samples["dcp_reused"].append(dcp.save(s.state, reused=True)),
            "tierpipe": lambda: _record_blocking(samples, tp.blocking(s.state)),
            "tierpipe_overlap": lambda: _record_overlap(samples, tp.overlapped(s.state, compute)),
        }
        log("  warm-up: every candidate once (tierpipe twice: the first save maps the slot)")
        first_stall = tp.blocking(s.state)[0]
        log(f"    tierpipe first save (allocates and maps the staging slot): {first_stall:.3f} s")
        for name, fn in candidates.items():
            t0 = time.perf_counter()
            fn()
            log(f"    {name}: {time.perf_counter() - t0:.2f} s")
        for values in samples.values():
            values.clear()

        for rep in range(reps):
            core = ["memcpy", "tierpipe", "dcp_reused", "dcp_default"]
            rest = [name for name in candidates if name not in core]
            order = alternate(core, rep) + shuffled(rest, rep)
            log(f"rep {rep + 1}/{reps}: {' '.join(order)}")
            for name in order:
                candidates[name]()
                dep.check_agent()
            log("  " + ", ".join(f"{k} {v[-1]:.4f}" for k, v in samples.items() if v))

        if profile:
            log("cProfile of one blocking save:\n" + tp.profile(s.state))

    for name, values in samples.items():
        log(f"{name:>16}: {fmt(values)}")
    stall, memcpy = median(samples["stall"]), median(samples["memcpy"])
    dcp_default, dcp_reused = median(samples["dcp_default"]), median(samples["dcp_reused"])
    dcp_best = "dcp_default" if dcp_default < dcp_reused else "dcp_reused"
    result: dict[str, Any] = {
        "stall_s": stall,
        "memcpy_s": memcpy,
        "torch_save_s": median(samples["torch_save"]),
        "dcp_async_blocking_s": dcp_default,
        "dcp_reused_stager_blocking_s": dcp_reused,
    }
    record(result, "stall_vs_memcpy", paired(samples["memcpy"], samples["stall"]), 1.05)
    record(result, "stall_vs_dcp_best", paired(samples[dcp_best], samples["stall"]), 1.0)
    result |= {
        "dcp_best": dcp_best,
        "overlap_return_s": median(samples["overlap_return"]),
        "overlap_exposed_s": median(samples["overlap_exposed"]),
        "size_gib": s.size_gib,
        "tensors": float(s.tensors),
        "reps": float(reps),
        "stall_internal_s": median(samples["stall_internal"]),
        "compute_s": median(compute.standalone),
        "overlap_compute_s": median(samples["overlap_compute"]),
        "overlap_copy_s": median(samples["overlap_copy"]),
        "state_bytes": float(s.nbytes),
        "first_stall_s": first_stall,
    }
    return result


def _record_blocking(samples: dict[str, list[float]], r: tuple[float, float]) -> None:
    samples["stall"].append(r[0])
    samples["stall_internal"].append(r[1])


def _record_overlap(samples: dict[str, list[float]], r: tuple[float, float, float, float]) -> None:
    samples["overlap_return"].append(r[0])
    samples["overlap_compute"].append(r[1])
    samples["overlap_exposed"].append(r[2])
    samples["overlap_copy"].append(r[3])
