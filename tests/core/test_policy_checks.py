"""Policy fields are type-checked in Python and in files; route templates are validated; overrides keep the base policy."""

from __future__ import annotations

from pathlib import Path

import pytest

from resilience import (
    BreakerConfig,
    EndpointPolicy,
    PolicyError,
    PolicyTable,
    RestartBudget,
    RetryBudgetConfig,
    RetryPolicy,
    load_policy_file,
)
from resilience.adapters.sglang import SGLANG_POLICIES


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
    with pytest.raises(PolicyError) as info:
        build()  # type: ignore[operator]
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("name", "text", "fragment"),
    [
        ("p.toml", '[endpoints."POST /release"]\nidempotent = "false"\n', "EndpointPolicy.idempotent must be true or false"),
        ("p.yaml", 'endpoints:\n  POST /release:\n    idempotent: "no"\n', "EndpointPolicy.idempotent must be true or false"),
        ("p.toml", '[endpoints."POST /x"]\nraise_on_exhausted = "false"\n', "raise_on_exhausted must be true or false"),
        ("p.toml", '[endpoints."POST /x"]\nretry = { base_s = "0.5" }\n', "RetryPolicy.base_s must be a finite number >= 0"),
        ("p.toml", '[endpoints."POST /x"]\nretry = { statuses = "502" }\n', "RetryPolicy.statuses must be a set of HTTP statuses"),
        ("p.yaml", "endpoints:\n  POST /x:\n    accept_statuses: [404, '409']\n", "accept_statuses must be HTTP statuses within 100-599"),
        ("p.toml", '[defaults]\nidempotent = "yes"\n[endpoints."POST /x"]\n', "defaults: EndpointPolicy.idempotent must be true or false"),
    ],
)
def test_wrong_types_rejected_in_files(tmp_path: Path, name: str, text: str, fragment: str) -> None:
    """A quoted boolean or number in TOML/YAML is an error naming the file, the field and the rule, never truthy."""
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(PolicyError) as info:
        load_policy_file(str(f))
    assert fragment in str(info.value) and name in str(info.value)


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
    with pytest.raises(PolicyError) as info:
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
    with pytest.raises(PolicyError) as info:
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


def test_override_starts_from_the_built_in_policy(tmp_path: Path) -> None:
    """A file entry over a built-in one changes only the fields it names; the methods it does not name keep theirs."""
    f = tmp_path / "p.toml"
    f.write_text('[defaults]\ndeadline_s = 20\n[endpoints."POST /release_memory_occupation"]\nretry = { max_attempts = 2 }\n')
    built_in = SGLANG_POLICIES.match("POST", "/release_memory_occupation").policy
    table = load_policy_file(str(f), base=SGLANG_POLICIES)
    post = table.match("POST", "/release_memory_occupation")
    assert post.policy.retry.max_attempts == 2
    assert (post.policy.attempt_timeout_s, post.policy.deadline_s) == (built_in.attempt_timeout_s, built_in.deadline_s) == (120, 300)
    assert post.policy.idempotent is False and post.policy.retry.base_s == built_in.retry.base_s
    assert table.match("GET", "/release_memory_occupation").policy == built_in
    assert len(table) == len(SGLANG_POLICIES) + 1  # "GET|POST" became "GET" and "POST"
    new = table.match("POST", "/my_endpoint")
    assert new.endpoint == "POST *"  # the file adds nothing else
    f.write_text('[defaults]\ndeadline_s = 20\n[endpoints."POST /mine"]\nidempotent = true\n')
    added = load_policy_file(str(f), base=SGLANG_POLICIES).match("POST", "/mine").policy
    assert added.deadline_s == 20 and added.idempotent is True  # a new entry gets the file's defaults


def test_defaults_without_endpoints_rejected(tmp_path: Path) -> None:
    """[defaults] with no endpoints would apply to nothing: an error that says so."""
    f = tmp_path / "p.toml"
    f.write_text("[defaults]\ndeadline_s = 60\n")
    with pytest.raises(PolicyError, match=r"p.toml: \[defaults\] apply only to the endpoints .* it lists none"):
        load_policy_file(str(f))


def test_binary_file_named(tmp_path: Path) -> None:
    """A binary file is an error naming the file, not a bare UnicodeDecodeError."""
    f = tmp_path / "p.toml"
    f.write_bytes(b"\x00\xff\xfe\x89PNG")
    with pytest.raises(PolicyError, match=r"p.toml: not a text policy file"):
        load_policy_file(str(f))
