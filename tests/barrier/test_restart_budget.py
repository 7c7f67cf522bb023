"""``resilience.barrier.journal``'s restart budget: its record outlives the process, and a bad file is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from resilience.barrier.journal import RestartBudget, RestartBudgetError, RestartRecorded
from resilience.events import Event


def test_restart_budget_persists_across_processes(tmp_path: Path) -> None:
    """The record survives a new RestartBudget on the same file (the restart it counts)."""
    path = tmp_path / "restarts.json"
    seen: list[Event] = []
    first = RestartBudget(3, path=path, observers=[seen.append])
    first.record("502 on /pause_generation", step=39)
    first.record("engine death", step=56)
    second = RestartBudget(3, path=path)
    assert second.used == 2 and second.remaining == 1
    second.record("again")
    assert RestartBudget(3, path=path).remaining == 0
    assert isinstance(seen[-1], RestartRecorded) and seen[-1].remaining == 1
    assert second.causes() == {"502 on /pause_generation": 1, "engine death": 1, "again": 1}


@pytest.mark.parametrize(
    ("content", "fragment"),
    [("{not json", "not JSON"), (json.dumps({"format": "something-else"}), "is not a"), (json.dumps([1, 2]), "is not a")],
)
def test_restart_budget_refuses_corrupt_or_foreign_file(tmp_path: Path, content: str, fragment: str) -> None:
    """A corrupt or foreign file is a clear error, never a silent reset."""
    path = tmp_path / "restarts.json"
    path.write_text(content)
    with pytest.raises(RestartBudgetError, match=fragment):
        RestartBudget(3, path=path)
    assert path.read_text() == content
