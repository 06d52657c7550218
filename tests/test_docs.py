"""The API reference (issue 24, item 6): `make docs`'s build passes with no warning, and the
public surface a user touches is in the pages it writes."""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import tierpipe.errors
import tierpipe.schemas.events
import tierpipe.schemas.names
import tierpipe.schemas.shard

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parent.parent

#: Page -> the objects it must document (the anchors mkdocstrings gives them), beside every
#: name in the `__all__` of the modules `exported` lists.
DOCUMENTED = {
    "api/tierpipe": [
        "tierpipe.Checkpointer",
        "tierpipe.Checkpointer.save",
        "tierpipe.Checkpointer.restore",
        "tierpipe.Checkpointer.latest_step",
        "tierpipe.Checkpointer.wait_until_finished",
        "tierpipe.Checkpointer.resume_flush",
        "tierpipe.recovery.agree.Restored",  # (what restore() returns)
        "tierpipe.recovery.agree.Restored.step",
        "tierpipe.recovery.agree.Restored.state",
        "tierpipe.SaveHandle",
        "tierpipe.SaveHandle.result",
        "tierpipe.SaveStats",
        "tierpipe.SaveStats.staged",
        "tierpipe.Keep",
        "tierpipe.Keep.s3_every_s",
        "tierpipe.Settings",
        "tierpipe.Settings.nats_url",
        "tierpipe.load_settings",
        "tierpipe.load_shard",
        "tierpipe.write_shard",
    ],
}


def make_docs(site: Path) -> subprocess.CompletedProcess[str]:
    """Run the Makefile's `docs` recipe as it stands, writing the site into `site`."""
    found = re.search(r"^docs:.*\n\t(.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert found, "the Makefile lost its docs target"
    argv = shlex.split(found[1].replace("$(VENV)/bin/", ""))
    assert argv[:3] == ["mkdocs", "build", "--strict"], argv
    argv[argv.index("--site-dir") + 1] = str(site)
    return subprocess.run(
        [sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=240
    )


def exported(path: str) -> list[str]:
    """A module's `__all__`, read from its source (the frameworks need not be imported)."""
    for node in ast.parse((ROOT / path).read_text()).body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "__all__":
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{path} has no __all__")


def anchors(page: Path) -> set[str]:
    return set(re.findall(r'id="([^"]+)"', page.read_text()))


def test_the_docs_build_without_a_warning_and_document_the_public_api(tmp_path: Path) -> None:
    """`make docs`'s build succeeds in strict mode with no warning at all, and every public
    name (the trainer API, the error tree, the integrations, the schemas, the settings file,
    the CLI) has its entry in the built pages."""
    out = make_docs(tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "WARNING" not in out.stderr, out.stderr[-4000:]

    wanted = {page: list(names) for page, names in DOCUMENTED.items()}
    wanted["api/errors"] = [f"tierpipe.errors.{n}" for n in tierpipe.errors.__all__]
    wanted["api/schemas"] = [
        f"{module.__name__}.{n}"
        for module in (tierpipe.schemas.events, tierpipe.schemas.shard, tierpipe.schemas.names)
        for n in module.__all__
    ]
    wanted["api/integrations"] = [
        f"tierpipe.integrations.{name}.{n}"
        for name in ("lightning", "model_parallel", "hf")
        for n in exported(f"pipeline/integrations/{name}.py")
    ]
    missing = {
        page: sorted(set(names) - anchors(tmp_path / f"{page}.html"))
        for page, names in wanted.items()
    }
    assert not any(missing.values()), missing

    errors = (tmp_path / "api" / "errors.html").read_text()
    for name in tierpipe.errors.__all__:  # the tree at the top links every class
        if isinstance(getattr(tierpipe.errors, name), type):
            assert f'href="#tierpipe.errors.{name}"' in errors, name
    settings = (tmp_path / "settings.html").read_text()
    assert "nats_url = " in settings  # (deploy/tierpipe.example.toml, included)
    cli = (tmp_path / "cli.html").read_text()
    assert "usage: tierpipe" in cli
    architecture = (tmp_path / "architecture.html").read_text()
    assert 'href="tiers.html"' in architecture
    assert 'href="control-plane.html"' in architecture
