"""The one route table pins both vLLM clients and the policy table: same methods, same signatures, real idempotence."""

from __future__ import annotations

import inspect

import pytest

from resilience.adapters.vllm import ROUTES, VLLM_POLICIES, AsyncVLLMClient, VLLMClient
from resilience.adapters.vllm.routes import CONTROL_ROUTES

_PLUMBING = {"close", "aclose", "api"}


def _route_methods(cls: type) -> dict[str, object]:
    return {name: fn for name, fn in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_") and name not in _PLUMBING}


@pytest.mark.parametrize("cls", [VLLMClient, AsyncVLLMClient])
def test_each_client_has_one_method_per_route(cls: type) -> None:
    """Each client's public methods are exactly the route table's names (nothing missing, nothing extra)."""
    assert set(_route_methods(cls)) == set(ROUTES)


def test_the_twins_agree_on_every_signature_and_docstring() -> None:
    """Sync and async methods of one route take the same parameters and say the same thing; the async ones are coroutines."""
    sync, asyn = _route_methods(VLLMClient), _route_methods(AsyncVLLMClient)
    assert len(sync) == len(ROUTES) >= 25
    for name in ROUTES:
        s, a = sync[name], asyn[name]
        assert inspect.iscoroutinefunction(a), name
        assert not inspect.iscoroutinefunction(s), name
        assert inspect.signature(s) == inspect.signature(a), name  # type: ignore[arg-type]
        if name != "health":
            assert inspect.getdoc(s) == inspect.getdoc(a), name


def test_the_policy_table_is_the_route_table() -> None:
    """VLLM_POLICIES has one entry per route, holding that route's policy."""
    assert set(VLLM_POLICIES.entries) == {r.endpoint for r in ROUTES.values()}
    for r in ROUTES.values():
        assert VLLM_POLICIES.match(r.method, r.path).policy == r.policy, r.endpoint


@pytest.mark.parametrize(
    "name",
    [
        "update_weights",
        "start_weight_update",
        "finish_weight_update",
        "init_weight_transfer_engine",
        "release_kv_cache_memory",
        "collective_rpc",
        "fault_tolerance_apply",
    ],
)
def test_calls_that_must_not_repeat_are_never_resent_once_they_may_have_arrived(name: str) -> None:
    """Not idempotent, and a gateway status is not a licence to re-send (prime-rl #3599: a re-sent /update_weights hung the run)."""
    policy = ROUTES[name].policy
    assert policy.idempotent is False
    assert policy.retry_statuses_if_not_idempotent is False
    assert policy.on_ambiguous == "raise"


@pytest.mark.parametrize("name", ["sleep", "wake_up", "pause", "resume", "reset_prefix_cache", "is_sleeping", "is_paused", "weight_info"])
def test_idempotent_vllm_routes_are_resent_on_gateway_statuses(name: str) -> None:
    """Sleep and wake are no-ops when repeated in vLLM (unlike SGLang's release), so they are re-sent after 502/503/504."""
    policy = ROUTES[name].policy
    assert policy.idempotent is True
    assert {502, 503, 504} <= policy.retry.statuses


def test_only_reset_prefix_cache_asks_again_after_success_false() -> None:
    """vLLM's docstring says "callers may retry" only for /reset_prefix_cache; every other success:false is raised at once."""
    assert [r.name for r in ROUTES.values() if r.refusals_retried] == ["reset_prefix_cache"]


def test_control_routes_are_the_dev_mode_routes_of_the_reference() -> None:
    """Every route the reference lists as dev-mode-only is marked so; the always-mounted ones are not."""
    assert {"/sleep", "/wake_up", "/pause", "/resume", "/update_weights", "/reset_prefix_cache", "/collective_rpc"} <= CONTROL_ROUTES
    assert not {"/health", "/version", "/v1/completions", "/v1/models"} & CONTROL_ROUTES
    assert len(CONTROL_ROUTES) == 23
