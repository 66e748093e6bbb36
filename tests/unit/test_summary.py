"""Tests for quotawrap.wrapper.summary: what a run's summary says of the calls that went around the guard."""

from __future__ import annotations

import json
from pathlib import Path

from quotawrap.config.settings import Settings
from quotawrap.core.identity import UNMAPPED
from quotawrap.ledger import ModelTotals, RunTotals
from quotawrap.wrapper.summary import format_summary, read_unguarded, run_report


class TestReadUnguarded:
    def test_by_reason(self, tmp_path: Path) -> None:
        """--fail-open's records (older ones name no reason) and --model's are counted apart, per model."""
        log = tmp_path / "unguarded.jsonl"
        records = [
            {"model": "a", "error": "down"},
            {"model": "a", "reason": "fail-open", "error": "down"},
            {"model": "b", "reason": "model-filter", "error": None},
            {"model": "b", "reason": "model-filter", "error": None},
        ]
        log.write_text("".join(json.dumps(record) + "\n" for record in records))
        assert read_unguarded(log) == {"a": 2}
        assert read_unguarded(log, "model-filter") == {"b": 2}
        assert read_unguarded(tmp_path / "none.jsonl", "model-filter") == {}


class TestOutsideFilter:
    def test_each_model_left_unguarded_is_said_in_a_column_and_a_line(self) -> None:
        """Calls --model left unguarded: a row per model (even one with no guarded call), an UNGUARDED column,
        a line naming the model and the filter, and the headline says not everything went through the guard."""
        totals = RunTotals("r", {"deepseek-v4-flash-260425": ModelTotals(calls=2, settled_tokens=90)})
        settings = Settings(model=("deepseek",))
        report = run_report(totals, settings=settings, exit_code=0, outside_filter={"doubao-seed-1-6-250615": 4})
        assert report["models"]["doubao-seed-1-6-250615"]["outside_filter_calls"] == 4
        assert report["models"]["deepseek-v4-flash-260425"]["outside_filter_calls"] == 0
        assert report["totals"]["outside_filter_calls"] == 4 and report["model_filter"] == ["deepseek"]
        text = format_summary(report)
        assert "NOT everything went through the guard" in text
        assert "4 call(s) to doubao-seed-1-6-250615 went out UNGUARDED: --model deepseek does not name" in text
        header, *rows = [line for line in text.splitlines() if line.startswith("  ") and "call(s)" not in line]
        assert header.split()[-1] == "UNGUARDED"
        assert [row.split()[-1] for row in rows] == ["0", "4"]

    def test_a_run_that_left_nothing_out_has_no_such_column(self) -> None:
        """No call went around the guard: the table is as it was."""
        report = run_report(RunTotals("r", {"m": ModelTotals(calls=1)}), settings=Settings(), exit_code=0)
        assert "UNGUARDED" not in format_summary(report) and report["totals"]["outside_filter_calls"] == 0

    def test_the_unmapped_row_shows_only_what_stayed_unmapped(self) -> None:
        """Unmapped calls all moved to their models leave an empty row, which is not shown; refused ones stay."""
        empty = RunTotals("r", {"m": ModelTotals(calls=1), UNMAPPED: ModelTotals()})
        assert UNMAPPED not in run_report(empty, settings=Settings(), exit_code=0)["models"]
        refused = RunTotals("r", {"m": ModelTotals(calls=1), UNMAPPED: ModelTotals(blocked_calls=1)})
        assert UNMAPPED in run_report(refused, settings=Settings(), exit_code=0)["models"]
