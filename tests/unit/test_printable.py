"""Text from programs and providers reaches the terminal escaped: one helper, and every table and line uses it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quotawrap.books.report import render_table
from quotawrap.books.status import render_sessions, render_status, render_unguarded
from quotawrap.support import log as _log
from quotawrap.support.log import printable, warn
from quotawrap.wrapper.live import Gauge, Reading, block_lines, warning_line
from quotawrap.wrapper.summary import step_summary_markdown

HOSTILE = "evil\n\x1b[31mRED\x1b[0m\r\u202etxt\x07"


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("deepseek-v4-flash", "deepseek-v4-flash"),
        ("豆包-模型 ü", "豆包-模型 ü"),  # letters of any script stay
        ("a\nb", "a\\nb"),
        ("a\r\tb", "a\\r\\tb"),
        ("\x1b[2J", "\\x1b[2J"),
        ("\x7f\x9b", "\\x7f\\x9b"),  # DEL and the 8-bit CSI
        ("right\u202eleft", "right\\u202eleft"),  # bidi override: reorders what follows
        ("zero\u200bwidth", "zero\\u200bwidth"),
        ("line\u2028sep", "line\\u2028sep"),
        ("", ""),
    ],
)
def test_control_characters_are_written_as_escapes(text: str, shown: str) -> None:
    assert printable(text) == shown


@given(st.text())
def test_the_result_is_printable_and_escaping_twice_changes_nothing(text: str) -> None:
    once = printable(text)
    assert once.isprintable() and printable(once) == once
    assert printable(text, lines=True).split("\n") == [printable(line) for line in text.split("\n")]


def test_a_warning_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    warn(f"model {HOSTILE} refused")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err and "\u202e" not in err


def _no_raw_control(text: str, lines: int) -> None:
    assert "\x1b" not in text and "\r" not in text and "\u202e" not in text and "\x07" not in text
    assert text.count("\n") == lines - 1, text


def test_the_ledger_tables_escape_their_cells() -> None:
    row = {
        "key": HOSTILE,
        "calls": 1,
        "blocked_calls": 0,
        "settled_tokens": 5,
        "cost_micro_cny": 7,
        "unresolved_calls": 0,
    }
    table = render_table([row, {**row, "key": "plain"}], "model")
    _no_raw_control(table, 4)
    header, _, first, second = table.split("\n")
    assert len(first) == len(second) == len(header)  # the widths count the escaped name
    sessions = render_sessions(
        [
            {
                "session": "s1",
                "started_at": 0.0,
                "state": "exit 0",
                "calls": 1,
                "blocked_calls": 0,
                "settled_tokens": 5,
                "cost_micro_cny": 7,
                "command": f"python agent.py {HOSTILE}",
            }
        ]
    )
    _no_raw_control(sessions, 1)
    unguarded = render_unguarded([{"session": "s", "pid": 1, "command": HOSTILE, "reason": HOSTILE, "stopped": False}])
    _no_raw_control("\n".join(unguarded), 2)


def test_status_escapes_the_model_name() -> None:
    row = {
        "model": HOSTILE,
        "evicted": False,
        "day": "2026-01-01",
        "usage": 1,
        "in_flight": 0,
        "effective_limit": 10,
        "binding": "daily_cap",
        "headroom": 9,
        "limit_detail": "daily cap 10",
        "output_allowance": 8192,
        "reasoning_ceiling": 262144,
        "reasoning_ceiling_known": False,
        "reasoning_reserve": "ceiling",
        "balance_known": False,
        "expiring_within_9_days": [],
        "keep_alive_advice": "",
        "open_video_tasks": [{"task_id": HOSTILE, "held": 5, "since": 0.0}],
        "seconds_to_reset": 60,
    }
    text = render_status([row])
    assert "\x1b" not in text and "\u202e" not in text
    assert text.split("\n")[0].startswith("evil\\n\\x1b[31mRED")


def test_the_live_view_escapes_model_names() -> None:
    gauge = Gauge(5, 0, 100, "daily limit")
    lines = block_lines(Reading(None, {HOSTILE: gauge, "plain": gauge}))
    _no_raw_control("\n".join(lines), 2)
    assert len(lines[0]) == len(lines[1])
    _no_raw_control(warning_line(HOSTILE, 0.5, gauge), 1)


def test_the_step_summary_keeps_its_table_whole() -> None:
    totals = {"calls": 1, "settled_tokens": 5, "blocked_calls": 0, "unguarded_processes": []}
    model = {"calls": 1, "blocked_calls": 0, "settled_tokens": 5, "overshoot_calls": 0, "unresolved_calls": 0}
    report = {
        "session": "s1",
        "totals": totals,
        "models": {f"a|b {HOSTILE}": model},
        "limits": {},
        "exit_code": 0,
        "mode": "enforce",
    }
    rows = [line for line in step_summary_markdown(report).split("\n") if line.startswith("| a")]
    assert len(rows) == 1 and rows[0].count(" | ") == 6 and "\x1b" not in rows[0]


def test_the_helper_is_the_one_in_log() -> None:
    """One helper: the edges import it from _log, which every module may import."""
    import quotawrap.books.report
    import quotawrap.books.status
    import quotawrap.wrapper.live
    import quotawrap.wrapper.summary

    for module in (quotawrap.books.report, quotawrap.wrapper.live, quotawrap.wrapper.summary, quotawrap.books.status):
        assert module.printable is _log.printable


def test_the_run_summary_escapes_model_names_and_keeps_its_columns() -> None:
    from quotawrap.config.settings import Settings
    from quotawrap.ledger import ModelTotals, RunTotals
    from quotawrap.wrapper.summary import format_summary, run_report

    totals = RunTotals("r1", {HOSTILE: ModelTotals(calls=1, settled_tokens=5), "plain": ModelTotals(calls=2)})
    text = format_summary(run_report(totals, settings=Settings(), exit_code=0))
    _no_raw_control(text, 4)
    _head, header, *rows = text.split("\n")
    assert len(rows) == 2 and all(len(row) == len(header) for row in rows)
