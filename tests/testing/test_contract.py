"""Contract: the emulator's routes and request fields against the real sglang (skipped unless sglang imports).

Run it in a separate venv (see README, "Checking the emulator against SGLang"):
torch 2.14.1 + torchvision 0.29.1 + ``sglang --no-deps`` and its pure-Python needs.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import pytest

from resilience.testing.emulator import EngineConfig

io_struct = pytest.importorskip("sglang.srt.managers.io_struct", reason="sglang is not importable here")

# emulator body model -> the sglang io_struct classes it stands for
_BODIES = {
    "PauseGenerationReqInput": ["PauseGenerationReqInput"],
    "ContinueGenerationReqInput": ["ContinueGenerationReqInput"],
    "MemoryOccupationReqInput": ["ReleaseMemoryOccupationReqInput", "ResumeMemoryOccupationReqInput"],
    "UpdateWeightsFromTensorReqInput": ["UpdateWeightsFromTensorReqInput"],
    "UpdateWeightsFromDistributedReqInput": ["UpdateWeightsFromDistributedReqInput"],
    "UpdateWeightFromDiskReqInput": ["UpdateWeightFromDiskReqInput"],
    "UpdateWeightVersionReqInput": ["UpdateWeightVersionReqInput"],
    "InitWeightsUpdateGroupReqInput": ["InitWeightsUpdateGroupReqInput"],
    "AbortReq": ["AbortReq"],
    "GenerateReqInput": ["GenerateReqInput"],
}


def field_names(cls: Any) -> set[str]:
    """Field names of a dataclass, msgspec Struct or pydantic model."""
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    for attr in ("__struct_fields__", "model_fields"):
        fields = getattr(cls, attr, None)
        if fields:
            return set(fields)
    names: set[str] = set()
    for klass in cls.__mro__:
        names.update(getattr(klass, "__annotations__", {}))
    return names


def routes(app: Any) -> set[tuple[str, str]]:
    return {(m, r.path) for r in app.routes for m in (getattr(r, "methods", None) or ())}


def test_emulator_routes_exist_in_sglang() -> None:
    """Every route the emulator serves (but its debug ones) exists in sglang's HTTP server with the same method."""
    from resilience.testing.emulator.app import create_app

    http_server = importlib.import_module("sglang.srt.entrypoints.http_server")
    ours = {(m, p) for m, p in routes(create_app(EngineConfig())[0]) if not p.startswith("/_emulator") and m != "HEAD"}
    missing = sorted(ours - routes(http_server.app))
    assert not missing, f"emulator routes sglang does not have: {missing}"


@pytest.mark.parametrize("ours", sorted(_BODIES))
def test_emulator_request_fields_exist_in_sglang(ours: str) -> None:
    """The emulator accepts no request field that sglang's io_struct lacks."""
    bodies = importlib.import_module("resilience.testing.emulator.bodies")
    mine = field_names(getattr(bodies, ours))
    for theirs in _BODIES[ours]:
        extra = sorted(mine - field_names(getattr(io_struct, theirs)))
        assert not extra, f"{ours} has fields {extra} that sglang's {theirs} lacks"
