"""The output bound the guard set on a call, and the mark its hold id carries so the books can tell which answers
the bound cut short. Pure: every ledger keeps hold ids as given, so no store needs a column for it."""

from __future__ import annotations

__all__ = ["ADDED", "REPLACED", "bound_mark", "cut_short", "read_bound_mark", "without_bound_mark"]

ADDED, REPLACED = "added", "replaced"


def cut_short(output: int, bound: int) -> bool:
    """Whether a call whose whole output the guard bounded at ``bound`` was stopped there: the provider
    stops a generation at the bound (finish_reason ``length``), so its output reached it."""
    return output >= bound


# A call the guard bounded carries how and at what in its hold id ("<id>@a8192": a bound added, "<id>@r64": its
# max_tokens replaced), as a refitted attempt carries its "~" (core/retry_mark.py), so every ledger keeps it with no
# column of its own and ``report`` and ``status`` read back which calls the bound cut short.
_MARK = "@"
_HOW = {ADDED: "a", REPLACED: "r"}
_HOW_BY_LETTER = {letter: how for how, letter in _HOW.items()}


def bound_mark(how: str | None, bound: int) -> str:
    """The suffix of the hold id of a call the guard sent with ``bound``, set ``how``."""
    return f"{_MARK}{_HOW.get(how or ADDED, 'a')}{bound}"


def read_bound_mark(hold_id: str) -> tuple[str, int] | None:
    """(how, bound) from a hold id :func:`bound_mark` marked, None for any other id."""
    _, marked, mark = hold_id.rpartition(_MARK)
    how = _HOW_BY_LETTER.get(mark[:1])
    if not marked or how is None or not mark[1:].isdigit():
        return None
    return how, int(mark[1:])


def without_bound_mark(hold_id: str) -> str:
    """The hold id without its bound mark (as the call's first attempt was numbered)."""
    return hold_id.rpartition(_MARK)[0] if read_bound_mark(hold_id) is not None else hold_id
