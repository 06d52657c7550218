"""mkdocs hooks of the API reference (`hooks:` in mkdocs.yml), so `mkdocs build` alone builds it.

- The import package as griffe sees it. griffe (mkdocstrings' reader) reads source files, not
  imports, and finds a package by its folder's name: tierpipe's folders are `pipeline/`, `stages/`
  and `schemas/` (pyproject's `package-dir`), so the reference reads a tree of links named as
  installed, `build/api-src/tierpipe` (the links `make typecheck` makes for mypy).
- The CLI page's help text, the errors page's tree and the settings file, from the repository
  at build time, so none goes stale.
- Links out of `docs/` (to `deploy/README.md`, say) work when a page is read in the repository,
  and nowhere in the built site: there they name the repository's file instead.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority

from tierpipe.errors import TierpipeError

ROOT = Path(__file__).resolve().parent.parent
#: What mkdocs.yml's mkdocstrings `paths` names.
API_SRC = ROOT / "build" / "api-src"
#: The line of a page that the CLI's help replaces.
CLI_HELP = "<!-- tierpipe --help -->"
#: The line of a page that the error classes' tree replaces.
ERROR_TREE = "<!-- error tree -->"
#: A line of a page that a repository file replaces, as a code block: (path).
_INCLUDE = re.compile(r"^<!-- include (\S+) -->$", re.M)
#: A relative Markdown link: (text, target, #anchor).
_LINK = re.compile(r"\[([^\]]+)\]\(((?:\.\./)+[^)\s#]+)(#[^)\s]*)?\)")


# Before the plugins' own: mkdocstrings keeps only the search paths that exist when it starts.
@event_priority(100)
def on_config(config: Any) -> Any:
    """Link `build/api-src/tierpipe` to the repository's folders, as the package installs them.

    Only what differs changes, each link replaced atomically: two builds at once (`make docs`
    beside the test) never see the tree half made.
    """
    pkg = API_SRC / "tierpipe"
    pkg.mkdir(parents=True, exist_ok=True)
    wanted = {
        e.name: e
        for e in (ROOT / "pipeline").iterdir()
        if e.suffix == ".py" or (e / "__init__.py").is_file()
    }
    wanted |= {folder: ROOT / folder for folder in ("stages", "schemas")}
    for name in os.listdir(pkg):
        if name not in wanted and not name.startswith("."):  # (a link being made: ".<name>.<pid>")
            (pkg / name).unlink(missing_ok=True)
    for name, target in wanted.items():
        link = pkg / name
        if not (link.is_symlink() and Path(os.readlink(link)) == target):
            tmp = pkg / f".{name}.{os.getpid()}"
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(target)
            os.replace(tmp, link)
    return config


def on_page_markdown(markdown: str, *, page: Any, config: Any, **kwargs: Any) -> str:
    """Name the repository's file for a link out of `docs/`; put in the CLI's help, the error
    tree and the files a page includes where it asks for them."""
    folder = (Path(config["docs_dir"]) / page.file.src_uri).parent
    markdown = _LINK.sub(lambda m: _outside(m, folder, Path(config["docs_dir"])), markdown)
    if CLI_HELP in markdown:
        markdown = markdown.replace(CLI_HELP, _cli_help())
    if ERROR_TREE in markdown:
        markdown = markdown.replace(ERROR_TREE, "\n".join(_error_tree(TierpipeError)))
    return _INCLUDE.sub(_include, markdown)


def _include(line: re.Match[str]) -> str:
    """The repository file a page names, as a code block (its language from its suffix)."""
    path = ROOT / line[1]
    return f"```{path.suffix.lstrip('.')}\n{path.read_text().rstrip()}\n```"


def _outside(link: re.Match[str], folder: Path, docs: Path) -> str:
    """A link whose target leaves `docs/`, as the path of that file in the repository."""
    target = (folder / link[2]).resolve()
    if target.is_relative_to(docs.resolve()):
        return link[0]
    path = target.relative_to(ROOT).as_posix()
    named = f"`{path}{link[3] or ''}` in the repository"
    return named if link[1] in (path, f"`{path}`") else f"{link[1]} ({named})"


def _error_tree(
    error: type[BaseException], depth: int = 0, parent: type | None = None
) -> list[str]:
    """A nested list of `error` and its subclasses, each linked to its entry on the page; a
    class with two bases is under both, and says so."""
    others = [b.__name__ for b in error.__bases__ if b is not parent and parent is not None]
    also = f" (also {', '.join(f'`{b}`' for b in others)})" if others else ""
    name = error.__name__
    lines = [f"{'    ' * depth}- [`{name}`](#{error.__module__}.{name}){also}"]
    for sub in sorted(error.__subclasses__(), key=lambda c: c.__name__):
        if sub.__module__ == error.__module__:
            lines += _error_tree(sub, depth + 1, error)
    return lines


def _cli_help() -> str:
    """`tierpipe --help`, as the installed command prints it, as a Markdown code block."""
    # The console script beside this Python (the venv's), whatever builds the command.
    command = Path(sys.executable).with_name("tierpipe")
    # A fixed width, so the text wraps the same on every terminal and in CI.
    env = {**os.environ, "COLUMNS": "100", "NO_COLOR": "1"}
    out = subprocess.run(
        [str(command), "--help"],
        capture_output=True, text=True, env=env, timeout=120, check=True,
    )  # fmt: skip
    return f"```text\n$ tierpipe --help\n{out.stdout.rstrip()}\n```"
