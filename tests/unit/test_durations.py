"""One parser for every duration a flag takes: --retention, prune --older-than, --since/--until -N."""

from __future__ import annotations

import pytest

from quotawrap.core.durations import parse_duration, parse_retention

GOOD = [
    ("90d", 90 * 86_400),
    ("12h", 12 * 3_600),
    ("30m", 30 * 60),
    ("1m", 60),
    (" 7 D ", 7 * 86_400),
    ("12 h", 12 * 3_600),
    ("007h", 7 * 3_600),
]
BAD = ["", "d", "90", "0d", "00h", "-3d", "+3d", "1w", "1.5d", "3s", "3dd", "½d", "²h", "off", "1 d x", "d3"]


@pytest.mark.parametrize(("text", "seconds"), GOOD)
def test_a_whole_number_and_a_unit_is_seconds(text: str, seconds: int) -> None:
    assert parse_duration(text) == seconds
    assert parse_retention(text) == seconds


@pytest.mark.parametrize("text", BAD)
def test_anything_else_is_refused_naming_the_forms(text: str) -> None:
    with pytest.raises(ValueError, match="90d, 12h, 30m"):
        parse_duration(text)


@pytest.mark.parametrize("text", ["off", "OFF", " never ", "0"])
def test_retention_may_be_off(text: str) -> None:
    assert parse_retention(text) is None


@pytest.mark.parametrize("text", [t for t in BAD if t != "off"])
def test_retention_refuses_what_the_parser_refuses_and_names_off(text: str) -> None:
    with pytest.raises(ValueError, match="or 'off'"):
        parse_retention(text)
