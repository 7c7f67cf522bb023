"""Shared parts of the smg tests: a real smg gateway on 127.0.0.1 in front of emulated engines.

Starting smg waits on its workers' health, so each module shares one gateway (``gateway_for``). Without the
``[smg]`` extra these tests skip, except under ``CI=true``, where they fail: CI must install it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest

from resilience.testing.smg import GatewayHealth, SmgGateway, smg_available


def require_smg(*, module: bool = False) -> None:
    """Skip without smg, or fail when CI=true (CI installs the [smg] extra).

    ``module``: called at a test module's top, before it imports ``smg`` (skips the whole module).
    """
    if not smg_available():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("smg is required on CI: pip install 'controlplane-resilience[smg]'", pytrace=False)
        pytest.skip("smg not installed (the [smg] extra)", allow_module_level=module)


def _progress(ready: int, n: int) -> None:
    print(f"smg: {ready}/{n} workers ready", file=sys.stderr, flush=True)


@contextmanager
def gateway_for(urls: Sequence[str], health: GatewayHealth, **kwargs: object) -> Iterator[SmgGateway]:
    """One smg in front of ``urls``, every worker ready before it yields (progress on stderr); stopped by PID after."""
    require_smg()
    gateway = SmgGateway(urls, health=health, progress=_progress, **kwargs)  # type: ignore[arg-type]
    with gateway:
        yield gateway
