"""The README is an entry point and its examples run; the docs' examples run and their links resolve.

The README's shape is pinned (install line and first example on its first screen, in the issue's
order, a few hundred lines at most), its first example is run as a user pastes it (a fresh
interpreter, two emulated engines behind fault proxies) and must print what the README says it
prints. The docs pages' streaming, emulator, weight-update and fault-tolerance examples run against real
emulated engines. Every
relative link in the README, CONTRIBUTING.md and benchmarks/NOTES.md must name a file that exists;
links inside docs/ are checked by ``mkdocs build --strict`` (scripts/test.sh).
"""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from resilience.testing.faults import FaultPlan
from tests.cli import docs_inline

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
FIRST_SCREEN = 60
"""Lines a reader sees without scrolling: the install line and the first example must be inside them."""
MAX_README_LINES = 300
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _blocks(text: str, lang: str) -> list[tuple[int, str]]:
    """(line number of the opening fence, body) of every fenced block in ``lang``."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(2)) for m in _FENCE.finditer(text) if m.group(1) == lang]


def _section(text: str, heading: str) -> str:
    """The text under ``heading`` (a whole heading line) up to the next heading of the same or a higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    start = text.index(heading + "\n")
    rest = text[start + len(heading) + 1 :]
    end = re.search(rf"^#{{1,{level}}} ", rest, flags=re.M)
    return rest[: end.start()] if end else rest


def _run_python(code: str, tmp_path: Path) -> str:
    """Run ``code`` as a user pasting it would: a fresh interpreter, another folder; its stdout."""
    script = tmp_path / "example.py"
    script.write_text(code, encoding="utf-8")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_readme_starts_where_a_user_starts() -> None:
    """What it is, install, a first example, the two commands, then links: the install line and the example on screen one."""
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; the reference belongs in docs/"
    headings = [line for line in lines if line.startswith("## ")]
    assert headings[:4] == ["## Install", "## A first example", "## Two commands", "## Documentation"]
    intro = text[text.index("\n") : text.index("## Install")]
    sentences = re.findall(r"[.!?](?:\s|$)", intro.strip())
    assert len(sentences) == 2, f"the opening says what it is in two sentences, not {len(sentences)}"
    first_screen = "\n".join(lines[:FIRST_SCREEN])
    assert 'pip install -e ".[all]"' in first_screen
    line, example = _blocks(text, "python")[0]
    end = line + example.count("\n") + 1
    assert end <= FIRST_SCREEN, f"the first example ends on line {end}, past the first screen ({FIRST_SCREEN} lines)"
    assert len(example.splitlines()) <= 20


def test_readme_names_every_extra() -> None:
    """The install table names each extra pyproject.toml defines (a new extra must be explained)."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    install = _section(README.read_text(encoding="utf-8"), "## Install")
    missing = sorted(name for name in extras if f"`{name}`" not in install)
    assert missing == []


def test_readme_keeps_the_two_commands() -> None:
    """The two commands a newcomer runs exist, and test.sh does what the README says (lint, types, docs, tests)."""
    commands = _section(README.read_text(encoding="utf-8"), "## Two commands")
    for script in ("scripts/demo.sh", "scripts/test.sh"):
        assert f"bash {script}" in commands and (ROOT / script).is_file()
    test_sh = (ROOT / "scripts" / "test.sh").read_text(encoding="utf-8")
    for step in ("scripts/setup.sh", "ruff check", "mypy", "mkdocs build --strict", "pytest"):
        assert step in test_sh
    assert "cpr demo" in (ROOT / "scripts" / "demo.sh").read_text(encoding="utf-8")
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


@pytest.mark.parametrize("path", ["README.md", "CONTRIBUTING.md", "benchmarks/NOTES.md", "telemetry/METRICS.md"])
def test_relative_links_resolve(path: str) -> None:
    """Every relative link names a file or folder of the repository (anchors inside docs/ are the strict build's job)."""
    source = ROOT / path
    targets = [t for t in _LINK.findall(source.read_text(encoding="utf-8")) if not re.match(r"[a-z]+:|#", t)]
    broken = [t for t in targets if not (source.parent / t.split("#", 1)[0]).exists()]
    assert broken == []


def test_readme_links_every_docs_page() -> None:
    """Each page of docs/ is one link away from the README, and every docs page is in mkdocs.yml's nav."""
    readme = README.read_text(encoding="utf-8")
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert len(pages) >= 10
    assert [p for p in pages if f"(docs/{p})" not in readme] == []
    assert [p for p in pages if f": {p}" not in nav] == []


def test_docs_pages_read_whole_without_mkdocs() -> None:
    """No page includes another file through MkDocs (``--8<--``): on the forge an include shows as its bare line."""
    includes = [
        f"{page.relative_to(ROOT)}:{n}: {line}"
        for page in sorted(DOCS.rglob("*.md"))
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        if line.lstrip().startswith("--8<--")
    ]
    assert includes == []


def test_inlined_copies_equal_their_sources() -> None:
    """Each copy a page inlines (README sections, example files, METRICS.md) is its source's text now, so none can drift
    (after editing a source: ``python -m tests.cli.docs_inline``)."""
    pages = {page: page.read_text(encoding="utf-8") for page in sorted(DOCS.rglob("*.md"))}
    marked = {page.relative_to(ROOT).as_posix(): text.count("<!-- inline: ") for page, text in pages.items() if "<!-- inline: " in text}
    assert marked == {"docs/emulator.md": 1, "docs/index.md": 1, "docs/install.md": 1, "docs/metrics.md": 1, "docs/policy-files.md": 2}
    stale = [page.relative_to(ROOT).as_posix() for page, text in pages.items() if docs_inline.render(text) != text]
    assert stale == [], "run: python -m tests.cli.docs_inline"


def test_an_edited_copy_is_caught() -> None:
    """The check is not vacuous: a copy that differs from its source by one character renders differently."""
    page = (DOCS / "policy-files.md").read_text(encoding="utf-8")
    marker = "<!-- inline: examples/policies.toml toml -->\n```toml\n"
    edited = page.replace(marker, marker + "#", 1)
    assert edited != page and docs_inline.render(edited) == page


def test_readme_first_example_runs_and_prints_what_it_says(tmp_path: Path) -> None:
    """The first example, pasted into a fresh interpreter, absorbs its faults and prints the line the README quotes."""
    text = README.read_text(encoding="utf-8")
    _, example = _blocks(text, "python")[0]
    out = _run_python(example, tmp_path).splitlines()
    assert len(out) == 2 and out[0].strip(), out
    m = re.fullmatch(r"3 steps, (\d+) injected faults absorbed, engines alive: True", out[1])
    assert m and int(m.group(1)) > 0, out
    assert f"`{out[1]}`" in text, "the README quotes the example's output"


PAGE_EXAMPLES = [
    # (page, index of its python block, the last lines it prints)
    ("barrier.md", 0, ["['serving', 'serving']"]),
    ("barrier.md", 1, ["['pause', 'flush', 'release']", "['serving', 'serving']"]),
    ("failure-and-recovery.md", 0, ["quarantined: 2, dead: 0", "['released', 'released'] True"]),
    ("failure-and-recovery.md", 1, ["True"]),
]


def test_every_python_block_of_the_barrier_pages_is_run() -> None:
    """docs/barrier.md and docs/failure-and-recovery.md have no fragment left untested: PAGE_EXAMPLES lists every block."""
    for page in ("barrier.md", "failure-and-recovery.md"):
        count = len(_blocks((DOCS / page).read_text(encoding="utf-8"), "python"))
        assert sorted(i for p, i, _ in PAGE_EXAMPLES if p == page) == list(range(count)), page


@pytest.mark.parametrize(("page", "index", "last_lines"), PAGE_EXAMPLES)
def test_barrier_page_example_runs_as_pasted(page: str, index: int, last_lines: list[str], tmp_path: Path) -> None:
    """Each example of the barrier pages is complete: pasted into a fresh interpreter it runs on emulated engines and
    prints what its comments say."""
    pytest.importorskip("torch")
    _, example = _blocks((DOCS / page).read_text(encoding="utf-8"), "python")[index]
    out = _run_python(example, tmp_path).splitlines()
    assert out[-len(last_lines) :] == last_lines, out
    for line in last_lines:  # the page quotes what it prints
        assert line in example


def test_emulator_page_example_runs(tmp_path: Path) -> None:
    """docs/emulator.md's first example: two 502s absorbed on pause, a 502 after release settled by the probe, engine alive."""
    text = (DOCS / "emulator.md").read_text(encoding="utf-8")
    _, example = _blocks(text, "python")[0]
    out = _run_python(example, tmp_path).splitlines()
    assert out[:2] == ["3", "True"], out
    assert out[3] == "['/pause_generation', '/release_memory_occupation']", out
    assert out[4].endswith(" True") and "kv_cache" in out[4], out


@pytest.fixture(scope="module")
def engine_url() -> Iterator[str]:
    pytest.importorskip("fastapi")
    from resilience.testing.emulator import EmulatedFleet, EngineConfig

    with EmulatedFleet(1, EngineConfig(token_rate=2000.0)) as fleet:
        yield fleet.urls[0]


def test_streaming_example_prints_each_token_once(engine_url: str) -> None:
    """docs/sglang.md's streaming loop prints the final text exactly once, although each chunk's text is cumulative."""
    from resilience.adapters.sglang import SGLangClient

    section = _section((DOCS / "sglang.md").read_text(encoding="utf-8"), "## Streaming")
    [(_, code)] = _blocks(section, "python")
    client = SGLangClient(engine_url)
    chunks = list(client.generate_stream("hi", sampling_params={"max_new_tokens": 8}))
    assert len(chunks) > 1 and all(chunks[-1].text.startswith(c.text) for c in chunks), "chunks are cumulative"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "docs/sglang.md", "exec"), {"client": client})
    client.close()
    assert printed.getvalue() == chunks[-1].text + "\n"


def test_fault_plan_example_is_documented_and_loads() -> None:
    """examples/fault_plan.toml loads, names every FaultRule field and kind it shows, and the page's YAML says the same."""
    import dataclasses

    import yaml

    from resilience.testing.faultplan import FaultRule

    plan = FaultPlan.load(ROOT / "examples" / "fault_plan.toml")
    assert plan.seed == 7 and plan.max_streak == 2 and len(plan.rules) == 5
    fields = {f.name for f in dataclasses.fields(FaultRule)}
    used = {key for rule in plan.rules for key in rule.to_dict()}
    assert used == fields, f"the example leaves out {sorted(fields - used)}"
    page = (DOCS / "emulator.md").read_text(encoding="utf-8")
    assert "<!-- inline: examples/fault_plan.toml toml -->\n```toml\n" in page  # equal to the file: test_inlined_copies_...
    [(_, yaml_text)] = _blocks(page, "yaml")
    assert FaultPlan.from_dict(yaml.safe_load(yaml_text)) == plan
    documented = _section(page, "## `FaultPlan` and `FaultRule`")
    assert [f for f in sorted(fields) if f"| `{f}` |" not in documented] == []


def _run_example(page: str, heading: str, url: str, placeholder: str) -> str:
    """Run the one Python block under ``heading`` of ``docs/<page>`` with ``placeholder`` (its server URL) set to ``url``; its stdout."""
    [(_, code)] = _blocks(_section((DOCS / page).read_text(encoding="utf-8"), heading), "python")
    assert f'"{placeholder}"' in code
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code.replace(placeholder, url), f"docs/{page}", "exec"), {})
    return printed.getvalue()


def test_sglang_weight_update_example_runs_and_the_refused_update_is_never_sent(engine_url: str) -> None:
    """docs/sglang.md's weight-update example: the update into released weights is refused unsent, the engine lives."""
    import requests

    out = _run_example("sglang.md", "## Weight updates", engine_url, "http://127.0.0.1:30000")
    assert "released" in out and engine_url.split("//")[1] in out
    calls = requests.get(engine_url + "/_emulator/record", timeout=10).json()["calls"]
    assert len([c for c in calls if c["path"] == "/update_weights_from_disk"]) == 1  # only the one after the resume


@pytest.fixture(scope="module")
def vllm_url() -> Iterator[str]:
    pytest.importorskip("fastapi")
    from resilience.testing.emulator import EmulatedFleet
    from resilience.testing.emulator.vllm import VLLMEngineConfig

    config = VLLMEngineConfig(dev_mode=True, enable_sleep_mode=True, enable_fault_tolerance=True, weight_transfer_backend="nccl")
    with EmulatedFleet(1, config) as fleet:
        yield fleet.engines[0].direct_url


def test_vllm_weights_asleep_and_fault_tolerance_examples_run(vllm_url: str) -> None:
    """docs/vllm.md's two examples: the refused update leaves the engine alive and awake; the retry recovers a faulted engine."""
    import requests

    out = _run_example("vllm.md", "## A weight update while the weights sleep", vllm_url, "http://127.0.0.1:8000")
    assert "asleep" in out
    state = requests.get(vllm_url + "/_emulator/state", timeout=10).json()
    assert (state["sleeping_tags"], state["pause_state"], state["update_chunks"]) == ([], "unpaused", 0)
    requests.post(vllm_url + "/_emulator/fault", timeout=10).raise_for_status()
    out = _run_example("vllm.md", "## Fault tolerance (`--enable-fault-tolerance`)", vllm_url, "http://127.0.0.1:8000")
    assert out.strip() == "[(0, 'healthy', None)]"


def test_control_lane_example_runs(tmp_path: Path) -> None:
    """docs/http-clients.md's control-lane example: the pause answers while four streams fill the pool of four."""
    [(_, code)] = _blocks(
        _section((DOCS / "http-clients.md").read_text(encoding="utf-8"), "## Control calls get a lane of their own"), "python"
    )
    assert _run_python(code, tmp_path).strip() == "200 {'success': True}"
