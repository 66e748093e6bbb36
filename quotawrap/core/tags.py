"""What a tag is: ``KEY=VALUE`` from ``--tag`` or a request's header, checked and merged. Pure, no I/O."""

from __future__ import annotations

from .errors import ConfigError

# The wrapper parses its --tag options before its child starts: no typing here.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from typing import Final

__all__ = ["MAX_TAG_VALUE_LENGTH", "clean_tag_value", "merge_tags", "parse_tags"]

MAX_TAG_VALUE_LENGTH: Final = 256
_KEY_CHARS: Final = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")  # [A-Za-z0-9_.-]+
_CONTROL: Final = {code: None for code in (*range(0x20), 0x7F)}  # str.translate deletes [\x00-\x1f\x7f]


def parse_tags(values: Sequence[str]) -> dict[str, str]:
    """``["team=infra", "ticket=QW-5"]`` → ``{"team": "infra", "ticket": "QW-5"}``; a repeated key's last value wins.

    Keys are ``[A-Za-z0-9_.-]+``; values are non-empty, single-line and at most
    :data:`MAX_TAG_VALUE_LENGTH` characters. Anything else is a :class:`ConfigError` that
    quotes the offending argument.
    """
    if isinstance(values, str):  # one tag passed bare would otherwise be read character by character
        values = [values]
    tags: dict[str, str] = {}
    for raw in values:
        if not isinstance(raw, str):
            raise ConfigError(f"--tag expects KEY=VALUE, got {raw!r}")
        key, separator, value = raw.partition("=")
        key = key.strip()
        if not separator:
            raise ConfigError(f"--tag expects KEY=VALUE, got {raw!r} (no '=')")
        if not key or not all(char in _KEY_CHARS for char in key):
            raise ConfigError(f"--tag {raw!r}: the key must be letters, digits, '_', '.' or '-'")
        if not value.strip():
            raise ConfigError(f"--tag {raw!r}: the value is empty (an unset shell variable?)")
        if value.translate(_CONTROL) != value:
            raise ConfigError(f"--tag {raw!r}: the value must be a single line without control characters")
        if len(value) > MAX_TAG_VALUE_LENGTH:
            raise ConfigError(f"--tag {key}=...: the value is longer than {MAX_TAG_VALUE_LENGTH} characters")
        tags[key] = value
    return tags


def merge_tags(automatic: Mapping[str, str], explicit: Mapping[str, str]) -> dict[str, str]:
    """One set of tags; an explicit ``--tag`` overrides an automatic tag with the same key."""
    return {**automatic, **explicit}


def clean_tag_value(value: str) -> str:
    """A value found outside the command line, made a one-line tag: control characters dropped, cut to length."""
    return value.translate(_CONTROL).strip()[:MAX_TAG_VALUE_LENGTH]
