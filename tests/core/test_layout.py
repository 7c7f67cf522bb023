"""The layout's import rules, checked on the source (AST), so a new module cannot quietly break them.

- The library does not depend on its test tools: nothing under ``resilience/`` outside the CLI
  (``resilience/cli/``) and ``resilience/testing/`` imports ``resilience.testing``. ``adapters/`` and ``telemetry/`` are
  ``resilience.adapters`` and ``resilience.telemetry`` (pyproject's package-dir), so they count.
- The core (``resilience/`` without the CLI, ``testing/`` and the two symlinked folders) imports
  neither ``resilience.adapters`` nor ``resilience.telemetry``; the package ``__init__`` alone
  names adapter classes, and only for its lazy exports (PEP 562: imported on first access).
- The core's top level (``resilience/*.py``: policy, outcome, events, breaker, budget, deadline, ...) is
  the layer under the retry core: it imports nothing from ``resilience.retry`` (what drives calls, the
  drivers' ``DriverConfig`` and the attempt ledger, lives in ``adapters/``).
- The core's modules import one another without a circle, counting imports inside functions
  (which would hide a circle from the interpreter) and leaving out ``if TYPE_CHECKING:`` blocks.
- ``tests/core`` mirrors the core: each test module there is ``test_<module>.py`` (or
  ``test_<module>_<topic>.py``) beside the path of the one module it tests, never two modules in one file.
- One import path per name: a core module's ``__all__`` lists only names it defines (a package's
  ``__init__`` may gather its package's names; ``resilience/retry/__init__.py`` defines nothing).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "resilience"


def _module_name(path: Path) -> str:
    """``resilience/...`` (or ``adapters/``, ``telemetry/``) file -> dotted module name."""
    rel = path.relative_to(ROOT)
    parts = list(rel.with_suffix("").parts)
    if parts[0] in ("adapters", "telemetry"):
        parts.insert(0, "resilience")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _files(folder: Path) -> list[Path]:
    """Every ``.py`` file under ``folder``, not following the ``adapters``/``telemetry`` symlinks."""
    return sorted(p for p in folder.rglob("*.py") if not any((ROOT / part).is_symlink() for part in p.relative_to(ROOT).parents))


def _is_cli(module: str) -> bool:
    parts = module.split(".")
    return len(parts) > 1 and parts[1] == "cli"


def _is_testing(module: str) -> bool:
    parts = module.split(".")
    return len(parts) > 1 and parts[1] == "testing"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, *, type_checking: bool) -> Iterator[tuple[int, str]]:
    """(line, module) for every import in the file, at any depth; ``type_checking=False`` skips ``if TYPE_CHECKING:`` bodies.

    ``from resilience import x`` yields ``resilience.x`` (a submodule or a name; both are checked by prefix).
    """
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(node: ast.AST) -> Iterator[tuple[int, str]]:
        if isinstance(node, ast.If) and not type_checking and _is_type_checking(node.test):
            for child in node.orelse:
                yield from visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"
        for child in ast.iter_child_nodes(node):
            yield from visit(child)

    yield from visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))


def _library_files() -> list[Path]:
    files = [*_files(PACKAGE), *_files(ROOT / "adapters"), *_files(ROOT / "telemetry")]
    assert len(files) > 20, f"found only {len(files)} modules; is ROOT ({ROOT}) the repository?"
    return files


def _core_files() -> list[Path]:
    files = [p for p in _files(PACKAGE) if not _is_cli(_module_name(p)) and not _is_testing(_module_name(p))]
    names = {_module_name(p) for p in files}
    expected = {"resilience.retry.retrier", "resilience.retry.call", "resilience.policy", "resilience.outcome", "resilience.errors"}
    assert expected <= names, sorted(names)
    return files


def test_the_library_does_not_import_its_test_tools() -> None:
    """Only the CLI and resilience.testing itself import resilience.testing."""
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for path in _library_files()
        if not _is_cli(_module_name(path)) and not _is_testing(_module_name(path))
        for line, target in _imports(path, type_checking=True)
        if target == "resilience.testing" or target.startswith("resilience.testing.")
    ]
    assert not offenders, "\n".join(offenders)


def test_the_core_imports_neither_adapters_nor_telemetry() -> None:
    """The core stands alone; transports and observers build on it, never the other way round."""
    layers = ("resilience.adapters", "resilience.telemetry")
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for path in _core_files()
        if path != PACKAGE / "__init__.py"  # the lazy exports (module names as strings, TYPE_CHECKING imports)
        for line, target in _imports(path, type_checking=True)
        if any(target == layer or target.startswith(layer + ".") for layer in layers)
    ]
    assert not offenders, "\n".join(offenders)


def test_the_core_top_level_imports_nothing_from_the_retry_core() -> None:
    """``resilience/*.py`` sits under ``resilience/retry/``: the retry core imports it, never the other way round."""
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for path in sorted(PACKAGE.glob("*.py"))
        if path.name != "__init__.py"  # the package's map names retry modules in its docstring only
        for line, target in _imports(path, type_checking=True)
        if target == "resilience.retry" or target.startswith("resilience.retry.")
    ]
    assert len(sorted(PACKAGE.glob("*.py"))) > 10
    assert not offenders, "\n".join(offenders)


CONTRACT = PACKAGE / "engine_contract.py"
FANOUT_ADAPTERS = frozenset({"adapters/ray.py", "adapters/smg_fanout.py"})
"""The adapters that implement a barrier fan-out (``FanOut``) and so build on ``resilience.barrier``; no other may."""


def test_the_engine_contract_sits_below_the_barrier_and_the_clients() -> None:
    """``resilience/engine_contract.py`` imports nothing from ``resilience.barrier`` or ``resilience.adapters``."""
    targets = [target for _, target in _imports(CONTRACT, type_checking=True)]
    assert targets, "the contract module has no imports at all: the wrong file?"
    offenders = [t for t in targets if t.startswith(("resilience.barrier", "resilience.adapters"))]
    assert not offenders, offenders


def test_no_engine_client_imports_the_barrier() -> None:
    """Clients implement the engine contract; only the adapters that implement fan-outs import ``resilience.barrier``."""
    adapters = _files(ROOT / "adapters")
    assert len(adapters) > 10 and all((ROOT / f).is_file() for f in FANOUT_ADAPTERS), FANOUT_ADAPTERS
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for path in adapters
        if str(path.relative_to(ROOT)) not in FANOUT_ADAPTERS
        for line, target in _imports(path, type_checking=True)
        if target == "resilience.barrier" or target.startswith("resilience.barrier.")
    ]
    assert not offenders, "\n".join(offenders)


def test_the_core_has_no_import_circle() -> None:
    """Following every runtime import (function-level ones too) between core modules never comes back."""
    files = {_module_name(p): p for p in _core_files() if p.name != "__init__.py" or p.parent != PACKAGE}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets = set()
        for _, target in _imports(path, type_checking=False):
            # ``from resilience.x import y`` names resilience.x.y: walk up to the module that exists
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
        graph[name] = targets
    assert sum(map(len, graph.values())) > 20, graph

    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                walk(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node, [node])
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


TRANSPORTS = ("requests", "urllib3", "httpx", "httpcore", "aiohttp")
"""The HTTP libraries only the drivers (``resilience.adapters``) import."""


def test_the_core_imports_no_transport_library() -> None:
    """The core (retry loop, errors, barrier) imports no HTTP library, not even lazily: what a call did is the
    drivers' delivery record (``resilience.outcome.attempts_of``), never an exception's library."""
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for path in _core_files()
        for line, target in _imports(path, type_checking=False)
        if target.split(".")[0] in TRANSPORTS
    ]
    assert not offenders, "\n".join(offenders)


REEXPORTS_LEFT = frozenset({"resilience/barrier/journal.py"})
"""Modules still re-exporting names (the journal's errors): the barrier's to settle, never a new one."""


def _defined_names(tree: ast.Module) -> set[str]:
    """Names a module's top level defines (classes, functions, assignments), not names it imports."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _dunder_all(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            assert isinstance(node.value, ast.List | ast.Tuple)
            return [e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def test_a_core_module_exports_only_what_it_defines() -> None:
    """One import path per name: no module (other than a package's ``__init__``) lists another module's name in ``__all__``."""
    offenders = []
    checked = 0
    for path in _core_files():
        rel = str(path.relative_to(ROOT))
        if path.name == "__init__.py" or rel in REEXPORTS_LEFT:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
        exported = _dunder_all(tree)
        checked += bool(exported)
        offenders += [f"{rel}: {name}" for name in exported if name not in _defined_names(tree)]
    assert checked > 20, checked
    assert not offenders, "names exported from a module that does not define them:\n" + "\n".join(offenders)


def test_the_retry_package_file_defines_and_imports_nothing() -> None:
    """``resilience.retry`` is a map (its docstring), so each retry name has one path: its module's."""
    tree = ast.parse((PACKAGE / "retry" / "__init__.py").read_text(encoding="utf-8"))
    body = tree.body[1:] if tree.body and isinstance(tree.body[0], ast.Expr) else tree.body
    assert ast.get_docstring(tree), "the package docstring is the map of the retry core"
    assert not body, [ast.dump(node)[:80] for node in body]


TESTS = ROOT / "tests" / "core"
CROSS_CUTTING = frozenset({"test_layout.py", "test_layout_emulator.py", "test_without_extras.py", "test_public_surface.py"})
"""Test modules about the whole package (its import rules, its extras, ``resilience/__init__.py``'s surface), not one module."""


def test_tests_core_mirrors_the_core() -> None:
    """``tests/core/<dir>/test_<module>[_<topic>].py`` tests ``resilience/<dir>/<module>.py``, and only that one module."""
    offenders = []
    mirrored = 0
    for test in sorted(TESTS.rglob("test_*.py")):
        if test.parent == TESTS and test.name in CROSS_CUTTING:
            continue
        folder = PACKAGE / test.parent.relative_to(TESTS)
        modules = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"} if folder.is_dir() else set()
        words = test.stem.removeprefix("test_").split("_")
        # the longest leading run of words that names a module; what follows is a topic, never another module
        subject = next(("_".join(words[:n]) for n in range(len(words), 0, -1) if "_".join(words[:n]) in modules), None)
        rest = test.stem.removeprefix("test_").removeprefix(subject or "").strip("_")
        if subject is None:
            offenders.append(f"{test.relative_to(ROOT)}: no module {folder.relative_to(ROOT)}/<name>.py for it")
        elif any(rest == m or rest.startswith(m + "_") for m in modules if m != subject):
            offenders.append(f"{test.relative_to(ROOT)}: pairs {subject} with another module ({rest})")
        else:
            mirrored += 1
    assert mirrored >= 10, mirrored
    assert not offenders, "\n".join(offenders)
