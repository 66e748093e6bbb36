"""The /proc TCP table as the process watcher reads it: open and opening connections by socket inode."""

from __future__ import annotations

import os
import socket

import pytest

from quotawrap.wrapper.sockets import GuardedPeers, open_peers, parse_tcp_table

HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (
            "0: 0100007F:A1B2 0100007F:1F90 01 00000000:00000000 00:00000000 00000000 0 0 4242 1",
            {4242: ("127.0.0.1", 8080)},
        ),
        ("0: 0100007F:A1B2 0A00000A:01BB 02 00000000:00000000 00:00000000 00000000 0 0 7 1", {7: ("10.0.0.10", 443)}),
        ("0: 0100007F:A1B2 0100007F:1F90 06 00000000:00000000 00:00000000 00000000 0 0 0 1", {}),  # TIME_WAIT
        ("0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000 0 0 9 1", {}),  # a listener
        (
            "0: 00000000000000000000000001000000:A1B2 00000000000000000000000001000000:1F90 01 0:0 0:0 0 0 0 11 1",
            {11: ("::1", 8080)},
        ),
        (
            "0: 0000000000000000FFFF00000100007F:A1B2 0000000000000000FFFF00000100007F:1F90 01 0:0 0:0 0 0 0 12 1",
            {12: ("127.0.0.1", 8080)},  # v4-mapped, as a dual-stack client's connection shows
        ),
        ("0: garbage", {}),
    ],
)
def test_parse_tcp_table(line: str, expected: dict[int, tuple[str, int]]) -> None:
    assert parse_tcp_table(HEADER + line + "\n") == expected


def test_this_process_sees_its_own_connection() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            assert ("127.0.0.1", port) in open_peers(os.getpid())
            peers = GuardedPeers([f"http://127.0.0.1:{port}/api/v3"])
            assert peers.guarded(("127.0.0.1", port))
            assert not peers.guarded(("127.0.0.1", port + 1))


def test_localhost_base_url_guards_both_loopbacks() -> None:
    peers = GuardedPeers(["http://localhost:8080"])
    assert peers.guarded(("127.0.0.1", 8080)) and peers.guarded(("::1", 8080))
