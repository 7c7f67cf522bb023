"""Both SGLang clients against their one method table (``resilience.adapters.sglang.routes.METHODS``).

The clients are hand-written twins (real signatures and docstrings for mypy, IDEs and the docs);
these tests are what keeps them twins: the same methods as the table, the same parameters in
both, the table's result type and docstring summary, a policy entry of their own, and the table's
route on the wire (each method called once on each client against a recording loopback server).
The own-session settings given with ``session=`` are refused the same way by both.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import typing
from collections.abc import AsyncIterator, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
import requests

from resilience.adapters.driver_config import DriverConfig
from resilience.adapters.sglang import SGLANG_POLICIES, AsyncSGLangClient, SGLangClient
from resilience.adapters.sglang.routes import METHODS, Method
from resilience.errors import ConfigConflict
from resilience.testing import fast_policies

CLIENTS = (SGLangClient, AsyncSGLangClient)
LIFECYCLE = {"close", "aclose"}
"""Public methods that are not endpoint methods."""


def endpoint_methods(cls: type) -> list[str]:
    """The public methods ``cls`` defines, in source order (properties and lifecycle methods left out)."""
    names = [name for name, member in vars(cls).items() if inspect.isfunction(member) and not name.startswith("_")]
    return [name for name in names if name not in LIFECYCLE]


@pytest.mark.parametrize("cls", CLIENTS, ids=lambda c: c.__name__)
def test_each_client_has_the_tables_methods_in_its_order(cls: type) -> None:
    """A method added to a client but not to the table (or the other way round) fails here."""
    assert len(METHODS) >= 20
    assert endpoint_methods(cls) == [m.name for m in METHODS]


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_both_clients_take_the_tables_parameters_with_the_same_types_and_defaults(method: Method) -> None:
    """Names and kinds from the table; annotations and defaults identical in both twins."""
    sync, async_ = (inspect.signature(getattr(cls, method.name)) for cls in CLIENTS)
    declared = [
        (name.lstrip("*"), inspect.Parameter.KEYWORD_ONLY if name.startswith("*") else inspect.Parameter.POSITIONAL_OR_KEYWORD)
        for name in method.params
    ]
    for signature in (sync, async_):
        params = list(signature.parameters.values())
        assert params[0].name == "self"
        assert [(p.name, p.kind) for p in params[1:]] == declared
    sync_hints, async_hints = (typing.get_type_hints(getattr(cls, method.name)) for cls in CLIENTS)
    sync_hints.pop("return"), async_hints.pop("return")
    assert sync_hints == async_hints
    assert [p.default for p in sync.parameters.values()] == [p.default for p in async_.parameters.values()]


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_results_docstrings_and_policy_follow_the_table(method: Method) -> None:
    """The declared result (an iterator of it for a stream), the docstring summary, and a policy entry of its own."""
    sync, async_ = (getattr(cls, method.name) for cls in CLIENTS)
    if method.stream:
        item: Any = method.result
        assert typing.get_type_hints(sync)["return"] == Iterator[item]
        assert typing.get_type_hints(async_)["return"] == AsyncIterator[item]
        assert inspect.isasyncgenfunction(async_)
    else:
        assert typing.get_type_hints(sync)["return"] == method.result
        assert typing.get_type_hints(async_)["return"] == method.result
        assert inspect.iscoroutinefunction(async_)
    for function in (sync, async_):
        assert (function.__doc__ or "").splitlines()[0] == method.summary, function.__qualname__
    assert method.policy in SGLANG_POLICIES.entries
    match = SGLANG_POLICIES.match(method.http, method.path)
    assert match.explicit and match.policy is SGLANG_POLICIES.entries[method.policy]


# -- on the wire ----------------------------------------------------------------------------------

ANSWER = {"success": True, "message": "ok", "model_path": "m", "weight_version": "1", "data": [{"id": "m"}], "text": "hi", "meta_info": {}}
"""One body every parser of the clients accepts."""

ARGUMENTS: dict[str, Any] = {
    "rid": "r1",
    "serialized_named_tensors": ["t"],
    "names": ["w"],
    "dtypes": ["bfloat16"],
    "shapes": [[1]],
    "model_path": "/models/m",
    "new_version": "v2",
    "master_address": "127.0.0.1",
    "master_port": 1,
    "rank_offset": 1,
    "world_size": 2,
    "text": "hi",
}
"""A value for each parameter without a usable default."""


class _Recorder(BaseHTTPRequestHandler):
    seen: list[tuple[str, str]]

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        type(self).seen.append((self.command, self.path.partition("?")[0]))
        if body.get("stream"):
            payload = f"data: {json.dumps(ANSWER)}\n\ndata: [DONE]\n\n".encode()
            kind = "text/event-stream"
        else:
            payload, kind = json.dumps(ANSWER).encode(), "application/json"
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = _answer

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def recorder() -> Iterator[tuple[str, list[tuple[str, str]]]]:
    """A loopback server that answers ``ANSWER`` to everything and records (method, path) of each request."""
    seen: list[tuple[str, str]] = []
    handler = type("Recorder", (_Recorder,), {"seen": seen})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _arguments(method: Method) -> dict[str, Any]:
    return {name.lstrip("*"): ARGUMENTS[name.lstrip("*")] for name in method.params if name.lstrip("*") in ARGUMENTS}


POLICIES = fast_policies(SGLANG_POLICIES, attempt_timeout_s=5.0, deadline_s=10.0)


def test_each_method_sends_the_tables_route_on_both_clients(recorder: tuple[str, list[tuple[str, str]]]) -> None:
    """Each method, called on a fresh client of each kind, sends exactly one request: the table's method and path."""
    url, seen = recorder
    sent: dict[str, list[list[tuple[str, str]]]] = {m.name: [] for m in METHODS}
    for method in METHODS:
        seen.clear()
        with SGLangClient(url, policies=POLICIES) as client:
            result = getattr(client, method.name)(**_arguments(method))
            if method.stream:
                assert list(result)
        sent[method.name].append(list(seen))

    async def run_async() -> None:
        for method in METHODS:
            seen.clear()
            async with AsyncSGLangClient(url, policies=POLICIES) as client:
                call: Callable[..., Any] = getattr(client, method.name)
                if method.stream:
                    assert [item async for item in call(**_arguments(method))]
                else:
                    await call(**_arguments(method))
            sent[method.name].append(list(seen))

    asyncio.run(run_async())
    wrong = {
        m.name: sent[m.name] for m in METHODS if sent[m.name] != [[(m.http, m.path)]] * 2
    }
    assert not wrong, wrong


# -- the own session's settings ---------------------------------------------------------------------

class _NoProbe:
    """A memory probe that can never tell (``resilience.engine_contract.MemoryProbe``)."""

    def released_tags(self, engine: str) -> frozenset[str] | None:
        return None


OWN_SESSION_SETTINGS: dict[str, Callable[[], Any]] = {
    "policies": lambda: SGLANG_POLICIES,
    "observers": lambda: (),
    "memory_probe": lambda: _NoProbe(),
    "breaker": lambda: None,
    "config": lambda: DriverConfig(policies=SGLANG_POLICIES),
}
"""Each setting that configures only a client's own session, and a valid value of it."""


@pytest.mark.parametrize("setting", sorted(OWN_SESSION_SETTINGS))
def test_both_clients_refuse_own_session_settings_with_a_session(setting: str) -> None:
    """``session=`` with ``policies=`` (or any other own-session setting) is refused by both twins with the same message."""
    value = OWN_SESSION_SETTINGS[setting]()
    messages = []
    with requests.Session() as sync_session:
        with pytest.raises(ConfigConflict) as sync_error:
            SGLangClient("http://127.0.0.1:9", session=sync_session, **{setting: value})
        messages.append(str(sync_error.value).replace("SGLangClient", "<client>", 1))

    async def refuse() -> None:
        async with httpx.AsyncClient() as async_session:
            with pytest.raises(ConfigConflict) as async_error:
                AsyncSGLangClient("http://127.0.0.1:9", session=async_session, **{setting: value})
            messages.append(str(async_error.value).replace("AsyncSGLangClient", "<client>", 1))

    asyncio.run(refuse())
    assert messages[0] == messages[1]
    assert messages[0].startswith(f"<client> got session= and {setting}=: those configure only the client's own session")
