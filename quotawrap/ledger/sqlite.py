"""The embedded ledger: one SQLite file in WAL mode, one short ``BEGIN IMMEDIATE`` per change.

``BEGIN IMMEDIATE`` takes SQLite's single write lock before the counters are read, so the
read-check-write of a reservation cannot interleave with another thread or process: this is
the "no await between read and write" rule of the post-mortem, enforced by the database.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .._errors import StoreCorrupt, StoreError
from ..quota import Counters, Package, Snapshot, verdict
from ..usage import Usage
from .base import Decision, HoldRequest, LimitsFor, ModelTotals, RunTotals, model_day_key, run_key

__all__ = ["SQLiteLedger"]

SCHEMA_VERSION = "1"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS counters (
    key TEXT PRIMARY KEY, settled INTEGER NOT NULL DEFAULT 0, in_flight INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS calls (
    id TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    model TEXT NOT NULL,
    day TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    state TEXT NOT NULL,
    reserved INTEGER NOT NULL,
    charged INTEGER NOT NULL DEFAULT 0,
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
    expires_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS calls_run ON calls (run_id);
CREATE INDEX IF NOT EXISTS calls_open ON calls (state, expires_at) WHERE state = 'held';
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
CREATE TABLE IF NOT EXISTS usage_series (
    model TEXT NOT NULL, day TEXT NOT NULL, minute INTEGER NOT NULL, cumulative INTEGER NOT NULL,
    PRIMARY KEY (model, day, minute)
);
"""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _retry_locked(action: Callable[[], object], attempts: int = 100) -> None:
    """Switching to WAL and creating the schema can report "locked" at once, without waiting on the
    busy handler, while another process opens the same new file: try again briefly."""
    for attempt in range(attempts):
        try:
            action()
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or attempt == attempts - 1:
                raise
            time.sleep(0.05)


def _private_file(path: Path) -> None:
    """Create the ledger file (and its directory) readable by the owner only."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.close(fd)
    os.chmod(path, 0o600)


class SQLiteLedger:
    """Ledger in one SQLite file; safe across threads (a connection per thread) and processes."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        url: str | None = None,
        clock: Callable[[], float] = time.time,  # injectable so a simulated day can run in seconds
    ) -> None:
        self._clock = clock
        self.path = Path(path).expanduser()
        self.url = url or f"sqlite:///{self.path}"
        self._local = threading.local()
        self._host = socket.gethostname()
        try:
            _private_file(self.path)
        except OSError as exc:
            raise StoreError(f"cannot create the ledger file: {exc}", store=self.url) from exc
        with self._errors("open"):
            conn = self._conn()
            _retry_locked(lambda: conn.executescript(_SCHEMA))
            row = conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
            if row is None:
                conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (SCHEMA_VERSION,))
            elif row[0] != SCHEMA_VERSION:
                raise StoreCorrupt(f"ledger schema {row[0]!r} is not {SCHEMA_VERSION!r}", store=self.url)
        for suffix in ("-wal", "-shm"):
            with contextlib.suppress(OSError):
                os.chmod(f"{self.path}{suffix}", 0o600)

    # -- connections ---------------------------------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        # A connection inherited through fork() must never be used by the child.
        if conn is None or self._local.pid != os.getpid():
            conn = sqlite3.connect(self.path, timeout=60.0, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA busy_timeout=60000")
            _retry_locked(lambda: conn.execute("PRAGMA journal_mode=WAL"))
            conn.execute("PRAGMA synchronous=NORMAL")
            self._local.conn = conn
            self._local.pid = os.getpid()
        return conn

    @contextlib.contextmanager
    def _errors(self, action: str) -> Iterator[None]:
        try:
            yield
        except StoreError:
            raise
        except sqlite3.DatabaseError as exc:
            text = str(exc)
            if "not a database" in text or "malformed" in text:
                raise StoreCorrupt(
                    f"ledger is damaged ({text}); it was left untouched", store=self.url
                ) from exc
            raise StoreError(f"ledger {action} failed: {text}", store=self.url) from exc

    @contextlib.contextmanager
    def _write(self, action: str) -> Iterator[sqlite3.Connection]:
        with self._errors(action):
            conn = self._conn()
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    # -- helpers -------------------------------------------------------------------------------

    @staticmethod
    def _read_counters(conn: sqlite3.Connection, keys: Sequence[str]) -> dict[str, Counters]:
        found = {
            key: Counters(settled, in_flight)
            for key, settled, in_flight in conn.execute(
                f"SELECT key, settled, in_flight FROM counters WHERE key IN ({','.join('?' * len(keys))})",
                tuple(keys),
            )
        }
        return {key: found.get(key, Counters()) for key in keys}

    @staticmethod
    def _bump(conn: sqlite3.Connection, key: str, settled: int, in_flight: int) -> None:
        conn.execute(
            "INSERT INTO counters (key, settled, in_flight) VALUES (?, ?, ?) ON CONFLICT (key) DO UPDATE "
            "SET settled = settled + excluded.settled, in_flight = in_flight + excluded.in_flight",
            (key, settled, in_flight),
        )

    @staticmethod
    def _read_snapshot(conn: sqlite3.Connection, model: str) -> Snapshot | None:
        row = conn.execute(
            "SELECT balance, usage_at_sync, lagged_usage, synced_at, day, source"
            " FROM snapshots WHERE model = ?",
            (model,),
        ).fetchone()
        if row is None:
            return None
        balance, usage_at_sync, lagged, synced_at, day, source = row
        return Snapshot(balance, usage_at_sync, lagged, synced_at, day, source)

    def _charge(self, conn: sqlite3.Connection, row: tuple[Any, ...], charged: int, in_flight: int) -> None:
        run_id, model, day = row
        for key in (run_key(run_id), model_day_key(model, day)):
            self._bump(conn, key, charged, in_flight)
        if charged:
            cumulative = conn.execute(
                "SELECT settled FROM counters WHERE key = ?", (model_day_key(model, day),)
            ).fetchone()[0]
            conn.execute(
                "INSERT INTO usage_series VALUES (?, ?, ?, ?) ON CONFLICT (model, day, minute) "
                "DO UPDATE SET cumulative = excluded.cumulative",
                (model, day, int(self._clock() // 60), cumulative),
            )

    # -- the Ledger interface ------------------------------------------------------------------

    def reserve(self, request: HoldRequest, limits_for: LimitsFor) -> Decision:
        keys = (run_key(request.run_id), model_day_key(request.model, request.day))
        with self._write("reserve") as conn:
            counters = self._read_counters(conn, keys)
            snapshot = self._read_snapshot(conn, request.model)
            limits = limits_for(snapshot)
            scoped = {"run": counters[keys[0]], "model_day": counters[keys[1]]}
            result = verdict(limits, scoped, request.reserve)
            held = result.allowed or not request.enforce
            conn.execute(
                "INSERT INTO calls (id, run_id, model, day, endpoint, state, reserved, would_block,"
                " blocked_by,"
                " pid, host, key_fingerprint, tags, started_at, expires_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    request.hold_id,
                    request.run_id,
                    request.model,
                    request.day,
                    request.endpoint,
                    "held" if held else "blocked",
                    request.reserve,
                    int(not result.allowed),
                    result.blocking.name if result.blocking else None,
                    request.pid,
                    request.host,
                    request.key_fingerprint,
                    json.dumps(dict(request.tags)) if request.tags else None,
                    self._clock(),
                    request.expires_at,
                ),
            )
            if held:
                for key in keys:
                    self._bump(conn, key, 0, request.reserve)
        return Decision(request.hold_id, result, held, scoped)

    def settle(self, hold_id: str, usage: Usage | None, *, latency_s: float | None = None) -> None:
        with self._write("settle") as conn:
            row = conn.execute(
                "SELECT run_id, model, day, state, reserved, charged FROM calls WHERE id = ?", (hold_id,)
            ).fetchone()
            if row is None:
                return
            run_id, model, day, state, reserved, charged = row
            if state == "held":
                actual = reserved if usage is None else usage.total_tokens
                self._charge(conn, (run_id, model, day), actual, -reserved)
            elif state == "unresolved" and usage is not None:
                # Charged in full when its owner vanished; real usage arrived after all: correct it.
                actual = usage.total_tokens
                self._charge(conn, (run_id, model, day), actual - charged, 0)
            else:
                return
            new_state = "unresolved" if usage is None else "settled"
            conn.execute(
                "UPDATE calls SET state = ?, charged = ?, prompt_tokens = ?, completion_tokens = ?,"
                " reasoning_tokens = ?, cached_tokens = ?, overshoot = ?, ended_at = ?, latency_s = ?"
                " WHERE id = ?",
                (
                    new_state,
                    actual,
                    usage.prompt_tokens if usage else None,
                    usage.completion_tokens if usage else None,
                    usage.reasoning_tokens if usage else None,
                    usage.cached_tokens if usage else None,
                    int(usage is not None and actual > reserved),
                    self._clock(),
                    latency_s,
                    hold_id,
                ),
            )

    def release(self, hold_id: str) -> None:
        with self._write("release") as conn:
            row = conn.execute(
                "SELECT run_id, model, day, reserved FROM calls WHERE id = ? AND state = 'held'", (hold_id,)
            ).fetchone()
            if row is None:
                return
            run_id, model, day, reserved = row
            self._charge(conn, (run_id, model, day), 0, -reserved)
            conn.execute(
                "UPDATE calls SET state = 'released', ended_at = ? WHERE id = ?", (self._clock(), hold_id)
            )

    def _charge_open(self, where: str, params: tuple[Any, ...]) -> int:
        with self._write("resolve") as conn:
            rows = conn.execute(
                f"SELECT id, run_id, model, day, reserved FROM calls WHERE state = 'held' AND {where}", params
            ).fetchall()
            now = self._clock()
            for hold_id, run_id, model, day, reserved in rows:
                self._charge(conn, (run_id, model, day), reserved, -reserved)
                conn.execute(
                    "UPDATE calls SET state = 'unresolved', charged = reserved, ended_at = ? WHERE id = ?",
                    (now, hold_id),
                )
        return len(rows)

    def resolve_run(self, run_id: str) -> int:
        return self._charge_open("run_id = ?", (run_id,))

    def reclaim_orphans(self, now: float) -> int:
        with self._errors("scan"):
            rows = (
                self._conn()
                .execute("SELECT DISTINCT pid FROM calls WHERE state = 'held' AND host = ?", (self._host,))
                .fetchall()
            )
        dead = [pid for (pid,) in rows if not _pid_alive(pid)]
        reclaimed = self._charge_open("expires_at < ?", (now,))
        if dead:
            marks = ",".join("?" * len(dead))
            reclaimed += self._charge_open(f"host = ? AND pid IN ({marks})", (self._host, *dead))
        return reclaimed

    def counters(self, keys: Sequence[str]) -> dict[str, Counters]:
        with self._errors("read"):
            return self._read_counters(self._conn(), keys)

    def snapshot(self, model: str) -> Snapshot | None:
        with self._errors("read"):
            return self._read_snapshot(self._conn(), model)

    def put_snapshot(self, model: str, snapshot: Snapshot) -> None:
        with self._write("sync") as conn:
            conn.execute(
                "INSERT OR REPLACE INTO snapshots VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    model,
                    snapshot.day,
                    snapshot.balance,
                    snapshot.usage_at_sync,
                    snapshot.lagged_usage,
                    snapshot.synced_at,
                    snapshot.source,
                ),
            )
            conn.execute(
                "INSERT INTO sync_history VALUES (?, ?, ?, ?, ?, ?)",
                (
                    model,
                    snapshot.day,
                    snapshot.synced_at,
                    snapshot.balance,
                    snapshot.usage_at_sync,
                    snapshot.source,
                ),
            )

    def usage_series(self, model: str, day: str) -> list[tuple[float, int]]:
        with self._errors("read"):
            rows = (
                self._conn()
                .execute(
                    "SELECT minute, cumulative FROM usage_series WHERE model = ? AND day = ? ORDER BY minute",
                    (model, day),
                )
                .fetchall()
            )
        return [(minute * 60.0, cumulative) for minute, cumulative in rows]

    def sync_history(self, model: str, day: str) -> list[tuple[float, int]]:
        with self._errors("read"):
            rows = (
                self._conn()
                .execute(
                    "SELECT synced_at, balance FROM sync_history"
                    " WHERE model = ? AND day = ? ORDER BY synced_at",
                    (model, day),
                )
                .fetchall()
            )
        return [(t, balance) for t, balance in rows]

    def put_packages(self, model: str, packages: Sequence[Package], synced_at: float) -> None:
        rows = [[p.available, p.expires_at] for p in packages]
        with self._write("sync") as conn:
            conn.execute(
                "INSERT OR REPLACE INTO packages VALUES (?, ?, ?)", (model, synced_at, json.dumps(rows))
            )

    def packages(self, model: str) -> list[Package]:
        with self._errors("read"):
            row = self._conn().execute("SELECT packages FROM packages WHERE model = ?", (model,)).fetchone()
        return (
            [Package(model, int(available), float(expires)) for available, expires in json.loads(row[0])]
            if row
            else []
        )

    def known_models(self) -> list[str]:
        """Every model the ledger has seen a call or a balance for."""
        with self._errors("read"):
            rows = (
                self._conn()
                .execute("SELECT model FROM snapshots UNION SELECT DISTINCT model FROM calls ORDER BY 1")
                .fetchall()
            )
        return [model for (model,) in rows]

    def try_lease(self, name: str, holder: str, ttl_s: float, now: float) -> bool:
        """Take (or renew) a named lease unless another holder has it: one billing caller per ledger."""
        with self._write("lease") as conn:
            row = conn.execute("SELECT holder, until FROM leases WHERE name = ?", (name,)).fetchone()
            if row is not None and row[0] != holder and row[1] > now:
                return False
            conn.execute("INSERT OR REPLACE INTO leases VALUES (?, ?, ?)", (name, holder, now + ttl_s))
        return True

    def release_lease(self, name: str, holder: str) -> None:
        with self._write("lease") as conn:
            conn.execute("DELETE FROM leases WHERE name = ? AND holder = ?", (name, holder))

    def run_totals(self, run_id: str) -> RunTotals:
        with self._errors("read"):
            rows = (
                self._conn()
                .execute(
                    """SELECT model,
                     COUNT(*) FILTER (WHERE state != 'blocked'),
                     COUNT(*) FILTER (WHERE state = 'blocked'),
                     SUM(would_block),
                     SUM(charged),
                     SUM(CASE WHEN state = 'held' THEN reserved ELSE 0 END),
                     SUM(overshoot),
                     COUNT(*) FILTER (WHERE state = 'unresolved'),
                     COUNT(*) FILTER (WHERE state = 'released'),
                     SUM(COALESCE(prompt_tokens, 0)), SUM(COALESCE(completion_tokens, 0)),
                     SUM(COALESCE(reasoning_tokens, 0)), SUM(COALESCE(cached_tokens, 0))
                   FROM calls WHERE run_id = ? GROUP BY model ORDER BY model""",
                    (run_id,),
                )
                .fetchall()
            )
        return RunTotals(run_id, {row[0]: ModelTotals(*(int(v or 0) for v in row[1:])) for row in rows})

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None and self._local.pid == os.getpid():
            conn.close()
        self._local = threading.local()
