"""The Redis store URL: every password form stays out of messages, unix sockets work, a bad port
is a ConfigError (one line for the CLI), not a traceback from inside redis-py."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from quotawrap.core.errors import ConfigError, StoreError
from quotawrap.core.quota import Counters, Limit, beijing_day
from quotawrap.core.usage import Usage
from quotawrap.ledger import HoldRequest, model_day_key, open_ledger
from quotawrap.ledger.redis import RedisLedger
from tests.redis_server import RedisServer, free_port, redis_binary

SECRET = "s3cret-Pw"


@pytest.mark.parametrize(
    "template",
    [
        "redis://:{pw}@127.0.0.1:{port}/0",
        "redis://alice:{pw}@127.0.0.1:{port}/0",
        "redis://127.0.0.1:{port}/0?password={pw}",
        "redis://127.0.0.1:{port}/0?db=0&password={pw}&prefix=qw",
        "rediss://alice:{pw}@127.0.0.1:{port}/0",
    ],
)
def test_no_password_form_reaches_a_message(template: str) -> None:
    """Whichever way the password is written, the StoreError of an unreachable store hides it."""
    url = template.format(pw=SECRET, port=free_port())
    with pytest.raises(StoreError) as error:
        RedisLedger(url, connect_timeout_s=0.5, retries=0).snapshot("m")
    assert SECRET not in str(error.value) and "***" in str(error.value)


def test_bad_option_value_hides_the_password() -> None:
    """A ConfigError about the URL's options shows the URL without its password."""
    with pytest.raises(ConfigError) as error:
        RedisLedger(f"redis://127.0.0.1:6379/0?password={SECRET}&audit_max=lots")
    assert SECRET not in str(error.value) and "audit_max" in str(error.value)


@pytest.mark.parametrize("port", ["notaport", "99999", "-1"])
def test_bad_port_is_a_config_error(port: str) -> None:
    """redis://host:notaport/0 is refused when the ledger is opened, naming the port, password hidden."""
    with pytest.raises(ConfigError, match="port") as error:
        open_ledger(f"redis://:{SECRET}@127.0.0.1:{port}/0")
    assert SECRET not in str(error.value)


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("unix:///x.sock?db=x", "'db'"),
        ("redis://127.0.0.1:6379/0?socket_timeout=abc", "'socket_timeout'"),
        ("redis://127.0.0.1:6379/0?health_check_interval=zz", "'health_check_interval'"),
        ("rediss://127.0.0.1:6379/0?ssl_cert_reqs=bogus", "bogus"),
        ("redis://127.0.0.1:6379/0?ssl_cert_reqs=none", "'ssl_cert_reqs'"),  # TLS words on a plain connection
        ("redis://127.0.0.1:6379/0?no_such_parameter=1", "'no_such_parameter'"),
        ("unix:///x.sock?cluster=yes", "unix socket"),
    ],
)
def test_a_parameter_redis_py_would_refuse_is_a_config_error_when_opened(url: str, named: str) -> None:
    """redis-py reads these only at its first connection, and raised there (a traceback, or a run that failed
    open): the ledger refuses them when it is opened, in redis-py's words, before any connection."""
    with pytest.raises(ConfigError, match=named) as error:
        open_ledger(url.replace("127.0.0.1", f":{SECRET}@127.0.0.1"))
    assert SECRET not in str(error.value)


def test_parameters_redis_py_takes_are_kept() -> None:
    for url in (
        "rediss://h:1/0?ssl_cert_reqs=none&socket_timeout=2",
        "unix:///x.sock?db=2",
        "redis://h/0?db=3&prefix=p",
    ):
        ledger = open_ledger(url)
        assert isinstance(ledger, RedisLedger)


class _UnixServer(RedisServer):
    """A private redis-server that also listens on a unix socket in its directory."""

    @property
    def socket_path(self) -> Path:
        return self.directory / "redis.sock"

    def _argv(self) -> list[str]:
        return [*super()._argv(), "--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]


@pytest.fixture
def unix_server() -> Iterator[_UnixServer]:
    binary = redis_binary()
    if binary is None:
        pytest.fail("redis-server is not installed")
    server = _UnixServer(binary).start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.mark.redis
def test_unix_socket_url_works(unix_server: _UnixServer) -> None:
    """unix:///path?db=N (with one of our options beside redis-py's) guards calls over the socket."""
    ledger = RedisLedger(f"unix://{unix_server.socket_path}?db=2&prefix=qx")
    day = beijing_day(time.time())
    request = HoldRequest(
        run_id="r", model="m", day=day, reserve=100, endpoint="/chat", pid=1, host=socket.gethostname(),
        expires_at=time.time() + 600,
    )  # fmt: skip
    decision = ledger.reserve(request, lambda snapshot: [Limit("daily_cap", "model_day", 1000)])
    ledger.settle(decision.hold_id, Usage(10, 20, 30))
    assert decision.held
    assert ledger.counters([model_day_key("m", day)])[model_day_key("m", day)] == Counters(30, 0)
    ledger.close()
