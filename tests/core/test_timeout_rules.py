"""The pure rules of one call, driven directly: ``attempt_timeouts``, ``call_deadlines``, ``classify``, and what "named" means."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest

from resilience import Deadline, EndpointPolicy, FakeClock, PolicyTable, RetryPolicy, load_policy_file
from resilience.outcome import Delivery, Outcome
from resilience.policy import DEFAULT_ATTEMPT_TIMEOUT_S, UnnamedSeconds
from resilience.retry.spec import CallSpec, Timeouts, attempt_timeouts, call_deadlines, classify

ENGINE = "http://127.0.0.1:1"


def spec(policy: EndpointPolicy | None, caller: Timeouts | None, method: str = "POST") -> CallSpec:
    """A call to ``/x``: matched by an entry holding ``policy``, or by no entry (the default policy) when None."""
    table = PolicyTable() if policy is None else PolicyTable({f"{method} /x": policy})
    return CallSpec(method, f"{ENGINE}/x", table.match(method, "/x"), ENGINE, "127.0.0.1", 1, request_timeout=caller)


# -- what "named" means ------------------------------------------------------


def test_a_default_left_alone_is_unnamed_and_a_given_one_is_named_even_at_the_same_number() -> None:
    """``EndpointPolicy()`` names neither time field; ``attempt_timeout_s=10`` names it, though the number is the default's."""
    plain, given = EndpointPolicy(), EndpointPolicy(attempt_timeout_s=10.0)
    assert plain.attempt_timeout_s == 10.0 and plain.deadline_s == 30.0
    assert not plain.named("attempt_timeout_s") and not plain.named("deadline_s")
    assert given.named("attempt_timeout_s") and not given.named("deadline_s")
    assert plain != given  # they decide differently, so they are not equal
    assert EndpointPolicy(attempt_timeout_s=None).named("attempt_timeout_s")


def test_unnamed_survives_replace_and_pickle() -> None:
    """``replace`` of another field and a pickle round trip keep a default unnamed (Ray ships policies by pickle)."""
    base = EndpointPolicy(idempotent=False)
    changed = dataclasses.replace(base, deadline_s=60)
    assert not changed.named("attempt_timeout_s") and changed.named("deadline_s")
    back = pickle.loads(pickle.dumps(base))
    assert back == base and hash(back) == hash(base) and not back.named("attempt_timeout_s")
    assert type(pickle.loads(pickle.dumps(DEFAULT_ATTEMPT_TIMEOUT_S))) is UnnamedSeconds


def test_named_rejects_other_fields() -> None:
    """``named`` answers only for the two time fields and says so."""
    with pytest.raises(ValueError, match=r"EndpointPolicy\.named takes one of attempt_timeout_s, deadline_s, but was 'idempotent'"):
        EndpointPolicy().named("idempotent")  # type: ignore[arg-type]


def test_an_unnamed_attempt_timeout_is_capped_by_a_shorter_named_deadline_not_rejected() -> None:
    """``deadline_s=5`` alone is valid (the unnamed 10 s attempt timeout yields); a named 10 s over it is still a mistake."""
    assert EndpointPolicy(deadline_s=5).deadline_s == 5
    with pytest.raises(ValueError, match=r"attempt_timeout_s must be <= deadline_s \(30.0, its default: name a longer one\)"):
        EndpointPolicy(attempt_timeout_s=60)


@pytest.mark.parametrize("suffix", ["toml", "yaml"])
def test_files_and_python_agree_on_what_is_named(tmp_path: Path, suffix: str) -> None:
    """A file entry naming only ``idempotent`` equals the Python ``EndpointPolicy(idempotent=False)``; ``[defaults]`` name."""
    path = tmp_path / f"p.{suffix}"
    if suffix == "toml":
        path.write_text('[endpoints."POST /a"]\nidempotent = false\n[endpoints."POST /b"]\nattempt_timeout_s = 10\n')
    else:
        path.write_text("endpoints:\n  POST /a:\n    idempotent: false\n  POST /b:\n    attempt_timeout_s: 10\n")
    table = load_policy_file(path)
    assert table.entries["POST /a"] == EndpointPolicy(idempotent=False)
    assert not table.entries["POST /a"].named("attempt_timeout_s")
    assert table.entries["POST /b"] == EndpointPolicy(attempt_timeout_s=10)
    with_defaults = tmp_path / f"d.{suffix}"
    if suffix == "toml":
        with_defaults.write_text('[defaults]\ndeadline_s = 60\n[endpoints."POST /a"]\nidempotent = false\n')
    else:
        with_defaults.write_text("defaults:\n  deadline_s: 60\nendpoints:\n  POST /a:\n    idempotent: false\n")
    entry = load_policy_file(with_defaults).entries["POST /a"]
    assert entry.named("deadline_s") and not entry.named("attempt_timeout_s")


def test_an_overlay_entry_keeps_the_base_entrys_named_fields() -> None:
    """Over a base table, a file entry that changes only ``idempotent`` keeps the base's named timeout named."""
    from resilience.policy_files import table_from_dict

    base = PolicyTable({"POST /a": EndpointPolicy(attempt_timeout_s=3), "POST /b": EndpointPolicy()})
    table = table_from_dict({"endpoints": {"POST /a": {"idempotent": False}, "POST /b": {"idempotent": False}}}, base=base)
    assert table.entries["POST /a"].named("attempt_timeout_s") and table.entries["POST /a"].attempt_timeout_s == 3
    assert not table.entries["POST /b"].named("attempt_timeout_s")


# -- attempt_timeouts ----------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "caller", "expected"),
    [
        # an entry that never named a timeout yields to the caller, shorter or longer
        (EndpointPolicy(idempotent=False), (0.5, 0.5), (0.5, 0.5)),
        (EndpointPolicy(idempotent=False), (60.0, 60.0), (60.0, 60.0)),
        (EndpointPolicy(idempotent=False), (None, None), (None, None)),
        # ... and applies its default only when the caller said nothing
        (EndpointPolicy(idempotent=False), None, (10.0, 10.0)),
        # a named timeout wins over the caller's, both ways
        (EndpointPolicy(attempt_timeout_s=2), (0.5, 0.5), (2, 2)),
        (EndpointPolicy(attempt_timeout_s=2), (60.0, 60.0), (2, 2)),
        (EndpointPolicy(attempt_timeout_s=10.0), (60.0, 60.0), (10.0, 10.0)),
        # a named None (no per-attempt limit) leaves the caller's
        (EndpointPolicy(attempt_timeout_s=None), (3.0, 4.0), (3.0, 4.0)),
        (EndpointPolicy(attempt_timeout_s=None), None, (None, None)),
        # the default policy (no entry matched) yields to the caller
        (None, (0.5, 7.0), (0.5, 7.0)),
        (None, None, (10.0, 10.0)),
    ],
)
def test_attempt_timeouts_precedence(policy: EndpointPolicy | None, caller: Timeouts | None, expected: Timeouts) -> None:
    """A named entry timeout beats the caller's; an unnamed one and the default's apply only when the caller gave none."""
    assert attempt_timeouts(spec(policy, caller)) == expected


def test_attempt_timeouts_capped_by_what_is_left() -> None:
    """Every limit is capped by ``cap_s``; no limit under a cap is the cap; no cap and no limit stays None."""
    assert attempt_timeouts(spec(EndpointPolicy(attempt_timeout_s=5), None), 1.5) == (1.5, 1.5)
    assert attempt_timeouts(spec(EndpointPolicy(), (None, 8.0)), 2.0) == (2.0, 2.0)
    assert attempt_timeouts(spec(EndpointPolicy(), (0.2, 8.0)), 2.0) == (0.2, 2.0)
    assert attempt_timeouts(spec(EndpointPolicy(attempt_timeout_s=None), (None, None))) == (None, None)


def test_attempt_timeouts_hand_out_plain_floats() -> None:
    """The unnamed default reaches the transport as a plain ``float``, not the marker type."""
    connect, read = attempt_timeouts(spec(EndpointPolicy(), None))
    assert type(connect) is float and type(read) is float


# -- call_deadlines ----------------------------------------------------------


def remaining(deadline: Deadline) -> float | None:
    return deadline.remaining() if deadline.bounded else None


@pytest.mark.parametrize(
    ("policy", "caller", "hard", "window"),
    [
        # an unnamed deadline under the caller's timeout is only a retry window
        (EndpointPolicy(idempotent=False), (60.0, 60.0), None, 30.0),
        (None, (2.0, 2.0), None, 30.0),
        # ... and hard when the caller gave none
        (EndpointPolicy(idempotent=False), None, 30.0, 30.0),
        (None, None, 30.0, 30.0),
        # a named deadline is hard
        (EndpointPolicy(deadline_s=12), (60.0, 60.0), 12.0, 12.0),
        (EndpointPolicy(deadline_s=30.0), (60.0, 60.0), 30.0, 30.0),
        # no deadline at all: the caller's timeouts, summed
        (EndpointPolicy(deadline_s=None, attempt_timeout_s=None), (1.0, 2.0), 3.0, 3.0),
        (EndpointPolicy(deadline_s=None, attempt_timeout_s=None), (None, None), None, None),
    ],
)
def test_call_deadlines(policy: EndpointPolicy | None, caller: Timeouts | None, hard: float | None, window: float | None) -> None:
    """Which deadline caps attempts (hard) and which only stops new retries (window), on a clock that does not move."""
    got_hard, got_window = call_deadlines(spec(policy, caller), FakeClock())
    assert (remaining(got_hard), remaining(got_window)) == (hard, window)


def test_an_outer_deadline_is_always_hard() -> None:
    """A caller's ``with Deadline(4):`` caps both, even over an unnamed deadline and the caller's timeout."""
    clock = FakeClock()
    with Deadline(4, clock=clock):
        hard, window = call_deadlines(spec(EndpointPolicy(), (60.0, 60.0)), clock)
    assert (remaining(hard), remaining(window)) == (4.0, 4.0)


# -- classify ----------------------------------------------------------------

IDEMPOTENT = EndpointPolicy()
UNSAFE = EndpointPolicy(idempotent=False)
UNSAFE_GATEWAY = EndpointPolicy(idempotent=False, retry_statuses_if_not_idempotent=True)


@pytest.mark.parametrize(
    ("policy", "status", "delivery", "retry_after", "outcome"),
    [
        (IDEMPOTENT, 200, Delivery.RESPONDED, None, Outcome.SUCCESS),
        (IDEMPOTENT, 204, Delivery.RESPONDED, None, Outcome.SUCCESS),
        (EndpointPolicy(accept_statuses=frozenset({404})), 404, Delivery.RESPONDED, None, Outcome.SUCCESS),
        (IDEMPOTENT, 404, Delivery.RESPONDED, None, Outcome.FATAL),
        (IDEMPOTENT, 500, Delivery.RESPONDED, None, Outcome.FATAL),
        (IDEMPOTENT, 502, Delivery.RESPONDED, None, Outcome.RETRYABLE),
        (UNSAFE, 502, Delivery.RESPONDED, None, Outcome.FATAL),
        (UNSAFE_GATEWAY, 503, Delivery.RESPONDED, None, Outcome.RETRYABLE),
        (IDEMPOTENT, 429, Delivery.RESPONDED, None, Outcome.FATAL),
        (IDEMPOTENT, 429, Delivery.RESPONDED, 1.0, Outcome.RETRYABLE),
        (EndpointPolicy(retry=RetryPolicy(respect_retry_after=False)), 429, Delivery.RESPONDED, 1.0, Outcome.FATAL),
        (IDEMPOTENT, None, Delivery.NOT_SENT, None, Outcome.RETRYABLE),
        (UNSAFE, None, Delivery.NOT_SENT, None, Outcome.RETRYABLE),
        (EndpointPolicy(retry=RetryPolicy(retry_before_send=False)), None, Delivery.NOT_SENT, None, Outcome.FATAL),
        (IDEMPOTENT, None, Delivery.MAYBE_APPLIED, None, Outcome.AMBIGUOUS),
        (UNSAFE, None, Delivery.MAYBE_APPLIED, None, Outcome.AMBIGUOUS),
    ],
)
def test_classify_follows_its_rules(
    policy: EndpointPolicy, status: int | None, delivery: Delivery, retry_after: float | None, outcome: Outcome
) -> None:
    """Each rule of ``classify``'s docstring, one row each: success, gateway statuses, 429, never sent, maybe applied."""
    assert classify(policy, status=status, delivery=delivery, retry_after=retry_after) is outcome
