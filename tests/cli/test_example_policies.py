"""The shipped example policy files: they load, say the same in TOML and YAML, name every knob, and are the docs'."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from resilience.policy import EndpointPolicy, RetryPolicy
from resilience.policy_files import load_policy_file
from tests.cli.cpr_testlib import run_cpr, table_rows

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = [ROOT / "examples" / "policies.toml", ROOT / "examples" / "policies.yaml"]


def test_toml_and_yaml_examples_give_the_same_table() -> None:
    """Both files load without error and give the same five entries, in the same order."""
    toml, yaml = (load_policy_file(p) for p in EXAMPLES)
    assert len(toml) == 5
    assert list(toml) == list(yaml)
    release = toml.match("POST", "/release_memory_occupation").policy
    assert not release.idempotent and release.retry_statuses_if_not_idempotent
    assert toml.match("GET", "/health").policy.accept_statuses == frozenset({503})


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.suffix)
def test_example_names_every_field(path: Path) -> None:
    """Each example sets every EndpointPolicy and RetryPolicy field a file can set (a new field must be shown too)."""
    text = path.read_text(encoding="utf-8")
    fields = {f.name for f in dataclasses.fields(EndpointPolicy)} | {f.name for f in dataclasses.fields(RetryPolicy)}
    assert len(fields) > 10
    missing = sorted(name for name in fields if not re.search(rf"\b{name}\b\s*[=:]", text))
    assert missing == []


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.suffix)
def test_docs_show_the_example_file_itself(path: Path) -> None:
    """docs/policy-files.md shows the shipped file itself, byte for byte (an inlined copy: the page reads whole on the forge)."""
    page = (ROOT / "docs" / "policy-files.md").read_text(encoding="utf-8")
    fence = "toml" if path.suffix == ".toml" else "yaml"
    blocks = re.findall(rf"```{fence}\n(.*?)```", page, flags=re.S)
    assert path.read_text(encoding="utf-8") in blocks


def test_cpr_policies_validates_the_example(tmp_path: Path) -> None:
    """``cpr policies --file examples/policies.toml`` accepts it and shows its five entries."""
    pytest.importorskip("rich")
    result = run_cpr("policies", "--file", str(EXAMPLES[0]), cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "valid, 5 entries" in result.stdout
    assert {row[0] for row in table_rows(result.stdout)} >= {"POST /pause_generation", "GET /health"}
