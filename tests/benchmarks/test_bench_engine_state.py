"""Smoke test of ``benchmarks/bench_engine_state.py`` at tiny sizes: both tables print every row, and the bound holds.

No figure is judged (speed targets belong to BENCHMARKS.md), except the series count, which is a count, not a time:
every fleet size up to the bound has one ``cpr_engine_state`` series per engine, and the 1024-engine fleet no more
than the bound plus its one folded ``other`` series.
"""

from __future__ import annotations

from tests.benchmarks.test_bench_smoke import _positive, _run


def test_engine_state_bench_prints_series_per_fleet_size_and_the_journal_times() -> None:
    out = _run("bench_engine_state.py", "--scrapes", "2", "--commits", "5")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    scrape = {int(r[0]): r for r in rows if r[0].isdigit()}
    assert sorted(scrape) == [8, 64, 256, 1024]
    for n in (8, 64, 256):
        assert int(scrape[n][1]) == n
    assert int(scrape[1024][1]) == 257  # 256 named engines + engine="other" (all serving, one kind)
    for r in scrape.values():
        _positive(r[2])
        _positive(r[3])
    journal = {r[0]: r[1] for r in rows if not r[0].isdigit() and r[0] not in ("engines", "journal append (FileJournalStore, fsync)")}
    assert len(journal) == 3, rows
    for cell in journal.values():
        _positive(cell)
