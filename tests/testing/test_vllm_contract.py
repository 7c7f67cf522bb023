"""Contract: the vLLM emulator against vLLM 0.33.0's dev and RL routers, read by AST from the pinned wheel.

Needs no GPU stack and imports nothing of vllm. The wheel (~336 MB) comes from the cache
(``~/.cache/cpr/wheels`` or ``$CPR_WHEEL_CACHE``; ``$CPR_VLLM_WHEEL`` names one file). It is
downloaded (``pip download --no-deps``) when ``CI=true`` or ``CPR_FETCH_VLLM_WHEEL=1``; a plain
local run without the cache skips the wheel tests and names ``scripts/vllm_contract.sh``,
which fetches it and runs this module. On CI a missing wheel fails. The doctored-input tests
show that each comparison can fail.
"""

from __future__ import annotations

import dataclasses
import os
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from resilience.testing.emulator.auth import GUARDED_PREFIX
from resilience.testing.emulator.vllm import VLLM_VERSION, VLLMEngineConfig
from resilience.testing.emulator.vllm.app import create_app
from tests.conftest import free_port
from tests.testing.engine_wheel import WheelUnavailable, find_wheel
from tests.testing.vllm_contract import (
    DEV_MODE_READER,
    app_paths,
    check,
    compare_bodies,
    compare_fault_tolerance,
    compare_mounting,
    compare_params,
    compare_routes,
    compare_serve_routes,
    emulator_control_routes,
    emulator_fault_tolerance_routes,
)
from tests.testing.vllm_source import HAND, REQUIRED, Param, RouteSpec, VllmSurface, read_vllm_surface, routes_in_source

SLEEP_ROUTER = "vllm/entrypoints/serve/dev/sleep/api_router.py"


def _fetching() -> bool:
    return os.environ.get("CI", "").lower() == "true" or os.environ.get("CPR_FETCH_VLLM_WHEEL") == "1"


@pytest.fixture(scope="module")
def wheel() -> Path:
    try:
        return find_wheel(VLLM_VERSION, package="vllm", download=_fetching())
    except WheelUnavailable as exc:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"the vllm wheel is required on CI: {exc}")
        pytest.skip(f"vllm wheel unavailable ({exc}); scripts/vllm_contract.sh fetches it and runs this check")


@pytest.fixture(scope="module")
def surface(wheel: Path) -> VllmSurface:
    return read_vllm_surface(wheel)


@pytest.fixture(scope="module")
def ours() -> dict[str, RouteSpec]:
    return emulator_control_routes()


@pytest.fixture(scope="module")
def paths() -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    return app_paths(create_app(VLLMEngineConfig(dev_mode=True))[0]), app_paths(create_app(VLLMEngineConfig(dev_mode=False))[0])


def test_the_emulators_own_routes_read_by_ast_match_what_its_app_mounts(
    ours: dict[str, RouteSpec], paths: tuple[set[tuple[str, str]], set[tuple[str, str]]]
) -> None:
    """Without the wheel: the AST reading of dev_routes.py and rl_routes.py is what the dev-mode app serves."""
    assert 20 <= len(ours) <= 40
    dev, plain = paths
    assert {(m, r.path) for r in ours.values() for m in r.methods} <= dev
    assert not {(m, r.path) for r in ours.values() for m in r.methods} & plain
    sleep = ours["/sleep"].params
    assert sleep["level"] == Param("level", "query", "int", 1, (("ge", 0), ("le", 2)))
    assert ours["/wake_up"].params["tags"] == Param("tags", "query-hand", "getlist", HAND)
    assert ours["/update_weights"].params["update_info"] == Param("update_info", "body", "WeightTransferUpdatePayload", REQUIRED)


def test_wheel_source_reads_a_plausible_surface(surface: VllmSurface) -> None:
    """The AST reading follows vLLM's registries to its 5 router modules and finds 0.33.0's routes, parameters and answers."""
    assert surface.version == "0.33.0"
    assert len(surface.control_modules) == 5 and SLEEP_ROUTER in surface.control_modules
    assert 20 <= len(surface.control) <= 40 and len(surface.all_routes) >= 50
    sleep = surface.control["/sleep"]
    assert sleep.methods == frozenset({"POST"}) and sleep.params["mode"] == Param("mode", "query", "PauseMode", "abort")
    assert sleep.bodies == frozenset({(("level", "*"), ("status", "sleeping"))})
    assert surface.control["/wake_up"].bodies == frozenset({(("status", "awake|sleeping"), ("tags", "*"))})
    assert surface.control["/pause"].params["clear_cache"] == Param("clear_cache", "query", "bool", True)
    assert surface.control["/finish_weight_update"].params["weight_version"] == Param("weight_version", "body", "str | None", None)
    assert surface.control["/collective_rpc"].params["args"] == Param("args", "json", "", [])
    assert surface.dev_mode_env == DEV_MODE_READER
    assert {"register_vllm_dev_api_routers", "register_rl_api_routers"} <= surface.dev_mode_gated
    assert surface.guarded_prefix == ("/v1", "/v2", "/inference", "/cohere")
    for gone in ("/pause_generation", "/update_weights_from_tensor"):  # SGLang's names, never vLLM's
        assert gone not in surface.all_routes


def test_check_runs_every_comparison_on_the_wheel(wheel: Path) -> None:
    """The one-call check sizes every set it compares and finds no difference."""
    report = check(wheel)
    assert report.engine_version == "0.33.0" and report.problems == ()
    assert report.sizes["vllm_control_routes"] == report.sizes["emulator_control_routes"] >= 20
    assert report.sizes["vllm_params"] >= 12 and report.sizes["emulator_bodies"] >= report.sizes["vllm_control_routes"]


def test_routes_compare_in_both_directions(surface: VllmSurface, ours: dict[str, RouteSpec]) -> None:
    """A route vLLM lacks, a route the emulator lacks and a changed method are each reported."""
    assert compare_routes(surface.control, ours) == []
    doctored = dict(ours)
    doctored["/pause_generation"] = RouteSpec("/pause_generation", frozenset({"POST"}), "pause_generation")
    del doctored["/start_draft_weight_update"]
    doctored["/is_paused"] = dataclasses.replace(ours["/is_paused"], methods=frozenset({"POST"}))
    problems = compare_routes(surface.control, doctored)
    assert len(problems) == 3, problems
    joined = "\n".join(problems)
    for needle in ("/pause_generation: the emulator serves it", "/start_draft_weight_update: vLLM 0.33.0 has it", "methods ['POST']"):
        assert needle in joined


def test_params_compare_in_both_directions(surface: VllmSurface, ours: dict[str, RouteSpec]) -> None:
    """An extra, a missing, a re-bound, a re-typed, a re-defaulted and a re-constrained parameter are each reported."""
    assert compare_params(surface.control, ours) == []
    doctored = dict(ours)
    sleep = dict(ours["/sleep"].params)
    sleep["level"] = dataclasses.replace(sleep["level"], constraints=(("ge", 0), ("le", 3)))
    sleep["mode"] = dataclasses.replace(sleep["mode"], default="wait")
    doctored["/sleep"] = dataclasses.replace(ours["/sleep"], params=sleep)
    pause = dict(ours["/pause"].params)
    pause["wait_for_inflight_requests"] = Param("wait_for_inflight_requests", "query", "bool", False)  # gone in 0.33.0
    pause["clear_cache"] = dataclasses.replace(pause["clear_cache"], where="body")
    doctored["/pause"] = dataclasses.replace(ours["/pause"], params=pause)
    finish = {"weight_version": dataclasses.replace(ours["/finish_weight_update"].params["weight_version"], annotation="str")}
    doctored["/finish_weight_update"] = dataclasses.replace(ours["/finish_weight_update"], params=finish)
    doctored["/abort_requests"] = dataclasses.replace(ours["/abort_requests"], params={})
    problems = compare_params(surface.control, doctored)
    joined = "\n".join(problems)
    assert len(problems) == 6, problems
    for needle in (
        "('le', 3)",
        "'mode' default 'wait'",
        "'wait_for_inflight_requests' only in the emulator",
        "where 'body'",
        "annotation 'str'",
        "'request_ids' (json) only in vLLM",
    ):
        assert needle in joined


def test_bodies_compare_in_both_directions(surface: VllmSurface, ours: dict[str, RouteSpec]) -> None:
    """An answer vLLM never gives and a vLLM answer the emulator lacks are reported; vLLM's error answers may be left out."""
    assert compare_bodies(surface.control, ours) == []
    doctored = dict(ours)
    doctored["/sleep"] = dataclasses.replace(ours["/sleep"], bodies=frozenset({(("status", "asleep"),)}))
    doctored["/weight_checker"] = dataclasses.replace(
        ours["/weight_checker"], bodies=ours["/weight_checker"].bodies - {(("status", "reset"),)}
    )
    problems = compare_bodies(surface.control, doctored)
    joined = "\n".join(problems)
    assert len(problems) == 3, problems  # /sleep: one extra, one missing; /weight_checker: one missing
    assert "{'status': 'asleep'}, vLLM never does" in joined and "{'status': 'reset'}, the emulator never does" in joined
    assert not any("{'error'" in p for p in problems)  # /pause's defensive 500 body is not required
    assert compare_bodies(surface.control, ours, unreachable=()) == ["route /collective_rpc: vLLM answers {}, the emulator never does"]


def test_mounting_and_serve_routes_compare(
    surface: VllmSurface, ours: dict[str, RouteSpec], paths: tuple[set[tuple[str, str]], set[tuple[str, str]]]
) -> None:
    """A missing gate, another env reader, control routes without dev mode, a changed method and other key prefixes are reported."""
    dev, plain = paths
    assert compare_mounting(surface, ours, dev, plain) == []
    assert compare_serve_routes(surface, dev, GUARDED_PREFIX) == []
    doctored = dataclasses.replace(
        surface, dev_mode_gated=frozenset({"register_vllm_dev_api_routers"}), dev_mode_env='"VLLM_SERVER_DEV_MODE": lambda: True,'
    )
    problems = compare_mounting(doctored, ours, dev - {("GET", "/is_paused")}, plain | {("POST", "/sleep")})
    joined = "\n".join(problems)
    assert len(problems) == 4, problems
    for needle in (
        "register_rl_api_routers",
        "reads VLLM_SERVER_DEV_MODE as",
        "does not serve GET /is_paused",
        "dev mode off: the emulator's app serves POST /sleep",
    ):
        assert needle in joined
    served = (dev - {("GET", "/health")}) | {("POST", "/health")}
    problems = compare_serve_routes(surface, served, ("/v1",))
    assert len(problems) == 2 and "route /health: methods ['POST']" in problems[0] and "--api-key guards ('/v1',)" in problems[1]


def test_the_fault_tolerance_routes_compare_and_mount_only_with_the_flag(surface: VllmSurface) -> None:
    """0.33.0 has POST /fault_tolerance/apply and GET /fault_tolerance/status (serve/fault_tolerance/api_router.py), mounted
    under ``enable_fault_tolerance`` (launchers/api_server/routers.py l.85-90): the emulator's match them, mounted only with
    ``enable_fault_tolerance``; a doctored side, and an emulator that mounts them always, are each reported."""
    ours = emulator_fault_tolerance_routes()
    assert set(surface.fault_tolerance) == set(ours) == {"/fault_tolerance/apply", "/fault_tolerance/status"}
    assert "register_fault_tolerance_api_router" in surface.fault_tolerance_gated
    accepted = (("message", "Request accepted; poll /fault_tolerance/status for updates."), ("request_id", "*"))
    assert surface.fault_tolerance["/fault_tolerance/apply"].bodies == frozenset({accepted})
    on = app_paths(create_app(VLLMEngineConfig(dev_mode=False, enable_fault_tolerance=True))[0])
    off = app_paths(create_app(VLLMEngineConfig(dev_mode=True))[0])
    assert compare_fault_tolerance(surface, ours, on, off) == []
    doctored = {"/fault_tolerance/apply": dataclasses.replace(ours["/fault_tolerance/apply"], bodies=frozenset({(("status", "ok"),)}))}
    problems = compare_fault_tolerance(surface, doctored, on, on)
    assert any("/fault_tolerance/status: vLLM 0.33.0 has it" in p for p in problems)
    assert any("the emulator answers {'status': 'ok'}, vLLM never does" in p for p in problems)
    assert any("fault tolerance off: the emulator's app serves POST /fault_tolerance/apply" in p for p in problems)
    ungated = dataclasses.replace(surface, fault_tolerance_gated=frozenset())
    assert any("enable_fault_tolerance" in p for p in compare_fault_tolerance(ungated, ours, on, off))


def test_a_doctored_vllm_source_fails_the_check(wheel: Path, ours: dict[str, RouteSpec]) -> None:
    """The same reader over an edited copy of vLLM's sleep router (level up to 3, a new query parameter) finds both edits."""
    with zipfile.ZipFile(wheel) as archive:
        text = archive.read(SLEEP_ROUTER).decode("utf-8")
    assert "Query(ge=0, le=2)" in text
    edited = text.replace("Query(ge=0, le=2)", "Query(ge=0, le=3)").replace(
        'mode: Annotated[PauseMode, Query()] = "abort",',
        'mode: Annotated[PauseMode, Query()] = "abort",\n    drain: bool = Query(default=False),',
    )
    theirs = routes_in_source(edited, SLEEP_ROUTER)
    problems = compare_params(theirs, {p: ours[p] for p in theirs})
    assert len(problems) == 2, problems
    assert "'drain' (query) only in vLLM" in problems[0] and "('le', 3)" in problems[1]


def test_find_wheel_for_vllm_names_what_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No cached vllm wheel and an index that refuses: WheelUnavailable names the package and why."""
    monkeypatch.delenv("CPR_VLLM_WHEEL", raising=False)
    with pytest.raises(WheelUnavailable, match=r"pip download vllm==0\.33\.0 into .* gave no wheel"):
        find_wheel(VLLM_VERSION, cache_dir=tmp_path / "empty", index_url=f"http://127.0.0.1:{free_port()}/simple", package="vllm")
    with pytest.raises(WheelUnavailable, match=r"no vllm-0\.33\.0 wheel in .* and downloading is off"):
        find_wheel(VLLM_VERSION, cache_dir=tmp_path / "empty", download=False, package="vllm")
    monkeypatch.setenv("CPR_VLLM_WHEEL", str(tmp_path / "missing.whl"))
    with pytest.raises(WheelUnavailable, match="CPR_VLLM_WHEEL="):
        find_wheel(VLLM_VERSION, package="vllm")
