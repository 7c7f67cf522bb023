"""Deterministic, seeded fault injection in front of an engine: "the nginx of the seed".

``FaultPlan``/``FaultRule`` (``faultplan``: pure logic) say which request gets
which fault; ``FaultProxy`` (``faultproxy``: a loopback HTTP reverse proxy)
carries the faults out on real connections::

    plan = FaultPlan.seed_like(seed=1234)
    with FaultProxy(engine_url, plan) as proxy:
        client = SGLangClient(proxy.url)
        ...
        print(proxy.counts())   # {"status_before:502:/pause_generation": 3, ...}

Standard library only (pyyaml, lazily, for YAML plans).
"""

from __future__ import annotations

from resilience.testing.faultplan import (
    AMBIGUOUS_PATHS,
    CONTROL_PATHS,
    VLLM_AMBIGUOUS_PATHS,
    VLLM_CONTROL_PATHS,
    Decision,
    FaultDecider,
    FaultKind,
    FaultPlan,
    FaultPlanError,
    FaultRule,
)
from resilience.testing.faultproxy import FaultProxy, InjectedFault, SeenRequest

__all__ = [
    "AMBIGUOUS_PATHS",
    "CONTROL_PATHS",
    "Decision",
    "FaultDecider",
    "FaultKind",
    "FaultPlan",
    "FaultPlanError",
    "FaultProxy",
    "FaultRule",
    "InjectedFault",
    "SeenRequest",
    "VLLM_AMBIGUOUS_PATHS",
    "VLLM_CONTROL_PATHS",
]
