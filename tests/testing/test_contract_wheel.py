"""Contract: emulator, client and policies against SGLang 0.5.23's source, read by AST from the pinned wheel.

Needs no GPU stack and imports nothing of sglang. The wheel comes from the cache
(``~/.cache/cpr/wheels`` or ``$CPR_WHEEL_CACHE``; ``$CPR_SGLANG_WHEEL`` names one file) or
from ``pip download --no-deps``; without it the module skips, and fails when ``CI=true``.
The doctored-input tests show that each comparison can fail.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("torch")

from fastapi import APIRouter, FastAPI

from resilience.adapters.sglang import SGLANG_ADMIN_PATHS, SGLANG_OPEN_PREFIXES, SGLANG_POLICIES
from resilience.testing.emulator import EngineConfig
from resilience.testing.emulator.app import create_app
from resilience.testing.emulator.routes import iter_routes
from tests.conftest import free_port
from tests.testing.engine_wheel import WheelUnavailable, find_wheel
from tests.testing.sglang_contract import (
    EmulatorRoute,
    check,
    client_endpoints,
    compare_bodies,
    compare_client,
    compare_routes,
    emulator_routes,
)
from tests.testing.sglang_source import SglangSurface, SourceField, read_surface


@pytest.fixture(scope="module")
def wheel() -> Path:
    try:
        return find_wheel()
    except WheelUnavailable as exc:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"the sglang wheel is required on CI: {exc}")
        pytest.skip(f"sglang wheel unavailable: {exc}")


@pytest.fixture(scope="module")
def surface(wheel: Path) -> SglangSurface:
    return read_surface(wheel)


@pytest.fixture(scope="module")
def emulator() -> Iterator[dict[str, EmulatorRoute]]:
    yield emulator_routes(create_app(EngineConfig())[0])


def test_wheel_source_reads_a_plausible_surface(surface: SglangSurface) -> None:
    """The AST reading finds SGLang 0.5.23's routes, levels, bodies, query defaults and open prefixes."""
    assert surface.version == "0.5.23"
    assert len(surface.routes) >= 60 and len(surface.structs) >= 80 and surface.unresolved_paths <= 3
    flush = surface.routes["/flush_cache"]
    assert (flush.methods, flush.auth, dict(flush.query)) == (frozenset({"GET", "POST"}), "admin_optional", {"timeout": 0.0})
    assert surface.routes["/pause_generation"].body == "PauseGenerationReqInput"
    assert surface.routes["/v1/loads"].methods == frozenset({"GET"})  # from the included router
    assert surface.routes["/generate"].auth == "normal" and surface.routes["/health"].auth == "normal"
    assert surface.structs["PauseGenerationReqInput"]["mode"] == SourceField("mode", "abort")
    assert surface.open_prefixes == ("/health", "/ready", "/metrics")
    for gone in ("/get_load", "/get_weight_version", "/weight_version"):
        assert gone not in surface.routes


def test_emulator_routes_methods_and_auth_match_sglang(surface: SglangSurface, emulator: dict[str, EmulatorRoute]) -> None:
    """Every emulator route exists in SGLang with the same methods, auth level and query defaults."""
    assert len(emulator) >= 20 and {"/flush_cache", "/generate", "/v1/loads"} <= set(emulator)
    assert compare_routes(surface, emulator) == []


def test_emulator_bodies_match_sglang_fields_and_defaults(surface: SglangSurface, emulator: dict[str, EmulatorRoute]) -> None:
    """Each emulator body has SGLang's fields, required fields and defaults (``/generate``: a subset)."""
    bodies = [r for r in emulator.values() if r.body is not None]
    assert len(bodies) >= 12
    assert compare_bodies(surface, emulator) == []


def test_client_calls_and_policies_exist_on_both_servers(surface: SglangSurface, emulator: dict[str, EmulatorRoute]) -> None:
    """Every call SGLangClient makes, every policy entry and the client's key rules agree with SGLang and the emulator."""
    calls = client_endpoints()
    assert len(calls) >= 15 and ("POST", "/flush_cache") in calls and ("GET", "/v1/loads") in calls
    assert len(SGLANG_POLICIES.entries) >= 15 and len(SGLANG_ADMIN_PATHS) >= 10
    assert compare_client(surface, emulator, calls, SGLANG_POLICIES.entries, SGLANG_ADMIN_PATHS, SGLANG_OPEN_PREFIXES) == []


def test_check_runs_every_comparison_on_the_wheel(wheel: Path) -> None:
    """The one-call check sizes every set it compares and finds no difference."""
    report = check(wheel)
    assert report.engine_version == "0.5.23" and report.problems == ()
    assert report.sizes["sglang_routes"] >= 60 and report.sizes["emulator_routes"] >= 20 and report.sizes["client_endpoints"] >= 15


def test_doctored_emulator_routes_fail(surface: SglangSurface, emulator: dict[str, EmulatorRoute]) -> None:
    """A route SGLang lacks, a missing method, a wrong auth level and a wrong query default are each reported."""
    doctored = dict(emulator)
    doctored["/get_load"] = EmulatorRoute("/get_load", frozenset({"GET"}), "normal")
    doctored["/flush_cache"] = dataclasses.replace(emulator["/flush_cache"], methods=frozenset({"POST"}), query={"timeout": 30.0})
    doctored["/pause_generation"] = dataclasses.replace(emulator["/pause_generation"], auth="normal")
    problems = compare_routes(surface, doctored)
    assert len(problems) == 4, problems
    joined = "\n".join(problems)
    for needle in ("/get_load", "methods ['POST']", "auth level normal", "'timeout' defaults to 30.0"):
        assert needle in joined


def test_doctored_sglang_fields_fail(surface: SglangSurface, emulator: dict[str, EmulatorRoute]) -> None:
    """A changed default and a new SGLang field on a body the emulator models are each reported."""
    structs = dict(surface.structs)
    pause = dict(structs["PauseGenerationReqInput"])
    pause["mode"] = SourceField("mode", "retract")
    pause["new_knob"] = SourceField("new_knob", 3)
    structs["PauseGenerationReqInput"] = pause
    problems = compare_bodies(dataclasses.replace(surface, structs=structs), emulator)
    assert len(problems) == 2, problems
    assert "'mode' defaults to 'abort' in the emulator, 'retract' in SGLang" in problems[1] and "new_knob" in problems[0]


def test_doctored_client_fails(surface: SglangSurface, emulator: dict[str, EmulatorRoute]) -> None:
    """A call to a route SGLang lacks, a policy for one, and an admin route sent the API key are each reported."""
    calls = client_endpoints() | {("GET", "/get_weight_version")}
    policies = [*SGLANG_POLICIES.entries, "GET /get_load"]
    admin = SGLANG_ADMIN_PATHS - {"/flush_cache"}
    problems = compare_client(surface, emulator, calls, policies, admin, SGLANG_OPEN_PREFIXES)
    joined = "\n".join(problems)
    assert len(problems) == 4, problems
    assert "/get_weight_version: SGLang" in joined and "the emulator does not serve it" in joined
    assert "'GET /get_load'" in joined and "API key to /flush_cache" in joined


def test_included_routes_are_read_through_original_router() -> None:
    """Routes added with include_router are found (FastAPI 0.1xx hides them from a flat read of app.routes)."""
    router = APIRouter()

    @router.get("/inside")
    async def inside() -> None:
        return None

    app = FastAPI()
    app.include_router(router, prefix="/pre")
    found = {(r.path, tuple(r.methods)) for r in iter_routes(app.routes)}
    assert ("/pre/inside", ("GET",)) in found


def test_find_wheel_names_what_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No cached wheel and an index that refuses: WheelUnavailable says pip download gave nothing and why."""
    monkeypatch.delenv("CPR_SGLANG_WHEEL", raising=False)
    with pytest.raises(WheelUnavailable, match=r"pip download sglang==0\.5\.23 into .* gave no wheel"):
        find_wheel(cache_dir=tmp_path / "empty", index_url=f"http://127.0.0.1:{free_port()}/simple")
    with pytest.raises(WheelUnavailable, match="downloading is off"):
        find_wheel(cache_dir=tmp_path / "empty", download=False)
