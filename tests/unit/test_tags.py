"""Tests for quotawrap.core.tags: --tag parsing, merging, and found values made one-line tags."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quotawrap.core.errors import ConfigError
from quotawrap.core.tags import MAX_TAG_VALUE_LENGTH, clean_tag_value, merge_tags, parse_tags


class TestParseTags:
    """--tag KEY=VALUE, repeatable."""

    def test_pairs(self) -> None:
        """Each KEY=VALUE becomes one entry."""
        assert parse_tags(["team=infra", "ticket=QW-5"]) == {"team": "infra", "ticket": "QW-5"}

    def test_value_may_contain_equals_and_spaces(self) -> None:
        """Only the first '=' separates; the rest belongs to the value."""
        assert parse_tags(["query=a=b c"]) == {"query": "a=b c"}

    def test_last_repeat_wins(self) -> None:
        """A key given twice keeps its last value."""
        assert parse_tags(["env=dev", "env=prod"]) == {"env": "prod"}

    def test_key_characters(self) -> None:
        """Letters, digits, '_', '.' and '-' are allowed in keys."""
        assert parse_tags(["a.b-c_D9=x"]) == {"a.b-c_D9": "x"}

    def test_bare_string(self) -> None:
        """A single string is one tag, not a sequence of characters."""
        assert parse_tags("team=infra") == {"team": "infra"}

    def test_empty(self) -> None:
        """No tags, no entries."""
        assert parse_tags([]) == {}

    @pytest.mark.parametrize(
        ("raw", "message"),
        [
            ("team", "no '='"),
            ("=infra", "the key"),
            ("te am=infra", "the key"),
            ("tëam=infra", "the key"),
            ("team/x=infra", "the key"),
            ("team=", "empty"),
            ("team=   ", "empty"),
            ("team=a\nb", "single line"),
            ("team=a\x1b[31m", "single line"),
            (f"team={'x' * (MAX_TAG_VALUE_LENGTH + 1)}", "longer than"),
        ],
    )
    def test_junk_is_a_config_error(self, raw: str, message: str) -> None:
        """Malformed tags raise ConfigError explaining the problem."""
        with pytest.raises(ConfigError, match=message):
            parse_tags([raw])

    def test_non_string_is_a_config_error(self) -> None:
        """A non-string item is refused, not crashed on."""
        with pytest.raises(ConfigError):
            parse_tags([42])  # type: ignore[list-item]

    @given(
        key=st.from_regex(r"[A-Za-z0-9_.-]{1,20}", fullmatch=True),
        value=st.text(
            alphabet=st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=MAX_TAG_VALUE_LENGTH
        ).filter(str.strip),
    )
    def test_round_trip(self, key: str, value: str) -> None:
        """Any valid key and single-line value comes back unchanged."""
        assert parse_tags([f"{key}={value}"]) == {key: value}


class TestMergeTags:
    """Explicit tags override automatic ones."""

    def test_explicit_wins(self) -> None:
        """An explicit key replaces the automatic value; other keys from both survive."""
        merged = merge_tags({"user": "ci-bot", "host": "h"}, {"user": "alice", "team": "infra"})
        assert merged == {"user": "alice", "host": "h", "team": "infra"}

    def test_inputs_untouched(self) -> None:
        """Merging returns a new dict and leaves both inputs as they were."""
        automatic, explicit = {"a": "1"}, {"a": "2"}
        merge_tags(automatic, explicit)
        assert automatic == {"a": "1"} and explicit == {"a": "2"}


@pytest.mark.parametrize(
    ("found", "tag"),
    [
        ("main", "main"),
        ("evil\nline", "evilline"),
        ("b\x1bob\x7f", "bob"),
        ("  padded\t", "padded"),
        ("\r\n", ""),
        ("x" * (MAX_TAG_VALUE_LENGTH + 9), "x" * MAX_TAG_VALUE_LENGTH),
    ],
)
def test_a_found_value_becomes_one_line_of_at_most_the_longest_tag(found: str, tag: str) -> None:
    """Control characters go, the ends are stripped and the rest is cut to the longest value --tag takes."""
    assert clean_tag_value(found) == tag
