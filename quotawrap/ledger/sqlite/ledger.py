"""The embedded ledger: one SQLite file in WAL mode, one short ``BEGIN IMMEDIATE`` per change.

``BEGIN IMMEDIATE`` takes SQLite's single write lock before the counters are read, so the
read-check-write of a reservation cannot interleave with another thread or process: this is
the "no await between read and write" rule of the post-mortem, enforced by the database.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Concatenate, ParamSpec, TypeVar

from ...core.budgets import BUDGET_PREFIX, Budget, BudgetUse
from ...core.errors import StoreCorrupt, StoreError
from ...core.quota import Counters, Package, Snapshot, Verdict, verdict
from ...core.usage import Usage
from ...support.host import hostname
from ...support.processes import pid_alive
from ..base import (
    CallRecord,
    DayAggregate,
    Decision,
    HoldRequest,
    LimitsFor,
    PruneResult,
    RunRecord,
    RunTotals,
    Settle,
)
from ..budgets import BudgetBook, budget_uses
from ..holds import Deltas, Event, add_deltas, clamp, step
from ..reasoning import REASONING_HISTORY
from ..scopes import model_day_key, run_cost_key, run_key, scope_keys
from . import books
from .advances import close_advance, drawn_runs, land_drawn, release_dead_advances, split_from_advance
from .budgets import (
    budget_counters,
    charge_budgets,
    list_budget_texts,
    remember_budgets,
    remove_budget,
    store_budget,
)
from .file import (
    CALL_COLUMNS,
    LOCK_WAIT_S,
    MIGRATIONS,
    OPEN_BUSY_MS,
    SCHEMA_VERSION,
    apply_migration,
    check,
    create,
    create_schema,
    identity,
    refuse_foreign,
    refuse_symlink,
    retry_locked,
    write_lock,
)
from .reserve import (
    BUMP,
    RESERVE_INTO_CALLS,
    RESERVE_INTO_HOLDS,
    SNAPSHOT_COLUMNS,
    Place,
    count_waiting,
    read_counters,
    read_for_reserve,
    tags_column,
)
from .rows import STEP_COLUMNS, Owed, step_values
from .runs import END_RUN, INSERT_RUN, LEASE_HOLDER, tags_json

if TYPE_CHECKING:
    from ...core.member_keys import MemberKey

__all__ = ["SCHEMA_VERSION", "SQLiteLedger"]

P = ParamSpec("P")
T = TypeVar("T")

FILE_CHECK_S = 1.0  # how often an open ledger checks that its file is still the one it opened
# A process that leaves checkpoints to another (leave_checkpoints) still runs one past this many WAL pages:
# SQLite's own threshold is 1,000, so the other process nearly always runs them first.
BACKSTOP_CHECKPOINT_PAGES = 10_000

# What a step writes (_step): a hold's row moves to calls with STEP_COLUMNS' values (then leaves holds); an
# unresolved call's row is updated in place. Parameters: those columns' values in order, then the id.
_ID = f"?{len(STEP_COLUMNS) + 1}"
UPDATE_FINAL = (
    f"UPDATE calls SET ({', '.join(STEP_COLUMNS)})"
    f" = ({', '.join(f'?{n}' for n in range(1, len(STEP_COLUMNS) + 1))}) WHERE id = {_ID}"
)
MOVE_HELD = (
    f"INSERT INTO calls ({', '.join(CALL_COLUMNS)}) SELECT "
    + ", ".join(f"?{STEP_COLUMNS.index(c) + 1}" if c in STEP_COLUMNS else c for c in CALL_COLUMNS)
    + f" FROM holds WHERE id = {_ID}"
)

# A call's row as SQLiteLedger._step takes it, led by whether it is a hold in flight (a row of holds, else of
# calls): a hold is in exactly one of the two tables.
HOLD_COLUMNS = "id, run_id, model, day, state, reserved, charged, reserved_cost, charged_cost"
HOLD_ROW = (
    f"SELECT 1, {HOLD_COLUMNS} FROM holds WHERE id = ?1 UNION ALL SELECT 0, {HOLD_COLUMNS} FROM calls WHERE id = ?1"
)
OPEN_HOLDS = f"SELECT 1, {HOLD_COLUMNS} FROM holds WHERE "  # then the condition: the holds in flight, as HOLD_ROW's


class _Transaction:
    """``with ledger._write(action) as conn``: one BEGIN IMMEDIATE ... COMMIT (ROLLBACK on any error),
    database errors raised as StoreError. A class, not a generator: every guarded call takes two."""

    __slots__ = ("_action", "_conn", "_ledger", "_lock", "_locked")

    def __init__(self, ledger: SQLiteLedger, action: str) -> None:
        self._ledger, self._action = ledger, action
        self._lock = write_lock(str(ledger.path))

    def __enter__(self) -> sqlite3.Connection:
        # Bounded as SQLite's busy timeout is: past it, ask SQLite as before rather than wait on.
        self._locked = self._lock.acquire(timeout=LOCK_WAIT_S)
        try:
            self._conn = self._ledger._conn()
            self._conn.execute("BEGIN IMMEDIATE")
        except BaseException as exc:
            if self._locked:
                self._lock.release()
            if isinstance(exc, sqlite3.DatabaseError):
                raise self._ledger._error(self._action, exc) from exc
            raise
        return self._conn

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            self._conn.execute("ROLLBACK" if exc is not None else "COMMIT")
        except sqlite3.DatabaseError as error:
            raise self._ledger._error(self._action, error) from (exc or error)
        finally:
            if self._locked:
                self._lock.release()
        if isinstance(exc, sqlite3.DatabaseError):
            raise self._ledger._error(self._action, exc) from exc


class SQLiteLedger:
    """Ledger in one SQLite file; safe across threads (a connection per thread) and processes."""

    takes_advances: ClassVar[bool] = True

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
        self._host = hostname()
        self._budget_book = BudgetBook()
        self._checkpoint_pages: int | None = None  # None: SQLite's default (leave_checkpoints)
        refuse_symlink(self.path, self.url)
        with self._errors("open"):
            # Before anything writes to it (mode, WAL switch, tables): a file that is not a
            # quotawrap ledger is refused as it is, never adopted.
            refuse_foreign(self.path, self.url)
            try:
                create(self.path)
                os.chmod(self.path, 0o600)
                self._identity = identity(self.path)
            except OSError as exc:
                raise StoreError(f"cannot create the ledger file: {exc}", store=self.url) from exc
            self._checked_at = time.monotonic()
            conn = self._conn()
            retry_locked(lambda: create_schema(conn))
            row = conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
            if row[0] in MIGRATIONS:
                self._migrate(conn)
            elif row[0] != SCHEMA_VERSION:
                raise StoreCorrupt(f"ledger schema {row[0]!r} is not {SCHEMA_VERSION!r}", store=self.url)
        for suffix in ("-wal", "-shm"):
            with contextlib.suppress(OSError):
                os.chmod(f"{self.path}{suffix}", 0o600)

    def _migrate(self, conn: sqlite3.Connection) -> None:
        conn.execute("BEGIN IMMEDIATE")
        try:
            current = conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()[0]
            while current in MIGRATIONS:  # re-read under the lock: another process may have migrated
                for statement in MIGRATIONS[current]:
                    apply_migration(conn, statement)
                current = conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()[0]
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    # -- connections ---------------------------------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        # A connection inherited through fork() must never be used by the child.
        if conn is None or self._local.pid != os.getpid():
            check(self.path, self._identity, self.url)
            conn = sqlite3.connect(self.path, timeout=60.0, isolation_level=None, check_same_thread=False)
            conn.execute(f"PRAGMA busy_timeout={OPEN_BUSY_MS}")
            retry_locked(lambda: conn.execute("PRAGMA journal_mode=WAL"))
            conn.execute("PRAGMA busy_timeout=60000")
            conn.execute("PRAGMA synchronous=NORMAL")
            if self._checkpoint_pages is not None:
                conn.execute(f"PRAGMA wal_autocheckpoint={self._checkpoint_pages}")
            self._local.conn = conn
            self._local.pid = os.getpid()
        elif time.monotonic() - self._checked_at >= FILE_CHECK_S:
            check(self.path, self._identity, self.url)
            self._checked_at = time.monotonic()
        return conn

    def leave_checkpoints(self) -> None:
        """This process's commits leave the WAL's checkpoints to another process that writes the same ledger
        all along (a guarded child's wrapper, which lands the child's settles). A checkpoint copies the WAL
        into the database and syncs both, slow on a slow disk, and whichever commit finds the WAL past
        SQLite's threshold runs it: in a guarded child, now and then a reserve's COMMIT, on the caller's
        path. Past BACKSTOP_CHECKPOINT_PAGES this process still runs one itself."""
        self._checkpoint_pages = BACKSTOP_CHECKPOINT_PAGES
        conn = getattr(self._local, "conn", None)
        if conn is not None and self._local.pid == os.getpid():
            conn.execute(f"PRAGMA wal_autocheckpoint={self._checkpoint_pages}")

    def _error(self, action: str, exc: sqlite3.DatabaseError) -> StoreError:
        """The StoreError a database error becomes: StoreCorrupt when the file is damaged."""
        text = str(exc)
        if "not a database" in text or "malformed" in text:
            return StoreCorrupt(f"ledger is damaged ({text}); it was left untouched", store=self.url)
        return StoreError(f"ledger {action} failed: {text}", store=self.url)

    @contextlib.contextmanager
    def _errors(self, action: str) -> Iterator[None]:
        try:
            yield
        except sqlite3.DatabaseError as exc:
            raise self._error(action, exc) from exc

    def _write(self, action: str) -> _Transaction:
        return _Transaction(self, action)

    def _read(self, read: Callable[Concatenate[sqlite3.Connection, P], T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``read`` (one of books.py's) over this thread's connection, database errors as StoreError."""
        with self._errors("read"):
            return read(self._conn(), *args, **kwargs)

    # -- helpers -------------------------------------------------------------------------------

    @staticmethod
    def _bump(conn: sqlite3.Connection, *rows: tuple[str, int]) -> None:
        """Add what was settled to each key's counter: one statement for all (a settle's two or three)."""
        conn.execute(BUMP[len(rows)], [value for row in rows for value in row])

    @staticmethod
    def _read_snapshot(conn: sqlite3.Connection, model: str) -> Snapshot | None:
        row = conn.execute(f"SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE model = ?", (model,)).fetchone()
        return None if row is None else Snapshot(*row)

    def _charge(self, conn: sqlite3.Connection, call: tuple[str, str, str], deltas: Deltas) -> None:
        """Add what a transition settled to every counter the call belongs to, and the usage series. What it
        had in flight was its row of holds (IN_FLIGHT), which the transition moved out."""
        run_id, model, day = call
        day_key = model_day_key(model, day)
        rows = [(run_key(run_id), deltas.settled), (day_key, deltas.settled)] if deltas.settled else []
        if deltas.cost_settled:
            rows.append((run_cost_key(run_id), deltas.cost_settled))
        if not rows:  # a release: nothing settled
            return
        self._bump(conn, *rows)
        if deltas.settled:  # the model-day's new total, read where the bump just left it: one statement
            conn.execute(
                "INSERT INTO usage_series SELECT ?, ?, ?, settled FROM counters WHERE key = ?"
                " ON CONFLICT (model, day, minute) DO UPDATE SET cumulative = excluded.cumulative",
                (model, day, int(self._clock() // 60), day_key),
            )

    # -- the Ledger interface ------------------------------------------------------------------

    def reserve(self, request: HoldRequest, limits_for: LimitsFor) -> Decision:
        scopes = scope_keys(request.run_id, request.model, request.day)
        reserve, reserve_cost = clamp(request.reserve), clamp(request.reserve_cost)
        with self._write("reserve") as conn:
            call = (request.run_id, request.model, request.day)
            scoped, snapshot, waiting, stored = read_for_reserve(conn, scopes, call, request.enforce)
            limits = limits_for(snapshot)
            budgets = self._budget_book.decode(stored)
            if self._budget_book.bars_advance(budgets, request):  # its calls reserve one by one (ledger/budgets.py)
                return Decision(request.hold_id, Verdict(True), False, scoped)
            budget_limits, budget_scopes = self._budget_book.for_hold(budgets, request, self._clock())
            if budget_scopes:
                scoped = {**scoped, **budget_counters(conn, budget_scopes)}
                limits = [*limits, *budget_limits]
            result = verdict(limits, scoped, reserve, reserve_cost=reserve_cost)
            place = Place(conn, request, self._clock(), waiting, scopes)
            outcome = place.decide(limits, scoped, result.allowed)
            if outcome in ("queued", "wait"):
                return place.decision(result, scoped)
            if outcome == "line_refused":
                result = place.refusal()
            held = outcome == "take"
            if not held and request.advance:  # no call was refused: its process reserves per call instead
                return Decision(request.hold_id, result, False, scoped)
            conn.execute(
                RESERVE_INTO_HOLDS if held else RESERVE_INTO_CALLS,
                (
                    request.hold_id,
                    request.run_id,
                    request.model,
                    request.day,
                    request.endpoint,
                    "held" if held else "blocked",
                    reserve,
                    reserve_cost,
                    int(not result.allowed),
                    result.blocking.name if result.blocking else None,
                    request.pid,
                    request.host,
                    request.key_fingerprint,
                    tags_column(request.tags),
                    self._clock(),
                    request.expires_at,
                ),
            )
            if held and budget_scopes:
                remember_budgets(conn, request.hold_id, budget_scopes)
        return Decision(request.hold_id, result, held, scoped, ticket=place.ticket)

    def leave_line(self, request: HoldRequest) -> None:
        with self._write("leave") as conn:
            Place.leave_lines(conn, request)

    def waiting(self, now: float) -> dict[str, int]:
        with self._errors("read"):
            return count_waiting(self._conn(), now)

    def _step(
        self,
        conn: sqlite3.Connection,
        row: tuple[Any, ...],
        event: Event,
        usage: Usage | None = None,
        cost: int | None = None,
        latency_s: float | None = None,
        anomaly: str | None = None,
        handed_to: str | None = None,
    ) -> Owed | None:
        """Apply holds.step to one call row (``HOLD_ROW``'s): what it owes the counters, None if it changed
        nothing. The caller charges it (``_charge_owed``): a batch once per (run, model, day)."""
        held, hold_id, run_id, model, day, state, reserved, charged, reserved_cost, charged_cost = row
        moved = step(
            state,
            event,
            reserved=reserved,
            charged=charged,
            reserved_cost=reserved_cost,
            charged_cost=charged_cost,
            usage_total=None if usage is None else usage.total_tokens,
            cost=cost,
        )
        if moved is None:
            return None
        values = step_values(moved, usage, latency_s, anomaly, handed_to, self._clock())
        charge_budgets(conn, hold_id, moved.deltas)
        conn.execute(MOVE_HELD if held else UPDATE_FINAL, (*values, hold_id))
        if held:  # it left 'held' (a hold never returns to it): its row moved to calls
            conn.execute("DELETE FROM holds WHERE id = ?", (hold_id,))
        return (run_id, model, day), moved.deltas

    def _charge_owed(self, conn: sqlite3.Connection, steps: Iterable[Owed | None]) -> int:
        """Charge what ``steps`` owe, each counter once; how many changed a call."""
        owed: dict[tuple[str, str, str], Deltas] = {}
        changed = 0
        for step_owes in steps:
            if step_owes is not None:
                call, deltas = step_owes
                owed[call] = add_deltas(owed.get(call), deltas)
                changed += 1
        for call, deltas in owed.items():
            self._charge(conn, call, deltas)
        return changed

    def settle(
        self,
        hold_id: str,
        usage: Usage | None,
        *,
        latency_s: float | None = None,
        cost: int | None = None,
        anomaly: str | None = None,
    ) -> None:
        self.settle_many([Settle(hold_id, "settle", usage, latency_s, cost, anomaly)])

    def release(self, hold_id: str, *, handed_to: str | None = None) -> None:
        with self._write("release") as conn:
            row = conn.execute(HOLD_ROW, (hold_id,)).fetchone()
            if row is not None:
                self._charge_owed(conn, [self._step(conn, row, "release", handed_to=handed_to)])

    def settle_many(self, settles: Sequence[Settle]) -> None:
        """Every settle and release in one transaction (one lock, one commit), each counter charged once."""
        with self._write("settle") as conn:
            self._charge_owed(conn, self._settle_steps(conn, settles))

    def _settle_steps(self, conn: sqlite3.Connection, settles: Sequence[Settle]) -> Iterator[Owed | None]:
        """Each settle's step, its row read right before it (a replay in the batch sees the state it left); the
        drawn calls of one advance with no row yet land together (land_drawn)."""
        for run in drawn_runs(settles):
            hold_id, event, _, _, _, _, drawn = run[0]
            if event == "close":  # an advance's rest given back (quotawrap.admission.advances)
                if drawn is not None:
                    close_advance(conn, hold_id, drawn)
                continue
            if event == "draw":  # a call drawn from an advance, in flight: its own row, once
                if drawn is not None:
                    split_from_advance(conn, hold_id, drawn)
                continue
            if drawn is not None:  # drawn calls settled with no row yet go straight to calls
                landed, run = land_drawn(conn, run, self._clock())
                yield from landed
            for hold_id, event, usage, latency_s, cost, anomaly, _ in run:  # drawn_runs: only settles, releases
                row = conn.execute(HOLD_ROW, (hold_id,)).fetchone()
                if row is not None:
                    ended: Event = "release" if event == "release" else "settle"
                    yield self._step(conn, row, ended, usage, cost, latency_s, anomaly)

    def _charge_open(self, where: str, params: tuple[Any, ...]) -> int:
        with self._write("resolve") as conn:
            rows = conn.execute(OPEN_HOLDS + where, params).fetchall()
            return self._charge_owed(conn, (self._step(conn, row, "resolve") for row in rows))

    def resolve_run(self, run_id: str, *, release_advances: bool = False) -> int:
        if release_advances:
            with self._write("resolve") as conn:
                release_dead_advances(conn, run_id, self._host)
        return self._charge_open("run_id = ?", (run_id,))

    def reclaim_orphans(self, now: float) -> int:
        with self._errors("scan"):
            rows = self._conn().execute("SELECT DISTINCT pid FROM holds WHERE host = ?", (self._host,)).fetchall()
        dead = [pid for (pid,) in rows if not pid_alive(pid)]
        reclaimed = self._charge_open("expires_at < ?", (now,))
        if dead:
            marks = ",".join("?" * len(dead))
            reclaimed += self._charge_open(f"host = ? AND pid IN ({marks})", (self._host, *dead))
        return reclaimed

    def counters(self, keys: Sequence[str]) -> dict[str, Counters]:
        budget_keys = [key for key in keys if key.startswith(BUDGET_PREFIX)]
        if not budget_keys:
            with self._errors("read"):
                return read_counters(self._conn(), keys)
        with self._write("read") as conn:  # one snapshot of both kinds of counter
            found = read_counters(conn, [key for key in keys if not key.startswith(BUDGET_PREFIX)])
            found.update(budget_counters(conn, budget_keys))
        return {key: found[key] for key in keys}

    # -- budgets (ledger/budgets.py) -------------------------------------------------------------

    def set_budget(self, budget: Budget) -> bool:
        with self._write("budget") as conn:
            return store_budget(conn, budget, self._clock())

    def remove_budget(self, budget_id: str) -> bool:
        with self._write("budget") as conn:
            return remove_budget(conn, budget_id)

    def budgets(self, run_id: str | None = None) -> list[Budget]:
        with self._errors("read"):
            return sorted(self._budget_book.decode(list_budget_texts(self._conn(), run_id)), key=lambda b: b.id)

    def budget_uses(self, now: float, run_id: str | None = None) -> list[BudgetUse]:
        return budget_uses(self, now, run_id)

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
        return self._read(books.usage_series, model, day)

    def sync_history(self, model: str, day: str) -> list[tuple[float, int]]:
        return self._read(books.sync_history, model, day)

    def put_packages(self, model: str, packages: Sequence[Package], synced_at: float) -> None:
        rows = [[p.available, p.expires_at] for p in packages]
        with self._write("sync") as conn:
            conn.execute("INSERT OR REPLACE INTO packages VALUES (?, ?, ?)", (model, synced_at, json.dumps(rows)))

    def packages(self, model: str) -> list[Package]:
        return self._read(books.packages, model)

    def known_models(self) -> list[str]:
        return self._read(books.known_models)

    def endpoint_models(self) -> dict[str, str]:
        """Every endpoint id -> model id pair kept (learned from answers, or listed by the management API)."""
        with self._errors("read"):
            return dict(self._conn().execute("SELECT endpoint, model FROM endpoints").fetchall())

    def put_endpoint_models(self, models: Mapping[str, str]) -> None:
        """Keep these endpoint id -> model id pairs; an endpoint's pair replaces the one it had."""
        if not models:
            return
        now = self._clock()
        with self._write("endpoints") as conn:
            conn.executemany(
                "INSERT OR REPLACE INTO endpoints VALUES (?, ?, ?)",
                [(endpoint, model, now) for endpoint, model in models.items()],
            )

    # -- member keys (member_keys.py): imported on use, off every guarded command's start

    def add_member_key(self, key: MemberKey) -> bool:
        from .member_keys import add_member_key

        with self._write("member keys") as conn:
            return add_member_key(conn, key)

    def member_key(self, key_hash: str) -> MemberKey | None:
        from .member_keys import member_key

        with self._errors("read"):
            return member_key(self._conn(), key_hash)

    def member_keys(self) -> list[MemberKey]:
        from .member_keys import member_keys

        with self._errors("read"):
            return member_keys(self._conn())

    def revoke_member_key(self, name: str, at: float) -> MemberKey | None:
        from .member_keys import revoke_member_key

        with self._write("member keys") as conn:
            return revoke_member_key(conn, name, at)

    def try_lease(self, name: str, holder: str, ttl_s: float, now: float) -> bool:
        """Take (or renew) a named lease unless another holder has it: one billing caller per ledger."""
        with self._write("lease") as conn:
            row = conn.execute(LEASE_HOLDER, (name,)).fetchone()
            if row is not None and row[0] != holder and row[1] > now:
                return False
            conn.execute("INSERT OR REPLACE INTO leases VALUES (?, ?, ?)", (name, holder, now + ttl_s))
        return True

    def release_lease(self, name: str, holder: str) -> None:
        with self._write("lease") as conn:
            conn.execute("DELETE FROM leases WHERE name = ? AND holder = ?", (name, holder))

    def run_totals(self, run_id: str) -> RunTotals:
        return self._read(books.run_totals, run_id)

    def reasoning_history(self, model: str, *, since: float, limit: int) -> list[int]:
        with self._errors("read"):
            rows = self._conn().execute(REASONING_HISTORY, (model, since, limit)).fetchall()
        return [reasoning for (reasoning,) in reversed(rows)]

    def call_records(
        self, *, since: float | None = None, until: float | None = None, run_id: str | None = None
    ) -> list[CallRecord]:
        return self._read(books.call_records, since=since, until=until, run_id=run_id)

    def start_run(self, run: RunRecord) -> None:
        with self._write("run") as conn:
            conn.execute(
                INSERT_RUN, (run.run_id, run.started_at, run.ended_at, run.command, tags_json(run.tags), run.exit_code)
            )

    def end_run(self, run_id: str, exit_code: int, ended_at: float) -> None:
        with self._write("run") as conn:
            conn.execute(END_RUN, (exit_code, ended_at, run_id))

    def runs(self, *, since: float | None = None, until: float | None = None) -> list[RunRecord]:
        return self._read(books.runs, since=since, until=until)

    def prune(self, before_day: str, *, dry_run: bool = False) -> PruneResult:
        from datetime import datetime

        from ...core.quota import BEIJING
        from .prune import prune_sqlite

        before_ts = datetime.fromisoformat(before_day).replace(tzinfo=BEIJING).timestamp()
        return prune_sqlite(self, before_day, before_ts, dry_run=dry_run)

    def aggregates(self, *, since_day: str | None = None, until_day: str | None = None) -> list[DayAggregate]:
        return self._read(books.aggregates, since_day=since_day, until_day=until_day)

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None and self._local.pid == os.getpid():
            conn.close()
        self._local = threading.local()
