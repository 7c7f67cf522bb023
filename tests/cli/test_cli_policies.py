"""``cpr policies``: the effective table, and a bad policy file named down to the field and the rule."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("rich")

from tests.cli.cpr_testlib import error_lines, run_cpr, table_rows


def test_default_table_is_sglang_policies(tmp_path: Path) -> None:
    """Without --file it prints SGLANG_POLICIES, release not idempotent."""
    result = run_cpr("policies", cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    rows = {row[0]: row for row in table_rows(result.stdout)}
    assert rows["GET|POST /release_memory_occupation"][1] == "no"
    assert rows["POST /pause_generation"][1] == "yes"


def test_bad_policy_file_names_the_field_and_the_rule(tmp_path: Path) -> None:
    """An invalid file: one stderr line with the file, the endpoint, the field and the rule; exit 1."""
    (tmp_path / "bad.toml").write_text('[endpoints."POST /pause_generation"]\nretry = { base_s = 2.0, cap_s = 0.5 }\n')
    result = run_cpr("policies", "--file", "bad.toml", cwd=tmp_path, timeout=60)
    assert result.returncode == 1
    [line] = error_lines(result.stderr)
    assert "bad.toml" in line and "POST /pause_generation" in line
    assert "RetryPolicy.cap_s must be >= base_s (2.0), but was 0.5" in line


def test_unknown_key_in_yaml_is_named(tmp_path: Path) -> None:
    """A misspelt key in a YAML file is named, with the keys allowed."""
    (tmp_path / "p.yaml").write_text("endpoints:\n  POST /flush_cache:\n    idempotnt: true\n")
    result = run_cpr("policies", "--file", "p.yaml", cwd=tmp_path, timeout=60)
    assert result.returncode == 1
    [line] = error_lines(result.stderr)
    assert "'idempotnt'" in line and "allowed:" in line


def test_valid_file_over_sglang_replaces_one_entry(tmp_path: Path) -> None:
    """--over-sglang shows SGLANG_POLICIES with the file's entry replacing its own."""
    (tmp_path / "p.toml").write_text('[endpoints."POST /pause_generation"]\nretry = { max_attempts = 9 }\n')
    result = run_cpr("policies", "--file", "p.toml", "--over-sglang", cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    rows = {row[0]: row for row in table_rows(result.stdout)}
    assert rows["POST /pause_generation"][2] == "9"
    assert "GET /health" in rows


def test_one_entry_is_singular(tmp_path: Path) -> None:
    """A file with one endpoint says "1 entry", not "1 entries"."""
    (tmp_path / "p.toml").write_text('[endpoints."POST /pause_generation"]\nidempotent = true\n')
    result = run_cpr("policies", "--file", "p.toml", cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "p.toml: valid, 1 entry" in result.stdout
    assert "entries" not in result.stdout


def test_override_over_sglang_keeps_the_built_in_timeouts(tmp_path: Path) -> None:
    """A file entry for POST /release_memory_occupation overrides the built-in one field by field: 120 s / 300 s stay."""
    (tmp_path / "p.toml").write_text('[endpoints."POST /release_memory_occupation"]\nretry = { max_attempts = 2 }\n')
    result = run_cpr("policies", "--file", "p.toml", "--over-sglang", cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    rows = {row[0]: row for row in table_rows(result.stdout)}
    post = rows["POST /release_memory_occupation"]
    assert (post[1], post[2], post[5], post[6]) == ("no", "2", "120", "300")
    assert rows["GET /release_memory_occupation"][2] == "6"  # the method the file did not name keeps the built-in policy


@pytest.mark.parametrize(
    ("name", "content", "fragment"),
    [
        ("bin.toml", b"\x00\xff\xfe\x89PNG\r\n", "bin.toml: not a text policy file"),
        ("d.toml", b"[defaults]\ndeadline_s = 60\n", "d.toml: [defaults] apply only to the endpoints"),
        ("t.yaml", b'endpoints:\n  POST /release:\n    idempotent: "no"\n', "EndpointPolicy.idempotent must be true or false"),
    ],
    ids=["binary", "defaults-only", "quoted-bool"],
)
def test_unusable_files_are_one_line_naming_the_file(tmp_path: Path, name: str, content: bytes, fragment: str) -> None:
    """A binary file, a file whose defaults apply to nothing, a quoted boolean: exit 1 with one line naming the file."""
    (tmp_path / name).write_bytes(content)
    result = run_cpr("policies", "--file", name, cwd=tmp_path, timeout=60)
    assert result.returncode == 1
    [line] = error_lines(result.stderr)
    assert fragment in line and "UnicodeDecodeError" not in line


def test_rows_say_when_the_callers_timeout_wins() -> None:
    """An entry that names no timeout is marked (the caller's timeout wins); one that names both is not."""
    from resilience.cli.render import policy_rows
    from resilience.policy import EndpointPolicy, PolicyTable

    table = PolicyTable({"POST /a": EndpointPolicy(idempotent=False), "POST /b": EndpointPolicy(attempt_timeout_s=5, deadline_s=20)})
    notes = {row[0]: row[-1] for row in policy_rows(table)}
    assert "attempt_timeout_s and deadline_s not named: the caller's timeout wins" in notes["POST /a"]
    assert "not named" not in notes["POST /b"]
