"""progress.py: the stage seconds of `--json` and the counting labels of the progress bars."""

from __future__ import annotations

from dsv41_convert.progress import add_seconds, counted, counting


def test_stage_seconds_are_summed_over_chunks_per_stage():
    """Catches add_seconds keeping the last chunk's seconds instead of their sum."""
    stages: dict[str, float] = {}
    for stage, seconds in [("read", 0.25), ("write", 1.0), ("read", 0.5), ("read", 2.0)]:
        add_seconds(stages, stage, seconds)
    assert stages == {"read": 2.75, "write": 1.0}


def test_a_counting_label_round_trips_and_a_byte_label_counts_no_noun():
    """A byte bar's noun is None (the columns test `noun is None`). Catches counted giving "" for a byte label."""
    assert counted(counting("pass 1/4 (prefill)", "units")) == ("pass 1/4 (prefill)", "units")
    assert counted("model0-mp8.safetensors") == ("model0-mp8.safetensors", None)


def test_a_progress_label_is_shown_as_it_is(capsys):
    """The bar's label went through rich markup: a file named `a:100:b` was shown as `a\U0001f4afb`."""
    from dsv41_convert.app import report

    with report.byte_progress("title") as progress:
        progress("a:100:b[x]y", 1, 1)
    assert "a:100:b[x]y " in capsys.readouterr().err
