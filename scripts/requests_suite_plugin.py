"""pytest plugin for scripts/requests-suite.sh: every ``requests.Session`` mounts ``ResilientAdapter``.

Loaded with ``-p requests_suite_plugin`` when the suite runs "with the adapter". It patches
``Session.__init__`` so that each new session mounts one ``ResilientAdapter`` (no policy table:
the defaults a new user gets) on ``http://`` and ``https://``, exactly as ``resilient_session()`` does.
"""

from __future__ import annotations

from typing import Any

import requests

from resilience.adapters.requests import ResilientAdapter

_original_init = requests.Session.__init__


def _init_with_adapter(self: requests.Session, *args: Any, **kwargs: Any) -> None:
    _original_init(self, *args, **kwargs)
    adapter = ResilientAdapter()
    self.mount("https://", adapter)
    self.mount("http://", adapter)


def pytest_configure(config: Any) -> None:
    """Patch before the suite imports or builds any session."""
    requests.Session.__init__ = _init_with_adapter  # type: ignore[method-assign]
    config.addinivalue_line("markers", "cpr_adapter: the run mounts ResilientAdapter on every Session")


def pytest_report_header(config: Any) -> str:
    return "requests-suite: every Session mounts resilience.adapters.requests.ResilientAdapter"
