"""Durations as every flag writes them: a whole number and a unit, ``90d``, ``12h``, ``30m``.

One parser for ``--retention``, ``prune --older-than`` and the relative ``--since/--until -7d`` of
``report`` and ``sessions``, so a form one flag takes the others take too. Pure, and free of ``re``:
``--retention`` is checked on a guarded command's start path.
"""

from __future__ import annotations

__all__ = ["FORMS", "UNITS", "parse_duration", "parse_retention"]

UNITS = {"d": 86_400, "h": 3_600, "m": 60}
FORMS = "a whole number and a unit, d, h or m: 90d, 12h, 30m"
_OFF = ("off", "never", "0")


def parse_duration(text: str) -> int:
    """Seconds of a positive duration (``90d``, ``12 h``, ``30M``); a ValueError naming the forms otherwise."""
    value = text.strip().lower()
    number, unit = value[:-1].strip(), value[-1:]
    if unit not in UNITS or not (number.isascii() and number.isdigit()) or int(number) == 0:
        raise ValueError(f"duration {text!r}: use {FORMS}")
    return int(number) * UNITS[unit]


def parse_retention(text: str) -> int | None:
    """``--retention``: seconds as :func:`parse_duration`, or None for ``off`` (never prune)."""
    if text.strip().lower() in _OFF:
        return None
    try:
        return parse_duration(text)
    except ValueError:
        raise ValueError(f"duration {text!r}: use {FORMS}, or 'off'") from None
