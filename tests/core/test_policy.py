"""``resilience.policy``: policies are validated values (named fields, types, a property); tables route method + path templates."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from resilience import BreakerConfig, EndpointPolicy, PolicyTable, RetryBudgetConfig, RetryPolicy
from resilience.barrier.journal import RestartBudget
from resilience.errors import ConfigError
from resilience.policy import DEFAULT_ATTEMPT_TIMEOUT_S, UnnamedSeconds


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"max_attempts": 0}, "RetryPolicy.max_attempts must be an integer >= 1, but was 0"),
        ({"statuses": {502, 600}}, "RetryPolicy.statuses must be HTTP statuses within 100-599, but was 600"),
        ({"base_s": -1.0}, "RetryPolicy.base_s must be a finite number >= 0, but was -1.0"),
        ({"base_s": 2.0, "cap_s": 1.0}, "RetryPolicy.cap_s must be >= base_s (2.0), but was 1.0"),
        ({"multiplier": 0.5}, "RetryPolicy.multiplier must be a number >= 1"),
        ({"jitter": 1.5}, "RetryPolicy.jitter must be within [0, 1]"),
    ],
)
def test_invalid_retry_policy_names_field_and_rule(kwargs: dict[str, object], fragment: str) -> None:
    """An invalid RetryPolicy is rejected at construction, naming the field and the rule."""
    with pytest.raises(ConfigError) as info:
        RetryPolicy(**kwargs)  # type: ignore[arg-type]
    assert fragment in str(info.value)


def test_attempt_timeout_above_deadline_rejected() -> None:
    """An attempt timeout longer than the total deadline cannot work and is rejected."""
    with pytest.raises(ConfigError, match=r"EndpointPolicy.attempt_timeout_s must be <= deadline_s \(5\), but was 10"):
        EndpointPolicy(attempt_timeout_s=10, deadline_s=5)


def test_negative_deadline_rejected() -> None:
    """Negative times are rejected."""
    with pytest.raises(ConfigError, match="deadline_s must be a number > 0 or None"):
        EndpointPolicy(deadline_s=-1)


def test_table_matches_templates_and_picks_most_specific() -> None:
    """The most specific template wins and becomes the endpoint label."""
    fast = EndpointPolicy(attempt_timeout_s=1)
    slow = EndpointPolicy(attempt_timeout_s=9)
    table = PolicyTable({"GET /models/{name}": fast, "GET /models/{name}/info": slow, "* /models/special": slow})
    assert table.match("GET", "/models/abc").endpoint == "GET /models/{name}"
    assert table.match("get", "/models/abc/info").policy is slow
    assert table.match("POST", "/models/special").endpoint == "POST /models/special"
    assert table.match("GET", "/models/special").template == "/models/special"


def test_unmatched_requests_get_method_defaults() -> None:
    """Unmatched GET is idempotent and POST is not; the label stays bounded."""
    table = PolicyTable()
    get = table.match("GET", "/anything/12345")
    post = table.match("POST", "/other/999")
    assert get.policy.idempotent and get.endpoint == "GET *"
    assert not post.policy.idempotent and post.endpoint == "POST *"


def test_bad_table_key_rejected() -> None:
    """A table key must be 'METHOD /path'."""
    with pytest.raises(ConfigError, match="must be 'METHOD /path'"):
        PolicyTable({"/no-method": EndpointPolicy()})


@pytest.mark.parametrize(
    ("build", "fragment"),
    [
        (lambda: EndpointPolicy(idempotent="no"), "EndpointPolicy.idempotent must be true or false"),  # type: ignore[arg-type]
        (lambda: EndpointPolicy(raise_on_exhausted="false"), "EndpointPolicy.raise_on_exhausted must be true or false"),  # type: ignore[arg-type]
        (lambda: EndpointPolicy(retry_statuses_if_not_idempotent=1), "retry_statuses_if_not_idempotent must be true or false"),  # type: ignore[arg-type]
        (lambda: EndpointPolicy(accept_statuses="404"), "EndpointPolicy.accept_statuses must be a set of HTTP statuses"),  # type: ignore[arg-type]
        (lambda: EndpointPolicy(accept_statuses={True}), "EndpointPolicy.accept_statuses must be HTTP statuses within 100-599"),
        (lambda: EndpointPolicy(deadline_s="30"), "EndpointPolicy.deadline_s must be a number > 0 or None"),  # type: ignore[arg-type]
        (lambda: RetryPolicy(retry_before_send="yes"), "RetryPolicy.retry_before_send must be true or false"),  # type: ignore[arg-type]
        (lambda: RetryPolicy(respect_retry_after=0), "RetryPolicy.respect_retry_after must be true or false"),  # type: ignore[arg-type]
        (lambda: RetryPolicy(statuses=502), "RetryPolicy.statuses must be a set of HTTP statuses"),  # type: ignore[arg-type]
        (lambda: RetryPolicy(max_attempts=2.0), "RetryPolicy.max_attempts must be an integer >= 1"),  # type: ignore[arg-type]
        (lambda: BreakerConfig(failure_threshold="5"), "BreakerConfig.failure_threshold must be an integer"),  # type: ignore[arg-type]
        (lambda: RetryBudgetConfig(ratio="0.2"), "RetryBudgetConfig.ratio must be a finite number"),  # type: ignore[arg-type]
        (lambda: RestartBudget("3"), "RestartBudget.limit must be an integer >= 0, but was '3'"),  # type: ignore[arg-type]
    ],
)
def test_wrong_types_rejected_in_python(build: object, fragment: str) -> None:
    """A string, number or scalar where a boolean, number or set belongs is rejected, naming the field and the rule."""
    with pytest.raises(ConfigError) as info:
        build()  # type: ignore[operator]
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("key", "fragment"),
    [
        ("POST /x/{id", "unbalanced or invalid '{name}'"),
        ("POST /x/id}", "unbalanced or invalid '{name}'"),
        ("FOO /x", "method must be one of"),
        ("POST /x?y=1", "without '?query'"),
        ("POST /x/{a}/{a}", "names {a} more than once"),
        ("GET|GET /x", "names a method twice"),
    ],
)
def test_bad_route_templates_rejected(key: str, fragment: str) -> None:
    """Templates that cannot match, or match ambiguously, are rejected at construction."""
    with pytest.raises(ConfigError) as info:
        PolicyTable({key: EndpointPolicy()})
    assert fragment in str(info.value) and repr(key) in str(info.value)


@pytest.mark.parametrize(
    "keys",
    [
        ("POST /x", "GET|POST /x"),
        ("GET /models/{a}", "GET /models/{b}/"),
        ("GET /a/{x}", "GET /{y}/b"),
        ("* /x", "* /x/"),
    ],
)
def test_overlapping_entries_rejected(keys: tuple[str, str]) -> None:
    """Two entries a request can match with equal precedence are an error naming both."""
    with pytest.raises(ConfigError) as info:
        PolicyTable(dict.fromkeys(keys, EndpointPolicy()))
    assert all(repr(k) in str(info.value) for k in keys) and "overlap" in str(info.value)


def test_more_specific_entries_do_not_overlap() -> None:
    """A literal over a variable, and an explicit method over *, are precedence, not overlap."""
    table = PolicyTable(
        {
            "GET /m/{name}": EndpointPolicy(),
            "GET /m/special": EndpointPolicy(),
            "* /m/special": EndpointPolicy(),
            "POST /m/{name}": EndpointPolicy(),
        }
    )
    assert len(table) == 4 and table.match("GET", "/m/special").endpoint == "GET /m/special"


@given(
    attempts=st.integers(-3, 10),
    base=st.floats(-1, 5, allow_nan=False),
    cap=st.floats(-1, 5, allow_nan=False),
    status=st.integers(0, 800),
)
def test_validator_accepts_exactly_valid_policies(attempts: int, base: float, cap: float, status: int) -> None:
    """The validator rejects a policy if and only if one of its rules is broken."""
    valid = attempts >= 1 and base >= 0 and cap >= 0 and cap >= base and 100 <= status <= 599
    try:
        RetryPolicy(max_attempts=attempts, base_s=base, cap_s=cap, statuses=frozenset({status}))
    except ConfigError:
        assert not valid
    else:
        assert valid


# -- what "named" means (the caller's own timeout beats an unnamed value, loses to a named one) --


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
