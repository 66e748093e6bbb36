"""Tests for quotawrap.intercept.stdlib_adapter (http.client, urllib.request, urllib3) and the
connection guard, against the real in-process Ark simulator: real sockets, chunked SSE bodies.
"""

from __future__ import annotations

import _socket
import errno
import http.client
import json
import re
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import urllib3
from hypothesis import given
from hypothesis import strategies as st

from quotawrap.admission.guard import Guard
from quotawrap.core.redact import redact_argv
from quotawrap.intercept import _scope, netguard, stdlib_adapter
from quotawrap.simulator import ArkSimulator
from quotawrap.wrapper.registry import _interpreter_flags, _python_name
from tests.conftest import ledger_rows

MODEL = "doubao-seed-1-6-250615"
HEADERS = {"Authorization": "Bearer sk-test", "Content-Type": "application/json"}


def _body(**extra: Any) -> bytes:
    return json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 64, **extra}
    ).encode()


@pytest.fixture(autouse=True)
def patched() -> Iterator[None]:
    """http.client and urllib3 patched for the test (and left as they were found)."""
    was = getattr(http.client.HTTPConnection, "_quotawrap_patched", False)
    was3 = getattr(urllib3.connectionpool.HTTPConnectionPool, "_quotawrap_patched", False)
    stdlib_adapter.patch_http_client(http.client)
    stdlib_adapter.patch_urllib3(urllib3)
    yield
    if not was:
        stdlib_adapter.unpatch_http_client(http.client)
    if not was3:
        stdlib_adapter.unpatch_urllib3(urllib3)


def _post(sim: ArkSimulator, body: bytes) -> http.client.HTTPResponse:
    parts = urlsplit(sim.url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port)
    conn.request("POST", parts.path + "/chat/completions", body, HEADERS)
    return conn.getresponse()


def _settled(store: str) -> list[tuple[Any, ...]]:
    return ledger_rows(store, "SELECT state, charged FROM calls")


READERS: dict[str, Callable[[http.client.HTTPResponse], bytes]] = {
    "read": lambda r: r.read(),
    "read(7)": lambda r: b"".join(iter(lambda: r.read(7), b"")),
    "read1": lambda r: b"".join(iter(r.read1, b"")),
    "readinto": lambda r: b"".join(_readinto(r)),
    "readline": lambda r: b"".join(iter(r.readline, b"")),
    "iteration": lambda r: b"".join(r),
    "peek+read": lambda r: r.peek() and r.read(),
}


def _readinto(response: http.client.HTTPResponse) -> Iterator[bytes]:
    buffer = bytearray(5)
    while n := response.readinto(buffer):
        yield bytes(buffer[:n])


class TestHttpClientTee:
    @pytest.mark.parametrize("reader", READERS, ids=list(READERS))
    def test_every_reader_settles_a_stream_and_never_sees_the_injected_usage(
        self, reader: str, guard: Guard, sim: ArkSimulator, store: str
    ) -> None:
        """Whichever way the body is read, the caller gets the stream without the usage-only chunk,
        and the call settles at exactly the simulator's bill."""
        response = _post(sim, _body(stream=True))
        text = READERS[reader](response).decode()
        assert text.endswith("data: [DONE]\n\n")
        assert '"choices":[]' not in text.replace(" ", "")
        assert _settled(store) == [("settled", sim.billed_total())]

    @pytest.mark.parametrize("reader", ["read", "read(7)", "readline"])
    def test_every_reader_settles_a_json_answer(self, reader: str, guard: Guard, sim: ArkSimulator, store: str) -> None:
        """A non-streamed answer passes unchanged and settles from its usage."""
        body = READERS[reader](_post(sim, _body()))
        assert json.loads(body)["usage"]["total_tokens"] == sim.billed_total()
        assert _settled(store) == [("settled", sim.billed_total())]

    def test_closing_a_stream_early_charges_its_hold(self, guard: Guard, sim: ArkSimulator, store: str) -> None:
        """A reader that stops and closes has abandoned the call: the whole hold is charged."""
        response = _post(sim, _body(stream=True))
        response.readline()
        response.close()
        ((state, charged),) = _settled(store)
        assert state == "unresolved" and charged > 0

    def test_a_refusal_is_a_real_response_and_nothing_is_sent(
        self, make_guard: Callable[..., Guard], sim: ArkSimulator
    ) -> None:
        """Blocked: getresponse() hands back a 429 with Ark's error shape; the simulator saw nothing."""
        make_guard(cap_tokens=10)
        response = _post(sim, _body())
        assert response.status == 429
        assert response.getheader("x-should-retry") == "false"
        assert "run_cap" in json.loads(response.read())["error"]["message"]
        assert sim.calls() == 0

    def test_unguarded_paths_pass_untouched(self, guard: Guard, sim: ArkSimulator, store: str) -> None:
        """A GET on the guarded host is not a billed call: no reservation, the answer as sent."""
        parts = urlsplit(sim.url)
        conn = http.client.HTTPConnection(parts.hostname or "", parts.port)
        conn.request("GET", parts.path + "/models")
        response = conn.getresponse()
        assert response.status == 404 and response.read()  # the simulator has no /models: whatever it says
        assert type(response) is http.client.HTTPResponse  # not teed
        assert not Path(store.removeprefix("sqlite:///")).exists()  # the guard never opened its ledger


class TestUrllib3:
    def test_a_stream_through_urllib3_is_teed_below_its_own_chunk_parser(
        self, guard: Guard, sim: ArkSimulator, store: str
    ) -> None:
        """urllib3 parses chunked framing from the socket file itself; the tee makes it read through us."""
        pool = urllib3.PoolManager()
        response = pool.request(
            "POST", sim.url + "/chat/completions", body=_body(stream=True), headers=HEADERS, preload_content=False
        )
        text = b"".join(response.stream(64)).decode()
        response.release_conn()
        assert text.endswith("data: [DONE]\n\n")
        assert _settled(store) == [("settled", sim.billed_total())]

    def test_retries_inside_urlopen_reserve_once(self, guard: Guard, sim: ArkSimulator, store: str) -> None:
        """urllib3's own recursion (retries, redirects) runs under the mark: one reservation per urlopen."""
        pool = urllib3.PoolManager(retries=urllib3.Retry(total=2))
        pool.request("POST", sim.url + "/chat/completions", body=_body(), headers=HEADERS)
        assert len(_settled(store)) == 1


class TestGuardedAddresses:
    def test_base_url_ports_and_localhost(self) -> None:
        """A --base-url's host:port is guarded, localhost's loopback addresses with it; other ports are not."""
        guarded = netguard.GuardedAddresses(["http://localhost:8080/api/v3"])
        assert guarded.guarded(("127.0.0.1", 8080)) == ("127.0.0.1", 8080)
        assert guarded.guarded(("::1", 8080, 0, 0)) == ("::1", 8080)
        assert guarded.guarded(("127.0.0.1", 8081)) is None
        assert guarded.guarded("/tmp/unix.sock") is None

    def test_ark_names_are_guarded_and_their_addresses_learnt(self) -> None:
        """An Ark name is guarded by name; once resolved, its addresses are guarded too."""
        guarded = netguard.GuardedAddresses([])
        assert guarded.guarded(("ark.cn-beijing.volces.com", 443)) is not None
        assert guarded.guarded(("203.0.113.7", 443)) is None
        ports = guarded.ports_of("ark.cn-beijing.volces.com")
        guarded.learn(ports, [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("203.0.113.7", 443))])
        assert guarded.guarded(("203.0.113.7", 443)) == ("203.0.113.7", 443)

    @pytest.mark.parametrize(
        ("address", "reaches"),
        [
            (("127.0.0.1", 8080), ("127.0.0.1", 8080)),
            (("::ffff:127.0.0.1", 8080, 0, 0), ("127.0.0.1", 8080)),
            (("::FFFF:7f00:1", 8080, 0, 0), ("127.0.0.1", 8080)),
            (("0:0:0:0:0:ffff:127.0.0.1", 8080, 0, 0), ("127.0.0.1", 8080)),
            ((b"127.0.0.1", 8080), ("127.0.0.1", 8080)),
            (("127.1", 8080), ("127.0.0.1", 8080)),
            (("2130706433", 8080), ("127.0.0.1", 8080)),
            (("0.0.0.0", 8080), ("127.0.0.1", 8080)),
            (("", 8080), ("127.0.0.1", 8080)),
            (("localhost", 8080), ("127.0.0.1", 8080)),
            (("127.0.0.2", 8080), None),
            (("::ffff:127.0.0.1", 8081, 0, 0), None),
            (("10.0.0.1", 8080), None),
        ],
    )
    def test_every_spelling_of_a_guarded_address(self, address: Any, reaches: Any) -> None:
        """The kernel reaches one address under many spellings: each is recognised as the guarded one."""
        guarded = netguard.GuardedAddresses(["http://127.0.0.1:8080/api/v3"])
        assert guarded.guarded(address) == reaches

    def test_a_v6_base_url_in_any_spelling(self) -> None:
        guarded = netguard.GuardedAddresses(["http://[0:0::1]:8080/api/v3", "http://[::ffff:10.1.2.3]:9000/"])
        assert guarded.guarded(("::1", 8080, 0, 0)) == ("::1", 8080)
        assert guarded.guarded(("10.1.2.3", 9000)) == ("10.1.2.3", 9000)

    def test_a_connection_inside_a_seam_passes(self) -> None:
        """The context mark of a seam lets a guarded address through; without it the check refuses."""
        guarded = netguard.GuardedAddresses(["http://127.0.0.1:9/"])
        assert netguard._check(guarded, ("127.0.0.1", 9)) is not None
        token = _scope.enter("test")
        try:
            assert netguard._check(guarded, ("127.0.0.1", 9)) is None
        finally:
            _scope.leave(token)


def _fromfd_of(sock: socket.socket) -> socket.socket:
    return socket.fromfd(sock.fileno(), sock.family, sock.type)


class TestGuardAfterSocketWasImported:
    """socket.socket already subclasses the C type here (pytest imported socket long ago): the guard sets its
    methods on that class and binds the name ``_socket.socket`` to a guarded subclass, and undoes both."""

    @pytest.fixture
    def listener(self) -> Iterator[tuple[str, int]]:
        server = socket.create_server(("127.0.0.1", 0))
        yield server.getsockname()
        server.close()

    @pytest.fixture
    def guarded(self, listener: tuple[str, int]) -> Iterator[tuple[str, int]]:
        assert netguard.patch(socket, [f"http://127.0.0.1:{listener[1]}/api/v3"]) is not None
        try:
            yield listener
        finally:
            netguard.unpatch(socket)

    @pytest.mark.parametrize(
        "route",
        [
            lambda address: _socket.socket().connect(address),
            lambda address: _socket.socket.connect(socket.socket(), address),
            lambda address: _socket.socket.connect(socket.socket().dup(), address),
            lambda address: _fromfd_of(socket.socket()).connect(address),
            lambda address: socket.socket().sendto(b"POST", socket.MSG_FASTOPEN, address),
            lambda address: socket.socket().sendmsg([b"POST"], [], socket.MSG_FASTOPEN, address),
            lambda address: socket.socket(socket.AF_INET6).connect(("::ffff:127.0.0.1", address[1])),
        ],
        ids=["c-socket", "c-method", "dup", "fromfd", "fastopen", "sendmsg", "mapped-v6"],
    )
    def test_each_route_is_refused(self, guarded: tuple[str, int], route: Callable[[tuple[str, int]], Any]) -> None:
        with pytest.raises(ConnectionRefusedError, match="--allow-unguarded"):
            route(guarded)
        assert _socket.socket().connect_ex(guarded) == errno.ECONNREFUSED

    def test_socket_types_look_as_before(self, guarded: tuple[str, int]) -> None:
        """isinstance and issubclass against ``_socket.socket`` and ``socket.SocketType`` answer as they did."""
        sock = socket.socket()
        assert isinstance(sock, _socket.socket) and isinstance(sock, socket.SocketType)
        assert issubclass(socket.socket, _socket.socket)
        assert not isinstance(object(), _socket.socket)
        sock.close()

    def test_unpatch_puts_everything_back(self, listener: tuple[str, int]) -> None:
        c_type, methods = _socket.socket, dict(vars(socket.socket))
        assert netguard.patch(socket, [f"http://127.0.0.1:{listener[1]}/"]) is not None
        assert _socket.socket is not c_type and "connect" in vars(socket.socket)
        netguard.unpatch(socket)
        assert _socket.socket is c_type and socket.SocketType is c_type
        assert dict(vars(socket.socket)) == methods
        sock = _socket.socket()
        sock.connect(listener)  # no guard left
        sock.close()


class TestRegistryHelpers:
    def test_secrets_in_a_command_are_masked(self) -> None:
        """Flag values, KEY=VALUE assignments, sk- tokens and URL credentials never reach a report."""
        command = " ".join(
            redact_argv(
                ["python", "app.py", "--api-key", "abc123", "ARK_API_KEY=xyz", "sk-live-0123456789", "https://u:p@h/x"]
            )
        )
        assert "abc123" not in command and "xyz" not in command and "0123456789" not in command
        assert "u:p@" not in command
        assert command.startswith("python app.py --api-key ***")

    @given(st.sampled_from(["python", "pytho", "py", "xpython", ""]), st.text(alphabet="0123456789.dmutw-", max_size=8))
    def test_a_python_name_is_the_pattern(self, head: str, tail: str) -> None:
        name = head + tail
        assert _python_name(name) == bool(re.fullmatch(r"python[0-9.]*[dmu]*", name))

    def test_interpreter_flags_stop_at_the_program(self) -> None:
        """-S of the interpreter counts; a -S after -c or the script belongs to the program."""
        assert "S" in _interpreter_flags(["python", "-IS", "app.py"])
        assert "S" not in _interpreter_flags(["python", "app.py", "-S"])
        assert "S" not in _interpreter_flags(["python", "-c", "pass", "-S"])
