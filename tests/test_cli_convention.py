"""One convention across every `tierpipe` command: exit status 0 ok, 1 a runtime failure
(unreachable server, unknown job), 2 a usage error; `--json` on every command that is not a
service, its stdout one JSON object per line while the command logs (to stderr); `tierpipe
events` one readable line per event, filtered, and a `--follow` that waits for its job; each
stage's backlog per node in `tierpipe status` and `tierpipe ls`.

The exit statuses are checked in-process (`main`), over the verbs the parser has: a new verb
fails here until it is listed in `ARGS` (and so follows the convention)."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.conftest import Agent, Events, make_staged, run_cli
from tests.test_operator_views import failed, publish
from tests.test_status_cli import _saves, _store_state
from tierpipe.bus.client import Bus
from tierpipe.bus.consumer import ensure_consumer
from tierpipe.cli import main
from tierpipe.cli.exits import EPILOG
from tierpipe.cli.parser import SERVICES, build_parser
from tierpipe.dev.process import free_ports
from tierpipe.names import consumer_name, filter_subject
from tierpipe.schemas import NodeBatch, ShardFlushed, ShardVerified, ShardWritten, StageFailed
from tierpipe.settings import Settings

pytestmark = pytest.mark.timeout(120)

#: The least each verb takes, for job `J` (and folder `D`): every verb of the parser is here.
ARGS: dict[str, list[str]] = {
    "worker": ["all"],
    "status": ["--job", "J"],
    "plan": ["--job", "J"],
    "reindex": ["--job", "J"],
    "flush": ["rate", "0", "--job", "J"],
    "budget": ["--job", "J"],
    "events": ["--job", "J"],
    "export": ["--job", "J", "--to", "torch", "D"],
    "import": ["--from", "dcp", "D", "--job", "J"],
    "prefetch": ["--job", "J"],
    "gc": ["--job", "J"],
    "rm": ["--job", "J"],
    "ls": [],
    "up": ["--data", "D"],
    "demo": ["--data", "D"],
}


def _verbs() -> list[str]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sorted(sub.choices)


VERBS = _verbs()
#: The verbs that print facts (every one but the services).
READERS = [v for v in VERBS if v not in SERVICES]
#: The verbs that name an existing job (`import` makes one).
OF_A_JOB = [v for v in READERS if "J" in ARGS.get(v, []) and v != "import"]


def argv(verb: str, job: str = "J", folder: Path | str = "D") -> list[str]:
    return [verb, *(job if a == "J" else str(folder) if a == "D" else a for a in ARGS[verb])]


@pytest.fixture
def cli(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Callable[..., tuple[int, str, str]]:
    """`tierpipe <args>` in this process with `settings` in its environment (logs at debug, so
    every command logs): (exit status, stdout, stderr)."""

    def run(*args: str, settings: Settings = settings) -> tuple[int, str, str]:
        for name, value in settings.replace(log_level="debug").as_env().items():
            monkeypatch.setenv(name, value)
        capsys.readouterr()
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_every_verb_is_held_to_the_convention() -> None:
    """Every verb of the parser is listed here; the top-level help documents the statuses."""
    assert set(VERBS) == set(ARGS), "a new verb: add it to ARGS (and give it --json)"
    shown = build_parser().format_help()
    assert "exit status:" in shown and EPILOG.splitlines()[1] in shown
    assert all(f"\n  {n}    " in EPILOG for n in "012"), EPILOG


@pytest.mark.parametrize("verb", VERBS)
def test_a_usage_error_exits_2(verb: str, capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown option, and a bad job name, are usage errors (2) before anything connects."""
    assert main([*argv(verb), "--no-such-option"]) == 2
    if "J" in ARGS[verb]:
        assert main(argv(verb, job="bad.name")) == 2
        assert "job name must match" in capsys.readouterr().err


def test_config_goes_before_or_after_the_verb(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--config FILE` is read wherever it is given (here a file with a typo: a usage error)."""
    bad = tmp_path / "bad.toml"
    bad.write_text("no_such_setting = 1\n")
    for args in (["--config", str(bad), "ls"], ["ls", "--config", str(bad)]):
        assert main(args) == 2
        assert "unknown field `no_such_setting`" in capsys.readouterr().err


@pytest.mark.parametrize("verb", READERS)
def test_every_reader_takes_json(verb: str) -> None:
    """Every verb that is not a service takes `--json`."""
    assert build_parser().parse_args([*argv(verb), "--json"]).json is True


@pytest.fixture(scope="module")
def dcp_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-tensor DCP checkpoint (what `tierpipe import` reads before it connects)."""
    import torch
    import torch.distributed.checkpoint as dcp

    folder = tmp_path_factory.mktemp("dcp") / "ckpt"
    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(folder), no_dist=True)
    return folder


@pytest.mark.parametrize("verb", READERS)
def test_an_unreachable_server_exits_1(
    verb: str, settings: Settings, cli: Callable[..., tuple[int, str, str]], dcp_folder: Path
) -> None:
    """NATS not answering is a runtime failure (1), said in one line on stderr."""
    (port,) = free_ports(1)
    dead = settings.replace(nats_url=f"nats://127.0.0.1:{port}")
    code, out, err = cli(*argv(verb, folder=dcp_folder), settings=dead)
    assert (code, out) == (1, ""), err
    assert f"tierpipe: error: cannot reach NATS at nats://127.0.0.1:{port}" in err
    assert "Traceback" not in err


def test_an_unreachable_object_store_exits_1(
    settings: Settings, job: str, cli: Callable[..., tuple[int, str, str]]
) -> None:
    """The object store not answering is a runtime failure (1) too."""
    _store_state(settings, job, _saves(job, 1, 1))
    (port,) = free_ports(1)
    dead = settings.replace(s3_endpoint=f"http://127.0.0.1:{port}")
    code, out, err = cli("gc", "--job", job, "--json", settings=dead)
    assert (code, out) == (1, ""), err
    assert "tierpipe: error: object store unreachable" in err and "Traceback" not in err


@pytest.mark.parametrize("verb", OF_A_JOB)
def test_an_unknown_job_exits_1(
    verb: str, job: str, tmp_path: Path, cli: Callable[..., tuple[int, str, str]]
) -> None:
    """A job nothing knows is not found (1) on every command that names one, not a usage error
    and not an empty success."""
    code, out, err = cli(*argv(verb, job=job, folder=tmp_path / "out"))
    assert (code, out) == (1, ""), err
    assert f"'{job}'" in err and "Traceback" not in err


def test_every_reader_succeeds_with_json_on_stdout_and_logs_on_stderr(
    settings: Settings,
    job: str,
    agent: Callable[..., Agent],
    events: Events,
    tmp_path: Path,
    dcp_folder: Path,
    cli: Callable[..., tuple[int, str, str]],
) -> None:
    """With a saved step, every reader exits 0 with `--json`; its stdout is JSON objects, a line
    each, while it logs (at debug) on stderr; as a separate process too."""
    import torch

    from tierpipe import Checkpointer

    agent().wait_ready()

    with Checkpointer(job, rank=0, world_size=1, settings=settings) as ckpt:
        ckpt.save(1, {"w": torch.arange(8.0)}).wait("verified", timeout=30)
    events.wait_for(lambda e: isinstance(e, ShardFlushed), kind="flushed")
    args = {
        "import": ["--step", "5"],
        "gc": ["--min-age-s", "0"],
    }
    for verb in READERS:
        folder = dcp_folder if verb == "import" else tmp_path / verb
        code, out, err = cli(*argv(verb, job=job, folder=folder), *args.get(verb, []), "--json")
        assert code == 0, f"{verb}: {err}"
        lines = out.splitlines()
        assert lines, verb
        assert all(isinstance(json.loads(line), dict) for line in lines), (verb, out)
        assert "bus_connected" in err, (verb, err)
    for verb in ("ls", "events"):
        run = run_cli(settings.replace(log_level="debug"), *argv(verb, job=job), "--json")
        assert run.returncode == 0 and "bus_connected" in run.stderr, run.stderr
        assert all(json.loads(line) for line in run.stdout.splitlines())


def _copies(job: str, node: str, step: int, rank: int) -> dict[str, Any]:
    return dict(
        job=job, node=node, ts=time.time(), step=step, rank=rank, world_size=2,
        path=f"/nvme/{job}/{rank}", nbytes=4096, header_digest=f"{step:016x}{rank:016x}",
        seconds=0.25,
    )  # fmt: skip


def test_events_are_one_readable_line_each_and_filtered(
    settings: Settings, job: str, cli: Callable[..., tuple[int, str, str]]
) -> None:
    """One line per event with its time, kind, step, rank, node, tier, size and duration; a
    node's batch shows as its events, each fact once; `--step`, `--rank`, `--node`, `--kind`
    keep only theirs; `--json` prints each event's body as stored."""
    a, b = "node-a", "node-b"
    verified = [ShardVerified(**_copies(job, a, 1, rank)) for rank in (0, 1)]
    batch = NodeBatch(job=job, node=a, ts=time.time(), batch="verified", events=verified)
    publish(
        settings,
        make_staged(job, a, 1),
        ShardWritten(**_copies(job, a, 1, 0), tensors=3),
        verified[0],
        batch,  # (rank 0's verified again, and rank 1's: only in the batch)
        failed(job, b, 2, "bad digest"),
    )
    code, out, err = cli("events", "--job", job)
    assert code == 0, err
    lines = out.splitlines()
    assert [line.split()[2] for line in lines] == [
        "staged", "written", "verified", "verified", "failed",
    ]  # fmt: skip
    written = lines[1].split()
    assert written[1].endswith("+00:00") and written[1][:4].isdigit()  # (UTC, ISO 8601)
    assert written[3:13] == ["step", "1", "rank", "0", a, "nvme", "4.0", "KiB", "0.25", "s"]
    assert lines[3].split()[3:7] == ["step", "1", "rank", "1"] and "batch" in lines[3]
    assert "verify IntegrityError: bad digest" in lines[4]

    def kinds(*args: str) -> list[tuple[str, str]]:
        code, out, err = cli("events", "--job", job, *args)
        assert code == 0, err
        return [(x.split()[2], x.split()[6]) for x in out.splitlines()]

    assert kinds("--step", "2") == [("failed", "0")]
    assert kinds("--rank", "1") == [("verified", "1")]
    assert kinds("--node", b) == [("failed", "0")]
    assert kinds("--kind", "verified", "--rank", "0") == [("verified", "0")]
    assert kinds("--kind", "staged", "--kind", "failed") == [("staged", "0"), ("failed", "0")]
    code, out, _ = cli("events", "--job", job, "--kind", "written", "--json")
    (one,) = map(json.loads, out.splitlines())
    assert one["subject"] == f"tp.{job}.written.{a}.0" and one["event"]["tensors"] == 3


@pytest.fixture
def follower(settings: Settings, job: str) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tierpipe.cli", "events", "--job", job, "--follow"],
        env={**settings.as_env()}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_follow_waits_for_a_job_that_has_no_stream_yet(
    settings: Settings, job: str, follower: subprocess.Popen[str]
) -> None:
    """A follow started before the job's first event says it waits, then prints that event
    and the next, and ends with 0 on Ctrl-C."""
    assert follower.stdout is not None and follower.stderr is not None
    while "waiting for job" not in (line := follower.stderr.readline()):
        assert line, "the follow ended"
    publish(settings, make_staged(job, "node-a", 1))
    assert follower.stdout.readline().split()[2:5] == ["staged", "step", "1"]
    publish(settings, failed(job, "node-a", 1, "bad digest"))
    assert "bad digest" in follower.stdout.readline()
    follower.send_signal(signal.SIGINT)
    assert follower.wait(10) == 0


def test_ls_shows_each_stage_backlog_per_node(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events
) -> None:
    """A stage's consumer whose stage is not running shows its pending events per node in
    `tierpipe status` and `tierpipe ls --json` (their sum in `tierpipe ls`); once the stage
    runs, none."""
    node = settings.node or ""
    _store_state(settings, job, _saves(job, 1, 1))
    durable = consumer_name("nvme-write", node)

    async def stopped_stage() -> None:  # (the consumer a stopped agent left, as it made it)
        async with Bus(settings) as bus:
            await bus.ensure_stream(job)
            await ensure_consumer(bus, job, durable, [filter_subject("staged", node=node, job=job)])

    anyio.run(stopped_stage)
    publish(settings, *(make_staged(job, node, step) for step in (2, 3, 4)))

    def backlog() -> dict[str, object]:
        out = run_cli(settings, "ls", "--json")
        assert out.returncode == 0, out.stderr
        (row,) = [r for r in map(json.loads, out.stdout.splitlines()) if r["job"] == job]
        (mine,) = [b for b in row["backlog"] if b["consumer"] == durable]
        return mine

    assert backlog() == {"stage": "nvme-write", "node": node, "consumer": durable,
                         "pending": 3, "ack_pending": 0, "redelivered": 0}  # fmt: skip
    text = run_cli(settings, "status", "--job", job).stdout
    (row,) = [line.split() for line in text.splitlines() if node in line]
    assert row == ["nvme-write", node, "3", "0", "0"]
    header, *table = run_cli(settings, "ls").stdout.splitlines()
    (total,) = [x[header.index("BACKLOG") :].split()[0] for x in table if x.startswith(job)]
    assert total == "3"

    agent("nvme-write").wait_ready()  # (its staging copies are gone: each fails for good)
    events.wait_for(lambda e: isinstance(e, StageFailed) and e.step == 4, kind="failed")
    deadline = time.monotonic() + 30
    while (now := backlog())["pending"] or now["ack_pending"]:
        assert time.monotonic() < deadline, now
        time.sleep(0.2)
