"""`tierpipe demo`: a small end-to-end session on this machine.

Starts an embedded nats-server and S3 store (SeaweedFS) unless `TIERPIPE_NATS_URL` /
`TIERPIPE_S3_ENDPOINT` point at real ones, one node agent (`tierpipe worker all`), then a few
trainer ranks as separate processes, each training a tiny transformer and saving every few steps.
Retention keeps the newest 2 complete steps on NVMe and 3 in S3, so older steps are evicted as
the run goes. At the end every rank restores the newest checkpoint into a fresh model (rank 0
plans, all ranks load, as after a restart) and checks it bitwise against its live state, and the
demo prints where every shard is, from the event stream.

`tierpipe demo --rank R --ranks W --steps S --every N` runs one trainer rank alone (what the demo
starts per rank, and compose.yaml's trainer) and prints one JSON line.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anyio

from tierpipe.catalog import Catalog
from tierpipe.dev.nats import NatsServer
from tierpipe.dev.s3 import S3Server
from tierpipe.settings import Settings
from tierpipe.status import shard_table

__all__ = ("Replay", "run_demo", "run_rank")

#: Folds every stored event of a job into a catalog (`tierpipe.cli.replay_catalog`).
Replay = Callable[[Settings, str], Awaitable[Catalog]]

_JOB = "demo"
_NODE = "demo-node"


def run_demo(
    settings: Settings, *, ranks: int, steps: int, every: int, data: str, replay: Replay
) -> int:
    """Run the demo; 0 when every rank restored bitwise and the newest step reached S3.

    Args:
        replay: how to read the job's catalog from the event stream (the CLI passes its own, so
            the dev harness does not import the CLI that imports it).
    """
    root = Path(data).absolute()
    shutil.rmtree(root, ignore_errors=True)
    staging = Path(settings.staging_root).absolute() / f"demo-{os.getpid()}"
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, staging, True)
        env = {**os.environ, **_services(stack, root)}
        env.update(
            TIERPIPE_NODE=_NODE,
            TIERPIPE_NVME_ROOT=str(root / "nvme"),
            TIERPIPE_STAGING_ROOT=str(staging),
            TIERPIPE_NVME_KEEP_LATEST_K=os.environ.get("TIERPIPE_NVME_KEEP_LATEST_K", "2"),
            TIERPIPE_S3_KEEP_LATEST_K=os.environ.get("TIERPIPE_S3_KEEP_LATEST_K", "3"),
            TIERPIPE_LOG_LEVEL=os.environ.get("TIERPIPE_LOG_LEVEL", "warning"),
        )
        demo = settings.replace(
            nats_url=env["TIERPIPE_NATS_URL"],
            nvme_keep_latest_k=int(env["TIERPIPE_NVME_KEEP_LATEST_K"]),
        )
        print(f"tierpipe demo: {ranks} ranks x {steps} steps, a save every {every}")
        print(
            f"  NATS      {env['TIERPIPE_NATS_URL']}\n  S3        {env['TIERPIPE_S3_ENDPOINT']}"
            f" bucket {env['TIERPIPE_S3_BUCKET']}\n  NVMe root {env['TIERPIPE_NVME_ROOT']}"
            f"\n  staging   {staging}"
        )
        t0 = time.monotonic()
        agent = subprocess.Popen([sys.executable, "-m", "tierpipe.cli", "worker", "all"], env=env)
        stack.callback(_stop, agent)
        trainer = [sys.executable, "-m", "tierpipe.cli", "demo", "--ranks", str(ranks),
                   "--steps", str(steps), "--every", str(every), "--rank"]  # fmt: skip
        trainers = [
            subprocess.Popen(
                [*trainer, str(r)],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
            for r in range(ranks)
        ]
        results = []
        for p in trainers:
            out, _ = p.communicate(timeout=300)
            if p.returncode != 0:
                print(f"trainer exited with {p.returncode}", file=sys.stderr)
                return 1
            results.append(json.loads(out.strip().splitlines()[-1]))
        last = max(r["step"] for r in results)
        catalog = anyio.run(_settled, demo, last, replay)
    shards = catalog.shards(_JOB)
    print("\nshards (from the event stream):")
    print(shard_table(shards))
    print("\ntrainers:")
    for r in results:
        print(
            f"  rank {r['rank']}: restored step {r['step']} from {r['tier']} in "
            f"{r['restore_ms']:.0f} ms, bitwise equal to the live state: {r['bitwise_equal']}; "
            f"longest save() stall {r['max_stall_ms']:.2f} ms"
        )
    newest_on_s3 = catalog.complete_steps(_JOB, ("s3",))
    ok = all(r["bitwise_equal"] for r in results) and last in newest_on_s3
    print(
        f"\nnewest step {last} verified on NVMe and flushed to S3 for every rank: "
        f"{last in newest_on_s3}; steps complete on NVMe "
        f"{catalog.complete_steps(_JOB, ('nvme',))}, in S3 {newest_on_s3} "
        f"({time.monotonic() - t0:.1f} s)"
    )
    return 0 if ok else 1


def _services(stack: ExitStack, root: Path) -> dict[str, str]:
    """NATS and S3 settings: the environment's, or embedded servers on loopback."""
    env = {}
    if "TIERPIPE_NATS_URL" not in os.environ:
        nats = stack.enter_context(NatsServer(root / "nats"))
        env["TIERPIPE_NATS_URL"] = nats.url
    if "TIERPIPE_S3_ENDPOINT" not in os.environ:
        s3 = stack.enter_context(
            S3Server(
                root / "s3", access_key="demo", secret_key=secrets.token_hex(16), bucket="demo"
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


async def _settled(
    settings: Settings, last: int, replay: Replay, timeout_s: float = 60.0
) -> Catalog:
    """The job's catalog once the newest step reached S3 on every rank and retention caught up."""
    deadline = time.monotonic() + timeout_s
    while True:
        catalog = await replay(settings, _JOB)
        flushed = last in catalog.complete_steps(_JOB, ("s3",))
        nvme = catalog.complete_steps(_JOB, ("nvme",))
        if (flushed and len(nvme) <= settings.nvme_keep_latest_k) or time.monotonic() > deadline:
            return catalog
        await anyio.sleep(0.2)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _model(seed: int) -> tuple[Any, Any]:
    import torch

    torch.manual_seed(seed)
    vocab, dim = 256, 64
    embed = torch.nn.Embedding(vocab, dim)
    body = torch.nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=128, batch_first=True)
    head = torch.nn.Linear(dim, vocab, bias=False)
    head.weight = embed.weight  # tied weights must come back tied
    model = torch.nn.ModuleDict({"embed": embed, "body": body, "head": head})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def run_rank(rank: int, world_size: int, steps: int, every: int) -> dict[str, object]:
    """One trainer rank (run in its own process): train and save, then restore into a fresh
    model the way a restarted job would, and compare with the live state."""
    import torch

    from tierpipe.client import Checkpointer

    random.seed(rank)
    model, optim = _model(1234 + rank)
    stalls = []
    with Checkpointer(_JOB, rank=rank, world_size=world_size) as ckpt:
        for step in range(1, steps + 1):
            tokens = torch.randint(0, 256, (8, 32))
            logits = model["head"](model["body"](model["embed"](tokens)))
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
            optim.zero_grad()
            loss.backward()
            optim.step()
            if step % every == 0:
                t = time.perf_counter()
                state = {
                    "model": model,
                    "optim": optim,
                    "step": step,
                    "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
                }
                ckpt.save(step, state)
                stalls.append(time.perf_counter() - t)
        ckpt.wait_until_finished(timeout=120)
        fresh, fresh_optim = _model(0)  # what a restarted rank would build, then restore into
        restored = ckpt.restore({"model": fresh, "optim": fresh_optim})
    equal = all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
    equal &= fresh["embed"].weight.data_ptr() == fresh["head"].weight.data_ptr()
    return {
        "rank": rank,
        "step": restored.step,
        "tier": restored.source.tier,
        "restore_ms": restored.seconds * 1e3,
        "bitwise_equal": bool(equal),
        "max_stall_ms": max(stalls) * 1e3,
    }
