"""``cpr journal show``: a journal's records and what a restarted controller would know, read beside the live writer."""

from __future__ import annotations

from pathlib import Path

from resilience.barrier.journal import Journal
from resilience.barrier.state import EngineKnowledge
from tests.cli.cpr_testlib import error_lines, run_cpr, table_rows

A, B = "http://127.0.0.1:31001", "http://127.0.0.1:31002"


def test_show_lists_each_record_and_the_state_a_new_controller_would_resume(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "run.journal")
    journal.open([A, B])
    paused = {n: EngineKnowledge(n, paused=True, flushed=True) for n in (A, B)}
    journal.commit(paused, [A, B], "flush outcome")
    paused[A].released = {"kv_cache", "weights", "cuda_graph"}
    paused[B].unknown = {"kv_cache"}
    journal.commit(paused, [A, B], "release outcome")
    try:  # the writer still holds the journal open: show must not need its lock
        out = run_cpr("journal", "show", str(tmp_path / "run.journal"), cwd=tmp_path)
    finally:
        journal.close()
    assert out.returncode == 0, out.stderr
    rows = table_rows(out.stdout)
    records = [r for r in rows if len(r) == 6]
    final = {r[0]: r for r in rows if len(r) == 3}
    assert [(r[2], r[3], r[4]) for r in records] == [
        ("flush outcome", A, "flushed"),
        ("flush outcome", B, "flushed"),
        ("release outcome", A, "released"),
        ("release outcome", B, "quarantined"),
    ]
    assert final[A][1] == "released" and "released cuda_graph,kv_cache,weights" in final[A][2]
    assert final[B][1] == "quarantined" and "unknown kv_cache" in final[B][2]


def test_show_names_a_torn_tail_and_a_file_that_is_not_a_journal(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "run.journal")
    journal.open([A])
    journal.commit({A: EngineKnowledge(A, paused=True)}, [A], "pause outcome")
    journal.close()
    with open(tmp_path / "run.journal", "ab") as fh:
        fh.write(b"0badc0de {")
    out = run_cpr("journal", "show", str(tmp_path / "run.journal"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "ignored the last 10 byte(s) after record 2" in " ".join(out.stdout.split())
    (tmp_path / "other").write_text("hello\n")
    bad = run_cpr("journal", "show", str(tmp_path / "other"), cwd=tmp_path)
    assert bad.returncode == 1 and error_lines(bad.stderr) == [
        f"cpr journal: error: {tmp_path / 'other'} is not a barrier journal (no controlplane-resilience/barrier-journal header)"
    ]
    missing = run_cpr("journal", "show", str(tmp_path / "nope"), cwd=tmp_path)
    assert missing.returncode == 1 and "cannot read journal" in missing.stderr


def test_show_keeps_credentials_and_query_tokens_of_engine_names_out(tmp_path: Path) -> None:
    """An engine named by a URL with user:password@ and ?token=: shown as scheme://host:port/path only."""
    secret = "http://ops:hunter2@127.0.0.1:31003/?token=tok-123"
    journal = Journal(tmp_path / "run.journal")
    journal.open([secret])
    journal.commit({secret: EngineKnowledge(secret, paused=True)}, [secret], "pause outcome")
    journal.close()
    out = run_cpr("journal", "show", str(tmp_path / "run.journal"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "hunter2" not in out.stdout and "tok-123" not in out.stdout and "ops:" not in out.stdout
    assert "http://127.0.0.1:31003/" in " ".join(out.stdout.split())
