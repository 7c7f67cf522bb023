"""SkyRL 0.4.0's own vLLM client (``RemoteInferenceClient``), loaded by path, and its colocated cycle.

``skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py`` is the client SkyRL's trainer fans its
control calls out with, straight to vLLM's routes: one POST per server over one ``aiohttp.ClientSession`` (the same
as its generation's), no retry on a status (``raise_for_status``), no timeout (``ClientTimeout(total=None)``). The
wheel pulls ray, torch and vLLM on import, so the rig loads this one file with the names it imports from SkyRL
stubbed (``sys.modules`` gets no ``skyrl``); ``scripts/setup.sh`` unpacks it into ``~/.cache/cpr/skyrl``
(``CPR_SKYRL_SOURCE``). One cycle is ``WorkerDispatch``'s colocated weight sync
(``skyrl/backends/skyrl_train/workers/worker_dispatch.py`` l.694-772): ``is_sleeping()``, ``sleep()`` (level 2),
``wake_up(["weights"])``, ``wake_up(["kv_cache"])``.
"""

from __future__ import annotations

import asyncio
import sys
import types
from pathlib import Path
from typing import Any

from resilience.testing.stubbed_import import framework_file, load_stubbed, never_called

__all__ = ["SKYRL_VERSION", "SkyRLMissing", "load_skyrl_client", "skyrl_client", "skyrl_cycle"]

SKYRL_VERSION = "0.4.0"
_FILE = "skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py"
_MODULE = "cpr_skyrl_remote_inference_client"


class SkyRLMissing(RuntimeError):
    """SkyRL's client file is not here; the message says how to fetch it."""


def _source() -> Path:
    missing = SkyRLMissing(
        f"SkyRL {SKYRL_VERSION}'s remote_inference_client.py is not here: run scripts/setup.sh (it unpacks "
        f"`pip download --no-deps skyrl=={SKYRL_VERSION}` into ~/.cache/cpr/skyrl), or set CPR_SKYRL_SOURCE"
    )
    return framework_file("skyrl", _FILE, "CPR_SKYRL_SOURCE", missing)


def load_skyrl_client() -> types.ModuleType:
    """SkyRL's ``remote_inference_client`` module, loaded by path, with the SkyRL names it imports stubbed (the base
    class and typed dicts, the generation-only decoders and helpers, ``skyrl.env_vars``' limits at their defaults:
    512 requests per engine, 50,000 connections); the control path is SkyRL's code."""
    loaded = sys.modules.get(_MODULE)
    if loaded is not None:
        return loaded
    path = _source()
    names = [
        "skyrl",
        "skyrl.backends",
        "skyrl.backends.utils",
        "skyrl.backends.skyrl_train",
        "skyrl.backends.skyrl_train.inference_servers",
        "skyrl.backends.skyrl_train.inference_servers.base",
        "skyrl.backends.skyrl_train.inference_servers.generate_wire",
        "skyrl.backends.skyrl_train.utils",
        "skyrl.backends.skyrl_train.utils.routed_experts",
        "skyrl.backends.skyrl_train.utils.sample_support",
        "skyrl.env_vars",
    ]
    stubs = {name: types.ModuleType(name) for name in names}
    base = stubs["skyrl.backends.skyrl_train.inference_servers.base"]
    base.InferenceEngineInterface = type("InferenceEngineInterface", (), {})  # type: ignore[attr-defined]
    for typed in ("InferenceEngineInput", "InferenceEngineOutput", "MMPlaceholderRangeInfo", "MultiModalFeatures"):
        setattr(base, typed, dict)
    wire = stubs["skyrl.backends.skyrl_train.inference_servers.generate_wire"]
    wire.PackedField = str  # type: ignore[attr-defined]
    for fn in ("decode_packed_routed_experts", "decode_packed_sample_support", "load_packed_body"):
        setattr(wire, fn, never_called("SkyRL", fn))
    stubs["skyrl.backends.skyrl_train.utils.routed_experts"].RoutedExpertIndices = list  # type: ignore[attr-defined]
    stubs["skyrl.backends.skyrl_train.utils.sample_support"].SampleSupport = list  # type: ignore[attr-defined]
    stubs["skyrl.backends.utils"].convert_vllm_prompt_logprobs = never_called("SkyRL", "convert_vllm_prompt_logprobs")  # type: ignore[attr-defined]
    stubs["skyrl.env_vars"].SKYRL_GENERATE_CONCURRENCY_PER_ENGINE = 512  # type: ignore[attr-defined]
    stubs["skyrl.env_vars"].SKYRL_HTTP_CONNECTION_LIMIT = 50_000  # type: ignore[attr-defined]
    return load_stubbed(_MODULE, path, stubs)


def skyrl_client(urls: list[str]) -> Any:
    """SkyRL's ``RemoteInferenceClient`` over ``urls`` (the control-plane fan-out; the first one as its data-plane URL)."""
    module = load_skyrl_client()
    return module.RemoteInferenceClient(proxy_url=urls[0], server_urls=list(urls), data_parallel_size=1)


def skyrl_cycle(client: Any) -> None:
    """``WorkerDispatch``'s colocated sync: is_sleeping, sleep (level 2), wake weights, wake kv_cache; on one event loop."""

    async def cycle() -> None:
        try:
            if not await client.is_sleeping():
                await client.sleep()
            await client.wake_up(tags=["weights"])
            await client.wake_up(tags=["kv_cache"])
        finally:
            await client.teardown()  # SkyRL's own close of its session: the loop ends here

    asyncio.run(cycle())
