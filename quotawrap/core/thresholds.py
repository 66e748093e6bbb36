"""Which thresholds of a limit a reading crossed, and which one to announce.

The live view's stderr lines and the webhook alerts ask the same two questions of the same numbers: the
thresholds passed on the way up, and the one a single message names. A poll that finds a limit past 50%
and 80% at once says "at 80%" once: the lower threshold is implied by the higher, and two lines for one
reading read as two events.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["THRESHOLDS", "crossed", "format_thresholds", "highest", "parse_thresholds"]

THRESHOLDS: tuple[float, ...] = (0.5, 0.8, 1.0)


def parse_thresholds(text: str) -> tuple[float, ...]:
    """``"50,80,100"`` -> ``(0.5, 0.8, 1.0)``: whole or decimal percents above 0, sorted, each once.

    Raises ValueError with the words a user needs (the option's check adds the flag's name)."""
    parts = [part.strip().removesuffix("%") for part in text.split(",")]
    if not any(parts):
        raise ValueError("must list at least one percent, e.g. 50,80,100")
    values = set()
    for part in parts:
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"{part!r} is not a percent: use numbers like 50,80,100") from None
        if not 0 < value <= 1000:  # also rejects nan and inf
            raise ValueError(f"{part!r}: each percent must be above 0 and at most 1000")
        values.add(value / 100)
    return tuple(sorted(values))


def format_thresholds(thresholds: Sequence[float]) -> str:
    """``(0.5, 0.8, 1.0)`` -> ``"50,80,100"``, the form :func:`parse_thresholds` reads."""
    return ",".join(f"{threshold * 100:g}" for threshold in thresholds)


def crossed(previous_fraction: float, fraction: float, thresholds: Sequence[float] = THRESHOLDS) -> list[float]:
    """The thresholds in (``previous_fraction``, ``fraction``], ascending: those passed on the way up."""
    return [t for t in thresholds if previous_fraction < t <= fraction]


def highest(thresholds: Sequence[float]) -> float | None:
    """The one threshold a message about ``thresholds`` (crossed in one reading) names."""
    return max(thresholds, default=None)
