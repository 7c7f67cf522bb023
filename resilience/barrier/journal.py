"""The barrier's journal: what the orchestrator knows of each engine, written where it outlives the controller.

``Orchestrator(groups, journal=PATH)`` (and ``AsyncOrchestrator``) writes a record before each command is sent, with the
facts it may change already marked unknown (the write-ahead intent), and another once its outcome is folded in; also on
every hold, reconcile and membership change. A new orchestrator on the same journal resumes every engine's knowledge,
holds (with their owners: ``Recovery.orphaned_holds`` names those whose process is gone), retirements, membership and
restart budget from the last complete record; a call in flight when the controller died reads as "ambiguous". A record
is durable when ``commit`` returns; a commit that raises wrote nothing that counts.

A record is one JSON object (framed and checksummed by the store, ``resilience.barrier.journal_store``):

- ``{"k": "header", "format": ..., "version": 1, "engines": [...]}``: first, once;
- ``{"k": "member", "engine": name, "change": ..., "group": ..., "facts": {...}}``: a membership change
  (``MEMBER_CHANGES``: ``joining`` before a join's first command, ``joined``, ``fenced``, ``left`` on retire;
  ``resilience.barrier.membership``), with the engine's facts then (and ``"budget"`` when it changed);
- ``{"k": "state", "why": ..., "engines": {name: facts}, "owners": {...}, "budget": {...}}``: the facts of the engines
  that changed, ``why`` says which step wrote it. An owner is ``{"host", "pid", "id", "start", "boot"}``: a random id of
  the process, its start time and the boot id tell it from a later process with the same PID (owners of older writers
  have host and PID only, and are judged by the PID).

An engine with unknown tags also has ``"doubt": {"method", "in_transit", "delivery"}`` in its facts (``state.Doubt``); a
record without it (an older writer) reads as a doubt whose request may still be on its way (the safe reading). The
journal is compacted (a header, naming every engine and the last membership change of each, and one full state record)
every ``compact_after`` records.

The run's ``RestartBudget`` is here too: restarts outlive the controller as the journal does (its own JSON file, and a
copy in the journal's records).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from resilience.barrier.journal_store import FileJournalStore, JournalBusy, JournalError, JournalStore, unframe
from resilience.barrier.state import Doubt, Effect, EngineKnowledge
from resilience.engine_contract import MEMORY_MODELS, SGLANG_MEMORY, MemoryModel
from resilience.errors import ConfigError, finite_number, integer, require
from resilience.events import Event, Observer, emit

__all__ = [
    "FORMAT", "Journal", "JournalBusy", "JournalError", "JournalMismatch", "Recovery", "RestartBudget", "RestartBudgetError",
    "RestartRecord", "RestartRecorded", "Resumed", "facts_of", "knowledge_from", "open_journal",
]

FORMAT = "controlplane-resilience/barrier-journal"
MEMBER_CHANGES = ("joining", "joined", "fenced", "left")
"""The membership changes a ``member`` record holds (``resilience.barrier.membership``)."""
JOINING, JOINED, FENCED, LEFT = MEMBER_CHANGES
OFFLOAD_TOKEN = 0
"""The offload hold's id (``resilience.barrier.state``): it belongs to whichever controller runs, so it has no owner."""
_VERSION = 1
_LOG = logging.getLogger("resilience.barrier.journal")


class JournalMismatch(JournalError):
    """The journal was written for other engines than the ones the orchestrator was given."""


_PROCESS_IDS: dict[int, str] = {}
"""A random id per process (keyed by PID, so a forked child gets its own): which process wrote a hold, beyond its PID."""


def _process_id() -> str:
    return _PROCESS_IDS.setdefault(os.getpid(), secrets.token_hex(8))


def _boot_id() -> str | None:
    """The kernel's boot id (Linux), None where there is none: a PID from before a reboot names another process."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _started(pid: int) -> str | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/PID/stat`` field 22; Linux), None where unreadable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # the command name, in parentheses, may hold spaces
    return fields[19] if len(fields) > 19 else None


def _me() -> dict[str, Any]:
    """Who writes: host and PID, and what tells this process from a later one with the same PID on the same host
    (a restarted container's controller is PID 1 again): a random id, the process's start time, the boot id."""
    pid = os.getpid()
    return {"host": os.uname().nodename, "pid": pid, "id": _process_id(), "start": _started(pid), "boot": _boot_id()}


def facts_of(k: EngineKnowledge, *, retired: bool = False) -> dict[str, Any]:
    """An engine's knowledge as JSON-ready facts (a late call becomes the name of its method; a doubt, when tags are unknown)."""
    facts: dict[str, Any] = {
        "paused": k.paused,
        "flushed": k.flushed,
        "pause_mode": k.pause_mode,
        "released": sorted(k.released),
        "unknown": sorted(k.unknown),
        "dead": k.dead,
        "holds": {str(i): r for i, r in sorted(k.holds.items())},
        "in_flight": _in_flight(k),
        "retired": retired,
    }
    if k.memory.kind != SGLANG_MEMORY.kind:  # SGLang's facts keep the shape they always had (no "kind": SGLang)
        facts["kind"] = k.memory.kind
    if k.unknown and k.doubt is not None:
        facts["doubt"] = {"method": k.doubt.method, "in_transit": k.doubt.in_transit, "delivery": k.doubt.delivery}
    return facts


def _in_flight(k: EngineKnowledge) -> dict[str, Any] | None:
    call = k.in_flight if k.in_flight is not None else k.pending
    return None if call is None else {"method": call.method, "kwargs": dict(call.kwargs)}


def knowledge_from(name: str, facts: Mapping[str, Any], memory: MemoryModel | None = None) -> EngineKnowledge:
    """The knowledge a journal's facts describe.

    ``memory``: the engine's memory model (default: the kind the facts name, else SGLang's).
    A call that was in flight is gone with its process; its facts were already written as "ambiguous"
    before it was sent, and are made so again here (marking it ambiguous again is idempotent), so a record written by an
    older writer, or one cut short between the mark and its record, can never read as "not applied".
    """
    if memory is None:  # the kind the facts name (``cpr journal show``); SGLang's when they name none
        memory = MEMORY_MODELS.get(str(facts.get("kind", SGLANG_MEMORY.kind)), SGLANG_MEMORY)
    paused = facts.get("paused")
    k = EngineKnowledge(
        name,
        paused=paused if paused is None else bool(paused),
        flushed=bool(facts.get("flushed", False)),
        pause_mode=facts.get("pause_mode"),
        released=set(facts.get("released", ())),
        unknown=set(facts.get("unknown", ())),
        dead=facts.get("dead"),
        holds={int(i): str(r) for i, r in dict(facts.get("holds", {})).items()},
        memory=memory,
    )
    doubt = facts.get("doubt")
    if isinstance(doubt, Mapping):
        method = doubt.get("method")
        k.doubt = Doubt(None if method is None else str(method), bool(doubt.get("in_transit", True)), str(doubt.get("delivery", "")))
    call = facts.get("in_flight")
    if isinstance(call, Mapping):
        method = str(call.get("method"))
        k.apply(method, dict(call.get("kwargs") or {}), Effect.AMBIGUOUS)
        if k.unknown and method in ("release_memory_occupation", "resume_memory_occupation"):
            k.doubt = Doubt(method, True, "in flight when the last controller stopped")
    if k.unknown and k.doubt is None:
        k.doubt = Doubt(None, True, "unknown in a journal that kept no reason")
    return k


@dataclass(frozen=True)
class Recovery:
    """What an orchestrator found in its journal when it started.

    ``resumed``: False for a new (empty) journal. ``records``: complete records read. ``dropped``: what a torn last
    record was (None when none; a corrupt record refuses the open). ``in_flight``: engine -> the call that was in flight
    when the last controller stopped (now "ambiguous"). ``orphaned_holds``: engine -> holds whose owner process is gone
    (``reason (pid P on HOST, gone)``: no process has that PID, or the one that has it is another process: another
    start, boot or id); they keep the engine paused until you ``unpause`` them. ``states``: engine -> its state word.
    ``members``: who joined and who left (below).
    """

    store: str
    resumed: bool = False
    records: int = 0
    dropped: str | None = None
    in_flight: Mapping[str, str] = field(default_factory=dict)
    orphaned_holds: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    states: Mapping[str, str] = field(default_factory=dict)
    members: Mapping[str, str] = field(default_factory=dict)
    """Engine -> its last membership change (``joining``, ``joined``, ``fenced``, ``left``), for the engines that joined
    or left while the journal was written (empty for a fixed fleet)."""

    def summary(self) -> str:
        """One paragraph for a person."""
        if not self.resumed:
            return f"journal {self.store}: new"
        parts = [f"journal {self.store}: resumed from {self.records} record(s)"]
        if self.dropped:
            parts.append(self.dropped)
        if self.in_flight:
            parts.append("in flight at the last stop (ambiguous): " + ", ".join(f"{n} {m}" for n, m in sorted(self.in_flight.items())))
        if self.members:
            parts.append("membership: " + ", ".join(f"{n} {c}" for n, c in sorted(self.members.items())))
        if self.orphaned_holds:
            parts.append("holds whose owner is gone: " + ", ".join(f"{n} {'; '.join(h)}" for n, h in sorted(self.orphaned_holds.items())))
        return "; ".join(parts)


@dataclass(frozen=True)
class Resumed:
    """What ``Journal.open`` read: the ``Recovery`` report, each engine's knowledge (engines with no record are left out),
    the retired engines, and the restart budget's state (None when the journal never saw one)."""

    recovery: Recovery
    knowledge: Mapping[str, EngineKnowledge] = field(default_factory=dict)
    retired: frozenset[str] = frozenset()
    budget: Mapping[str, Any] | None = None


@dataclass
class _Folded:
    engines: list[str] | None = None
    facts: dict[str, dict[str, Any]] = field(default_factory=dict)
    owners: dict[str, dict[str, Any]] = field(default_factory=dict)
    budget: dict[str, Any] | None = None
    members: dict[str, str] = field(default_factory=dict)


def _fold(payloads: Iterable[bytes], where: str) -> _Folded:
    out = _Folded()
    for i, payload in enumerate(payloads):
        try:
            rec = json.loads(payload)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise JournalError(f"journal {where}: record {i} passes its checksum but is not JSON ({exc})") from exc
        if i == 0:
            if not isinstance(rec, dict) or rec.get("k") != "header" or rec.get("format") != FORMAT:
                raise JournalError(f"journal {where} is not a {FORMAT} journal (its first record is not our header); refusing to use it")
            if rec.get("version") != _VERSION:
                raise JournalError(f"journal {where} has version {rec.get('version')!r}, expected {_VERSION}")
            out.engines = [str(e) for e in rec.get("engines", [])]
            out.members = {str(n): str(c) for n, c in dict(rec.get("members", {})).items()}
            continue
        kind = rec.get("k") if isinstance(rec, dict) else type(rec).__name__
        if kind == "member":
            change, name = str(rec.get("change")), str(rec.get("engine"))
            if change not in MEMBER_CHANGES:
                raise JournalError(f"journal {where}: record {i} has unknown membership change {change!r}")
            out.members[name] = change
            out.facts[name] = dict(rec.get("facts", {}))
        elif kind == "state":
            for name, facts in dict(rec.get("engines", {})).items():
                out.facts[name] = dict(facts)
            out.owners.update(dict(rec.get("owners", {})))
        else:
            raise JournalError(f"journal {where}: record {i} has unknown kind {kind!r}")
        if rec.get("budget") is not None:
            out.budget = dict(rec["budget"])
    return out


def read_journal(store: JournalStore) -> tuple[_Folded, int, str | None]:
    """Fold a store's records (for ``cpr journal show``); (folded, records, dropped)."""
    loaded = store.load()
    return _fold(loaded.records, store.name), len(loaded.records), loaded.dropped


def _alive(owner: Mapping[str, Any]) -> bool | None:
    """True/False when the owner process is known alive/gone on this host; None when it lives on another host
    (docs/failure-and-recovery.md, "Whose holds are orphaned": this PID with another id, or a PID another process now
    has, is gone; an owner with no id is judged by its PID alone)."""
    if owner.get("host") != os.uname().nodename:
        return None
    try:
        pid = int(owner["pid"])
    except (KeyError, ValueError, TypeError):
        return True
    if "id" in owner:
        if owner["id"] == _process_id() and pid == os.getpid():
            return True
        if pid == os.getpid():
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    boot, start = owner.get("boot"), owner.get("start")
    if boot is not None and _boot_id() not in (None, boot):
        return False
    return not (start is not None and _started(pid) not in (None, start))


class Journal:
    """The barrier's durable knowledge, over a ``JournalStore``.

    ``store``: where the records live (a path gives a ``FileJournalStore``). ``compact_after``: records written before
    the journal is rewritten as one snapshot (default 2000; each record holds only the engines that changed).
    """

    def __init__(self, store: JournalStore | str | os.PathLike[str], *, compact_after: int = 2000) -> None:
        if compact_after < 2:
            raise JournalError(f"Journal.compact_after must be >= 2, but was {compact_after!r}")
        self.store: JournalStore = store if isinstance(store, JournalStore) else FileJournalStore(store)
        self.compact_after = compact_after
        self._engines: tuple[str, ...] = ()
        self._written = 0
        self._owners: dict[str, dict[str, Any]] = {}
        self._budget: dict[str, Any] | None = None
        self._last: dict[str, dict[str, Any]] = {}
        self._members: dict[str, str] = {}

    @property
    def name(self) -> str:
        """Where the journal lives."""
        return self.store.name

    @staticmethod
    def read_only(path: str | os.PathLike[str]) -> dict[str, EngineKnowledge]:
        """What a controller started on the journal file at ``path`` would know of each engine now, read without its lock."""
        loaded = unframe(Path(path).read_bytes(), str(path))
        folded = _fold(loaded.records, str(path))
        return {n: knowledge_from(n, f) for n, f in folded.facts.items()}

    def open(self, engines: Sequence[str], kinds: Mapping[str, MemoryModel] | None = None) -> Resumed:
        """Read the journal for ``engines``: what it recovered, each engine's knowledge, the retired ones, the budget.

        ``kinds``: each engine's memory model (default SGLang's for all): the knowledge is rebuilt with it. An empty or
        missing journal gets its header (written whole). A journal for other engines, or kinds, raises
        ``JournalMismatch``; a torn last record is described in ``Recovery.dropped`` (and logged), then cut off; a
        damaged record, or a file that does not start with our header, raises ``JournalError`` and is left as it was.
        """
        kinds = kinds or {}
        self._engines = tuple(engines)
        loaded = self.store.load()
        if not loaded.records:
            if loaded.dropped:  # our header is written whole (a rewrite): bytes without one are not a journal
                raise JournalError(
                    f"journal {self.store.name} is not a {FORMAT} journal: it holds no complete record ({loaded.dropped}); "
                    "refusing to use it, and the file is left as it was. Give journal= a new file, or an empty one"
                )
            self.store.rewrite([self._header()])  # atomic: a crash leaves no file or a whole header, never a torn one
            self._written = 1
            return Resumed(Recovery(self.store.name))
        folded = _fold(loaded.records, self.store.name)
        assert folded.engines is not None
        left = {n for n, c in folded.members.items() if c == "left"}
        named = (set(folded.engines) | set(folded.members)) - left
        if not named <= set(engines) <= named | left:
            missing = sorted(named - set(engines))
            extra = sorted(set(engines) - named - left)
            joined = [n for n in missing if n in folded.members]
            raise JournalMismatch(
                f"journal {self.store.name} was written for other engines: it names {len(named)} "
                f"({'not given: ' + ', '.join(missing) if missing else 'all given'}; "
                f"{'not in the journal: ' + ', '.join(extra) if extra else 'none new'}). "
                + (f"{', '.join(joined)} joined while it was written (add): give them too. " if joined else "")
                + "Use a new journal for a new fleet, or give the orchestrator the engines the journal knows."
            )
        self._members = dict(folded.members)
        self._owners, self._budget = folded.owners, folded.budget
        if loaded.dropped:
            _LOG.warning("%s", loaded.dropped)
        given = set(engines)
        for n, f in folded.facts.items():
            if n not in given:
                continue  # one that left (retire) is not rebuilt: its kind is not asked
            written, now = str(f.get("kind", SGLANG_MEMORY.kind)), kinds.get(n, SGLANG_MEMORY).kind
            if written != now:
                raise JournalMismatch(f"journal {self.store.name}: engine {n} was journaled as a {written} engine, but is a {now} engine")
        knowledge = {n: knowledge_from(n, f, kinds.get(n, SGLANG_MEMORY)) for n, f in folded.facts.items() if n in given}
        in_flight = {n: str(f["in_flight"].get("method")) for n, f in folded.facts.items() if isinstance(f.get("in_flight"), Mapping)}
        orphaned: dict[str, tuple[str, ...]] = {}
        for n, k in knowledge.items():
            gone = []
            for token, reason in sorted(k.holds.items()):
                owner = self._owners.get(str(token))
                if owner is not None and _alive(owner) is False:
                    gone.append(f"{reason} (pid {owner.get('pid')} on {owner.get('host')}, gone)")
            if gone:
                orphaned[n] = tuple(gone)
        states = {n: str(k.state) for n, k in knowledge.items()}
        recovery = Recovery(
            self.store.name,
            resumed=True,
            records=len(loaded.records),
            dropped=loaded.dropped,
            in_flight=in_flight,
            orphaned_holds=orphaned,
            states=states,
            members=dict(folded.members),
        )
        self._last = {n: dict(f) for n, f in folded.facts.items()}
        if loaded.dropped or len(loaded.records) >= self.compact_after:
            self._compact()
        else:
            self._written = len(loaded.records)
        if in_flight or orphaned:
            _LOG.warning("%s", recovery.summary())
        retired = frozenset(n for n, f in folded.facts.items() if f.get("retired") and n in given)
        return Resumed(recovery, knowledge, retired, folded.budget)

    def commit(
        self,
        know: Mapping[str, EngineKnowledge],
        names: Collection[str],
        why: str,
        *,
        retired: Collection[str] = (),
        budget: RestartBudget | None = None,
    ) -> None:
        """Write the facts of ``names`` (those that changed since the last record) durably, with ``why``."""
        changed: dict[str, dict[str, Any]] = {}
        for n in names:
            facts = facts_of(know[n], retired=n in retired)
            if self._last.get(n) != facts:
                changed[n] = facts
        owners: dict[str, dict[str, Any]] = {}
        for n in names:
            for token in know[n].holds:
                if token != OFFLOAD_TOKEN and str(token) not in self._owners:
                    owners[str(token)] = _me()
        budget_state = self._budget_change(budget)
        if not changed and not owners and budget_state is None:
            return
        rec: dict[str, Any] = {"k": "state", "t": time.time(), "why": why, "engines": changed}
        if owners:
            rec["owners"] = owners
        if budget_state is not None:
            rec["budget"] = budget_state
        self.store.append(_dump(rec))  # raises when the record is not durable: then nothing below is marked written
        self._last.update(changed)
        self._owners.update(owners)
        if budget_state is not None:
            self._budget = budget_state
        self._count_written()

    def _budget_change(self, budget: RestartBudget | None) -> dict[str, Any] | None:
        """The restart budget's state to write: None when there is none, or it is what the journal last holds."""
        budget_state = _budget_state(budget)
        return None if budget_state == self._budget else budget_state

    def _count_written(self) -> None:
        """One more durable record: compact once ``compact_after`` records were written since the last compaction."""
        self._written += 1
        if self._written >= self.compact_after:
            try:
                self._compact()
            except JournalError as exc:  # the record written is durable; the journal is as it was, and compacts next time
                _LOG.warning("%s", exc)

    def member(
        self,
        name: str,
        change: str,
        group: str,
        know: Mapping[str, EngineKnowledge],
        *,
        retired: Collection[str] = (),
        budget: RestartBudget | None = None,
    ) -> None:
        """Write durably that ``name`` (of the group named ``group``) had the membership change ``change``
        (``MEMBER_CHANGES``), with its facts now (and the restart budget, when it changed); ``Recovery.members`` gives it back."""
        if change not in MEMBER_CHANGES:
            raise JournalError(f"Journal.member change must be one of {', '.join(MEMBER_CHANGES)}, but was {change!r}")
        facts = facts_of(know[name], retired=name in retired)
        rec: dict[str, Any] = {"k": "member", "t": time.time(), "engine": name, "change": change, "group": group, "facts": facts}
        budget_state = self._budget_change(budget)
        if budget_state is not None:
            rec["budget"] = budget_state
        self.store.append(_dump(rec))  # raises when the record is not durable: then nothing below is marked written
        self._last[name] = facts
        if budget_state is not None:
            self._budget = budget_state
        self._members[name] = change
        if name not in self._engines:
            self._engines = (*self._engines, name)
        self._count_written()

    def _header(self) -> bytes:
        """The header record: the engines, and the last membership change of each that had one."""
        header = {"k": "header", "format": FORMAT, "version": _VERSION, "engines": list(self._engines), "t": time.time(), "by": _me()}
        return _dump({**header, "members": dict(self._members)} if self._members else header)

    def _compact(self) -> None:
        snapshot: dict[str, Any] = {"k": "state", "t": time.time(), "why": "compacted", "engines": self._last, "owners": self._owners}
        if self._budget is not None:
            snapshot["budget"] = self._budget
        self.store.rewrite([self._header(), _dump(snapshot)])
        self._written = 2

    def close(self) -> None:
        """Let go of the store."""
        self.store.close()


@dataclass(frozen=True, slots=True, kw_only=True)
class RestartRecorded(Event):
    """The caller recorded a restart in a ``RestartBudget``."""

    cause: str
    step: int | None
    used: int
    limit: int

    @property
    def remaining(self) -> int:
        """Restarts left before the budget is spent (never negative)."""
        return max(0, self.limit - self.used)


class RestartBudgetError(ValueError):
    """A restart-budget file is unreadable, corrupt or belongs to something else."""


_BUDGET_FORMAT = "controlplane-resilience/restart-budget"
_BUDGET_VERSION = 1


@dataclass(frozen=True, slots=True)
class RestartRecord:
    """One recorded restart."""

    cause: str
    at: float
    """Wall-clock seconds since the epoch."""
    step: int | None = None


class RestartBudget:
    """A run's allowed restarts: record each with its cause, read what is left. It never restarts anything.

    ``limit`` is the number of restarts the run may take (the seed's
    ``max_global_restart=3``). ``path`` (optional) is a JSON file that keeps
    the record across the very restarts it counts: loaded when it exists,
    replaced atomically on each record; a corrupt or foreign file raises
    ``RestartBudgetError``, never a silent reset. ``planned_run_seconds`` is
    the planned run length burn rates are measured against (default 24 h).
    """

    def __init__(
        self,
        limit: int = 3,
        *,
        path: str | os.PathLike[str] | None = None,
        planned_run_seconds: float = 86400.0,
        observers: Sequence[Observer] = (),
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        require(integer(limit) and limit >= 0, "RestartBudget", "limit", "an integer >= 0", limit)
        ok = finite_number(planned_run_seconds) and planned_run_seconds > 0
        require(ok, "RestartBudget", "planned_run_seconds", "a finite number > 0", planned_run_seconds)
        self._limit = limit
        self._planned_run_seconds = planned_run_seconds
        self.path = Path(path) if path is not None else None
        self._observers = tuple(observers)
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        self._restarts = self._load(self.path) if self.path is not None and self.path.exists() else []

    @staticmethod
    def _load(path: Path) -> list[RestartRecord]:
        try:
            raw: Any = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RestartBudgetError(f"restart budget file {path} is unreadable or not JSON: {exc}") from exc
        if not isinstance(raw, dict) or raw.get("format") != _BUDGET_FORMAT:
            raise RestartBudgetError(
                f"restart budget file {path} is not a {_BUDGET_FORMAT} file (format field was "
                f"{raw.get('format') if isinstance(raw, dict) else type(raw).__name__!r}); refusing to overwrite it"
            )
        if raw.get("version") != _BUDGET_VERSION:
            raise RestartBudgetError(f"restart budget file {path} has version {raw.get('version')!r}, expected {_BUDGET_VERSION}")
        entries = raw.get("restarts")
        if not isinstance(entries, list):
            raise RestartBudgetError(f"restart budget file {path}: 'restarts' must be a list")
        records = []
        for i, entry in enumerate(entries):
            try:
                step = entry.get("step")
                records.append(RestartRecord(cause=str(entry["cause"]), at=float(entry["at"]), step=None if step is None else int(step)))
            except (AttributeError, KeyError, TypeError, ValueError) as exc:
                raise RestartBudgetError(f"restart budget file {path}: restarts[{i}] is malformed: {exc!r}") from exc
        return records

    def _save(self) -> None:
        if self.path is None:
            return
        payload = {
            "format": _BUDGET_FORMAT,
            "version": _BUDGET_VERSION,
            "limit": self._limit,
            "planned_run_seconds": self._planned_run_seconds,
            "restarts": [asdict(r) for r in self._restarts],
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(payload, fh, indent=2)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @property
    def limit(self) -> int:
        """Restarts the run may take."""
        return self._limit

    @property
    def planned_run_seconds(self) -> float:
        """The planned run length burn rates are measured against."""
        return self._planned_run_seconds

    @property
    def records(self) -> tuple[RestartRecord, ...]:
        """Every restart recorded, oldest first (including earlier processes')."""
        with self._lock:
            return tuple(self._restarts)

    @property
    def used(self) -> int:
        """Restarts recorded so far."""
        return len(self.records)

    @property
    def remaining(self) -> int:
        """Restarts left (never negative)."""
        return max(0, self._limit - self.used)

    def record(self, cause: str, *, step: int | None = None) -> RestartRecord:
        """Record a restart the caller decided to take; persist it first, then announce it."""
        if not cause:
            raise ConfigError("RestartBudget.record: cause must be a non-empty string")
        rec = RestartRecord(cause=cause, at=self._wall_clock(), step=step)
        with self._lock:
            self._restarts.append(rec)
            try:
                self._save()
            except BaseException:
                self._restarts.pop()
                raise
            used = len(self._restarts)
        emit(self._observers, RestartRecorded(cause=cause, step=step, used=used, limit=self._limit))
        return rec

    def restore(self, records: Sequence[RestartRecord]) -> int:
        """Add the restarts in ``records`` that this budget lacks (a journal's copy, after a controller restart); returns how many.

        Nothing is announced (they were when they happened); the file, when there is one, is rewritten."""
        with self._lock:
            known = set(self._restarts)
            new = [r for r in records if r not in known]
            if new:
                self._restarts.extend(new)
                self._restarts.sort(key=lambda r: r.at)
                self._save()
            return len(new)

    def causes(self) -> dict[str, int]:
        """Restarts per cause."""
        return dict(Counter(rec.cause for rec in self.records))


def _budget_state(budget: RestartBudget | None) -> dict[str, Any] | None:
    if budget is None:
        return None
    return {"limit": budget.limit, "restarts": [{"cause": r.cause, "at": r.at, "step": r.step} for r in budget.records]}


def restore_budget(budget: RestartBudget | None, state: Mapping[str, Any] | None) -> RestartBudget | None:
    """The restart budget a journal recorded: merged into ``budget`` (restarts it lacks), or built from the journal."""
    if state is None:
        return budget
    records = [RestartRecord(cause=str(r["cause"]), at=float(r["at"]), step=r.get("step")) for r in state.get("restarts", [])]
    if budget is None:
        budget = RestartBudget(int(state.get("limit", 3)))
    budget.restore(records)
    return budget


def open_journal(journal: Journal | JournalStore | str | os.PathLike[str]) -> Journal:
    """A ``Journal`` from what an orchestrator was given: a journal, a store, or a path."""
    return journal if isinstance(journal, Journal) else Journal(journal)


def _dump(rec: Mapping[str, Any]) -> bytes:
    return json.dumps(rec, separators=(",", ":"), sort_keys=True).encode()
