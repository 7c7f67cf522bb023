"""The timeline picture: one time axis for every panel, the training gap labelled, the death's cause in the title."""

from __future__ import annotations

import pytest

from resilience.cli.timeline import Bar, Mark, StepTimeline, draw_figure


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
