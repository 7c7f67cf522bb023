"""``resilience.budget``: the retry budget (spend, floor, deposits)."""

from __future__ import annotations

from resilience import RetryBudgetConfig
from resilience.budget import RetryBudget
from resilience.testing.clock import FakeClock


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


def test_full_says_whether_a_deposit_changes_anything() -> None:
    """``full`` holds from the start until a withdrawal, and again once deposits bring the balance back to ``max_tokens``."""
    budget = RetryBudget(RetryBudgetConfig(ratio=0.5, min_retries_per_second=0, max_tokens=2), clock=FakeClock())
    assert budget.full
    assert budget.try_withdraw() and not budget.full
    budget.deposit()
    assert not budget.full and budget.tokens == 1.5
    budget.deposit()
    assert budget.full and budget.tokens == 2.0
