"""``cpr probe --engine vllm URL...``: read-only checks of vLLM 0.33.0 servers, all at once, each bounded in time.

Per engine: ``GET /health``, ``/version``, ``/is_paused``, ``/is_sleeping`` and
``/weight_info``, one attempt each with a short timeout, never retried, nothing
that changes the engine. What vLLM answers differently from SGLang
(``shared/reference/vllm-control-plane.md``): ``/health`` stays 200 while the
engine is paused or asleep (503 only when the engine core is dead); the control
routes answer 404 without ``VLLM_SERVER_DEV_MODE=1`` (said so); ``/is_sleeping`` is
true while merely paused; no route says which tags sleep. ``--api-key`` guards only
``/v1`` routes, so no key is sent. Exit 0 only when every engine is healthy.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from resilience.adapters.vllm import VLLM_POLICIES
from resilience.cli.common import plural
from resilience.cli.errors_text import safe_url
from resilience.cli.probe import Check, CheckResult, EngineProbe, probe_engines
from resilience.cli.render import describe_policy, make_console, rich_table

__all__ = ["VLLM_CHECKS", "run_vllm_probe", "vllm_line"]

VLLM_CHECKS: tuple[Check, ...] = (
    Check("health", "/health"),
    Check("version", "/version"),
    Check("is_paused", "/is_paused"),
    Check("is_sleeping", "/is_sleeping"),
    Check("weight_info", "/weight_info"),
)
"""What ``cpr probe --engine vllm`` asks each engine, in table order; all GETs, none behind vLLM's API key."""


def _flag(result: CheckResult, key: str) -> bool | None:
    data = result.data
    if result.ok and isinstance(data, dict) and isinstance(data.get(key), bool):
        return bool(data[key])
    return None


def vllm_line(probe: EngineProbe) -> str:
    """One line: OK/FAIL, the URL, and what was learnt (dev mode, paused, asleep, weights)."""
    r = probe.results
    if all(x.unreachable for x in r.values()):
        return f"FAIL  {safe_url(probe.url)}  unreachable: {r['health'].error}"
    parts = []
    health = r["health"]
    if health.ok:
        parts.append(f"alive ({health.status} in {health.latency_s or 0:.2f} s; also while paused or asleep)")
    elif health.status == 503:
        parts.append("/health answered 503: the engine core is dead")
    else:
        parts.append(f"/health: {health.cell()}")
    version = r["version"]
    if version.ok and isinstance(version.data, dict):
        parts.append(f"vllm {version.data.get('version', '?')}")
    else:
        parts.append(f"/version: {version.cell()}")
    paused, sleeping = r["is_paused"], r["is_sleeping"]
    if paused.status == 404 or sleeping.status == 404:
        parts.append("control routes 404: dev mode off (VLLM_SERVER_DEV_MODE=1 not set)")
    else:
        is_paused, is_sleeping = _flag(paused, "is_paused"), _flag(sleeping, "is_sleeping")
        if is_paused is None:
            parts.append(f"/is_paused: {paused.cell()}")
        else:
            parts.append("paused" if is_paused else "not paused")
        if is_sleeping is None:
            parts.append(f"/is_sleeping: {sleeping.cell()}")
        elif is_sleeping and not is_paused:
            parts.append("asleep")
        elif is_sleeping:
            parts.append("asleep or paused (vLLM cannot tell which)")
        else:
            parts.append("awake")
        info = r["weight_info"]
        if info.ok and isinstance(info.data, dict):
            parts.append(f"weights {info.data.get('weight_version')!r}")
        else:
            parts.append(f"/weight_info: {info.cell()}")
    return f"{'OK  ' if probe.healthy else 'FAIL'}  {safe_url(probe.url)}  " + "; ".join(parts)


def run_vllm_probe(urls: Sequence[str], timeout: float) -> int:
    """Probe the vLLM engines at ``urls`` (already checked); exit 0 only when every one is healthy."""
    probes = probe_engines(urls, timeout, None, VLLM_CHECKS, keyed=lambda _path: False)
    console = make_console()
    for probe in probes:
        console.print(vllm_line(probe), markup=False, highlight=False, soft_wrap=True)
    columns = ["check", *(safe_url(p.url).split("://", 1)[1].rstrip("/") for p in probes)]
    rows = [[f"GET {check.path}", *(p.results[check.name].cell() for p in probes)] for check in VLLM_CHECKS]
    heading = f"cpr probe --engine vllm: {plural(len(probes), 'engine')}, one attempt per check, {timeout:g} s timeout"
    console.print(heading, markup=False, highlight=False, soft_wrap=True)
    console.print(rich_table(None, columns, rows))
    console.print("policy a client applies (VLLM_POLICIES):", markup=False, highlight=False)
    groups: dict[str, list[str]] = {}
    for check in VLLM_CHECKS:
        groups.setdefault(describe_policy(VLLM_POLICIES.match("GET", check.path).policy), []).append(check.path)
    for description, paths in groups.items():
        console.print(f"  GET {', '.join(paths)}: {description}", markup=False, highlight=False, soft_wrap=True)
    healthy = sum(p.healthy for p in probes)
    console.print(f"{healthy} of {plural(len(probes), 'engine')} healthy", markup=False, highlight=False)
    sick = [safe_url(p.url) for p in probes if not p.healthy]
    if sick:
        print(f"cpr probe: {len(sick)} of {plural(len(probes), 'engine')} not healthy: {', '.join(sick)}", file=sys.stderr)
    return 0 if not sick else 1
