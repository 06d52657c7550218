"""Settings: one frozen object from defaults, a TOML file and `TIERPIPE_*` environment variables.

Precedence, lowest first: defaults, the TOML file (`TIERPIPE_CONFIG` or an explicit path),
`TIERPIPE_<FIELD>` environment variables, explicit keyword arguments. An unknown key in the file
is an error, not a silent default. Paths are made absolute when the settings are built, so a
process started from another working directory still finds the same files. Secrets never show
in a repr (`SECRET_FIELDS`, and credentials inside `nats_url`).
"""

from __future__ import annotations

import os
import re
import tomllib
import weakref
from pathlib import Path
from typing import Literal

import msgspec

from tierpipe.errors import ConfigError

__all__ = ("SECRET_FIELDS", "Settings", "explicit_fields", "load_settings")

SlotPolicy = Literal["wait", "skip"]
SaveErrors = Literal["report", "raise"]

_ENV_PREFIX = "TIERPIPE_"
#: Fields whose values are secrets: redacted in every repr and log line.
SECRET_FIELDS = frozenset({"s3_secret_access_key", "nats_password", "nats_token", "peer_token"})
#: Fields that are filesystem paths: made absolute when the settings are built.
_PATH_FIELDS = (
    "staging_root",
    "nvme_root",
    "nats_creds_file",
    "nats_nkey_seed_file",
    "nats_tls_ca_file",
    "nats_tls_cert_file",
    "nats_tls_key_file",
)


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, weakref=True):
    """Everything configurable, with defaults that work on one machine with no setup."""

    # --- NATS / JetStream
    #: Server URL(s), comma-separated. The demo starts an embedded server when
    #: `TIERPIPE_NATS_URL` is not set.
    nats_url: str = "nats://127.0.0.1:4222"
    #: Credentials and TLS for NATS (None: none, or what `nats_url` carries). Prefer a creds
    #: file or an nkey seed file over a password; a TLS client cert/key for mutual TLS.
    nats_user: str | None = None
    nats_password: str | None = None
    nats_token: str | None = None
    nats_creds_file: str | None = None
    nats_nkey_seed_file: str | None = None
    nats_tls_ca_file: str | None = None
    nats_tls_cert_file: str | None = None
    nats_tls_key_file: str | None = None
    #: The streams' names: `<stream>_<job>` holds one job's events (`tp.<job>.>`), with its own
    #: limits; `<stream>_ctl` the run-time flush commands.
    stream: str = "TIERPIPE"
    #: Where an agent serves Prometheus `/metrics` and `/healthz` (0: any free port, logged as
    #: `metrics_serving`; -1: off). Loopback unless set otherwise.
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9464
    #: Replicas of the stream and of the KV bucket (3 on a 3-server cluster).
    stream_replicas: int = 1
    #: The JetStream KV bucket of the jobs' compacted state (`tierpipe.control.kvstate`).
    kv_bucket: str = "tierpipe-state"
    #: Events older than this leave the stream (0: kept forever). Limits drop the oldest events
    #: first, so what stays is always a suffix of the history: a copy's removal is never lost
    #: while the events that created it remain. Older checkpoints: `tierpipe reindex`.
    stream_max_age_s: float = 30 * 86400.0
    #: Each job's stream's size limit in bytes (-1: none); the oldest events of that job go
    #: first, never another job's.
    stream_max_bytes: int = -1
    #: Consumers the stream admits: 4 durable ones per node (a stage each) plus short-lived
    #: readers. nats-server's own default is 1,000, which stops a cluster at 250 nodes.
    stream_max_consumers: int = 100_000
    duplicate_window_s: float = 120.0
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 10.0

    # --- stage runner
    ack_wait_s: float = 30.0
    max_deliver: int = 10
    max_ack_pending: int = 64
    retry_base_s: float = 0.5
    retry_max_s: float = 30.0
    #: How long a stopping worker lets in-flight work finish before it is abandoned (and nak'ed).
    drain_timeout_s: float = 30.0
    #: How long a starting agent waits for another agent of the same node (which holds the
    #: node's lock) to exit before it gives up (a rolling update's old agent still draining).
    agent_lock_timeout_s: float = 60.0
    #: Fault injection for tests: the agent SIGKILLs itself at this named point ("" : never).
    fault_point: str = ""
    #: How often an agent stores its node's record (`tierpipe.control.advert`: its roots and store,
    #: for the trainers of its node). A record three of these old counts as no agent.
    node_heartbeat_s: float = 10.0

    # --- node identity and tiers
    #: This node's name; None: the host name's first label.
    node: str | None = None
    staging_root: str = "/dev/shm/tierpipe"
    nvme_root: str = "tierpipe-data/nvme"
    #: Bytes a shard write must leave free on the NVMe filesystem.
    nvme_reserve_bytes: int = 0
    #: Use O_DIRECT for shard writes and verification reads where the filesystem supports it.
    direct_io: bool = True
    io_chunk_bytes: int = 8 << 20
    io_queue_depth: int = 4

    # --- object storage (S3 API)
    #: Endpoint URL; None: AWS's default for the region. The demo starts an embedded SeaweedFS
    #: when `TIERPIPE_S3_ENDPOINT` is not set.
    s3_endpoint: str | None = None
    s3_region: str = "us-east-1"
    s3_bucket: str = "tierpipe"
    #: Key prefix under which `<hh>/<job>/step-.../rank-....shard` objects live.
    s3_prefix: str = ""
    #: Credentials; None: the standard AWS chain (AWS_ACCESS_KEY_ID, profiles, instance roles).
    s3_access_key_id: str | None = None
    s3_secret_access_key: str | None = None
    part_size_bytes: int = 64 << 20
    part_concurrency: int = 4
    #: Upload rate limit in bytes/s (0: unlimited); changeable at run time on `tp.ctl.flush`.
    flush_max_bytes_per_s: int = 0
    s3_connect_timeout_s: float = 5.0
    s3_read_timeout_s: float = 60.0
    #: S3 requests one process has in flight at most; a throttling reply (503 SlowDown) halves
    #: the allowance, successes raise it back to this.
    s3_max_concurrent_requests: int = 64
    #: Retries of a throttled request (waits of up to `retry_base_s * 2**n`, capped at
    #: `retry_max_s`, randomized) before it fails as an outage.
    s3_throttle_retries: int = 6
    #: Multipart uploads under the prefix older than this are aborted at start, whoever began
    #: them (this node's own are aborted at once).
    orphan_upload_max_age_s: float = 86400.0

    # --- retention
    #: Complete steps kept on NVMe (torchtitan's keep_latest_k); at least 2.
    nvme_keep_latest_k: int = 3
    #: Complete steps kept in object storage.
    s3_keep_latest_k: int = 10
    #: Also keep every step divisible by this in object storage (0: off; Orbax's keep_period).
    s3_keep_period: int = 0
    #: Remove NVMe copies that were never flushed (for deployments without object storage).
    evict_unflushed: bool = False
    #: Below this many free bytes on the NVMe filesystem, the oldest flushed copies go first.
    nvme_min_free_bytes: int = 0
    #: Object-storage cadence (defaults of `Keep`): the job names a step for upload at most
    #: every this many steps, and at most every this many seconds (0: as soon as the last one
    #: is complete there).
    s3_every_steps: int = 1
    s3_every_s: float = 0.0
    #: The agent warns when a node lost now would cost more than this many checkpoint
    #: intervals (the steps between the newest saved step and the newest one safe elsewhere).
    risk_warn_steps: int = 4
    #: How long a job's retention coordinator holds its lease without renewing it: after this,
    #: another node's agent takes the job over. It renews at a third of this.
    lease_ttl_s: float = 15.0
    #: How often a coordinator stores what the events it folded changed.
    coordinator_flush_s: float = 0.2

    # --- peer replicas
    #: Copies of each verified shard on partner nodes' NVMe: 0, 1 or 2 (None: 1 where the job
    #: has two nodes or more, else 0).
    peer_replicas: int | None = None
    #: Where the agent's peer endpoint listens (the replicate stage's, and restores' from
    #: peers): host and port (0: any free port). Loopback by default; a non-loopback bind
    #: requires `peer_token`.
    peer_bind_host: str = "127.0.0.1"
    peer_bind_port: int = 0
    #: The address other nodes reach the endpoint at (`http://host:port`; "": the bound one),
    #: e.g. the node's fabric address when it binds 0.0.0.0.
    peer_advertise_url: str = ""
    #: The shared secret every agent's endpoint requires (`Authorization: Bearer ...`); from the
    #: environment (`TIERPIPE_PEER_TOKEN`) or the settings file, never logged.
    peer_token: str | None = None
    #: The node's failure-domain label (e.g. its rack): a partner is chosen in another one.
    failure_domain: str = ""

    # --- recovery
    #: How long ranks wait for each other (and for rank 0's plan) during a restore.
    restore_timeout_s: float = 600.0
    #: A restoring rank that had no plan from rank 0 for this long reads the newest stored one
    #: (one published before it listened, or lost in a reconnect), then less often; ranks that
    #: sent no `ready` wait a random part of it more the first time. Every rank of a slow
    #: restart reads then: at 80,000 ranks, 10 s made the reads cost more than the plan.
    restore_plan_poll_s: float = 30.0
    #: Ranged GETs from object storage in flight at once per node during a restore (all ranks of
    #: a node share it): the guard against every rank of a restart hitting the store at once.
    restore_s3_reads_per_node: int = 8
    #: Restore reads from NVMe with O_DIRECT (true) or through the page cache (false); unset:
    #: O_DIRECT unless the page cache already holds most of the shard. A cold buffered read
    #: allocates a fresh page-cache page for every 4 KiB and copies it once more: on the
    #: reference VM, where page faults are slow, it measured 1.3-3x the O_DIRECT read.
    restore_direct_io: bool | None = None
    #: When torch.distributed is initialised with this job's rank and world size, ranks agree
    #: on the plan through its collectives (the reports and plans still go on the stream).
    restore_use_torch_distributed: bool = True

    # --- trainer
    staging_slots: int = 2
    slot_policy: SlotPolicy = "wait"
    slot_wait_timeout_s: float = 300.0
    publish_timeout_s: float = 10.0
    #: A save whose `staged` event NATS did not take: "report" (as DCP's async_save: the error
    #: goes to the save's handle and the log, its slot is freed, training goes on) or "raise"
    #: (a blocking save() raises it after one try of publish_timeout_s).
    save_errors: SaveErrors = "report"
    #: How long "report" retries a save's `staged` event (NATS down or stalled) in the
    #: background before the save counts as failed; the bytes wait in shared memory meanwhile.
    #: At most duplicate_window_s - publish_timeout_s (every retry must be the same event).
    save_retry_s: float = 60.0
    #: A wait for a staging slot or for the other ranks of a restore warns after this long
    #: (what it waits for, and why), and again every this long while it lasts.
    wait_warning_s: float = 5.0

    # --- logging
    log_level: str = "info"
    log_format: Literal["auto", "json", "console"] = "auto"

    def __post_init__(self) -> None:
        for name in _PATH_FIELDS:
            value = getattr(self, name)
            if value is not None:
                msgspec.structs.force_setattr(self, name, os.path.abspath(value))
        _check(self.stream and all(c not in self.stream for c in ".*> "), "stream", self.stream)
        for name in (
            "ack_wait_s", "retry_base_s", "retry_max_s", "publish_timeout_s", "wait_warning_s",
            "node_heartbeat_s",
        ):  # fmt: skip
            _check(getattr(self, name) > 0, name, getattr(self, name))
        for name in ("max_deliver", "max_ack_pending", "staging_slots", "io_queue_depth"):
            _check(getattr(self, name) >= 1, name, getattr(self, name))
        _check(
            self.io_chunk_bytes >= 4096 and self.io_chunk_bytes % 4096 == 0,
            "io_chunk_bytes",
            self.io_chunk_bytes,
        )
        _check(self.nvme_reserve_bytes >= 0, "nvme_reserve_bytes", self.nvme_reserve_bytes)
        _check(-1 <= self.metrics_port <= 65535, "metrics_port", self.metrics_port)
        _check(self.stream_max_age_s >= 0, "stream_max_age_s", self.stream_max_age_s)
        _check(
            self.stream_max_bytes == -1 or self.stream_max_bytes > 0,
            "stream_max_bytes",
            self.stream_max_bytes,
        )
        _check(self.stream_max_consumers >= 1, "stream_max_consumers", self.stream_max_consumers)
        _check(self.agent_lock_timeout_s >= 0, "agent_lock_timeout_s", self.agent_lock_timeout_s)
        # The newest NVMe copy may still be in flight, so one is never enough on the fast tier.
        _check(self.nvme_keep_latest_k >= 2, "nvme_keep_latest_k", self.nvme_keep_latest_k)
        _check(self.s3_keep_latest_k >= 1, "s3_keep_latest_k", self.s3_keep_latest_k)
        _check(self.s3_keep_period >= 0, "s3_keep_period", self.s3_keep_period)
        _check(self.s3_every_steps >= 1, "s3_every_steps", self.s3_every_steps)
        _check(self.s3_every_s >= 0, "s3_every_s", self.s3_every_s)
        _check(self.risk_warn_steps >= 1, "risk_warn_steps", self.risk_warn_steps)
        _check(self.peer_replicas in (None, 0, 1, 2), "peer_replicas", self.peer_replicas)
        _check(0 <= self.peer_bind_port <= 65535, "peer_bind_port", self.peer_bind_port)
        _check(
            self.peer_advertise_url == ""
            or re.fullmatch(r"https?://[^/\s]+", self.peer_advertise_url) is not None,
            "peer_advertise_url",
            self.peer_advertise_url,
        )
        _check(
            re.fullmatch(r"[A-Za-z0-9_.-]{0,64}", self.failure_domain) is not None,
            "failure_domain",
            self.failure_domain,
        )
        _check(self.lease_ttl_s >= 1, "lease_ttl_s", self.lease_ttl_s)
        _check(0 < self.coordinator_flush_s <= 10, "coordinator_flush_s", self.coordinator_flush_s)
        _check(
            re.fullmatch(r"[A-Za-z0-9_-]{1,64}", self.kv_bucket) is not None,
            "kv_bucket",
            self.kv_bucket,
        )
        # S3 multipart parts are 5 MiB .. 5 GiB (the last part may be smaller).
        _check(5 << 20 <= self.part_size_bytes <= 5 << 30, "part_size_bytes", self.part_size_bytes)
        _check(self.part_concurrency >= 1, "part_concurrency", self.part_concurrency)
        _check(
            self.s3_max_concurrent_requests >= 1,
            "s3_max_concurrent_requests",
            self.s3_max_concurrent_requests,
        )
        _check(self.s3_throttle_retries >= 0, "s3_throttle_retries", self.s3_throttle_retries)
        _check(self.save_retry_s >= 0, "save_retry_s", self.save_retry_s)
        _check(self.restore_timeout_s > 0, "restore_timeout_s", self.restore_timeout_s)
        _check(self.restore_plan_poll_s > 0, "restore_plan_poll_s", self.restore_plan_poll_s)
        _check(
            self.restore_s3_reads_per_node >= 1,
            "restore_s3_reads_per_node",
            self.restore_s3_reads_per_node,
        )
        _check(self.flush_max_bytes_per_s >= 0, "flush_max_bytes_per_s", self.flush_max_bytes_per_s)
        _check(
            not self.s3_prefix.startswith("/") and ".." not in self.s3_prefix.split("/"),
            "s3_prefix",
            self.s3_prefix,
        )

    def __repr__(self) -> str:
        fields = []
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if name in SECRET_FIELDS and value is not None:
                value = "***"
            elif name == "nats_url":
                value = _redact_url(value)
            fields.append(f"{name}={value!r}")
        return f"Settings({', '.join(fields)})"

    def secrets(self) -> list[str]:
        """Every secret value these settings hold (for scrubbing logs), longest first."""
        from urllib.parse import urlsplit

        found = [getattr(self, n) for n in SECRET_FIELDS]
        for u in self.nats_url.split(","):
            parts = urlsplit(u.strip())
            found += [parts.password, parts.username if parts.password is None else None]
        return sorted({v for v in found if v and len(v) >= 4}, key=len, reverse=True)

    def replace(self, **changes: object) -> Settings:
        """A copy with some fields changed (validated)."""
        return load_settings(path=None, env={}, base=self, **changes)

    def as_env(self) -> dict[str, str]:
        """These settings as `TIERPIPE_*` variables, to hand to a worker process."""
        env = {}
        for name, value in msgspec.structs.asdict(self).items():
            text = (
                ""
                if value is None
                else str(value).lower()
                if isinstance(value, bool)
                else str(value)
            )
            env[_ENV_PREFIX + name.upper()] = text
        return env


def _redact_url(url: str) -> str:
    from tierpipe.names import redact_url  # names imports errors only; no circle at run time

    return redact_url(url)


def _check(ok: object, name: str, value: object) -> None:
    if not ok:
        raise ValueError(f"invalid setting {name}={value!r}")


def load_settings(
    path: str | os.PathLike[str] | None = None,
    *,
    env: dict[str, str] | None = None,
    base: Settings | None = None,
    **overrides: object,
) -> Settings:
    """Build the settings.

    Args:
        path: TOML file; defaults to `$TIERPIPE_CONFIG` when set.
        env: environment to read `TIERPIPE_*` overrides from (default `os.environ`).
        base: start from these settings instead of the defaults.
        **overrides: explicit values; they win over everything else.

    Raises:
        ConfigError: unknown key, wrong type or invalid value (the message names the key).
    """
    env = dict(os.environ) if env is None else env
    values: dict[str, object] = msgspec.structs.asdict(base) if base is not None else {}
    explicit = set(explicit_fields(base)) if base is not None else set()
    path = path if path is not None else env.get("TIERPIPE_CONFIG")
    if path:
        try:
            from_file = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read settings file {path}: {e}") from e
        values.update(from_file)
        explicit.update(from_file)
    fields = set(Settings.__struct_fields__)
    for key, raw in env.items():
        if key.startswith(_ENV_PREFIX) and key != "TIERPIPE_CONFIG":
            name = key[len(_ENV_PREFIX) :].lower()
            if name in fields:
                values[name] = _from_env(name, raw)
                explicit.add(name)
    values.update({k: v for k, v in overrides.items()})
    explicit.update(overrides)
    try:
        settings = msgspec.convert(values, Settings, strict=False)
    except (msgspec.ValidationError, ValueError) as e:
        raise ConfigError(f"invalid settings: {e}") from e
    _explicit[id(settings)] = frozenset(explicit & fields)
    weakref.finalize(settings, _explicit.pop, id(settings), None)
    return settings


#: id(settings) -> the fields its file, environment or arguments set (`load_settings`).
_explicit: dict[int, frozenset[str]] = {}


def explicit_fields(settings: Settings) -> frozenset[str]:
    """The fields `settings` were given rather than took as defaults: set by the TOML file,
    a `TIERPIPE_*` variable or an argument of `load_settings` (or `replace`). Settings built
    directly (`Settings(...)`) count every field that differs from its default."""
    found = _explicit.get(id(settings))
    if found is not None:
        return found
    return frozenset(
        name
        for name, default in zip(
            Settings.__struct_fields__, Settings.__struct_defaults__, strict=True
        )
        if getattr(settings, name)
        != (os.path.abspath(default) if name in _PATH_FIELDS and default else default)
    )


def _from_env(name: str, raw: str) -> str | None:
    # Optional fields take "" as None, so `TIERPIPE_NODE=` means "use the host name".
    default = Settings.__struct_defaults__[Settings.__struct_fields__.index(name)]
    if raw == "" and default is None:
        return None
    return raw
