"""``cpr probe URL...``: read-only checks of SGLang (or, with ``--engine vllm``, vLLM) engines, all at once, each bounded.

SGLang: ``GET /health``, ``/ready``, ``/model_info``, ``/v1/loads?include=core``, ``/server_info``. vLLM 0.33.0:
``GET /health``, ``/version``, ``/is_paused``, ``/is_sleeping``, ``/weight_info``. One attempt each, never
retried, never a call that changes the engine. A paused SGLang engine's ``/health`` hangs about 20 s: the probe
says "no answer in 3 s (paused?)". vLLM's ``/health`` stays 200 while paused or asleep (503 only with the engine
core dead), its control routes answer 404 without ``VLLM_SERVER_DEV_MODE=1``, ``/is_sleeping`` is true while
merely paused, and ``--api-key`` guards only ``/v1`` routes (no key is sent). The probe ends within about twice
the timeout; exit 0 only when every engine is healthy.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import requests

from resilience.adapters.sglang import SGLANG_OPEN_PREFIXES, SGLANG_POLICIES
from resilience.adapters.vllm import VLLM_POLICIES
from resilience.cli.common import CliError, plural
from resilience.cli.errors_text import safe_url
from resilience.cli.render import describe_policy, make_console, rich_table
from resilience.policy import PolicyTable

__all__ = [
    "CHECKS",
    "VLLM_CHECKS",
    "Check",
    "CheckResult",
    "EngineProbe",
    "GatewayWorkers",
    "gateway_workers",
    "policy_groups",
    "probe_engines",
    "run_probe",
    "vllm_line",
]


@dataclass(frozen=True, slots=True)
class Check:
    """One read-only request of the probe."""

    name: str
    path: str
    params: Mapping[str, str] | None = None


CHECKS: tuple[Check, ...] = (
    Check("health", "/health"),
    Check("ready", "/ready"),
    Check("model_info", "/model_info"),
    Check("loads", "/v1/loads", {"include": "core"}),
    Check("server_info", "/server_info"),
)
"""What ``cpr probe`` asks each engine, in table order; all GETs."""


VLLM_CHECKS: tuple[Check, ...] = (
    Check("health", "/health"),
    Check("version", "/version"),
    Check("is_paused", "/is_paused"),
    Check("is_sleeping", "/is_sleeping"),
    Check("weight_info", "/weight_info"),
)
"""What ``cpr probe --engine vllm`` asks each engine, in table order; all GETs, none behind vLLM's API key."""


@dataclass(frozen=True, slots=True)
class CheckResult:
    """The answer to one check: a status and latency, or why there was none."""

    check: Check
    status: int | None = None
    latency_s: float | None = None
    data: Any = None
    error: str | None = None
    """``connection refused``, ``no answer in 3 s``, ... (None when an HTTP status came back)."""
    unreachable: bool = False
    """The connection itself failed (nothing listens, no route, unknown host)."""
    key_sent: bool = False
    """Whether the API key went with this check (never to ``/health*`` or ``/ready*``, which SGLang leaves open)."""

    @property
    def ok(self) -> bool:
        """A 2xx came back."""
        return self.status is not None and 200 <= self.status < 300

    def cell(self) -> str:
        """Short form for the table: ``200 in 0.012 s`` or the error."""
        if self.status in (401, 403):
            return f"{self.status}: " + ("the API key was refused" if self.key_sent else "a key is required (--api-key-env)")
        if self.status is not None:
            return f"{self.status} in {self.latency_s or 0:.3f} s"
        return self.error or "?"


@dataclass
class EngineProbe:
    """Every check of one engine."""

    url: str
    timeout_s: float
    results: dict[str, CheckResult]

    @property
    def healthy(self) -> bool:
        """``/health`` answered 2xx."""
        return self.results["health"].ok

    def line(self) -> str:
        """One line: OK/FAIL, the URL, and what was learnt."""
        return _line(self, _sglang_parts)


def _line(probe: EngineProbe, parts: Callable[[dict[str, CheckResult]], list[str]]) -> str:
    """``OK``/``FAIL``, the URL, and ``parts(results)`` joined by ``; `` (or ``unreachable`` and why)."""
    r = probe.results
    if all(x.unreachable for x in r.values()):
        return f"FAIL  {safe_url(probe.url)}  unreachable: {r['health'].error}"
    return f"{'OK  ' if probe.healthy else 'FAIL'}  {safe_url(probe.url)}  " + "; ".join(parts(r))


def _said(result: CheckResult, say: Callable[[dict[str, Any]], str]) -> str:
    """``say(data)`` when ``result`` is a 2xx with a JSON object, else ``<path>: <cell>``."""
    if result.ok and isinstance(result.data, dict):
        return say(result.data)
    return f"{result.check.path}: {result.cell()}"


def _sglang_parts(r: dict[str, CheckResult]) -> list[str]:
    health, ready = r["health"], r["ready"]
    if health.ok:
        alive = f"healthy ({health.status} in {health.latency_s or 0:.2f} s)"
    elif health.status is not None:
        alive = f"/health answered {health.status}"
    elif health.error and health.error.startswith("no answer"):
        alive = f"/health: {health.error} (paused?)"
    else:
        alive = f"/health: {health.error}"
    if ready.ok:
        readiness = "ready"
    elif ready.status is not None:
        readiness = f"not ready ({ready.status}{', paused?' if ready.status == 503 else ''})"
    else:
        readiness = f"/ready: {ready.error}"
    entry = _first_load(r["loads"].data) if r["loads"].ok else None
    return [
        alive,
        readiness,
        _said(r["model_info"], lambda d: f"weights {d.get('weight_version')!r} ({d.get('model_path')})"),
        f"{entry.get('num_running_reqs', '?')} running, {entry.get('num_waiting_reqs', '?')} waiting"
        if entry is not None
        else f"/v1/loads: {r['loads'].cell()}",
        _said(r["server_info"], lambda d: f"sglang {d.get('version', '?')}"),
    ]


def _flag(result: CheckResult, key: str) -> bool | None:
    data = result.data
    if result.ok and isinstance(data, dict) and isinstance(data.get(key), bool):
        return bool(data[key])
    return None


def vllm_line(probe: EngineProbe) -> str:
    """One line: OK/FAIL, the URL, and what was learnt (dev mode, paused, asleep, weights)."""
    return _line(probe, _vllm_parts)


def _vllm_parts(r: dict[str, CheckResult]) -> list[str]:
    health = r["health"]
    if health.ok:
        alive = f"alive ({health.status} in {health.latency_s or 0:.2f} s; also while paused or asleep)"
    elif health.status == 503:
        alive = "/health answered 503: the engine core is dead"
    else:
        alive = f"/health: {health.cell()}"
    parts = [alive, _said(r["version"], lambda d: f"vllm {d.get('version', '?')}")]
    paused, sleeping = r["is_paused"], r["is_sleeping"]
    if paused.status == 404 or sleeping.status == 404:
        return [*parts, "control routes 404: dev mode off (VLLM_SERVER_DEV_MODE=1 not set)"]
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
    return [*parts, _said(r["weight_info"], lambda d: f"weights {d.get('weight_version')!r}")]


def _first_load(data: Any) -> dict[str, Any] | None:
    if isinstance(data, dict) and isinstance(data.get("loads"), list) and data["loads"] and isinstance(data["loads"][0], dict):
        first: dict[str, Any] = data["loads"][0]
        return first
    return None


def _why(exc: requests.RequestException, timeout: float) -> tuple[str, bool]:
    """(what went wrong, whether the engine is unreachable)."""
    if isinstance(exc, requests.ConnectTimeout):
        return f"no connection in {timeout:g} s", True
    if isinstance(exc, requests.ReadTimeout):
        return f"no answer in {timeout:g} s", False
    text = str(exc)
    if isinstance(exc, requests.ConnectionError):
        if "refused" in text.lower():
            return "connection refused", True
        if "resolve" in text.lower() or "name or service not known" in text.lower() or "nodename" in text.lower():
            return "cannot resolve the host", True
        if "reset" in text.lower() or "aborted" in text.lower() or "RemoteDisconnected" in text:
            return "connection dropped without an answer", False
        return "cannot connect", True
    return type(exc).__name__, False


def _run_check(
    url: str, check: Check, timeout: float, headers: Mapping[str, str], out: dict[str, CheckResult], keyed: Callable[[str], bool]
) -> None:
    if not keyed(check.path):
        headers = {}  # the engine asks no key there: do not spread it
    t0 = time.monotonic()
    try:
        with requests.Session() as session:
            response = session.get(
                url + check.path, params=check.params, headers=headers, timeout=(timeout, timeout), allow_redirects=False
            )
    except requests.RequestException as exc:
        error, unreachable = _why(exc, timeout)
        out[check.name] = CheckResult(check, error=error, unreachable=unreachable)
        return
    latency = time.monotonic() - t0
    try:
        data = response.json() if response.content else None
    except ValueError:
        data = None
    out[check.name] = CheckResult(check, response.status_code, latency, data, key_sent="Authorization" in headers)


def _sglang_keyed(path: str) -> bool:
    return not path.startswith(SGLANG_OPEN_PREFIXES)


def probe_engines(
    urls: Sequence[str],
    timeout: float,
    api_key: str | None = None,
    checks: Sequence[Check] = CHECKS,
    keyed: Callable[[str], bool] = _sglang_keyed,
) -> list[EngineProbe]:
    """Run every check (default ``CHECKS``, SGLang's) against every engine concurrently; return within about
    ``2 * timeout + 1`` seconds. ``keyed``: whether the API key goes to a path (default: SGLang's guarded ones)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    outs: list[dict[str, CheckResult]] = [{} for _ in urls]
    threads = [
        threading.Thread(target=_run_check, args=(url, check, timeout, headers, out, keyed), name=f"cpr-probe-{check.name}", daemon=True)
        for url, out in zip(urls, outs, strict=True)
        for check in checks
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 2 * timeout + 1
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    probes = []
    for url, out in zip(urls, outs, strict=True):
        results = {c.name: out.get(c.name) or CheckResult(c, error=f"no answer in {timeout:g} s") for c in checks}
        probes.append(EngineProbe(url, timeout, results))
    return probes


def _normalise(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CliError(f"{url!r} is not an http:// or https:// engine URL (e.g. http://127.0.0.1:30000)", 2)
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise CliError(f"{url!r} has an invalid port", 2) from None
    return url.rstrip("/")


@dataclass(frozen=True, slots=True)
class GatewayWorkers:
    """What an smg gateway's ``GET /workers`` listed (``--router smg``): each worker's URL and smg's status of it."""

    gateway: str
    workers: tuple[tuple[str, str], ...] = ()
    """``(worker URL, status)`` pairs (``ready``, ``pending``, ``failed``, ``draining``), in the gateway's order."""
    error: str | None = None
    """Why the gateway gave no list (None when it did)."""

    def line(self) -> str:
        """One line: the gateway, and its workers by status (or why it listed none)."""
        if self.error is not None:
            return f"FAIL  gateway {safe_url(self.gateway)}  {self.error}"
        counts: dict[str, int] = {}
        for _url, status in self.workers:
            counts[status] = counts.get(status, 0) + 1
        verdict = "OK  " if self.workers and set(counts) == {"ready"} else "FAIL"
        by_status = ", ".join(f"{n} {status}" for status, n in counts.items()) or "none"
        return f"{verdict}  gateway {safe_url(self.gateway)}  {plural(len(self.workers), 'worker')}: {by_status}"


def gateway_workers(gateway: str, timeout: float) -> GatewayWorkers:
    """``GET /workers`` of the smg gateway at ``gateway``: one attempt within ``timeout`` seconds, never retried."""
    try:
        response = requests.get(f"{gateway}/workers", timeout=timeout)
    except requests.RequestException as exc:
        return GatewayWorkers(gateway, error=f"GET /workers: {_why(exc, timeout)[0]}")
    if response.status_code != 200:
        return GatewayWorkers(gateway, error=f"GET /workers answered {response.status_code} (is it an smg gateway?)")
    try:
        listed = response.json().get("workers", [])
        workers = tuple((str(w["url"]).rstrip("/"), str(w.get("status"))) for w in listed)
    except (ValueError, AttributeError, KeyError, TypeError):
        return GatewayWorkers(gateway, error="GET /workers answered no worker list (is it an smg gateway?)")
    return GatewayWorkers(gateway, workers)


def run_probe(args: argparse.Namespace) -> int:
    """Probe the engines from parsed arguments; exit 0 only when every engine is healthy (``--router smg``: the URLs
    are gateways, the engines the workers they list, and every gateway must list workers, all ``ready``)."""
    urls = [_normalise(u) for u in args.urls]
    gateways: list[GatewayWorkers] = []
    if args.router == "smg":
        gateways = [gateway_workers(url, args.timeout) for url in urls]
        urls = list(dict.fromkeys(url for g in gateways for url, _status in g.workers))
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise CliError(f"--api-key-env {args.api_key_env}: that environment variable is not set", 2)
    vllm = args.engine == "vllm"
    line: Callable[[EngineProbe], str]
    if vllm:  # vLLM's --api-key guards only /v1 routes: no check here sends it
        checks, line, table, name = VLLM_CHECKS, vllm_line, VLLM_POLICIES, "VLLM_POLICIES"
        probes = probe_engines(urls, args.timeout, None, VLLM_CHECKS, keyed=lambda _path: False)
    else:
        checks, line, table, name = CHECKS, EngineProbe.line, SGLANG_POLICIES, "SGLANG_POLICIES"
        probes = probe_engines(urls, args.timeout, api_key)
    console = make_console()
    for gateway in gateways:
        console.print(gateway.line(), markup=False, highlight=False, soft_wrap=True)
    if gateways and not urls:
        print(f"cpr probe: no worker to check behind {plural(len(gateways), 'gateway')}", file=sys.stderr)
        return 1
    for probe in probes:
        console.print(line(probe), markup=False, highlight=False, soft_wrap=True)
    columns = ["check", *(safe_url(p.url).split("://", 1)[1].rstrip("/") for p in probes)]  # host:port, no credentials
    rows = [[f"GET {check.path}", *(p.results[check.name].cell() for p in probes)] for check in checks]
    # the heading is a line of its own: as a table title it would wrap at the table's width (narrow for one engine)
    command = "cpr probe" + (" --engine vllm" if vllm else "") + (" --router smg" if gateways else "")
    heading = f"{command}: {plural(len(probes), 'engine')}, one attempt per check, {args.timeout:g} s timeout"
    console.print(heading, markup=False, highlight=False, soft_wrap=True)
    console.print(rich_table(None, columns, rows))
    console.print(f"policy a client applies ({name}):", markup=False, highlight=False)
    for paths, description in policy_groups(checks, table):
        console.print(f"  {paths}: {description}", markup=False, highlight=False, soft_wrap=True)
    healthy = sum(p.healthy for p in probes)
    console.print(f"{healthy} of {plural(len(probes), 'engine')} healthy", markup=False, highlight=False)
    sick = [safe_url(p.url) for p in probes if not p.healthy]
    sick += [f"gateway {safe_url(g.gateway)}" for g in gateways if not g.line().startswith("OK")]
    if sick:
        print(f"cpr probe: {len(sick)} of {plural(len(probes), 'engine')} not healthy: {', '.join(sick)}", file=sys.stderr)
    return 0 if not sick else 1


def policy_groups(checks: Sequence[Check] = CHECKS, table: PolicyTable = SGLANG_POLICIES) -> list[tuple[str, str]]:
    """The policy ``table`` applies to each of ``checks``, once per distinct policy: ``("GET /ready, /v1/loads", "...")``."""
    groups: dict[str, list[str]] = {}
    for check in checks:
        groups.setdefault(describe_policy(table.match("GET", check.path).policy), []).append(check.path)
    return [(f"GET {', '.join(paths)}", description) for description, paths in groups.items()]
