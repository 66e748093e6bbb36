"""The Redis store URL: every password form stays out of messages, unix sockets work, a bad port
is a ConfigError (one line for the CLI), not a traceback from inside redis-py."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from quotawrap._errors import ConfigError, StoreError
from quotawrap.ledger import HoldRequest, model_day_key, open_ledger
from quotawrap.ledger.redis import RedisLedger
from quotawrap.quota import Counters, Limit, beijing_day
from quotawrap.usage import Usage
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
