"""The ``JournalStore`` contract, run on every store: ``FileJournalStore`` and ``RayKVJournalStore`` (Ray's GCS KV).

Each store, where the fault applies to it: records read back in order across store objects; a write that fails
raises ``JournalError`` and leaves the records as they were (or, where the write may have landed, with that record
whole and in its place); a damaged record before the last is refused, naming it; of two controllers on one journal
at most one writes. Ray's own: a link to a generation with no records, a compaction cut between its seal and its
link. Ray runs once for the module (``ray_runtime``, RAY_AUTH_MODE=disabled); its tests are the few here.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from resilience.barrier.journal import Journal, JournalError
from resilience.barrier.journal_store import FileJournalStore, JournalBusy, JournalStore, RayKVJournalStore, unframe
from resilience.barrier.state import EngineKnowledge
from tests.barrier.journal_faults import FaultyOS

ENGINES = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
_KEYS = itertools.count()


class FlakyKV:
    """Ray's internal KV, whose next ``fail`` puts (of keys containing ``match``) raise; ``land``: after reaching the GCS."""

    def __init__(self) -> None:
        from ray.experimental import internal_kv

        self.kv = internal_kv
        self.fail = 0
        self.land = False
        self.match = b""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kv, name)

    def _internal_kv_put(self, key: bytes, value: bytes, overwrite: bool = True, *, namespace: Any = None) -> bool:
        if self.fail and self.match in key:
            self.fail -= 1
            if self.land:
                self.kv._internal_kv_put(key, value, overwrite, namespace=namespace)
            raise RuntimeError("injected: the GCS did not answer the put")
        existed: bool = self.kv._internal_kv_put(key, value, overwrite, namespace=namespace)
        return existed


class Backend:
    """How one kind of store is opened, broken and damaged in these tests."""

    def __init__(self, kind: str, tmp_path: Path) -> None:
        self.kind = kind
        self.where = str(tmp_path / "journal") if kind == "file" else f"contract-{next(_KEYS)}-{id(tmp_path)}"
        self.layer = FaultyOS()
        self.kv: FlakyKV | None = FlakyKV() if kind == "ray" else None

    def open(self) -> JournalStore:
        if self.kind == "file":
            return FileJournalStore(self.where, syscalls=self.layer)
        return RayKVJournalStore(self.where, kv=self.kv)

    def fail_next_write(self, *, landed: bool) -> None:
        """The next write fails: before anything landed, or (``landed``) once its bytes reached the store."""
        if self.kv is None:
            self.layer.arm({("fsync", 0): "EIO"} if landed else {("write", 0): "ENOSPC"})
        else:
            self.kv.fail, self.kv.land, self.kv.match = 1, landed, b"/g/"

    def damage(self, record: int) -> None:
        """Replace record ``record``'s stored bytes with others of the same length (a flipped bit)."""
        if self.kind == "file":
            path = Path(self.where)
            lines = path.read_bytes().splitlines(keepends=True)
            lines[record] = lines[record][:10] + bytes([lines[record][10] ^ 0x01]) + lines[record][11:]
            path.write_bytes(b"".join(lines))
            return
        from ray.experimental import internal_kv

        key = f"{self.where}/g/0/{record:012d}".encode()
        value = bytearray(internal_kv._internal_kv_get(key, namespace="controlplane-resilience"))
        value[10] ^= 0x01
        internal_kv._internal_kv_put(key, bytes(value), True, namespace="controlplane-resilience")


@pytest.fixture(params=["file", "ray"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "ray":
        request.getfixturevalue("ray_runtime")
    yield Backend(request.param, tmp_path)


def _records(backend: Backend) -> list[bytes]:
    store = backend.open()
    try:
        return list(store.load().records)
    finally:
        store.close()


def _filled(backend: Backend, n: int = 3) -> JournalStore:
    store = backend.open()
    store.load()
    for i in range(n):
        store.append(b'{"i":%d}' % i)
    return store


def test_records_read_back_in_order_across_store_objects(backend: Backend) -> None:
    """Appends and a rewrite, then a new store object on the same journal: the same records, in order."""
    store = _filled(backend)
    store.rewrite([b'{"i":9}', b'{"i":10}'])
    store.append(b'{"i":11}')
    store.close()
    assert _records(backend) == [b'{"i":9}', b'{"i":10}', b'{"i":11}']


def test_a_write_that_fails_raises_and_leaves_the_records_as_they_were(backend: Backend) -> None:
    """A write that fails before anything landed: JournalError, the records as before, and the next write follows them."""
    store = _filled(backend)
    backend.fail_next_write(landed=False)
    with pytest.raises(JournalError, match="not durable"):
        store.append(b'{"i":3}')
    assert _records_beside(backend, store) == [b'{"i":%d}' % i for i in range(3)]
    store.append(b'{"i":4}')
    store.close()
    assert _records(backend) == [b'{"i":%d}' % i for i in (0, 1, 2, 4)]


def _records_beside(backend: Backend, store: JournalStore) -> list[bytes]:
    """The records as a reader sees them while ``store`` stays open (a file's lock is the store's: read the bytes)."""
    if backend.kind == "file":
        return list(unframe(Path(backend.where).read_bytes(), backend.where).records)
    return _records(backend)


def test_a_write_that_may_have_landed_leaves_it_whole_in_its_place_or_gone(backend: Backend) -> None:
    """A write whose bytes reached the store but whose answer failed (fsync EIO; a put that landed, then raised): the record is
    either cut back (the file) or kept whole in its place (the KV), and the next write follows it: never torn, never reordered."""
    store = _filled(backend)
    backend.fail_next_write(landed=True)
    with pytest.raises(JournalError, match="not durable"):
        store.append(b'{"i":3}')
    store.append(b'{"i":4}')
    store.close()
    got = _records(backend)
    assert got in ([b'{"i":%d}' % i for i in (0, 1, 2, 4)], [b'{"i":%d}' % i for i in (0, 1, 2, 3, 4)]), got


def test_a_damaged_record_before_the_last_is_refused_naming_it(backend: Backend) -> None:
    """A flipped bit in record 1 of 3: reading refuses with a JournalError naming record 1 (never resumed from record 0)."""
    _filled(backend).close()
    backend.damage(1)
    with pytest.raises(JournalError, match="record 1"):
        _records(backend)


def test_of_two_controllers_on_one_journal_at_most_one_writes(backend: Backend) -> None:
    """Two stores opened on one journal: the second is refused at once (the file's lock), or the writer that is behind is
    refused at its first write (the KV's slots); the journal holds one writer's records, in order."""
    first = _filled(backend, 1)
    try:
        second: JournalStore | None = backend.open()
    except JournalBusy:
        second = None
    else:
        second.load()  # what a controller reads at its start (``Journal.open``)
    wrote: dict[str, list[bytes]] = {"first": [], "second": []}
    for i, (who, store) in itertools.product(range(3), (("first", first), ("second", second))):
        if store is None:
            continue
        record = b'{"%s":%d}' % (who.encode(), i)
        try:
            store.append(record)
        except JournalBusy:
            continue
        wrote[who].append(record)
    first.close()
    if second is not None:
        second.close()
    assert not (wrote["first"] and wrote["second"]), wrote
    assert _records(backend) == [b'{"i":0}', *wrote["first"], *wrote["second"]]


def test_a_compaction_by_a_second_controller_stops_the_first(backend: Backend) -> None:
    """The second controller compacts (a rewrite); the first's next write is refused, so its records never go where no one reads."""
    first = _filled(backend, 2)
    try:
        second = backend.open()
    except JournalBusy:
        first.close()
        return  # the file's lock: no second controller to compact
    second.load()
    second.rewrite([b'{"snapshot":1}'])
    with pytest.raises(JournalBusy):
        first.append(b'{"late":1}')
    second.append(b'{"after":1}')
    first.close()
    second.close()
    assert _records(backend) == [b'{"snapshot":1}', b'{"after":1}']


def test_a_journal_resumes_on_every_store(backend: Backend) -> None:
    """The barrier's journal over the store: compacted, reopened by a new controller, the last facts come back."""
    journal = Journal(backend.open(), compact_after=3)
    journal.open(ENGINES)
    for i in range(4):
        journal.commit({n: EngineKnowledge(n, paused=bool(i % 2)) for n in ENGINES}, ENGINES, f"step {i}")
    journal.close()
    again = Journal(backend.open())
    resumed = again.open(ENGINES)
    again.close()
    assert resumed.recovery.resumed and resumed.knowledge[ENGINES[0]].paused is True


def test_a_journal_whose_first_record_is_not_a_header_is_refused(backend: Backend) -> None:
    """Records that are not a barrier journal's: refused, and left as they were."""
    _filled(backend, 2).close()
    journal = Journal(backend.open())
    try:
        with pytest.raises(JournalError, match="not a controlplane-resilience/barrier-journal journal"):
            journal.open(ENGINES)
    finally:
        journal.close()
    assert _records(backend) == [b'{"i":0}', b'{"i":1}']


# -- Ray's own -----------------------------------------------------------------------


def _ray_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    request.getfixturevalue("ray_runtime")
    return Backend("ray", tmp_path)


def test_a_link_to_a_generation_with_no_records_is_refused(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """``key/next/0`` names a generation that holds nothing: refused, never read as a new (serving) journal."""
    from ray.experimental import internal_kv

    ray = _ray_backend(request, tmp_path)
    _filled(ray, 2).close()
    internal_kv._internal_kv_put(f"{ray.where}/next/0".encode(), b"7.lost", True, namespace="controlplane-resilience")
    with pytest.raises(JournalError, match=r"links to generation 7\.lost, which has no records"):
        ray.open().load()


def test_a_compaction_cut_between_its_seal_and_its_link_is_finished_by_the_next_writer(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The link's put fails: the old generation stays live (sealed); the next store reads it and its first write ends the compaction."""
    ray = _ray_backend(request, tmp_path)
    store = _filled(ray, 3)
    assert ray.kv is not None
    ray.kv.fail, ray.kv.match = 1, b"/next/"
    with pytest.raises(JournalError, match="compaction failed"):
        store.rewrite([b'{"snapshot":1}'])
    store.close()
    assert _records(ray) == [b'{"i":0}', b'{"i":1}', b'{"i":2}']
    again = ray.open()
    again.append(b'{"i":3}')
    again.close()
    assert _records(ray) == [b'{"i":0}', b'{"i":1}', b'{"i":2}', b'{"i":3}']


def test_the_ray_kv_store_refuses_a_bad_key() -> None:
    """A key with '/' would collide with the store's own layout."""
    with pytest.raises(JournalError, match=r"RayKVJournalStore\.key"):
        RayKVJournalStore("a/b")


def test_a_ray_kv_journal_is_named_by_namespace_and_key(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """``ray-kv://namespace/key``, in every message."""
    ray = _ray_backend(request, tmp_path)
    assert ray.open().name == f"ray-kv://controlplane-resilience/{ray.where}"

