"""Policies are validated values; tables route method + path templates; files load with clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from resilience import EndpointPolicy, PolicyError, PolicyTable, RetryPolicy, load_policy_file


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
    with pytest.raises(PolicyError) as info:
        RetryPolicy(**kwargs)  # type: ignore[arg-type]
    assert fragment in str(info.value)


def test_attempt_timeout_above_deadline_rejected() -> None:
    """An attempt timeout longer than the total deadline cannot work and is rejected."""
    with pytest.raises(PolicyError, match=r"EndpointPolicy.attempt_timeout_s must be <= deadline_s \(5\), but was 10"):
        EndpointPolicy(attempt_timeout_s=10, deadline_s=5)


def test_negative_deadline_rejected() -> None:
    """Negative times are rejected."""
    with pytest.raises(PolicyError, match="deadline_s must be a number > 0 or None"):
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
    with pytest.raises(PolicyError, match="must be 'METHOD /path'"):
        PolicyTable({"/no-method": EndpointPolicy()})


def test_toml_file_loads(tmp_path: Path) -> None:
    """A TOML file builds the same table as Python, with defaults applied."""
    f = tmp_path / "p.toml"
    f.write_text(
        '[defaults]\ndeadline_s = 60\n[endpoints."POST /pause_generation"]\nidempotent = true\n'
        "retry = { max_attempts = 5, statuses = [502, 503], base_s = 0.5 }\n"
    )
    match = load_policy_file(str(f)).match("POST", "/pause_generation")
    assert match.policy.deadline_s == 60
    assert match.policy.retry.max_attempts == 5
    assert match.policy.retry.statuses == frozenset({502, 503})


def test_yaml_file_loads(tmp_path: Path) -> None:
    """A YAML file loads too."""
    f = tmp_path / "p.yaml"
    f.write_text("endpoints:\n  POST /release_memory_occupation:\n    idempotent: false\n    attempt_timeout_s: 30\n    deadline_s: 120\n")
    policy = load_policy_file(str(f)).match("POST", "/release_memory_occupation").policy
    assert policy.idempotent is False and policy.attempt_timeout_s == 30


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('[endpoints."POST /x"]\nidempotnet = true\n', "unknown key(s) 'idempotnet'"),
        ('[endpoints."POST /x"]\nretry = { max_attempts = 0 }\n', "RetryPolicy.max_attempts must be an integer >= 1"),
        ('[endpoints."POST /x"]\nattempt_timeout_s = 50\ndeadline_s = 10\n', "attempt_timeout_s must be <= deadline_s"),
        ('[endpoints."POST /x"]\nretry = { statuses = [700] }\n', "within 100-599, but was 700"),
        ('[endpoints."POST /x"]\nretry = { base_s = 5, cap_s = 1 }\n', "cap_s must be >= base_s"),
        ("[surprise]\n", "unknown key(s) 'surprise'"),
        ("not toml = = =", "invalid TOML"),
    ],
)
def test_bad_policy_file_names_file_field_and_rule(tmp_path: Path, text: str, fragment: str) -> None:
    """Every bad policy file is rejected with the file name, the field and the rule."""
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(PolicyError) as info:
        load_policy_file(str(f))
    assert fragment in str(info.value)
    assert "bad.toml" in str(info.value)
