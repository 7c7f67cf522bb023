"""``SGLangInstrumentor``: clients built by code that knows nothing of us get our drivers, for the engines named only.

Each "framework" below builds its own client the way AReaL and verl do (a
session per call, module-level ``requests.post``) and wraps it in its own
retry loop of three tries. With the instrumentor active, the sends per
logical call stay within the endpoint's ``max_attempts`` however many times
the outer loop tries; after ``uninstrument`` everything is plain library code
again. Real loopback servers only.
"""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import httpx
import pytest
import requests

import resilience
from resilience.adapters.driver_config import DriverConfig
from resilience.adapters.instrument import SGLangInstrumentor
from resilience.adapters.requests import ResilientAdapter
from resilience.adapters.sglang import mount_sglang, sglang_policies
from resilience.engine_contract import UnknownEngine
from resilience.errors import ConfigConflict, ConfigError
from resilience.policy import EndpointPolicy, PolicyTable, ProbeAnswer, ProbeContext, RetryPolicy
from resilience.testing.memory_probe import EmulatorMemoryProbe
from tests.servers import Hang, Reply, ScriptedServer, scripted

MAX = 4
OUTER = 3
PAUSE = "/pause_generation"
RELEASE = "/release_memory_occupation"
_QUICK = RetryPolicy(max_attempts=MAX, base_s=0.0, cap_s=0.0)


def table(probe: Callable[[ProbeContext], ProbeAnswer] | None = None) -> PolicyTable:
    """pause idempotent, release not (502s retried: the seed's trade-off), both with ``MAX`` attempts and no backoff."""
    release = EndpointPolicy(retry=_QUICK, idempotent=False, retry_statuses_if_not_idempotent=True, attempt_timeout_s=0.5, deadline_s=20)
    if probe is not None:
        release = EndpointPolicy(
            retry=_QUICK, idempotent=False, retry_statuses_if_not_idempotent=True, attempt_timeout_s=0.5, deadline_s=20, on_ambiguous=probe
        )
    return PolicyTable(
        {
            f"POST {PAUSE}": EndpointPolicy(retry=_QUICK, idempotent=True, attempt_timeout_s=5, deadline_s=20),
            f"POST {RELEASE}": release,
        }
    )


@pytest.fixture
def instrumented() -> Iterator[Callable[..., SGLangInstrumentor]]:
    made: list[SGLangInstrumentor] = []

    def make(engines: list[str], cls: type[SGLangInstrumentor] = SGLangInstrumentor, **kwargs: object) -> SGLangInstrumentor:
        inst = cls(engines, **kwargs).instrument()  # type: ignore[arg-type]
        made.append(inst)
        return inst

    try:
        yield make
    finally:
        for inst in made:
            inst.uninstrument()
        assert SGLangInstrumentor.active() is None


# -- "framework" code: knows nothing of us; three tries of its own, as AReaL and verl ---------


def requests_framework(url: str) -> tuple[int | None, str]:
    """verl's sync path: module-level ``requests.post`` in a loop, ``raise_for_status``."""
    last = ""
    for _ in range(OUTER):
        try:
            r = requests.post(url, json={}, timeout=5)
            r.raise_for_status()
            return r.status_code, ""
        except requests.RequestException as exc:
            last = type(exc).__name__
    return None, last


def httpx_framework(url: str) -> tuple[int | None, str]:
    """A client per call, as slime's and AReaL's httpx helpers build them."""
    last = ""
    for _ in range(OUTER):
        try:
            with httpx.Client(timeout=5) as client:
                r = client.post(url, json={})
                r.raise_for_status()
                return r.status_code, ""
        except httpx.HTTPError as exc:
            last = type(exc).__name__
    return None, last


def httpx_async_framework(url: str) -> tuple[int | None, str]:
    async def main() -> tuple[int | None, str]:
        last = ""
        for _ in range(OUTER):
            try:
                async with httpx.AsyncClient(timeout=5) as client:
                    r = await client.post(url, json={})
                    r.raise_for_status()
                    return r.status_code, ""
            except httpx.HTTPError as exc:
                last = type(exc).__name__
        return None, last

    return asyncio.run(main())


def aiohttp_framework(url: str) -> tuple[int | None, str]:
    """AReaL's ``arequest_with_retry``: a session, ``raise_for_status``, every ClientError and timeout caught and re-sent."""

    async def main() -> tuple[int | None, str]:
        last = ""
        for _ in range(OUTER):
            try:
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
                    async with session.post(url, json={}) as r:
                        r.raise_for_status()
                        return r.status, ""
            except (TimeoutError, aiohttp.ClientError) as exc:
                last = type(exc).__name__
        return None, last

    return asyncio.run(main())


FRAMEWORKS = {
    "requests": requests_framework,
    "httpx": httpx_framework,
    "httpx-async": httpx_async_framework,
    "aiohttp": aiohttp_framework,
}


def posts(server: ScriptedServer, path: str) -> int:
    return sum(1 for s in server.seen if s.path == path)


@pytest.mark.parametrize("library", FRAMEWORKS)
def test_outer_retry_loop_of_a_release_stays_within_max_attempts(library: str, instrumented: Callable[..., SGLangInstrumentor]) -> None:
    """Three tries of an always-502 release (a re-send can hurt) send ``max_attempts`` requests in all, not three times that."""
    framework = FRAMEWORKS[library]
    with scripted(Reply(502, b"")) as server:
        status, _error = framework(server.url + RELEASE)
        assert status is None and posts(server, RELEASE) == OUTER  # as shipped: one send per try
        instrumented([server.url], policies=table())
        status, _error = framework(server.url + RELEASE)
        assert status is None
        assert posts(server, RELEASE) == OUTER + MAX


@pytest.mark.parametrize("library", FRAMEWORKS)
def test_outer_retry_loop_of_a_pause_gets_attempts_per_try(library: str, instrumented: Callable[..., SGLangInstrumentor]) -> None:
    """A pause is harmless to re-send: each of the framework's tries gets ``max_attempts`` (a 502 streak longer than one call's
    attempts is ridden out, as a session mounted per call would), bounded by the budget and the endpoint's deadline."""
    framework = FRAMEWORKS[library]
    script = [*[Reply(502, b"")] * (MAX + 1), Reply(200, b"{}"), *[Reply(502, b"")] * (2 * MAX), Reply(200, b"{}")]
    with scripted(*script) as server:
        instrumented([server.url], policies=table())
        status, _error = framework(server.url + PAUSE)
        assert status == 200, _error
        assert posts(server, PAUSE) == MAX + 2
        # verl: one call, no retry of its own on a status: our rounds ride out twice the attempts
        assert requests.post(server.url + PAUSE, json={}, timeout=5).status_code == 200
        assert posts(server, PAUSE) == 3 * MAX + 3


@pytest.mark.parametrize("library", FRAMEWORKS)
def test_transient_502s_are_absorbed_once(library: str, instrumented: Callable[..., SGLangInstrumentor]) -> None:
    """Two 502s then 200: the first try succeeds through our retries; the framework never sees the 502s."""
    with scripted(Reply(502, b""), Reply(502, b""), Reply(200, b"{}")) as server:
        instrumented([server.url], policies=table())
        status, _ = FRAMEWORKS[library](server.url + PAUSE)
        assert status == 200 and posts(server, PAUSE) == 3


@pytest.mark.parametrize("library", FRAMEWORKS)
def test_unresolved_release_is_not_re_sent_by_the_outer_loop(library: str, instrumented: Callable[..., SGLangInstrumentor]) -> None:
    """A release whose answer never came (read timeout after sending) goes out once, whatever the framework's loop does."""
    with scripted(Hang(3.0)) as server:
        instrumented([server.url], policies=table())
        status, error = FRAMEWORKS[library](server.url + RELEASE)
        assert status is None and posts(server, RELEASE) == 1, error


@pytest.mark.parametrize("library", FRAMEWORKS)
def test_probe_settles_the_outer_retry(library: str, instrumented: Callable[..., SGLangInstrumentor]) -> None:
    """With a probe on the endpoint, the outer loop's re-send of an unresolved release asks it first; "done" answers without sending."""
    asked: list[ProbeContext] = []

    def probe(context: ProbeContext) -> ProbeAnswer:
        asked.append(context)
        return ProbeAnswer.DONE

    with scripted(Hang(3.0)) as server:
        instrumented([server.url], policies=table(probe))
        status, _ = FRAMEWORKS[library](server.url + RELEASE)
        assert status == 200  # the call's own probe confirmed it
        assert posts(server, RELEASE) == 1 and len(asked) == 1


@pytest.mark.parametrize("library", FRAMEWORKS)
@pytest.mark.parametrize(
    ("second", "sends", "asks"),
    [(ProbeAnswer.DONE, 1, 2), (ProbeAnswer.NOT_DONE, 2, 2)],
)
def test_the_outer_loops_next_call_asks_the_probe_before_sending(
    library: str, second: ProbeAnswer, sends: int, asks: int, instrumented: Callable[..., SGLangInstrumentor]
) -> None:
    """The call's own probe cannot tell (the call raises); the framework's re-send asks again: "done" sends nothing, "not done" sends."""
    answers = [ProbeAnswer.UNKNOWN, second]
    asked: list[ProbeContext] = []

    def probe(context: ProbeContext) -> ProbeAnswer:
        asked.append(context)
        return answers[min(len(asked), len(answers)) - 1]

    with scripted(Hang(3.0), Reply(200, b"{}")) as server:
        instrumented([server.url], policies=table(probe))
        status, _ = FRAMEWORKS[library](server.url + RELEASE)
        assert status == 200
        assert posts(server, RELEASE) == sends and len(asked) == asks
        assert asked[1].body == b"{}"  # the repeat's probe sees the body (a memory probe reads the tags there)


def test_other_hosts_stay_plain(instrumented: Callable[..., SGLangInstrumentor]) -> None:
    """A host:port not named is not touched: one send per try, as the library does it."""
    with scripted(Reply(502, b"")) as engine, scripted(Reply(502, b"")) as other:
        instrumented([engine.url], policies=table())
        for framework in FRAMEWORKS.values():
            framework(other.url + PAUSE)
        assert posts(other, PAUSE) == OUTER * len(FRAMEWORKS)
        assert engine.count == 0


def test_bare_host_matches_every_port(instrumented: Callable[..., SGLangInstrumentor]) -> None:
    """A bare host names every port of it."""
    with scripted(Reply(502, b"")) as server:
        instrumented(["127.0.0.1"], policies=table())
        requests_framework(server.url + RELEASE)
        assert posts(server, RELEASE) == MAX


def test_no_double_mount(instrumented: Callable[..., SGLangInstrumentor]) -> None:
    """A session that already mounts our adapter keeps it; the instrumentor adds nothing to it, nor to a session with our middleware."""
    own = PolicyTable({f"POST {PAUSE}": EndpointPolicy(retry=RetryPolicy(max_attempts=2, base_s=0, cap_s=0), idempotent=True)})
    with scripted(Reply(502, b"")) as server:
        instrumented([server.url], policies=table())
        session = requests.Session()
        adapter = mount_sglang(session, [server.url], policies=own)
        assert session.get_adapter(server.url + PAUSE) is adapter
        session.post(server.url + PAUSE)
        assert posts(server, PAUSE) == 2

        async def with_middleware() -> int:
            middleware = resilience.adapters.aiohttp.ResilientMiddleware(own)
            async with aiohttp.ClientSession(middlewares=(middleware,)) as s:
                assert len(s._middlewares) == 1
                async with s.post(server.url + PAUSE) as r:
                    return r.status

        assert asyncio.run(with_middleware()) == 502
        assert posts(server, PAUSE) == 4


def test_uninstrument_restores_the_libraries(instrumented: Callable[..., SGLangInstrumentor]) -> None:
    """After ``uninstrument`` the patched attributes are the originals and every library sends once per try again."""
    originals = (
        requests.Session.__dict__["get_adapter"],
        httpx.Client.__dict__["_transport_for_url"],
        httpx.AsyncClient.__dict__["_transport_for_url"],
        aiohttp.ClientSession.__dict__["__init__"],
    )
    with scripted(Reply(502, b"")) as server:
        inst = instrumented([server.url], policies=table())
        assert requests.Session.__dict__["get_adapter"] is not originals[0]
        assert isinstance(requests.Session().get_adapter(server.url), ResilientAdapter)
        inst.uninstrument()
        assert not inst.instrumented and SGLangInstrumentor.active() is None
        after = (
            requests.Session.__dict__["get_adapter"],
            httpx.Client.__dict__["_transport_for_url"],
            httpx.AsyncClient.__dict__["_transport_for_url"],
            aiohttp.ClientSession.__dict__["__init__"],
        )
        assert after == originals
        for framework in FRAMEWORKS.values():
            framework(server.url + PAUSE)
        assert posts(server, PAUSE) == OUTER * len(FRAMEWORKS)


def test_a_session_opened_while_instrumented_passes_through_after() -> None:
    """An aiohttp session built while instrumented sends plainly once the instrumentor is undone."""
    with scripted(Reply(502, b"")) as server:
        inst = SGLangInstrumentor([server.url], policies=table()).instrument()

        async def main() -> int:
            async with aiohttp.ClientSession() as session:
                inst.uninstrument()
                async with session.post(server.url + PAUSE) as r:
                    return r.status

        try:
            assert asyncio.run(main()) == 502
        finally:
            inst.uninstrument()
        assert posts(server, PAUSE) == 1


def test_instrument_is_idempotent_per_process(instrumented: Callable[..., SGLangInstrumentor]) -> None:
    """Twice, or an equal instrumentor: one set of patches; a different one is refused until the first is undone."""
    first = instrumented(["http://127.0.0.1:30000"], policies=table())
    patched = requests.Session.__dict__["get_adapter"]
    assert first.instrument() is first
    assert SGLangInstrumentor(["http://127.0.0.1:30000"], policies=table()).instrument() is first
    assert requests.Session.__dict__["get_adapter"] is patched
    with pytest.raises(RuntimeError, match="already active"):
        SGLangInstrumentor(["http://127.0.0.1:30001"]).instrument()


def test_pickles_as_its_settings(instrumented: Callable[..., SGLangInstrumentor]) -> None:
    """Ray ships an instrumentor by pickle: the copy has the same settings and is not active in the process that loads it."""
    inst = instrumented(["http://127.0.0.1:30000", "10.0.0.7"], policies=table(), window_s=12.0)
    copy = pickle.loads(pickle.dumps(inst))
    assert copy is not inst and not copy.instrumented and copy.same_settings(inst)
    assert copy.instrument() is inst  # equal settings: the process's active one


@pytest.mark.parametrize(
    ("engines", "message"),
    [
        ([], "non-empty sequence"),
        ("http://127.0.0.1:1", "non-empty sequence"),
        ([""], "URLs, 'host:port' or hosts"),
        (["http://127.0.0.1:1/generate"], "not a path or query"),
        (["127.0.0.1:notaport"], "is not a URL"),
    ],
)
def test_bad_engines_are_refused(engines: object, message: str) -> None:
    """Engines that are not URLs, host:port or hosts are refused, naming the value."""
    with pytest.raises(ConfigError, match=message):
        SGLangInstrumentor(engines)  # type: ignore[arg-type]


def test_bad_libraries_and_window_are_refused() -> None:
    """An unknown library and a window that is not > 0 are refused at construction."""
    with pytest.raises(ConfigError, match="libraries"):
        SGLangInstrumentor(["127.0.0.1"], libraries=("urllib",))
    with pytest.raises(ConfigError, match="window_s"):
        SGLangInstrumentor(["127.0.0.1"], window_s=0)


def test_every_ray_worker_process_instruments_itself(ray_runtime: object) -> None:
    """Shipped to two Ray actors by pickle and instrumented in each (twice: idempotent), every worker's own loop stays bounded."""
    import ray

    @ray.remote(num_cpus=0)
    class Worker:
        def __init__(self, inst: SGLangInstrumentor) -> None:
            self.inst = inst.instrument()
            assert inst.instrument() is self.inst  # a second call in the same process changes nothing

        def release(self, url: str, tries: int) -> tuple[int, bool, bool]:
            import os

            import requests

            from resilience.adapters.requests import ResilientAdapter

            failed = 0
            for _ in range(tries):  # the framework's own loop, as requests_framework (not importable in a worker)
                try:
                    failed += requests.post(url, json={}, timeout=5).status_code == 502
                except requests.RequestException:  # the ledger refuses what our attempts already spent
                    failed += 1
            adapter = requests.Session().get_adapter(url)
            return os.getpid(), failed == tries, isinstance(adapter, ResilientAdapter)

    with scripted(Reply(502, b"")) as server:
        inst = SGLangInstrumentor([server.url], policies=table())
        workers = [Worker.remote(inst) for _ in range(2)]  # type: ignore[attr-defined]
        try:
            answers = ray.get([w.release.remote(server.url + RELEASE, OUTER) for w in workers], timeout=120)
        finally:
            for w in workers:
                ray.kill(w)
        assert len({pid for pid, _, _ in answers}) == 2
        assert all(failed and ours for _, failed, ours in answers)
        assert posts(server, RELEASE) == 2 * MAX
        assert not inst.instrumented and SGLangInstrumentor.active() is None  # the driver's process was never patched


def test_one_driver_config_for_every_attached_driver(instrumented: Callable[..., SGLangInstrumentor]) -> None:
    """Given a ``DriverConfig``, every attached driver is built from it and shares its breakers; a keyword beside it is refused."""
    config = DriverConfig(policies=table())
    with scripted(Reply(502, b"")) as server:
        inst = instrumented([server.url], config=config)
        adapter = requests.Session().get_adapter(server.url)
        assert inst.config is config and adapter.driver_config is config
        assert inst.retrier(adapter.retrier.error_types).breakers is config.breakers
    with pytest.raises(ConfigConflict, match="policies="):
        SGLangInstrumentor(["127.0.0.1"], config=config, policies=table())


class _Probe:
    """A memory probe that knows ``known`` only (``UnknownEngine`` for the rest) and has no reading for any."""

    def __init__(self, *known: str) -> None:
        self.known = set(known)

    def released_tags(self, engine: str) -> frozenset[str] | None:
        if engine not in self.known:
            raise UnknownEngine(self, engine)
        return None


def test_a_memory_probe_must_know_every_engine(instrumented: Callable[..., SGLangInstrumentor], tmp_path: Path) -> None:
    """``instrument()`` refuses a probe that knows nothing of an engine it is given, naming it; nothing is patched."""
    engines = ["http://127.0.0.1:30001", "127.0.0.1:30002"]
    for probe in (_Probe("http://127.0.0.1:30001"), EmulatorMemoryProbe(tmp_path)):
        inst = SGLangInstrumentor(engines, policies=sglang_policies(memory_probe=probe))
        with pytest.raises(ConfigError, match=r"knows nothing of \['http://127.0.0.1:30002'\]" if isinstance(probe, _Probe) else "30001"):
            inst.instrument()
        assert SGLangInstrumentor.active() is None
    with pytest.raises(ConfigError, match="name no port"):
        SGLangInstrumentor(["127.0.0.1"], policies=sglang_policies(memory_probe=_Probe())).instrument()
    inst = instrumented(engines, policies=sglang_policies(memory_probe=_Probe("http://127.0.0.1:30001", "http://127.0.0.1:30002")))
    assert inst.instrumented and len(inst.memory_probes()) == 1


def test_vllm_engines_get_the_same_mount_over_vllm_policies(instrumented: Callable[..., SGLangInstrumentor]) -> None:
    """``VLLMInstrumentor``: ``VLLM_POLICIES`` by default; a 502 on ``/sleep`` (idempotent) is absorbed, one on
    ``/update_weights`` is handed back unsent again (a collective), and it pickles as itself."""
    from resilience.adapters.instrument import VLLMInstrumentor
    from resilience.adapters.vllm import VLLM_POLICIES

    with scripted(Reply(502, b""), Reply(200, b"{}"), Reply(502, b"")) as server:
        inst = instrumented([server.url], cls=VLLMInstrumentor)
        assert isinstance(inst, VLLMInstrumentor) and inst.policies is VLLM_POLICIES
        assert requests.post(server.url + "/sleep", timeout=5).status_code == 200
        assert posts(server, "/sleep") == 2
        assert requests.post(server.url + "/update_weights", json={}, timeout=5).status_code == 502
        assert posts(server, "/update_weights") == 1
        copy = pickle.loads(pickle.dumps(inst))
        assert type(copy) is VLLMInstrumentor and copy.same_settings(inst) and not inst.same_settings(SGLangInstrumentor([server.url]))
