"""The demo's simulated cluster: nodes (an agent each, with its own NVMe and staging folders)
and one launch of every rank on them (`tierpipe demo --rank R`, as torchrun would start them),
with the JSON lines the ranks print.
"""

from __future__ import annotations

import json
import queue
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierpipe.dev.process import free_ports, own_session, start_agent, terminate

__all__ = ("Attempt", "Node", "launch")


@dataclass
class Node:
    name: str
    nvme: Path
    staging: Path
    agent: subprocess.Popen[bytes] | None = None

    def env(self, base: dict[str, str]) -> dict[str, str]:
        return {**base, "TIERPIPE_NODE": self.name, "TIERPIPE_NVME_ROOT": str(self.nvme),
                "TIERPIPE_STAGING_ROOT": str(self.staging)}  # fmt: skip

    def start(self, base: dict[str, str], log: Path) -> Node:
        self.staging.mkdir(parents=True, exist_ok=True)
        self.agent = start_agent(self.env(base), ["all"], log)
        return self

    def lose(self) -> None:
        """SIGKILL the agent and wipe the node's disks: the node is gone."""
        if self.agent is not None:
            self.agent.kill()
            self.agent.wait()
        shutil.rmtree(self.nvme, ignore_errors=True)
        shutil.rmtree(self.staging, ignore_errors=True)

    def stop(self) -> None:
        if self.agent is not None:
            terminate(self.agent, 30)


@dataclass
class Attempt:
    """One launch of every rank (what torchrun does per attempt), with their JSON lines."""

    procs: dict[int, subprocess.Popen[str]]
    lines: queue.Queue[dict[str, Any]] = field(default_factory=queue.Queue)
    seen: list[dict[str, Any]] = field(default_factory=list)

    def drain(self, timeout_s: float) -> Iterator[dict[str, Any]]:
        """Lines that arrived within `timeout_s` (all that are there, then waits)."""
        try:
            line = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            return
        while True:
            self.seen.append(line)
            yield line
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                return

    def of(self, event: str) -> list[dict[str, Any]]:
        return [x for x in self.seen if x["event"] == event]

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs.values()) or not self.lines.empty()

    def signal(self, sig: int, ranks: list[int] | None = None) -> None:
        for r in self.procs if ranks is None else ranks:
            p = self.procs[r]
            if p.poll() is None:
                p.send_signal(sig)

    def kill(self, ranks: list[int], sig: int) -> None:
        self.signal(sig, ranks)
        self.signal(signal.SIGCONT, ranks)  # (a paused process acts on SIGTERM only now)
        for r in ranks:
            self.procs[r].wait(30)


def launch(
    base: dict[str, str],
    nodes: dict[str, Node],
    placement: dict[int, str],
    steps: int,
    every: int,
    root: Path,
    *,
    attempt: int,
) -> Attempt:
    """Start every rank (`tierpipe demo --rank R`) on its node, with a fresh rendezvous."""
    (port,) = free_ports(1)
    ranks = len(placement)
    per_node = int(base["LOCAL_WORLD_SIZE"])
    procs = {}
    for rank, node in placement.items():
        env = nodes[node].env(base)
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank % per_node))  # fmt: skip
        log = open(root / "logs" / f"rank-{rank}-attempt-{attempt}.log", "ab")  # noqa: SIM115
        procs[rank] = subprocess.Popen(
            [sys.executable, "-m", "tierpipe.cli", "demo", "--rank", str(rank), "--ranks",
             str(ranks), "--steps", str(steps), "--every", str(every)],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, text=True,
            preexec_fn=own_session,
        )  # fmt: skip
        log.close()
    attempt_ = Attempt(procs)
    for p in procs.values():
        threading.Thread(target=_read_lines, args=(p, attempt_.lines), daemon=True).start()
    return attempt_


def _read_lines(proc: subprocess.Popen[str], out: queue.Queue[dict[str, Any]]) -> None:
    assert proc.stdout is not None
    for text in proc.stdout:
        try:
            line = json.loads(text)
        except ValueError:
            continue
        if isinstance(line, dict) and "event" in line:
            out.put(line)
