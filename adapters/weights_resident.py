"""``WeightsNotResident``: a weight call refused before sending, because the engine's weights are released or asleep.

A weight update into weights that sleep mode or the memory saver has unmapped is an illegal memory access: the engine
dies (vLLM #57853 / #57854: the EngineCore segfaults; smg #2529: "a request routed to a sleeping engine returns 500 and
can kill the engine"). Neither engine refuses it itself in the releases we support (vLLM 0.33.0
``v1/worker/gpu_worker.py`` ``_start_weight_update`` l.1559, ``update_weights`` l.1592, ``finish_weight_update`` l.1633,
and SGLang 0.5.23 ``srt/managers/scheduler_components/weight_updater.py`` ``update_weights_from_*`` l.138-287,
``begin_weight_update`` l.309, ``end_weight_update`` l.323: none looks at the sleep state or ``offload_tags``), so the
clients refuse it from what they know: the sleeps and releases they sent and the wakes and resumes since. The base of
``SGLangWeightsReleased`` and ``VLLMWeightsAsleep``; catch it for both kinds.
"""

from __future__ import annotations

from resilience.adapters.answer_error import EngineAnswerError
from resilience.outcome import AttemptRecord, Delivery, Outcome

__all__ = ["WeightsNotResident"]


class WeightsNotResident(EngineAnswerError):
    """Not sent: ``endpoint`` reads or writes the weights of ``engine``, whose weights are ``state`` (in words).

    ``engine``, ``endpoint`` and ``state`` are attributes and in the message; ``status`` is None and
    ``attempts`` one ``Delivery.NOT_SENT`` record (``attempts_of`` reads it: nothing left the client, so
    nothing needs settling). ``remedy`` says what brings the weights back.
    """

    def __init__(self, engine: str, endpoint: str, state: str, remedy: str) -> None:
        self.state = state
        detail = f"not sent: the weights are {state}; a weight call now would kill the engine ({remedy} first)"
        refused = AttemptRecord(0, None, Outcome.FATAL, Delivery.NOT_SENT, type(self).__name__, 0.0)
        super().__init__(engine, endpoint, None, "", detail=detail, attempts=(refused,))
