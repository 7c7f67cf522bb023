"""``GET /version`` picks the API a request is built for; a release outside the range, or without the route, is refused unsent.

These drive the sans-IO builders (``resilience.adapters.vllm.calls``) with a hand-made ``VLLMApi``: no server is needed to say
what a request for 0.14.0 looks like. Over HTTP, the emulator speaks 0.33.0 (``test_client_http.py``).
"""

from __future__ import annotations

import pytest

from resilience.adapters.engine_http import Answer
from resilience.adapters.vllm import VLLMApi, VLLMPauseMode, VLLMProtocolError, VLLMVersionError, calls
from resilience.adapters.vllm.answers import Plan, gate
from resilience.adapters.vllm.versions import parse_version

ENGINE = "http://127.0.0.1:8000"
V012, V014, V017, V020, V023, V030, V033 = (VLLMApi.of(v) for v in ("0.12.0", "0.14.0", "0.17.0", "0.20.0", "0.23.0", "0.30.0", "0.33.0"))


@pytest.mark.parametrize(
    ("text", "parsed"),
    [("0.33.0", (0, 33, 0)), ("0.33.1.dev4+g12ab", (0, 33, 1)), ("v0.17.0rc1", (0, 17, 0)), ("0.8", (0, 8, 0)), ("dev", None), ("", None)],
)
def test_versions_parse_to_their_release(text: str, parsed: tuple[int, int, int] | None) -> None:
    """A dev or rc build counts as the release it leads to; text naming no release parses to None."""
    assert parse_version(text) == parsed


@pytest.mark.parametrize("text", ["0.8.5", "0.11.9", "0.34.0", "0.34.0rc1", "1.0.0"])
def test_a_release_outside_the_range_is_named_in_the_error(text: str) -> None:
    """0.12.0 to 0.33.x are spoken; anything else raises before sending, naming the release and the range."""
    with pytest.raises(VLLMVersionError) as err:
        gate(ENGINE, calls.sleep().route, VLLMApi.of(text))
    assert text in str(err.value)
    assert "0.12.0 to 0.33.x" in str(err.value)
    assert "POST /sleep not sent" in str(err.value)


def test_every_033_patch_is_supported() -> None:
    """0.33.x patches speak 0.33.0's API."""
    assert VLLMApi.of("0.33.7").supported and VLLMApi.of("0.33.7").json_sleep_bodies


@pytest.mark.parametrize(
    ("plan", "api", "added"),
    [
        (calls.start_weight_update(), V020, "0.23.0"),
        (calls.finish_weight_update("v1"), V020, "0.23.0"),
        (calls.update_weights({"names": []}), V014, "0.17.0"),
        (calls.weight_info(), V023, "0.27.0"),
        (calls.weight_checker("checksum"), V030, "0.33.0"),
        (calls.release_kv_cache_memory(), V030, "0.33.0"),
    ],
)
def test_a_route_the_release_lacks_is_refused_unsent(plan: Plan[object], api: VLLMApi, added: str) -> None:
    """Weight-session routes since 0.23, weight-version routes since 0.27, 0.33's additions: older servers get a clear error."""
    with pytest.raises(VLLMVersionError, match=f"has no {plan.route.endpoint} \\(added in {added}\\)") as err:
        gate(ENGINE, plan.route, api)
    assert err.value.status is None and err.value.attempts == ()


def test_mode_parameters_exist_since_017() -> None:
    """``/sleep?mode=`` is sent from 0.17.0 on; asked of 0.14.0 it is refused (that release takes only the level and does not pause)."""
    plan = calls.sleep(2, "wait")
    assert plan.build(ENGINE, V017).params == (("level", "2"), ("mode", "wait"))
    assert calls.sleep(1).build(ENGINE, V014).params == (("level", "1"),)
    with pytest.raises(VLLMVersionError, match="takes no mode="):
        plan.build(ENGINE, V014)


@pytest.mark.parametrize(
    ("mode", "api", "params"),
    [
        ("abort", V033, (("mode", "abort"),)),
        ("keep", V030, (("mode", "keep"),)),
        ("wait", V014, (("wait_for_inflight_requests", "true"),)),
        ("abort", V012, (("wait_for_inflight_requests", "false"),)),
        (None, V033, ()),
    ],
)
def test_pause_speaks_each_release(mode: VLLMPauseMode | None, api: VLLMApi, params: tuple[tuple[str, str], ...]) -> None:
    """From 0.17 only ``mode`` (``wait_for_inflight_requests`` is gone in 0.33); before, the old flag; None sends the server's default."""
    assert calls.pause(mode).build(ENGINE, api).params == params


def test_keep_pause_needs_017() -> None:
    """0.12/0.14 have no ``keep``: refused, not silently turned into something else."""
    with pytest.raises(VLLMVersionError):
        calls.pause("keep").build(ENGINE, V014)


def test_sleep_and_wake_answers_are_json_in_033_and_empty_before() -> None:
    """An empty 200 is a success before 0.33.0 and a malformed answer in 0.33.0."""
    sleep = calls.sleep(1)
    empty = Answer("POST /sleep", 200, "")
    assert sleep.read(ENGINE, V030, empty).level == 1
    assert calls.wake_up(["weights"]).read(ENGINE, V030, Answer("POST /wake_up", 200, "")).awake is None
    with pytest.raises(VLLMProtocolError, match="not a JSON object"):
        sleep.read(ENGINE, V033, empty)


def test_wake_tags_are_repeated_query_parameters() -> None:
    """``/wake_up?tags=weights&tags=kv_cache``, as vLLM reads them (``getlist("tags")``); no tags = every tag."""
    assert calls.wake_up(["weights", "kv_cache"]).build(ENGINE, V033).params == (("tags", "weights"), ("tags", "kv_cache"))
    assert calls.wake_up().build(ENGINE, V033).params == ()
    with pytest.raises(TypeError, match="not one string"):
        calls.wake_up("weights")


@pytest.mark.parametrize("bad", [3, -1, True, "1"])
def test_a_bad_sleep_level_is_refused_before_anything_is_sent(bad: object) -> None:
    """Levels are 0, 1 or 2 (vLLM's ``Query(ge=0, le=2)``); the error names the value."""
    with pytest.raises(ValueError, match="sleep level must be 0, 1 or 2"):
        calls.sleep(bad)  # type: ignore[arg-type]
