"""The choice between bit-identical forms of a call by timing its first calls (``ops.faster_form``)."""

from __future__ import annotations

import time

import pytest

from hw_agnostic.ops.faster_form import TIMED_CALLS, FasterForm


def _form(name: str, seconds: float, ran: list[str]):
    def form(x: int) -> int:
        ran.append(name)
        time.sleep(seconds)
        return x + 1

    return form


def test_forms_take_turns_then_the_fastest_runs_every_call():
    ran: list[str] = []
    chooser = FasterForm(_form("slow", 0.004, ran), _form("fast", 0.0, ran))
    trial = 2 * (TIMED_CALLS + 1)  # one untimed call each, then TIMED_CALLS each, alternating
    assert [chooser(i) for i in range(trial + 5)] == [i + 1 for i in range(trial + 5)]
    assert ran[:trial] == ["slow", "fast"] * (TIMED_CALLS + 1) and ran[trial:] == ["fast"] * 5
    assert chooser.chosen is chooser.forms[1]


def test_a_slow_first_call_does_not_count():
    """A form's first call may compile: it is not timed."""
    ran: list[str] = []
    first = [True]

    def compiles_once(x: int) -> int:
        ran.append("compiles")
        if first[0]:
            first[0] = False
            time.sleep(0.05)
        return x

    chooser = FasterForm(compiles_once, _form("steady", 0.003, ran))
    for i in range(2 * (TIMED_CALLS + 1)):
        chooser(i)
    assert chooser.chosen is compiles_once


def test_one_form_is_no_choice():
    with pytest.raises(ValueError, match="at least two forms"):
        FasterForm(lambda x: x)
