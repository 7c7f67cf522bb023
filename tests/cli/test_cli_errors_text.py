"""A failed step's error as a progress line shows it: engines by label, no secrets, never cut inside a parenthesis."""

from __future__ import annotations

from resilience.cli.errors_text import clip, engine_labels, label_urls, safe_url, short_error

E3 = "http://127.0.0.1:40123"
LABELS = engine_labels({3: [E3, "http://127.0.0.1:39001"], 4: ["http://127.0.0.1:40124/"]})

SOAK_ERROR = (
    f"step 812: PhaseFailed: offload failed in phase 'release' on 1 engine(s): {E3}: AmbiguousOutcome: POST "
    f"/release_memory_occupation on {E3} may have been applied (connection reset after the request was sent; the memory "
    "probe could not tell whether the engine released its memory, so the call is not re-sent); not re-sent. Quarantined "
    f"(released tags unknown; reconcile or retire): {E3}. Not serving: {E3} (paused by offload). A restart would use 1 of 3 "
    "remaining (limit 3); the orchestrator restarts nothing."
)
"""The shape of the line a 1000-step soak printed cut mid-parenthesis (``PhaseFailed`` around an ``AmbiguousOutcome``)."""


def _balanced(text: str) -> bool:
    depth = 0
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth < 0:
            return False
    return depth == 0


def test_engines_are_named_by_label_and_the_prefix_goes() -> None:
    """Every URL of engine 3 (its proxy's, its own, with or without a slash) reads "engine 3"; no "on on /"."""
    line = short_error(SOAK_ERROR, LABELS, limit=10_000)
    assert line is not None
    assert line.startswith("PhaseFailed: offload failed in phase 'release' on 1 engine(s): engine 3: AmbiguousOutcome: POST")
    assert "POST /release_memory_occupation on engine 3 may have been applied (" in line
    assert "http" not in line and "on on /" not in line and "127.0.0.1" not in line
    assert label_urls("GET http://127.0.0.1:40124/health answered 503", LABELS) == "GET engine 4 /health answered 503"
    assert label_urls("http://127.0.0.1:39001: down", LABELS) == "engine 3: down"


def test_an_engine_without_a_label_is_named_by_host_and_port() -> None:
    """Unknown URLs keep host:port (still readable, still short); requests' "for url:" reads "from"."""
    text = "HTTPError: 502 Server Error: Bad Gateway for url: http://10.0.0.7:30000/release_memory_occupation"
    assert label_urls(text) == "HTTPError: 502 Server Error: Bad Gateway from 10.0.0.7:30000 /release_memory_occupation"
    assert label_urls("(at http://[::1]:8000/flush_cache)") == "(at [::1]:8000 /flush_cache)"


def test_credentials_query_tokens_and_bearer_keys_never_reach_the_line() -> None:
    """user:password@, ?token=..., #fragment and Bearer keys are dropped or masked."""
    text = (
        "POST http://admin:s3cret-pw@10.0.0.5:30000/generate?token=abc123&x=1#frag failed; "
        "header Authorization: Bearer sk-live-0123456789 refused"
    )
    line = short_error(text)
    assert line is not None
    for secret in ("admin", "s3cret-pw", "abc123", "token=", "frag", "sk-live-0123456789"):
        assert secret not in line, line
    assert "10.0.0.5:30000 /generate failed" in line and "Bearer ***" in line


def test_a_long_error_is_cut_between_clauses_never_inside_a_parenthesis() -> None:
    """At every limit the line fits, its parentheses are balanced, and a cut says so with " ..."."""
    full = short_error(SOAK_ERROR, LABELS, limit=10_000)
    assert full is not None
    for limit in range(24, len(full) + 5):
        cut = short_error(SOAK_ERROR, LABELS, limit=limit)
        assert cut is not None
        assert len(cut) <= limit, (limit, cut)
        assert _balanced(cut), (limit, cut)
        assert cut == full or cut.endswith(" ..."), (limit, cut)
    at_240 = short_error(SOAK_ERROR, LABELS)
    assert at_240 is not None and at_240.endswith("on engine 3 may have been applied ...")  # cut before the parenthesis


def test_a_text_that_is_one_parenthesis_is_closed_after_its_cut() -> None:
    """No boundary outside the group: the cut keeps the parentheses balanced all the same."""
    text = "(" + "x" * 300 + ")"
    cut = clip(text, 50)
    assert len(cut) <= 50 and _balanced(cut) and "..." in cut


def test_no_error_stays_none() -> None:
    """A step without an error has no error line."""
    assert short_error(None) is None


def test_safe_url_keeps_scheme_host_port_and_path_only() -> None:
    """What cpr probe and cpr journal show of a URL: no user:password@, query or fragment; a plain name as it is."""
    assert safe_url("http://ops:pw@127.0.0.1:31003/v1?token=t#f") == "http://127.0.0.1:31003/v1"
    assert safe_url("http://127.0.0.1:30000") == "http://127.0.0.1:30000"
    assert safe_url("engine-a") == "engine-a"
    assert safe_url("http://ops:pw@127.0.0.1:99999/v1/traces?k=v") == "http://127.0.0.1:99999/v1/traces"  # a bad port too
