"""The SGLang colocate loop on emulated engines, as the baseline (``"old"``) or the resilient loop (``"ours"``).

Each step: rollout (plus stragglers that arrive around the offload), offload, a training pause, onload, weight
sync. The baseline is the seeds' "before" code: bare ``requests`` with ``raise_for_status()``, flush then release
with no pause, a bare weight sync, and verl's 3 attempts on a connection error or timeout of any control call
(which kills an engine whose release or resume had been applied). Ours is ``SGLangClient`` + ``Orchestrator``: a
call that may have been applied raises ``AmbiguousOutcome``, the engine is quarantined, reconciled from the
emulator's memory probe (``SGLangLab._reconcile``) and the transition runs again.

``ColocateConfig.controller_crash_step``: the controller dies once while the engines train and a new one runs
that step again from its offload; the baseline's knows nothing and releases again (the engines die), ours starts
on the dead one's journal. ``ColocateConfig.controller_kill_every``: ours is killed every K steps inside a seeded
phase with its calls on the wire (``controller_kill``), and a new one starts on the journal as it was at the kill.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import requests

from resilience.adapters.sglang import SGLANG_POLICIES, GenerateResult, SGLangClient
from resilience.adapters.sglang.calls import generate_chunk
from resilience.barrier import EngineGroup, Orchestrator
from resilience.barrier.transitions import WEIGHT_SYNC_HOLD
from resilience.policy import PolicyTable
from resilience.testing.controller_kill import ControllerKilled, KillPoint, KillSwitchFanOut
from resilience.testing.counting_probe import CountingProbe
from resilience.testing.lab import (
    BASELINE,
    CONTROL_TIMEOUT_S,
    DEADLINES,
    LabSetup,
    RetryCounter,
    bare_session,
    lost_stragglers,
    put_in_order,
    reconcile_from_probe,
    restore_fleet,
    rollout,
    run_rounds,
)
from resilience.testing.memory_probe import EmulatorMemoryProbe
from resilience.testing.policies import fast_policies

if TYPE_CHECKING:
    from resilience.events import Observer
    from resilience.testing.faults import FaultProxy

__all__ = ["SGLangLab", "demo_policies"]

_DEADLINES: Final = replace(DEADLINES, in_transit_s=5)
"""An emulated engine applies a control call within milliseconds of its arrival: 5 s covers a loaded machine."""
_SCALED_ROUTES = ("/pause_generation", "/continue_generation", "/release_memory_occupation", "/resume_memory_occupation")
_BASELINE_ATTEMPTS = 3
"""The baseline's attempts on a connection error or a timeout: verl's ``max_attempts=3`` (statuses are not retried)."""


def demo_policies() -> PolicyTable:
    """SGLANG_POLICIES' decisions with backoffs scaled down 10x and control attempts capped at ``CONTROL_TIMEOUT_S``."""
    table = fast_policies(SGLANG_POLICIES, base_s=0.05, cap_s=0.4)
    scaled = {
        key: replace(policy, attempt_timeout_s=CONTROL_TIMEOUT_S)
        for key, policy in table.entries.items()
        if any(key.endswith(" " + route) for route in _SCALED_ROUTES)
    }
    assert len(scaled) == len(_SCALED_ROUTES), f"SGLANG_POLICIES routes changed: {sorted(scaled)}"
    return table.with_entries(scaled)


def _json_post(session: requests.Session, url: str, body: dict[str, Any], timeout: float = 30.0) -> requests.Response:
    r = session.post(url, json=body, timeout=timeout)
    r.raise_for_status()
    return r


class _BaselineResends:
    """What the baseline re-sent (it has no retry events to count them by); thread-safe."""

    def __init__(self) -> None:
        self.after_error = 0
        """Control calls re-sent after a connection error or timeout."""
        self.after_502 = 0
        """``update_weights_from_tensor`` calls re-sent after a 502."""
        self.absorbed_502 = 0
        """502s followed by a good answer to the same call."""
        self._lock = threading.Lock()

    def add(self, *, after_error: int = 0, after_502: int = 0, absorbed_502: int = 0) -> None:
        with self._lock:
            self.after_error += after_error
            self.after_502 += after_502
            self.absorbed_502 += absorbed_502


def _baseline_control(session: requests.Session, url: str, body: dict[str, Any], resends: _BaselineResends) -> requests.Response:
    """The baseline's control call: raise_for_status, and like verl 3 attempts on connection errors and timeouts."""
    for attempt in range(_BASELINE_ATTEMPTS):
        try:
            return _json_post(session, url, body, timeout=CONTROL_TIMEOUT_S)
        except (requests.ConnectionError, requests.Timeout):
            if attempt == _BASELINE_ATTEMPTS - 1:
                raise
            resends.add(after_error=1)
            time.sleep(0.05)
    raise AssertionError("unreachable")


class SGLangLab:
    """The SGLang loop of one run (the baseline or ours) on the direct route: a :class:`~resilience.testing.lab.Lab`."""

    def __init__(self, setup: LabSetup) -> None:
        fleet, config, kind, budget = setup.fleet, setup.config, setup.way, setup.budget
        self.fleet, self.config, self.kind, self.clock = fleet, config, kind, setup.clock
        self.urls, self.counted = setup.direct_urls()
        self.rng = random.Random(f"{config.seed}:{kind}")
        self.budget = budget
        self.counter = RetryCounter()
        self.resends = _BaselineResends()
        self._count_lock = threading.Lock()
        self.report = setup.new_report()
        self.pool = ThreadPoolExecutor(
            max(4, len(fleet.engines) * (config.stragglers + config.rollout_requests)), thread_name_prefix=f"colocate-{kind}"
        )
        self.bare = bare_session()
        policies = setup.policies if setup.policies is not None else demo_policies()
        self._policies, self._client_observers = policies, (*setup.observers, self.counter)
        self.proxy_of: dict[str, FaultProxy] = {}
        aliases = {u: h.direct_url for u, h in zip(self.urls, fleet.engines, strict=True)}
        truth = EmulatorMemoryProbe(fleet.memory_state_dir, aliases=aliases)
        self.probe = CountingProbe(truth)
        """The orchestrator's and ``_reconcile``'s memory probe."""
        self.client_probe = CountingProbe(truth)
        """The clients' (release and resume, after a gateway status or a reset)."""
        self.clients = self._new_clients()
        self.proxy_of.update({c.engine: p for c, p in zip(self.clients, self.counted, strict=False) if p is not None})
        restarts = config.controller_crash_step is not None or config.controller_kill_every is not None
        self._journal_dir = Path(tempfile.mkdtemp(prefix="cpr-journal-")) if restarts else None
        self._journals = 0
        self._journal_path = self._new_journal_path()
        self._snapshot: Path | None = None
        self.fanout = KillSwitchFanOut(on_kill=self._snapshot_journal)
        self.kill_rng = random.Random(f"{config.seed}:kill")
        """Where each kill lands: its own stream, so kills do not move the stragglers."""
        self._old_clients: list[SGLangClient] = []
        self.restarted_controller_in: int | None = None
        self.orch = self._orchestrator(setup.observers)

    def _new_journal_path(self) -> Path | None:
        """A fresh journal file (None when the run restarts no controller: knowledge in memory)."""
        if self._journal_dir is None:
            return None
        self._journals += 1
        return self._journal_dir / f"barrier-{self._journals}.journal"

    def _orchestrator(self, observers: Sequence[Observer]) -> Orchestrator[SGLangClient]:
        return Orchestrator(
            EngineGroup(self.clients),
            observers=observers,
            deadlines=_DEADLINES,
            restart_budget=self.budget,
            fanout=self.fanout,
            memory_probe=self.probe,
            journal=self._journal_path,
        )

    def _snapshot_journal(self) -> None:
        """At the instant of a kill: copy the journal as a killed process leaves it (the next controller's)."""
        path = self._new_journal_path()
        if path is not None and self._journal_path is not None:
            shutil.copyfile(self._journal_path, path)
        self._snapshot = path

    def _new_clients(self) -> list[SGLangClient]:
        return [
            SGLangClient(
                u,
                policies=self._policies,
                observers=self._client_observers,
                flush_poll_s=0.05,
                pool_maxsize=64,
                memory_probe=self.client_probe,
                clock=self.clock,
            )
            for u in self.urls
        ]

    # -- generation ------------------------------------------------------------------

    def _generate(self, i: int, tag: str) -> GenerateResult | None:
        body = {"text": tag, "sampling_params": {"max_new_tokens": self.config.max_new_tokens}}
        if self.kind == BASELINE:
            r = self.bare.post(f"{self.urls[i]}/generate", json=body, timeout=60)
            r.raise_for_status()
            return generate_chunk(r.json())
        return self.clients[i].generate(tag, sampling_params={"max_new_tokens": self.config.max_new_tokens})

    def _straggler(self, i: int, delay: float, tag: str) -> str:
        self.clock.sleep(delay)
        for _ in range(3):  # an aborted request is re-submitted by the rollout, as RL rollouts do
            try:
                out = self._generate(i, tag)
            except requests.RequestException:
                return "lost"
            if out is None or not out.aborted:
                return "done"
            with self._count_lock:  # stragglers run on many threads
                self.report.requests_aborted_rerun += 1
        return "lost"

    # -- the two loops -----------------------------------------------------------------

    def _baseline_offload(self) -> None:
        def one(url: str) -> None:
            for _ in range(self.config.baseline_flush_polls):  # slime/Relax: poll flush until it says flushed
                r = self.bare.get(f"{url}/flush_cache", timeout=30)
                if r.status_code == 200:
                    break
                time.sleep(0.05)
            else:
                raise TimeoutError(f"{url}: timeout while flushing cache")
            _baseline_control(self.bare, f"{url}/release_memory_occupation", {"tags": None}, self.resends)

        list(self.pool.map(one, self.urls))

    def _baseline_onload(self) -> None:
        list(
            self.pool.map(lambda u: _baseline_control(self.bare, f"{u}/resume_memory_occupation", {"tags": None}, self.resends), self.urls)
        )

    def _baseline_weight_sync(self, version: str) -> None:
        def one(url: str) -> None:
            _baseline_control(self.bare, f"{url}/pause_generation", {}, self.resends)
            _json_post(self.bare, f"{url}/begin_weight_update", {"selector": "all"})
            got_502 = 0
            for attempt in range(3):  # the seed's _make_request(max_attempts=3) on this one call
                r = self.bare.post(f"{url}/update_weights_from_tensor", json={"serialized_named_tensors": ["w"], "weight_version": version})
                if r.status_code not in (502, 503, 504) or attempt == 2:
                    r.raise_for_status()
                    self.resends.add(absorbed_502=got_502)
                    break
                if r.status_code == 502:
                    got_502 += 1
                    self.resends.add(after_502=1)
                time.sleep(0.05)
            _json_post(self.bare, f"{url}/end_weight_update", {})
            _baseline_control(self.bare, f"{url}/continue_generation", {}, self.resends)

        list(self.pool.map(one, self.urls))

    def _resilient_weight_sync(self, version: str) -> None:
        with self.orch.weight_sync(mode="retract") as engines:

            def one(client: SGLangClient) -> None:
                client.begin_weight_update()
                client.update_weights_from_tensor(["w"], weight_version=version)
                client.end_weight_update()

            list(self.pool.map(one, engines))

    def _resilient(self, transition: Callable[[], object]) -> None:
        """Run a transition in rounds; killed inside it, a new controller runs it again."""
        try:
            self._rounds(transition)
        except ControllerKilled:
            self._controller_killed()
            self._rounds(transition)

    def _rounds(self, transition: Callable[[], object]) -> None:
        run_rounds(transition, lambda: self.orch.quarantined(), self._reconcile, self.report)

    def _reconcile(self, names: Sequence[str]) -> None:
        reconcile_from_probe(names, self.orch.reconcile, self.probe.released_tags, self.proxy_of, self.report)

    def step(self, n: int) -> None:
        cfg = self.config
        stragglers = rollout(self.pool, n, cfg, self.rng, self._generate, self._straggler, len(self.urls))
        kill, interrupted = cfg.kills_at(n), False
        if kill and self.kind != BASELINE:  # any of the step's phases (offload 3, onload 2, weight sync 2), 0-50 ms in
            self.fanout.arm(KillPoint(phase=self.kill_rng.randrange(7), after_s=round(self.kill_rng.uniform(0.0, 0.05), 4)))
        try:
            if self.kind == BASELINE:
                offload: Callable[[], None] = self._baseline_offload
                onload: Callable[[], None] = self._baseline_onload
                sync: Callable[[], None] = lambda: self._baseline_weight_sync(f"v{n}")  # noqa: E731
            else:  # self.orch is read when each runs: a controller restart replaces it
                offload = lambda: self._resilient(lambda: self.orch.offload(mode="abort"))  # noqa: E731
                onload = lambda: self._resilient(lambda: self.orch.onload())  # noqa: E731
                sync = lambda: self._resilient(lambda: self._resilient_weight_sync(f"v{n}"))  # noqa: E731
            self.report.timed("offload", offload)
            if n == cfg.controller_crash_step or (kill and self.kind == BASELINE):
                time.sleep(cfg.train_s)  # the controller dies while the engines train
                self._controller_restart(n)
                self.report.timed("offload", offload)  # the new controller runs the step again from its offload
            time.sleep(cfg.train_s)
            self.report.timed("onload", onload)
            self.report.timed("weight_sync", sync)
        except BaseException as exc:
            interrupted = not isinstance(exc, Exception)
            raise
        finally:
            self.fanout.disarm()  # a kill point the step did not reach (a step with fewer phases) is not carried over
            self.report.requests_lost += lost_stragglers(stragglers, interrupted)
            for client in self._old_clients:  # a dead controller's clients: closed once its stragglers are in
                client.close()
            self._old_clients.clear()

    # -- recovery: what a global restart does here ------------------------------------------

    def recover(self, failed: bool) -> int:
        """After every step, ``failed`` or not: a global restart (``restore_fleet``), the controller started afresh."""
        deaths = restore_fleet(self.fleet.engines, lambda engine: put_in_order(self.bare, engine))
        self._new_controller(self._new_journal_path())  # every engine in order: nothing to resume
        return deaths

    def _new_controller(self, journal: Path | None, *, keep_clients: bool = False) -> None:
        """New clients (the old ones closed, or kept for the stragglers still using them) and a new orchestrator on
        ``journal`` (the old one closed, its journal deleted)."""
        if keep_clients:
            self._old_clients.extend(self.clients)
        else:
            for client in self.clients:
                client.close()
        self.clients = self._new_clients()
        old, observers = self.orch, self.orch.observers
        old.close()
        if old.journal is not None and self._journal_path is not None and self._journal_path != journal:
            self._journal_path.unlink(missing_ok=True)  # one journal file at a time on disk
        self._journal_path = journal
        self.orch = self._orchestrator(observers)

    def _controller_killed(self) -> None:
        """The controller died inside a phase; a new one takes over on the journal's copy from that instant.

        It starts once the dead one's calls on the wire ended, with new clients, knowing only what the copy says
        (a call in flight at the kill is ambiguous; unknown tags are reconciled from the memory probe). It releases
        a weight-sync hold the dead one took (the owner's PID is this process's, so the journal cannot tell).
        """
        self.report.controller_restarts += 1
        self.report.controller_kills += 1
        self.fanout.drain(30.0)
        self._new_controller(self._snapshot, keep_clients=True)
        self._snapshot = None
        for _ in range(8):  # bounded: one unpause per hold the dead controller left
            if not any(WEIGHT_SYNC_HOLD in reasons for reasons in self.orch.held().values()):
                break
            self._rounds(lambda: self.orch.unpause(WEIGHT_SYNC_HOLD))
        if not self.orch.quarantined():
            self.report.restarts_clean += 1

    def _controller_restart(self, n: int) -> None:
        """The controller dies while the engines train; the baseline's new one knows nothing, ours starts on the journal."""
        self.report.controller_restarts += 1
        self.restarted_controller_in = n
        if self.kind == BASELINE:
            self.bare.close()
            self.bare = bare_session()
            return
        self._new_controller(self._journal_path)

    def tally(self) -> None:
        report = self.report
        report.http_502_absorbed += self.resends.absorbed_502
        report.retried_502 += self.resends.after_502
        report.resent_after_error += self.resends.after_error
        report.reconciles_probe = self.probe.proved
        report.probe_verdicts = self.client_probe.proved

    def close(self, *, interrupted: bool = False) -> None:
        self.pool.shutdown(wait=not interrupted, cancel_futures=True)
        self.bare.close()
        for client in [*self.clients, *self._old_clients]:
            client.close()
        self.orch.close()
        self.fanout.close()
        if self._journal_dir is not None:
            shutil.rmtree(self._journal_dir, ignore_errors=True)
