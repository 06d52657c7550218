"""`tierpipe demo`: a small end-to-end session on this machine.

Starts an embedded nats-server (unless `TIERPIPE_NATS_URL` is set) and one node agent
(`tierpipe worker all`), then a few trainer ranks as separate processes, each training a tiny
transformer and saving every few steps. At the end it replays the event stream and prints where
every shard is and whether it verified; each rank reloads its last shard from NVMe and checks it
bitwise against its live state.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio

from pipeline.embedded import NatsServer
from pipeline.settings import Settings

__all__ = ["run_demo"]

_JOB = "demo"
_NODE = "demo-node"


def run_demo(settings: Settings, *, ranks: int, steps: int, every: int, data: str) -> int:
    from pipeline.cli import replay_catalog, shard_table

    root = Path(data).absolute()
    shutil.rmtree(root, ignore_errors=True)
    staging = Path(settings.staging_root).absolute() / f"demo-{os.getpid()}"
    server = None
    if "TIERPIPE_NATS_URL" in os.environ:
        url = os.environ["TIERPIPE_NATS_URL"]
    else:
        server = NatsServer(root / "nats").start()
        url = server.url
    env = {
        **os.environ,
        "TIERPIPE_NATS_URL": url,
        "TIERPIPE_NODE": _NODE,
        "TIERPIPE_NVME_ROOT": str(root / "nvme"),
        "TIERPIPE_STAGING_ROOT": str(staging),
        "TIERPIPE_LOG_LEVEL": os.environ.get("TIERPIPE_LOG_LEVEL", "warning"),
    }
    print(
        f"tierpipe demo: {ranks} ranks x {steps} steps, a save every {every}; "
        f"NATS {'embedded' if server else url}"
    )
    print(f"  NVMe root {env['TIERPIPE_NVME_ROOT']}\n  staging   {staging}")
    agent = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "worker", "all"], env=env)
    t0 = time.monotonic()
    try:
        trainers = [
            subprocess.Popen(
                [sys.executable, "-m", "pipeline.demo", str(r), str(ranks), str(steps), str(every)],
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
        demo_settings = settings.replace(nats_url=url)
        catalog = anyio.run(replay_catalog, demo_settings, _JOB)
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(30)
        except subprocess.TimeoutExpired:
            agent.kill()
        if server is not None:
            server.stop()
        shutil.rmtree(staging, ignore_errors=True)
    shards = catalog.shards(_JOB)
    print("\nshards (from the event stream):")
    print(shard_table(shards))
    print("\ntrainers:")
    for r in results:
        print(
            f"  rank {r['rank']}: step {r['step']} reloaded from NVMe, bitwise equal to the live "
            f"state: {r['bitwise_equal']}; longest save() stall {r['max_stall_ms']:.2f} ms"
        )
    ok = all(r["bitwise_equal"] for r in results) and all(
        any(c.tier == "nvme" and c.verified for c in s.copies.values()) for s in shards
    )
    print(f"\n{len(shards)} shards, all verified on NVMe: {ok}  ({time.monotonic() - t0:.1f} s)")
    return 0 if ok else 1


def _train(rank: int, world_size: int, steps: int, every: int) -> dict[str, object]:
    """One trainer rank (run in its own process)."""
    import torch

    from pipeline.client import Checkpointer
    from pipeline.state import load_shard

    torch.manual_seed(1234 + rank)
    random.seed(rank)
    vocab, dim = 256, 64
    embed = torch.nn.Embedding(vocab, dim)
    body = torch.nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=128, batch_first=True)
    head = torch.nn.Linear(dim, vocab, bias=False)
    head.weight = embed.weight  # tied weights must come back tied
    model = torch.nn.ModuleDict({"embed": embed, "body": body, "head": head})
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handles, stalls = [], []
    with Checkpointer(_JOB, rank=rank, world_size=world_size) as ckpt:
        for step in range(1, steps + 1):
            tokens = torch.randint(0, vocab, (8, 32))
            logits = model["head"](model["body"](model["embed"](tokens)))
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
            optim.zero_grad()
            loss.backward()
            optim.step()
            if step % every == 0:
                t = time.perf_counter()
                handles.append(
                    ckpt.save(
                        step,
                        {
                            "model": model,
                            "optim": optim,
                            "step": step,
                            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
                        },
                    )
                )
                stalls.append(time.perf_counter() - t)
        verified = handles[-1].wait("verified", timeout=120)
    _, saved = load_shard(verified.path)
    live = model.state_dict()
    equal = all(torch.equal(saved["model"][k], v) for k, v in live.items())
    equal &= saved["model"]["embed.weight"].data_ptr() == saved["model"]["head.weight"].data_ptr()
    return {
        "rank": rank,
        "step": handles[-1].step,
        "bitwise_equal": bool(equal),
        "max_stall_ms": max(stalls) * 1e3,
    }


if __name__ == "__main__":
    rank, world, n_steps, n_every = map(int, sys.argv[1:5])
    print(json.dumps(_train(rank, world, n_steps, n_every)))
