"""``resilience.budget``: the retry budget (spend, floor, deposits) and the restart budget's file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from resilience import RetryBudgetConfig
from resilience.budget import RestartBudget, RestartBudgetError, RetryBudget
from resilience.clock import FakeClock
from resilience.events import Event, RestartRecorded


def test_retry_budget_spends_and_floor_refills() -> None:
    """Retries stop when the bucket is spent; the time floor lets a quiet engine retry again."""
    clock = FakeClock()
    budget = RetryBudget(RetryBudgetConfig(ratio=0.0, min_retries_per_second=1.0, max_tokens=2), clock=clock)
    assert budget.try_withdraw() and budget.try_withdraw()
    assert not budget.try_withdraw()
    clock.advance(1.0)
    assert budget.try_withdraw()


def test_retry_budget_deposits_per_call() -> None:
    """Each call deposits ``ratio`` tokens, capped by ``max_tokens``."""
    budget = RetryBudget(RetryBudgetConfig(ratio=0.5, min_retries_per_second=0, max_tokens=1), clock=FakeClock())
    assert budget.try_withdraw()
    budget.deposit()
    assert not budget.try_withdraw()
    budget.deposit()
    assert budget.try_withdraw()


def test_a_deposit_into_a_full_budget_changes_nothing_later() -> None:
    """A full bucket skips the deposit (and its refill); a later withdrawal refills to the same balance as if it had not."""
    clock = FakeClock()
    config = RetryBudgetConfig(ratio=0.5, min_retries_per_second=0.5, max_tokens=2)
    skipped, twin = RetryBudget(config, clock=clock), RetryBudget(config, clock=clock)
    for _ in range(3):
        clock.advance(1.0)
        skipped.deposit()  # full: nothing to do
    twin._refill()  # what a deposit under the lock would have done, at the last reading
    clock.advance(1.0)
    assert skipped.try_withdraw() and twin.try_withdraw()
    assert skipped.tokens == twin.tokens == 1.0
    skipped.deposit()  # no longer full: credited under the lock
    twin.deposit()
    assert skipped.tokens == twin.tokens == 1.5
    assert skipped.try_withdraw() and twin.try_withdraw()
    clock.advance(0.5)
    assert skipped.tokens == twin.tokens == 0.75


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
