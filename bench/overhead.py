"""`python -m bench overhead [--size-gib S] [--reps N]`: what a save every `EVERY` steps costs a
real training loop on this machine.

A small real model (an MLP whose parameters and AdamW state make about `--size-gib` of
checkpoint, 0.05 GiB by default for this bench) trains on the CPU for `STEPS` steps, three ways,
in shuffled order within each rep: no checkpoints (`base`); `save()` every `EVERY` steps
(`blocking`); `save(blocking=False)` with `guard(optimizer)` (`overlapped`). A node agent runs
throughout (nvme-write, verify, evict: NVMe only), as on a real node, competing for the same
cores. Figures are medians over the reps:

- `overhead_pct_blocking`, `overhead_pct_overlapped`: (run time / base run time - 1) x 100;
  the target is <= 5 % at `EVERY`.
- `stall_s_per_save_*`: the time `save()` itself took (the trainer's blocking share).
- `agent_cpu_s_per_save`: the agent's CPU per save (its process, from /proc), which on a
  machine with fewer cores than training threads plus the agent's comes out of training time.
- `explained_pct_*`: the stall's and the agent's share of the overhead (stall x saves / base,
  agent CPU / cores / base), to read the rest as noise or contention.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import torch

from bench.common import Deployment, fmt, log, median

STEPS = 300
EVERY = 50
BATCH = 64
DEFAULT_SIZE_GIB = 0.05


def run(size_gib: float, reps: int) -> dict[str, Any]:
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    times: dict[str, list[float]] = {"base": [], "blocking": [], "overlapped": []}
    stalls: dict[str, list[float]] = {"blocking": [], "overlapped": []}
    agent_cpu: list[float] = []
    with Deployment("overhead", stages=("nvme-write", "verify", "evict")) as dep:
        width, state_bytes = _width(size_gib)
        log(f"overhead: MLP of width {width} ({state_bytes / 2**20:.0f} MiB of checkpoint), "
            f"{STEPS} steps, a save every {EVERY}, {reps} reps")  # fmt: skip
        _train(width, None, "warmup", STEPS // 3)  # (the first run's allocations, caches)
        runs = 0
        for rep in range(reps):
            modes = list(times)
            random.Random(rep).shuffle(modes)
            for mode in modes:
                runs += 1
                ckpt = None if mode == "base" else dep.checkpointer()
                cpu0 = _cpu_s(dep.agent.pid) if dep.agent else 0.0
                try:
                    # (one job: each run's steps come after the last run's)
                    elapsed, stall = _train(width, ckpt, mode, STEPS, step0=runs * STEPS)
                    if ckpt is not None:
                        ckpt.wait_until_finished(timeout=120)
                finally:
                    if ckpt is not None:
                        ckpt.close()
                dep.check_agent()
                times[mode].append(elapsed)
                if mode != "base":
                    stalls[mode].append(stall)
                    agent_cpu.append(_cpu_s(dep.agent.pid) - cpu0 if dep.agent else 0.0)
                log(f"  rep {rep} {mode}: {elapsed:.3f} s (save() {stall * 1e3:.1f} ms total)")
    base = median(times["base"])
    saves = STEPS // EVERY
    cores = os.cpu_count() or 1
    out: dict[str, Any] = {
        "steps": STEPS, "every": EVERY, "saves_per_run": saves, "reps": reps,
        "state_mib": round(state_bytes / 2**20, 1), "cores": cores,
        "base_s": base,
    }  # fmt: skip
    per_save_agent = median(agent_cpu) / saves
    for mode in ("blocking", "overlapped"):
        t = median(times[mode])
        pct = (t / base - 1) * 100
        stall = median(stalls[mode]) / saves
        out[f"{mode}_s"] = t
        out[f"overhead_pct_{mode}"] = round(pct, 2)
        out[f"stall_s_per_save_{mode}"] = stall
        out[f"explained_pct_{mode}"] = {
            "stall": round(stall * saves / base * 100, 2),
            "agent_cpu": round(per_save_agent * saves / cores / base * 100, 2),
        }
        log(f"{mode}: {fmt(times[mode])} s vs base {fmt(times['base'])} s: {pct:+.1f} % "
            f"({'meets' if pct <= 5 else 'MISSES'} the target <= 5 %)")  # fmt: skip
    out["agent_cpu_s_per_save"] = per_save_agent
    out["notes"] = (
        "medians over reps; the agent (nvme-write, verify, evict) runs during every mode and "
        "takes CPU only around saves; explained_pct: the overhead the save() stall and the "
        "agent's CPU (spread over the cores) account for"
    )
    return out


def _width(size_gib: float) -> tuple[int, int]:
    """The MLP width whose parameters and AdamW state (3 copies, fp32) make about `size_gib`."""
    target = size_gib * 2**30 / (3 * 4)  # parameters
    width = max(64, int((target / 4) ** 0.5) // 64 * 64)
    params = 4 * (width * width + width)
    return width, params * 3 * 4


def _model(width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers[:-1])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _train(width: int, ckpt: Any, mode: str, steps: int, *, step0: int = 0) -> tuple[float, float]:
    """(seconds for `steps` steps, seconds inside save() in all)."""
    model, optim = _model(width)
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(BATCH, width, generator=g) for _ in range(8)]
    if ckpt is not None and mode == "overlapped":
        ckpt.guard(optim)
    stall = 0.0
    t0 = time.perf_counter()
    for step in range(steps):
        x = data[step % len(data)]
        loss = model(x).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        if ckpt is not None and (step + 1) % EVERY == 0:
            s0 = time.perf_counter()
            ckpt.save(step0 + step, {"model": model, "optim": optim, "step": step},
                      blocking=mode == "blocking")  # fmt: skip
            stall += time.perf_counter() - s0
    return time.perf_counter() - t0, stall


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
