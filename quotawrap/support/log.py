"""quotawrap's one voice on stderr, importable without pulling in anything else."""

from __future__ import annotations

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing loads re and enum: not on a guarded command's start path
    from typing import NoReturn

__all__ = ["NO_COST", "fail", "printable", "summary_head", "warn"]

NO_COST = "¥0.000000"  # money.format_cny(0), without decimal: a run that made no guarded call says it


def printable(text: object, *, lines: bool = False) -> str:
    """``text`` with every character a terminal would act on written as its escape (``\\n``, ``\\x1b``,
    ``\\u202e``), so a model name, path, tag or provider message cannot add lines to what quotawrap
    prints, recolour it or reorder it. ``lines``: the text's own line breaks stay (a table of lines).

    Applied where quotawrap writes to a terminal; a table escapes its cells first, so its widths hold.
    """
    text = str(text)
    if lines:
        return "\n".join(printable(line) for line in text.split("\n"))
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else char.encode("unicode_escape").decode("ascii") for char in text)


def warn(message: str) -> None:
    """One line on stderr; never raises (stderr may be closed in a daemonised child)."""
    try:
        sys.stderr.write(f"quotawrap: {printable(message)}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def summary_head(
    session: str,
    calls: int,
    settled_tokens: int,
    cost: str,
    blocked: int,
    *,
    would_block: int | None,
    went_around: bool,
) -> str:
    """The first line of a run's summary (``report.format_summary``'s); ``would_block`` in watch mode only.

    Here, not in :mod:`quotawrap.wrapper.summary`: a run whose processes never opened the ledger prints it alone,
    without loading the report's modules and the full ledger."""
    return (
        f"quotawrap: session {session}: {calls} guarded call(s),"
        f" {settled_tokens:,} tokens settled ({cost}),"
        f" {blocked} blocked"
        + (f", {would_block} WOULD have been blocked (watch mode)" if would_block is not None else "")
        + (" — and NOT everything went through the guard (below)" if went_around else "")
    )


def fail(message: str, code: int) -> NoReturn:
    """One line on stderr naming the problem (store passwords redacted), then exit with ``code``."""
    from ..core.redact import redact_text  # store errors quote their URL; its password stays out of the terminal

    try:
        sys.stderr.write(f"quotawrap: {printable(redact_text(message))}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass  # no terminal to tell: the exit code still says it
    sys.exit(code)
