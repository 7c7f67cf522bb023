"""``SmgEngine``: each call is a one-engine fan-out, under the deadline the call names or the one in force."""

from __future__ import annotations

from typing import Any

import pytest

from resilience.adapters.smg_fanout import SmgEngine, SmgFanOut
from resilience.barrier.fanout import Calls, EngineResult
from resilience.deadline import Deadline
from resilience.errors import ConfigError


class Noting(SmgFanOut):
    """An ``SmgFanOut`` that notes each call's method and deadline and answers it without a gateway."""

    def __init__(self) -> None:
        super().__init__("http://127.0.0.1:9")  # never dialled: ``call`` is replaced
        self.seen: list[tuple[str, float]] = []

    def call(self, calls: Calls, method: str, deadline: Deadline) -> list[EngineResult]:
        self.seen.append((method, deadline.remaining()))
        return [EngineResult(engine=engine.engine, value="ok") for engine, _ in calls]  # type: ignore[attr-defined]


def test_flush_cache_runs_under_its_own_deadline_capped_by_the_one_in_force() -> None:
    fanout = Noting()
    engine = SmgEngine("http://127.0.0.1:30000", fanout)
    try:
        assert engine.flush_cache(deadline_s=2.0) == "ok"
        with Deadline(5.0):
            engine.flush_cache(deadline_s=30.0)
            engine.flush_cache()
        engine.pause_generation()
    finally:
        fanout.close()
    methods = [m for m, _ in fanout.seen]
    left: list[Any] = [s for _, s in fanout.seen]
    assert methods == ["flush_cache", "flush_cache", "flush_cache", "pause_generation"]
    assert 0 < left[0] <= 2.0  # its own 2 s (it was ignored before: no deadline at all)
    assert 0 < left[1] <= 5.0 and 0 < left[2] <= 5.0  # the outer 5 s caps a longer one, and serves when none is named
    assert left[3] == float("inf")


def test_a_pause_mode_sglang_does_not_know_is_refused_before_anything_is_sent() -> None:
    """The fan-out builds its calls with ``SGLangClient``'s own builders, so their checks hold through the gateway too."""
    fanout = SmgFanOut("http://127.0.0.1:9")  # never dialled: the mode is refused first
    engine = SmgEngine("http://127.0.0.1:30000", fanout)
    try:
        with pytest.raises(ValueError, match="pause mode must be 'abort', 'retract' or 'in_place', but was 'bogus'"):
            engine.pause_generation(mode="bogus")  # type: ignore[arg-type]
    finally:
        fanout.close()
    assert fanout.gateway_calls == 0


def test_a_negative_flush_deadline_is_refused_as_by_sglang_client() -> None:
    """``deadline_s`` is checked as ``SGLangClient.flush_cache`` checks it: a ``ConfigError`` naming the seconds, nothing sent."""
    fanout = Noting()
    engine = SmgEngine("http://127.0.0.1:30000", fanout)
    try:
        with pytest.raises(ConfigError, match="Deadline seconds must be >= 0 or None, but was -1"):
            engine.flush_cache(deadline_s=-1)
    finally:
        fanout.close()
    assert fanout.seen == []
