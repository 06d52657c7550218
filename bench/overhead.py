"""`python -m bench overhead [--size-gib S] [--reps N] [--quick]`: what a save every `EVERY`
steps costs a real training loop on this machine.

A small real model (an MLP whose parameters and AdamW state make about `--size-gib` of
checkpoint, 0.05 GiB by default for this bench) trains on the CPU for `STEPS` steps, three ways,
back to back in this one process: no checkpoints (`base`); `save()` every `EVERY` steps
(`blocking`); `save(blocking=False)` with `guard(optimizer)` (`overlapped`). A node agent runs
throughout (nvme-write, verify, evict: NVMe only), as on a real node, competing for the same
cores. One round runs the three modes in that order, the next in the reverse order, and so on
(a drift costs every mode alike); each round gives one ratio per mode (its time over the same
round's base time). At least `--reps` rounds, then more until the 90 % interval of
both modes' median ratio is within ±`HALF_WIDTH` (2 %) of it, or `MAX_ROUNDS` rounds or
`BUDGET_S` seconds are spent (`interval_reached` false, and the log says so); a spent time
budget ends the run after 2 rounds even short of `--reps` (a machine too loaded to measure
on). `--quick`: a smaller model, fewer steps and a smaller budget (`bench all --quick`).

- `overhead_pct_blocking`, `overhead_pct_overlapped`: (median per-round ratio - 1) x 100, with
  `_lo`, `_hi` (the interval, same units) and `_verdict` (met / missed / undecided against the
  target: <= 5 % at `EVERY`).
- `base_s`, `blocking_s`, `overlapped_s`: median run times; `stall_s_per_save_*`: the time
  `save()` itself took (the trainer's blocking share).
- `agent_cpu_s_per_save`: the agent's CPU per save (its process, from /proc), which on a
  machine with fewer cores than training threads plus the agent's comes out of training time.
- `explained_pct_*`: the stall's and the agent's share of the overhead (stall x saves / base,
  agent CPU / cores / base), to read the rest as noise or contention.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from bench.common import Deployment, fmt, log, median
from bench.paired import alternate, paired, record

__all__ = ["run"]

STEPS = 300
EVERY = 50
BATCH = 64
DEFAULT_SIZE_GIB = 0.05
#: The interval the rounds aim for (relative half-width), the target, and the budgets.
HALF_WIDTH = 0.02
TARGET_PCT = 5.0
MAX_ROUNDS = 20
BUDGET_S = 900.0
#: `--quick`: state size cap, steps, save interval (the target's), rounds and budget.
QUICK_GIB, QUICK_STEPS, QUICK_EVERY, QUICK_MAX_ROUNDS, QUICK_BUDGET_S = 0.01, 200, EVERY, 8, 120.0

_MODES = ("base", "blocking", "overlapped")


def run(size_gib: float, reps: int, *, quick: bool = False) -> dict[str, Any]:
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    steps, every, max_rounds, budget_s = STEPS, EVERY, max(reps, MAX_ROUNDS), BUDGET_S
    if quick:
        size_gib, steps, every = min(size_gib, QUICK_GIB), QUICK_STEPS, QUICK_EVERY
        max_rounds, budget_s = max(reps, QUICK_MAX_ROUNDS), QUICK_BUDGET_S
    times: dict[str, list[float]] = {mode: [] for mode in _MODES}
    stalls: dict[str, list[float]] = {"blocking": [], "overlapped": []}
    agent_cpu: list[float] = []
    reached = False
    with Deployment("overhead", stages=("nvme-write", "verify", "evict")) as dep:
        width, state_bytes = _width(size_gib)
        log(f"overhead: MLP of width {width} ({state_bytes / 2**20:.0f} MiB of checkpoint), "
            f"{steps} steps, a save every {every}, {reps} to {max_rounds} rounds, "
            f"{budget_s:g} s budget")  # fmt: skip
        _train(width, None, "warmup", steps // 3, every)  # (the first run's allocations, caches)
        runs = 0
        t0 = time.monotonic()
        for index in range(max_rounds):
            for mode in alternate(_MODES, index):
                runs += 1
                ckpt = None if mode == "base" else dep.checkpointer()
                cpu0 = _cpu_s(dep.agent.pid) if dep.agent else 0.0
                try:
                    # (one job: each run's steps come after the last run's)
                    elapsed, stall = _train(width, ckpt, mode, steps, every, step0=runs * steps)
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
                log(f"  round {index} {mode}: {elapsed:.3f} s (save() {stall * 1e3:.1f} ms total)")
            spent = time.monotonic() - t0 >= budget_s
            if index + 1 < reps and not (spent and index >= 1):  # (2 rounds: an interval)
                continue
            widths = [paired(times["base"], times[m]).half_width for m in stalls]
            log("  interval half-widths: " + ", ".join(
                "-" if w is None else f"{w * 100:.1f} %" for w in widths))  # fmt: skip
            if all(w is not None and w <= HALF_WIDTH for w in widths):
                reached = True
                break
            if spent:
                break
    rounds = len(times["base"])
    base = median(times["base"])
    saves = steps // every
    cores = os.cpu_count() or 1
    out: dict[str, Any] = {
        "steps": steps, "every": every, "saves_per_run": saves, "reps": rounds,
        "state_mib": round(state_bytes / 2**20, 1), "cores": cores,
        "base_s": base,
    }  # fmt: skip
    per_save_agent = median(agent_cpu) / saves
    for mode in stalls:
        t = median(times[mode])
        stall = median(stalls[mode]) / saves
        out[f"{mode}_s"] = t
        log(f"{mode}: {fmt(times[mode])} vs base {fmt(times['base'])}")
        pct = paired(times["base"], times[mode]).map(lambda r: round((r - 1) * 100, 2))
        record(out, f"overhead_pct_{mode}", pct, TARGET_PCT)
        out[f"stall_s_per_save_{mode}"] = stall
        out[f"explained_pct_{mode}"] = {
            "stall": round(stall * saves / base * 100, 2),
            "agent_cpu": round(per_save_agent * saves / cores / base * 100, 2),
        }
    out["agent_cpu_s_per_save"] = per_save_agent
    out["interval_half_width_pct"] = HALF_WIDTH * 100
    out["interval_reached"] = reached
    if not reached:
        log(f"WARNING: could not get both intervals within ±{HALF_WIDTH * 100:g} % in "
            f"{rounds} rounds ({time.monotonic() - t0:.0f} s; at most {max_rounds} rounds, "
            f"{budget_s:g} s)")  # fmt: skip
    out["notes"] = (
        "overhead_pct: median over rounds of each round's ratio to its base run, with a "
        "90 % interval (_lo, _hi); interval_reached: both within "
        f"±{HALF_WIDTH * 100:g} % before the round or time budget ran out; the agent "
        "(nvme-write, verify, evict) runs during every mode and takes CPU only around saves; "
        "explained_pct: the overhead the save() stall and the agent's CPU (spread over the "
        "cores) account for"
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


def _train(
    width: int, ckpt: Any, mode: str, steps: int, every: int, *, step0: int = 0
) -> tuple[float, float]:
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
        if ckpt is not None and (step + 1) % every == 0:
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
