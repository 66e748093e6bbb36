"""Tests for quotawrap.wrapper.live: the rendering, which limit a line shows, the terminal block, the view."""

from __future__ import annotations

import io
import os
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pyte
import pytest
from hypothesis import given
from hypothesis import strategies as st

from quotawrap.config.settings import Settings
from quotawrap.core.budgets import BudgetUse, parse_budget
from quotawrap.core.quota import QuotaSettings, Snapshot, beijing_day
from quotawrap.core.usage import Usage
from quotawrap.ledger import Ledger
from quotawrap.ledger.base import HoldRequest
from quotawrap.ledger.sqlite.ledger import SQLiteLedger
from quotawrap.wrapper.live import (
    DAILY_LIMIT,
    FREE,
    RUN_CAP,
    SHADED,
    SOLID,
    BottomBlock,
    Gauge,
    LiveView,
    Reading,
    bar,
    block_lines,
    day_limit,
    human,
    percent,
    read_gauges,
    render_line,
    tightest,
    warning_line,
)

NOW = 1_780_000_000.0  # a fixed instant: the Beijing day never changes under a test
DAY = beijing_day(NOW)
MODEL = "deepseek-v4"
ANSI = re.compile(r"\x1b")


class TestBar:
    @pytest.mark.parametrize(
        ("settled", "in_flight", "limit", "expected"),
        [
            (0, 0, 100, "░░░░░░░░░░"),
            (62, 0, 100, "██████░░░░"),
            (1_210_000, 34_000, 1_950_000, "██████▒░░░"),  # the numbers: 1.7% in flight still shows
            (1_210_000, 400_000, 1_950_000, "██████▒▒░░"),
            (85, 25, 100, "████████▒▒"),  # the post-mortem: settled + in flight past the cap fills the bar
            (99, 0, 100, "█████████░"),  # rounded down: full only at the limit
            (100, 0, 100, "██████████"),
            (150, 10, 100, "██████████"),  # clamped at the limit, nothing shaded without room
            (95, 50, 100, "█████████▒"),
            (0, 1, 1_000_000, "▒░░░░░░░░░"),
            (0, 0, 0, "░░░░░░░░░░"),
            (5, 0, 0, "██████████"),
            (0, 5, 0, "▒▒▒▒▒▒▒▒▒▒"),
        ],
    )
    def test_table(self, settled: int, in_flight: int, limit: int, expected: str) -> None:
        """Settled cells rounded down, in flight at least one cell, clamped at the limit."""
        assert bar(settled, in_flight, limit) == expected

    def test_width(self) -> None:
        """The width is a parameter."""
        assert bar(1, 1, 2, width=4) == "██▒▒"

    @given(
        st.integers(0, 10**7),
        st.integers(0, 10**7),
        st.integers(1, 10**7),
        st.integers(1, 40),
    )
    def test_shape(self, settled: int, in_flight: int, limit: int, width: int) -> None:
        """Always `width` cells: solid, then shaded, then free; shaded iff something is in flight and fits."""
        drawn = bar(settled, in_flight, limit, width)
        assert len(drawn) == width
        assert re.fullmatch(f"{SOLID}*{SHADED}*{FREE}*", drawn)
        solid = drawn.count(SOLID)
        assert solid == min(width, settled * width // limit)
        assert (drawn.count(SHADED) > 0) == (in_flight > 0 and solid < width)
        if settled + in_flight >= limit:
            assert FREE not in drawn


class TestHuman:
    @pytest.mark.parametrize(
        ("n", "expected"),
        [
            (0, "0"),
            (950, "950"),
            (999, "999"),
            (1_000, "1k"),
            (1_500, "1.5k"),
            (12_345, "12.3k"),
            (34_000, "34k"),
            (123_456, "123k"),
            (999_999, "1M"),
            (1_210_000, "1.21M"),
            (1_950_000, "1.95M"),
            (2_000_000, "2M"),
            (1_500_000_000, "1.5B"),
            (-34_000, "-34k"),
        ],
    )
    def test_table(self, n: int, expected: str) -> None:
        """Three significant digits and a k/M/B suffix, trailing zeros dropped."""
        assert human(n) == expected

    @given(st.integers(1_000, 10**12))
    def test_close_to_the_number(self, n: int) -> None:
        """The short form is within 0.5% of the number."""
        text = human(n)
        value = float(text[:-1]) * {"k": 1e3, "M": 1e6, "B": 1e9}[text[-1]]
        assert abs(value - n) <= 0.005 * n


class TestPercent:
    @pytest.mark.parametrize(
        ("settled", "limit", "expected"),
        [(1_210_000, 1_950_000, 62), (999, 1000, 99), (1000, 1000, 100), (1500, 1000, 150), (0, 0, 0), (1, 0, 100)],
    )
    def test_table(self, settled: int, limit: int, expected: int) -> None:
        """Settled over the limit, rounded down; over 100% is shown as it is."""
        assert percent(settled, limit) == expected


class TestRenderLine:
    @pytest.mark.parametrize(
        ("args", "expected"),
        [
            (
                (MODEL, 1_210_000, 34_000, 1_950_000, ""),
                "deepseek-v4  1.21M / 1.95M ██████▒░░░ 62% (+34k in flight)",
            ),
            ((MODEL, 1_210_000, 0, 1_950_000, ""), "deepseek-v4  1.21M / 1.95M ██████░░░░ 62%"),
            (
                (MODEL, 12_400, 5_100, 20_000, RUN_CAP),
                "deepseek-v4  12.4k / 20k ██████▒▒░░ 62% of run cap (+5.1k in flight)",
            ),
            (("run", 950, 0, 1000, ""), "run  950 / 1k █████████░ 95%"),
        ],
    )
    def test_table(self, args: tuple[str, int, int, int, str], expected: str) -> None:
        """The issue's shape; the limit is named only when it is not the label's own."""
        assert render_line(*args) == expected


class TestWarningLine:
    def test_in_flight(self) -> None:
        """The issue's wording, with the in-flight part."""
        gauge = Gauge(1_560_000, 34_000, 1_950_000, DAILY_LIMIT)
        assert warning_line(MODEL, 0.8, gauge) == (
            "quotawrap: deepseek-v4 at 80% of daily limit (1.56M / 1.95M, +34k in flight)"
        )

    def test_nothing_in_flight(self) -> None:
        """Without holds open the in-flight part is left out."""
        assert warning_line("run", 0.5, Gauge(10_000, 0, 20_000, RUN_CAP)) == (
            "quotawrap: run at 50% of run cap (10k / 20k)"
        )


def _snapshot(balance: int, usage: int = 0) -> Snapshot:
    return Snapshot(balance=balance, usage_at_sync=usage, lagged_usage=usage, synced_at=NOW, day=DAY)


class TestDayLimit:
    def test_usage_wall_below_the_daily_cap(self) -> None:
        """No sync: min(daily cap 2M, usage wall 1.95M)."""
        assert day_limit(None, QuotaSettings(), DAY) == 1_950_000

    def test_snapshot_binds(self) -> None:
        """A small synced pool: balance + usage - small buffer."""
        assert day_limit(_snapshot(500_000, 100_000), QuotaSettings(), DAY) == 550_000

    def test_yesterdays_snapshot_is_ignored(self) -> None:
        """A snapshot of another day does not set today's limit."""
        old = Snapshot(500_000, 0, 0, NOW - 86_400, beijing_day(NOW - 86_400))
        assert day_limit(old, QuotaSettings(), DAY) == 1_950_000

    def test_balance_wall_is_no_bar_limit(self) -> None:
        """A pool below the balance wall does not make the limit 1 token."""
        assert day_limit(_snapshot(60_000), QuotaSettings(small_buffer=0), DAY) == 60_000


class TestTightest:
    @pytest.mark.parametrize(
        ("day", "run", "expected"),
        [
            (Gauge(10, 0, 1000, DAILY_LIMIT), None, DAILY_LIMIT),
            (Gauge(10, 0, 1000, DAILY_LIMIT), Gauge(10, 0, 500, RUN_CAP), RUN_CAP),
            (Gauge(900, 50, 1000, DAILY_LIMIT), Gauge(10, 0, 500, RUN_CAP), DAILY_LIMIT),
            (Gauge(0, 0, 500, DAILY_LIMIT), Gauge(0, 0, 500, RUN_CAP), DAILY_LIMIT),  # tie: the model's own
            (Gauge(0, 0, 500, DAILY_LIMIT), Gauge(0, 100, 500, RUN_CAP), RUN_CAP),  # in flight counts
        ],
    )
    def test_least_headroom(self, day: Gauge, run: Gauge | None, expected: str) -> None:
        """The limit with the least headroom left (settled and in flight both count)."""
        assert tightest(day, run).limit_name == expected


class TestBlockLines:
    def test_run_line_first_then_models_aligned(self) -> None:
        """The run line, then each model at its tightest limit, labels padded to one column."""
        reading = Reading(
            run=Gauge(12_400, 5_100, 20_000, RUN_CAP),
            models={
                MODEL: Gauge(1_210_000, 5_100, 1_950_000, DAILY_LIMIT),
                "doubao-x": Gauge(0, 0, 1_950_000, DAILY_LIMIT),
            },
        )
        assert block_lines(reading) == [
            "run          12.4k / 20k ██████▒▒░░ 62% (+5.1k in flight)",
            "deepseek-v4  12.4k / 20k ██████▒▒░░ 62% of run cap (+5.1k in flight)",
            "doubao-x     12.4k / 20k ██████▒▒░░ 62% of run cap (+5.1k in flight)",
        ]

    def test_model_at_its_daily_limit(self) -> None:
        """Without a run cap a model line shows its daily limit, unnamed."""
        reading = Reading(run=None, models={MODEL: Gauge(1_210_000, 34_000, 1_950_000, DAILY_LIMIT)})
        assert block_lines(reading) == ["deepseek-v4  1.21M / 1.95M ██████▒░░░ 62% (+34k in flight)"]

    def test_empty(self) -> None:
        """No calls yet: no lines."""
        assert block_lines(Reading(None, {})) == []


# -- against a real ledger -----------------------------------------------------------------------


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[SQLiteLedger]:
    opened = SQLiteLedger(tmp_path / "ledger.sqlite3", clock=lambda: NOW)
    yield opened
    opened.close()


def _hold(ledger: Ledger, tokens: int, *, run_id: str = "run-1", model: str = MODEL, settle: int | None = None) -> str:
    request = HoldRequest(
        run_id=run_id,
        model=model,
        day=DAY,
        reserve=tokens,
        endpoint="chat",
        pid=os.getpid(),
        host=socket.gethostname(),
        expires_at=NOW + 3600,
    )
    hold_id = ledger.reserve(request, lambda _snapshot: []).hold_id
    if settle is not None:
        ledger.settle(hold_id, Usage(prompt_tokens=0, completion_tokens=settle, total_tokens=settle))
    return hold_id


class TestBudgetWarnings:
    def test_a_token_and_a_money_budget_of_one_selector_and_period_warn_apart(self, ledger: SQLiteLedger) -> None:
        """Two budgets that share a label (team=a/day) each keep their own thresholds: neither re-arms the other's."""
        tokens = BudgetUse(parse_budget("team=a:1000/day,soft"), DAY, 600, 0, None)
        money = BudgetUse(parse_budget("team=a:cny1/day,soft"), DAY, 100_000, 0, None)
        assert tokens.label == money.label
        view = LiveView(ledger, Settings(), "run-1", stream=io.StringIO())
        reading = Reading(None, {}, (tokens, money))
        assert view._crossings(reading) == ["quotawrap: budget team=a/day at 50% (600 / 1,000 tokens)"]
        assert view._crossings(reading) == []  # the next poll, the same numbers: nothing new


class TestReadGauges:
    def test_run_and_model_day_counters(self, ledger: SQLiteLedger) -> None:
        """The run gauge counts this run; the model gauge counts the whole model-day (other runs too)."""
        _hold(ledger, 3_000, settle=2_000)
        _hold(ledger, 1_000)
        _hold(ledger, 500_000, run_id="other-run", settle=400_000)
        reading = read_gauges(ledger, Settings(cap_tokens=10_000), "run-1", NOW)
        assert reading.run == Gauge(2_000, 1_000, 10_000, RUN_CAP)
        assert reading.models == {MODEL: Gauge(402_000, 1_000, 1_950_000, DAILY_LIMIT)}

    def test_only_this_runs_models(self, ledger: SQLiteLedger) -> None:
        """A model only another run called gets no line."""
        _hold(ledger, 100, model="other-model", run_id="other-run")
        _hold(ledger, 100)
        assert list(read_gauges(ledger, Settings(), "run-1", NOW).models) == [MODEL]

    def test_no_calls_no_run_line(self, ledger: SQLiteLedger) -> None:
        """Before the first call there is nothing to show, not even the run cap."""
        assert read_gauges(ledger, Settings(cap_tokens=10), "run-1", NOW) == Reading(None, {})

    def test_snapshot_sets_the_limit(self, ledger: SQLiteLedger) -> None:
        """A synced pool below the daily cap is the model's limit."""
        ledger.put_snapshot(MODEL, _snapshot(300_000))
        _hold(ledger, 100)
        reading = read_gauges(ledger, Settings(), "run-1", NOW)
        assert reading.models[MODEL].limit == 250_000


# -- the terminal block --------------------------------------------------------------------------


class _Terminal:
    """A VT100 emulator: what a user would see."""

    def __init__(self, columns: int = 60, rows: int = 10) -> None:
        self.columns, self.rows = columns, rows
        self.screen = pyte.Screen(columns, rows)
        self._stream = pyte.Stream(self.screen)

    def feed(self, text: str) -> None:
        self._stream.feed(text.replace("\n", "\r\n"))  # what the tty's ONLCR does

    @property
    def lines(self) -> list[str]:
        return [line.rstrip() for line in self.screen.display]


class TestBottomBlock:
    def test_child_output_scrolls_above_the_block(self) -> None:
        """The block stays on the bottom rows; the child's lines scroll above it, none overwritten."""
        term, block = _Terminal(), BottomBlock()
        term.feed("child 0\n")
        term.feed(block.frame(["line A", "line B"], term.columns, term.rows))
        for n in range(1, 12):
            term.feed(f"child {n}\n")
            term.feed(block.frame([f"line A {n}", f"line B {n}"], term.columns, term.rows))
        assert term.lines[-2:] == ["line A 11", "line B 11"]
        assert term.lines[:-2] == [f"child {n}" for n in range(5, 12)] + [""]

    def test_growth_keeps_the_childs_cursor(self) -> None:
        """Taking another row mid-line: the child's partial line continues where it was."""
        term, block = _Terminal(rows=6), BottomBlock()
        term.feed("a\nb\nc\nd\npartial")
        term.feed(block.frame(["one"], term.columns, term.rows))
        term.feed(block.frame(["one", "two"], term.columns, term.rows))
        term.feed(" line\nnext\n")
        assert term.lines == ["d", "partial line", "next", "", "one", "two"]

    def test_release_prints_nothing_twice(self) -> None:
        """After release the rows are blank and the final lines print once, below the child's output."""
        term, block = _Terminal(rows=8), BottomBlock()
        term.feed(block.frame(["live 1"], term.columns, term.rows))
        term.feed("child\n")
        term.feed(block.frame(["live 2"], term.columns, term.rows))
        term.feed(block.release() + "final\n")
        assert [line for line in term.lines if line] == ["child", "final"]

    def test_lines_fit_the_width(self) -> None:
        """A line wider than the terminal is cut, never wrapped into the child's rows."""
        term, block = _Terminal(columns=20, rows=6), BottomBlock()
        term.feed(block.frame(["x" * 50], term.columns, term.rows))
        assert term.lines[-1] == "x" * 19
        assert term.lines[:-1] == [""] * 5

    def test_tiny_terminal_draws_nothing(self) -> None:
        """Fewer rows than the block plus two for the child: the block is cut, or not drawn."""
        block = BottomBlock()
        assert block.frame(["a", "b"], 80, 2) == ""
        assert block.frame(["a", "b"], 80, 0) == ""
        assert block.release() == ""

    def test_resize_takes_the_rows_afresh(self) -> None:
        """After a resize the block is on the new bottom rows."""
        block = BottomBlock()
        block.frame(["a"], 40, 10)
        term = _Terminal(rows=14)
        term.feed(block.frame(["after resize"], term.columns, term.rows))
        assert term.lines[-1] == "after resize"
        assert block.reserved == 1


# -- the view ------------------------------------------------------------------------------------


class _FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


class TestLiveViewPlain:
    def test_warnings_only_no_escapes(self, ledger: SQLiteLedger) -> None:
        """Off a terminal: one plain line per crossed threshold, each once, no ANSI."""
        out = io.StringIO()
        view = LiveView(ledger, Settings(cap_tokens=10_000), "run-1", stream=out, clock=lambda: NOW)
        _hold(ledger, 6_000, settle=5_500)
        view.poll()
        view.poll()
        _hold(ledger, 3_000, settle=3_000)
        _hold(ledger, 500)
        view.stop()
        assert out.getvalue().splitlines() == [
            "quotawrap: run at 50% of run cap (5.5k / 10k)",
            "quotawrap: run at 80% of run cap (8.5k / 10k, +500 in flight)",
        ]
        assert not ANSI.search(out.getvalue())

    def test_two_thresholds_in_one_poll_are_one_line(self, ledger: SQLiteLedger) -> None:
        """0 -> 85% between two looks: one line, at 80% (it used to print 50% and 80% together)."""
        out = io.StringIO()
        view = LiveView(ledger, Settings(cap_tokens=10_000), "run-1", stream=out, clock=lambda: NOW)
        view.poll()
        _hold(ledger, 9_000, settle=8_500)
        view.stop()
        assert out.getvalue().splitlines() == ["quotawrap: run at 80% of run cap (8.5k / 10k)"]

    def test_alert_at_sets_the_percents(self, ledger: SQLiteLedger) -> None:
        """--alert-at 30,60: the lines come at 30% and 60%, not at 50%."""
        out = io.StringIO()
        view = LiveView(ledger, Settings(cap_tokens=10_000, alert_at="30,60"), "run-1", stream=out, clock=lambda: NOW)
        _hold(ledger, 3_500, settle=3_500)
        view.poll()
        _hold(ledger, 2_000, settle=2_000)
        view.poll()
        _hold(ledger, 1_000, settle=1_000)
        view.stop()
        assert out.getvalue().splitlines() == [
            "quotawrap: run at 30% of run cap (3.5k / 10k)",
            "quotawrap: run at 60% of run cap (6.5k / 10k)",
        ]

    def test_daily_limit_warning(self, ledger: SQLiteLedger) -> None:
        """A model past 50% of its day (other runs included) is logged at the first look."""
        _hold(ledger, 1_000_000, run_id="earlier", settle=1_000_000)
        _hold(ledger, 10)
        out = io.StringIO()
        LiveView(ledger, Settings(), "run-1", stream=out, clock=lambda: NOW).stop()
        assert out.getvalue() == f"quotawrap: {MODEL} at 50% of daily limit (1M / 1.95M, +10 in flight)\n"

    def test_ledger_errors_do_not_escape(self) -> None:
        """A ledger that fails is skipped quietly: the view never fails the run."""

        class Broken:
            def run_totals(self, run_id: str) -> None:
                raise OSError("gone")

        out = io.StringIO()
        view = LiveView(Broken(), Settings(), "run-1", stream=out)  # type: ignore[arg-type]
        view.start()
        view.stop()
        assert out.getvalue() == ""


class TestLiveViewTerminal:
    def _view(self, ledger: Ledger, out: io.StringIO, term: _Terminal) -> LiveView:
        return LiveView(
            ledger,
            Settings(cap_tokens=10_000),
            "run-1",
            stream=out,
            clock=lambda: NOW,
            terminal_size=lambda: (term.columns, term.rows),
        )

    def test_live_then_final(self, ledger: SQLiteLedger, monkeypatch: pytest.MonkeyPatch) -> None:
        """While a hold is open the block shows it shaded; on stop the final lines print once."""
        monkeypatch.setenv("TERM", "xterm")
        out, term = _FakeTTY(), _Terminal(columns=80)
        view = self._view(ledger, out, term)
        assert view.is_terminal
        hold = _hold(ledger, 4_000)
        view.poll()
        term.feed(out.getvalue())
        assert term.lines[-2:] == [
            "run          0 / 10k ▒▒▒▒░░░░░░ 0% (+4k in flight)",
            "deepseek-v4  0 / 10k ▒▒▒▒░░░░░░ 0% of run cap (+4k in flight)",
        ]
        ledger.settle(hold, Usage(prompt_tokens=0, completion_tokens=6_000, total_tokens=6_000))
        out.seek(0)
        out.truncate()
        view.stop()
        view.stop()
        term.feed(out.getvalue())
        assert [line for line in term.lines if line] == [
            "quotawrap: run at 50% of run cap (6k / 10k)",
            "run          6k / 10k ██████░░░░ 60%",
            "deepseek-v4  6k / 10k ██████░░░░ 60% of run cap",
        ]

    def test_dumb_terminal_is_plain(self, ledger: SQLiteLedger, monkeypatch: pytest.MonkeyPatch) -> None:
        """TERM=dumb cannot move the cursor: plain mode."""
        monkeypatch.setenv("TERM", "dumb")
        out = _FakeTTY()
        view = self._view(ledger, out, _Terminal())
        _hold(ledger, 100)
        view.stop()
        assert not view.is_terminal
        assert out.getvalue() == ""
