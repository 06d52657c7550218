"""The README's `train.py`, extracted and run as a user runs it: torchrun with two workers over
gloo, `--max-restarts 1`, one worker killed mid-run. The restarted workers restore the newest
complete step and every loss after it equals an uninterrupted run's, bit for bit."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from tests.conftest import Agent
from tierpipe.bus.client import Bus
from tierpipe.control.kvstate import JobStore
from tierpipe.settings import Settings

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parent.parent / "README.md"


def example() -> str:
    """The code block after `<!-- example: train.py ... -->` in the README."""
    text = README.read_text()
    found = re.search(r"<!-- example: train\.py[^\n]*-->\n```python\n(.*?)\n```", text, re.S)
    assert found, "README.md lost its train.py example"
    return found.group(1) + "\n"


class Run:
    """`torchrun --standalone --nproc-per-node 2 --max-restarts 1 train.py`: torchrun's own
    output in a file, each worker's (one JSON line per step) in a file per rank and attempt."""

    def __init__(self, script: Path, settings: Settings, run: str, out: Path) -> None:
        self.out, self.logs = out, out.with_suffix(".logs")
        env = {**os.environ, **settings.as_env(), "RUN_NAME": run, "OMP_NUM_THREADS": "1",
               # (as the README says: a restart's workers get a store of their own)
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # fmt: skip
        torchrun = [sys.executable, "-m", "torch.distributed.run"]
        with open(out, "wb") as f:
            self.proc = subprocess.Popen(
                [*torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                 "--log-dir", str(self.logs), "--redirects", "1", str(script)],
                env=env, stdout=f, stderr=subprocess.STDOUT, cwd=script.parent,
                start_new_session=True,  # (`kill` ends its workers too)
            )  # fmt: skip

    def kill(self) -> None:
        """torchrun and its workers, whatever state they are in."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def lines(self) -> list[dict[str, object]]:
        """The workers' JSON lines, attempt by attempt."""
        out = []
        for path in sorted(self.logs.glob("*/attempt_*/*/stdout.log")):
            for line in path.read_text(errors="replace").splitlines():
                if line.startswith("{") and line.endswith("}"):
                    out.append(json.loads(line))
        return out

    def tail(self) -> str:
        errors = sorted(self.logs.glob("*/attempt_*/*/stderr.log"))
        return "\n".join([self.out.read_text()[-2000:], *(p.read_text()[-2000:] for p in errors)])

    def losses(self) -> dict[tuple[int, int], str]:
        """(rank, step) -> loss, the last printed (a restarted run prints some steps again)."""
        return {(x["rank"], x["step"]): x["loss"] for x in self.lines() if "loss" in x}  # type: ignore[misc]

    def wait(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"torchrun did not finish:\n{self.tail()}") from None


def complete_step(settings: Settings, job: str) -> int:
    """The newest step complete on NVMe, from the job state in KV (-1: none yet)."""

    async def read() -> int:
        async with Bus(settings) as bus:
            head = await (await JobStore(bus.js, settings).open()).head(job)
        return head.nvme_steps[-1] if head and head.nvme_steps else -1

    return anyio.run(read)


def workers_past(run: Run, step: int) -> dict[int, int]:
    """rank -> pid of the workers that reported a step after `step` (their save of it returned)."""
    return {
        int(x["rank"]): int(x["pid"])  # type: ignore[call-overload]
        for x in run.lines()
        if "pid" in x and int(x["step"]) > step  # type: ignore[call-overload]
    }


def test_the_readme_example_resumes_bit_for_bit_after_a_worker_dies(
    settings: Settings, job: str, agent: Callable[..., Agent], tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text(example())
    for run in (f"{job}-ref", f"{job}-crash"):  # (the agent serves the jobs it finds here)
        Path(settings.staging_root, run).mkdir(parents=True, exist_ok=True)
    agent().wait_ready()

    runs: list[Run] = []
    try:
        check(script, settings, job, tmp_path, runs)
    finally:
        for run in runs:
            run.kill()


def check(script: Path, settings: Settings, job: str, tmp_path: Path, runs: list[Run]) -> None:
    ref = Run(script, settings, f"{job}-ref", tmp_path / "ref.out")
    runs.append(ref)
    assert ref.wait() == 0, ref.tail()
    expected = ref.losses()
    steps = 1 + max(step for _, step in expected)
    assert len(expected) == 2 * steps and steps >= 300

    crash = Run(script, settings, f"{job}-crash", tmp_path / "crash.out")
    runs.append(crash)
    # On a loaded machine the agent may verify step 100 only once training is nearly over:
    # once both ranks are past save(100), they are held (SIGSTOP) until it is complete, so the
    # worker dies mid-run whatever the machine's load (a test's precondition, not a product wait).
    deadline = time.monotonic() + 120
    while len(pids := workers_past(crash, 100)) < 2:
        assert crash.proc.poll() is None, crash.tail()
        assert time.monotonic() < deadline, "the run did not reach step 100 in time"
        time.sleep(0.1)
    for pid in pids.values():
        os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 120
    while complete_step(settings, f"{job}-crash") < 100:  # a checkpoint to come back to
        assert time.monotonic() < deadline, "no complete checkpoint in time"
        time.sleep(0.2)
    victim = next(x for x in reversed(crash.lines()) if x.get("rank") == 1 and "pid" in x)
    assert int(victim["step"]) < steps - 50, "the run was nearly done: make it longer"  # type: ignore[call-overload]
    os.kill(pids[0], signal.SIGCONT)
    os.kill(pids[1], signal.SIGKILL)
    assert crash.wait() == 0, crash.tail()

    restored = [x for x in crash.lines() if "restored" in x]
    assert sorted(x["rank"] for x in restored) == [0, 1], crash.tail()
    assert {x["restored"] for x in restored} == {restored[0]["restored"]}
    assert int(restored[0]["restored"]) >= 100  # type: ignore[call-overload]
    assert crash.losses() == expected  # every step, both ranks, bit for bit
