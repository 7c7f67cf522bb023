"""The emulator's modules (``resilience/testing/emulator/``) import one another without a circle; so do the test tools
(``resilience/testing/``, the lab and the emulator together) and the CLI (``resilience/cli/``).

The same rule as the core's (``test_layout.py``): every runtime import counts, those inside
functions too (which hide a circle from the interpreter until the function runs), and
``if TYPE_CHECKING:`` blocks do not. Shared constants go in a leaf module (``ready.py``
holds the READY line that the engine prints and the fleet reads).
"""

from __future__ import annotations

from pathlib import Path

from tests.core.test_layout import PACKAGE, _files, _imports, _module_name

EMULATOR = PACKAGE / "testing" / "emulator"


def _graph(*folders: Path) -> dict[str, set[str]]:
    """Module -> the modules of ``folders`` (default: the emulator's) it imports at runtime (``from .x import y`` walked
    up to the module ``.x``)."""
    files = {_module_name(p): p for folder in folders or (EMULATOR,) for p in _files(folder)}
    assert len(files) > 20, sorted(files)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets = set()
        for _, target in _imports(path, type_checking=False):
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every circle a depth-first walk of ``graph`` meets, as the path that closes it."""
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
    return cycles


def test_the_emulator_has_no_import_circle() -> None:
    """Following every runtime import between the emulator's modules never comes back."""
    graph = _graph()
    assert sum(map(len, graph.values())) > 20, graph
    cycles = _cycles(graph)
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_circle_finder_finds_the_old_ready_line_circle() -> None:
    """The check is not vacuous: the circle this package had (server -> serve_many -> fleet -> processes -> server) is
    found."""
    graph = _graph()
    graph["resilience.testing.emulator.processes"] = {*graph["resilience.testing.emulator.processes"], "resilience.testing.emulator.server"}
    assert "resilience.testing.emulator.serve_many" in graph["resilience.testing.emulator.server"]
    cycles = _cycles(graph)
    assert any(c[0] == c[-1] and "resilience.testing.emulator.processes" in c and "resilience.testing.emulator.server" in c for c in cycles)


def test_the_test_tools_and_the_cli_have_no_import_circle() -> None:
    """Following every runtime import between the modules of resilience/testing (the lab, the emulator) and resilience/cli
    never comes back (``cli/probe.py`` and ``cli/probe_vllm.py`` imported each other before they were one module)."""
    graph = _graph(PACKAGE / "testing", PACKAGE / "cli")
    assert "resilience.testing.lab" in graph["resilience.testing.colocate"], graph["resilience.testing.colocate"]
    cycles = _cycles(graph)
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)
