"""`tierpipe demo`: the whole story on one machine, in about a minute.

Starts an embedded nats-server and S3 store (SeaweedFS) unless `TIERPIPE_NATS_URL` /
`TIERPIPE_S3_ENDPOINT` point at real ones, and two simulated nodes, each a node agent
(`tierpipe worker all`) with its own NVMe folder and staging folder. A small language model
trains on ranks spread over both nodes (DDP over gloo; `tierpipe.dev.trainer`), saving every few
steps. Object storage is slower than the saves, as it is in real clusters: each agent's uploads
are throttled (`flush_max_bytes_per_s`, default here `THROTTLE_BYTES_PER_S`, far below a node's
save rate). Nothing waits for it: node-b is lost at a moment drawn at random (a step between a
third and two thirds of the run, from a seeded RNG: the seed is printed, and `seed` /
`TIERPIPE_DEMO_SEED` replays it): its agent and trainers are SIGKILLed and its NVMe and staging
folders wiped; the survivors' trainers are stopped, as torchrun would. The demo prints what each
tier held at that moment (the newest complete step on NVMe, on peers, in S3, and their lag
behind the newest step trained) and what the restore planner could restore without node-b. The
job restarts with a replacement node (node-c, empty): the survivors' ranks restore from their
NVMe, the replacement's from its partner's replica (the peer tier) where there is one, else from
S3, else the job starts over; every rank trains on. Once training ends the upload throttle is
lifted, so the final checkpoint reaches S3. The demo checks that the steps trained twice had the
same losses to the bit, that each rank's final checkpoint reloads bitwise, that the steps lost
are no more than the tiers' lags at the kill allowed, and prints what it cost: the stall per save
against `torch.save` of the same state, the training-step overhead at the demo's interval, bytes
and seconds per tier (from the event stream), steps lost and seconds to resume. `--plot FILE`
renders the timeline of events per tier to a PNG.
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import signal
import statistics
import time
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path

import anyio
import msgspec

from tierpipe.bus.client import Bus
from tierpipe.control.kvstate import JobStore
from tierpipe.dev.cluster import Attempt, Node, launch
from tierpipe.dev.nats import NatsServer
from tierpipe.dev.s3 import S3Server
from tierpipe.dev.trainer import JOB
from tierpipe.errors import ConfigError, NoCheckpointError
from tierpipe.names import flush_control_subject, job_subjects, msg_id
from tierpipe.progress import Bar, bar
from tierpipe.recovery.kvplan import KvPlan, plan_now
from tierpipe.schemas import (
    Event,
    FlushControl,
    NodeBatch,
    ShardEvicted,
    ShardFlushed,
    ShardReplicated,
    ShardStaged,
    ShardVerified,
    ShardWritten,
)
from tierpipe.schemas.jobstate import JobHead
from tierpipe.settings import Settings

__all__ = ("THROTTLE_BYTES_PER_S", "run_demo")

#: Each agent's upload rate unless `TIERPIPE_FLUSH_MAX_BYTES_PER_S` says otherwise: a node of the
#: demo saves ~8 MiB per rank every save (several per second), so S3 takes a small fraction.
THROTTLE_BYTES_PER_S = 1 << 20

#: Where the story's moments happen: (seconds since the start, what).
Moments = list[tuple[float, str]]


def run_demo(
    settings: Settings,
    *,
    ranks: int,
    steps: int,
    every: int,
    data: str,
    plot: str | None = None,
    seed: int | None = None,
) -> int:
    """Run the demo; 0 when the story held (see the module docstring), else 1. `seed`: the
    kill moment's RNG (default `TIERPIPE_DEMO_SEED`, else drawn; printed either way)."""
    if ranks < 2 or ranks % 2:
        raise ConfigError(f"--ranks must be even: its ranks spread over two nodes (got {ranks})")
    if steps < 4 * every:
        raise ConfigError(f"--steps must be at least 4 x --every (got {steps} and {every})")
    root = Path(data).absolute()
    shutil.rmtree(root, ignore_errors=True)
    (root / "logs").mkdir(parents=True)
    shm = Path(settings.staging_root).absolute() / f"demo-{os.getpid()}"
    per_node = ranks // 2
    if seed is None:
        given = os.environ.get("TIERPIPE_DEMO_SEED", "")
        seed = int(given) if given.strip() else secrets.randbelow(1 << 31)
    rng = random.Random(seed)  # noqa: S311 (a demo's moment, not a secret)
    kill_at = rng.randint(max(every + 1, steps // 3), max(every + 1, steps * 2 // 3))
    throttle = int(os.environ.get("TIERPIPE_FLUSH_MAX_BYTES_PER_S") or THROTTLE_BYTES_PER_S)
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, shm, True)
        base = {
            **os.environ,
            **_services(stack, root),
            "TIERPIPE_NVME_KEEP_LATEST_K": os.environ.get("TIERPIPE_NVME_KEEP_LATEST_K", "3"),
            "TIERPIPE_S3_KEEP_LATEST_K": os.environ.get("TIERPIPE_S3_KEEP_LATEST_K", "3"),
            "TIERPIPE_LOG_LEVEL": os.environ.get("TIERPIPE_LOG_LEVEL", "warning"),
            "TIERPIPE_FLUSH_MAX_BYTES_PER_S": str(throttle),
            # (the demo compresses time: a node record lists a new job from its next beat, and
            # partners are chosen among the nodes whose records list the job)
            "TIERPIPE_NODE_HEARTBEAT_S": os.environ.get("TIERPIPE_NODE_HEARTBEAT_S", "1"),
            "TIERPIPE_METRICS_PORT": "0",  # (two agents on one machine)
            "LOCAL_WORLD_SIZE": str(per_node),
        }
        bus_settings = settings.replace(nats_url=base["TIERPIPE_NATS_URL"])
        nodes = {n: Node(n, root / "nvme" / n, shm / n) for n in ("node-a", "node-b", "node-c")}
        print(f"tierpipe demo: {ranks} ranks on 2 nodes, {steps} steps, a save every {every}")
        print(f"  NATS {base['TIERPIPE_NATS_URL']}   S3 {base['TIERPIPE_S3_ENDPOINT']}"
              f" bucket {base['TIERPIPE_S3_BUCKET']}   data {root}")  # fmt: skip
        print(f"  uploads throttled to {throttle / 2**20:.2f} MiB/s per node; node-b lost at step "
              f"{kill_at} (drawn at random: seed {seed})")  # fmt: skip
        t0 = time.time()
        moments: Moments = []
        for n in ("node-a", "node-b"):
            stack.callback(nodes[n].start(base, root / "logs" / f"agent-{n}.log").stop)
        placement = {r: "node-a" if r < per_node else "node-b" for r in range(ranks)}
        show = stack.enter_context(bar("starting", total=steps, stderr=False))
        first = launch(base, nodes, placement, steps, every, root, attempt=1)
        stack.callback(Attempt.kill, first, list(range(ranks)), signal.SIGKILL)
        if not _train_until(first, at=kill_at, every=every, show=show):
            print(f"the first run ended before step {kill_at} (logs in <data>/logs)")
            return 1
        b_ranks = [r for r, n in placement.items() if n == "node-b"]
        first.kill(b_ranks, signal.SIGKILL)
        nodes["node-b"].lose()
        first.kill([r for r in placement if r not in b_ranks], signal.SIGTERM)
        moments.append((time.time() - t0, "node-b lost"))
        list(first.drain(0.1))
        trained = max(x["step"] for x in first.of("step"))
        print(
            f"\n!! node-b lost at step {trained}: its agent and trainers SIGKILLed, its NVMe "
            "and staging wiped;\n   the survivors' trainers stopped (as torchrun would)"
        )
        allowed = _at_the_kill(bus_settings, trained)
        placement = {r: "node-c" if n == "node-b" else n for r, n in placement.items()}
        stack.callback(nodes["node-c"].start(base, root / "logs" / "agent-node-c.log").stop)
        restart = time.time()
        moments.append((restart - t0, "restart with node-c"))
        print("!! the job restarts: node-b's ranks on node-c (a replacement, its NVMe empty)")
        second = launch(base, nodes, placement, steps, every, root, attempt=2)
        stack.callback(Attempt.kill, second, list(range(ranks)), signal.SIGKILL)
        while second.running():
            for line in second.drain(0.5):
                if line["event"] == "step" and line["rank"] == 0:
                    show(line["step"], what="training on node-a and node-c")
                if line["event"] == "restored":
                    r = line["rank"]
                    what = (f"step {line['step']} from {line['tier']}" if line["tier"] != "none"
                            else "nothing (the job starts over)")  # fmt: skip
                    print(f"   rank {r} on {placement[r]}: restored {what} in "
                          f"{line['restore_s']:.2f} s")  # fmt: skip
        codes = {r: p.wait() for r, p in second.procs.items()}
        if restored := second.of("restored"):
            moments.append((max(x["t"] for x in restored) - t0, "every rank restored"))
        anyio.run(_unthrottle, bus_settings)
        events, in_s3 = anyio.run(_settled, bus_settings, steps)
    return _report(first, second, codes, (events, in_s3), placement, every, t0, restart, moments,
                   plot, allowed)  # fmt: skip


def _train_until(attempt: Attempt, *, at: int, every: int, show: Bar) -> bool:
    """Let the first run train until a rank reports step `at` (nothing waits for any tier);
    False when the run ended first."""
    while attempt.running():
        for line in attempt.drain(0.05):
            if line["event"] == "step":
                if line["rank"] == 0:
                    show(line["step"], what="training on node-a and node-b")
                if line["rank"] == 0 and line["step"] % every == 0:
                    print(f"   step {line['step']:>4}  loss {float.fromhex(line['loss']):.4f}")
                if line["step"] >= at:
                    return True
    return False


def _at_the_kill(settings: Settings, trained: int) -> int:
    """Print what each tier held when node-b was lost (the job state in KV: the newest step
    complete on NVMe, on peers, in S3, and each one's lag behind step `trained`) and what the
    restore planner could restore without node-b; returns the most steps the restart may lose
    (`trained` minus the newest step the lost node's ranks have off the node: on peers or in
    S3; `trained` when there is none)."""
    head = anyio.run(_head, settings)
    newest = {
        "NVMe": head.nvme_steps[-1] if head is not None and head.nvme_steps else None,
        "peers": head.peer_steps[-1] if head is not None and head.peer_steps else None,
        "S3": head.s3_steps[-1] if head is not None and head.s3_steps else None,
    }
    print("   at the kill, the newest step complete on each tier (lag behind step "
          f"{trained}):")  # fmt: skip
    for tier, step in newest.items():
        lag = "nothing there" if step is None else f"lag {trained - step} steps"
        print(f"     {tier:6} {'-' if step is None else step:>5}   ({lag})")
    off_node = [s for s in (newest["peers"], newest["S3"]) if s is not None]
    allowed = trained - max(off_node, default=0)
    plan = anyio.run(_plan, settings, False, ("node-b",))
    said = "nothing restorable" if plan is None else plan.describe().splitlines()[0]
    print(f"   tierpipe plan --lost-node node-b: {said}")
    print(f"   so the restart may lose at most {allowed} steps")
    return allowed


async def _head(settings: Settings) -> JobHead | None:
    async with Bus(settings, name="tierpipe-demo") as bus:
        store = await JobStore(bus.js, settings).open()
        return await store.head(JOB)


async def _unthrottle(settings: Settings) -> None:
    """Lift every agent's upload throttle (`tierpipe flush rate 0`): training is over, and the
    final checkpoint should reach S3 without waiting out the backlog at the throttled rate."""
    control = FlushControl(action="rate", rate_bytes_per_s=0, ts=time.time())
    async with Bus(settings, name="tierpipe-demo") as bus:
        await bus.publish_raw(flush_control_subject(None), msgspec.json.encode(control))


async def _plan(settings: Settings, nvme_lost: bool, lost_nodes: tuple[str, ...]) -> KvPlan | None:
    """What `tierpipe plan` says now (None: no step is restorable yet)."""
    async with Bus(settings, name="tierpipe-demo") as bus:
        store = await JobStore(bus.js, settings).open()
        try:
            _, _, plan = await plan_now(bus, store, JOB, nvme_lost=nvme_lost, lost_nodes=lost_nodes)
        except (NoCheckpointError, ConfigError):
            return None
        return plan


async def _settled(
    settings: Settings, last: int, timeout_s: float = 60.0
) -> tuple[list[Event], bool]:
    """The job's events, each fact once (per rank; a node's batch repeats them), once the last
    step reached S3 on every rank (or `timeout_s` passed), and whether it did (the restore
    planner, NVMe assumed lost, picks it)."""
    deadline = time.monotonic() + timeout_s
    async with Bus(settings, name="tierpipe-demo") as bus:
        while True:
            stored = await bus.history(job_subjects(JOB))
            events: list[Event] = [e for e in stored if not isinstance(e, NodeBatch)]
            seen = {msg_id(e) for e in events}
            for b in stored:  # (what only a node's batch says: the coordinator's removals)
                if isinstance(b, NodeBatch):
                    events += [e for e in b.events if msg_id(e) not in seen]
                    seen.update(msg_id(e) for e in b.events)
            plan = await _plan(settings, True, ())
            in_s3 = plan is not None and plan.step >= last
            if in_s3 or time.monotonic() > deadline:
                return events, in_s3
            await anyio.sleep(0.3)


def _services(stack: ExitStack, root: Path) -> dict[str, str]:
    """NATS and S3 settings: the environment's, or embedded servers on loopback."""
    env = {}
    if "TIERPIPE_NATS_URL" not in os.environ:
        nats = stack.enter_context(NatsServer(root / "nats"))
        env["TIERPIPE_NATS_URL"] = nats.url
    if "TIERPIPE_S3_ENDPOINT" not in os.environ:
        s3 = stack.enter_context(
            S3Server(
                root / "s3",
                access_key=f"demo-{secrets.token_hex(4)}",  # (logs mask it: not a plain word)
                secret_key=secrets.token_hex(16),
                bucket="demo",
            )
        )
        env.update(
            TIERPIPE_S3_ENDPOINT=s3.endpoint,
            TIERPIPE_S3_BUCKET=s3.bucket,
            TIERPIPE_S3_ACCESS_KEY_ID=s3.access_key,
            TIERPIPE_S3_SECRET_ACCESS_KEY=s3.secret_key,
        )
    env.setdefault("TIERPIPE_S3_BUCKET", os.environ.get("TIERPIPE_S3_BUCKET", "tierpipe"))
    env.setdefault("TIERPIPE_S3_ENDPOINT", os.environ.get("TIERPIPE_S3_ENDPOINT", ""))
    return env


def _report(
    first: Attempt,
    second: Attempt,
    codes: dict[int, int],
    settled: tuple[list[Event], bool],
    placement: dict[int, str],
    every: int,
    t0: float,
    restart: float,
    moments: Moments,
    plot: str | None,
    allowed: int,
) -> int:
    """Print the story's table; 0 when it held. `settled`: the job's events, and whether the
    last step is in S3 (`_settled`); `allowed`: the most steps the tiers' lags at the kill let
    the restart lose (`_at_the_kill`)."""
    events, in_s3 = settled
    done = {x["rank"]: x for x in second.of("done")}
    restored = {x["rank"]: x for x in second.of("restored")}
    if len(done) < len(placement) or len(restored) < len(placement):
        print(f"\nthe restarted ranks did not all finish (exit codes {codes}); logs in "
              "<data>/logs")  # fmt: skip
        return 1
    before = {(x["rank"], x["step"]): x["loss"] for x in first.of("step")}
    after = {(x["rank"], x["step"]): x["loss"] for x in second.of("step")}
    twice = sorted(set(before) & set(after))
    same = all(before[k] == after[k] for k in twice)
    trained_to = max(step for _, step in before)
    resumed = min(x["step"] for x in restored.values())
    stalls = [x["stall_s"] for x in first.of("saved") + second.of("saved")]
    stall = statistics.median(stalls)
    torch_save = statistics.median(x["torch_save_s"] for x in done.values())
    step_s = statistics.median(x["step_s"] for x in done.values() if x["step_s"] is not None)
    first_steps = [min(x["t"] for x in second.of("step") if x["rank"] == r) for r in done]
    last = max(x["step"] for x in done.values())
    lost = trained_to - resumed
    tiers_ok = all(
        restored[r]["tier"] in (("peer", "s3", "none") if node == "node-c" else ("nvme", "none"))
        for r, node in placement.items()
    )
    ok = (
        all(c == 0 for c in codes.values())
        and same
        and bool(twice)
        and tiers_ok
        and 0 <= lost <= allowed
        and all(x["bitwise_equal"] for x in done.values())
        and in_s3
    )
    print("\nwhat a save cost the trainer")
    print(f"  stall per save (median of {len(stalls)})      {stall * 1e3:9.2f} ms")
    print(f"  torch.save + fsync of the same state    {torch_save * 1e3:9.2f} ms   "
          f"(tierpipe's stall is {stall / torch_save:.3f}x of it)")  # fmt: skip
    print(f"  training-step overhead, a save every {every} steps: "
          f"{stall / (every * step_s) * 100:.2f} % (step {step_s * 1e3:.0f} ms)")  # fmt: skip
    print("\nwhat the tiers did (from the event stream)")
    for line in _tier_lines(events):
        print("  " + line)
    print("\nthe restart")
    print(f"  steps lost: {lost} (trained to step {trained_to}, resumed from step {resumed}; "
          f"the tiers' lags at the kill allowed at most {allowed})")  # fmt: skip
    started = max(x["t"] for x in second.of("started"))
    print(f"  seconds to resume: {max(first_steps) - restart:.1f}, from the restart to the first "
          "step trained on every rank:")  # fmt: skip
    print(f"    {started - restart:5.1f} s  new processes start, import Python modules and torch")
    ready = max(x["t"] for x in restored.values())
    restore_s = max(x["restore_s"] for x in restored.values())
    print(f"    {ready - started - restore_s:5.1f} s  connect (gloo, NATS), find the newest step")
    print(f"    {restore_s:5.1f} s  restore(): the job state made current, the plan, every byte "
          "read and checked")  # fmt: skip
    for r in sorted(restored):
        if restored[r]["tier"] == "none":
            print(f"  rank {r} on {placement[r]}: restored nothing (started over from step 0: "
                  f"{restored[r].get('why', '')})")  # fmt: skip
        else:
            print(f"  rank {r} on {placement[r]}: restored step {restored[r]['step']} from "
                  f"{restored[r]['tier']}")  # fmt: skip
    print(f"  the {len(twice)} losses of the steps trained twice (after step {resumed}) are "
          f"identical to the bit: {same and bool(twice)}")  # fmt: skip
    print(f"  every rank's final checkpoint (step {last}) reloads bitwise: "
          f"{all(x['bitwise_equal'] for x in done.values())}; it is in S3: "
          f"{in_s3}")  # fmt: skip
    if plot:
        from tierpipe.dev.timeline import render

        render(events, moments, t0=t0, path=Path(plot))
        print(f"\ntimeline: {plot}")
    print(f"\n{'the story held' if ok else 'THE STORY DID NOT HOLD'} "
          f"({time.time() - t0:.0f} s)")  # fmt: skip
    return 0 if ok else 1


def _tier_lines(events: list[Event]) -> list[str]:
    """Copies, bytes and seconds per tier: RAM (the trainers' staging copies), NVMe write and
    verify, peer replicas, S3 flush, and evictions per tier (the copies of saves: not a
    restore's write-back of what it read from S3)."""
    rows: dict[str, list[tuple[int, float]]] = defaultdict(list)
    evicted: dict[str, int] = defaultdict(int)
    flushed: set[tuple[int, int, str]] = set()
    for e in events:
        match e:
            case ShardStaged(origin="save"):
                rows["RAM (staged)"].append((e.nbytes, e.stall_s))
            case ShardWritten(origin="save"):
                rows["NVMe write"].append((e.nbytes, e.seconds))
            case ShardVerified(origin="save"):
                rows["NVMe verify"].append((e.nbytes, e.seconds))
            case ShardReplicated():
                rows["peer replica"].append((e.nbytes, e.seconds))
            case ShardFlushed() if (e.step, e.rank, e.header_digest) not in flushed:
                flushed.add((e.step, e.rank, e.header_digest))  # (a copy found there: once)
                rows["S3 flush"].append((e.nbytes, e.seconds))
            case ShardEvicted():
                evicted[e.tier] += 1
    out = [f"{'':14}{'copies':>7}{'MiB':>9}{'seconds':>9}{'MiB/s':>8}"]
    for name, got in rows.items():
        nbytes, seconds = sum(b for b, _ in got), sum(s for _, s in got)
        rate = f"{nbytes / 2**20 / seconds:8.0f}" if seconds > 0 else f"{'':8}"
        out.append(f"{name:14}{len(got):7}{nbytes / 2**20:9.1f}{seconds:9.2f}{rate}")
    out.append("evicted       " + ", ".join(f"{t} {n}" for t, n in sorted(evicted.items())))
    return out
