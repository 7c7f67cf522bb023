"""Socket-free fake engines inside Ray engine actors, driven through ``RayFanOut`` (the membership property test's Ray
backend).

Each engine is a ``JoinFake`` (``test_membership_properties.py``: SGLang 0.5.23's crash rules, ``/ready``,
``/model_info``) built inside a Ray actor whose body is the package's own engine-actor body (``adapters/ray.py``'s
``_EngineActor``: every call runs under the phase deadline it is sent with, and an error raised inside is made to
survive pickling); the driver holds a ``RayFake``, a ``RayEngine`` handle whose client class is the fake. So every
control call and every read the barrier makes crosses Ray as ObjectRefs, through ``RayFanOut`` and its error mapping
(a dead actor is ``EngineDied``, an error inside is the original error, a call past the deadline is ``PhaseTimeout``
with a ``LateRef``).

Actors are pooled (``FakePool``): starting a Ray worker process costs a second or more on a small machine, so an
example borrows live actors, rebuilds the fake inside (``reset``) and gives them back; an actor killed by the test
(``ray.kill``: a restarted engine's old process) is replaced by a new one when the pool runs short.
"""

from __future__ import annotations

from typing import Any

import ray

from resilience.adapters.ray import RayEngine, _EngineActor
from tests.barrier.fake_engine import Fault
from tests.barrier.test_membership_properties import VERSION, JoinFake

ACTOR_OPTIONS: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 16, "max_restarts": 0}
"""``max_concurrency=16``: a late call blocks its actor thread until the test lands it (``land``), which is a call of its
own on the same actor."""
READY_S = 120.0
"""How long a new actor may take to start (a Ray worker process on a loaded machine)."""


class _FakeBody(_EngineActor):
    """The engine actor's body with a ``JoinFake`` as its client, plus what the test asks of the fake."""

    target = JoinFake

    def reset(self, name: str, version: str) -> None:
        """A fresh engine process at ``name`` (serving, all memory) with weights ``version``."""
        self._client = JoinFake(name, version)

    def facts(self) -> dict[str, Any]:
        """What the invariants read: why it would have died (None: alive), killed, its weights, unverified continues."""
        fake = self._client
        return {"crash": fake.crash, "killed": fake.killed, "version": fake.version, "continued_unverified": fake.continued_unverified}

    def kill_process(self) -> None:
        """The engine's process is killed (the actor lives on): every call refused from now on (``EngineDied``)."""
        self._client.killed = True


FakeActor: Any = ray.remote(**ACTOR_OPTIONS)(_FakeBody)


class RayFake(RayEngine):
    """The driver's handle of one fake engine actor: what the barrier sees (``RayEngine``'s calls, ``ready`` and
    ``model_info`` forwarded to the fake) and what the property test reads and arms, each one remote call."""

    target = JoinFake

    def __init__(self, actor: Any, engine: str) -> None:
        super().__init__(actor, engine)
        self.gone: dict[str, Any] | None = None
        """The facts read just before its actor was killed (None while it lives)."""

    def _test(self, method: str, *args: Any) -> Any:
        return ray.get(getattr(self.actor, method).remote(*args), timeout=READY_S)

    def _client_call(self, name: str, /, **kwargs: Any) -> Any:
        return ray.get(self.actor.call.remote(name, kwargs, None), timeout=READY_S)

    def facts(self) -> dict[str, Any]:
        return self.gone if self.gone is not None else dict(self._test("facts"))

    @property
    def crash(self) -> str | None:
        value: str | None = self.facts()["crash"]
        return value

    @property
    def killed(self) -> bool:
        return bool(self.facts()["killed"])

    @property
    def version(self) -> str:
        return str(self.facts()["version"])

    @property
    def continued_unverified(self) -> int:
        return int(self.facts()["continued_unverified"])

    def arm(self, method: str, fault: Fault) -> None:
        self._client_call("arm", method=method, fault=fault)

    def disarm(self) -> None:
        if self.gone is None:
            self._client_call("disarm")

    def land(self) -> None:
        if self.gone is None:
            self._client_call("land")

    def snapshot(self) -> tuple[bool, bool, frozenset[str]]:
        paused, flushed, released = self._client_call("snapshot")
        return bool(paused), bool(flushed), frozenset(released)

    def kill_process(self) -> None:
        """The engine's process is killed; its actor lives on (calls raise ``EngineDied`` inside the actor)."""
        self._test("kill_process")

    def kill_actor(self) -> None:
        """The engine's process and its actor are killed together (``ray.kill``): calls fail as Ray's ``ActorDiedError``."""
        self.land()
        self.gone = {**self.facts(), "killed": True}
        self.kill()


class FakePool:
    """Live fake engine actors, reused across examples (``take`` rebuilds the fake inside, ``give_back`` returns it)."""

    def __init__(self) -> None:
        self.idle: list[Any] = []
        self.every: list[Any] = []

    def take(self, name: str, version: str = VERSION) -> RayFake:
        if self.idle:
            actor = self.idle.pop()
        else:
            actor = FakeActor.remote(name, {"version": version})
            self.every.append(actor)
        ray.get(actor.reset.remote(name, version), timeout=READY_S)
        return RayFake(actor, name)

    def give_back(self, fake: RayFake) -> None:
        if fake.gone is None:
            self.idle.append(fake.actor)

    def close(self) -> None:
        for actor in self.every:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        self.idle.clear()
        self.every.clear()
