"""The in-process line, the run's events log and what the summary, live view and status make of it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from quotawrap.config.settings import Settings
from quotawrap.ledger.base import ModelTotals, RunTotals
from quotawrap.support.events import EventLog, EventsTail, percentile, read_events, summarize, waiting_now
from quotawrap.wrapper.live import wait_line
from quotawrap.wrapper.summary import format_summary, run_report


def _lines(*events: dict) -> list[str]:
    return [json.dumps(event) for event in events]


class TestEvents:
    def test_summarize(self) -> None:
        """Finished waits give the count and percentiles; an open wait is waiting now; bounds and superseded add up."""
        events = summarize(
            [
                *_lines(
                    {"ev": "wait", "id": "a", "model": "m"},
                    {"ev": "waited", "id": "a", "model": "m", "outcome": "admitted", "waited_s": 0.5, "superseded": 1},
                    {"ev": "wait", "id": "b", "model": "m"},
                    {"ev": "waited", "id": "b", "model": "m", "outcome": "refused", "waited_s": 2.0, "superseded": 0},
                    {"ev": "wait", "id": "c", "model": "m"},
                    {"ev": "superseded", "model": "m", "n": 2},
                    {"ev": "bound", "model": "m", "bound": 4096},
                ),
                "not json",
                "{}",
            ]
        )
        assert events.waits == [0.5, 2.0]
        assert (events.admitted_after_wait, events.refused_after_wait, events.waiting_now) == (1, 1, 1)
        assert events.superseded_by_model == {"m": 3}
        assert events.bounded_by_model == {"m": 1}
        assert (events.bounds, events.cut) == ({"added": 1}, {})  # an older line: it only ever added, said no cut
        assert (events.wait_p50, events.wait_p99) == (0.5, 2.0)

    def test_tail_reads_only_what_was_appended(self, tmp_path: Path) -> None:
        """A half-written last line waits for its end; nothing is counted twice."""
        path = tmp_path / "events.jsonl"
        log = EventLog(str(path))
        tail = EventsTail(path)
        log.write({"ev": "bound", "model": "m"})
        with open(path, "a") as handle:
            handle.write('{"ev": "bou')
        assert tail.poll().bounded_calls == 1
        with open(path, "a") as handle:
            handle.write('nd", "model": "m"}\n')
        assert tail.poll().bounded_calls == 2
        assert tail.poll().bounded_calls == 2
        assert oct(path.stat().st_mode & 0o777) == "0o600"

    def test_bound_lines_are_the_events_write_makes(self, tmp_path: Path) -> None:
        """``bounds`` keeps its last line encoded: each line is the one ``write`` makes of the same event,
        one write or several, and a different model, bound or process gets its own."""
        kept, written = EventLog(str(tmp_path / "kept.jsonl")), EventLog(str(tmp_path / "written.jsonl"))
        events = [
            ("m", 4096, 7, "added", False),
            ("m", 4096, 7, "added", False),
            ("m", 512, 7, "added", False),
            ("n", 512, 7, "added", False),
            ("m", 512, 8, "added", False),
            ("m", 512, 8, "added", True),
            ("m", 64, 8, "replaced", True),
        ]
        kept.bounds(events[:1])
        kept.bounds(events[1:])
        kept.bounds([])  # nothing to write
        for model, bound, pid, how, cut in events:
            written.write({"ev": "bound", "model": model, "bound": bound, "pid": pid, "how": how, "cut": cut})
        assert (tmp_path / "kept.jsonl").read_bytes() == (tmp_path / "written.jsonl").read_bytes()
        read = read_events(tmp_path / "kept.jsonl")
        assert read.bounded_by_model == {"m": 6, "n": 1}
        assert (read.bounds, read.cut) == ({"added": 6, "replaced": 1}, {"added": 1, "replaced": 1})
        assert (read.replaced_by_model, read.cut_by_model) == ({"m": 1}, {"m": 2})

    def test_directory_made_once_and_again_if_removed(self, tmp_path: Path) -> None:
        """A bounded call writes a line each: the directory is made on the first, and again if it went."""
        path = tmp_path / "events" / "run.jsonl"
        log = EventLog(str(path))
        log.write({"ev": "bound", "model": "m"})
        path.unlink()
        path.parent.rmdir()
        log.write({"ev": "bound", "model": "m"})
        assert read_events(path).bounded_calls == 1
        assert oct(path.parent.stat().st_mode & 0o777) == "0o700"

    def test_a_descriptor_the_program_closed_and_reused_is_left_to_it(self, tmp_path: Path) -> None:
        """The log keeps its file open; a program that closes every descriptor and opens its own file
        on the same number must find that file untouched, and still open after the log is gone."""
        import gc

        path = tmp_path / "events.jsonl"
        log = EventLog(str(path))
        log.write({"ev": "bound", "model": "m"})
        fd = log._fd
        assert fd is not None
        other = os.open(tmp_path / "program.txt", os.O_WRONLY | os.O_CREAT, 0o600)
        os.dup2(other, fd)  # the program's file now has the log's number
        os.close(other)
        log.write({"ev": "bound", "model": "m"})
        assert read_events(path).bounded_calls == 2
        assert (tmp_path / "program.txt").read_bytes() == b""
        del log
        gc.collect()
        os.write(fd, b"still open")
        os.close(fd)
        assert (tmp_path / "program.txt").read_bytes() == b"still open"

    def test_missing_log(self, tmp_path: Path) -> None:
        """No log (nothing waited, or no run): no events, no error."""
        assert read_events(tmp_path / "absent.jsonl").waits == []
        assert read_events(None).bounded_calls == 0

    def test_waiting_now_counts_live_processes_only(self, tmp_path: Path) -> None:
        """status counts a wait while its process lives; a dead child's open wait is not waiting."""
        (tmp_path / "run.jsonl").write_text(
            "\n".join(
                _lines(
                    {"ev": "wait", "id": "live", "model": "m", "pid": os.getpid()},
                    {"ev": "wait", "id": "dead", "model": "m", "pid": 2**22 + 12345},
                    {"ev": "wait", "id": "over", "model": "m", "pid": os.getpid()},
                    {"ev": "waited", "id": "over", "model": "m", "outcome": "admitted", "waited_s": 1},
                )
            )
        )
        assert waiting_now(tmp_path) == {"m": 1}

    def test_percentile(self) -> None:
        """Nearest rank; None without values."""
        assert percentile([], 50) is None
        assert percentile([3.0, 1.0, 2.0], 50) == 2.0


class TestReport:
    def test_superseded_attempts_are_not_blocks(self) -> None:
        """A call refused once, then admitted after waiting, is not counted as blocked in the summary."""
        totals = RunTotals("r", {"m": ModelTotals(calls=3, blocked_calls=2)})
        events = summarize(
            _lines(
                {"ev": "wait", "id": "a", "model": "m"},
                {"ev": "waited", "id": "a", "model": "m", "outcome": "admitted", "waited_s": 0.25, "superseded": 1},
                {"ev": "bound", "model": "m"},
            )
        )
        report = run_report(totals, settings=Settings(), exit_code=0, events=events)
        assert report["totals"]["blocked_calls"] == 1
        assert report["models"]["m"]["blocked_calls"] == 1
        assert report["waits"]["waited_calls"] == 1
        text = format_summary(report)
        assert "1 call(s) waited for room" in text and "p99 0.25s" in text
        assert "1 call(s) that may think set no output bound: sent with max_completion_tokens" in text

    @pytest.mark.parametrize("policy", ["ceiling", "cut"])
    def test_each_way_the_guard_bounded_calls_has_its_line_and_its_cuts(self, policy: str) -> None:
        """Calls that set no bound and calls whose max_tokens went out as the bound are told apart, each with
        the calls cut short at the guard's bound, in the summary and the report's JSON (per model too)."""
        totals = RunTotals("r", {"m": ModelTotals(calls=5), "n": ModelTotals(calls=1)})
        bound = [
            {"ev": "bound", "model": "m", "bound": 8192, "how": "added", "cut": False},
            {"ev": "bound", "model": "m", "bound": 8192, "how": "added", "cut": True},
            {"ev": "bound", "model": "m", "bound": 64, "how": "replaced", "cut": True},
            {"ev": "bound", "model": "n", "bound": 64, "how": "replaced", "cut": False},
        ]
        report = run_report(
            totals, settings=Settings(reasoning_reserve=policy), exit_code=0, events=summarize(_lines(*bound))
        )
        assert report["bounds"] == {
            "reasoning_reserve": policy,
            "added": 2,
            "replaced": 2,
            "added_cut": 1,
            "replaced_cut": 1,
        }
        assert (report["totals"]["bounded_calls"], report["totals"]["cut_by_bound_calls"]) == (4, 2)
        assert report["totals"]["replaced_max_tokens_calls"] == 2
        model = report["models"]["m"]
        assert (model["bounded_calls"], model["replaced_max_tokens_calls"], model["cut_by_bound_calls"]) == (3, 1, 2)
        lines = format_summary(report).splitlines()
        added = next(line for line in lines if "set no output bound" in line)
        replaced = next(line for line in lines if "set max_tokens" in line)
        assert added.startswith("  2 call(s)") and "1 cut short there" in added
        assert replaced.startswith("  2 call(s)") and "as max_completion_tokens" in replaced
        assert "1 cut short there" in replaced
        assert ("--reasoning-reserve cut" in replaced) is (policy == "cut")
        assert not any("left their whole output open" in line for line in lines)

    def test_no_bound_line_without_bounded_calls(self) -> None:
        """A run whose calls the guard did not change says nothing about bounds."""
        report = run_report(RunTotals("r", {"m": ModelTotals(calls=1)}), settings=Settings(), exit_code=0)
        assert "bound" not in format_summary(report)

    def test_live_wait_line(self) -> None:
        """The live view's line says who waits now and how long waits took; nothing before any wait."""
        assert wait_line(summarize([])) is None
        events = summarize(_lines({"ev": "wait", "id": "a", "model": "m"}))
        assert wait_line(events) == "waiting  1 call(s) for room now"
