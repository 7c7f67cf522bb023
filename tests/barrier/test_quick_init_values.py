"""The barrier's and the SGLang clients' per-call values built with ``quick_init``: each takes its dataclass's signature.

The same check as ``tests/core/test__frozen.py`` (a plain dataclass twin per class), for the values a fan-out builds
for every engine call: the SGLang ``Call`` and ``Answer``, the control and flush results, the fan-out's
``EngineResult`` and the knowledge's ``Facts`` and ``Pending``.
"""

from __future__ import annotations

import pytest

from resilience.adapters.sglang.calls import Answer, Call
from resilience.adapters.sglang.results import ControlResult, FlushResult
from resilience.barrier.fanout import EngineResult
from resilience.barrier.knowledge import Facts, Pending
from tests.core import test__frozen as frozen_checks

DECORATED = [Call, Answer, ControlResult, FlushResult, EngineResult, Facts, Pending]


@pytest.mark.parametrize("cls", DECORATED, ids=lambda c: c.__name__)
def test_each_per_call_value_takes_the_dataclass_signature_and_sets_every_field(cls: type) -> None:
    """Same parameters (names, order, kinds, defaults) as a plain twin; every field set from its argument or its default."""
    frozen_checks.test_each_decorated_class_takes_the_dataclass_signature_and_sets_every_field(cls)


@pytest.mark.parametrize("cls", DECORATED, ids=lambda c: c.__name__)
def test_each_per_call_value_has_the_fast_init(cls: type) -> None:
    """The class's ``__init__`` is ``quick_init``'s (it sets each slot through its descriptor, ``_set0`` ...), not the dataclass's."""
    assert "_set0" in cls.__init__.__globals__  # type: ignore[misc]
