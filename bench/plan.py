"""`python -m bench plan`: the control plane at scale, recovery planning and event replay, on
synthetic events (no shard data, so `--size-gib` and `--reps` do not apply).

- `plan_s_1024x20`: `plan_recovery` on a synthetic catalog of 1024 ranks x 20 steps (`written`,
  `verified`, `flushed` for every shard, 8 ranks per node, 3 nodes dead and replaced, the newest
  step incomplete: not flushed yet, so the replaced nodes' ranks have no copy of it), median of
  `PLAN_RUNS` runs (it must reject step 20 and plan step 19).
- `replay_s_100k`: `Bus.history` of 100,000 events from an embedded nats-server (published
  untimed with `js.publish_async`) plus folding them into a `Catalog`, median of `REPLAY_RUNS`;
  `replay_history_s` and `replay_fold_s` split it.
- `plan_fold_s_1024x20`: folding that catalog's events into a `Catalog`, once, before the timed
  plan runs.

`plan_s_1024x20` has a target: < 2 s.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.common import GiB, ShardIdent, fmt, log, median, remove, scratch_dir

__all__ = ["run"]

#: Planning at scale: ranks, steps, ranks per node, dead nodes.
PLAN_RANKS, PLAN_STEPS, PLAN_PER_NODE, PLAN_DEAD = 1024, 20, 8, (5, 50, 100)
PLAN_RUNS = 7
REPLAY_EVENTS = 100_000
REPLAY_RUNS = 3
#: The bucket the synthetic `flushed` events name (nothing is uploaded).
BUCKET = "tierpipe-bench"


def _events(job: str, ranks: int, steps: int, per_node: int, digest: str) -> list[list[Any]]:
    """Per step, `written`, `verified`, `flushed` of every rank (in that order per rank)."""
    from tierpipe.schemas import ShardFlushed, ShardVerified, ShardWritten

    out = []
    ts = time.time()
    for step in range(1, steps + 1):
        batch: list[Any] = []
        for rank in range(ranks):
            node = f"node-{rank // per_node:03d}"
            rel = f"{job}/step-{step:012d}/rank-{rank:05d}-of-{ranks:05d}.shard"
            ident = ShardIdent(job=job, node=node, ts=ts, step=step, rank=rank, world_size=ranks)
            path = f"/nvme/{rel}"
            batch += [
                ShardWritten(**ident, path=path, nbytes=GiB, header_digest=digest, tensors=205,
                             seconds=1.0),
                ShardVerified(**ident, path=path, nbytes=GiB, header_digest=digest, seconds=1.0),
                ShardFlushed(**ident, bucket=BUCKET, key=rel, etag="e", checksum="c",
                             header_digest=digest, nbytes=GiB, seconds=10.0),
            ]  # fmt: skip
        out.append(batch)
    return out


def _plan_at_scale() -> dict[str, float]:
    from tests.oracle_catalog import Catalog
    from tests.oracle_plan import plan_recovery

    job, digest = "plan", "0" * 32
    batches = _events(job, PLAN_RANKS, PLAN_STEPS, PLAN_PER_NODE, digest)
    # The newest step is not flushed yet: its NVMe copies are all it has.
    batches[-1] = [e for e in batches[-1] if type(e).__name__ != "ShardFlushed"]
    events = [e for b in batches for e in b]
    catalog = Catalog()
    t0 = time.perf_counter()
    for e in events:
        catalog.apply(e)
    fold = time.perf_counter() - t0
    dead = {f"node-{n:03d}" for n in PLAN_DEAD}
    rank_nodes: dict[int, str] = {}
    local_steps: dict[int, list[int]] = {}
    for rank in range(PLAN_RANKS):
        node = f"node-{rank // PLAN_PER_NODE:03d}"
        if node in dead:  # a replacement node, with an empty NVMe
            rank_nodes[rank] = f"spare-{rank // PLAN_PER_NODE:03d}"
            local_steps[rank] = []
        else:
            rank_nodes[rank] = node
            local_steps[rank] = list(range(1, PLAN_STEPS + 1))
    times = []
    plan = None
    for _ in range(PLAN_RUNS):
        t0 = time.perf_counter()
        plan = plan_recovery(
            catalog,
            job,
            world_size=PLAN_RANKS,
            alive=set(rank_nodes.values()),
            rank_nodes=rank_nodes,
            local_steps=local_steps,
        )
        times.append(time.perf_counter() - t0)
    assert plan is not None
    from_s3 = sum(1 for srcs in plan.sources.values() if srcs[0].tier == "s3")
    if plan.step != PLAN_STEPS - 1 or PLAN_STEPS not in plan.rejected:
        raise RuntimeError(f"plan picked step {plan.step}, rejected {sorted(plan.rejected)}")
    if from_s3 != PLAN_PER_NODE * len(PLAN_DEAD):
        raise RuntimeError(f"plan reads {from_s3} ranks from object storage")
    log(f"  plan 1024x20 ({len(events)} events, fold {fold:.3f} s): step {plan.step}, "
        f"{from_s3} ranks from S3; {fmt(times)}")  # fmt: skip
    return {"plan": median(times), "plan_fold": fold}


def _replay_at_scale(work: Path) -> dict[str, float]:
    import anyio

    from tests.oracle_catalog import Catalog
    from tierpipe.bus.client import KIND_HEADER, SCHEMA_HEADER, Bus
    from tierpipe.dev import NatsServer
    from tierpipe.names import event_subject, msg_id
    from tierpipe.schemas import SCHEMA_VERSION, encode_event
    from tierpipe.settings import load_settings

    job = "replay"
    steps = -(-REPLAY_EVENTS // (PLAN_RANKS * 3))
    events = [e for b in _events(job, PLAN_RANKS, steps, PLAN_PER_NODE, "1" * 32) for e in b]
    events = events[:REPLAY_EVENTS]
    server = NatsServer(work / "replay-nats")
    try:
        server.start()
        settings = load_settings(
            path=None, env={"TIERPIPE_NATS_URL": server.url, "TIERPIPE_LOG_LEVEL": "warning"}
        )

        async def go() -> dict[str, list[float]]:
            async with Bus(settings, name="bench-replay") as bus:
                await bus.ensure_stream(job)
                t0 = time.perf_counter()
                for e in events:
                    headers = {
                        "Nats-Msg-Id": msg_id(e),
                        KIND_HEADER: type(e).__struct_config__.tag,
                        SCHEMA_HEADER: str(SCHEMA_VERSION),
                    }
                    await bus.js.publish_async(
                        event_subject(e),
                        encode_event(e),
                        stream=bus.stream(event_subject(e)),
                        headers=headers,
                    )
                await bus.js.publish_async_completed()
                log(f"  published {len(events)} events in {time.perf_counter() - t0:.1f} s")
                out: dict[str, list[float]] = {"history": [], "fold": [], "replay": []}
                for _ in range(REPLAY_RUNS):
                    t0 = time.perf_counter()
                    got = await bus.history(f"tp.{job}.>")
                    t1 = time.perf_counter()
                    catalog = Catalog()
                    for e in got:
                        catalog.apply(e)
                    t2 = time.perf_counter()
                    if len(got) != len(events):
                        raise RuntimeError(f"replayed {len(got)} of {len(events)} events")
                    if len(catalog.shards(job)) != -(-len(events) // 3):
                        raise RuntimeError("replayed catalog has the wrong number of shards")
                    out["history"].append(t1 - t0)
                    out["fold"].append(t2 - t1)
                    out["replay"].append(t2 - t0)
                return out

        times = anyio.run(go, backend_options={"use_uvloop": True})
    finally:
        server.stop()
        remove(work / "replay-nats")
    history, fold = median(times["history"]), median(times["fold"])
    log(f"  replay {len(events)} events: {fmt(times['replay'])} "
        f"(history {history:.3f} s, fold {fold:.3f} s)")  # fmt: skip
    return {k: median(v) for k, v in times.items()}


def run(size_gib: float, reps: int) -> dict[str, float]:
    del size_gib, reps  # synthetic events only; the run counts are fixed above
    from tierpipe.log import configure_logging

    # structlog's defaults print to stdout, which must carry only the JSON line.
    configure_logging("warning", "json", only_if_unconfigured=True)
    log("plan: planning and replay at scale")
    scale = _plan_at_scale()
    with scratch_dir("plan") as work:
        scale.update(_replay_at_scale(work))
    result = {
        "plan_s_1024x20": scale["plan"],
        "replay_s_100k": scale["replay"],
        "replay_history_s": scale["history"],
        "replay_fold_s": scale["fold"],
        "plan_fold_s_1024x20": scale["plan_fold"],
    }
    ok = result["plan_s_1024x20"] < 2.0
    log(f"plan_s_1024x20 = {result['plan_s_1024x20']:.3f}: "
        f"{'meets' if ok else 'MISSES'} the target < 2 s")  # fmt: skip
    return result
