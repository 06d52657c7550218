"""Settings: defaults, TOML file, environment and explicit overrides, with clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierpipe.errors import ConfigError
from tierpipe.settings import Settings, load_settings


def test_precedence_file_then_env_then_arguments(tmp_path: Path) -> None:
    """Explicit arguments beat TIERPIPE_* variables, which beat the file, which beats defaults."""
    conf = tmp_path / "t.toml"
    conf.write_text('stream = "FROMFILE"\nack_wait_s = 7\nnode = "file-node"\n')
    env = {"TIERPIPE_CONFIG": str(conf), "TIERPIPE_ACK_WAIT_S": "9", "TIERPIPE_DIRECT_IO": "false"}
    s = load_settings(env=env, node="arg-node")
    assert (s.stream, s.ack_wait_s, s.direct_io, s.node) == ("FROMFILE", 9.0, False, "arg-node")
    assert s.max_deliver == Settings().max_deliver


def test_unknown_key_in_file_is_an_error(tmp_path: Path) -> None:
    """A typo in the TOML file fails loudly instead of silently keeping a default."""
    conf = tmp_path / "t.toml"
    conf.write_text("ack_wiat_s = 3\n")
    with pytest.raises(ConfigError, match="ack_wiat_s"):
        load_settings(conf, env={})


@pytest.mark.parametrize(
    ("field", "value"),
    [("staging_slots", 0), ("io_chunk_bytes", 1000), ("stream", "a.b"), ("slot_policy", "maybe")],
)
def test_invalid_values_name_the_setting(field: str, value: object) -> None:
    """Out-of-range values are rejected with the setting's name in the message."""
    with pytest.raises(ConfigError, match=field if field != "slot_policy" else "slot_policy"):
        load_settings(env={}, **{field: value})


def test_env_round_trip() -> None:
    """as_env() hands settings to a worker process losslessly."""
    s = load_settings(env={}, node="n1", direct_io=False, nvme_reserve_bytes=123)
    assert load_settings(env=s.as_env()) == s


def test_paths_are_made_absolute_when_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative nvme_root means the same directory whatever working directory a worker is
    restarted from: it is resolved once, when the settings are built."""
    monkeypatch.chdir(tmp_path)
    s = load_settings(env={}, nvme_root="data/nvme", nats_creds_file="x.creds")
    assert s.nvme_root == str(tmp_path / "data" / "nvme")
    assert s.nats_creds_file == str(tmp_path / "x.creds")
    assert Path(s.staging_root).is_absolute()
    monkeypatch.chdir("/")
    assert load_settings(env=s.as_env()).nvme_root == s.nvme_root


def test_repr_never_shows_secrets() -> None:
    """Passwords, tokens, secret keys and credentials inside the NATS URL never appear in a repr."""
    s = load_settings(
        env={},
        nats_url="nats://agent:hunter2-nats@10.0.0.1:4222",
        nats_password="pw-field-secret",
        nats_token="tok-field-secret",
        s3_secret_access_key="s3-secret-key-value",
    )
    text = repr(s) + str(s) + f"{s}"
    for secret in ("hunter2-nats", "pw-field-secret", "tok-field-secret", "s3-secret-key-value"):
        assert secret not in text
        assert secret in s.secrets()
    assert "nats_password='***'" in text and "10.0.0.1:4222" in text
