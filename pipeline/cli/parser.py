"""The `tierpipe` command line: its verbs and their options (argparse), and how a rate and a
time given on it are read."""

from __future__ import annotations

import argparse
import re
import time
from datetime import UTC, datetime
from typing import get_args

import tierpipe
from tierpipe.cli.events import EVENT_KINDS
from tierpipe.cli.exits import EPILOG
from tierpipe.errors import ConfigError
from tierpipe.schemas import FlushAction

__all__ = ("DESCRIPTION", "SERVICES", "build_parser", "parse_rate", "parse_since")

#: What `tierpipe --help` says the command is.
DESCRIPTION = "The `tierpipe` command: run node-agent stages, inspect a job, run the demo."

#: The verbs that run until stopped (an agent, servers, the demo) and print no facts to read
#: back: every other verb takes `--json`.
SERVICES = ("worker", "up", "demo")


class _Verbs:
    """The shared layer of every verb: `--config` after the verb as before it, and `--json`
    (one JSON object per line on stdout) on each verb that is not a service."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self._sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
        self._common = argparse.ArgumentParser(add_help=False)
        # SUPPRESS: a verb's own default would overwrite a --config given before the verb.
        self._common.add_argument(
            "--config", default=argparse.SUPPRESS,
            help="settings TOML file (default $TIERPIPE_CONFIG)",
        )  # fmt: skip

    def add(
        self, name: str, *, json: str = "one JSON object", help: str, description: str = ""
    ) -> argparse.ArgumentParser:
        """The verb `name`; `json`: what its `--json` prints."""
        verb = self._sub.add_parser(
            name, parents=[self._common], help=help, description=description or None
        )
        if name not in SERVICES:
            verb.add_argument("--json", action="store_true", help=json)
        return verb


def build_parser() -> argparse.ArgumentParser:
    """Every verb of `tierpipe` with its options."""
    parser = argparse.ArgumentParser(
        prog="tierpipe", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--config", help="settings TOML file (default $TIERPIPE_CONFIG)")
    parser.add_argument(
        "--version", action="version", version=f"tierpipe {tierpipe.__version__}",
        help="print the installed version and exit",
    )  # fmt: skip
    sub = _Verbs(parser)

    from tierpipe.stages import AGENT_STAGES

    worker = sub.add("worker", help="run node-agent stages until SIGTERM/SIGINT")
    worker.add_argument(
        "stages",
        nargs="+",
        choices=[*AGENT_STAGES, "all"],
        help="stages to run in this process ('all': every stage of this node)",
    )

    status = sub.add(
        "status",
        help="a job's kept steps from its state in KV (per rank: --step N)",
        description="One line per step the job keeps: world size, ranks with a good copy on "
        "NVMe and in object storage, and on which tier the step is complete; above them the "
        "newest complete steps, the retention floors and policy, and the coordinator's lease; "
        "below them each stage's backlog per node (its consumer's events pending, unacked, "
        "redelivered). --step N lists that step's ranks instead (digest, size, NVMe path, "
        "object).",
        json="one JSON object per step (per rank with --step)",
    )
    status.add_argument("--job", required=True)
    status.add_argument("--step", type=int, help="per-rank detail of this step")
    status.add_argument("--rank", type=int, help="with --step: only this rank")

    plan = sub.add(
        "plan",
        help="which step a restore would pick now, from the job state in KV",
        description="The newest candidate step a restart considers on which every rank has a "
        "copy on some tier, and how many ranks would read NVMe, a replica on a peer node and "
        "object storage, assuming every rank's node still holds the NVMe copy the job state "
        "records (a restart also checks each file on its disk). --json prints one object: job, "
        "step, world_size, from_nvme, from_peer, from_s3 (rank counts), peer_ranks and "
        "s3_ranks (the ranks reading a peer's replica, object storage), "
        "candidates (newest first), rejected (step -> why), unconfirmed (step -> why the "
        "job state does not back what its head says of it: no record, or no rank digests; "
        "never planned), assumes (nvme_kept, nvme_lost or nodes_lost), lost_nodes (those given "
        "with --lost-node), folded_seq and stream_seq (the job "
        "state lags the stream when the first is lower). Exits 1 when no candidate is "
        "confirmed and restorable.",
        json="one JSON object (see above)",
    )
    plan.add_argument("--job", required=True)
    plan.add_argument("--step", type=int, help="plan this step rather than the newest")
    plan.add_argument(
        "--nvme-lost",
        action="store_true",
        help="plan as if every NVMe copy were lost, and with them every peer replica (every "
        "rank reads object storage)",
    )
    plan.add_argument(
        "--lost-node",
        action="append",
        metavar="NODE",
        help="plan as if NODE were lost with its NVMe (replaced by an empty node): the ranks "
        "it saved (its `verified` events say which) read a verified replica on a surviving "
        "node, else object storage; the replicas it held are lost too; repeatable",
    )
    # Gone: the job state does not record which node holds a rank's NVMe copy.
    plan.add_argument("--alive", help=argparse.SUPPRESS)

    reindex = sub.add(
        "reindex", help="rebuild a job's events from this node's shard files and the objects"
    )
    reindex.add_argument("--job", required=True)
    reindex.add_argument(
        "--no-verify",
        action="store_true",
        help="trust NVMe files without re-reading them (the agent verifies)",
    )
    reindex.add_argument("--no-s3", action="store_true", help="this node's NVMe only")

    flush = sub.add("flush", help="change the upload rate to object storage at run time")
    flush.add_argument("action", choices=get_args(FlushAction))
    flush.add_argument(
        "rate",
        nargs="?",
        default=None,
        help="for `rate`: bytes/s, e.g. 50MiB, 200MB, 0 for unlimited",
    )
    flush.add_argument("--node", help="only this node (default: every node)")
    flush.add_argument(
        "--job",
        help="`rate` for this job as a whole: its coordinator divides it among the job's "
        "active nodes (each node keeps its own rate too: the lower applies)",
    )
    flush.add_argument(
        "--force",
        action="store_true",
        help="send to --node even if it has no flush worker and no events yet",
    )

    budget = sub.add(
        "budget",
        help="show or set a job's object-storage budgets (for the whole job: its coordinator "
        "divides them among the job's active nodes)",
    )
    budget.add_argument("--job", required=True)
    budget.add_argument(
        "--flush", help="upload bytes/s of the whole job, e.g. 800MiB (0: no job-wide cap)"
    )
    budget.add_argument(
        "--restore-gets",
        type=int,
        help="concurrent object GETs of the whole job during a restore (0: no job-wide cap)",
    )

    events = sub.add(
        "events",
        help="a job's events, one line each: time, kind, step, rank, node, tier, size, duration",
        description="What `nats stream view` / `nats sub` would show of one job, without the "
        "NATS CLI, one line per event (a node's batch is shown as the events it carries, each "
        "fact once): stream sequence, time (UTC), kind, step, rank, node, tier, size, duration "
        "and what else the event says; oldest first, only those the filters keep. --follow "
        "then prints each new one until Ctrl-C, and waits for a job whose stream does not "
        "exist yet (a follow started before the trainer).",
        json="one JSON object per event: seq, time, subject, event (its body as stored)",
    )
    events.add_argument("--job", required=True)
    events.add_argument(
        "--kind", action="append", choices=EVENT_KINDS, help="only this kind (repeatable)"
    )
    events.add_argument("--step", type=int, help="only events of this step")
    events.add_argument("--rank", type=int, help="only events of this rank")
    events.add_argument("--node", help="only events of this node")
    events.add_argument(
        "--since", help="only those stored in the last 90s, 15m, 2h, 1d, ... or since an ISO "
        "8601 time (2026-12-01T03:00:00Z)",
    )  # fmt: skip
    events.add_argument(
        "--follow", "-f", action="store_true",
        help="then print new ones (waits for a job that has no stream yet)",
    )  # fmt: skip

    export = sub.add(
        "export",
        help="write a step of a job in a format other tools load (torch, safetensors, dcp)",
        description="Reads every rank's shard of the step, one rank at a time (this node's "
        "NVMe copy, else object storage; every digest checked) and writes into DIR: with --to "
        "dcp one torch.distributed.checkpoint checkpoint of the whole step (every rank's "
        "shards, one .metadata) that dcp.load reads into any world size; with --merged the "
        "full model (every sharded tensor assembled, other values rank 0's) as model.pt or "
        "model.safetensors (split into files of at most --max-file-size with a "
        "model.safetensors.index.json when larger); else one file per rank: rank-R-of-W.pt "
        "(torch.load(..., weights_only=True)) or rank-R-of-W.safetensors (tensors by dotted "
        "key path, other values in its metadata).",
        json="one JSON object: job, step, format, world_size, dir",
    )
    export.add_argument("--job", required=True)
    export.add_argument("--step", type=int, help="default: the newest complete step")
    export.add_argument("--to", required=True, choices=("torch", "safetensors", "dcp"))
    export.add_argument(
        "--merged", action="store_true",
        help="torch, safetensors: the full model as one file set instead of a file per rank",
    )  # fmt: skip
    export.add_argument(
        "--max-file-size", default="5GB",
        help="--merged safetensors: split above this size (5GB, as Hugging Face's)",
    )  # fmt: skip
    export.add_argument("dir", help="where to write (made if missing)")

    imports = sub.add(
        "import",
        help="start a job from an existing torch.distributed.checkpoint (DCP) checkpoint",
        description="Reads the DCP checkpoint in DIR whole (its .metadata through an "
        "allow-list of DCP's types, every value with torch.load(weights_only=True): nothing in "
        "it can run code; sharded tensors assembled into full tensors) and saves it as step "
        "--step (default 0) of --job through this node's agent, waiting until it is verified "
        "on NVMe (the agent then flushes it to object storage as any save). Refuses a job that "
        "already has that step or a newer one. --world N saves the full state as each of N "
        "ranks (a job restoring plain state on N ranks); a DTensor job restores the default "
        "world-1 step into any mesh.",
        json="one JSON object: job, step, world_size, tensors, nbytes, seconds",
    )
    imports.add_argument("--from", dest="source", required=True, choices=("dcp",))
    imports.add_argument("dir", help="the DCP checkpoint's folder (with its .metadata)")
    imports.add_argument("--job", required=True)
    imports.add_argument("--step", type=int, help="the step to save it as (default 0)")
    imports.add_argument("--world", type=int, default=1, help="ranks to save it as (1)")
    imports.add_argument(
        "--timeout-s", type=float, default=600.0,
        help="how long to wait for the step to be verified on NVMe (600)",
    )  # fmt: skip

    prefetch = sub.add(
        "prefetch",
        help="pull a node's shards of the newest step in object storage onto this node's NVMe",
        description="For a standby node: fetches the ranks of --node (default: this node) of "
        "the newest step complete in object storage (or --step), checks every digest, writes "
        "them to this node's NVMe and reports them written and verified here, so a restore on "
        "this node reads NVMe instead of object storage.",
        json="one JSON object: job, step, fetched and present ranks",
    )
    prefetch.add_argument("--job", required=True)
    prefetch.add_argument("--node", help="whose ranks (default: this node's)")
    prefetch.add_argument("--step", type=int, help="default: the newest complete in object storage")

    gc = sub.add(
        "gc",
        help="list (--apply: remove) a job's objects and this node's files no kept step owns",
        description="Judges the job's objects (shards, COMMITs) and this node's NVMe files by "
        "their step against the job state in KV: those of steps it keeps on no tier (below the "
        "floors, or with no record) are listed with why; --apply removes them. Never a step the "
        "floors keep, a step newer than any the job state knows, or anything younger than "
        "--min-age-s. Refuses a job with no state in KV (`tierpipe reindex` rebuilds it).",
        json="one JSON object per object or file",
    )
    gc.add_argument("--job", required=True)
    gc.add_argument("--apply", action="store_true", help="remove them (default: a dry run)")
    gc.add_argument("--min-age-s", type=float, default=600.0, help="leave younger ones (600)")
    rm = sub.add(
        "rm",
        help="delete a job: stream, job-state keys, objects, this node's files (dry run first)",
        description="Counts what of the job would go; --apply deletes it. Refuses a job in use "
        "(a live coordinator lease, or an event younger than --idle-s) unless --force. Each "
        "node's NVMe and staging files are its own: run it on every node that held copies.",
    )
    rm.add_argument("--job", required=True)
    rm.add_argument("--apply", action="store_true", help="delete it (default: a dry run)")
    rm.add_argument("--force", action="store_true", help="delete it even while in use")
    rm.add_argument("--idle-s", type=float, default=600.0, help="in use if an event is younger")

    sub.add(
        "ls",
        help="every job: newest step per tier and its lag, steps at risk, coordinator, last error",
        description="A line per job: its world size; the newest saved step; the newest step "
        "complete on NVMe, on peers and in object storage, each with how far it trails the "
        "newest save (steps, seconds), e.g. `13 (-46, 47s)`; the steps at risk if a node were "
        "lost now (the newest saved step less the newest that survives any one node's loss); "
        "kept steps, fold lag, backlog (events the job's stages have not been delivered yet, "
        "on all nodes: `tierpipe status` shows them per node), coordinator, newest failure.",
        json="one JSON object per job, with its stages' backlog per node",
    )

    up = sub.add(
        "up",
        help="run this machine's NATS, S3 store and node agent under one supervisor",
        description="Starts an embedded nats-server and S3 store (SeaweedFS) on loopback and "
        "this node's agent, restarts whichever exits (with backoff), writes the environment a "
        "trainer needs to <data>/env (source it, then run your trainer), and on Ctrl-C drains "
        "the agent and stops the servers.",
    )
    up.add_argument("--data", default=".tierpipe", help="directory for everything (./.tierpipe)")
    up.add_argument(
        "--nats-port", type=int, default=4222, help="the embedded nats-server's port (4222)"
    )
    up.add_argument("--nats-url", help="use this running NATS server instead of an embedded one")
    up.add_argument("--s3-endpoint", help="use this S3 endpoint instead of an embedded store")
    up.add_argument(
        "--no-s3", action="store_true", help="no object storage: NVMe only (retention may then "
        "remove copies that were never flushed)",
    )  # fmt: skip

    demo = sub.add(
        "demo", help="the whole story on this machine: train, lose a node, resume (about 1 min)"
    )
    demo.add_argument("--ranks", type=int, default=2, help="ranks, spread over two nodes (2)")
    demo.add_argument("--steps", type=int, default=60)
    demo.add_argument("--every", type=int, default=5, help="a save every this many steps (5)")
    demo.add_argument(
        "--data", default="tierpipe-data/demo", help="directory for NVMe, NATS, S3 data and logs"
    )
    demo.add_argument(
        "--seed", type=int, help="the RNG of the moment node-b is lost (default: drawn, printed)"
    )
    demo.add_argument(
        "--plot", nargs="?", const="tierpipe-demo.png", metavar="PNG",
        help="render the timeline of events per tier (default file tierpipe-demo.png; needs "
        "matplotlib: pip install 'tierpipe[plot]')",
    )  # fmt: skip
    demo.add_argument(
        "--rank",
        type=int,
        help="run only this trainer rank, against the agent and servers the settings name "
        "(what the demo starts per rank, and compose.yaml's trainer); prints JSON lines",
    )
    return parser


def parse_rate(text: str) -> int:
    """`50MiB`, `200MB`, `1.5GiB`, `1048576`, `0` -> bytes/s."""
    units = {
        "": 1,
        "b": 1,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
    }
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*?)(?:/s)?\s*", text)
    if m is None or m.group(2).lower() not in units:
        raise ConfigError(f"cannot read a rate from {text!r} (try 50MiB or 200MB)")
    return int(float(m.group(1)) * units[m.group(2).lower()])


def parse_since(text: str, *, now: float | None = None) -> float:
    """`90s`, `15m`, `2h`, `1d`, `30` (seconds) ago, or an ISO 8601 time
    (`2026-12-01T03:00:00Z`; without a zone: UTC) -> a Unix time."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smhd]?)\s*", text)
    if m is not None:
        ago = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
        return (time.time() if now is None else now) - ago
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ConfigError(
            f"cannot read a time from {text!r} (try 90s, 15m, 2h, 1d or 2026-12-01T03:00:00Z)"
        ) from None
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()
