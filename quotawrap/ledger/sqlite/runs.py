"""The runs table on the SQLite store: its statements (the one copy: :class:`SQLiteLedger` writes
with them too), and a run's own record written with plain ``sqlite3``.

Every guarded command records its run before its child starts. The full ledger (its records,
the limit math, the interface: dataclasses, typing, json) would cost that start its imports,
and a run needs none of it to write one row, so the wrapper opens the ledger's file here and
loads the full ledger only when a process of the run makes a guarded call, or when anything is
unusual: no file yet (a new ledger is made complete by the full path), an older schema (it
migrates), a file that is not a current quotawrap ledger, or any database error (the full path
then says what is wrong, with its exit code).
"""

from __future__ import annotations

# The C module itself: the sqlite3 package adds only its datetime adapters (and datetime, a cost on a
# guarded command's start path); its classes and functions are these very objects.
import _sqlite3 as sqlite3
import os

from ..advance_endpoints import ADVANCE, ADVANCE_CLOSED
from .file import EVERY_CALL, OPEN_BUSY_MS, SCHEMA_VERSION, check, retry_locked

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from typing import Any

__all__ = [
    "AUTO_PRUNE_LEASE",
    "END_RUN",
    "INSERT_RUN",
    "KNOWN_MODELS",
    "LEASE_HOLDER",
    "RUNS_BETWEEN",
    "RUN_TOTALS",
    "RunBooks",
    "RunsFile",
    "open_runs",
    "tags_json",
]

INSERT_RUN = "INSERT OR REPLACE INTO runs VALUES (?, ?, ?, ?, ?, ?)"
END_RUN = "UPDATE runs SET exit_code = ?, ended_at = ? WHERE run_id = ?"
RUNS_BETWEEN = (
    "SELECT run_id, started_at, ended_at, command, tags, exit_code FROM runs"
    " WHERE started_at >= ? AND started_at < ? ORDER BY started_at"
)
# A run's totals per model, from its calls (the summary and `status` read them).
# An open advance (quotawrap.admission.advances) is room held, not a call: its calls are counted as they settle.
RUN_TOTALS = f"""SELECT model,
    COUNT(*) FILTER (WHERE state != 'blocked' AND handed_to IS NULL
      AND NOT (state = 'held' AND endpoint IN ('{ADVANCE}', '{ADVANCE_CLOSED}'))),
    COUNT(*) FILTER (WHERE state = 'blocked'),
    SUM(would_block),
    SUM(charged),
    SUM(CASE WHEN state = 'held' THEN reserved ELSE 0 END),
    SUM(overshoot),
    COUNT(*) FILTER (WHERE state = 'unresolved'),
    COUNT(*) FILTER (WHERE state = 'released' AND handed_to IS NULL),
    SUM(COALESCE(prompt_tokens, 0)), SUM(COALESCE(completion_tokens, 0)),
    SUM(COALESCE(reasoning_tokens, 0)), SUM(COALESCE(cached_tokens, 0)),
    SUM(charged_cost),
    COUNT(*) FILTER (WHERE usage_anomaly IS NOT NULL)
    FROM {EVERY_CALL} WHERE run_id = ? GROUP BY model ORDER BY model"""
AUTO_PRUNE_LEASE = "prune:auto"  # taken for a day and never released: the automatic prune runs at most daily
LEASE_HOLDER = "SELECT holder, until FROM leases WHERE name = ?"
# every model the ledger has seen a call or a balance for (a run's start asks: can a package expire?)
KNOWN_MODELS = "SELECT model FROM snapshots UNION SELECT model FROM holds UNION SELECT model FROM calls ORDER BY 1"
_HEADER = b"SQLite format 3\0"


def tags_json(tags: Mapping[str, str]) -> str:
    """``json.dumps(dict(tags))`` for string keys and values, without importing json (and re)."""
    try:
        from _json import encode_basestring_ascii as quote
    except ImportError:  # pragma: no cover - an interpreter without the C accelerator
        import json

        return json.dumps(dict(tags))
    return "{" + ", ".join(f"{quote(str(key))}: {quote(str(value))}" for key, value in tags.items()) + "}"


class RunsFile:
    """An open current-schema ledger file, for the run's own row only (start and end)."""

    def __init__(self, path: str, conn: sqlite3.Connection, opened: tuple[int, int]) -> None:
        self.path = path
        self._conn = conn
        self._opened = opened

    def start_run(
        self, run_id: str, started_at: float, command: str, tags: Mapping[str, str]
    ) -> None:  # raises sqlite3.Error
        self._conn.execute(INSERT_RUN, (run_id, started_at, None, command, tags_json(tags), None))

    def end_run(self, run_id: str, exit_code: int, ended_at: float) -> None:
        """Raises StoreError/StoreCorrupt (the file gone or replaced) or sqlite3.Error."""
        check(self.path, self._opened, f"sqlite:///{self.path}")
        self._conn.execute(END_RUN, (exit_code, ended_at, run_id))

    def lease_held(self, name: str, now: float) -> bool:
        """Whether some holder has the lease ``name`` until after ``now``. Raises sqlite3.Error."""
        row = self._conn.execute(LEASE_HOLDER, (name,)).fetchone()
        return row is not None and row[1] > now

    def known_models(self) -> list[str]:
        """Raises sqlite3.Error."""
        return [model for (model,) in self._conn.execute(KNOWN_MODELS).fetchall()]

    def close(self) -> None:
        self._conn.close()


def open_runs(path: str) -> RunsFile | None:
    """The ledger file at ``path`` opened as the full ledger opens it, or None: take the full path.

    None when the file is missing, a symlink, empty, not a database, not at the current schema,
    or on any database error; never raises for those.
    """
    try:
        st = os.lstat(path)
        if not (st.st_mode & 0o170000 == 0o100000 and st.st_size > 0):  # a regular file with content
            return None
        with open(path, "rb") as file:
            if file.read(16) != _HEADER:
                return None
        os.chmod(path, 0o600)  # as the full ledger does on every open
    except OSError:
        return None
    conn: sqlite3.Connection | None = None
    try:
        conn = sqlite3.connect(path, timeout=60.0, isolation_level=None, check_same_thread=False)
        conn.execute(f"PRAGMA busy_timeout={OPEN_BUSY_MS}")
        retry_locked(lambda: conn.execute("PRAGMA journal_mode=WAL") if conn is not None else None)
        conn.execute("PRAGMA busy_timeout=60000")
        conn.execute("PRAGMA synchronous=NORMAL")
        row = conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
        if row is None or row[0] != SCHEMA_VERSION:
            conn.close()
            return None
        return RunsFile(path, conn, (st.st_dev, st.st_ino))
    except sqlite3.Error:
        if conn is not None:
            conn.close()
        return None


class RunBooks:
    """A run's ledger on the usual SQLite store: its own row written lean (a :class:`RunsFile`), the
    full ledger opened on first use (a settle relayed, the reclaimer, the live view, the run's end);
    every other attribute is the full ledger's.

    The lean connection is closed before the full ledger opens, and from then on the full ledger
    does everything: its opening checks read the file through a plain descriptor, and closing that
    drops every POSIX lock this process holds on the file, the lean connection's too (SQLite's
    locks are per process), which would let another process checkpoint under our WAL readers.
    What the full ledger raises on opening (a store gone meanwhile) is raised to that use.
    """

    lean = True  # the launcher's sign: no process of the run may have opened the ledger yet

    def __init__(self, url: str, runs: RunsFile, open_full: Callable[[str], Any]) -> None:
        """``open_full``: :func:`quotawrap.ledger.open_ledger` (passed in: that package imports this module)."""
        import _thread  # threading's lock, without threading's imports on the start path

        self._open_full = open_full
        self.url = url
        self._runs: RunsFile | None = runs
        self._full: Any = None
        self._lock = _thread.allocate_lock()

    def full(self) -> Any:
        with self._lock:
            if self._full is None:
                if self._runs is not None:
                    self._runs.close()
                    self._runs = None
                self._full = self._open_full(self.url)
            return self._full

    def __getattr__(self, name: str) -> Any:
        return getattr(self.full(), name)

    def _lean_call(self, action: str, call: Any) -> Any:
        """``call(runs)`` on the lean connection (database errors as the full ledger's StoreError),
        or ``call`` is not made and this returns ``self`` (the full ledger is open: ask it)."""
        from ...core.errors import StoreError

        with self._lock:
            if self._runs is None:
                return self
            try:
                return call(self._runs)
            except sqlite3.Error as exc:
                raise StoreError(f"ledger {action} failed: {exc}", store=self.url) from exc

    def start_run(self, run_id: str, started_at: float, command: str, tags: Mapping[str, str]) -> None:
        """The run's row (before anything else: the full ledger is not open yet)."""
        self._lean_call("run", lambda runs: runs.start_run(run_id, started_at, command, tags))

    def end_run(self, run_id: str, exit_code: int, ended_at: float) -> None:
        if self._lean_call("run", lambda runs: runs.end_run(run_id, exit_code, ended_at)) is self:
            self.full().end_run(run_id, exit_code, ended_at)

    def known_models(self) -> list[str]:
        found = self._lean_call("read", lambda runs: runs.known_models())
        return self.full().known_models() if found is self else list(found)

    def pruned_today(self, now: float) -> bool:
        """Whether the daily automatic prune's lease is held (the usual run's end); False when unsure
        or once the full ledger is open (the full prune check then asks it)."""
        try:
            return self._lean_call("read", lambda runs: runs.lease_held(AUTO_PRUNE_LEASE, now)) is True
        except Exception:  # the full path then asks, and says what is wrong
            return False

    def close(self) -> None:
        with self._lock:
            if self._runs is not None:
                self._runs.close()
                self._runs = None
        if self._full is not None:
            self._full.close()
