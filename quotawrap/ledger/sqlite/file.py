"""The SQLite ledger's file: its schema, its migrations, and the checks before anything writes to it."""

from __future__ import annotations

# The C module itself: the sqlite3 package adds only its datetime adapters (and datetime, a cost on a
# guarded command's start path); its classes and functions are these very objects.
import _sqlite3 as sqlite3
import contextlib
import os
import stat
import time

from ...core.errors import StoreCorrupt, StoreError

# Imported by the wrapper's start path (ledger/runs.py): pathlib and threading load when needed.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import threading
    from collections.abc import Callable
    from pathlib import Path

__all__ = [
    "CALL_COLUMNS",
    "EVERY_CALL",
    "LOCK_WAIT_S",
    "MIGRATIONS",
    "OPEN_BUSY_MS",
    "PAGE_SIZE",
    "SCHEMA_VERSION",
    "apply_migration",
    "check",
    "create",
    "create_schema",
    "identity",
    "refuse_foreign",
    "refuse_symlink",
    "retry_locked",
    "write_lock",
]

SCHEMA_VERSION = "7"

# The page size of a new ledger. A commit dirties one page of each b-tree it writes (a settle: the calls
# table and its indexes, the holds, the counters) and copies and checksums each whole page into the WAL:
# 2 KiB pages copy half the bytes per commit of SQLite's 4 KiB, with no slower report (1 KiB gained
# little more and deepens every tree). A ledger created with
# another size keeps it (WAL mode cannot change it).
PAGE_SIZE = 2048

_AGGREGATES_TABLE = """CREATE TABLE IF NOT EXISTS call_aggregates (
    day TEXT NOT NULL, model TEXT NOT NULL, tags TEXT NOT NULL,
    calls INTEGER NOT NULL DEFAULT 0, blocked_calls INTEGER NOT NULL DEFAULT 0,
    settled_tokens INTEGER NOT NULL DEFAULT 0, cost_micro_cny INTEGER NOT NULL DEFAULT 0,
    unresolved_calls INTEGER NOT NULL DEFAULT 0, overshoot_calls INTEGER NOT NULL DEFAULT 0,
    released_calls INTEGER NOT NULL DEFAULT 0, prompt_tokens INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0, reasoning_tokens INTEGER NOT NULL DEFAULT 0,
    cached_tokens INTEGER NOT NULL DEFAULT 0,{}
    PRIMARY KEY (day, model, tags)
)"""  # what `prune` keeps of the calls of a day it deletes (ledger/retention.py)
_AGGREGATES_V3 = _AGGREGATES_TABLE.format("")  # as schema 3 created it (migration "2")
_AGGREGATES = _AGGREGATES_TABLE.format("\n    anomalous_calls INTEGER NOT NULL DEFAULT 0,")

# The waiting lines (ledger/lines.py): one row per waiter per line ("run:<run>" or "md:<day>:<model>",
# the counter key), ordered by ticket; "until" is the waiter's lease. The ticket sequence is meta's "ticket".
_WAITERS = """CREATE TABLE IF NOT EXISTS waiters (
    line TEXT NOT NULL, waiter TEXT NOT NULL, ticket INTEGER NOT NULL, until REAL NOT NULL, model TEXT NOT NULL,
    PRIMARY KEY (line, waiter)
)"""

# A call's row: one definition for both tables that keep calls. A call in flight (state 'held') is a row of
# ``holds``, a small table without indexes: a reserve on the caller's path writes that one b-tree and the
# counters' page, where a row of ``calls`` (its table and its indexes) made its COMMIT copy six pages into
# the WAL. The wrapper moves the row to ``calls`` when its settle lands, so the work moves off the caller's
# path rather than away; a hold never returns to 'held', so every row of ``calls`` is final.
_CALL_ROW = """(
    id TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    model TEXT NOT NULL,
    day TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    state TEXT NOT NULL,
    reserved INTEGER NOT NULL,
    charged INTEGER NOT NULL DEFAULT 0,
    reserved_cost INTEGER NOT NULL DEFAULT 0,
    charged_cost INTEGER NOT NULL DEFAULT 0,
    prompt_tokens INTEGER, completion_tokens INTEGER, reasoning_tokens INTEGER, cached_tokens INTEGER,
    overshoot INTEGER NOT NULL DEFAULT 0,
    would_block INTEGER NOT NULL DEFAULT 0,
    blocked_by TEXT,
    pid INTEGER NOT NULL,
    host TEXT NOT NULL,
    key_fingerprint TEXT,
    tags TEXT,
    started_at REAL NOT NULL,
    ended_at REAL,
    latency_s REAL,
    expires_at REAL NOT NULL,
    usage_anomaly TEXT,
    handed_to TEXT
)"""
CALL_COLUMNS = (
    *("id", "run_id", "model", "day", "endpoint", "state", "reserved", "charged", "reserved_cost", "charged_cost"),
    *("prompt_tokens", "completion_tokens", "reasoning_tokens", "cached_tokens", "overshoot", "would_block"),
    *("blocked_by", "pid", "host", "key_fingerprint", "tags", "started_at", "ended_at", "latency_s", "expires_at"),
    *("usage_anomaly", "handed_to"),
)  # _CALL_ROW's, in order
_ALL = ", ".join(CALL_COLUMNS)
# Every call, in flight or not, for the reads that want both (a run's totals, the records, the models seen).
EVERY_CALL = f"(SELECT {_ALL} FROM holds UNION ALL SELECT {_ALL} FROM calls)"
_HOLDS = f"CREATE TABLE IF NOT EXISTS holds {_CALL_ROW} WITHOUT ROWID"
# The gateway's member keys (member_keys.py), by the key's hash; made on open, so an older ledger gets it then.
_MEMBER_KEYS = """CREATE TABLE IF NOT EXISTS member_keys (
    key_hash TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE, tags TEXT NOT NULL, created_at REAL NOT NULL, revoked_at REAL
) WITHOUT ROWID"""

# Budgets (ledger/budgets.py) and the budget scopes each hold counts against (ledger/sqlite/budgets.py).
BUDGET_TABLES = """
CREATE TABLE IF NOT EXISTS budgets (id TEXT PRIMARY KEY, budget TEXT NOT NULL, run_id TEXT NOT NULL, set_at REAL);
CREATE TABLE IF NOT EXISTS hold_budgets (hold_id TEXT NOT NULL, scope TEXT NOT NULL, PRIMARY KEY (hold_id, scope))
    WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS hold_budgets_scope ON hold_budgets (scope);
"""

_SCHEMA = (
    """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS counters (key TEXT PRIMARY KEY, settled INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS calls """
    + _CALL_ROW
    + """;
CREATE INDEX IF NOT EXISTS calls_run ON calls (run_id);
CREATE INDEX IF NOT EXISTS calls_started ON calls (started_at);
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, started_at REAL NOT NULL, ended_at REAL, command TEXT, tags TEXT, exit_code INTEGER
);
CREATE TABLE IF NOT EXISTS snapshots (
    model TEXT PRIMARY KEY, day TEXT NOT NULL, balance INTEGER NOT NULL, usage_at_sync INTEGER NOT NULL,
    lagged_usage INTEGER NOT NULL, synced_at REAL NOT NULL, source TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS sync_history (
    model TEXT NOT NULL, day TEXT NOT NULL, synced_at REAL NOT NULL, balance INTEGER NOT NULL,
    usage_at_sync INTEGER NOT NULL, source TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS packages (
    model TEXT PRIMARY KEY, synced_at REAL NOT NULL, packages TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS leases (name TEXT PRIMARY KEY, holder TEXT NOT NULL, until REAL NOT NULL);
CREATE TABLE IF NOT EXISTS endpoints (endpoint TEXT PRIMARY KEY, model TEXT NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS usage_series (
    model TEXT NOT NULL, day TEXT NOT NULL, minute INTEGER NOT NULL, cumulative INTEGER NOT NULL,
    PRIMARY KEY (model, day, minute)
);
"""
    + _AGGREGATES
    + ";\n"
    + _WAITERS
    + ";\n"
    + _HOLDS
    + ";\n"
    + _MEMBER_KEYS
    + ";\n"
    + BUDGET_TABLES
)


# schema version -> the statements that bring it to the next one
MIGRATIONS: dict[str, tuple[str, ...]] = {
    "1": (
        "ALTER TABLE calls ADD COLUMN reserved_cost INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE calls ADD COLUMN charged_cost INTEGER NOT NULL DEFAULT 0",
        "UPDATE meta SET value = '2' WHERE key = 'schema'",
    ),
    "2": (_AGGREGATES_V3, "UPDATE meta SET value = '3' WHERE key = 'schema'"),
    # a call whose usage was not believed, and a video task's create handed over to the task's row
    "3": (
        "ALTER TABLE calls ADD COLUMN usage_anomaly TEXT",
        "ALTER TABLE calls ADD COLUMN handed_to TEXT",
        "ALTER TABLE call_aggregates ADD COLUMN anomalous_calls INTEGER NOT NULL DEFAULT 0",
        "UPDATE meta SET value = '4' WHERE key = 'schema'",
    ),
    "4": (_WAITERS, "UPDATE meta SET value = '5' WHERE key = 'schema'"),
    # the calls in flight move to their own table (_CALL_ROW)
    "5": (
        _HOLDS,
        f"INSERT INTO holds ({_ALL}) SELECT {_ALL} FROM calls WHERE state = 'held'",
        "DELETE FROM calls WHERE state = 'held'",
        "DROP INDEX IF EXISTS calls_open",
        "UPDATE meta SET value = '6' WHERE key = 'schema'",
    ),
    # what is in flight is summed from holds (sqlite/reserve.py IN_FLIGHT), no longer counted beside the settled
    "6": (
        "CREATE TABLE counters_7 (key TEXT PRIMARY KEY, settled INTEGER NOT NULL DEFAULT 0)",
        "INSERT INTO counters_7 SELECT key, settled FROM counters",
        "DROP TABLE counters",
        "ALTER TABLE counters_7 RENAME TO counters",
        "UPDATE meta SET value = '7' WHERE key = 'schema'",
    ),
}


def apply_migration(conn: sqlite3.Connection, statement: str) -> None:
    """One statement of ``MIGRATIONS``. Opening creates the missing tables in their newest form
    before migrating (``create_schema``), so a column a migration adds may be there already."""
    try:
        conn.execute(statement)
    except sqlite3.OperationalError as exc:
        if not (statement.startswith("ALTER TABLE") and "duplicate column name" in str(exc)):
            raise


LOCKED_RETRY_S = 30.0  # how long opening keeps retrying "database is locked" in all
OPEN_BUSY_MS = 2000  # the busy wait of one try while opening (a guarded call's own waits are longer)


def retry_locked(action: Callable[[], object], deadline_s: float = LOCKED_RETRY_S) -> None:
    """Switching to WAL and creating the schema can report "locked" at once, without waiting on the
    busy handler, while another process opens the same file: try again briefly, never for ever."""
    give_up = time.monotonic() + deadline_s
    while True:
        try:
            action()
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= give_up:
                raise
            time.sleep(0.05)


def refuse_symlink(path: Path, url: str) -> None:
    if path.is_symlink():
        raise StoreError(
            "the ledger path is a symlink, and a ledger is never opened through one: give the real path",
            store=url,
        )


def refuse_foreign(path: Path, url: str) -> None:
    """Raise StoreCorrupt unless ``path`` is missing or a quotawrap ledger; reads only.

    An empty file is refused too: a new ledger is created complete (``create``), so an empty one
    is a ledger that was truncated, and adopting it as new would forget the day's usage.
    """
    try:
        if not path.is_file():
            return
        if path.stat().st_size == 0:
            raise StoreCorrupt(
                "ledger file is empty (truncated?); it was left untouched: restore it, or move it away to start anew",
                store=url,
            )
        with path.open("rb") as file:
            header = file.read(16)
    except OSError:
        return  # create() says what is wrong with the path
    if header != b"SQLite format 3\0":  # SQLite itself takes a short file of garbage for an empty database
        raise StoreCorrupt("ledger is damaged (file is not a database); it was left untouched", store=url)
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=60.0)
    try:
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            return
        try:
            row = conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
        except sqlite3.OperationalError:  # no meta table, or not ours
            row = None
    finally:
        conn.close()
    if row is None:
        raise StoreCorrupt("this SQLite file is not a quotawrap ledger; it was left untouched", store=url)
    if row[0] != SCHEMA_VERSION and row[0] not in MIGRATIONS:
        raise StoreCorrupt(f"ledger schema {row[0]!r} is not {SCHEMA_VERSION!r}", store=url)


def create_schema(conn: sqlite3.Connection) -> None:
    """Tables and the schema mark in one transaction: no opener ever sees tables without the mark."""
    mark = f"INSERT OR IGNORE INTO meta VALUES ('schema', '{int(SCHEMA_VERSION)}');"
    try:
        conn.executescript(f"BEGIN IMMEDIATE;\n{_SCHEMA}\n{mark}\nCOMMIT;")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _new_private_file(directory: Path, prefix: str, suffix: str) -> str:
    """``tempfile.mkstemp``'s promise (a new file, mode 0600, never an existing one), closed: importing
    tempfile (random, hashlib, shutil) would slow every guarded command's start."""
    while True:
        name = str(directory / f"{prefix}{os.urandom(6).hex()}{suffix}")
        try:
            os.close(os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600))
        except FileExistsError:
            continue  # another's name: draw again
        return name


def create(path: Path) -> None:
    """Create a new ledger (and its directory) readable by the owner only, if there is none.

    The database is built beside the path and hard-linked into place, which never replaces a
    file: the path holds a complete ledger or nothing, never an empty file another process
    could take for new. Whoever links first wins; the others open theirs.
    """
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.exists():
        return
    name = _new_private_file(path.parent, f".{path.name}.", ".new")
    try:
        conn = sqlite3.connect(name, isolation_level=None)
        try:
            conn.execute(f"PRAGMA page_size={PAGE_SIZE}")  # before anything is written: fixed from then on
            conn.execute("PRAGMA journal_mode=WAL")
            create_schema(conn)
        finally:
            conn.close()
        with contextlib.suppress(FileExistsError):
            os.link(name, path)
    finally:
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{name}{suffix}")


def identity(path: Path) -> tuple[int, int]:
    """(device, inode) of the ledger file: what ``check`` compares against."""
    st = os.lstat(path)
    return st.st_dev, st.st_ino


def check(path: str | os.PathLike[str], opened: tuple[int, int], url: str) -> None:
    """Raise StoreCorrupt when the ledger file is no longer the one opened: gone, replaced, a
    symlink now, or truncated to nothing. SQLite would go on writing to its open file (or its WAL)
    as if nothing happened, and every other process would see a different ledger."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise StoreCorrupt("the ledger file is gone (deleted or moved while in use)", store=url) from None
    if stat.S_ISLNK(st.st_mode) or (st.st_dev, st.st_ino) != opened:
        raise StoreCorrupt("the ledger file was replaced while in use; the new one was left untouched", store=url)
    if st.st_size == 0:
        raise StoreCorrupt("the ledger file was truncated to nothing while in use; it was left untouched", store=url)


# Threads of one process writing one file queue on this lock, woken the moment the writer commits,
# rather than on SQLite's busy handler, which sleeps in steps far longer than a write once it finds the
# file locked: a guarded call's reserve meeting its own settler's batch would sleep out a whole step.
_WRITE_LOCKS: dict[str, threading.RLock] = {}
LOCK_WAIT_S = 60.0  # as long as the connections' busy_timeout: past it, SQLite's handler decides


def write_lock(path: str) -> threading.RLock:
    """The lock this process's writers of the ledger at ``path`` take around each write transaction."""
    lock = _WRITE_LOCKS.get(path)
    if lock is None:
        import threading

        lock = _WRITE_LOCKS.setdefault(path, threading.RLock())
    return lock


if hasattr(os, "register_at_fork"):  # a lock another thread held at fork() would never be released
    os.register_at_fork(after_in_child=_WRITE_LOCKS.clear)
