"""The Redis ledger's settings, and the store URL they may come in (``redis://host/0?prefix=qw``)."""

from __future__ import annotations

from dataclasses import fields
from urllib.parse import parse_qsl, urlencode, urlsplit

from ...core.errors import ConfigError
from ...core.records import Record

__all__ = ["DAY_S", "RedisOptions", "redact", "split_url"]

DAY_S = 86_400


class RedisOptions(Record, frozen=True):
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


def _parse_option(name: str, raw: str, url: str) -> object:
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
        raise ConfigError(f"store URL {redact(url)}: bad value {raw!r} for {name}") from exc
    return raw


def split_url(url: str) -> tuple[str, dict[str, object]]:
    """(the URL redis-py should see, our options taken out of its query string).

    The URL is cut at its ``?`` rather than rebuilt with urlunsplit, which would turn
    ``unix:///path`` into ``unix:/path`` (a form redis-py refuses).
    """
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 - parsing the port is the check: redis-py would raise a bare ValueError later
    except ValueError as exc:
        raise ConfigError(f"store URL {redact(url)}: the port is not a number from 0 to 65535") from exc
    ours: dict[str, object] = {}
    theirs: list[tuple[str, str]] = []
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key in RedisOptions.names():
            ours[key] = _parse_option(key, value, url)
        else:
            theirs.append((key, value))
    if ours.get("cluster") and parts.scheme == "unix":
        raise ConfigError(f"store URL {redact(url)}: a Redis Cluster is not reached through a unix socket")
    base = url.partition("#")[0].partition("?")[0]
    client_url = f"{base}?{urlencode(theirs)}" if theirs else base
    if theirs:
        _check_their_parameters(client_url, url)
    return client_url, ours


def _check_their_parameters(client_url: str, url: str) -> None:
    """The query parameters redis-py reads, judged by redis-py now rather than at its first connection
    (a traceback, or a run that fails open): it builds, without connecting, the connection they describe."""
    try:
        from redis.connection import ConnectionPool
        from redis.exceptions import RedisError
    except Exception:  # no usable redis package: opening the store says so in its own words
        return
    try:
        pool = ConnectionPool.from_url(client_url)
        pool.make_connection()
        pool.disconnect()
    except (ValueError, TypeError, RedisError) as exc:
        raise ConfigError(
            f"store URL {redact(url)}: a query parameter is wrong ({exc}); correct or remove it"
        ) from None


_SECRET_PARAMETERS = frozenset({"password"})


def redact(url: str) -> str:
    """The URL as messages may show it: any password (``:pw@``, ``user:pw@``, ``?password=``) is ***."""
    try:
        parts = urlsplit(url)
    except ValueError:  # not even a URL: show its scheme alone
        return url.partition(":")[0] + ":***"
    netloc = parts.netloc
    user, at, host = netloc.rpartition("@")
    if at and ":" in user:
        netloc = f"{user.partition(':')[0]}:***@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(key in _SECRET_PARAMETERS for key, _ in pairs):
            query = "&".join(
                f"{key}=***" if key in _SECRET_PARAMETERS else urlencode([(key, value)]) for key, value in pairs
            )
    if (netloc, query) == (parts.netloc, parts.query):
        return url
    text = f"{parts.scheme}://{netloc}{parts.path}"
    return f"{text}?{query}" if query else text
