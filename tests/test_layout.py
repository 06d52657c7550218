"""The package's layout rules (DESIGN.md §3), read from the source: the import graph of `tierpipe`,
its `__all__` declarations and the wheel's package list in pyproject.toml.

An import counts wherever it is (a function body too), and one under `if TYPE_CHECKING:` counts
too (for mypy and for a reader it is the same dependency). Importing `a.b.c` runs package `a.b`'s
`__init__` first, which may import its public names: for the circle rule that is an edge to each
package above the target that is not also above the importer (the root `tierpipe`, which every
import runs first and which imports only leaves, excepted). A rule that a module outside this
change still breaks is listed in `KNOWN_EXCEPTIONS`, and each test also fails once a listed
exception no longer occurs, so the list only shrinks.
"""

from __future__ import annotations

import ast
import importlib
import tomllib
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

#: (rule, offender) pairs that are allowed for now. Each names a module that other work is
#: rewriting (issue 21); remove the entry with the change that fixes it (the tests fail until then).
KNOWN_EXCEPTIONS: frozenset[tuple[str, str]] = frozenset()

#: Folder names that are import packages only under `tierpipe` (never importable bare).
BARE_NAMES = frozenset({"pipeline", "stages", "schemas"})
#: The only module outside the dev harness that may import it (for `tierpipe demo`).
DEV = "tierpipe.dev"
DEV_IMPORTERS = frozenset({"tierpipe.cli.ops"})


@dataclass(frozen=True)
class Import:
    """One import statement's target, resolved to a module of the package where it is one."""

    line: int
    #: The top-level name imported (`tierpipe`, `nats`, `bench`, ...).
    top: str
    #: The module of the package it loads (None: not the project's).
    module: str | None
    #: Inside `if TYPE_CHECKING:`, so never executed.
    typing_only: bool


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    imports: list[Import] = field(default_factory=list)

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"

    def where(self, imp: Import) -> str:
        return f"{self.path.relative_to(ROOT)}:{imp.line}"


def _package_dirs() -> dict[str, Path]:
    """Import package -> its folder, from `[tool.setuptools.package-dir]`."""
    return {pkg: ROOT / d for pkg, d in PYPROJECT["tool"]["setuptools"]["package-dir"].items()}


@cache
def modules() -> dict[str, Module]:
    """Every module of the package by dotted name, with its imports resolved."""
    found: dict[str, Module] = {}
    # The most specific mapping wins for a folder inside another package's folder.
    for pkg, folder in sorted(_package_dirs().items(), key=lambda kv: -kv[0].count(".")):
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([pkg, *parts])
            found.setdefault(name, Module(name, path, ast.parse(path.read_text(), str(path))))
    for mod in found.values():
        mod.imports = list(_imports(mod, found))
    return found


def _typing_only_nodes(tree: ast.Module) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (
            (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
            or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
        ):
            for child in node.body:
                out.update(id(n) for n in ast.walk(child))
    return out


def _resolve(name: str, known: dict[str, Module]) -> str | None:
    """The package's module that importing `name` loads: itself or its longest known prefix."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(mod: Module, known: dict[str, Module]) -> Iterator[Import]:
    typing_only = _typing_only_nodes(mod.tree)
    for node in ast.walk(mod.tree):
        guarded = id(node) in typing_only
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(
                    node.lineno, alias.name.partition(".")[0], _resolve(alias.name, known), guarded
                )
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's own package, `level - 1` up
                base = mod.name if mod.is_package else mod.name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            for alias in node.names:
                # `from a import b` loads module a.b when b is one, else a.
                sub = f"{source}.{alias.name}"
                target = sub if sub in known else _resolve(source, known)
                yield Import(node.lineno, source.partition(".")[0], target, guarded)


def _edges(*, packages: bool = False) -> dict[str, set[str]]:
    """Module -> the package's modules it imports; with `packages`, also the packages whose
    `__init__` an import runs first (above the target, not above the importer, not the root)."""
    edges: dict[str, set[str]] = {}
    for name, mod in modules().items():
        targets = {i.module for i in mod.imports if i.module and i.module != name}
        if packages:
            for target in list(targets):
                parent = target.rpartition(".")[0]
                while parent.count("."):  # stops at the root package
                    if not (name + ".").startswith(parent + "."):
                        targets.add(parent)
                    parent = parent.rpartition(".")[0]
        edges[name] = targets - {name}
    return edges


def _violations(rule: str, found: dict[str, list[str]]) -> None:
    """Fail on offenders of `rule` that are not known exceptions, and on known exceptions that
    no longer offend (`found`: offender -> what it does)."""
    known = {offender for r, offender in KNOWN_EXCEPTIONS if r == rule}
    new = [line for k, lines in sorted(found.items()) if k not in known for line in lines]
    assert not new, f"{rule}:\n  " + "\n  ".join(new)
    fixed = sorted(known - found.keys())
    assert not fixed, f"{rule}: no longer broken, remove from KNOWN_EXCEPTIONS: {fixed}"


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as one
    shortest cycle through its first module in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    cycles = []
    for component in components:
        start = min(component)
        paths = {start: [start]}  # breadth first: a shortest way back to `start`
        frontier = [start]
        cycle: list[str] = []
        while not cycle:
            following = []
            for v in frontier:
                for w in sorted(edges[v] & component):
                    if w == start:
                        cycle = [*paths[v], start]
                        break
                    if w not in paths:
                        paths[w] = [*paths[v], w]
                        following.append(w)
                if cycle:
                    break
            frontier = following
        cycles.append(cycle)
    return sorted(cycles)


def _module_all(mod: Module) -> ast.expr | None:
    for node in mod.tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return node.value  # type: ignore[union-attr]
    return None


# --- the import graph


def test_the_graph_sees_the_package() -> None:
    """The graph holds every folder's modules and finds imports inside functions."""
    mods = modules()
    for name in ("tierpipe", "tierpipe.cli.ops", "tierpipe.dev.demo", "tierpipe.stages.flush",
                 "tierpipe.schemas.events", "tierpipe.storage.s3.store"):  # fmt: skip
        assert name in mods, name
    assert "tierpipe.dev.demo" in _edges()["tierpipe.cli.ops"]  # imported inside a function
    # importing tierpipe.bus.consumer runs tierpipe.bus's __init__ first
    assert "tierpipe.bus" not in _edges()["tierpipe.trainer.handle"]
    assert "tierpipe.bus" in _edges(packages=True)["tierpipe.trainer.handle"]
    assert _cycles({"a": {"b"}, "b": {"c", "a"}, "c": {"a"}}) == [["a", "b", "a"]]


def test_no_import_circles() -> None:
    """No module of the package imports itself through others: typing-only imports count, and so
    does the `__init__` of a package an import runs first."""
    found = {" <-> ".join(sorted(set(c))): [" -> ".join(c)] for c in _cycles(_edges(packages=True))}
    _violations("no-circle", found)


def test_schemas_import_nothing_of_the_project() -> None:
    """tierpipe.schemas (wire and on-disk types) imports only its own modules."""
    found: dict[str, list[str]] = defaultdict(list)
    for name, mod in modules().items():
        if name == "tierpipe.schemas" or name.startswith("tierpipe.schemas."):
            for i in mod.imports:
                if i.top == "tierpipe" and not (i.module or "").startswith("tierpipe.schemas"):
                    found[name].append(f"{mod.where(i)}: {name} imports {i.module}")
    _violations("schemas-alone", found)


def test_stages_never_import_each_other() -> None:
    """A stage module imports no other stage (nor the stages package, which imports them all)."""
    found: dict[str, list[str]] = defaultdict(list)
    for name, mod in modules().items():
        if name.startswith("tierpipe.stages."):
            for i in mod.imports:
                target = i.module or ""
                if target != name and (target + ".").startswith("tierpipe.stages."):
                    found[name].append(f"{mod.where(i)}: {name} imports {target}")
    _violations("stages-apart", found)


def test_only_the_cli_imports_the_dev_harness() -> None:
    """Nothing outside tierpipe.dev imports it but tierpipe.cli.ops (`tierpipe demo`, `up`)."""
    found: dict[str, list[str]] = defaultdict(list)
    for name, mod in modules().items():
        if name in DEV_IMPORTERS or (name + ".").startswith(DEV + "."):
            continue
        for i in mod.imports:
            if ((i.module or "") + ".").startswith(DEV + "."):
                found[name].append(f"{mod.where(i)}: {name} imports {i.module}")
    _violations("dev-apart", found)


def test_the_package_imports_neither_tests_nor_bench() -> None:
    """No module of the package imports the test suite or the benchmarks."""
    found: dict[str, list[str]] = defaultdict(list)
    for name, mod in modules().items():
        for i in mod.imports:
            if i.top in ("tests", "bench"):
                found[name].append(f"{mod.where(i)}: {name} imports {i.top}")
    _violations("no-tests-or-bench", found)


def test_no_bare_folder_names() -> None:
    """Modules import `tierpipe...`, never the folders' names (pipeline, stages, schemas)."""
    found: dict[str, list[str]] = defaultdict(list)
    for name, mod in modules().items():
        for i in mod.imports:
            if i.top in BARE_NAMES:
                found[name].append(f"{mod.where(i)}: {name} imports {i.top} (use tierpipe)")
    _violations("no-bare-names", found)


# --- packaging and public names


def test_every_subpackage_is_in_the_wheel() -> None:
    """pyproject's packages list names every folder with an `__init__.py`, and only those (else
    a wheel lacks modules an editable install has)."""
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    on_disk = {name for name, mod in modules().items() if mod.is_package}
    assert on_disk - listed == set(), "add to [tool.setuptools] packages in pyproject.toml"
    assert listed - on_disk == set(), "listed in pyproject.toml but no such package"


def test_every_all_is_a_tuple() -> None:
    """Every `__all__` in the package is a tuple (immutable, as anyio and msgspec declare it)."""
    found: dict[str, list[str]] = defaultdict(list)
    for name, mod in modules().items():
        value = _module_all(mod)
        if value is not None and not isinstance(value, ast.Tuple):
            found[name].append(f"{mod.path.relative_to(ROOT)}: __all__ is not a tuple")
    _violations("all-is-tuple", found)


@pytest.mark.parametrize(
    "name", sorted(n for n, m in modules().items() if _module_all(m) is not None)
)
def test_every_public_name_imports(name: str) -> None:
    """Every name a module's (or package's) `__all__` lists can be imported from it."""
    module = importlib.import_module(name)
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert missing == [], f"{name}.__all__ lists names it does not have: {missing}"


# --- size and boundaries

#: The longest a module may be (lines, docstring included): past it, cut it on a seam.
MAX_LINES = 450
#: The most modules a package folder may hold directly (its `__init__` not counted).
MAX_MODULES = 15
#: Where `nats` may be imported: the NATS boundary, and the dev harness (its embedded server).
NATS_HOMES = ("tierpipe.bus", "tierpipe.dev")


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_no_module_is_too_long() -> None:
    """No module of the package is over `MAX_LINES` lines."""
    found: dict[str, list[str]] = defaultdict(list)
    for name, mod in modules().items():
        lines = len(mod.path.read_text().splitlines())
        if lines > MAX_LINES:
            found[name].append(f"{mod.path.relative_to(ROOT)}: {lines} lines (> {MAX_LINES})")
    _violations("max-lines", found)


def test_no_folder_holds_too_many_modules() -> None:
    """No package folder holds more than `MAX_MODULES` modules directly (its `__init__` and
    `__main__` and its subfolders not counted): a folder that grows past it wants a subfolder
    per subsystem."""
    found: dict[str, list[str]] = defaultdict(list)
    for name, mod in modules().items():
        if not mod.is_package:
            continue
        folder = mod.path.parent
        count = sum(1 for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
        if count > MAX_MODULES:
            found[name].append(f"{folder.relative_to(ROOT)}/: {count} modules (> {MAX_MODULES})")
    _violations("max-modules", found)


def test_only_the_bus_imports_nats() -> None:
    """nats-py is imported only inside `tierpipe.bus` (and the dev harness, which runs a
    server): everything else reaches NATS through `Bus` and the job store."""
    found: dict[str, list[str]] = defaultdict(list)
    for name, mod in modules().items():
        if any(_within(name, home) for home in NATS_HOMES):
            continue
        for i in mod.imports:
            if i.top == "nats":
                found[name].append(f"{mod.where(i)}: {name} imports nats")
    _violations("nats-in-bus", found)


def test_nothing_outside_the_stages_imports_a_stage() -> None:
    """No module outside `tierpipe.stages` imports a stage module (the package's registry,
    `tierpipe.stages`, is how the agent finds them): what stages share lives below them."""
    found: dict[str, list[str]] = defaultdict(list)
    for name, mod in modules().items():
        if _within(name, "tierpipe.stages"):
            continue
        for i in mod.imports:
            if (i.module or "").startswith("tierpipe.stages."):
                found[name].append(f"{mod.where(i)}: {name} imports {i.module}")
    _violations("stages-below", found)
