"""``SGLangClientState``: what both SGLang clients hold and remember (keys, the pause sent, the tags released)."""

from __future__ import annotations

from collections.abc import Sequence

from resilience.adapters.engine_state import EngineClientState
from resilience.adapters.engine_steps import Steps
from resilience.adapters.sglang.calls import WEIGHT_PATHS, Call, flush_steps, key_for, memory_tags
from resilience.adapters.sglang.results import FlushResult, SGLangWeightsReleased

__all__ = ["SGLangClientState"]


class SGLangClientState(EngineClientState):
    """What both SGLang clients hold and remember: the engine, the keys, the pause sent, the tags released.

    ``base_url``: the engine (``http://127.0.0.1:30000``). ``api_key`` / ``admin_api_key``:
    SGLang's ``--api-key`` / ``--admin-api-key`` (default None), kept out of repr and
    errors. ``flush_deadline_s`` (default 120 s) / ``flush_poll_s`` (default 0.5 s):
    ``flush_cache``'s wait for idle and the pause between "not idle" answers.
    """

    KEYS = ("api_key", "admin_api_key")

    def __init__(
        self, base_url: str, *, api_key: str | None, admin_api_key: str | None, flush_deadline_s: float, flush_poll_s: float
    ) -> None:
        super().__init__(base_url)
        self._api_key = api_key
        self._admin_api_key = admin_api_key
        self.flush_deadline_s = flush_deadline_s
        self.flush_poll_s = flush_poll_s
        self._paused_mode: str | None = None
        self._released: set[str] = set()

    @property
    def paused_mode(self) -> str | None:
        """The mode of the pause this client sent and has not continued, or None."""
        return self._paused_mode

    @property
    def released_tags(self) -> frozenset[str]:
        """Tags this client released and has not resumed (SGLang itself cannot tell)."""
        with self._lock:
            return frozenset(self._released)

    def _key_for(self, path: str) -> tuple[str | None, str | None]:
        """The key this route's SGLang auth level asks for, as (name, key); (None, None) = send none."""
        return key_for(path, self._api_key, self._admin_api_key)

    def _flush_waits(self, wait_for_idle: bool | None) -> bool:
        """Whether a flush passes the remaining time as ``?timeout=``: by default only when this client has not paused."""
        return self._paused_mode is None if wait_for_idle is None else wait_for_idle

    def _flush_steps(self, deadline_s: float | None, wait_for_idle: bool | None) -> Steps[Call | float, FlushResult]:
        """``flush_cache``'s steps: within ``deadline_s`` (None = ``flush_deadline_s``), ``flush_poll_s`` between "not idle"."""
        deadline = deadline_s if deadline_s is not None else self.flush_deadline_s
        return flush_steps(self.engine, self._flush_waits(wait_for_idle), deadline, self.flush_poll_s)

    def _refuse_if_released(self, call: Call) -> None:
        """``SGLangWeightsReleased``, before anything is sent, for a weight call while this client has ``weights`` released."""
        if call.path in WEIGHT_PATHS and "weights" in self.released_tags:
            state = "released (this client's release_memory_occupation answered, and no resume of them since)"
            raise SGLangWeightsReleased(self.engine, call.endpoint, state, "resume_memory_occupation(['weights'])")

    def _note_paused(self, mode: str | None) -> None:
        self._paused_mode = mode

    def _note_released(self, tags: Sequence[str] | None) -> None:
        with self._lock:
            self._released.update(memory_tags(tags))

    def _note_resumed(self, tags: Sequence[str] | None) -> None:
        with self._lock:
            self._released.difference_update(memory_tags(tags))
