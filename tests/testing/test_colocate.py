"""The colocate comparison's entry point and the lab's stop clock: bad input named before anything starts; a stopped
clock ends every sleep at once, so an interrupted run's threads stop retrying."""

from __future__ import annotations

import threading
from typing import Any, cast

import pytest

from resilience.testing.colocate import ColocateConfig, run_colocate
from resilience.testing.emulator import EmulatedFleet
from resilience.testing.faults import FaultPlan
from resilience.testing.lab import LabStopped, StopClock

_NO_FLEET = cast(EmulatedFleet, object())
"""Never reached: every check below fails before the fleet is used."""


@pytest.mark.parametrize(
    ("way", "kwargs", "needle"),
    [
        ("ours", {"engine": "vllm", "route": "smg"}, "no colocate lab for engine 'vllm' on route 'smg'"),
        ("ours", {"engine": "tgi"}, "no colocate lab for engine 'tgi' on route 'direct'"),
        ("smg", {}, "`way` must be one of ['old', 'ours'] on route 'direct', but was 'smg'"),
        ("old", {"route": "smg", "plan": FaultPlan(seed=1)}, "`way` must be one of ['smg', 'ours', 'ours-smg'] on route 'smg'"),
        ("ours", {"route": "smg"}, "route 'smg' takes a `plan`"),
    ],
)
def test_bad_engine_route_or_way_is_named(way: str, kwargs: dict[str, Any], needle: str) -> None:
    """An engine kind, route or way with no lab is a ValueError naming it, raised before any engine is touched."""
    with pytest.raises(ValueError) as info:
        run_colocate(_NO_FLEET, ColocateConfig(steps=1), way, **kwargs)
    assert needle in str(info.value)


def test_a_stopped_clock_ends_a_sleep_in_progress_and_every_later_one() -> None:
    """stop() from another thread wakes a long sleep with LabStopped; later sleeps raise at once, even of 0 s."""
    clock = StopClock()
    clock.sleep(0.0)  # running: a sleep returns
    raised: list[BaseException] = []

    def backoff() -> None:
        try:
            clock.sleep(3600.0)
        except LabStopped as exc:
            raised.append(exc)

    sleeper = threading.Thread(target=backoff, daemon=True)
    sleeper.start()
    clock.stop()
    sleeper.join(timeout=30)
    assert not sleeper.is_alive() and len(raised) == 1
    assert clock.stopped
    with pytest.raises(LabStopped):
        clock.sleep(0.0)


def test_the_smg_route_offers_the_peer_table_ways_in_order() -> None:
    """run_colocate's ways behind smg are lab_smg's PEER_WAYS (the table's columns), in the same order."""
    from resilience.testing import colocate
    from resilience.testing.lab_smg import PEER_WAYS

    assert colocate._WAYS["smg"] == tuple(way for way, _ in PEER_WAYS)
