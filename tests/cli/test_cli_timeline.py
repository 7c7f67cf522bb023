"""The timeline picture: one time axis for every panel, the training gap labelled, the death's cause in the title."""

from __future__ import annotations

import pytest

from resilience.cli.timeline import Bar, Mark, StepTimeline, draw_figure, mark_kind


def _old() -> StepTimeline:
    """A short failed step: two engines killed by two causes, the client saw a 502."""
    tl = StepTimeline("old way", 1, False, "502 from engine 1 /release_memory_occupation", 3, died=[1, 2, 0])
    tl.causes = ["prefill scheduled after release", "prefill scheduled after release", "release while requests were running"]
    tl.bars.append(Bar(0, "flush", 0.0, 0.05, 1, (200,)))
    tl.marks.append(Mark(1, 0.06, "died", ""))
    return tl


def _ours() -> StepTimeline:
    """A long good step: release ends at 0.35 s, resume starts at 0.5 s (the training gap), continue at 1.2 s."""
    tl = StepTimeline("ours", 20, True, None, 2)
    for i in range(2):
        tl.bars += [
            Bar(i, "pause", 0.0, 0.05, 1, (200,)),
            Bar(i, "release", 0.1, 0.3 + 0.05 * i, 1, (200,)),
            Bar(i, "resume", 0.5 + 0.1 * i, 0.7, 1, (200,)),
            Bar(i, "continue", 1.1, 1.2, 1, (200,)),
        ]
    return tl


def test_title_says_what_killed_the_engines_before_the_502() -> None:
    """Deaths come first, grouped by cause; the 502 the client saw is only the echo."""
    first, second = _old().title.split("\n")
    assert first == (
        "old way, step 1: prefill scheduled after release killed engines 1, 2; release while requests were running killed engine 0"
    )
    assert second == "the client only saw: 502 from engine 1 /release_memory_occupation"
    assert _ours().title == "ours, step 20: ok"


def test_training_gap_is_last_release_to_first_resume() -> None:
    """The gap runs from the last release's answer to the first resume after it; none without a resume."""
    assert _ours().training_gap() == pytest.approx((0.35, 0.5))
    assert _old().training_gap() is None


def test_panels_share_one_time_axis_and_label_the_gap() -> None:
    """A 0.06 s step and a 1.2 s step are drawn on the same x range; the training gap carries its label."""
    plt = pytest.importorskip("matplotlib.pyplot")
    fig = draw_figure([_old(), _ours()])
    try:
        old_ax, ours_ax = fig.axes
        assert old_ax.get_xlim() == ours_ax.get_xlim()
        assert old_ax.get_xlim()[1] > 1.2
        texts = [t.get_text() for t in ours_ax.texts]
        assert any(t.startswith("training") for t in texts)
        assert not any(t.get_text().startswith("training") for t in old_ax.texts)
        assert "prefill scheduled after release" in old_ax.get_title(loc="left")
    finally:
        plt.close(fig)


def _synced() -> StepTimeline:
    """``_ours`` with its weight sync: the engines are paused again after the onload, updated and continued."""
    tl = _ours()
    for i in range(2):
        tl.bars += [
            Bar(i, "pause", 1.3, 1.32, 1, (200,)),
            Bar(i, "weight sync", 1.35, 1.5, 3, (200, 200, 200)),
            Bar(i, "continue", 1.52, 1.55, 1, (200,)),
        ]
    return tl


def test_segments_name_the_transitions_and_why_the_engines_pause_twice() -> None:
    """offload | training | onload | weight sync (paused again): the second pause/continue is the weight sync's."""
    names = [(label, round(a, 2), round(b, 2)) for label, a, b in _synced().segments()]
    assert names == [
        ("offload", 0.0, 0.35),
        ("training (memory released)", 0.35, 0.5),
        ("onload", 0.5, 1.3),
        ("weight sync: paused again", 1.3, 1.55),
    ]
    assert _old().segments() == []  # a step that never reached its training pause is not split


def test_a_transition_run_twice_and_a_call_without_answer_are_said() -> None:
    """Two releases on one engine in the offload: "2 rounds" and why; a held resume: the onload waits out its timeout."""
    tl = _synced()
    tl.bars.append(Bar(1, "pause", 0.31, 0.315, 1, (200,)))
    tl.bars.append(Bar(1, "release", 0.32, 0.34, 1, (200,)))
    tl.marks.append(Mark(0, 0.55, "no answer", "/resume_memory_occupation"))
    labels = [label for label, _, _ in tl.segments()]
    assert labels[0] == "offload, 2 rounds: run again after its engines' memory was reconciled"
    assert labels[2] == "onload (no answer to a resume: it waits out the read timeout)"


def test_the_phase_labels_sit_below_every_engine_row() -> None:
    """No label is drawn over a bar: every text of the panel lies below the last engine's row (the y axis points down)."""
    plt = pytest.importorskip("matplotlib.pyplot")
    tl = _synced()
    fig = draw_figure([tl])
    try:
        [ax] = fig.axes
        texts = {t.get_text(): t.get_position()[1] for t in ax.texts}
        assert set(texts) == {label for label, _, _ in tl.segments()}
        assert all(y > tl.engines - 0.5 for y in texts.values()), texts
        assert ax.get_ylim()[0] >= max(texts.values())  # inside the axes
    finally:
        plt.close(fig)


def test_marks_say_what_the_client_got_instead_of_an_answer() -> None:
    """502, 503/504, resets and held calls are marked; a plain answer or an upstream 502 without fault is a 502 too."""
    assert mark_kind(502, "status_before") == "502" and mark_kind(502, None) == "502"  # injected, or the engine was gone
    assert mark_kind(504, "status_after") == "5xx"
    assert mark_kind(None, "drop_after") == "reset"
    assert mark_kind(None, "hang_after") == "no answer"
    assert mark_kind(200, None) is None and mark_kind(200, "latency") is None
