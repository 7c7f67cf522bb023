"""The colocate sequence behind a real smg gateway, three ways side by side: smg's own client, ours direct, ours through smg.

Each run starts fresh fault proxies (one per engine, all playing the same plan) and a fresh gateway
(:class:`SmgGateway`) whose workers are those proxies. Each step: rollout through the gateway, offload, a training
pause, onload, weight sync (``update_weights_from_disk``). The ways differ only in their control plane:

- ``"smg"`` (the peer): smg's own client, ``smg.rl.RL.fanout`` per phase and ``smg.rl.paused`` around the weight
  update, with no retries. ``paused()`` sends ``continue_generation`` on the way out whatever the body did: after
  a body that released memory, that continue crashes SGLang at its next prefill.
- ``"ours"``: ``SGLangClient`` + ``Orchestrator`` straight to the engines (through the same proxies).
- ``"ours-smg"``: the ``Orchestrator`` with :class:`~resilience.adapters.smg_fanout.SmgFanOut`, each phase one
  ``/v1/rl`` fan-out through the gateway.

Both of ours reconcile quarantined engines from the emulator's memory probe and run a transition again, at most 3
times. A failed step is a global restart, and the run goes on until the restart budget is spent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Final, Literal

from resilience.adapters.sglang import SGLangClient
from resilience.adapters.smg_fanout import SmgEngine, SmgFanOut
from resilience.barrier import EngineGroup, Orchestrator
from resilience.testing.faultplan import CONTROL_PATHS
from resilience.testing.faultproxy import FaultProxy
from resilience.testing.lab import (
    CONTROL_TIMEOUT_S,
    DEADLINES,
    ColocateReport,
    LabSetup,
    RetryCounter,
    bare_session,
    put_in_order,
    reconcile_from_probe,
    restore_fleet,
    run_rounds,
)
from resilience.testing.lab_sglang import demo_policies
from resilience.testing.memory_probe import EmulatorMemoryProbe
from resilience.testing.smg import GatewayHealth, SmgGateway

__all__ = ["PEER_WAYS", "PeerWay", "SmgLab", "peer_rows", "ways"]

PeerWay = Literal["smg", "ours", "ours-smg"]
PEER_WAYS: Final[tuple[tuple[PeerWay, str], ...]] = (("smg", "smg's client"), ("ours", "ours direct"), ("ours-smg", "ours via SmgFanOut"))
"""The three ways in table order, with their column titles."""
GATEWAY_HEALTH: Final = GatewayHealth(interval_s=1, timeout_s=1, failure_threshold=3, success_threshold=1)
"""The gateway's health settings in these runs (short, so a restarted engine is ready again within seconds)."""
RL_TIMEOUT_S: Final = int(CONTROL_TIMEOUT_S)
"""``--rl-control-timeout-secs``: as ``lab.CONTROL_TIMEOUT_S``, every control attempt's bound."""
_SELECTOR = "engine=sglang"


class SmgLab:
    """The loop of one way behind an smg gateway: a :class:`~resilience.testing.lab.Lab` with its own proxies and gateway."""

    def __init__(self, setup: LabSetup) -> None:
        fleet, config, way = setup.fleet, setup.config, setup.way
        assert setup.plan is not None, "run_colocate checks that route 'smg' has a plan"
        plan = setup.plan
        self.fleet, self.config, self.way, self.clock = fleet, config, way, setup.clock
        self.policies = setup.policies if setup.policies is not None else demo_policies()
        self.restarted_controller_in: int | None = None  # a new controller starts only in a recovery
        self.report = setup.new_report()
        self.proxies = [FaultProxy(e.direct_url, plan, e.index) for e in fleet.engines]
        self.counted: Sequence[FaultProxy | None] = self.proxies
        for proxy in self.proxies:
            proxy.start()
        self.urls = [p.url for p in self.proxies]
        self.gateway = SmgGateway(self.urls, health=GATEWAY_HEALTH, rl_control_timeout_s=RL_TIMEOUT_S)
        try:
            self.gateway.start()
        except BaseException:
            for proxy in self.proxies:
                proxy.stop()
            raise
        aliases = {p.url: e.direct_url for p, e in zip(self.proxies, fleet.engines, strict=True)}
        self.probe = EmulatorMemoryProbe(fleet.memory_state_dir, aliases=aliases)
        self.counter = RetryCounter()
        self.session = bare_session()
        self.clients: list[SGLangClient] = []
        self.fanout: SmgFanOut | None = None
        self.orch: Orchestrator[SGLangClient] | Orchestrator[SmgEngine] | None = None
        self._new_controller()

    # -- controllers ---------------------------------------------------------------------

    def _new_controller(self) -> None:
        """A fresh controller (after a restart too): new clients or fan-out, a new orchestrator; the peer has neither."""
        self._close_controller()
        if self.way == "ours":
            probe = self._settled_probe()
            observers = (self.counter,)
            self.clients = [
                SGLangClient(u, policies=self.policies, observers=observers, flush_poll_s=0.05, memory_probe=probe, clock=self.clock)
                for u in self.urls
            ]
            self.orch = Orchestrator(EngineGroup(self.clients), deadlines=DEADLINES, memory_probe=self._settled_probe())
        elif self.way == "ours-smg":
            self.fanout = SmgFanOut(self.gateway.url, timeout_s=RL_TIMEOUT_S + 5.0, memory_probe=self._settled_probe())
            self.orch = Orchestrator(
                EngineGroup(self.fanout.engines(self.urls)), fanout=self.fanout, deadlines=DEADLINES, memory_probe=self._settled_probe()
            )

    def _settled_probe(self) -> _SettledProbe:
        return _SettledProbe(self.probe, {p.url: p for p in self.proxies})

    def _close_controller(self) -> None:
        for client in self.clients:
            client.close()
        self.clients = []
        if self.fanout is not None:
            self.report.probe_verdicts += self.fanout.probe_verdicts
            self.counter.absorbed += self.fanout.absorbed_502
            self.fanout.close()
            self.fanout = None

    # -- one step --------------------------------------------------------------------------

    def _rollout(self, n: int) -> None:
        body = {"sampling_params": {"max_new_tokens": self.config.max_new_tokens}}
        for i in range(self.config.rollout_requests * len(self.urls)):
            for _ in range(50):  # bounded: a gateway without a ready worker (an engine restarting) answers 503
                r = self.session.post(f"{self.gateway.url}/generate", json={**body, "text": f"s{n}-r{i}"}, timeout=60)
                if r.status_code != 503:
                    break
                time.sleep(0.1)
            r.raise_for_status()

    def step(self, n: int) -> None:
        self._rollout(n)
        if self.way == "smg":
            self._peer_step(n)
            return
        assert self.orch is not None
        orch = self.orch
        self._rounds(lambda: orch.offload(mode="abort"))
        time.sleep(self.config.train_s)
        self._rounds(orch.onload)
        self._rounds(lambda: self._our_weight_sync(n))

    def _peer_step(self, n: int) -> None:
        from smg.rl import RL, paused

        rl = RL(self.gateway.url, timeout=RL_TIMEOUT_S + 5.0)
        rl.fanout("pause_generation", {"mode": "abort"}, selector=_SELECTOR)
        rl.fanout("flush_cache", {}, selector=_SELECTOR)
        rl.fanout("release_memory_occupation", {"tags": None}, selector=_SELECTOR)
        time.sleep(self.config.train_s)
        rl.fanout("resume_memory_occupation", {"tags": None}, selector=_SELECTOR)
        rl.fanout("continue_generation", {}, selector=_SELECTOR)
        with paused(rl, _SELECTOR, mode="retract"):
            rl.fanout("update_weights_from_disk", {"model_path": "emulated/sglang-model", "weight_version": f"v{n}"}, selector=_SELECTOR)

    def _our_weight_sync(self, n: int) -> None:
        assert self.orch is not None
        with self.orch.weight_sync(mode="retract") as engines:
            if self.way == "ours":
                for client in engines:
                    assert isinstance(client, SGLangClient)
                    client.update_weights_from_disk("emulated/sglang-model", weight_version=f"v{n}")
            else:
                from smg.rl import RL

                RL(self.gateway.url, timeout=RL_TIMEOUT_S + 5.0).fanout(
                    "update_weights_from_disk", {"model_path": "emulated/sglang-model", "weight_version": f"v{n}"}, selector=_SELECTOR
                )

    def _rounds(self, transition: Callable[[], object]) -> None:
        orch = self.orch
        assert orch is not None
        run_rounds(transition, orch.quarantined, self._reconcile, self.report, again_unquarantined=True)

    def _reconcile(self, names: Sequence[str]) -> None:
        assert self.orch is not None
        proxies = {p.url: p for p in self.proxies}
        reconcile_from_probe(names, self.orch.reconcile, self.probe.released_tags, proxies, self.report)

    # -- recovery --------------------------------------------------------------------------

    def recover(self, failed: bool) -> int:
        """After a ``failed`` step only: a global restart (``restore_fleet``) and a new controller; returns the deaths."""
        if not failed:
            return 0
        deaths = restore_fleet(self.fleet.engines, lambda engine: put_in_order(self.session, engine, end_weight_session=False))
        self._new_controller()
        for url in self.urls:  # a restarted engine: the gateway makes it ready again after a good probe
            self.gateway.wait_status(url, lambda s: s == "ready", 30.0)
        return deaths

    def tally(self) -> None:
        """Nothing: the fan-out's absorbed 502s and probe verdicts were added as each controller closed."""

    def close(self, *, interrupted: bool = False) -> None:
        self._close_controller()
        self.session.close()
        self.gateway.stop()
        for proxy in self.proxies:
            proxy.stop()


class _SettledProbe:
    """The emulator's memory truth, read once the engine's proxy has no control call in flight (a late effect lands first)."""

    def __init__(self, inner: EmulatorMemoryProbe, proxies: dict[str, FaultProxy]) -> None:
        self._inner, self._proxies = inner, proxies

    def released_tags(self, engine: str) -> frozenset[str] | None:
        proxy = self._proxies.get(engine)
        if proxy is not None and not proxy.settle(timeout=10.0, paths=CONTROL_PATHS):
            return None
        return self._inner.released_tags(engine)


def ways(names: Sequence[str] | None = None) -> list[PeerWay]:
    """The ways named (all of them, in table order, by default); a clear error for an unknown name."""
    known = [w for w, _ in PEER_WAYS]
    if names is None:
        return known
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"unknown way(s) {bad}: the ways are {known}")
    return [w for w in known if w in names]


_ROWS: Final[tuple[tuple[str, Callable[[ColocateReport], str]], ...]] = (
    ("steps finished", lambda r: f"{r.steps_finished}/{r.steps_planned}"),
    ("failed steps", lambda r: str(r.failed_steps)),
    ("engine deaths", lambda r: str(r.engine_deaths)),
    ("restarts", lambda r: f"{r.restarts}" + (" (budget spent)" if r.stopped_early else "")),
    ("502s injected", lambda r: str(r.http_502_seen)),
    ("502s absorbed by our retries", lambda r: str(r.http_502_absorbed)),
    ("engines quarantined, reconciled", lambda r: f"{r.engines_quarantined}, {r.engines_reconciled}"),
    ("releases/resumes settled by SmgFanOut's memory probe", lambda r: str(r.probe_verdicts)),
    ("wall s", lambda r: f"{r.wall_s:.1f}"),
)


def peer_rows(reports: Sequence[ColocateReport]) -> list[list[str]]:
    """The side-by-side table's rows, ``[label, one cell per report...]`` (``cpr demo --router smg`` and the benchmark)."""
    return [[label, *(cell(r) for r in reports)] for label, cell in _ROWS]
