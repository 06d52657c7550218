"""One trainer rank for the chaos test (run as its own process, like torchrun would).

    python tests/chaos_rank.py JOB RANK WORLD STEPS EVERY OUT [resume]

Trains a small MLP on data drawn from the global torch RNG, saving model, optimizer, step and
RNG states every EVERY steps. Without `resume` it starts from scratch; with it, it restores first
(from wherever tierpipe finds the newest complete step) and continues to STEPS. It appends one
JSON line per event to OUT: `saved` (step, digest of the state), `step` (progress), `restored`
(step, tier, seconds since the process started, digest after restore) and `done` (final digest).
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import signal
import sys
import time

T0 = time.monotonic()

import torch  # noqa: E402

from tierpipe.trainer.checkpointer import Checkpointer  # noqa: E402


def digest(model: torch.nn.Module, optim: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    for st in optim.state_dict()["state"].values():
        for t in st.values():
            if isinstance(t, torch.Tensor):
                h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    h.update(torch.get_rng_state().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # (the test's stacks of a hang)
    job, rank, world, steps, every, out = sys.argv[1], *map(int, sys.argv[2:6]), sys.argv[6]
    resume = len(sys.argv) > 7 and sys.argv[7] == "resume"
    torch.manual_seed(100 + rank)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    log = open(out, "a", buffering=1)  # noqa: SIM115

    def emit(**record: object) -> None:
        log.write(json.dumps({"rank": rank, **record}) + "\n")

    with Checkpointer(job, rank=rank, world_size=world) as ckpt:
        ckpt.guard(optim)
        start = 1
        if resume:
            restored = ckpt.restore({"model": model, "optim": optim})
            torch.set_rng_state(restored.state["rng"])
            start = restored.step + 1
            emit(
                event="restored",
                step=restored.step,
                tier=restored.source.tier,
                seconds=time.monotonic() - T0,
                digest=digest(model, optim),
            )
        for step in range(start, steps + 1):
            x = torch.randn(16, 32)
            loss = (model(x) - x.sum(dim=1, keepdim=True).sin()).square().mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
            if step % every == 0:
                ckpt.save(
                    step,
                    {"model": model, "optim": optim, "step": step, "rng": torch.get_rng_state()},
                )
                emit(event="saved", step=step, digest=digest(model, optim))
            emit(event="step", step=step)
            time.sleep(0.05)
        ckpt.wait_until_finished(timeout=180)  # (a loaded machine verifies slowly)
    emit(event="done", step=steps, digest=digest(model, optim))


if __name__ == "__main__":
    main()
