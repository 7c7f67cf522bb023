"""The aiohttp middleware's version check: the installed aiohttp passes, one whose internals differ fails naming its version."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
import types
import warnings
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from resilience.adapters._aiohttp_compat import TESTED, check, internals_missing, parse_version

ROOT = Path(__file__).resolve().parents[2]


def test_the_installed_aiohttp_is_tested_and_has_every_internal_the_middleware_reads() -> None:
    """The aiohttp the tests run on lies in ``TESTED`` and has the closure cells, ``_timer`` and response attributes read."""
    low, high = TESTED
    assert low <= parse_version(aiohttp.__version__) < high, aiohttp.__version__
    assert internals_missing(aiohttp) == []


def test_the_extra_is_bounded_to_the_tested_versions() -> None:
    """pyproject's ``[aiohttp]`` extra allows exactly ``TESTED``, so pip never installs a version the tests do not cover."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    (low_major, low_minor), (high_major, high_minor) = TESTED
    assert extras["aiohttp"] == [f"aiohttp>={low_major}.{low_minor},<{high_major}.{high_minor}"]


def test_differing_internals_fail_naming_the_version_and_what_differs() -> None:
    """``check`` raises ImportError naming the aiohttp version, each missing internal, and what to install."""
    with pytest.raises(ImportError) as info:
        check("3.16.0", ["ClientResponse._headers (read by ClientResponse.headers)", "ClientRequest._timer"])
    message = str(info.value)
    assert "aiohttp 3.16.0 does not have: ClientResponse._headers (read by ClientResponse.headers); ClientRequest._timer" in message
    assert "'aiohttp>=3.12,<3.15'" in message


def test_an_aiohttp_without_client_middlewares_is_refused() -> None:
    """Before 3.12 there are no client middlewares: the error says so and names the version."""
    with pytest.raises(ImportError, match=r"needs client middlewares \(aiohttp 3\.12 or later\), but aiohttp 3\.11\.18 is installed"):
        check("3.11.18", [])


def test_a_newer_aiohttp_with_the_same_internals_runs_with_a_warning() -> None:
    """3.15 with every internal present: a RuntimeWarning naming it, no error; a tested version: silence."""
    with pytest.warns(RuntimeWarning, match=r"aiohttp 3\.15\.0 is newer than the versions .* tested on \(aiohttp>=3\.12,<3\.15\)"):
        check("3.15.0", [])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check(aiohttp.__version__, [])


def test_importing_the_middleware_on_an_aiohttp_whose_internals_differ_fails_loudly() -> None:
    """A fresh interpreter whose aiohttp lost ``ClientResponse._headers``: importing the middleware raises, naming version and internal."""
    code = textwrap.dedent(
        """
        import aiohttp
        del aiohttp.ClientResponse._headers  # as a release that keeps headers elsewhere would
        aiohttp.__version__ = "3.16.0"
        import resilience.adapters.aiohttp
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: resilience.adapters.aiohttp reads aiohttp internals that aiohttp 3.16.0 does not have:")
    assert "ClientResponse._headers (read by ClientResponse.headers)" in last


def test_a_session_that_reads_its_connector_early_or_a_request_without_session_slot_is_named() -> None:
    """The control lane swaps ``session._connector`` before the handler runs: a handler that took it earlier is refused."""

    class _Session:
        _connector: Any = None

        async def _request(self) -> None:
            connector = self._connector

            async def _connect_and_send_request(req: Any) -> Any:
                return await req.send(await connector.connect(req))

            await _connect_and_send_request(None)

    class _Request(aiohttp.ClientRequest):
        @property
        def session(self) -> Any:
            return self._elsewhere

    fake = types.ModuleType("aiohttp")
    fake.__dict__.update(vars(aiohttp))
    fake.ClientSession = _Session  # type: ignore[attr-defined]
    fake.ClientRequest = _Request  # type: ignore[attr-defined]
    missing = internals_missing(fake)
    assert "_connect_and_send_request reading self._connector when it runs (the control lane swaps it)" in missing
    assert "ClientRequest.session" in missing


@pytest.mark.parametrize(("text", "parsed"), [("3.14.5", (3, 14)), ("4.0.0a1", (4, 0)), ("3.12", (3, 12)), ("dev", (0, 0))])
def test_parse_version(text: str, parsed: tuple[int, int]) -> None:
    """Major and minor of a version string; none found reads as (0, 0), which the check refuses."""
    assert parse_version(text) == parsed


class _TimedRequest(aiohttp.ClientRequest):
    """A request class with the public ``timeout`` aiohttp 3.15 adds (aio-libs/aiohttp#13176): a fixed one, to tell it apart."""

    TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=1.25, sock_read=3.75)

    @property
    def timeout(self) -> aiohttp.ClientTimeout:
        return self.TIMEOUT


@pytest.mark.asyncio
async def test_request_timeout_prefers_the_public_property_where_aiohttp_has_one() -> None:
    """A ``ClientRequest`` with a ``timeout`` property (``request_class=``, aiohttp's own seam): read it, not the closure cells."""
    from resilience.adapters.aiohttp import request_timeout
    from tests.servers import Reply, scripted

    seen: list[aiohttp.ClientTimeout] = []

    async def spy(request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType) -> aiohttp.ClientResponse:
        seen.append(request_timeout(request, handler))
        return await handler(request)

    with scripted(Reply(200)) as server:
        async with aiohttp.ClientSession(middlewares=(spy,), request_class=_TimedRequest) as plain:
            async with plain.get(f"{server.url}/x", timeout=aiohttp.ClientTimeout(total=9)) as r:
                assert r.status == 200
        async with aiohttp.ClientSession(middlewares=(spy,)) as session:
            own = aiohttp.ClientTimeout(total=9)
            async with session.get(f"{server.url}/x", timeout=own) as r:
                assert r.status == 200
    assert seen[0] is _TimedRequest.TIMEOUT and seen[1] is own
