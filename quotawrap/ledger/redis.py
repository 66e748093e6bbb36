"""The shared ledger: Redis (single node, TLS, unix socket or Cluster), one Lua script per change.

Same seam and same semantics as :mod:`quotawrap.ledger.sqlite`; ``docs/redis.md`` documents
the key schema. The shape of the design:

* limits are computed in Python by ``limits_for(snapshot)``, then a Lua script evaluates exactly
  ``quota.verdict``'s rule on the server and takes the hold in the same step;
* a hold lives as a small hash in its model-day's slot (``{qw:md:<day>:<model>}``), and is
  deleted once settled or released, so the per-call state is bounded by the open holds;
  per-call history goes to a capped stream, totals to per-run hashes;
* every transition is state based (``held -> settled`` applies ``-reserved`` in flight and
  ``+actual`` settled once, judged from the stored state), so a retried settle never counts twice;
* on single-node Redis one script touches the run and the model-day slots at once: fully atomic.
  On Cluster those are two slots, so a reserve takes the run hold first, then the model-day hold,
  and gives the run hold back if the model-day refused (never over, at worst briefly over-held);
* usage recorded by the LiteLLM limiter under ``daily_usage:{date}:{model}:{hash}`` counts towards
  the model-day's settled usage, and ours is written there under our own hash.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.resources
import json
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import datetime, timedelta
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from .. import quota
from .._errors import ConfigError, StoreError
from ..quota import BEIJING, Counters, Limit, Package, Snapshot, Verdict, beijing_day
from ..usage import Usage
from .base import CallRecord, Decision, HoldRequest, LimitsFor, ModelTotals, RunRecord, RunTotals, pid_alive
from .scopes import ModelDay, Run, RunCost, parse_counter_key

__all__ = ["RedisLedger", "RedisOptions"]

_T = TypeVar("_T")

DAY_S = 86_400
OWN_DAILY_USAGE_TTL_S = 48 * 3600  # the LiteLLM limiter's TTL for daily_usage keys (seed §6.1)
THEIR_SNAPSHOT_TTL_S = 24 * 3600  # the LiteLLM sync thread writes its snapshot keys with 24h (seed §7.5)
OUR_SNAPSHOT_TTL_S = 48 * 3600
BLOCKED_MARK_TTL_S = 60  # long enough for a retried reserve to find its first answer
SNAPSHOT_REUSE_S = 1.0  # a process re-reads the balance snapshot at least this often (the script checks it anyway)
KEY_CACHE_MAX = 4096  # (day, model, run) key tuples a process keeps before starting afresh
SYNC_HISTORY_MAX = 1000
MAX_RUNS_INDEXED = 10_000
ACTIVE_KEEP_S = 3 * DAY_S
FINAL_STATES = ("settled", "released", "gone")


# ------------------------------------------------------------------------------------------- Lua

_WITH_LIB = ("reserve_one", "run_gate", "md_reserve", "run_apply", "transition_one", "md_transition")


def _lua(name: str) -> str:
    return (importlib.resources.files(__package__) / "redis_lua" / f"{name}.lua").read_text()


def _sources() -> dict[str, str]:
    lib = _lua("lib")
    return {name: (lib + _lua(name) if name in _WITH_LIB else _lua(name)) for name in (*_WITH_LIB, "lease", "unlease")}


def _lease_ttl(ttl_s: float) -> int:
    return int(max(ttl_s, 0)) + 3600


def _optional_int(text: str | None) -> int | None:
    return None if text in (None, "") else int(float(text or 0))


def _optional_float(text: str | None) -> float | None:
    return None if text in (None, "") else float(text or 0)


def _record(model: str, day: str, f: Mapping[str, str]) -> CallRecord:
    """A CallRecord from an audit stream entry or an open hold's hash."""
    state = f.get("state") or "held"
    return CallRecord(
        id=f["id"],
        run_id=f.get("run") or "",
        model=model,
        day=day,
        endpoint=f.get("endpoint") or "",
        state=state,  # type: ignore[arg-type]
        reserved=_optional_int(f.get("reserved")) or 0,
        charged=_optional_int(f.get("charged")) or 0,
        reserved_cost=_optional_int(f.get("reserved_cost")) or 0,
        charged_cost=_optional_int(f.get("charged_cost")) or 0,
        prompt_tokens=_optional_int(f.get("prompt")),
        completion_tokens=_optional_int(f.get("completion")),
        reasoning_tokens=_optional_int(f.get("reasoning")),
        cached_tokens=_optional_int(f.get("cached")),
        overshoot=f.get("overshoot") == "1",
        would_block=f.get("would_block") == "1",
        blocked_by=f.get("blocked_by") or None,
        key_fingerprint=f.get("kf") or None,
        tags=json.loads(f["tags"]) if f.get("tags") else {},
        started_at=_optional_float(f.get("started")) or 0.0,
        ended_at=_optional_float(f.get("ended")),
        latency_s=_optional_float(f.get("latency")),
        pid=_optional_int(f.get("pid")) or 0,
        host=f.get("host") or "",
    )


# ----------------------------------------------------------------------------------- options


@dataclass(frozen=True)
class RedisOptions:
    """Settings of a Redis ledger; each may be given as a query parameter of the store URL."""

    prefix: str = "qw"  # our own keys: {qw:md:...}, {qw:run:...}, qw:meta, ...
    daily_usage_prefix: str = "daily_usage"  # the LiteLLM limiter's daily counters
    snapshot_prefix: str = "limit:dynamic:volcengine"  # the LiteLLM limiter's sync snapshot
    date_format: str = "%Y-%m-%d"  # the Beijing date inside daily_usage keys
    hash: str = "quotawrap"  # our own {hash} in daily_usage:{date}:{model}:{hash}
    audit_max: int = 10_000  # per model-day audit stream length (approximate, XADD MAXLEN ~)
    foreign_refresh_ms: int = 1000  # how often the set of foreign daily_usage keys is re-scanned
    run_ttl_s: int = 7 * DAY_S  # how long a run's counters and holds survive its last call
    cluster: bool | None = None  # None: ask the server
    retries: int = 2  # retries of an idempotent command after a connection error
    socket_timeout_s: float = 5.0
    connect_timeout_s: float = 2.0

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


_BOOL = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def _parse_option(name: str, raw: str, url: str) -> Any:
    default = getattr(RedisOptions(), name)
    try:
        if name == "cluster":
            return _BOOL[raw.lower()] if raw.lower() != "auto" else None
        if isinstance(default, bool):
            return _BOOL[raw.lower()]
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"store URL {_redact(url)}: bad value {raw!r} for {name}") from exc
    return raw


def split_url(url: str) -> tuple[str, dict[str, Any]]:
    """(the URL redis-py should see, our options taken out of its query string)."""
    parts = urlsplit(url)
    ours: dict[str, Any] = {}
    theirs: list[tuple[str, str]] = []
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key in RedisOptions.names():
            ours[key] = _parse_option(key, value, url)
        else:
            theirs.append((key, value))
    return urlunsplit(parts._replace(query=urlencode(theirs))), ours


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


# ------------------------------------------------------------------------------- small helpers


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _int(value: Any) -> int:
    text = _text(value)
    return int(float(text)) if text else 0


@functools.lru_cache(maxsize=64)
def _midnight_after(day: str) -> float | None:
    """The Unix time of the Beijing midnight that ends ``day``; None for an unknown format.

    Cached: every reserve and settle asks, and strptime costs more than the rest of the key math.
    """
    try:
        start = datetime.strptime(day, "%Y-%m-%d").replace(tzinfo=BEIJING)
    except ValueError:
        return None
    return (start + timedelta(days=1)).timestamp()


def _day_end(day: str) -> float:
    """The Unix time of the Beijing midnight that ends ``day`` (now + 2 days for an unknown format)."""
    end = _midnight_after(day)
    return time.time() + 2 * DAY_S if end is None else end


def _limit_args(ordered: Sequence[Limit]) -> list[list[Any]]:
    """The limits as lib.lua's blocking() reads them, in quota.ordered's order."""
    return [[limit.scope, limit.kind, int(limit.cap), limit.name] for limit in ordered]


@dataclass(frozen=True)
class _Loc:
    day: str
    model: str
    run_id: str


@dataclass
class _Foreign:
    names: list[str]
    scanned_at: float
    last_sum: int = 0


# ----------------------------------------------------------------------------------- the ledger


class RedisLedger:
    """Ledger in Redis; safe across threads, processes and hosts. Connects on first use."""

    def __init__(self, url: str, *, clock: Callable[[], float] = time.time, **options: Any) -> None:
        self.url = url
        self._clock = clock  # timestamps of records and the usage series (a simulated day runs fast)
        self._store = _redact(url)
        self._client_url, from_url = split_url(url)
        unknown = set(options) - set(RedisOptions.names())
        if unknown:
            raise ConfigError(f"unknown Redis ledger option(s): {', '.join(sorted(unknown))}")
        self.options = RedisOptions(**{**from_url, **options})
        self._host = socket.gethostname()
        self._lock = threading.Lock()
        self._client: Any = None
        self._cluster = False
        self._epoch: str | None = None
        self._scripts: dict[str, Any] = {}
        self._locs: dict[str, _Loc] = {}
        self._foreign: dict[tuple[str, str], _Foreign] = {}
        self._snapshots: dict[str, tuple[float, str, Snapshot | None]] = {}
        self._active_seen: dict[str, float] = {}
        self._usage_dates: dict[str, str] = {}
        self._key_cache: dict[tuple[str, str, str, str], tuple[str, ...]] = {}
        self._local = threading.local()  # this thread's connection for the script calls
        self._connections: weakref.WeakSet[Any] = weakref.WeakSet()

    # -- keys ----------------------------------------------------------------------------------

    def _md(self, day: str, model: str) -> str:
        return f"{{{self.options.prefix}:md:{day}:{model}}}"

    def _md_keys(self, day: str, model: str, run_id: str) -> dict[str, str]:
        tag = self._md(day, model)
        return {
            "c": f"{tag}:c",
            "open": f"{tag}:open",
            "pids": f"{tag}:pids",
            "rt": f"{tag}:rt:{run_id}",
            "series": f"{tag}:series",
            "audit": f"{tag}:audit",
            "sync": f"{tag}:sync",
        }

    def _cached_keys(self, kind: str, day: str, model: str, run_id: str) -> tuple[str, ...]:
        """The keys a script call needs besides the call's own, the same for a whole run on a model-day.

        Built once per process: a guarded call otherwise formats a dozen key names twice.
        """
        cache_key = (kind, day, model, run_id)
        keys = self._key_cache.get(cache_key)
        if keys is not None:
            return keys
        mk, rk = self._md_keys(day, model, run_id), self._run_keys(run_id)
        if kind == "reserve":  # KEYS[3..14] of the reserve script
            keys = (
                self._meta_key(),
                self._snap_key(model),
                *self._their_snapshot_keys(model),
                rk["c"],
                rk["h"],
                rk["mds"],
                mk["c"],
                mk["open"],
                mk["pids"],
                mk["rt"],
                mk["audit"],
            )
        else:  # KEYS[2..10] of the transition script
            keys = (
                mk["c"],
                mk["open"],
                mk["pids"],
                mk["rt"],
                mk["series"],
                mk["audit"],
                rk["c"],
                rk["h"],
                self.own_daily_usage_key(model, day),
            )
        if len(self._key_cache) >= KEY_CACHE_MAX:
            self._key_cache.clear()
        self._key_cache[cache_key] = keys
        return keys

    def _hold_key(self, day: str, model: str, hold_id: str) -> str:
        return f"{self._md(day, model)}:h:{hold_id}"

    def _run_keys(self, run_id: str) -> dict[str, str]:
        tag = f"{{{self.options.prefix}:run:{run_id}}}"
        return {"c": f"{tag}:c", "h": f"{tag}:h", "mds": f"{tag}:mds"}

    def _meta_key(self) -> str:
        return f"{self.options.prefix}:meta"

    def _active_key(self) -> str:
        return f"{self.options.prefix}:active"

    def _models_key(self) -> str:
        return f"{self.options.prefix}:models"

    def _runs_key(self) -> str:
        return f"{self.options.prefix}:runs"

    def _run_info_key(self, run_id: str) -> str:
        return f"{{{self.options.prefix}:run:{run_id}}}:info"

    def _packages_key(self, model: str) -> str:
        return f"{self.options.prefix}:packages:{model}"

    def _lease_key(self, name: str) -> str:
        return f"{self.options.prefix}:lease:{name}"

    def _loc_key(self, hold_id: str) -> str:
        return f"{self.options.prefix}:loc:{hold_id}"

    def _snap_key(self, model: str) -> str:
        return f"{self.options.prefix}:snap:{model}"

    def _their_snapshot_keys(self, model: str) -> tuple[str, str]:
        prefix = self.options.snapshot_prefix
        return f"{prefix}:balance_at_sync:{model}", f"{prefix}:usage_at_sync:{model}"

    def _usage_date(self, day: str) -> str:
        cached = self._usage_dates.get(day)
        if cached is None:
            try:
                cached = datetime.strptime(day, "%Y-%m-%d").strftime(self.options.date_format)
            except ValueError:
                cached = day
            if len(self._usage_dates) > 64:  # a long-lived process sees one new day a day
                self._usage_dates.clear()
            self._usage_dates[day] = cached
        return cached

    def own_daily_usage_key(self, model: str, day: str) -> str:
        """Where our settled usage is mirrored for the LiteLLM limiter."""
        return f"{self.options.daily_usage_prefix}:{self._usage_date(day)}:{model}:{self.options.hash}"

    def _expire_at(self, day: str, expires_at: float = 0.0) -> int:
        """Model-day keys live two days past the later of the day's end and now (late settles)."""
        return int(max(_day_end(day), expires_at, time.time()) + 2 * DAY_S)

    # -- connection and errors -----------------------------------------------------------------

    def _store_error(self, action: str, exc: BaseException) -> StoreError | None:
        """The StoreError a redis or socket error becomes; None for anything else (it passes unchanged)."""
        import redis

        if isinstance(exc, StoreError):
            return None
        if isinstance(exc, redis.exceptions.RedisError):
            return StoreError(f"Redis ledger {action} failed: {type(exc).__name__}: {exc}", store=self._store)
        if isinstance(exc, OSError):  # raised by some socket paths before redis-py wraps them
            return StoreError(f"Redis ledger {action} failed: {exc}", store=self._store)
        return None

    @contextlib.contextmanager
    def _errors(self, action: str) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            error = self._store_error(action, exc)
            if error is None:
                raise
            raise error from exc

    def _retrying(self, action: str, fn: Callable[[], _T]) -> _T:
        """Run an idempotent step, again after a connection error (redis-py reconnects by itself)."""
        try:  # the common case pays for one try block, not for a context manager per call
            return fn()
        except Exception as exc:
            return self._retry_after(action, fn, exc)

    def _retry_after(self, action: str, fn: Callable[[], _T], exc: Exception) -> _T:
        import redis

        attempt = 0
        while True:
            error = self._store_error(action, exc)
            if error is None:
                raise exc
            transient = isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError))
            if not transient or attempt >= self.options.retries:
                raise error from exc
            attempt += 1
            time.sleep(0.05 * attempt)
            try:
                return fn()
            except Exception as again:
                exc = again

    def _connect(self) -> Any:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        common: dict[str, Any] = {
            "socket_timeout": self.options.socket_timeout_s,
            "socket_connect_timeout": self.options.connect_timeout_s,
            # our own retry loop decides what may be repeated
            "retry": Retry(NoBackoff(), 0),
        }
        cluster = self.options.cluster
        if cluster is None:
            if self._client_url.startswith("unix://"):
                cluster = False
            else:
                probe = redis.Redis.from_url(self._client_url, **common)
                try:
                    cluster = bool(probe.info("cluster").get("cluster_enabled"))
                finally:
                    probe.close()
        if cluster:
            from redis.cluster import RedisCluster

            return RedisCluster.from_url(self._client_url, **common), True
        return redis.Redis.from_url(self._client_url, **common), False

    def _redis(self) -> Any:
        """The client, connected and checked (meta epoch, our hash) on first use."""
        if self._client is not None and self._epoch is not None:
            return self._client
        with self._lock:
            if self._client is None:
                with self._errors("connect"):
                    self._client, self._cluster = self._connect()
                sources = _sources()
                self._scripts = {name: self._client.register_script(src) for name, src in sources.items()}
            if self._epoch is None:
                self._retrying("open", self._load_meta)
        return self._client

    def _load_meta(self) -> None:
        meta = self._meta_key()
        client = self._client
        client.hsetnx(meta, "epoch", uuid.uuid4().hex)
        client.hsetnx(meta, "hash", self.options.hash)
        client.hsetnx(meta, "created_at", repr(time.time()))
        values = client.hgetall(meta)
        stored = {_text(k): _text(v) for k, v in values.items()}
        if stored.get("hash") != self.options.hash:
            raise ConfigError(
                f"store {self._store} is used by quotawrap with daily_usage hash {stored.get('hash')!r}, not"
                f" {self.options.hash!r}: two hashes under one prefix would count each other's usage twice"
            )
        self._epoch = stored["epoch"]

    def _lost(self, day: str) -> StoreError:
        """The store came back empty (restart without persistence): mark the day, refuse to guess."""
        meta = self._meta_key()
        now = time.time()

        def mark() -> None:
            client = self._client
            client.hsetnx(meta, "epoch", uuid.uuid4().hex)
            client.hsetnx(meta, "hash", self.options.hash)
            client.hsetnx(meta, f"lost:{day}", repr(now))
            self._epoch = _text(client.hget(meta, "epoch"))

        self._retrying("mark lost", mark)
        return self._lost_error(day, now)

    def _lost_error(self, day: str, at: float) -> StoreError:
        when = datetime.fromtimestamp(at, BEIJING).strftime("%H:%M:%S")
        return StoreError(
            f"Redis lost quotawrap's counters (restarted without persistence?); detected at {when} Beijing."
            f" Today's ({day}) usage is unknown, so guarded calls are refused until Beijing midnight."
            f" Restore the counts, then clear the mark: HDEL {self._meta_key()} lost:{day}",
            store=self._store,
        )

    def _script(self, name: str) -> Any:
        self._redis()
        return self._scripts[name]

    def _connection(self) -> Any:
        """This thread's own connection for script calls (single node), opened on first use."""
        local = self._local
        conn = getattr(local, "conn", None)
        if conn is None or local.pid != os.getpid():  # never a connection inherited through fork()
            pool = self._client.connection_pool
            conn = pool.connection_class(**pool.connection_kwargs)  # same URL, TLS, timeouts as the pool's
            local.conn, local.pid = conn, os.getpid()
            with self._lock:
                self._connections.add(conn)
        return conn

    def _evalsha(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run a registered script on this thread's connection; after NOSCRIPT (a restart, SCRIPT FLUSH)
        load it again and run it once more, as redis-py's Script does.

        The reserve and the settle of every guarded call come here. Going around the pool skips its
        per-command bookkeeping (a poll() for stale data, locks, metrics), which cost the client more
        CPU than sending the command; instead a connection whose reply may be unread is closed.
        """
        from redis.exceptions import NoScriptError, ResponseError

        script = self._scripts[name]
        conn = self._connection()
        try:
            try:
                conn.send_command("EVALSHA", script.sha, len(keys), *keys, *args)
                return conn.read_response()
            except NoScriptError:
                conn.send_command("SCRIPT", "LOAD", script.script)
                script.sha = _text(conn.read_response())
                conn.send_command("EVALSHA", script.sha, len(keys), *keys, *args)
                return conn.read_response()
        except ResponseError:
            raise  # an error reply: the connection is still in step
        except BaseException:
            conn.disconnect()  # anything else may leave a reply unread; redis-py connects again on the next command
            raise

    # -- the LiteLLM limiter's daily_usage keys -------------------------------------------------

    def _foreign_names(self, model: str, day: str) -> list[str]:
        """The other writers' daily_usage keys of a model-day, re-scanned at most every refresh_ms."""
        key = (model, day)
        now = time.monotonic()
        cached = self._foreign.get(key)
        if cached is not None and now - cached.scanned_at < self.options.foreign_refresh_ms / 1000:
            return cached.names
        own = self.own_daily_usage_key(model, day)
        base = f"{self.options.daily_usage_prefix}:{self._usage_date(day)}:{model}:"
        client = self._redis()
        found = self._retrying(
            "scan", lambda: [_text(n) or "" for n in client.scan_iter(match=f"{_glob_escape(base)}*", count=1000)]
        )
        # a model named "m:x" has keys under "m:*" too: the hash is the last part, without a colon
        names = sorted(name for name in found if name != own and ":" not in name[len(base) :])
        last = cached.last_sum if cached is not None else 0
        self._foreign[key] = _Foreign(names, now, last)
        return names

    def _foreign_sum(self, model: str, day: str) -> int:
        names = self._foreign_names(model, day)
        total = 0
        if names:
            client = self._redis()
            values = client.mget_nonatomic(names) if self._cluster else client.mget(names)
            total = sum(_int(v) for v in values)
        self._foreign[(model, day)].last_sum = total
        return total

    def _last_foreign(self, model: str, day: str) -> int:
        cached = self._foreign.get((model, day))
        return cached.last_sum if cached is not None else 0

    # -- snapshots -----------------------------------------------------------------------------

    def _read_snapshot_raw(self, model: str) -> tuple[str, Snapshot | None]:
        """(fingerprint of the snapshot keys, the snapshot they give)."""
        client = self._redis()
        bal_key, usage_key = self._their_snapshot_keys(model)
        if self._cluster:
            ours = client.hgetall(self._snap_key(model))
            bal, usage = client.get(bal_key), client.get(usage_key)
            ttl = client.pttl(bal_key)
        else:
            pipe = client.pipeline(transaction=False)
            pipe.hgetall(self._snap_key(model))
            pipe.get(bal_key)
            pipe.get(usage_key)
            pipe.pttl(bal_key)
            ours, bal, usage, ttl = pipe.execute()
        record = {_text(k): _text(v) for k, v in ours.items()}
        fingerprint = f"{record.get('synced_at') or ''}|{_text(bal) or ''}|{_text(usage) or ''}"
        return fingerprint, _pick_snapshot(record, _text(bal), _text(usage), int(ttl or -1))

    def _snapshot_for_reserve(self, model: str, *, fresh: bool) -> tuple[str, Snapshot | None]:
        """(fingerprint, snapshot), read at most every SNAPSHOT_REUSE_S unless ``fresh``.

        Reusing it is safe: the reserve script compares the fingerprint with the stored keys and
        answers -1 when they changed, and the reserve then reads again with ``fresh``.
        """
        now = time.monotonic()
        cached = self._snapshots.get(model)
        if cached is None or fresh or now - cached[0] >= SNAPSHOT_REUSE_S:
            fingerprint, snapshot = self._retrying("read", lambda: self._read_snapshot_raw(model))
            cached = (now, fingerprint, snapshot)
            self._snapshots[model] = cached
        return cached[1], cached[2]

    # -- reserve -------------------------------------------------------------------------------

    def _reserve_args(self, request: HoldRequest, ordered: Sequence[Limit], expire_at: int) -> str:
        """The Lua reserve_args() record, as one JSON argument."""
        fields_ = {
            "hold_id": request.hold_id,
            "run": request.run_id,
            "reserve": int(request.reserve),
            "enforce": "1" if request.enforce else "0",
            "day": request.day,
            "model": request.model,
            "expires": repr(float(request.expires_at)),
            "pid": str(int(request.pid)),
            "host": request.host,
            "now": repr(self._clock()),
            "endpoint": request.endpoint,
            "key_fingerprint": request.key_fingerprint or "",
            "tags": json.dumps(dict(request.tags)) if request.tags else "",
            "expire_at": expire_at,
            "run_ttl": self.options.run_ttl_s,
            "audit_max": self.options.audit_max,
            "blocked_ttl": BLOCKED_MARK_TTL_S,
            "reserve_cost": int(request.reserve_cost),
            "limits": _limit_args(ordered),
        }
        return json.dumps(fields_, separators=(",", ":"))

    def reserve(self, request: HoldRequest, limits_for: LimitsFor) -> Decision:
        self._redis()
        if self._cluster:
            return self._reserve_cluster(request, limits_for)
        return self._reserve_one(request, limits_for)

    def _decision(
        self,
        request: HoldRequest,
        ordered: Sequence[Limit],
        blocking: int,
        md: Counters,
        run: Sequence[Any],
        held: bool,
    ) -> Decision:
        if held:
            self._locs[request.hold_id] = _Loc(request.day, request.model, request.run_id)
        result = Verdict(True) if blocking == 0 else Verdict(False, ordered[blocking - 1])
        tokens, cost = Counters(int(run[0]), int(run[1])), Counters(int(run[2]), int(run[3]))
        return Decision(request.hold_id, result, held, {"run": tokens, "model_day": md, "run_cost": cost})

    def _reserve_one(self, request: HoldRequest, limits_for: LimitsFor) -> Decision:
        """Single node: one script checks every limit and takes the hold in both slots."""
        day, model = request.day, request.model
        shared = self._cached_keys("reserve", day, model, request.run_id)
        own = (self._hold_key(day, model, request.hold_id), self._loc_key(request.hold_id))
        expire_at = self._expire_at(day, request.expires_at)
        self._touch_active(day, model)
        fresh = False
        for _ in range(5):
            fingerprint, snapshot = self._snapshot_for_reserve(model, fresh=fresh)
            ordered = quota.ordered(limits_for(snapshot))
            keys = [*own, *shared, *self._foreign_names(model, day)]
            args = (self._epoch, fingerprint, self._reserve_args(request, ordered, expire_at))
            result = self._retrying("reserve", lambda k=keys, a=args: self._evalsha("reserve_one", k, a))
            code = int(result[0])
            if code == -1:  # the snapshot changed since it was read: read it again
                fresh = True
                continue
            if code == -2:
                raise self._lost(request.day)
            if code == -3:
                raise self._lost_error(request.day, float(_text(result[1]) or 0))
            md = Counters(int(result[1]), int(result[2]))
            run = [result[4], result[5], result[7], result[8]]
            cached = self._foreign.get((request.model, request.day))
            if cached is not None:  # the usage series adds it to our own settled
                cached.last_sum = int(result[6])
            return self._decision(request, ordered, int(result[0]), md, run, bool(int(result[3])))
        raise StoreError("the balance snapshot kept changing while reserving; try again", store=self._store)

    def _check_meta(self, day: str) -> None:
        client = self._redis()
        epoch, lost = client.hmget(self._meta_key(), ["epoch", f"lost:{day}"])
        if _text(epoch) != self._epoch:
            raise self._lost(day)
        if lost is not None:
            raise self._lost_error(day, float(_text(lost) or 0))

    def _reserve_cluster(self, request: HoldRequest, limits_for: LimitsFor) -> Decision:
        """Cluster: run slot first (check the run limits, take the run hold), then the model-day slot.

        The model-day script re-evaluates the whole verdict on the run counters the gate saw, so
        the answer is quota.verdict's; if it refuses, the run hold is given back. Between the two
        steps the run hold is held but not yet used: other calls of the same run may be refused
        for it, never let through beyond the cap.
        """
        client = self._redis()
        rk = self._run_keys(request.run_id)
        mk = self._md_keys(request.day, request.model, request.run_id)
        expire_at = self._expire_at(request.day, request.expires_at)
        self._retrying("read", lambda: self._check_meta(request.day))
        _, snapshot = self._snapshot_for_reserve(request.model, fresh=True)
        ordered = quota.ordered(limits_for(snapshot))
        foreign = self._retrying("read", lambda: self._foreign_sum(request.model, request.day))
        args = [self._reserve_args(request, ordered, expire_at)]
        self._retrying(
            "reserve",
            lambda: client.set(
                self._loc_key(request.hold_id),
                f"{request.day}\t{request.model}\t{request.run_id}",
                exat=expire_at,
            ),
        )
        self._touch_active(request.day, request.model)
        gate = self._retrying(
            "reserve", lambda: self._scripts["run_gate"](keys=[rk["c"], rk["h"], rk["mds"]], args=args)
        )
        run, taken = [int(v) for v in gate[:4]], int(gate[4])
        md_keys = [
            mk["c"],
            mk["open"],
            mk["pids"],
            self._hold_key(request.day, request.model, request.hold_id),
            mk["rt"],
            mk["audit"],
        ]
        try:
            result = self._retrying(
                "reserve", lambda: self._scripts["md_reserve"](keys=md_keys, args=[*run, foreign, *args])
            )
        except StoreError:
            if taken:
                with contextlib.suppress(StoreError):
                    self._run_apply(request.run_id, request.hold_id, "gone", 0, 0)
            raise
        held = bool(int(result[3]))
        if not held:
            if taken:
                self._run_apply(request.run_id, request.hold_id, "gone", 0, 0)
            self._retrying("reserve", lambda: client.delete(self._loc_key(request.hold_id)))
        md = Counters(int(result[1]), int(result[2]))
        return self._decision(request, ordered, int(result[0]), md, run, held)

    def _run_apply(self, run_id: str, hold_id: str, target: str, actual: int, actual_cost: int) -> None:
        rk = self._run_keys(run_id)
        self._retrying(
            "settle",
            lambda: self._scripts["run_apply"](
                keys=[rk["c"], rk["h"]], args=[hold_id, target, actual, actual_cost, self.options.run_ttl_s]
            ),
        )

    def _touch_active(self, day: str, model: str) -> None:
        """Index the model-day (for reclaim_orphans) and the model (known_models), once a minute per process."""
        member = f"{day}\t{model}"
        now = time.time()
        if now - self._active_seen.get(member, 0.0) < 60:
            return
        client = self._redis()

        def index() -> None:
            client.zadd(self._active_key(), {member: now})
            client.sadd(self._models_key(), model)

        self._retrying("index", index)
        self._active_seen[member] = now

    # -- transitions ---------------------------------------------------------------------------

    def _locate(self, hold_id: str) -> _Loc | None:
        loc = self._locs.pop(hold_id, None)
        if loc is not None:
            return loc
        client = self._redis()
        raw = _text(self._retrying("read", lambda: client.get(self._loc_key(hold_id))))
        if raw is None:
            return None
        day, model, run_id = raw.split("\t", 2)
        return _Loc(day, model, run_id)

    def _transition(
        self,
        loc: _Loc,
        hold_id: str,
        mode: str,
        usage: Usage | None = None,
        latency_s: float | None = None,
        cost: int | None = None,
    ) -> tuple[bool, str]:
        """Apply settle/release/resolve to one hold. (changed, new state)."""
        self._redis()  # connected again if close() came between the reserve and this
        shared = self._cached_keys("transition", loc.day, loc.model, loc.run_id)
        hold_key = self._hold_key(loc.day, loc.model, hold_id)
        now = self._clock()
        fields_ = {
            "hold_id": hold_id,
            "mode": mode,
            "has_usage": "1" if usage is not None else "0",
            "total": usage.total_tokens if usage else 0,
            "prompt": usage.prompt_tokens if usage else 0,
            "completion": usage.completion_tokens if usage else 0,
            "reasoning": usage.reasoning_tokens if usage else 0,
            "cached": usage.cached_tokens if usage else 0,
            "latency": "" if latency_s is None else repr(float(latency_s)),
            "now": repr(now),
            "minute": int(now // 60),
            "expire_at": self._expire_at(loc.day),
            "audit_max": self.options.audit_max,
            "foreign": self._last_foreign(loc.model, loc.day),
            "run_ttl": self.options.run_ttl_s,
            "own_ttl": OWN_DAILY_USAGE_TTL_S,
            "cost": "" if cost is None else int(cost),
        }
        args = (json.dumps(fields_, separators=(",", ":")),)
        if not self._cluster:
            keys = [hold_key, *shared, self._loc_key(hold_id)]
            result = self._retrying(mode, lambda: self._evalsha("transition_one", keys, args))
            if not int(result[0]):
                return False, ""
            return True, _text(result[1]) or ""
        md_keys = [hold_key, *shared[:6]]
        own_key = shared[8]
        result = self._retrying(mode, lambda: self._scripts["md_transition"](keys=md_keys, args=args))
        if not int(result[0]):
            return False, ""
        target, actual, delta, actual_cost = _text(result[1]) or "", int(result[3]), int(result[4]), int(result[6])
        # Not atomic with the model-day step on Cluster: each is idempotent, and a lost step only
        # leaves the run's or the LiteLLM limiter's view short (docs/redis.md).
        self._run_apply(loc.run_id, hold_id, target, actual, actual_cost)
        client = self._client
        if delta:
            with self._errors(mode):
                pipe = client.pipeline(transaction=False)
                pipe.incrby(own_key, delta)
                pipe.expire(own_key, OWN_DAILY_USAGE_TTL_S)
                pipe.execute()
        if target != "unresolved":
            with contextlib.suppress(StoreError), self._errors(mode):
                client.delete(self._loc_key(hold_id))
        return True, target

    def settle(
        self, hold_id: str, usage: Usage | None, *, latency_s: float | None = None, cost: int | None = None
    ) -> None:
        """Charge actual usage and cost (micro-CNY; without usage or cost the reserved cost). Idempotent."""
        loc = self._locate(hold_id)
        if loc is not None:
            self._transition(loc, hold_id, "settle", usage, latency_s, cost)

    def release(self, hold_id: str) -> None:
        loc = self._locate(hold_id)
        if loc is not None:
            self._transition(loc, hold_id, "release")

    def resolve_run(self, run_id: str) -> int:
        client = self._redis()
        rk = self._run_keys(run_id)
        entries = self._retrying("read", lambda: client.hgetall(rk["h"]))
        resolved = 0
        for raw_id, raw in entries.items():
            hold_id = _text(raw_id) or ""
            state, _, _, _, _, day, model = (_text(raw) or "").split("\t", 6)
            if state != "held":
                continue
            loc = _Loc(day, model, run_id)
            self._locs.pop(hold_id, None)
            changed, _ = self._transition(loc, hold_id, "resolve")
            if changed:
                resolved += 1
            elif not self._retrying("read", lambda h=hold_id, d=day, m=model: client.exists(self._hold_key(d, m, h))):
                # the model-day never took it (a Cluster reserve cut short): nothing was sent
                self._run_apply(run_id, hold_id, "gone", 0, 0)
        return resolved

    def reclaim_orphans(self, now: float) -> int:
        client = self._redis()
        active_key = self._active_key()
        self._retrying("scan", lambda: client.zremrangebyscore(active_key, "-inf", now - ACTIVE_KEEP_S))
        members = [_text(m) or "" for m in self._retrying("scan", lambda: client.zrange(active_key, 0, -1))]
        reclaimed = 0
        for member in members:
            day, _, model = member.partition("\t")
            reclaimed += self._reclaim_model_day(day, model, now)
        return reclaimed

    def _reclaim_model_day(self, day: str, model: str, now: float) -> int:
        client = self._redis()
        tag = self._md(day, model)
        open_key, pids_key = f"{tag}:open", f"{tag}:pids"
        expired = [
            _text(h) or "" for h in self._retrying("scan", lambda: client.zrangebyscore(open_key, "-inf", f"({now!r}"))
        ]
        reclaimed = self._resolve_holds(day, model, expired)
        pids = self._retrying("scan", lambda: client.hgetall(pids_key))
        dead = set()
        for raw in pids:
            host, _, pid = (_text(raw) or "").rpartition("|")
            if host == self._host and pid.isdigit() and not pid_alive(int(pid)):
                dead.add(pid)
        if dead:
            open_ids = [_text(h) or "" for h in self._retrying("scan", lambda: client.zrange(open_key, 0, -1))]
            owners = self._hold_fields(day, model, open_ids, "host", "pid")
            mine = [h for h, (host, pid) in zip(open_ids, owners, strict=True) if host == self._host and pid in dead]
            reclaimed += self._resolve_holds(day, model, mine)
        return reclaimed

    def _hold_fields(self, day: str, model: str, hold_ids: Sequence[str], *names: str) -> list[tuple[str, ...]]:
        client = self._redis()

        def read() -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for hold_id in hold_ids:
                pipe.hmget(self._hold_key(day, model, hold_id), list(names))
            return pipe.execute()

        rows = self._retrying("scan", read) if hold_ids else []
        return [tuple(_text(v) or "" for v in row) for row in rows]

    def _resolve_holds(self, day: str, model: str, hold_ids: Sequence[str]) -> int:
        count = 0
        for hold_id, (run_id,) in zip(hold_ids, self._hold_fields(day, model, hold_ids, "run"), strict=True):
            if not run_id:
                continue
            changed, _ = self._transition(_Loc(day, model, run_id), hold_id, "resolve")
            count += changed
        return count

    # -- reads ---------------------------------------------------------------------------------

    def counters(self, keys: Sequence[str]) -> dict[str, Counters]:
        """Counters by base.run_key / run_cost_key / model_day_key; a model-day's settled includes
        the LiteLLM limiter's daily_usage of that model-day (what the verdict sees)."""
        client = self._redis()
        found: dict[str, Counters] = {}
        for key in keys:
            scope = parse_counter_key(key)
            if isinstance(scope, Run):
                fields_ = self._run_keys(scope.run_id)["c"], ["settled", "in_flight"]
                values = self._retrying("read", lambda f=fields_: client.hmget(*f))
                found[key] = Counters(_int(values[0]), _int(values[1]))
            elif isinstance(scope, RunCost):
                fields_ = self._run_keys(scope.run_id)["c"], ["cost_settled", "cost_in_flight"]
                values = self._retrying("read", lambda f=fields_: client.hmget(*f))
                found[key] = Counters(_int(values[0]), _int(values[1]))
            elif isinstance(scope, ModelDay):
                day, model = scope.day, scope.model
                values = self._retrying(
                    "read",
                    lambda d=day, m=model: client.hmget(f"{self._md(d, m)}:c", ["settled", "in_flight"]),
                )
                foreign = self._retrying("read", lambda d=day, m=model: self._foreign_sum(m, d))
                found[key] = Counters(_int(values[0]) + foreign, _int(values[1]))
            else:
                found[key] = Counters()
        return found

    def snapshot(self, model: str) -> Snapshot | None:
        self._redis()
        _, snapshot = self._retrying("read", lambda: self._read_snapshot_raw(model))
        return snapshot

    def put_snapshot(self, model: str, snapshot: Snapshot) -> None:
        """Our record, the sync history, and the LiteLLM limiter's two snapshot keys (TTL 24h)."""
        client = self._redis()
        record = {
            "balance": snapshot.balance,
            "usage_at_sync": snapshot.usage_at_sync,
            "lagged_usage": snapshot.lagged_usage,
            "synced_at": repr(float(snapshot.synced_at)),
            "day": snapshot.day,
            "source": snapshot.source,
        }
        bal_key, usage_key = self._their_snapshot_keys(model)
        sync_key = f"{self._md(snapshot.day, model)}:sync"
        entry = f"{snapshot.synced_at!r}\t{snapshot.balance}\t{snapshot.usage_at_sync}\t{snapshot.source}"

        def write() -> None:
            # their keys first: if we stop half-way the next read sees theirs newer, never a mix
            client.set(bal_key, snapshot.balance, ex=THEIR_SNAPSHOT_TTL_S)
            client.set(usage_key, snapshot.usage_at_sync, ex=THEIR_SNAPSHOT_TTL_S)
            pipe = client.pipeline(transaction=not self._cluster)
            pipe.delete(self._snap_key(model))
            pipe.hset(self._snap_key(model), mapping=record)
            pipe.expire(self._snap_key(model), OUR_SNAPSHOT_TTL_S)
            pipe.execute()
            pipe = client.pipeline(transaction=not self._cluster)
            pipe.rpush(sync_key, entry)
            pipe.ltrim(sync_key, -SYNC_HISTORY_MAX, -1)
            pipe.expireat(sync_key, self._expire_at(snapshot.day))
            pipe.execute()
            client.sadd(self._models_key(), model)

        self._retrying("sync", write)
        self._snapshots.pop(model, None)

    def usage_series(self, model: str, day: str) -> list[tuple[float, int]]:
        client = self._redis()
        raw = self._retrying("read", lambda: client.hgetall(f"{self._md(day, model)}:series"))
        return sorted((int(_text(m) or 0) * 60.0, _int(v)) for m, v in raw.items())

    def sync_history(self, model: str, day: str) -> list[tuple[float, int]]:
        client = self._redis()
        raw = self._retrying("read", lambda: client.lrange(f"{self._md(day, model)}:sync", 0, -1))
        points = []
        for item in raw:
            synced_at, balance, _ = (_text(item) or "").split("\t", 2)
            points.append((float(synced_at), int(balance)))
        return sorted(points)

    def run_totals(self, run_id: str) -> RunTotals:
        client = self._redis()
        members = self._retrying("read", lambda: client.smembers(self._run_keys(run_id)["mds"]))
        models: dict[str, ModelTotals] = {}
        for member in sorted(_text(m) or "" for m in members):
            day, _, model = member.partition("\t")
            raw = self._retrying("read", lambda d=day, m=model: client.hgetall(f"{self._md(d, m)}:rt:{run_id}"))
            if not raw:
                continue
            values = {_text(k): _int(v) for k, v in raw.items()}
            totals = ModelTotals(**{name: values.get(name, 0) for name in ModelTotals.__dataclass_fields__})
            models.setdefault(model, ModelTotals()).add(totals)
        return RunTotals(run_id, dict(sorted(models.items())))

    # -- records: calls, runs, packages, models, leases -----------------------------------------

    def call_records(
        self, *, since: float | None = None, until: float | None = None, run_id: str | None = None
    ) -> list[CallRecord]:
        """What Redis still keeps: the capped audit streams and the open holds of the indexed model-days."""
        client = self._redis()
        members = [_text(m) or "" for m in self._retrying("read", lambda: client.zrange(self._active_key(), 0, -1))]
        latest: dict[str, CallRecord] = {}
        for member in members:
            day, _, model = member.partition("\t")
            tag = self._md(day, model)
            entries = self._retrying("read", lambda t=tag: client.xrange(f"{t}:audit"))
            for _, raw in entries:  # oldest first: a later entry of the same call replaces an earlier one
                fields_ = {_text(k) or "": _text(v) or "" for k, v in raw.items()}
                latest[fields_["id"]] = _record(model, day, fields_)
            open_ids = [_text(h) or "" for h in self._retrying("read", lambda t=tag: client.zrange(f"{t}:open", 0, -1))]
            for hold_id, row in zip(open_ids, self._hold_rows(day, model, open_ids), strict=True):
                if row.get("state") == "held":
                    latest[hold_id] = _record(model, day, {**row, "id": hold_id, "ended": "", "latency": ""})
        records = [
            r
            for r in latest.values()
            if (since is None or r.started_at >= since)
            and (until is None or r.started_at < until)
            and (run_id is None or r.run_id == run_id)
        ]
        return sorted(records, key=lambda r: r.started_at)

    def _hold_rows(self, day: str, model: str, hold_ids: Sequence[str]) -> list[dict[str, str]]:
        client = self._redis()

        def read() -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for hold_id in hold_ids:
                pipe.hgetall(self._hold_key(day, model, hold_id))
            return pipe.execute()

        rows = self._retrying("read", read) if hold_ids else []
        return [{_text(k) or "": _text(v) or "" for k, v in row.items()} for row in rows]

    def start_run(self, run: RunRecord) -> None:
        client = self._redis()
        record = {
            "run_id": run.run_id,
            "started_at": run.started_at,
            "ended_at": run.ended_at,
            "command": run.command,
            "tags": dict(run.tags),
            "exit_code": run.exit_code,
        }

        def write() -> None:
            client.set(self._run_info_key(run.run_id), json.dumps(record), ex=self.options.run_ttl_s)
            client.zadd(self._runs_key(), {run.run_id: run.started_at})
            # the index is bounded like the records it points to
            client.zremrangebyscore(self._runs_key(), "-inf", time.time() - self.options.run_ttl_s)
            client.zremrangebyrank(self._runs_key(), 0, -MAX_RUNS_INDEXED - 1)

        self._retrying("run", write)

    def end_run(self, run_id: str, exit_code: int, ended_at: float) -> None:
        client = self._redis()
        key = self._run_info_key(run_id)
        raw = _text(self._retrying("run", lambda: client.get(key)))
        if raw is None:
            return
        record = json.loads(raw)
        record.update(exit_code=exit_code, ended_at=ended_at)
        self._retrying("run", lambda: client.set(key, json.dumps(record), ex=self.options.run_ttl_s))

    def runs(self, *, since: float | None = None, until: float | None = None) -> list[RunRecord]:
        client = self._redis()
        low = "-inf" if since is None else repr(float(since))
        high = "+inf" if until is None else f"({float(until)!r}"
        run_ids = [
            _text(r) or "" for r in self._retrying("read", lambda: client.zrangebyscore(self._runs_key(), low, high))
        ]
        raws = self._retrying("read", lambda: [client.get(self._run_info_key(r)) for r in run_ids]) if run_ids else []
        found = []
        for raw in raws:
            if raw is None:
                continue
            data = json.loads(_text(raw) or "{}")
            found.append(
                RunRecord(
                    data["run_id"],
                    float(data["started_at"]),
                    data.get("ended_at"),
                    data.get("command") or "",
                    data.get("tags") or {},
                    data.get("exit_code"),
                )
            )
        return sorted(found, key=lambda r: r.started_at)

    def put_packages(self, model: str, packages: Sequence[Package], synced_at: float) -> None:
        client = self._redis()
        rows = [[p.available, p.expires_at] for p in packages]
        payload = json.dumps({"synced_at": synced_at, "packages": rows})

        self._retrying("sync", lambda: client.set(self._packages_key(model), payload))

    def packages(self, model: str) -> list[Package]:
        client = self._redis()
        raw = _text(self._retrying("read", lambda: client.get(self._packages_key(model))))
        if raw is None:
            return []
        return [Package(model, int(available), float(expires)) for available, expires in json.loads(raw)["packages"]]

    def known_models(self) -> list[str]:
        """Every model the ledger has seen a call or a balance for."""
        client = self._redis()
        return sorted(_text(m) or "" for m in self._retrying("read", lambda: client.smembers(self._models_key())))

    def try_lease(self, name: str, holder: str, ttl_s: float, now: float) -> bool:
        """Take (or renew) a named lease unless another holder has it: one billing caller per ledger."""
        self._redis()
        result = self._retrying(
            "lease",
            lambda: self._scripts["lease"](
                keys=[self._lease_key(name)],
                args=[holder, repr(float(now)), repr(float(now + ttl_s)), _lease_ttl(ttl_s)],
            ),
        )
        return bool(int(result))

    def release_lease(self, name: str, holder: str) -> None:
        self._redis()
        self._retrying("lease", lambda: self._scripts["unlease"](keys=[self._lease_key(name)], args=[holder]))

    def audit(self, model: str, day: str, count: int = 100) -> list[dict[str, str]]:
        """The newest per-call records of a model-day (capped stream, newest first)."""
        client = self._redis()
        raw = self._retrying("read", lambda: client.xrevrange(f"{self._md(day, model)}:audit", count=count))
        return [{_text(k) or "": _text(v) or "" for k, v in entry.items()} for _, entry in raw]

    def close(self) -> None:
        with self._lock:
            client, self._client, self._epoch = self._client, None, None
            connections, self._connections = list(self._connections), weakref.WeakSet()
            self._local = threading.local()
        for conn in connections:
            with contextlib.suppress(Exception):
                conn.disconnect()
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()


def _glob_escape(text: str) -> str:
    """Redis MATCH patterns take a backslash before a special character."""
    return "".join(f"\\{ch}" if ch in "*?[]\\" else ch for ch in text)


def _pick_snapshot(
    record: Mapping[str | None, str | None], bal: str | None, usage: str | None, ttl_ms: int
) -> Snapshot | None:
    """Ours, unless the LiteLLM sync thread wrote a newer one (its age is told by its 24h TTL)."""
    ours = None
    if record.get("synced_at"):
        ours = Snapshot(
            balance=int(record.get("balance") or 0),
            usage_at_sync=int(record.get("usage_at_sync") or 0),
            lagged_usage=int(record.get("lagged_usage") or 0),
            synced_at=float(record["synced_at"] or 0),
            day=record.get("day") or "",
            source=record.get("source") or "manual",
        )
    if bal is None or usage is None:
        return ours
    now = time.time()
    synced_at = now - max(0.0, THEIR_SNAPSHOT_TTL_S - ttl_ms / 1000) if ttl_ms > 0 else now
    balance, at_sync = max(0, int(float(bal))), max(0, int(float(usage)))
    if ours is not None and (
        synced_at <= ours.synced_at + 5 or (balance, at_sync) == (ours.balance, ours.usage_at_sync)
    ):
        return ours
    # The LiteLLM record has no lag information: taken at face value, as that limiter does (v6).
    return Snapshot(balance, at_sync, at_sync, synced_at, beijing_day(synced_at), "litellm")
