"""The emulator's record of control calls is bounded: the last MAX_CALLS calls, seq counting on, the rest counted as dropped."""

from __future__ import annotations

import pytest

from resilience.testing.emulator.record import MAX_CALLS, CallRecord


def test_the_record_keeps_the_last_calls_and_counts_the_dropped_ones() -> None:
    """3000 calls into a record of 2048: the newest 2048 stay, in order, with their own seq; 952 are counted dropped."""
    record = CallRecord()
    for i in range(3000):
        entry = record.begin("POST", f"/p{i}", "")
        entry["status"] = 200
    calls = record.calls()
    assert MAX_CALLS == 2048 and len(calls) == MAX_CALLS and record.dropped == 3000 - MAX_CALLS
    assert [c["seq"] for c in calls] == list(range(3000 - MAX_CALLS, 3000))
    assert calls[-1]["path"] == "/p2999" and calls[-1]["status"] == 200


def test_a_small_record_and_a_bad_size() -> None:
    """max_calls=2 keeps two; 0 or a non-integer is refused with the field named."""
    record = CallRecord(max_calls=2)
    for path in ("/a", "/b", "/c"):
        record.begin("GET", path, "")
    assert [c["path"] for c in record.calls()] == ["/b", "/c"] and record.dropped == 1
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="`max_calls` must be an integer >= 1"):
            CallRecord(max_calls=bad)  # type: ignore[arg-type]
