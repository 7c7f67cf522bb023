"""``resilience.policy_files``: TOML and YAML policy files load onto a base table; bad files fail naming the file, field and rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from resilience import EndpointPolicy, PolicyTable, load_policy_file
from resilience.adapters.sglang import SGLANG_POLICIES
from resilience.errors import ConfigError


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
    with pytest.raises(ConfigError) as info:
        load_policy_file(str(f))
    assert fragment in str(info.value)
    assert "bad.toml" in str(info.value)


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
    with pytest.raises(ConfigError) as info:
        load_policy_file(str(f))
    assert fragment in str(info.value) and name in str(info.value)


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
    with pytest.raises(ConfigError, match=r"p.toml: \[defaults\] apply only to the endpoints .* it lists none"):
        load_policy_file(str(f))


def test_binary_file_named(tmp_path: Path) -> None:
    """A binary file is an error naming the file, not a bare UnicodeDecodeError."""
    f = tmp_path / "p.toml"
    f.write_bytes(b"\x00\xff\xfe\x89PNG")
    with pytest.raises(ConfigError, match=r"p.toml: not a text policy file"):
        load_policy_file(str(f))


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
