"""The membership state machine of ``test_membership_properties.py`` on Ray: engines as Ray actors through ``RayFanOut``.

The same rules and invariants (engines added, some with the wrong weights, restarted at their URL and retired, at
random points between and inside offloads and onloads, partial progress included, with the ambiguous faults drawn on
any call): no engine dies, none is continued before it was verified, no joined engine counts before it reached the
group's state. Here ``Orchestrator`` drives ``RayFanOut``, and each engine is a socket-free fake inside a Ray engine
actor (``tests/barrier/ray_fake.py``), so every control call, ``/ready`` and ``/model_info`` read is an ObjectRef and
every fault crosses Ray as the error the actor raised. A restart kills the old engine's process in one of two ways,
drawn: the whole actor (``ray.kill``: its calls fail as Ray's ``ActorDiedError``, which ``RayFanOut`` names
``EngineDied``), or the engine behind a live actor (its calls refused inside the actor).

Phase limits are wider than the thread variant's (0.5 s, not 0.05 s): a Ray call's round trip on a loaded two-core
machine can take tens of milliseconds, and a limit it misses turns every call into a late one.

``CPR_MEMBERSHIP_EXAMPLES`` sets the number of examples here too (default 6 on Ray: about 20 s; 30 take about a minute; e.g. 100
for a longer run).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

if os.environ.get("CI", "").lower() != "true":  # CI must have Ray: fail, don't skip
    pytest.importorskip("ray", reason="Ray is not installed (pip install controlplane-resilience[ray])")

from resilience.adapters.ray import RayFanOut
from resilience.barrier import EngineGroup, Orchestrator, PhaseDeadlines
from tests.barrier.ray_fake import FakePool, RayFake
from tests.barrier.test_membership_properties import ARMED, SETTINGS, VERSION, Fault, MembershipMachine

EXAMPLES = int(os.environ.get("CPR_MEMBERSHIP_EXAMPLES", "6"))
DEADLINES = PhaseDeadlines(transition_s=10.0, pause_s=0.5, flush_s=0.5, release_s=0.5, resume_s=0.5, continue_s=0.5, in_transit_s=0.5)
"""Phase limits a Ray round trip fits in with room to spare (a late fault costs one of them)."""

POOL: FakePool | None = None


@pytest.fixture(scope="module", autouse=True)
def _pool(ray_runtime: Any) -> Iterator[FakePool]:
    """The module's pool of fake engine actors, on the session's Ray; every actor killed at the end."""
    global POOL
    POOL = FakePool()
    try:
        yield POOL
    finally:
        POOL.close()
        POOL = None


class RayMembershipMachine(MembershipMachine):
    """The same machine; ``Orchestrator`` over ``RayFanOut``, engines in Ray actors."""

    kill_actor = False

    def orchestrator(self, engines: list[Any]) -> Any:
        return Orchestrator(EngineGroup(engines), fanout=RayFanOut(), deadlines=DEADLINES)

    def fake(self, url: str, version: str = VERSION) -> Any:
        assert POOL is not None, "the module's actor pool is not started"
        return POOL.take(url, version)

    def kill_process(self, old: Any) -> None:
        assert isinstance(old, RayFake)
        event(f"restart: {'actor killed' if self.kill_actor else 'engine killed, actor alive'}")
        if self.kill_actor:
            old.kill_actor()
        else:
            old.kill_process()

    @precondition(lambda self: len(self.current) > len(self.retired))
    @rule(pick=st.integers(0, 5), armed=ARMED)
    def restart_with_its_actor(self, pick: int, armed: list[tuple[int, str, Fault]]) -> None:
        """A restart whose old engine's actor dies with it (``ray.kill``)."""
        self.kill_actor = True
        try:
            self.restart(pick, armed)
        finally:
            self.kill_actor = False

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            assert POOL is not None
            for fake in self.every:
                POOL.give_back(fake)


RayMembershipMachine.TestCase.settings = settings(**{**SETTINGS, "max_examples": EXAMPLES})  # type: ignore[arg-type]


@pytest.mark.usefixtures("ray_runtime")
class TestMembershipOnRay(RayMembershipMachine.TestCase):  # type: ignore[misc,name-defined]
    """The membership machine on Ray (``ray_runtime``: the session's one local Ray; this module is in ``RAY_MODULES``)."""
