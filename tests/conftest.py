"""Shared fixtures: a clean proxy environment, testing switches, loopback helpers."""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import psutil
import pytest
from hypothesis import settings

import resilience

# CI draws the same examples on every run (a red CI then means a real, reproducible defect, never the luck of one
# draw); runs on a workstation draw fresh ones each time, and the stop-of-work checks raise the counts by env knobs.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI", "").lower() == "true":
    settings.load_profile("ci")

_PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "all_proxy", "no_proxy")

SHORT_TIMEOUT = 0.5
"""Seconds: an attempt timeout that a hung loopback server exceeds."""
LONG_TIMEOUT = 10.0 if os.environ.get("CI") else 5.0
"""Seconds: a bound that a healthy loopback exchange never reaches."""


@pytest.fixture(autouse=True)
def _clean_environ(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No test sees the machine's proxy settings unless it sets them itself."""
    for var in _PROXY_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    yield


@pytest.fixture(autouse=True)
def _reset_testing_mode() -> Iterator[None]:
    """The testing switch never leaks from one test to the next."""
    with resilience.set_testing(False):
        yield


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_refuses(url: str) -> bool:
    """True when a connect to ``url``'s host and port fails (nothing listens there now)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) != 0


def none_of_ours_listens(url: str, ours: Iterable[int]) -> bool:
    """A dead server's port refuses, or whoever listens on it now is none of ``ours`` (the processes that served it).

    A freed port is anyone's: a Ray worker or another server may bind it between the
    death and the check, so "refuses" alone would fail on someone else's socket.
    """
    if port_refuses(url):
        return True
    port = int(url.rsplit(":", 1)[1])
    listeners = psutil.net_connections(kind="tcp")
    holders = {c.pid for c in listeners if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port}
    return not holders & set(ours)


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process under it now."""
    return [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]


@pytest.fixture
def refusing_port() -> Iterator[int]:
    """A loopback port that refuses every connection for the whole test.

    The socket stays bound without listening, so the kernel answers each connect
    with a reset and no other process (a Ray worker, a server of a test running
    beside this one) can take the port meanwhile, as it could after ``free_port()``.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield int(s.getsockname()[1])


@contextmanager
def port_held(url: str) -> Iterator[None]:
    """Keep the port of ``url``'s dead server refusing for the block: bound (SO_REUSEADDR: past its TIME_WAITs), never listening.

    A freed port is anyone's: while a client retries a refused connect (SGLANG_POLICIES' connect window: 5 s),
    another test's engine or proxy (the other xdist worker's, or another run's) may bind it, answer, and the dead
    engine would look alive. Bound here, the kernel resets each connect, and no automatic bind (port 0) picks it.
    """
    port = int(url.rsplit(":", 1)[1])
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        yield


def require_tool(name: str) -> str:
    """The path of an executable; skip without it, or fail when CI=true (CI must install it)."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{name} is required on CI but not installed")
        pytest.skip(f"{name} not installed")
    return path


def start_local_ray() -> None:
    """The session's local Ray: num_cpus=2, loopback only, no dashboard (also what a module that ran its own cluster
    starts again when it is done: ``tests/adapters/test_ray_cluster.py``)."""
    import ray

    os.environ["RAY_AUTH_MODE"] = "disabled"  # read at init, before any per-test fixture runs
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False, _node_ip_address="127.0.0.1")


@pytest.fixture(scope="session")
def ray_runtime() -> Iterator[Any]:
    """One local Ray for the whole session (num_cpus=2, loopback only), always shut down; skip without ray unless CI."""
    try:
        import ray
    except ImportError:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("ray is required on CI")
        pytest.skip("ray not installed")
    start_local_ray()
    try:
        yield ray
    finally:
        ray.shutdown()


RAY_MODULES = frozenset(
    {
        "tests/adapters/test_instrument.py",
        "tests/adapters/test_ray.py",
        "tests/adapters/test_ray_cluster.py",
        "tests/barrier/test_ambiguous_http.py",
        "tests/barrier/test_barrier.py",
        "tests/barrier/test_write_ahead_knowledge.py",
        "tests/barrier/test_journal_contract.py",
        "tests/barrier/test_membership_emulated.py",
        "tests/barrier/test_membership_properties_ray.py",
    }
)
"""The test modules with a Ray test: under ``-n`` they run as one unit, in one worker (the session's one Ray runtime).

A worker's collection checks this list (:func:`pytest_collection_modifyitems`): a module that uses Ray and is not
named here stops the run with a message saying so."""


def _distributing(config: pytest.Config) -> bool:
    """True in the controller of a pytest-xdist run (``-n 2``: what ``scripts/test.sh`` runs)."""
    return str(getattr(config.option, "dist", "no")) != "no"


def pytest_configure(config: pytest.Config) -> None:
    """Under ``-n``: this suite's own scheduling (:func:`pytest_xdist_make_scheduler`), in collection order.

    ``-n N`` alone means ``--dist load`` (any test on any worker), which would split a module's tests across
    workers: its module fixtures would start twice, and a test that reads what the tests before it left (the
    fault counts of ``test_ambiguous_http.py``) would see nothing. Other ``--dist`` modes are refused by name.
    ``loadscopereorder`` off: the work queue keeps the collection's order, so tests/frameworks, collected last,
    is the last unit a worker takes.
    """
    if hasattr(config, "workerinput") or not _distributing(config):
        return
    if config.option.dist != "load":
        raise pytest.UsageError(f"this suite runs under -n with its own scheduling (a module per unit), not --dist {config.option.dist}")
    config.option.loadscopereorder = False


def _unit(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    return "ray" if module in RAY_MODULES else module


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: without it installed, nothing calls this
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Each test module is one unit of work that one worker runs whole, in its order, as in a serial run (its module
    fixtures start once); the modules of :data:`RAY_MODULES` are one unit together, so one worker only starts Ray.

    pytest-xdist's ``--dist loadgroup`` would do this from ``xdist_group`` marks, but under pytest 9 its renaming of
    node ids (``item._nodeid = ...@group`` in xdist 3.8's ``remote.py``) no longer reaches ``item.nodeid``, so the
    marks are lost; the grouping here reads the node ids the workers send, nothing else.
    """
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return ModuleScheduling(config, log)


def _uses_ray(item: pytest.Item) -> bool:
    """The test takes ``ray_runtime``, directly or through a fixture parametrized ``"ray"`` (``request.getfixturevalue``)."""
    if "ray_runtime" in getattr(item, "fixturenames", ()):
        return True
    callspec = getattr(item, "callspec", None)
    return callspec is not None and "ray" in callspec.params.values()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run tests/frameworks last: importing AReaL 1.0.4 rewires the process's logging (``areal.utils.logging.getLogger``
    replaces ``logging.Logger.root`` and ``.manager`` and runs ``dictConfig`` with ``disable_existing_loggers``), and
    the rig's ``_keeping_logging`` cannot undo all of it, so tests that read log records must not run after it.

    Under ``-n`` the scheduling (:func:`pytest_xdist_make_scheduler`) keeps this order, so tests/frameworks is the
    last unit queued and the worker that takes it runs nothing after it. A worker also checks that every module with
    a Ray test is in :data:`RAY_MODULES`, or two workers could start two Ray clusters at once.
    """
    items.sort(key=lambda item: "tests/frameworks/" in item.nodeid.replace("\\", "/"))
    if not hasattr(config, "workerinput"):
        return
    unlisted = sorted({item.nodeid.split("::", 1)[0] for item in items if _uses_ray(item)} - RAY_MODULES)
    if unlisted:
        raise pytest.UsageError(f"{', '.join(unlisted)} use Ray: add them to RAY_MODULES in tests/conftest.py")
