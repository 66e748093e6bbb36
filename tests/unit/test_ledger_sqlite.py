"""Tests for what only the SQLite ledger does: private files, refusing what is not a ledger, fork safety,
and keeping API keys out of the file. (The behaviour every ledger shares is in test_ledger_contract.py.)"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import sqlite3
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quotawrap.admission.guard import Guard
from quotawrap.config.settings import Settings
from quotawrap.core.errors import StoreCorrupt, StoreError
from quotawrap.core.quota import Counters
from quotawrap.core.usage import Usage
from quotawrap.ledger import HoldRequest, model_day_key
from quotawrap.ledger.base import new_hold_id
from quotawrap.ledger.sqlite.file import _SCHEMA, PAGE_SIZE
from quotawrap.ledger.sqlite.ledger import SCHEMA_VERSION, SQLiteLedger

MODEL = "doubao-seed-1-6-250615"
DAY = "2026-05-01"


def _hold(reserve: int = 100, **changes: object) -> HoldRequest:
    fields: dict[str, object] = {
        "run_id": "run-1",
        "model": MODEL,
        "day": DAY,
        "reserve": reserve,
        "endpoint": "chat",
        "pid": os.getpid(),
        "host": "test-host",
        "expires_at": time.time() + 3600,
        **changes,
    }
    return HoldRequest(**fields)  # type: ignore[arg-type]


def _no_limits(_snapshot: object) -> list[object]:
    return []


def _open_at(path: Path, start_at: float, results: Any) -> None:
    """In a forked process: open the ledger at the agreed moment, report ok or the error."""
    while time.time() < start_at:
        pass
    try:
        SQLiteLedger(path).close()
        results.put("ok")
    except BaseException as exc:
        results.put(repr(exc))


def _mode(path: Path | str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def loose_umask() -> Iterator[None]:
    """A umask that would leave new files world-readable, so privacy must come from the ledger itself."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


class TestPrivateFiles:
    def test_database_and_journals_are_0600(self, tmp_path: Path, loose_umask: None) -> None:
        """The ledger, its -wal and its -shm are readable by the owner only."""
        path = tmp_path / "ledger.sqlite3"
        ledger = SQLiteLedger(path)
        ledger.reserve(_hold(), _no_limits)  # type: ignore[arg-type]
        for name in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
            assert name.exists(), name
            assert _mode(name) == 0o600, name
        ledger.close()

    def test_existing_loose_file_is_tightened(self, tmp_path: Path) -> None:
        """A ledger file someone made 0644 is made 0600 again on open."""
        path = tmp_path / "ledger.sqlite3"
        SQLiteLedger(path).close()
        os.chmod(path, 0o644)
        SQLiteLedger(path).close()
        assert _mode(path) == 0o600

    def test_created_directory_is_0700(self, tmp_path: Path, loose_umask: None) -> None:
        """The directory the ledger creates for itself is private."""
        directory = tmp_path / "state" / "quotawrap"
        SQLiteLedger(directory / "ledger.sqlite3").close()
        assert _mode(directory) == 0o700

    def test_uncreatable_path_is_a_store_error(self, tmp_path: Path) -> None:
        """A path under a regular file cannot be a ledger: StoreError naming the store."""
        blocker = tmp_path / "file"
        blocker.write_text("")
        with pytest.raises(StoreError, match="file"):
            SQLiteLedger(blocker / "ledger.sqlite3")


def _assert_refused_untouched(path: Path, match: str) -> None:
    before, mode = path.read_bytes(), _mode(path)
    with pytest.raises(StoreCorrupt, match=match) as error:
        SQLiteLedger(path)
    assert str(path) in str(error.value)  # names the store
    assert path.read_bytes() == before
    assert _mode(path) == mode


class TestRefusesWhatIsNotALedger:
    def test_garbage(self, tmp_path: Path) -> None:
        """A file of garbage is StoreCorrupt and is left byte for byte as it was."""
        path = tmp_path / "ledger.sqlite3"
        path.write_bytes(b"this is not a database\n" * 500)
        _assert_refused_untouched(path, "damaged")

    @settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.binary(min_size=1, max_size=8192).filter(lambda data: not data.startswith(b"SQLite format 3\0")))
    def test_any_garbage(self, data: bytes) -> None:
        """Whatever non-SQLite bytes the file holds, it is refused and never rewritten."""
        with tempfile.TemporaryDirectory() as directory:
            path = Path(directory) / "ledger.sqlite3"
            path.write_bytes(data)
            with pytest.raises(StoreCorrupt):
                SQLiteLedger(path)
            assert path.read_bytes() == data

    def test_truncated_ledger(self, tmp_path: Path) -> None:
        """A ledger cut in half is StoreCorrupt, and the rest of it is not overwritten."""
        path = tmp_path / "ledger.sqlite3"
        ledger = SQLiteLedger(path)
        for _ in range(200):
            ledger.reserve(_hold(tags={"padding": "x" * 200}), _no_limits)  # type: ignore[arg-type]
        ledger.close()
        with sqlite3.connect(path) as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            conn.execute("PRAGMA journal_mode=DELETE")
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
        _assert_refused_untouched(path, "damaged")

    def test_other_applications_database(self, tmp_path: Path) -> None:
        """Someone else's SQLite file is refused as it is: no tables added, no WAL switch, no chmod."""
        path = tmp_path / "app.db"
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
            conn.execute("INSERT INTO users VALUES (1, 'ada')")
        os.chmod(path, 0o644)
        _assert_refused_untouched(path, "not a quotawrap ledger")
        with sqlite3.connect(path) as conn:
            tables = [name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        assert tables == ["users"]

    def test_other_applications_meta_table(self, tmp_path: Path) -> None:
        """A `meta` table of another shape is not our schema mark."""
        path = tmp_path / "app.db"
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE meta (k TEXT, v TEXT)")
        _assert_refused_untouched(path, "not a quotawrap ledger")

    def test_other_schema_version(self, tmp_path: Path) -> None:
        """A ledger from an unknown (newer) quotawrap is refused, not downgraded or reset."""
        path = tmp_path / "ledger.sqlite3"
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            conn.execute("INSERT INTO meta VALUES ('schema', '99')")
        _assert_refused_untouched(path, "schema '99'")

    def test_own_ledger_reopens(self, tmp_path: Path) -> None:
        """The refusal is not over-eager: a ledger reopens with its data, at the current schema."""
        path = tmp_path / "ledger.sqlite3"
        first = SQLiteLedger(path)
        decision = first.reserve(_hold(), _no_limits)  # type: ignore[arg-type]
        first.close()
        second = SQLiteLedger(path)
        second.settle(decision.hold_id, Usage(10, 5, 15))
        assert second.counters([model_day_key(MODEL, DAY)])[model_day_key(MODEL, DAY)].settled == 15
        second.close()
        with sqlite3.connect(path) as conn:
            assert conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone() == (SCHEMA_VERSION,)

    def test_new_ledger_has_small_pages_and_an_older_one_keeps_its_own(self, tmp_path: Path) -> None:
        """A new ledger is made of PAGE_SIZE pages (less for each commit to copy); a ledger made before, of
        SQLite's 4 KiB pages, opens, keeps them and its data, and takes holds as before."""
        new = SQLiteLedger(tmp_path / "new.sqlite3")
        assert new._conn().execute("PRAGMA page_size").fetchone() == (PAGE_SIZE,) != (4096,)
        new.close()
        old_path = tmp_path / "old.sqlite3"
        with sqlite3.connect(old_path) as conn:  # as the ledger made it before: SQLite's default page size
            conn.execute("PRAGMA journal_mode=WAL")
            conn.executescript(_SCHEMA + f"INSERT INTO meta VALUES ('schema', '{SCHEMA_VERSION}');")
            conn.execute("INSERT INTO counters VALUES (?, 40)", (model_day_key(MODEL, DAY),))
        conn.close()
        old = SQLiteLedger(old_path)
        decision = old.reserve(_hold(), _no_limits)  # type: ignore[arg-type]
        old.settle(decision.hold_id, Usage(10, 5, 15))
        assert old._conn().execute("PRAGMA page_size").fetchone() == (4096,)
        assert old.counters([model_day_key(MODEL, DAY)])[model_day_key(MODEL, DAY)] == Counters(55, 0)
        old.close()

    def test_a_ledger_made_before_endpoint_ids_opens_and_keeps_them(self, tmp_path: Path) -> None:
        """A ledger file of the same schema made before the endpoints table existed opens, keeps its data and
        gets the table: no migration step, no version change (older quotawrap still opens it)."""
        path = tmp_path / "ledger.sqlite3"
        with sqlite3.connect(path) as conn:
            conn.executescript(_SCHEMA + f"INSERT INTO meta VALUES ('schema', '{SCHEMA_VERSION}');")
            conn.execute("DROP TABLE endpoints")
            conn.execute("INSERT INTO counters VALUES (?, 40)", (model_day_key(MODEL, DAY),))
        conn.close()
        ledger = SQLiteLedger(path)
        assert ledger.endpoint_models() == {}
        ledger.put_endpoint_models({"ep-20250101123456-abcde": MODEL})
        assert ledger.endpoint_models() == {"ep-20250101123456-abcde": MODEL}
        assert ledger.counters([model_day_key(MODEL, DAY)])[model_day_key(MODEL, DAY)] == Counters(40, 0)
        ledger.close()
        with sqlite3.connect(path) as conn:
            assert conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone() == (SCHEMA_VERSION,)

    @pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
    def test_concurrent_first_opens(self, tmp_path: Path) -> None:
        """Processes racing to create one new ledger all succeed: none sees tables without the schema mark."""
        context = multiprocessing.get_context("fork")
        for round_ in range(4):
            path = tmp_path / f"ledger-{round_}.sqlite3"
            results = context.Queue()
            start_at = time.time() + 0.2
            openers = [context.Process(target=_open_at, args=(path, start_at, results)) for _ in range(12)]
            for opener in openers:
                opener.start()
            outcomes = [results.get(timeout=60) for _ in openers]
            for opener in openers:
                opener.join()
            assert outcomes == ["ok"] * len(openers)


def _open_and_report(path: Path, results: Any) -> None:
    """In a forked process: open the ledger and take a hold, report ok or the error's class and text."""
    try:
        SQLiteLedger(path).reserve(_hold(), _no_limits)  # type: ignore[arg-type]
        results.put("ok")
    except Exception as exc:
        results.put(f"{type(exc).__name__}: {exc}")


@pytest.fixture
def check_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """An open ledger checks its file on every call instead of once a second."""
    monkeypatch.setattr("quotawrap.ledger.sqlite.ledger.FILE_CHECK_S", 0.0)


class TestTruncatedOrReplaced:
    def test_empty_file_is_refused_not_adopted(self, tmp_path: Path) -> None:
        """A zero-byte ledger file (a ledger truncated while no one had it open) is StoreCorrupt, stays empty."""
        path = tmp_path / "ledger.sqlite3"
        path.touch(mode=0o600)
        _assert_refused_untouched(path, "empty")

    @pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
    def test_truncated_under_an_open_ledger_fails_new_openers_at_once(self, tmp_path: Path) -> None:
        """Truncated to 0 bytes while another ledger holds its WAL open, a new opener is refused
        (it used to wait on the busy lock, a minute per retry, a hundred retries)."""
        path = tmp_path / "ledger.sqlite3"
        running = SQLiteLedger(path)
        running.reserve(_hold(), _no_limits)  # type: ignore[arg-type]
        os.truncate(path, 0)
        results = multiprocessing.get_context("fork").Queue()
        opener = multiprocessing.get_context("fork").Process(target=_open_and_report, args=(path, results))
        opener.start()
        outcome = results.get(timeout=60)  # a hang fails here instead of holding the suite
        opener.join()
        assert outcome.startswith("StoreCorrupt") and "empty" in outcome
        assert path.stat().st_size == 0
        running.close()

    def test_truncated_while_in_use(self, tmp_path: Path, check_every_call: None) -> None:
        """A ledger truncated under a running process fails its next call with StoreCorrupt (SQLite
        would go on writing into its WAL) and is not rebuilt."""
        path = tmp_path / "ledger.sqlite3"
        ledger = SQLiteLedger(path)
        held = ledger.reserve(_hold(), _no_limits)  # type: ignore[arg-type]
        os.truncate(path, 0)
        with pytest.raises(StoreCorrupt, match="truncated"):
            ledger.settle(held.hold_id, Usage(1, 1, 2))
        with pytest.raises(StoreCorrupt):
            ledger.reserve(_hold(), _no_limits)  # type: ignore[arg-type]
        assert path.stat().st_size == 0
        ledger.close()

    def test_replaced_while_in_use(self, tmp_path: Path, check_every_call: None) -> None:
        """A ledger file replaced by another (renamed over it) fails the running process's next call:
        it would otherwise keep counting in the old, unlinked file that no other process sees."""
        path, other = tmp_path / "ledger.sqlite3", tmp_path / "other.sqlite3"
        ledger = SQLiteLedger(path)
        ledger.reserve(_hold(), _no_limits)  # type: ignore[arg-type]
        SQLiteLedger(other).close()
        before = other.read_bytes()
        os.replace(other, path)
        with pytest.raises(StoreCorrupt, match="replaced"):
            ledger.reserve(_hold(), _no_limits)  # type: ignore[arg-type]
        assert path.read_bytes() == before
        ledger.close()

    def test_deleted_while_in_use(self, tmp_path: Path, check_every_call: None) -> None:
        """A ledger file deleted under a running process fails its next call instead of counting in a ghost."""
        path = tmp_path / "ledger.sqlite3"
        ledger = SQLiteLedger(path)
        ledger.reserve(_hold(), _no_limits)  # type: ignore[arg-type]
        path.unlink()
        with pytest.raises(StoreCorrupt, match="gone"):
            ledger.reserve(_hold(), _no_limits)  # type: ignore[arg-type]
        ledger.close()

    def test_symlink_is_refused(self, tmp_path: Path) -> None:
        """A ledger path that is a symlink is refused, and the file it points to is left as it was."""
        real, link = tmp_path / "real.sqlite3", tmp_path / "ledger.sqlite3"
        SQLiteLedger(real).close()
        before = real.read_bytes()
        link.symlink_to(real)
        with pytest.raises(StoreError, match="symlink"):
            SQLiteLedger(link)
        assert real.read_bytes() == before

    def test_dangling_symlink_is_refused(self, tmp_path: Path) -> None:
        """A symlink to nowhere is not followed to create a ledger where it points."""
        target, link = tmp_path / "elsewhere.sqlite3", tmp_path / "ledger.sqlite3"
        link.symlink_to(target)
        with pytest.raises(StoreError, match="symlink"):
            SQLiteLedger(link)
        assert not target.exists()


class TestForkSafety:
    @pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
    def test_child_settles_on_its_own_connection(self, tmp_path: Path) -> None:
        """Reserve in the parent, fork, settle in the child on a fresh connection; the parent sees it."""
        ledger = SQLiteLedger(tmp_path / "ledger.sqlite3")
        decision = ledger.reserve(_hold(reserve=500), _no_limits)  # type: ignore[arg-type]
        parent_conn = ledger._conn()
        pid = os.fork()
        if pid == 0:  # the child: no pytest here, only an exit code
            code = 1
            try:
                ledger.settle(decision.hold_id, Usage(40, 2, 42))
                code = 0 if ledger._conn() is not parent_conn else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        counters = ledger.counters([model_day_key(MODEL, DAY)])[model_day_key(MODEL, DAY)]
        assert (counters.settled, counters.in_flight) == (42, 0)
        assert ledger._conn() is parent_conn  # the parent's own connection is unharmed and still used
        again = ledger.reserve(_hold(reserve=7), _no_limits)  # type: ignore[arg-type]
        assert again.held
        ledger.close()


class TestNoApiKeyStored:
    def test_only_a_fingerprint_reaches_the_file(self, tmp_path: Path) -> None:
        """The Authorization header's key never touches the disk; a short fingerprint identifies it."""
        secret = "sk-ark-" + "7f3a9c" * 6
        store = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
        guard = Guard(Settings(store=store, base_url=("http://testserver/api/v3",)))
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9})
        call = guard.begin(
            "POST",
            "http://testserver/api/v3/chat/completions",
            {"authorization": f"Bearer {secret}"},
            body.encode(),
        )
        assert call is not None and call.blocked is None
        call.response_started(200, {"content-type": "application/json"})
        call.feed(json.dumps({"usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}).encode())
        call.finish()
        fingerprint = "sha256:" + hashlib.sha256(secret.encode()).hexdigest()[:16]
        path = tmp_path / "ledger.sqlite3"
        files = [path, Path(f"{path}-wal"), Path(f"{path}-shm")]
        raw = b"".join(name.read_bytes() for name in files if name.exists())
        assert secret.encode() not in raw
        assert secret[7:].encode() not in raw  # not even without its prefix
        assert fingerprint.encode() in raw
        with sqlite3.connect(path) as conn:
            assert conn.execute("SELECT key_fingerprint, state FROM calls").fetchall() == [(fingerprint, "settled")]

    def test_no_header_no_fingerprint(self, tmp_path: Path) -> None:
        """A call without a key records none (its hold is in flight: a row of holds)."""
        store = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
        guard = Guard(Settings(store=store, base_url=("http://testserver/api/v3",)))
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
        call = guard.begin("POST", "http://testserver/api/v3/chat/completions", {}, body)
        assert call is not None and call.blocked is None
        with sqlite3.connect(tmp_path / "ledger.sqlite3") as conn:
            assert conn.execute("SELECT key_fingerprint FROM holds").fetchall() == [(None,)]


class TestThreadsOfOneProcess:
    def test_a_thread_waits_for_another_threads_transaction_without_the_busy_handler(self, tmp_path: Path) -> None:
        """Threads of one process queue on an in-process lock, woken at the other's commit: the reserve
        below would fail at once with "database is locked" if it met SQLite's busy handler (timeout 0
        here), and with the busy handler's default it would sleep a whole millisecond and more."""
        import threading

        ledger = SQLiteLedger(tmp_path / "ledger.sqlite3")
        inside, results = threading.Event(), []

        def hold_the_write_lock() -> None:
            with ledger._write("test"):
                inside.set()
                time.sleep(0.2)  # the other thread asks meanwhile

        def reserve_without_busy_handler() -> None:
            ledger._conn().execute("PRAGMA busy_timeout=0")
            inside.wait()
            results.append(ledger.reserve(_hold(), _no_limits).held)

        threads = [threading.Thread(target=hold_the_write_lock), threading.Thread(target=reserve_without_busy_handler)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert results == [True]
        ledger.close()


class TestCheckpointsLeftToTheWrapper:
    """A guarded child whose settles the wrapper lands leaves the WAL's checkpoints to the wrapper's commits,
    so no reserve's COMMIT copies and syncs the WAL on the caller's path."""

    @staticmethod
    def _wal_pages_after_calls(path: Path, *, leave: bool) -> int:
        from tests.unit.test_ledger_contract import limits, request

        ledger = SQLiteLedger(path)
        if leave:
            ledger.leave_checkpoints()
        for _ in range(600):  # some 4,000 pages of WAL: well past SQLite's checkpoint at 1,000
            hold = ledger.reserve(request(100), limits(run_cap=10**9)).hold_id
            ledger.release(hold)
        page = int(ledger._conn().execute("PRAGMA page_size").fetchone()[0])
        pages = Path(f"{path}-wal").stat().st_size // page  # before close(), which checkpoints and removes it
        ledger.close()
        return pages

    def test_a_leaving_ledger_lets_the_wal_grow_past_sqlites_checkpoint(self, tmp_path: Path) -> None:
        own = self._wal_pages_after_calls(tmp_path / "own.sqlite3", leave=False)
        left = self._wal_pages_after_calls(tmp_path / "left.sqlite3", leave=True)
        assert own < 1_500 < 2_500 < left, (own, left)  # checkpointed and restarted, against never

    def test_a_guarded_childs_guard_leaves_them_only_under_a_wrapper(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from quotawrap.ledger.sqlite.ledger import BACKSTOP_CHECKPOINT_PAGES
        from quotawrap.settling.handoff import SOCKET_VARIABLE

        store = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
        monkeypatch.delenv(SOCKET_VARIABLE, raising=False)
        alone = Guard(Settings(store=store), background_settle=True).ledger
        monkeypatch.setenv(SOCKET_VARIABLE, str(tmp_path / "settle.sock"))
        relayed = Guard(Settings(store=store), background_settle=True).ledger
        in_process = Guard(Settings(store=store)).ledger

        def pages(ledger: object) -> int:
            assert isinstance(ledger, SQLiteLedger)
            return int(ledger._conn().execute("PRAGMA wal_autocheckpoint").fetchone()[0])

        assert pages(relayed) == BACKSTOP_CHECKPOINT_PAGES
        assert pages(alone) == pages(in_process) == 1000


_RUNS, _MODELS, _DAYS = ("run-1", "run-2"), (MODEL, "deepseek-v4-flash"), (DAY, "2026-05-02")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    holds=st.lists(
        st.tuples(
            st.sampled_from(_RUNS),
            st.sampled_from(_MODELS),
            st.sampled_from(_DAYS),
            st.integers(0, 10**6),
            st.integers(0, 10**6),
            st.sampled_from(["open", "settle", "release", "charge"]),
        ),
        max_size=12,
    )
)
def test_what_is_in_flight_is_what_the_open_holds_reserved(tmp_path: Path, holds: list[Any]) -> None:
    """In flight is summed from holds (sqlite_reserve.IN_FLIGHT) in two forms, the reserve's one read and
    ``counters``; on generated holds, some settled, released or charged, both say what the holds still open
    reserved, per run, run cost and model-day, and the settled what the others were charged."""
    from quotawrap.ledger.scopes import scope_keys
    from quotawrap.ledger.sqlite.reserve import read_for_reserve

    with tempfile.TemporaryDirectory(dir=tmp_path) as directory:
        ledger = SQLiteLedger(Path(directory) / "ledger.sqlite3")
        open_by: dict[str, int] = {}
        settled_by: dict[str, int] = {}
        for run_id, model, day, reserve, cost, end in holds:
            hold = _hold(reserve, run_id=run_id, model=model, day=day, reserve_cost=cost)
            assert ledger.reserve(hold, _no_limits).held  # type: ignore[arg-type]
            keys = scope_keys(run_id, model, day)
            amounts = {"run": reserve, "model_day": reserve, "run_cost": cost}
            if end == "open":
                for scope, key in keys.items():
                    open_by[key] = open_by.get(key, 0) + amounts[scope]
                continue
            if end == "settle":
                ledger.settle(hold.hold_id, Usage(1, 2, 3), cost=5)
                amounts = {"run": 3, "model_day": 3, "run_cost": 5}
            elif end == "release":
                ledger.release(hold.hold_id)
                amounts = {"run": 0, "model_day": 0, "run_cost": 0}
            else:  # no usage: the whole hold is charged (unresolved)
                ledger.settle(hold.hold_id, None)
            for scope, key in keys.items():
                settled_by[key] = settled_by.get(key, 0) + amounts[scope]
        conn = ledger._conn()
        for run_id in _RUNS:
            for model in _MODELS:
                for day in _DAYS:
                    keys = scope_keys(run_id, model, day)
                    expected = {s: Counters(settled_by.get(k, 0), open_by.get(k, 0)) for s, k in keys.items()}
                    with conn:
                        read, _, _, _ = read_for_reserve(conn, keys, (run_id, model, day), True)
                    assert read == expected
                    assert ledger.counters(list(keys.values())) == {keys[s]: c for s, c in expected.items()}
        ledger.close()


def test_hold_ids_are_led_by_the_time_they_were_made_and_never_repeat() -> None:
    """A batch of settles adds its calls at the end of the calls id index only if the ids of calls made one after
    another sort next to each other (new_hold_id); the random rest keeps the ids of threads at once apart."""
    made: list[list[str]] = [[] for _ in range(4)]

    def make(into: list[str]) -> None:
        for _ in range(500):
            into.append(new_hold_id())

    threads = [threading.Thread(target=make, args=(into,)) for into in made]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every = [hold_id for ids in made for hold_id in ids]
    assert len(set(every)) == len(every)
    assert all(len(hold_id) == 32 and set(hold_id) <= set("0123456789abcdef") for hold_id in every)
    for ids in made:  # in each thread, in the order made (to the microsecond: ids of one microsecond may swap)
        assert [hold_id[:13] for hold_id in ids] == sorted(hold_id[:13] for hold_id in ids)
    assert abs(int(every[0][:13], 16) / 1e6 - time.time()) < 60
