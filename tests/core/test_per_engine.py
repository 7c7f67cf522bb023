"""``PerEngine``: one value per engine, made on first lookup, once even when threads miss at the same time."""

from __future__ import annotations

import threading

from resilience.breaker import BreakerRegistry
from resilience.budget import RetryBudgets
from resilience.per_engine import PerEngine


def test_a_value_is_made_on_first_lookup_and_kept() -> None:
    made: list[str] = []

    def make(engine: str) -> list[str]:
        made.append(engine)
        return [engine]

    per = PerEngine(make)
    first = per["http://a:1"]
    assert per["http://a:1"] is first and per.get("http://b:2") is None  # get() does not make
    assert made == ["http://a:1"] and dict(per) == {"http://a:1": ["http://a:1"]}


def test_threads_that_miss_at_once_get_the_one_value() -> None:
    """Every thread waits at a barrier, then looks the same new engine up: one value is made, and all get it."""
    made: list[object] = []
    per: PerEngine[object] = PerEngine(lambda _engine: made.append(object()) or made[-1])
    start = threading.Barrier(8)
    got: list[object] = []

    def look() -> None:
        start.wait()
        got.append(per["http://a:1"])

    threads = [threading.Thread(target=look) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and got == made * 8


def test_the_registries_hand_out_their_per_engine_values() -> None:
    """``by_engine[engine]`` makes the engine's breaker (named for it, of the registry's config) or budget once, then keeps it."""
    breakers, budgets = BreakerRegistry(), RetryBudgets()
    a = breakers.by_engine["http://a:1"]
    assert a.name == "http://a:1" and a.config is breakers.config and breakers.by_engine["http://a:1"] is a
    assert breakers.by_engine["http://b:1"] is not a and budgets.by_engine["http://a:1"] is budgets.by_engine["http://a:1"]
    assert budgets.by_engine["http://a:1"].config is budgets.config
    assert set(breakers.states()) == {"http://a:1", "http://b:1"}
