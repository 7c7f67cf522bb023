"""NvmlMemoryProbe's decisions on given readings (NVML itself needs a GPU: ``benchmarks/gpu/probe_check.py`` runs it there).

The reader is the one seam: a function from PIDs to used bytes. Everything else (which
tags a reading proves released, when it proves nothing, finding SGLang's scheduler
processes, the missing-extra error) runs for real here.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, Sequence

import pytest

from resilience.adapters.nvml import (
    EngineGpu,
    GiB,
    NvmlMemoryProbe,
    NvmlThresholds,
    infer_released,
    scheduler_pids,
    tag_bytes_from_loads,
)
from resilience.engine_contract import MemoryProbe, UnknownEngine, covers
from tests.conftest import process_tree

TAGS = {"kv_cache": 60 * GiB, "weights": 16 * GiB, "cuda_graph": 6 * GiB}
SERVING = 100 * GiB
ENGINE = "http://10.0.0.5:30000"


class Readings:
    """A reader that answers what the test sets, and counts its reads."""

    def __init__(self, used: int | None = SERVING) -> None:
        self.used = used
        self.asked: list[tuple[int, ...]] = []

    def __call__(self, pids: Sequence[int]) -> int | None:
        self.asked.append(tuple(pids))
        return self.used


def subsets() -> Iterator[frozenset[str]]:
    for n in range(len(TAGS) + 1):
        for combo in itertools.combinations(TAGS, n):
            yield frozenset(combo)


@pytest.mark.parametrize("noise", [0, -GiB // 2, GiB // 2, 2 * GiB - 1])
def test_every_state_is_recognised_within_the_tolerance(noise: int) -> None:
    """Each of the 8 states, read with noise inside the tolerance (2 % of 100 GiB = 2 GiB), is named exactly."""
    for released in subsets():
        used = SERVING - sum(TAGS[t] for t in released) + noise
        assert infer_released(used, SERVING, TAGS) == released, (released, noise)


def test_readings_between_states_prove_nothing() -> None:
    """A reading more than the tolerance away from every prediction (a release half done, untagged growth): None."""
    assert infer_released(SERVING - 11 * GiB, SERVING, TAGS) is None  # 89: between "graph released" (94) and "weights" (84)
    assert infer_released(SERVING + 3 * GiB, SERVING, TAGS) is None  # above serving: something else grew
    assert infer_released(0, SERVING, TAGS) is None


def test_a_tag_smaller_than_the_noise_makes_the_states_it_separates_unprovable() -> None:
    """With a 1 GiB cuda_graph and a 2 GiB tolerance, "nothing released" and "graph released" overlap: None, never a guess."""
    tags = {**TAGS, "cuda_graph": GiB}
    assert infer_released(SERVING, SERVING, tags) is None
    assert infer_released(SERVING - 60 * GiB - GiB // 2, SERVING, tags) is None
    tight = NvmlThresholds(tolerance_fraction=0.0, tolerance_bytes=GiB // 4)
    assert infer_released(SERVING - 60 * GiB - 16 * GiB, SERVING, tags, tight) == {"kv_cache", "weights"}


def test_the_tolerance_is_the_larger_of_its_two_knobs() -> None:
    """tolerance = max(tolerance_bytes, tolerance_fraction * serving); defaults 1 GiB and 2 %."""
    assert NvmlThresholds().tolerance(10 * GiB) == GiB
    assert NvmlThresholds().tolerance(100 * GiB) == pytest.approx(2 * GiB)
    assert NvmlThresholds(tolerance_bytes=0, tolerance_fraction=0.0).tolerance(100 * GiB) == 0


def test_the_probe_learns_the_serving_baseline_then_answers_from_one_reading() -> None:
    """No baseline: None. learn() while serving, then each reading names its state; one read per question."""
    readings = Readings()
    probe = NvmlMemoryProbe({ENGINE + "/": EngineGpu(pids=(1,), tag_bytes=TAGS)}, reader=readings)
    assert isinstance(probe, MemoryProbe)
    assert probe.released_tags(ENGINE) is None  # nothing learnt yet
    assert probe.learn(ENGINE) == SERVING and probe.serving_bytes(ENGINE) == SERVING
    assert probe.released_tags(ENGINE) == frozenset()
    readings.used = SERVING - TAGS["kv_cache"] - TAGS["cuda_graph"]
    assert probe.released_tags(ENGINE + "/generate") == {"kv_cache", "cuda_graph"}
    readings.used = SERVING - sum(TAGS.values())
    assert probe.released_tags(ENGINE) == frozenset(TAGS)
    assert readings.asked == [(1,)] * 4
    with pytest.raises(KeyError, match="not one of this probe's engines"):
        probe.learn("http://10.0.0.6:30000")


def test_a_configured_baseline_needs_no_learning_and_unknown_engines_are_named() -> None:
    """serving_bytes given: answers at once; an engine not configured, or a non-string: ``UnknownEngine`` without a read."""
    readings = Readings(SERVING - TAGS["weights"])
    probe = NvmlMemoryProbe({ENGINE: EngineGpu(pids=(1,), tag_bytes=TAGS, serving_bytes=SERVING)}, reader=readings)
    assert probe.released_tags(ENGINE) == {"weights"}
    with pytest.raises(UnknownEngine, match=r"10\.0\.0\.6:30000"):
        probe.released_tags("http://10.0.0.6:30000")
    with pytest.raises(UnknownEngine):
        probe.released_tags(None)  # type: ignore[arg-type]
    assert len(readings.asked) == 1
    assert covers(probe, ENGINE) and not covers(probe, "http://10.0.0.6:30000")


def test_a_dead_pid_an_unreadable_nvml_or_a_failing_reader_prove_nothing() -> None:
    """A scheduler PID that is gone is never read; a reader answering None or raising gives None too."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait(timeout=30)
    readings = Readings()
    dead = NvmlMemoryProbe({ENGINE: EngineGpu(pids=(ended.pid,), tag_bytes=TAGS, serving_bytes=SERVING)}, reader=readings)
    assert dead.released_tags(ENGINE) is None and readings.asked == []

    def broken(_pids: Sequence[int]) -> int | None:
        raise OSError("NVML went away")

    gpu = EngineGpu(pids=(1,), tag_bytes=TAGS, serving_bytes=SERVING)
    assert NvmlMemoryProbe({ENGINE: gpu}, reader=Readings(None)).released_tags(ENGINE) is None
    assert NvmlMemoryProbe({ENGINE: gpu}, reader=broken).released_tags(ENGINE) is None


def serving_reader(_pids: Sequence[int]) -> int | None:
    """A picklable reader: the engine serves, nothing released."""
    return SERVING


def test_the_probe_travels_pickled_with_what_it_learnt() -> None:
    """A probe (inside a client's policy table, say) pickles for Ray: engines, thresholds, reader and baselines kept."""
    engines = {ENGINE: EngineGpu(pids=(1,), tag_bytes=TAGS)}
    probe = NvmlMemoryProbe(engines, thresholds=NvmlThresholds(tolerance_bytes=2 * GiB), reader=serving_reader)
    probe.learn(ENGINE)
    copy = pickle.loads(pickle.dumps(probe))
    assert copy.serving_bytes(ENGINE) == SERVING and copy.thresholds.tolerance_bytes == 2 * GiB
    assert copy.released_tags(ENGINE) == frozenset()


def test_tag_sizes_from_sglangs_loads_answer() -> None:
    """/v1/loads?include=memory (weight_gb, kv_cache_gb, graph_gb) gives tag_bytes; an answer without them is refused."""
    loads = {"loads": [{"dp_rank": 0, "memory": {"weight_gb": 16.0, "kv_cache_gb": 60.5, "graph_gb": 0.25, "token_capacity": 9}}]}
    assert tag_bytes_from_loads(loads) == {"weights": 16 * GiB, "kv_cache": int(60.5 * GiB), "cuda_graph": GiB // 4}
    with pytest.raises(ValueError, match=r"ask it with \?include=memory"):
        tag_bytes_from_loads({"loads": [{"dp_rank": 0}]})


def test_bad_configuration_is_refused_with_the_field_named() -> None:
    """PIDs, tag sizes, baselines, thresholds and engine maps are checked when built."""
    for kwargs, message in (
        ({"pids": (), "tag_bytes": TAGS}, "`pids` must be one or more process IDs"),
        ({"pids": (0,), "tag_bytes": TAGS}, "`pids` must be one or more process IDs"),
        ({"pids": (1,), "tag_bytes": {}}, "`tag_bytes` must map one or more tags"),
        ({"pids": (1,), "tag_bytes": {"kv_cache": -1}}, r"`tag_bytes\['kv_cache'\]` must be an integer number of bytes"),
        ({"pids": (1,), "tag_bytes": TAGS, "serving_bytes": 1.5}, "`serving_bytes` must be an integer number of bytes"),
    ):
        with pytest.raises(ValueError, match=message):
            EngineGpu(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`tolerance_fraction` must be a number in \[0, 1\)"):
        NvmlThresholds(tolerance_fraction=1.0)
    with pytest.raises(ValueError, match="`tolerance_bytes` must be an integer >= 0"):
        NvmlThresholds(tolerance_bytes=-1)
    with pytest.raises(ValueError, match=r"`engines\['x'\]` must be an EngineGpu"):
        NvmlMemoryProbe({"x": "gpu0"}, reader=Readings())  # type: ignore[dict-item]


def test_scheduler_pids_finds_the_processes_sglang_titles_under_a_server() -> None:
    """Children titled sglang::scheduler* under the server PID are found; the detokenizer and strangers are not."""
    titles = ("sglang::scheduler_TP0", "sglang::scheduler_TP1", "sglang::detokenizer")
    script = " ".join(f"(exec -a {title} sleep 60) &" for title in titles) + " wait"
    server = subprocess.Popen(["bash", "-c", script])
    try:
        deadline = time.monotonic() + 10
        found: tuple[int, ...] = ()
        while time.monotonic() < deadline and len(found) < 2:  # bounded: the children exec their titles at once
            found = scheduler_pids(server.pid)
            time.sleep(0.02)
        tree = process_tree(server.pid)
        assert len(found) == 2 and set(found) <= set(tree) and server.pid not in found
        assert scheduler_pids(1 << 22) == ()
    finally:
        for pid in reversed(process_tree(server.pid)):  # the sleeps first, then their bash
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        server.wait(timeout=10)


def test_without_nvidia_ml_py_the_default_reader_says_how_to_install_it() -> None:
    """pynvml unimportable: building the probe with the default reader raises ImportError naming the [nvml] extra."""
    code = textwrap.dedent(
        """
        import importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "pynvml":
                    raise ImportError("blocked: pynvml")
                return None
        sys.meta_path.insert(0, Block())
        from resilience.adapters.nvml import EngineGpu, NvmlMemoryProbe
        try:
            NvmlMemoryProbe({"http://h:1": EngineGpu(pids=(1,), tag_bytes={"kv_cache": 1})})
        except ImportError as exc:
            print(exc)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "pip install 'controlplane-resilience[nvml]'" in out.stdout
