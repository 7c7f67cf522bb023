"""On a lent GPU (an H200): what torch_memory_saver really does to NVML's per-process memory, and NvmlMemoryProbe's answers.

Not run by the test suite (it needs a GPU, CUDA, ``torch``, ``nvidia-ml-py`` and
``torch-memory-saver``); it finishes in well under 5 minutes. The device machine starts
bare and reaches no registry, so carry the torch-memory-saver wheel with the working
tree (``pip download --no-deps torch-memory-saver==0.0.10 -d benchmarks/gpu/wheels``)
and pass it with ``--wheel``; it is installed with ``--no-deps --no-index`` first.

    python benchmarks/gpu/probe_check.py --wheel benchmarks/gpu/wheels/torch_memory_saver-0.0.10-*.whl

What it does, each engine-like process a child of this script (``--child`` mode, driven
by one JSON command per line on its stdin):

1. **States.** One child allocates a KV-sized tensor under the tag ``kv_cache`` and a
   weights-sized one under ``weights`` (``torch_memory_saver.region``), writes them,
   and then pauses and resumes them in SGLang's order. Before and after each step this
   script reads NVML's used memory of the child's PID (``NvmlReader``, the probe's own
   reader) and asks ``NvmlMemoryProbe`` (serving baseline learnt at the start, tag sizes
   = the tensors' sizes) which tags are released; each answer is compared with the truth.
2. **Misuse, each in its own child**, recording exit code, signal and stderr tail:
   pausing a tag twice; resuming a tag that was never paused; writing into a paused
   tensor. The emulator models the first as torch_memory_saver's ``exit(1)``
   ("Cannot pause allocation that is not active"), and SGLang raises ``KeyError`` for
   the second *before* torch_memory_saver sees it (``offload_tags.remove``,
   ``weight_updater.py``): the figures say what torch_memory_saver itself does.
3. Writes every figure as JSON to ``$OUT/probe_check.json`` (``--out``), and exits 1
   when any probe answer was wrong.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

GiB = 1 << 30
MiB = 1 << 20
SETTLE_S = 0.5
"""Pause after each step before NVML is read (the driver updates per-process usage at once; this is margin)."""
CHILD_TIMEOUT_S = 60.0


# -- the engine-like child --------------------------------------------------------------


def child_main(kv_bytes: int, weights_bytes: int, hook_mode: str) -> int:
    """Allocate the two tagged tensors, then obey commands: pause/resume/touch/exit; answer one JSON line each."""
    import torch
    from torch_memory_saver import torch_memory_saver as tms

    if hook_mode == "torch":
        tms.hook_mode = "torch"
    device = torch.device("cuda")
    with tms.region(tag="kv_cache"):
        kv = torch.empty(kv_bytes // 2, dtype=torch.bfloat16, device=device)
    with tms.region(tag="weights"):
        weights = torch.empty(weights_bytes // 2, dtype=torch.bfloat16, device=device)
    kv.fill_(1.0)
    weights.fill_(2.0)
    torch.cuda.synchronize()
    tensors = {"kv_cache": kv, "weights": weights}
    _answer({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:  # bounded by the parent: it closes stdin or sends exit
        command = json.loads(line)
        op, tag = command["op"], command.get("tag")
        try:
            if op == "pause":
                tms.pause(tag)
            elif op == "resume":
                tms.resume(tag)
            elif op == "touch":
                tensors[tag].add_(1.0)
            elif op == "exit":
                _answer({"ok": True})
                return 0
            torch.cuda.synchronize()
            _answer({"ok": True})
        except Exception as exc:  # a Python-level error is a finding too
            _answer({"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]})
    return 0


def _answer(body: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(body) + "\n")
    sys.stdout.flush()


# -- the parent ----------------------------------------------------------------------------


class Child:
    """One engine-like child process, driven over its stdin/stdout."""

    def __init__(self, args: argparse.Namespace) -> None:
        command = [
            sys.executable,
            __file__,
            "--child",
            "--kv-gib",
            str(args.kv_gib),
            "--weights-gib",
            str(args.weights_gib),
            "--hook-mode",
            args.hook_mode,
        ]
        with _subprocess_env(args.hook_mode):
            self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        hello = self._read()
        if not hello.get("ready"):
            raise RuntimeError(f"the child did not start: {hello}")
        self.pid = int(hello["pid"])

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            return {"ended": True, "code": self.proc.wait(timeout=CHILD_TIMEOUT_S)}
        answer: dict[str, Any] = json.loads(line)
        return answer

    def send(self, op: str, tag: str | None = None) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"op": op, "tag": tag}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            return {"ended": True, "code": self.proc.wait(timeout=CHILD_TIMEOUT_S)}
        return self._read()

    def finish(self) -> dict[str, Any]:
        """Close stdin, wait (bounded), and report the exit code and the stderr tail."""
        assert self.proc.stdin is not None and self.proc.stderr is not None
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            code = self.proc.wait(timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(timeout=CHILD_TIMEOUT_S)
        stderr = self.proc.stderr.read()
        return {"exit_code": code, "stderr_tail": stderr[-1500:]}


def _subprocess_env(hook_mode: str) -> AbstractContextManager[Any]:
    """torch_memory_saver's preload mode needs its hook library LD_PRELOADed into the child."""
    if hook_mode != "preload":
        return nullcontext()
    import torch_memory_saver

    configure: Any = getattr(torch_memory_saver, "configure_subprocess", None)
    return configure() if configure is not None else nullcontext()


def install_wheel(pattern: str | None) -> str | None:
    """Install the carried torch-memory-saver wheel (no index, no deps) unless it imports already; the version."""
    try:
        import torch_memory_saver  # noqa: F401
    except ImportError:
        if pattern is None:
            raise SystemExit("torch_memory_saver is not installed: pass --wheel with the carried wheel") from None
        wheels = sorted(glob.glob(pattern))
        if not wheels:
            raise SystemExit(f"no wheel matches {pattern!r}") from None
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", wheels[-1]], check=True)
    from importlib.metadata import version

    return version("torch-memory-saver")


def read(reader: Any, pid: int) -> int | None:
    time.sleep(SETTLE_S)
    used: int | None = reader([pid])
    return used


def states(args: argparse.Namespace) -> Iterator[tuple[str, str | None, str | None, frozenset[str]]]:
    """(step name, op, tag, tags released after it), SGLang's release then resume order, and back."""
    yield "serving", None, None, frozenset()
    yield "pause kv_cache", "pause", "kv_cache", frozenset({"kv_cache"})
    yield "pause weights", "pause", "weights", frozenset({"kv_cache", "weights"})
    yield "resume weights", "resume", "weights", frozenset({"kv_cache"})
    yield "resume kv_cache", "resume", "kv_cache", frozenset()
    yield "touch kv_cache (serving again)", "touch", "kv_cache", frozenset()


def check_states(args: argparse.Namespace, reader: Any) -> list[dict[str, Any]]:
    from resilience.adapters.nvml import EngineGpu, NvmlMemoryProbe

    child = Child(args)
    engine = "http://127.0.0.1:30000"
    tag_bytes = {"kv_cache": args.kv_gib * GiB, "weights": args.weights_gib * GiB}
    probe = NvmlMemoryProbe({engine: EngineGpu(pids=(child.pid,), tag_bytes=tag_bytes)}, reader=reader)
    rows: list[dict[str, Any]] = []
    try:
        for name, op, tag, truth in states(args):
            started = time.monotonic()
            answer = child.send(op, tag) if op is not None else {"ok": True}
            took = time.monotonic() - started
            if name == "serving":
                probe.learn(engine)
            used = read(reader, child.pid)
            said = probe.released_tags(engine)
            rows.append(
                {
                    "step": name,
                    "child": answer,
                    "op_seconds": round(took, 4),
                    "nvml_used_bytes": used,
                    "nvml_used_gib": None if used is None else round(used / GiB, 3),
                    "truth": sorted(truth),
                    "probe": None if said is None else sorted(said),
                    "ok": said == truth,
                }
            )
    finally:
        rows.append({"step": "end", **child.finish()})
    return rows


MISUSE = {
    "pause twice": (("pause", "kv_cache"), ("pause", "kv_cache")),
    "resume never paused": (("resume", "kv_cache"),),
    "write into a paused tensor": (("pause", "kv_cache"), ("touch", "kv_cache")),
}


def check_misuse(args: argparse.Namespace) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for case, steps in MISUSE.items():
        child = Child(args)
        answers = [child.send(op, tag) for op, tag in steps]
        found[case] = {"answers": answers, **child.finish()}
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kv-gib", type=int, default=16, help="KV tensor size, GiB (default: 16)")
    parser.add_argument("--weights-gib", type=int, default=4, help="weights tensor size, GiB (default: 4)")
    parser.add_argument("--hook-mode", choices=("preload", "torch"), default="preload", help="torch_memory_saver hook mode")
    parser.add_argument("--wheel", default=None, help="glob of the carried torch-memory-saver wheel, installed when missing")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for probe_check.json (default: $OUT)")
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args.kv_gib * GiB, args.weights_gib * GiB, args.hook_mode)

    started = time.monotonic()
    report: dict[str, Any] = {"tms_version": install_wheel(args.wheel), "hook_mode": args.hook_mode}
    import pynvml
    import torch

    from resilience.adapters.nvml import NvmlReader, NvmlThresholds

    report.update(
        torch=torch.__version__,
        cuda=torch.version.cuda,
        nvidia_ml_py=getattr(pynvml, "__version__", None),
        gpu=torch.cuda.get_device_name(0),
        kv_bytes=args.kv_gib * GiB,
        weights_bytes=args.weights_gib * GiB,
        tolerance_bytes=NvmlThresholds().tolerance_bytes,
    )
    reader = NvmlReader()
    try:
        report["states"] = check_states(args, reader)
        report["misuse"] = check_misuse(args)
    finally:
        reader.close()
    report["seconds"] = round(time.monotonic() - started, 1)
    report["all_probe_answers_right"] = all(row.get("ok", True) for row in report["states"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe_check.json").write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps({k: report[k] for k in ("gpu", "tms_version", "all_probe_answers_right", "seconds")}))
    for row in report["states"]:
        print(f"{row['step']:<32} used={row.get('nvml_used_gib')} GiB truth={row.get('truth')} probe={row.get('probe')}")
    for case, result in report["misuse"].items():
        print(f"{case:<32} exit={result['exit_code']} answers={result['answers']}")
    return 0 if report["all_probe_answers_right"] else 1


if __name__ == "__main__":
    sys.exit(main())
