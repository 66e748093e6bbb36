"""The threshold rules the live view and the webhook alerts share (quotawrap.core.thresholds)."""

from __future__ import annotations

import pytest

from quotawrap.core.thresholds import THRESHOLDS, crossed, format_thresholds, highest, parse_thresholds


class TestParseThresholds:
    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            ("50,80,100", (0.5, 0.8, 1.0)),
            ("100, 50 ,80", (0.5, 0.8, 1.0)),
            ("90%", (0.9,)),
            ("80,80", (0.8,)),
            ("12.5,150", (0.125, 1.5)),
        ],
    )
    def test_valid(self, text: str, expected: tuple[float, ...]) -> None:
        """Percents in any order, with or without %, each once, sorted."""
        assert parse_thresholds(text) == expected

    @pytest.mark.parametrize(
        ("text", "words"),
        [
            ("", "at least one percent"),
            ("50,,", "not a percent"),
            ("fifty", "not a percent"),
            ("0", "above 0"),
            ("-10", "above 0"),
            ("nan", "above 0"),
            ("inf", "above 0"),
            ("2000", "at most 1000"),
        ],
    )
    def test_invalid(self, text: str, words: str) -> None:
        """A bad list says what is wrong in a user's words."""
        with pytest.raises(ValueError, match=words):
            parse_thresholds(text)

    def test_round_trip(self) -> None:
        """The default written out reads back as itself."""
        assert format_thresholds(THRESHOLDS) == "50,80,100"
        assert parse_thresholds(format_thresholds(THRESHOLDS)) == THRESHOLDS


class TestCrossed:
    @pytest.mark.parametrize(
        ("previous", "now", "expected"),
        [
            (0.0, 0.3, []),
            (0.0, 0.5, [0.5]),
            (0.49, 0.62, [0.5]),
            (0.5, 0.79, []),
            (0.0, 0.9, [0.5, 0.8]),
            (0.9, 1.4, [1.0]),
            (0.9, 0.2, []),  # a drop (new day) crosses nothing
            (0.0, float("inf"), [0.5, 0.8, 1.0]),
        ],
    )
    def test_table(self, previous: float, now: float, expected: list[float]) -> None:
        """Each threshold in (previous, now], ascending."""
        assert crossed(previous, now) == expected


class TestHighest:
    def test_one_message_names_the_highest(self) -> None:
        """50% and 80% crossed in one reading are announced as 80%."""
        assert highest(crossed(0.0, 0.9)) == 0.8

    def test_none_crossed(self) -> None:
        """Nothing crossed: nothing to announce."""
        assert highest([]) is None
