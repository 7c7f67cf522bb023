"""Which vLLM API a server speaks: ``GET /version`` read into a ``VLLMApi`` (the drift between releases).

vLLM's control routes changed shape between releases; the client asks the server's version once and builds every request
for that version. The drift, as read from the wheels (``shared/reference/vllm-control-plane.md`` sections 1, 4.3 and
4.5; the 0.33.0 lines are cited where the clients use them):

- 0.12.0 (the oldest supported): ``/pause`` takes ``wait_for_inflight_requests``
  and ``clear_cache``; ``/sleep`` takes only ``level`` and does not pause first.
- 0.17.0: ``mode`` (``abort``/``wait``/``keep``) on ``/pause`` and ``/sleep``
  (PR #32351, PR #34528); native weight transfer (``/init_weight_transfer_engine``,
  ``/update_weights``); ``/pause``, ``/resume``, ``/is_paused`` need dev mode.
- 0.23.0: the weight-update session (``/start_weight_update``, ``/finish_weight_update``, PR #39212).
- 0.27.0: ``/update_weight_version`` and ``/weight_info``.
- 0.33.0: ``/sleep`` and ``/wake_up`` answer JSON bodies (empty 200s before);
  ``wait_for_inflight_requests`` is gone; ``/release_kv_cache_memory``,
  ``/weight_checker``, ``/shutdown_weight_transfer_engine``, ``/start_draft_weight_update``.

A version outside ``SUPPORTED`` (older than 0.12.0, or 0.34 and newer, whose
routes nobody has read yet) raises ``VLLMVersionError`` naming it and the range.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

__all__ = [
    "JSON_SLEEP_BODIES", "MODE_PARAMS", "NEWEST", "OLDEST", "PAUSE_NEEDS_DEV_MODE", "SUPPORTED", "VLLMApi", "Version", "WEIGHT_SESSION",
    "WEIGHT_TRANSFER", "WEIGHT_VERSION_ROUTES", "format_version", "parse_version",
]

Version = tuple[int, int, int]
"""A release as (major, minor, patch)."""

OLDEST: Final[Version] = (0, 12, 0)
"""The oldest release the clients speak: the first with ``/pause`` (absent in 0.8.5)."""
NEWEST: Final[Version] = (0, 33, 0)
"""The newest release read; every 0.33.x patch is accepted (``SUPPORTED``)."""
SUPPORTED: Final[tuple[Version, Version]] = (OLDEST, (0, 34, 0))
"""``[oldest, first unsupported)``: 0.12.0 up to and including every 0.33.x."""

MODE_PARAMS: Final[Version] = (0, 17, 0)
"""``mode`` on ``/pause`` and ``/sleep``; ``/sleep`` pauses the scheduler first."""
PAUSE_NEEDS_DEV_MODE: Final[Version] = (0, 17, 0)
"""``/pause``, ``/resume``, ``/is_paused`` are mounted only in dev mode (0.12.0/0.14.0 mounted them always)."""
WEIGHT_TRANSFER: Final[Version] = (0, 17, 0)
"""``/init_weight_transfer_engine`` and ``/update_weights`` (RFC #31848)."""
WEIGHT_SESSION: Final[Version] = (0, 23, 0)
"""``/start_weight_update`` and ``/finish_weight_update`` (PR #39212)."""
WEIGHT_VERSION_ROUTES: Final[Version] = (0, 27, 0)
"""``/update_weight_version`` and ``/weight_info``."""
JSON_SLEEP_BODIES: Final[Version] = (0, 33, 0)
"""``/sleep`` and ``/wake_up`` answer JSON (``serve/dev/sleep/api_router.py`` l.34, l.53); empty 200s before."""

_RELEASE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


def parse_version(text: str) -> Version | None:
    """``"0.33.0"``, ``"0.33.1.dev4+g12ab"``, ``"v0.17.0rc1"`` -> (0, 33, 0), (0, 33, 1), (0, 17, 0); None when no release is in it.

    A pre-release or dev build counts as the release it leads to (``0.34.0rc1`` is 0.34.0).
    """
    match = _RELEASE.match(text) if isinstance(text, str) else None
    if match is None:
        return None
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def format_version(version: Version) -> str:
    """(0, 33, 0) -> ``"0.33.0"``."""
    return ".".join(str(part) for part in version)


@dataclass(frozen=True, slots=True)
class VLLMApi:
    """The API one vLLM server speaks, from its ``GET /version``.

    ``version``: the release, as parsed; ``text``: what the server said
    (``"0.33.0"``). Build one with ``VLLMApi.of("0.33.0")`` to skip asking.
    """

    version: Version
    text: str

    @classmethod
    def of(cls, text: str) -> VLLMApi:
        """The API of the release named by ``text``; ``ValueError`` when it names none."""
        version = parse_version(text)
        if version is None:
            raise ValueError(f"a vLLM version must look like '0.33.0', but was {text!r}")
        return cls(version, text.strip())

    @property
    def supported(self) -> bool:
        """True when the release lies in ``SUPPORTED``."""
        return SUPPORTED[0] <= self.version < SUPPORTED[1]

    def at_least(self, release: Version) -> bool:
        """True when this server is ``release`` or newer."""
        return self.version >= release

    @property
    def mode_params(self) -> bool:
        """``/pause`` and ``/sleep`` take ``mode`` (0.17.0+)."""
        return self.at_least(MODE_PARAMS)

    @property
    def json_sleep_bodies(self) -> bool:
        """``/sleep`` and ``/wake_up`` answer JSON (0.33.0+); before, an empty 200."""
        return self.at_least(JSON_SLEEP_BODIES)

    def range_text(self) -> str:
        """The supported range, for messages."""
        return f"{format_version(SUPPORTED[0])} to {NEWEST[0]}.{NEWEST[1]}.x"
