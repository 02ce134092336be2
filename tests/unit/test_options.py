"""The option parsers of app/options.py at their edges: the bounds themselves are taken, one past them is not,
and a number that overflows to infinity is no finite bound."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from dsv41_convert.app.options import finite_number, given_path, parse_workers, whole_number
from dsv41_convert.store.machine import MAX_THREADS


def test_whole_number_takes_its_bounds_and_refuses_one_past_them():
    threads = whole_number(1, most=MAX_THREADS)
    assert threads("1") == 1 and threads(str(MAX_THREADS)) == MAX_THREADS
    for value in ("0", str(MAX_THREADS + 1), "-1", "1.0", "", "٣"):
        with pytest.raises(typer.BadParameter, match=rf"expected a number >= 1 and <= {MAX_THREADS} in the digits"):
            threads(value)
    assert whole_number()("-3") == -3  # --seed: no bound


@pytest.mark.parametrize("value", ["1e999", "-1e999", "nan", "inf", "-inf", "Infinity", "0x10", ""])
def test_finite_number_refuses_what_is_no_finite_decimal(value):
    with pytest.raises(typer.BadParameter, match="expected a finite number >= 0"):
        finite_number(0)(value)


def test_finite_number_takes_its_bounds():
    cos = finite_number(-1, 1)
    assert (cos("-1"), cos("1"), cos("1e0"), cos(".5")) == (-1.0, 1.0, 1.0, 0.5)
    for value in ("1.0000001", "-1.0000001", "2"):
        with pytest.raises(typer.BadParameter, match=r"expected a finite number >= -1 and <= 1"):
            cos(value)
    assert finite_number(0)("1e308") == 1e308


def test_workers_is_auto_or_a_count_of_at_least_one():
    assert parse_workers("auto") == 0 and parse_workers("1") == 1 and parse_workers("16") == 16
    for value in ("0", "Auto", "-2", "two"):
        with pytest.raises(typer.BadParameter, match="expected a number >= 1 in the digits 0-9 or auto"):
            parse_workers(value)


def test_a_path_is_taken_as_given_but_empty_or_with_an_unexpanded_tilde(tmp_path, monkeypatch):
    """given_path: "" (a variable left unset) was the current folder; `~/x` after `--option=` a folder named ~."""
    monkeypatch.chdir(tmp_path)
    assert given_path("a/b") == Path("a/b") and given_path(".") == Path(".")
    with pytest.raises(typer.BadParameter, match="an empty path"):
        given_path("")
    with pytest.raises(typer.BadParameter, match="~ is not expanded here"):
        given_path("~/models")
    (tmp_path / "~").mkdir()
    assert given_path("~/models") == Path("~/models")  # a folder of that name is there: taken
