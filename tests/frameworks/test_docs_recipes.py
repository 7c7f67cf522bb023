"""docs/frameworks.md's AReaL, verl and SkyRL recipes run as written, on the frameworks' own code.

Each section's python block is executed as it stands (in this process: AReaL's import takes
tens of seconds on 2 cores, and tests/frameworks already pays it), on the emulated servers it
starts itself; it must print what the page says it prints, leave every engine alive with
nothing released, and its mount must have carried the probe. The servers and the mount it
leaves are stopped afterwards, as a user's process would at exit.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("torch")

from resilience.adapters.instrument import SGLangInstrumentor
from resilience.testing.frameworks import _keeping_logging
from tests.frameworks.test_frameworks import _available

PAGE = Path(__file__).resolve().parents[2] / "docs" / "frameworks.md"
_FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


def recipe(heading: str) -> str:
    """The one python block under ``heading`` (a ``## `` line) of docs/frameworks.md."""
    text = PAGE.read_text(encoding="utf-8")
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    [code] = _FENCE.findall(text[start : end if end > 0 else None])
    return str(code)


@pytest.mark.parametrize(
    ("framework", "heading"), [("areal", "## AReaL 1.0.4"), ("verl", "## verl 0.9.1"), ("skyrl", "## SkyRL 0.4.0 (vLLM)")]
)
def test_recipe_runs_as_written(framework: str, heading: str) -> None:
    """The recipe, executed as written: it prints ``[True, True]``, no engine died or stays released or asleep, and an
    SGLang recipe's mount carried its probe."""
    _available(framework)
    code = recipe(heading)
    probes = 0 if framework == "skyrl" else 1
    assert probes == 0 or ("memory_probe=probe" in code and "probe = " in code)  # the probe variant, defined where it is used
    namespace: dict[str, Any] = {"__name__": "__recipe__"}
    printed = io.StringIO()
    try:
        with _keeping_logging(), contextlib.redirect_stdout(printed):
            exec(compile(code, f"docs/frameworks.md {heading}", "exec"), namespace)
        inst = SGLangInstrumentor.active()
        assert inst is not None and len(inst.memory_probes()) == probes
        fleet = namespace["fleet"]
        assert all(e.alive() and not e.state().get("released_tags") and not e.state().get("sleeping_tags") for e in fleet.engines)
        assert printed.getvalue().splitlines()[-1] == "[True, True]", printed.getvalue()[-2000:]
    finally:
        active = SGLangInstrumentor.active()
        if active is not None:
            active.uninstrument()
        rollout = namespace.get("rollout")
        if rollout is not None:
            with _keeping_logging():
                rollout.destroy()
        fleet = namespace.get("fleet")
        if fleet is not None:
            fleet.stop()
