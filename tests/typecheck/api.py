"""Type-checked (never run) uses of the public API: mypy must accept these."""

from __future__ import annotations

import requests

import resilience
from resilience import EndpointPolicy, PolicyTable, RetryPolicy
from resilience.adapters.driver_config import DriverConfig
from resilience.adapters.instrument import SGLangInstrumentor
from resilience.adapters.ledger import AttemptLedger, LedgerEntry
from resilience.adapters.requests import ResilientAdapter, resilient_session
from resilience.errors import ConfigConflict
from resilience.events import Event
from resilience.outcome import AttemptRecord, Delivery, attempts_of

table: PolicyTable = PolicyTable({"POST /pause_generation": EndpointPolicy(retry=RetryPolicy(max_attempts=3))})
session: requests.Session = resilient_session(table)
adapter: ResilientAdapter = ResilientAdapter(table, breaker=None)
with resilience.Deadline(5.0) as d:
    left: float = d.remaining()
try:
    session.post("http://127.0.0.1:1/pause_generation", json={})
except resilience.AmbiguousOutcome as exc:
    attempts: tuple[AttemptRecord, ...] = exc.attempts
except requests.RequestException:
    pass

# The lazy top-level names type-check as the classes of their modules.
lazy_session: requests.Session = resilience.resilient_session(table)
lazy_adapter: resilience.ResilientAdapter = resilience.ResilientAdapter(table)
group: resilience.EngineGroup[resilience.SGLangClient] = resilience.EngineGroup([])
failed_type: type[RuntimeError] = resilience.PhaseFailed
client_type: type[resilience.SGLangClient] = resilience.SGLangClient
orchestrator_type: type[resilience.Orchestrator[resilience.SGLangClient]] = resilience.Orchestrator

# Policy files load through a free function; bad values raise the one ConfigError (a ValueError).
try:
    loaded: PolicyTable = resilience.load_policy_file("policies.toml", base=table)
except resilience.ConfigError as bad:
    message: str = str(bad)
config_error: type[ValueError] = resilience.ConfigError

# The one testing switch: a plain call, or a with-block that restores the previous mode.
resilience.set_testing(True, attempts=2)
with resilience.set_testing(False) as mode:
    active: bool = mode.active

# Memory probes: the protocol, the two shipped probes, and the tables and clients that ask them.
from resilience.adapters.nvml import EngineGpu, NvmlMemoryProbe  # noqa: E402
from resilience.adapters.sglang import (  # noqa: E402
    SGLANG_STRICT_POLICIES,
    SGLangClient,
    sglang_policies,
    with_memory_probe,
)
from resilience.engine_contract import MemoryProbe  # noqa: E402
from resilience.testing import EmulatorMemoryProbe  # noqa: E402

emulator_probe: MemoryProbe = EmulatorMemoryProbe("/tmp/state", aliases={"http://127.0.0.1:2": "http://127.0.0.1:1"})
nvml_probe: MemoryProbe = NvmlMemoryProbe({"http://10.0.0.5:30000": EngineGpu(pids=(1,), tag_bytes={"kv_cache": 1})}, reader=lambda _p: 0)
tags: frozenset[str] | None = emulator_probe.released_tags("http://127.0.0.1:1")
probed: PolicyTable = sglang_policies(memory_probe=emulator_probe, strict=False)
strict: PolicyTable = with_memory_probe(SGLANG_STRICT_POLICIES, nvml_probe)
confirmed: bool = SGLangClient("http://127.0.0.1:1", memory_probe=emulator_probe).release_memory_occupation().confirmed_by_probe

# One DriverConfig for every driver; the delivery record of an error through the one accessor.


def watch(event: Event) -> None:
    """An observer."""


config: DriverConfig = DriverConfig(policies=table, observers=(watch,), breaker=None)
shared: ResilientAdapter = ResilientAdapter(config=config)
shared_session: requests.Session = resilient_session(config=config)
conflict: type[resilience.ConfigError] = ConfigConflict
try:
    shared_session.get("http://127.0.0.1:1/x")
except requests.RequestException as failed:
    record: tuple[AttemptRecord, ...] | None = attempts_of(failed)
    never_left: bool = record is not None and all(r.delivery is Delivery.NOT_SENT for r in record)

# Whether an entry named its timeouts (the caller's own timeout wins where it did not); the connect window.
named: bool = EndpointPolicy(attempt_timeout_s=5).named("attempt_timeout_s") and not EndpointPolicy().named("deadline_s")
window: float | None = RetryPolicy(connect_window_s=5.0).connect_window_s
refused_event: type[object] = resilience.events.EngineRefused

# The instrumentor (adapters/instrument.py) and the ledger under it (adapters/ledger.py).

instrumentor: SGLangInstrumentor = SGLangInstrumentor(["http://127.0.0.1:30000", "10.0.0.6"], window_s=10.0).instrument()
instrumented_by_config: SGLangInstrumentor = SGLangInstrumentor(["10.0.0.7:30000"], config=DriverConfig(policies=table))
now_active: SGLangInstrumentor | None = SGLangInstrumentor.active()
is_on: bool = instrumentor.instrumented and instrumentor.matches_url("http://127.0.0.1:30000/pause_generation")
entry: LedgerEntry | None = AttemptLedger(10.0).get("http://127.0.0.1:30000", "POST /release_memory_occupation")
instrumentor.uninstrument()
