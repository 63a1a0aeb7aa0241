"""A cloud's preemption notice asked on the node (agents/preemption.py): the user's script
says whether the node goes (exit 0) and when (its first line); anything else is no notice."""

from __future__ import annotations

import time

from agents.preemption import ask, deadline


def script(tmp_path, text):
    path = tmp_path / "check.sh"
    path.write_text(text)
    return str(path)


def test_exit_0_is_a_notice_and_its_first_line_says_when(tmp_path):
    assert ask(script(tmp_path, "echo 120; echo more"), 5, "t") == "120"
    assert ask(script(tmp_path, "exit 0"), 5, "t") == ""
    assert ask(script(tmp_path, "echo 2026-11-26T17:00:00Z; exit 1"), 5, "t") is None
    assert ask(str(tmp_path / "missing.sh"), 5, "t") is None  # sh fails: no notice


def test_a_check_past_its_time_is_no_notice_and_leaves_nothing_behind(tmp_path):
    marker = tmp_path / "survived"
    started = time.monotonic()
    assert ask(script(tmp_path, f"(sleep 3; touch {marker}) & sleep 30; echo 1"), 1, "t") \
        is None
    assert time.monotonic() - started < 5
    time.sleep(3.5)
    assert not marker.exists()  # its whole process group went


def test_when_is_seconds_or_an_iso_time_else_the_grace():
    now = 1_800_000_000.0  # 2027-01-15T08:00:00Z
    assert deadline("90", 10, now) == now + 90
    assert deadline("2027-01-15T09:00:00Z", 10, now) == now + 3600  # AWS's form
    assert deadline("2027-01-15T10:00:00+01:00", 10, now) == now + 3600
    assert deadline('"2027-01-15T09:00:00"', 10, now) == now + 3600  # no zone: UTC
    assert deadline("terminate", 10, now) == now + 10
    assert deadline("", 10, now) == now + 10
    assert deadline("-5", 10, now) == now  # already due
    assert deadline("1e12", 10, now) == now + 86400  # capped
    assert deadline("nan", 10, now) == now + 10
    assert deadline("2020-01-01T00:00:00Z", 10, now) == now  # in the past: now
