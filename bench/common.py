"""Shared helpers of the benchmarks: the synthetic training state, the identity of synthetic
events, timing and statistics, page cache dropping, and a one-node tierpipe deployment (an
embedded nats-server plus the node agent, `python -m tierpipe.cli worker all`, as a subprocess)
with guaranteed cleanup.

Nothing here is measured by itself; `bench.stall`, `bench.nvme` and `bench.flush` do the
measuring.
"""

from __future__ import annotations

import gc
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import torch

#: The repository root (bench/ lives directly under it).
REPO = Path(__file__).resolve().parent.parent
#: Scratch space for NVMe roots, NATS stores and baseline files: gitignored, on the same
#: filesystem as the repository (the "NVMe" of these machines).
SCRATCH = REPO / ".bench"
SHM = Path("/dev/shm")
JOB = "bench"
NODE = "bench-node"
GiB = 1 << 30
MiB = 1 << 20

_T0 = time.perf_counter()


def log(msg: str) -> None:
    """Progress for humans, on stderr (stdout carries only the final JSON line)."""
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def emit(result: dict[str, Any]) -> None:
    """The one JSON line on stdout."""
    print(json.dumps(result, sort_keys=False), flush=True)


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def fmt(xs: Sequence[float]) -> str:
    """`median (min-max, n)` in seconds, for progress lines."""
    if not xs:
        return "-"
    return f"{median(xs):.4f} s (min {min(xs):.4f}, max {max(xs):.4f}, n={len(xs)})"


def shuffled(items: Sequence[Any], rep: int) -> list[Any]:
    """`items` in a different, reproducible order per rep (seeded by `rep`): interleaving
    against a noisy machine, with varying neighbours so no candidate always follows the same
    one (a plain rotation would keep every candidate's predecessor fixed)."""
    out = list(items)
    random.Random(rep).shuffle(out)
    return out


def quiesce() -> None:
    """Untimed: collect garbage and let writeback settle before a timed section."""
    gc.collect()
    os.sync()


def drop_caches() -> bool:
    """Write back and drop the page cache (needs root); False if not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as e:
        log(f"WARNING: cannot drop the page cache ({e}); read baselines may hit the cache")
        return False
    return True


def fsync_path(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def require_free(path: Path, nbytes: int, what: str) -> None:
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        raise RuntimeError(f"{what}: {path} has {free / GiB:.1f} GiB free, need {nbytes / GiB:.1f}")


@contextmanager
def scratch_dir(tag: str) -> Iterator[Path]:
    """A fresh directory under `SCRATCH`, removed afterwards whatever happens."""
    SCRATCH.mkdir(exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f"{tag}-", dir=SCRATCH))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def remove(path: str | os.PathLike[str]) -> None:
    """Delete a file or a directory tree if it exists."""
    p = Path(path)
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def sigterm_as_interrupt() -> None:
    """Turn SIGTERM into KeyboardInterrupt so `finally` blocks clean up on `kill`."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


# --- the synthetic state


@dataclass(frozen=True, slots=True)
class SyntheticState:
    """A GPT-like training state: bf16 weights, fp32 Adam moments, step counters, RNG state."""

    state: dict[str, Any]
    #: Every tensor with a flat dotted name (for safetensors, memcpy and reporting).
    flat: dict[str, torch.Tensor]
    nbytes: int
    dim: int
    layers: int
    vocab: int

    @property
    def tensors(self) -> int:
        return len(self.flat)

    @property
    def size_gib(self) -> float:
        return self.nbytes / GiB


def _param_shapes(dim: int, layers: int, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    shapes: list[tuple[str, tuple[int, ...]]] = [("embed.weight", (vocab, dim))]
    for i in range(layers):
        p = f"layers.{i}."
        shapes += [
            (p + "ln1.weight", (dim,)),
            (p + "attn.qkv.weight", (3 * dim, dim)),
            (p + "attn.out.weight", (dim, dim)),
            (p + "ln2.weight", (dim,)),
            (p + "mlp.up.weight", (4 * dim, dim)),
            (p + "mlp.down.weight", (dim, 4 * dim)),
        ]
    shapes += [("ln_f.weight", (dim,)), ("lm_head.weight", (vocab, dim))]
    return shapes


def make_state(
    size_gib: float, *, layers: int = 8, vocab: int = 32000, seed: int = 0
) -> SyntheticState:
    """Build a state of about `size_gib` GiB: `layers` transformer blocks (6 weights each) plus
    embedding, final norm and LM head; Adam `step`, `exp_avg`, `exp_avg_sq` for every weight;
    a training step counter and RNG state. With 8 layers: 51 weights, 205 tensors.

    Bytes per parameter: 2 (bf16 weight) + 4 + 4 (fp32 moments). The model width is solved
    from the size (12*layers*d^2 + (2*vocab + 2*layers + 1)*d parameters), a multiple of 16.
    """
    target_params = size_gib * GiB / 10
    a, b = 12 * layers, 2 * vocab + 2 * layers + 1
    dim = max(16, round((-b + math.sqrt(b * b + 4 * a * target_params)) / (2 * a) / 16) * 16)
    gen = torch.Generator().manual_seed(seed)
    model: dict[str, torch.Tensor] = {}
    optim_state: dict[int, dict[str, torch.Tensor]] = {}
    for index, (name, shape) in enumerate(_param_shapes(dim, layers, vocab)):
        w = torch.empty(shape, dtype=torch.bfloat16)
        if name.endswith(("ln1.weight", "ln2.weight", "ln_f.weight")):
            w.fill_(1.0)
        else:
            w.normal_(0.0, 0.02, generator=gen)
        model[name] = w
        optim_state[index] = {
            "step": torch.tensor(1000.0),
            "exp_avg": torch.empty(shape).normal_(0.0, 1e-3, generator=gen),
            "exp_avg_sq": torch.empty(shape).uniform_(0.0, 1e-6, generator=gen),
        }
    param_groups = [
        {
            "lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
            "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
            "differentiable": False, "fused": None, "decoupled_weight_decay": True,
            "params": list(range(len(model))),
        }
    ]  # fmt: skip
    rnd = random.Random(seed)
    state: dict[str, Any] = {
        "model": model,
        "optim": {"state": optim_state, "param_groups": param_groups},
        "step": 1000,
        "rng": {"torch": torch.get_rng_state(), "python": rnd.getstate()},
    }
    flat: dict[str, torch.Tensor] = {f"model.{k}": v for k, v in model.items()}
    for index, st in optim_state.items():
        for k, v in st.items():
            flat[f"optim.state.{index}.{k}"] = v
    flat["rng.torch"] = state["rng"]["torch"]
    nbytes = sum(t.numel() * t.element_size() for t in flat.values())
    return SyntheticState(state, flat, nbytes, dim, layers, vocab)


# --- synthetic events


class ShardIdent(TypedDict):
    """The fields that name a shard event's publisher and shard (`tierpipe.schemas.ShardEvent`),
    shared by the synthetic events of one rank and step: `ShardWritten(**ident, ...)`."""

    job: str
    node: str
    ts: float
    step: int
    rank: int
    world_size: int


# --- simulated compute


class Compute:
    """A CPU matmul loop calibrated to run about `target_s` seconds on an idle machine."""

    def __init__(self, target_s: float = 0.5, n: int = 512) -> None:
        gen = torch.Generator().manual_seed(1)
        self.a = torch.randn(n, n, generator=gen)
        self.b = torch.randn(n, n, generator=gen)
        self.c = torch.empty(n, n)
        self._time(20)  # warm up
        self.iters = max(1, round(target_s / (self._time(20) / 20)))
        for _ in range(5):  # refine on full-length runs (the machine is noisy)
            t = median([self._time(self.iters) for _ in range(3)])
            if abs(t - target_s) < 0.05 * target_s:
                break
            self.iters = max(1, round(self.iters * target_s / t))
        self.standalone = [self._time(self.iters) for _ in range(3)]

    def _time(self, iters: int) -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            torch.mm(self.a, self.b, out=self.c)
        return time.perf_counter() - t0

    def __call__(self) -> float:
        """Run the loop; returns its wall time."""
        return self._time(self.iters)


# --- a one-node tierpipe deployment


class Deployment:
    """An embedded nats-server, a node agent subprocess (every agent stage, or `stages`) and the
    matching trainer settings (plus `env`, extra `TIERPIPE_*` values for both), all in private
    directories: an NVMe root under `SCRATCH` and a staging root directly under /dev/shm.
    `close()` stops both processes and deletes every directory.
    """

    def __init__(
        self,
        tag: str,
        *,
        stages: Sequence[str] = ("all",),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.tag = tag
        #: The agent's `worker` arguments.
        self.stages = tuple(stages)
        #: Extra `TIERPIPE_*` settings for agent and trainer alike (e.g. the object store's).
        self.extra_env = dict(env or {})
        self.dir: Path | None = None
        self.staging_root: Path | None = None
        self.server: Any = None
        self.agent: subprocess.Popen[bytes] | None = None
        self.settings: Any = None

    def __enter__(self) -> Deployment:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def nvme_root(self) -> Path:
        assert self.dir is not None
        return self.dir / "nvme"

    def start(self) -> None:
        from tierpipe.dev import NatsServer
        from tierpipe.log import configure_logging
        from tierpipe.settings import load_settings

        # structlog's defaults print to stdout, which must carry only the JSON line.
        configure_logging("warning", "json", only_if_unconfigured=True)

        SCRATCH.mkdir(exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix=f"{self.tag}-", dir=SCRATCH))
        self.staging_root = Path(tempfile.mkdtemp(prefix=f"tierpipe-bench-{self.tag}-", dir=SHM))
        self.nvme_root.mkdir()
        # The bench's job is on this node, as its trainer makes it: the agent serves the jobs
        # it finds on its node, and binds their consumers before it says it is ready.
        (self.staging_root / JOB).mkdir()
        self.server = NatsServer(self.dir / "nats").start()
        env_settings = {
            "TIERPIPE_NATS_URL": self.server.url,
            "TIERPIPE_NODE": NODE,
            "TIERPIPE_NVME_ROOT": str(self.nvme_root),
            "TIERPIPE_STAGING_ROOT": str(self.staging_root),
            "TIERPIPE_LOG_LEVEL": "warning",
            **self.extra_env,
        }
        # The trainer side reads the very same values, and nothing else from the environment.
        self.settings = load_settings(path=None, env=env_settings)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIERPIPE_")}
        env.update(env_settings)
        with open(self.dir / "agent.log", "wb") as agent_log:
            self.agent = subprocess.Popen(
                [sys.executable, "-m", "tierpipe.cli", "worker", *self.stages],
                env=env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=agent_log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        self._wait_agent_ready()
        log(f"deployment up: nats {self.server.url}, agent pid {self.agent.pid}, "
            f"nvme {self.nvme_root}, staging {self.staging_root}")  # fmt: skip

    def _wait_agent_ready(self, timeout_s: float = 60.0) -> None:
        """Until the agent's durable consumers exist (seen on the monitoring port): three for
        `all` (as before), else one per stage."""
        assert self.agent is not None
        consumers = 3 if "all" in self.stages else len(self.stages)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.agent.poll() is not None:
                raise RuntimeError(
                    f"node agent exited with {self.agent.returncode}:\n{self.agent_log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.server.monitor_url}/jsz", timeout=2) as r:
                    if json.loads(r.read()).get("consumers", 0) >= consumers:
                        return
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                tail = self.agent_log_tail()
                raise RuntimeError(f"node agent not ready in {timeout_s} s:\n{tail}")
            time.sleep(0.05)

    def agent_log_tail(self, nbytes: int = 4000) -> str:
        if self.dir is None:
            return ""
        try:
            return (self.dir / "agent.log").read_bytes()[-nbytes:].decode(errors="replace")
        except OSError:
            return ""

    def check_agent(self) -> None:
        if self.agent is not None and self.agent.poll() is not None:
            tail = self.agent_log_tail()
            raise RuntimeError(f"node agent died ({self.agent.returncode}):\n{tail}")

    def checkpointer(self, job: str = JOB) -> Any:
        from tierpipe.trainer.checkpointer import Checkpointer

        return Checkpointer(job, rank=0, world_size=1, node=NODE, settings=self.settings)

    def busy_markers(self, job: str = JOB, rank: int = 0) -> list[str]:
        assert self.staging_root is not None
        d = self.staging_root / job / f"rank-{rank:05d}"
        try:
            return sorted(n for n in os.listdir(d) if ".step-" in n)
        except FileNotFoundError:
            return []

    def wait_released(self, job: str = JOB, rank: int = 0, timeout_s: float = 120.0) -> None:
        """Untimed: until the evict stage released every staging slot of (job, rank), so the
        next save() finds a free slot at once."""
        deadline = time.monotonic() + timeout_s
        while self.busy_markers(job, rank):
            self.check_agent()
            if time.monotonic() > deadline:
                raise TimeoutError(f"staging slots not released: {self.busy_markers(job, rank)}")
            time.sleep(0.005)

    def close(self) -> None:
        agent, self.agent = self.agent, None
        if agent is not None and agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(30)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
        server, self.server = self.server, None
        if server is not None:
            server.stop()
        for d in (self.staging_root, self.dir):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)
        self.staging_root = self.dir = None
