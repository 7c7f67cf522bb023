"""SGLangClient against emulated engines: per-endpoint policies, both seed bugs, errors and secrets."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import requests
from pytest_httpserver import HTTPServer

from resilience import AmbiguousOutcome
from resilience.adapters.sglang import (
    SGLANG_POLICIES,
    GenerateResult,
    SGLangClient,
    SGLangError,
    SGLangProtocolError,
    SGLangWeightsReleased,
    mount_sglang,
)
from resilience.errors import DeadlineExceeded
from resilience.events import Event, RetryScheduled
from resilience.outcome import Delivery, attempts_of
from resilience.testing.emulator import EmulatedFleet
from resilience.testing.faults import FaultPlan, FaultRule
from tests.sglang.conftest import FAST_ENGINE, FAST_SGLANG


def wait_dead(fleet: EmulatedFleet, i: int = 0, seconds: float = 10.0) -> bool:
    """Poll (bounded) until engine ``i`` has exited."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not fleet.engines[i].alive():
            return True
        time.sleep(0.05)
    return False


def test_bug_a_bare_requests_dies_client_absorbs() -> None:
    """A 502 window on /pause_generation kills a bare raise_for_status caller; SGLangClient absorbs it, each retry an event."""
    plan = FaultPlan(seed=7, rules=(FaultRule("/pause_generation", "status_before", calls=frozenset({1, 2, 4, 5})),))
    with EmulatedFleet(1, FAST_ENGINE, fault_plan=plan) as fleet:
        url = fleet.urls[0]
        with pytest.raises(requests.HTTPError, match="502"):
            requests.post(f"{url}/pause_generation", json={}).raise_for_status()
        requests.post(f"{url}/continue_generation", json={}).raise_for_status()  # call 2 of pause is still a 502 below
        events: list[Event] = []
        client = SGLangClient(url, policies=FAST_SGLANG, observers=[events.append])
        result = client.pause_generation("abort")
        assert result.attempts >= 2
        retries = [e for e in events if isinstance(e, RetryScheduled)]
        assert [e.reason for e in retries] == ["status_502"] * (result.attempts - 1)
        assert all(e.endpoint == "POST /pause_generation" for e in retries)
        client.continue_generation()
        assert fleet.engines[0].alive()


def test_bug_b_old_sequence_kills_barrier_sequence_survives() -> None:
    """Old flush->release with a straggler kills the engine; pause(abort)->flush->release->resume->continue survives it."""
    with EmulatedFleet(2, FAST_ENGINE) as fleet:
        old, new = (SGLangClient(u, policies=FAST_SGLANG) for u in fleet.urls)
        # old way: no pause; flush and release succeed while idle, then a straggler arrives
        old.flush_cache()
        old.release_memory_occupation()
        straggler_error: list[BaseException] = []
        t = threading.Thread(target=lambda: _generate(old, straggler_error))
        t.start()
        assert wait_dead(fleet, 0)
        t.join(10)
        assert straggler_error, "the straggler's connection should have dropped with the engine"
        assert "Scheduler hit an exception" in fleet.engines[0].log()
        # our way: pause first; the straggler waits, and completes after resume + continue
        new.pause_generation("abort")
        new.flush_cache()
        new.release_memory_occupation()
        answers: list[object] = []
        t = threading.Thread(target=lambda: answers.append(new.generate("late", sampling_params={"max_new_tokens": 4})))
        t.start()
        time.sleep(0.3)
        assert fleet.engines[1].alive() and not answers
        new.resume_memory_occupation()
        new.continue_generation()
        t.join(10)
        assert fleet.engines[1].alive() and len(answers) == 1


def _generate(client: SGLangClient, errors: list[BaseException]) -> None:
    try:
        client.generate("straggler", sampling_params={"max_new_tokens": 4})
    except requests.RequestException as exc:
        errors.append(exc)


def test_502_after_handing_on_release_blind_resend_kills() -> None:
    """A 502 given after the proxy handed a release on: a blind re-send double-releases and kills the engine."""
    plan = FaultPlan(seed=1, rules=(FaultRule("/release_memory_occupation", "status_after", calls=frozenset({1})),))
    with EmulatedFleet(1, FAST_ENGINE, fault_plan=plan) as fleet:
        url = fleet.urls[0]
        requests.post(f"{url}/pause_generation", json={"mode": "abort"}).raise_for_status()
        for _ in range(3):  # the naive "retry on 502" loop
            try:
                r = requests.post(f"{url}/release_memory_occupation", json={"tags": None}, timeout=5)
            except requests.ConnectionError:
                break
            if r.status_code != 502:
                break
        assert wait_dead(fleet)
        assert "Cannot pause allocation that is not active" in fleet.engines[0].log()


def test_read_timeout_on_release_is_never_resent() -> None:
    """A release whose answer times out (applied late) is not re-sent by SGLANG_POLICIES: AmbiguousOutcome, engine alive."""
    plan = FaultPlan(seed=1, rules=(FaultRule("/release_memory_occupation", "latency", delay=1.0, calls=frozenset({1})),))
    policies = FAST_SGLANG.with_entries(
        {
            "GET|POST /release_memory_occupation": replace(
                FAST_SGLANG.match("POST", "/release_memory_occupation").policy, attempt_timeout_s=0.4
            )
        }
    )
    with EmulatedFleet(1, FAST_ENGINE, fault_plan=plan) as fleet:
        client = SGLangClient(fleet.urls[0], policies=policies)
        client.pause_generation("abort")
        with pytest.raises(AmbiguousOutcome) as info:
            client.release_memory_occupation()
        assert "POST /release_memory_occupation" in str(info.value)
        time.sleep(1.5)  # the proxy hands the release on after its delay
        assert fleet.engines[0].alive()
        releases = [c for c in fleet.engines[0].record()["calls"] if c["path"] == "/release_memory_occupation"]
        assert len(releases) == 1


def until_idle(client: SGLangClient, seconds: float = 15.0) -> None:
    """Wait (bounded) until the engine runs and queues nothing: a request the test before aborted may still count as
    running for a moment after its answer, and ``until_running`` would take it for the one this test starts next."""
    end = time.monotonic() + seconds
    while any(rank["num_running_reqs"] or rank["num_waiting_reqs"] for rank in client.loads()["loads"]):
        assert time.monotonic() < end, "the engine never became idle"
        time.sleep(0.02)


def until_running(client: SGLangClient, seconds: float = 15.0) -> None:
    """Wait (bounded) until the engine runs a request: a generation thread started just before may still be on its way."""
    end = time.monotonic() + seconds
    while not any(rank["num_running_reqs"] for rank in client.loads()["loads"]):
        assert time.monotonic() < end, "the generation never started running"
        time.sleep(0.02)


def test_flush_cache_waits_for_idle_within_deadline(fleet1: EmulatedFleet) -> None:
    """flush_cache keeps asking while requests run, passing SGLang's ?timeout=, and succeeds once idle."""
    client = SGLangClient(fleet1.urls[0], policies=FAST_SGLANG, flush_poll_s=0.05)
    until_idle(client)
    t = threading.Thread(target=lambda: client.generate("long", sampling_params={"max_new_tokens": 1000}))
    t.start()
    until_running(client)
    result = client.flush_cache(deadline_s=10)
    t.join(10)
    assert result.message.startswith("Cache flushed")
    flushes = [c for c in fleet1.engines[0].record()["calls"] if c["path"] == "/flush_cache"]
    assert flushes and all("timeout=" in c["query"] for c in flushes)


def test_flush_cache_gives_up_at_deadline_naming_engine(fleet1: EmulatedFleet) -> None:
    """A flush that never sees idle ends at its deadline with an error naming engine and endpoint."""
    client = SGLangClient(fleet1.urls[0], policies=FAST_SGLANG, flush_poll_s=0.05)
    until_idle(client)
    t = threading.Thread(target=lambda: client.generate("longer", sampling_params={"max_new_tokens": 2000}))
    t.start()
    until_running(client)
    with pytest.raises(SGLangError) as info:
        client.flush_cache(deadline_s=1.5)
    assert client.engine in str(info.value) and "POST /flush_cache" in str(info.value) and "400" in str(info.value)
    client.abort_request(abort_all=True)
    t.join(10)


class StalledBetweenPolls(SGLangClient):
    """A client whose thread stalls a whole second after each "not idle" answer, as on an overloaded machine."""

    def _pause_between_polls(self, seconds: float) -> None:
        time.sleep(seconds + 1.0)


def test_flush_stalled_past_its_deadline_still_says_not_idle(fleet1: EmulatedFleet) -> None:
    """The deadline ending during the pause between polls gives the "still not idle" error, the deadline as its cause."""
    client = StalledBetweenPolls(fleet1.urls[0], policies=FAST_SGLANG, flush_poll_s=0.05)
    before = len([c for c in fleet1.engines[0].record()["calls"] if c["path"] == "/flush_cache"])
    until_idle(client)
    t = threading.Thread(target=lambda: client.generate("longer", sampling_params={"max_new_tokens": 2000}))
    t.start()
    until_running(client)
    with pytest.raises(SGLangError) as info:
        client.flush_cache(deadline_s=0.5, wait_for_idle=False)
    client.abort_request(abort_all=True)
    t.join(10)
    assert "HTTP 400" in str(info.value) and "still not idle after 1 tries" in str(info.value)
    assert isinstance(info.value.__cause__, DeadlineExceeded)
    flushes = [c for c in fleet1.engines[0].record()["calls"] if c["path"] == "/flush_cache"]
    assert len(flushes) - before == 1  # nothing sent once the deadline had passed


def test_typed_reads_and_weight_version(fleet1: EmulatedFleet) -> None:
    """Reads come back typed; the weight version follows update_weight_version."""
    client = SGLangClient(fleet1.urls[0], policies=FAST_SGLANG)
    assert client.health().healthy and client.ready()
    assert client.models()
    assert "num_running_reqs" in str(client.loads())
    client.update_weight_version("v2")
    assert client.model_info().weight_version == "v2"
    assert "version" in client.server_info()


def test_weight_update_session_errors_are_clear(fleet1: EmulatedFleet) -> None:
    """end_weight_update without a session is refused with the engine, endpoint and SGLang's message."""
    client = SGLangClient(fleet1.urls[0], policies=FAST_SGLANG)
    with pytest.raises(SGLangError) as info:
        client.end_weight_update()
    assert "POST /end_weight_update" in str(info.value) and client.engine in str(info.value)
    records = attempts_of(info.value)  # the refusal's delivery record: answered 400, so it reached the engine
    assert records and (records[-1].delivery, records[-1].status) == (Delivery.RESPONDED, 400)
    assert client.begin_weight_update().success
    assert client.end_weight_update().success


def test_update_weight_version_leaves_running_requests_alone_unless_asked(fleet1: EmulatedFleet) -> None:
    """miles #2589: SGLang 0.5.23 aborts every running request on /update_weight_version by default (io_struct.py
    l.2159, http_server.py l.1533); the client sends ``abort_all_requests: false`` unless the caller asks for true."""
    client = SGLangClient(fleet1.urls[0], policies=FAST_SGLANG)
    out: list[GenerateResult] = []
    until_idle(client)
    t = threading.Thread(target=lambda: out.append(client.generate("x", sampling_params={"max_new_tokens": 2000})))
    t.start()
    until_running(client)
    assert client.update_weight_version("v3").success
    assert any(rank["num_running_reqs"] for rank in client.loads()["loads"]) and not out  # still generating
    sent = [c for c in fleet1.engines[0].record()["calls"] if c["path"] == "/update_weight_version"]
    assert sent[-1]["body"]["abort_all_requests"] is False
    assert client.update_weight_version("v4", abort_all_requests=True).success
    t.join(10)
    assert len(out) == 1 and out[0].aborted
    assert client.model_info().weight_version == "v4"


def test_a_weight_update_into_released_weights_is_refused_unsent(fleet1: EmulatedFleet) -> None:
    """smg #2529 / vLLM #57853: a weight load into freed weights kills the engine (SGLang 0.5.23's weight_updater.py
    never looks at offload_tags). After its own release the client refuses every weight route unsent, naming the engine
    and the state; a resume of the weights lifts it. The same request sent bare kills the emulated engine."""
    url = fleet1.urls[0]
    client = SGLangClient(url, policies=FAST_SGLANG)
    client.pause_generation("retract")
    client.release_memory_occupation(["weights"])
    refused = [
        lambda: client.update_weights_from_disk("emulated/sglang-model"),
        lambda: client.update_weights_from_tensor(["t"]),
        lambda: client.update_weights_from_distributed(["w"], ["bfloat16"], [[1]]),
        client.begin_weight_update,
        client.end_weight_update,
    ]
    for call in refused:
        with pytest.raises(SGLangWeightsReleased) as info:
            call()
        assert client.engine in str(info.value) and "weights are released" in str(info.value) and info.value.status is None
        assert isinstance(info.value, SGLangError) and attempts_of(info.value)[0].delivery is Delivery.NOT_SENT  # type: ignore[index]
    weight_paths = {"/update_weights_from_disk", "/update_weights_from_tensor", "/update_weights_from_distributed"}
    assert not [c for c in fleet1.engines[0].record()["calls"] if c["path"] in weight_paths | {"/begin_weight_update"}]
    assert fleet1.engines[0].alive() and client.update_weight_version("label-only").success  # no weights touched: sent
    client.resume_memory_occupation(["weights"])
    assert client.update_weights_from_disk("emulated/sglang-model", weight_version="v5").success
    client.release_memory_occupation(["weights"])
    with pytest.raises(requests.ConnectionError):
        requests.post(f"{url}/update_weights_from_disk", json={"model_path": "emulated/sglang-model"}, timeout=10)
    assert wait_dead(fleet1)  # what the client kept away: the scheduler wrote into the freed weights


def test_paused_engine_health_reports_paused_by_us(fleet1: EmulatedFleet) -> None:
    """After our pause, health() answers 'paused by us' at once instead of hanging on /health."""
    client = SGLangClient(fleet1.urls[0], policies=FAST_SGLANG)
    client.pause_generation("retract")
    t0 = time.monotonic()
    health = client.health()
    assert health.paused_by_us and time.monotonic() - t0 < 0.5
    client.continue_generation()
    assert not client.health().paused_by_us


def test_aborted_generation_is_reported(fleet1: EmulatedFleet) -> None:
    """A pause in abort mode answers in-flight generation with finish_reason abort."""
    client = SGLangClient(fleet1.urls[0], policies=FAST_SGLANG)
    out: list[object] = []
    until_idle(client)
    t = threading.Thread(target=lambda: out.append(client.generate("x", sampling_params={"max_new_tokens": 2000})))
    t.start()
    until_running(client)
    SGLangClient(fleet1.urls[0], policies=FAST_SGLANG).pause_generation("abort")
    t.join(10)
    assert len(out) == 1 and out[0].aborted  # type: ignore[attr-defined]


def test_malformed_answer_shows_endpoint_status_and_excerpt(httpserver: HTTPServer) -> None:
    """A 200 that is not JSON raises SGLangProtocolError naming endpoint, status and a body excerpt."""
    httpserver.expect_request("/model_info").respond_with_data("<html>gateway page</html>", status=200)
    client = SGLangClient(httpserver.url_for("/").rstrip("/"), policies=FAST_SGLANG)
    with pytest.raises(SGLangProtocolError) as info:
        client.model_info()
    text = str(info.value)
    assert "GET /model_info" in text and "HTTP 200" in text and "not JSON" in text
    assert "gateway page" in text
    assert [(r.delivery, r.status) for r in attempts_of(info.value) or ()] == [(Delivery.RESPONDED, 200)]


def test_errors_over_a_plain_session_carry_a_record_too(httpserver: HTTPServer) -> None:
    """A session without the resilience layer records nothing; the client writes the one answered attempt itself.

    That one attempt got a gateway status, so the client checks ``GET /model_info`` (the dead-behind-a-proxy
    check); the engine answers it, and the 503's own error stands, with its record.
    """
    httpserver.expect_request("/pause_generation").respond_with_data("busy", status=503)
    httpserver.expect_request("/model_info").respond_with_json({"model_path": "m"})
    with requests.Session() as session:
        client = SGLangClient(httpserver.url_for("/").rstrip("/"), session=session)
        with pytest.raises(SGLangError) as info:
            client.pause_generation()
    assert type(info.value) is SGLangError and info.value.status == 503
    assert [(r.attempt, r.delivery, r.status) for r in attempts_of(info.value) or ()] == [(0, Delivery.RESPONDED, 503)]
    assert [request.path for request, _ in httpserver.log] == ["/pause_generation", "/model_info"]


def test_api_key_in_bearer_header_only(httpserver: HTTPServer) -> None:
    """The API key travels as a Bearer header and is absent from repr and errors."""
    httpserver.expect_request("/pause_generation", headers={"Authorization": "Bearer sk-SECRET-1"}).respond_with_data("bad", status=400)
    client = SGLangClient(httpserver.url_for("/").rstrip("/"), api_key="sk-SECRET-1", policies=FAST_SGLANG)
    with pytest.raises(SGLangError) as info:
        client.pause_generation()
    assert "sk-SECRET-1" not in repr(client) and "sk-SECRET-1" not in str(info.value)
    assert len(httpserver.log) == 1


def test_mount_sglang_on_existing_session(httpserver: HTTPServer) -> None:
    """mount_sglang gives a session existing code already uses the SGLang policies: its 502 is absorbed."""
    httpserver.expect_ordered_request("/continue_generation").respond_with_data("", status=502)
    httpserver.expect_ordered_request("/continue_generation").respond_with_json({"status": "ok"})
    session = requests.Session()
    base = httpserver.url_for("/").rstrip("/")
    mount_sglang(session, [base], policies=FAST_SGLANG)
    assert session.post(f"{base}/continue_generation", json={}).status_code == 200


def test_default_policies_encode_endpoint_safety() -> None:
    """SGLANG_POLICIES: control calls idempotent; release/resume/generate not, release/resume retry gateway statuses."""
    m = SGLANG_POLICIES.match
    for path in ("/pause_generation", "/continue_generation", "/flush_cache", "/abort_request", "/update_weight_version"):
        assert m("POST", path).policy.idempotent, path
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        p = m("POST", path).policy
        assert not p.idempotent and p.retry_statuses_if_not_idempotent and p.on_ambiguous == "raise"
    gen = m("POST", "/generate").policy
    assert not gen.idempotent and not gen.retry_statuses_if_not_idempotent
    assert m("GET", "/health").policy.idempotent
