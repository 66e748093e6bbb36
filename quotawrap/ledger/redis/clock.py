"""The Redis server's clock as one process reads it: its own clock plus the offset it last measured.

Processes of many hosts share one Redis ledger, and a host's clock may be wrong: one 20 h ahead opened the next
Beijing day's counters and spent a second daily cap in the same real day. So every time the ledger keeps or
compares (the Beijing day of a call, when a hold expires, the usage series, the records) is on the server's clock:
its ``TIME``, read on connecting and with every reserve's answer, gives the offset; the reserve scripts check
that the day a call names is the server's day (lua/lib.lua ``day_refused``), so a process whose offset is stale
asks again with the server's day instead of opening another.

A process whose clock is more than ``SKEW_WARN_S`` off says so once (its children share its clock: a run's
wrapper tells them in ``QUOTAWRAP_CLOCK_SKEW`` that it said it).
"""

from __future__ import annotations

import os
import threading
import time

from ...support.log import warn

__all__ = ["SKEW_VARIABLE", "SKEW_WARN_S", "ServerClock", "consistent", "skew_text", "skew_warning"]

SKEW_WARN_S = 5.0  # NTP keeps hosts within milliseconds; seconds off is a clock nobody keeps
SKEW_VARIABLE = "QUOTAWRAP_CLOCK_SKEW"  # the offset a process of this tree warned of (its children share its clock)
_SLACK_S = 0.001  # TIME has microseconds; a millisecond keeps rounding from moving the offset on every reading


def consistent(offset: float, server: float, sent: float, received: float) -> bool:
    """Whether ``offset`` (server minus local) agrees with one reading: the server said ``server`` after this
    process sent at local ``sent`` and before it received at local ``received``."""
    return server - received - _SLACK_S <= offset <= server - sent + _SLACK_S


def skew_text(offset: float) -> str:
    """How far this host's clock is off, in words: '30.0 h ahead', '12 min behind', '7 s ahead'."""
    size = abs(offset)
    if size < 120:
        amount = f"{size:.0f} s"
    elif size < 2 * 3600:
        amount = f"{size / 60:.0f} min"
    else:
        amount = f"{size / 3600:.1f} h"
    return f"{amount} {'behind' if offset > 0 else 'ahead'}"


def skew_warning(offset: float, store: str) -> str:
    """The one line a process whose clock is off says (``offset``: the server's clock minus this host's)."""
    return (
        f"this host's clock is {skew_text(offset)} of the Redis ledger's ({store}); quotawrap counts the"
        " Beijing day and hold expiry on the ledger's clock, so the caps hold, but fix this host's clock"
        " (turn on NTP: timedatectl set-ntp true, or chrony)"
    )


def _warned_by_parent(offset: float) -> bool:
    told = os.environ.get(SKEW_VARIABLE)
    try:
        return told is not None and abs(float(told) - offset) < SKEW_WARN_S
    except ValueError:
        return False


_warned = False  # one warning a process, whatever number of ledgers and threads measure
_warning = threading.Lock()


class ServerClock:
    """The offset of one Redis server's clock from this host's; safe across threads (a float is set whole)."""

    def __init__(self, store: str) -> None:
        self.store = store  # as messages show it (no password)
        self.offset = 0.0  # the server's clock minus this host's, in seconds
        self.measured = False

    def now(self) -> float:
        return time.time() + self.offset

    def observe(self, server: float, sent: float, received: float) -> None:
        """One reading of the server's clock: kept as the offset unless the one held agrees with it (a
        reading bounds the offset by its round trip; a stepped host clock moves it out of those bounds)."""
        if self.measured and consistent(self.offset, server, sent, received):
            return
        self.offset = server - (sent + received) / 2
        self.measured = True
        self._maybe_warn()

    def _maybe_warn(self) -> None:
        global _warned
        offset = self.offset
        if _warned or abs(offset) <= SKEW_WARN_S:
            return
        with _warning:
            if _warned:
                return
            _warned = True
        if not _warned_by_parent(offset):
            warn(skew_warning(offset, self.store))
        os.environ[SKEW_VARIABLE] = repr(offset)  # inherited by the children this process starts from now on
