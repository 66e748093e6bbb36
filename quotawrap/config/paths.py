"""Where quotawrap keeps its state by default, and how a run is named: one place for every process that needs it."""

from __future__ import annotations

import os
import sys
import time

__all__ = ["default_events_log", "default_store_url", "default_unguarded_log", "new_run_id", "user_state_dir"]


def user_state_dir() -> str:
    """quotawrap's state directory: ``platformdirs.user_state_dir("quotawrap")``.

    On Linux by the XDG rule platformdirs applies (``$XDG_STATE_HOME`` when absolute, else
    ``$HOME/.local/state``), since importing platformdirs delays every guarded command's child;
    anything unusual (another system, no absolute home) asks platformdirs.
    """
    if sys.platform.startswith("linux"):
        xdg = os.environ.get("XDG_STATE_HOME", "")
        if xdg.startswith("/"):
            return os.path.join(xdg, "quotawrap")
        home = os.environ.get("HOME", "")
        if home.startswith("/"):
            return home.rstrip("/") + "/.local/state/quotawrap"
    import platformdirs

    return platformdirs.user_state_dir("quotawrap")


def default_store_url() -> str:
    return f"sqlite:///{os.path.join(user_state_dir(), 'ledger.sqlite3')}"


def default_unguarded_log(run_id: str) -> str:
    """Where a --fail-open run's children record what they let through while the store was down."""
    return os.path.join(user_state_dir(), "unguarded", f"{run_id}.jsonl")


def default_events_log(run_id: str) -> str:
    """Where a run's children record their waits for room and the calls they bounded."""
    return os.path.join(user_state_dir(), "events", f"{run_id}.jsonl")


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + os.urandom(3).hex()  # secrets.token_hex(3), without its imports
