"""The vLLM colocate loop on emulated engines: SkyRL's sequence (``"old"``) against the barrier (``"ours"``).

Each step: rollout (plus stragglers around the offload), offload, a training pause, onload and weight sync, and a
check of every completion against the text intact weights give: "a 200 that isn't healthy" is counted.

The old way is SkyRL's colocated sequence (``field-2026.md``; SkyRL ``workers/worker_dispatch.py`` ~l.645-710,
``trainer.py`` l.381, ``inference_servers/remote_inference_client.py``): ``/sleep?level=2`` on every server,
``/wake_up?tags=weights``, the weight broadcast (start, update, finish), ``/wake_up?tags=kv_cache``; each phase a bare
``asyncio.gather`` of one aiohttp POST per server (``_call_all_servers``), no retry, no timeout (SkyRL's
``ClientTimeout(total=None)``; capped here at ``OLD_WAY_CAP_S``), the first error propagating without saying which
server failed.

Ours is ``Orchestrator(EngineGroup([VLLMEngine(u), ...]))``: ``offload()``, ``onload(tags=["weights"])``, a
``weight_sync()`` pushing weights per engine, ``onload()``; a failed transition runs again, at most three times
(sleep and wake are idempotent: nothing is quarantined). A failed step is a global restart, as in ``lab_sglang``;
an engine slept at level 2 and woken by it holds garbage weights and answers 200 (verl #7904): ``garbage_completions``.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Final

import aiohttp
import requests

from resilience.adapters.vllm import VLLM_POLICIES, VLLMClient, VLLMEngine, VLLMError
from resilience.barrier import EngineGroup, Orchestrator
from resilience.policy import PolicyTable
from resilience.testing.emulator import EngineHandle
from resilience.testing.emulator.vllm import expected_checksums
from resilience.testing.emulator.vllm.text import token, weights_content
from resilience.testing.faultplan import VLLM_CONTROL_PATHS
from resilience.testing.lab import (
    BASELINE,
    CONTROL_TIMEOUT_S,
    DEADLINES,
    LabSetup,
    RetryCounter,
    bare_session,
    lost_stragglers,
    restore_fleet,
    rollout,
    run_rounds,
)
from resilience.testing.policies import fast_policies

__all__ = ["OLD_WAY_CAP_S", "SKYRL_SLEEP_LEVEL", "VLLMLab", "vllm_demo_policies"]

SKYRL_SLEEP_LEVEL: Final = 2
"""SkyRL's default sleep level (forced to 1 only with LoRA-only syncs)."""
OLD_WAY_CAP_S: Final = 10.0
"""SkyRL's control calls have no timeout; the demo cuts one after this many seconds (counted as a failed step)."""
_SCALED = (*VLLM_CONTROL_PATHS, "/weight_checker", "/update_weight_version")
_PAUSED_RETRY_S = 30.0
"""How long a straggler keeps re-submitting while the engine answers 503 (an abort pause's back-pressure)."""
_BASE_VERSION = "default"
COMPLETION_TIMEOUT_S: Final = 10.0
"""Seconds a completion may take in both ways (an emulated one takes milliseconds; one queued at a sleeping engine hangs)."""


def vllm_demo_policies() -> PolicyTable:
    """VLLM_POLICIES' decisions with backoffs scaled down 10x and the RL transaction's control routes capped at
    ``CONTROL_TIMEOUT_S`` a try."""
    table = fast_policies(VLLM_POLICIES, base_s=0.05, cap_s=0.4)
    scaled = {k: replace(p, attempt_timeout_s=CONTROL_TIMEOUT_S) for k, p in table.entries.items() if k.split(" ", 1)[1] in _SCALED}
    assert len(scaled) == len(_SCALED), f"VLLM_POLICIES routes changed: {sorted(scaled)}"
    return table.with_entries(scaled)


def _intact(text: str, prompt: str, versions: Sequence[str]) -> bool:
    """``text`` is what intact weights give: one version's tokens, or (a request kept across a weight update) the first
    tokens from one version and the rest from another."""
    words = [" " + w for w in text.split(" ")[1:]]
    wanted = {v: [token(weights_content(v), prompt, i) for i in range(len(words))] for v in versions}
    for k in range(len(words) + 1):
        if any(t[:k] == words[:k] for t in wanted.values()) and any(t[k:] == words[k:] for t in wanted.values()):
            return True
    return False


class _SkyRL:
    """SkyRL's control fan-out: one aiohttp session, no timeout (capped), no retry, a bare ``asyncio.gather``."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = list(urls)

    async def _call_server(self, session: aiohttp.ClientSession, url: str, path: str, json: Any = None) -> None:
        async with session.post(f"{url}{path}", json=json) as r:
            r.raise_for_status()

    async def _call_all(self, path: str, json: Any = None) -> None:
        timeout = aiohttp.ClientTimeout(total=OLD_WAY_CAP_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.gather(*(self._call_server(session, u, path, json) for u in self.urls))

    def call_all(self, path: str, json: Any = None) -> None:
        """POST ``path`` to every server at once; the first error propagates (which server: lost)."""
        asyncio.run(self._call_all(path, json))

    def weight_sync(self, version: str) -> None:
        """The broadcast of one version: start, one update, finish (each a bare gather)."""
        self.call_all("/start_weight_update")
        self.call_all("/update_weights", {"update_info": {"names": ["w"], "version": version}})
        self.call_all("/finish_weight_update", {"weight_version": version})


class VLLMLab:
    """The vLLM loop of one run (SkyRL's sequence or ours) on the direct route: a :class:`~resilience.testing.lab.Lab`."""

    def __init__(self, setup: LabSetup) -> None:
        fleet, config, kind = setup.fleet, setup.config, setup.way
        self.fleet, self.config, self.kind, self.clock = fleet, config, kind, setup.clock
        self.urls, self.counted = setup.direct_urls()
        self.restarted_controller_in: int | None = None  # this loop restarts no controller mid-step
        self.proxies = {i: p for i, p in enumerate(self.counted) if p is not None}
        self.rng = random.Random(f"{config.seed}:{kind}:vllm")
        self.budget = setup.budget
        self.counter = RetryCounter()
        self.report = setup.new_report()
        self.pool = ThreadPoolExecutor(max(4, len(self.urls) * (config.stragglers + config.rollout_requests + 1)))
        self.bare = bare_session()
        self.skyrl = _SkyRL(self.urls)
        self._policies = setup.policies if setup.policies is not None else vllm_demo_policies()
        self._observers, self._orch_observers = (*setup.observers, self.counter), setup.observers
        self.versions = {_BASE_VERSION}
        self._lock = threading.Lock()
        self.stragglers: list[Future[str]] = []
        self.engines = self._new_engines()
        self.orch = self._orchestrator()
        self._init_transfer()

    def _new_engines(self) -> list[VLLMEngine]:
        return [
            VLLMEngine(VLLMClient(u, policies=self._policies, observers=self._observers, api_version="0.33.0", clock=self.clock))
            for u in self.urls
        ]

    def _orchestrator(self) -> Orchestrator[VLLMEngine]:
        return Orchestrator(EngineGroup(self.engines), observers=self._orch_observers, deadlines=DEADLINES, restart_budget=self.budget)

    def _init_transfer(self) -> None:
        """Each server's weight-transfer group, once (SkyRL: ``/init_weight_transfer_engine`` per server at start)."""
        for handle in self.fleet.engines:
            self.bare.post(f"{handle.direct_url}/init_weight_transfer_engine", json={"init_info": {"rank_offset": 0}}, timeout=30)

    # -- generation ------------------------------------------------------------------------

    def _complete(self, i: int, prompt: str) -> tuple[str, str | None]:
        """One completion on engine ``i``: (text, finish reason); 503 answers (a pause's back-pressure) are re-submitted."""
        give_up = time.monotonic() + _PAUSED_RETRY_S
        while True:
            try:
                if self.kind == BASELINE:
                    body = {"prompt": prompt, "max_tokens": self.config.max_new_tokens}
                    r = self.bare.post(f"{self.urls[i]}/v1/completions", json=body, timeout=COMPLETION_TIMEOUT_S)
                    r.raise_for_status()
                    choice = r.json()["choices"][0]
                    return choice["text"], choice.get("finish_reason")
                out = self.engines[i].client.complete(prompt, max_tokens=self.config.max_new_tokens)
                return out.text, out.finish_reason
            except (requests.HTTPError, VLLMError) as exc:
                status = getattr(getattr(exc, "response", None), "status_code", None) or getattr(exc, "status", None)
                if status != 503 or time.monotonic() > give_up:
                    raise
                time.sleep(0.05)

    def _checked(self, i: int, prompt: str) -> str:
        """A completion, re-submitted when aborted (as rollouts do); counts garbage (a 200 no intact weights give)."""
        for _ in range(3):
            try:
                text, finish = self._complete(i, prompt)
            except requests.RequestException:
                return "lost"
            if finish == "abort":
                with self._lock:
                    self.report.requests_aborted_rerun += 1
                continue
            if not _intact(text, prompt, list(self.versions)):
                with self._lock:
                    self.report.garbage_completions += 1
            return "done"
        return "lost"

    def _straggler(self, i: int, delay: float, prompt: str) -> str:
        self.clock.sleep(delay)
        return self._checked(i, prompt)

    # -- the two ways ----------------------------------------------------------------------

    def _ours(self, transition: Callable[[], object]) -> None:
        run_rounds(transition, lambda: self.orch.quarantined(), None, self.report, again_unquarantined=True)

    def _ours_sync(self, version: str) -> None:
        with self.orch.weight_sync(mode="retract") as engines:
            expected = expected_checksums(version)  # what the trainer knows of the weights it pushes

            def push(e: VLLMEngine) -> object:
                return e.push_weights([{"names": ["w"], "version": version}], version=version, expected=expected)

            list(self.pool.map(push, engines))

    def step(self, n: int) -> None:
        cfg, version = self.config, f"v{n}"
        stragglers = rollout(self.pool, n, cfg, self.rng, self._checked, self._straggler, len(self.urls))
        self.stragglers = stragglers
        if self.kind == BASELINE:
            self.report.timed("offload", lambda: self.skyrl.call_all(f"/sleep?level={SKYRL_SLEEP_LEVEL}"))
            time.sleep(cfg.train_s)
            self.report.timed("onload", lambda: self.skyrl.call_all("/wake_up?tags=weights"))
            self.versions.add(version)
            self.report.timed("weight_sync", lambda: self.skyrl.weight_sync(version))
            self.report.timed("onload", lambda: self.skyrl.call_all("/wake_up?tags=kv_cache"))
        else:
            self.report.timed("offload", lambda: self._ours(self.orch.offload))
            time.sleep(cfg.train_s)
            self.report.timed("onload", lambda: self._ours(lambda: self.orch.onload(tags=["weights"])))
            self.versions.add(version)
            self.report.timed("weight_sync", lambda: self._ours(lambda: self._ours_sync(version)))
            self.report.timed("onload", lambda: self._ours(self.orch.onload))

    # -- recovery: a global restart ------------------------------------------------------

    def _put_in_order(self, engine: EngineHandle) -> None:
        proxy = self.proxies.get(engine.index)
        if proxy is not None:  # a control call reset after sending may still be landing: read the state once it has
            proxy.settle(paths=VLLM_CONTROL_PATHS)
        state, url = engine.state(), engine.direct_url
        if state.get("weight_update_active"):
            self.bare.post(f"{url}/finish_weight_update", json={}, timeout=30)
        if state.get("sleeping_tags"):
            self.bare.post(f"{url}/wake_up", timeout=30)
        if state.get("pause_state") != "unpaused":
            self.bare.post(f"{url}/resume", timeout=30)

    def recover(self, failed: bool) -> int:
        """After every step, ``failed`` or not: a global restart (``restore_fleet``), the controller started afresh,
        then the step's stragglers waited for (requests queued at a sleeping engine hang until its wake)."""
        deaths = restore_fleet(self.fleet.engines, self._put_in_order)
        for e in self.engines:
            e.close()
        self.engines = self._new_engines()
        self.orch = self._orchestrator()
        self._init_transfer()
        stragglers, self.stragglers = self.stragglers, []
        self.report.requests_lost += lost_stragglers(stragglers, False)
        return deaths

    def tally(self) -> None:
        """Nothing of its own: every count comes from the proxies and the retry events."""

    def close(self, *, interrupted: bool = False) -> None:
        if interrupted:
            lost_stragglers(self.stragglers, True)
        self.pool.shutdown(wait=not interrupted, cancel_futures=True)
        self.bare.close()
        for e in self.engines:
            e.close()
