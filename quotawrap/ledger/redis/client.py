"""The connection to Redis: connect (single node, TLS, unix socket or Cluster), run the Lua
scripts, turn redis-py's errors into StoreError, and retry what may be retried.

redis-py is untyped where it matters (every reply is ``Any``); this module is where replies
become ``str``, ``int`` and ``dict``, so nothing else in the ledger handles ``Any``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.resources
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from ...core.errors import StoreError
from ...core.records import Record
from .options import RedisOptions

__all__ = ["Arg", "Client", "as_int", "as_text", "lua_file"]

_T = TypeVar("_T")
Arg = str | int | float
_READ_BYTES = 65536  # a reserve's answer is ~100 bytes, a batch of settles' a few KiB

# scripts that start with the shared library lua/lib.lua
_WITH_LIB = (
    "reserve_one",
    "run_gate",
    "md_reserve",
    "run_apply",
    "transition_one",
    "transition_many",
    "md_transition",
    "line_leave",
    "budget_gate",
    "budget_apply",
)
_WITH_ADVANCE = ("transition_many",)  # then lua/advance.lua (an advance's steps) after the library
SCRIPTS = (*_WITH_LIB, "lease", "unlease", "budget_set")


def as_text(value: object) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def as_int(value: object) -> int:
    """A reply as an integer; a missing or empty one is 0 (counters start at nothing)."""
    text = as_text(value)
    return int(float(text)) if text else 0


def _map(value: Any) -> dict[str, str]:
    return {as_text(k) or "": as_text(v) or "" for k, v in value.items()}


def _packer() -> Callable[..., Any] | None:
    """hiredis's packer when redis-py packs with it too, else None (the connection's own packer).

    The bytes are the same either way: redis-py's hiredis path is this function behind a pass over every
    argument for bytearray and memoryview (never ours), paid again for each of a reserve's many arguments.
    """
    from redis.utils import HIREDIS_AVAILABLE  # the flag redis-py's connections choose their packer by

    if not HIREDIS_AVAILABLE:
        return None
    from hiredis import pack_command

    return pack_command


class _Script(Record):
    source: str
    sha: str


def lua_file(name: str) -> str:
    """The text of lua/NAME.lua (lib.lua is the shared library)."""
    return (importlib.resources.files(__package__) / "lua" / f"{name}.lua").read_text(encoding="utf-8")


def _load_scripts() -> dict[str, _Script]:
    lib = lua_file("lib")
    scripts = {}
    for name in SCRIPTS:
        source = lua_file(name)
        if name in _WITH_ADVANCE:
            source = lua_file("advance") + source
        if name in _WITH_LIB:
            source = lib + source
        scripts[name] = _Script(source, hashlib.sha1(source.encode()).hexdigest())
    return scripts


class _Wire:
    """One thread's connection for the scripts (single node), written and read on its socket directly.

    redis-py opens it (TCP, TLS or a Unix socket; AUTH, SELECT) and says what an error reply is
    (``parse_error``); a script call is then one ``sendall`` of hiredis's packed command and the reads
    its answer needs, fed to a hiredis reader. redis-py's ``send_packed_command`` and ``read_response``
    wrap the same steps in checks (health, buffers, timeouts) that cost the client's CPU on every call
    and that a connection of our own does not need.
    Anything but a whole answer closes the connection, which the next call opens again; socket errors
    become redis-py's ConnectionError and TimeoutError, as its own path raises them (retried).
    """

    __slots__ = ("_buffer", "_reader", "conn")

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self._reader: Any = None
        self._buffer = bytearray(_READ_BYTES)

    def call(self, packed: bytes) -> Any:
        conn = self.conn
        try:
            sock = conn._sock  # redis-py's socket: None until connected, and again once disconnected
            if sock is None:
                from hiredis import Reader
                from redis._parsers.base import BaseParser

                conn.connect()
                sock = conn._sock
                self._reader = Reader(replyError=BaseParser.parse_error)
            reader, buffer = self._reader, self._buffer
            sock.sendall(packed)
            reply = reader.gets()
            while reply is False:
                count = sock.recv_into(buffer)
                if not count:
                    raise OSError("Connection closed by server.")
                reader.feed(buffer, 0, count)
                reply = reader.gets()
        except BaseException as exc:
            conn.disconnect()  # a reply may be left unread
            if isinstance(exc, OSError):  # TimeoutError here is the builtin (socket.timeout)
                from redis import exceptions

                wrapped = exceptions.TimeoutError if isinstance(exc, TimeoutError) else exceptions.ConnectionError
                raise wrapped(f"Error while talking to the socket: {exc}") from exc
            raise
        if isinstance(reply, Exception):  # an error reply (NOSCRIPT...): the connection is still in step
            raise reply
        return reply


class Client:
    """One store's connection; connects on first use, again after ``close``."""

    def __init__(self, url: str, store: str, options: RedisOptions) -> None:
        self._url = url  # what redis-py sees: our options taken out
        self.store = store  # the URL as messages show it (no password)
        self.options = options
        self._lock = threading.Lock()
        self._redis: Any = None
        self.cluster = False
        self._scripts = _load_scripts()
        self._local = threading.local()  # this thread's connection for the script calls (single node)
        self._connections: weakref.WeakSet[Any] = weakref.WeakSet()

    # -- connecting --------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._redis is not None

    def connect(self) -> None:
        if self._redis is not None:
            return
        with self._lock:
            if self._redis is None:
                from redis.exceptions import NoScriptError, ResponseError

                # looked up once: script() runs for every reserve and settle
                self._no_script: type[Exception] = NoScriptError
                self._error_reply: type[Exception] = ResponseError
                self._pack = _packer()
                with self.errors("connect"):
                    self._redis, self.cluster = self._open()

    def _open(self) -> tuple[Any, bool]:
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
            if self._url.startswith("unix://"):
                cluster = False
            else:
                probe = redis.Redis.from_url(self._url, **common)
                try:
                    cluster = bool(probe.info("cluster").get("cluster_enabled"))
                finally:
                    probe.close()
        if cluster:
            from redis.cluster import RedisCluster

            return RedisCluster.from_url(self._url, **common), True
        return redis.Redis.from_url(self._url, **common), False

    def close(self) -> None:
        with self._lock:
            client, self._redis = self._redis, None
            connections, self._connections = list(self._connections), weakref.WeakSet()
            self._local = threading.local()
        for conn in connections:
            with contextlib.suppress(Exception):
                conn.disconnect()
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()

    # -- errors and retries ------------------------------------------------------------------

    def _store_error(self, action: str, exc: BaseException) -> StoreError | None:
        """The StoreError a redis or socket error becomes; None for anything else (it passes unchanged)."""
        import redis

        if isinstance(exc, StoreError):
            return None
        if isinstance(exc, redis.exceptions.RedisError):
            return StoreError(f"Redis ledger {action} failed: {type(exc).__name__}: {exc}", store=self.store)
        if isinstance(exc, OSError):  # raised by some socket paths before redis-py wraps them
            return StoreError(f"Redis ledger {action} failed: {exc}", store=self.store)
        return None

    @contextlib.contextmanager
    def errors(self, action: str) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            error = self._store_error(action, exc)
            if error is None:
                raise
            raise error from exc

    def retrying(self, action: str, fn: Callable[[], _T]) -> _T:
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

    # -- scripts -----------------------------------------------------------------------------

    def sha(self, name: str) -> str:
        return self._scripts[name].sha

    def script(self, name: str, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        """Run a script by its SHA; after NOSCRIPT (a restart, SCRIPT FLUSH) load it and run it once more.

        The one path for a single node and for Cluster; only the transport differs (``_send``).
        """
        script = self._scripts[name]
        try:
            return self._send("EVALSHA", script.sha, len(keys), *keys, *args)
        except self._no_script:
            self._send("SCRIPT", "LOAD", script.source)
            return self._send("EVALSHA", script.sha, len(keys), *keys, *args)

    def _send(self, *command: Arg) -> Any:
        """Cluster: through the client, which routes by the keys' slot (SCRIPT LOAD goes to every primary).

        Single node: on this thread's own connection. The reserve and the settle of every guarded call
        come here; going around the pool skips its per-command bookkeeping (a poll() for stale data,
        locks, metrics), which cost the client more CPU than sending the command. Instead a
        connection whose reply may be unread is closed.
        """
        if self.cluster:
            return self._redis.execute_command(*command)
        wire = self._wire()
        pack = self._pack
        if pack is not None:
            return wire.call(pack(command))
        conn = wire.conn
        try:
            conn.send_packed_command(conn.pack_command(*command))
            return conn.read_response()
        except self._error_reply:
            raise  # an error reply: the connection is still in step
        except BaseException:
            conn.disconnect()  # anything else may leave a reply unread; redis-py connects again on the next command
            raise

    def _wire(self) -> _Wire:
        """This thread's own connection (single node), opened on first use."""
        local = self._local
        wire: _Wire | None = getattr(local, "wire", None)
        if wire is None or local.pid != os.getpid():  # never a connection inherited through fork()
            pool = self._redis.connection_pool
            conn = pool.connection_class(**pool.connection_kwargs)  # same URL, TLS, timeouts as the pool's
            wire = local.wire = _Wire(conn)
            local.pid = os.getpid()
            with self._lock:
                self._connections.add(conn)
        return wire

    # -- commands, typed ---------------------------------------------------------------------

    def config_get(self, name: str) -> Any:
        """CONFIG GET ``name``: one dict, or one per primary of a Cluster (node name -> dict)."""
        if self.cluster:
            return self._redis.config_get(name, target_nodes="primaries")
        return self._redis.config_get(name)

    def get(self, key: str) -> str | None:
        return as_text(self._redis.get(key))

    def set(self, key: str, value: str | int, *, ex: int | None = None, exat: int | None = None) -> None:
        self._redis.set(key, value, ex=ex, exat=exat)

    def delete(self, key: str) -> None:
        self._redis.delete(key)

    def incr(self, key: str) -> int:
        return int(self._redis.incr(key))

    def exists(self, key: str) -> bool:
        return bool(self._redis.exists(key))

    def time(self) -> float:
        """The server's clock (TIME), in seconds; on Cluster a node's (each keeps its own, NTP keeps them close)."""
        reply = self._redis.time()
        if isinstance(reply, dict):  # redis-py's Cluster answers per node
            reply = next(iter(reply.values()))
        seconds, micros = reply
        return int(seconds) + int(micros) / 1_000_000

    def mget(self, keys: Sequence[str]) -> list[str | None]:
        values = self._redis.mget_nonatomic(keys) if self.cluster else self._redis.mget(keys)
        return [as_text(v) for v in values]

    def scan(self, match: str) -> list[str]:
        return [as_text(n) or "" for n in self._redis.scan_iter(match=match, count=1000)]

    def hget(self, key: str, field: str) -> str | None:
        return as_text(self._redis.hget(key, field))

    def hmget(self, key: str, fields: Sequence[str]) -> list[str | None]:
        return [as_text(v) for v in self._redis.hmget(key, list(fields))]

    def hgetall(self, key: str) -> dict[str, str]:
        return _map(self._redis.hgetall(key))

    def hsetnx(self, key: str, field: str, value: str) -> bool:
        """Whether the field was set (it was not there)."""
        return bool(self._redis.hsetnx(key, field, value))

    def sadd(self, key: str, member: str) -> None:
        self._redis.sadd(key, member)

    def smembers(self, key: str) -> list[str]:
        return sorted(as_text(m) or "" for m in self._redis.smembers(key))

    def zadd(self, key: str, member: str, score: float) -> None:
        self._redis.zadd(key, {member: score})

    def zrange(self, key: str) -> list[str]:
        return [as_text(m) or "" for m in self._redis.zrange(key, 0, -1)]

    def zrangebyscore(self, key: str, low: str, high: str) -> list[str]:
        return [as_text(m) or "" for m in self._redis.zrangebyscore(key, low, high)]

    def zremrangebyscore(self, key: str, low: str, high: float) -> None:
        self._redis.zremrangebyscore(key, low, high)

    def zremrangebyrank(self, key: str, start: int, stop: int) -> None:
        self._redis.zremrangebyrank(key, start, stop)

    def lrange(self, key: str) -> list[str]:
        return [as_text(v) or "" for v in self._redis.lrange(key, 0, -1)]

    def xrange(self, key: str) -> list[dict[str, str]]:
        """A stream's entries, oldest first."""
        return [_map(fields) for _, fields in self._redis.xrange(key)]

    def hmget_many(self, keys: Sequence[str], fields: Sequence[str]) -> list[list[str | None]]:
        """HMGET of one field list on many keys, in one round trip on a single node."""
        if not keys:
            return []
        rows = self._batch([("HMGET", key, *fields) for key in keys])
        return [[as_text(v) for v in row] for row in rows]

    def hgetall_many(self, keys: Sequence[str]) -> list[dict[str, str]]:
        if not keys:
            return []
        return [_map(row) for row in self._batch([("HGETALL", key) for key in keys])]

    def read_snapshot(self, ours: str, balance: str, usage: str) -> tuple[dict[str, str], str | None, str | None, int]:
        """(our snapshot hash, their balance, their usage, their balance key's TTL in ms), in one round trip."""
        mine, bal, used, ttl = self._batch([("HGETALL", ours), ("GET", balance), ("GET", usage), ("PTTL", balance)])
        return _map(mine), as_text(bal), as_text(used), int(ttl or -1)

    def write(self, commands: Sequence[Sequence[Arg | bytes]]) -> None:
        """Write commands as one MULTI/EXEC on a single node; on Cluster one by one (keys may span slots)."""
        self._batch(commands, transaction=True)

    def _batch(self, commands: Sequence[Sequence[Arg | bytes]], *, transaction: bool = False) -> list[Any]:
        if self.cluster:
            return [self._redis.execute_command(*command) for command in commands]
        pipe = self._redis.pipeline(transaction=transaction)
        for command in commands:
            pipe.execute_command(*command)
        return list(pipe.execute())
