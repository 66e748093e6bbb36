"""What the connection guard costs per connection (docs/benchmarks.md, "Connection guard").

Connects a TCP socket to a loopback listener and closes it, N times, in one process:
without the guard, with it to a host:port that is not guarded (every other connection of a
program), and with it to a guarded ``--base-url`` port from inside a guarded client (the
guarded call's own connection; the check reads the context mark and stops). The check alone
(no syscall) is timed too, since the connect itself varies by more than the guard costs.
Rounds alternate the variants; the medians over rounds are printed as a Markdown table.

    python bench/bench_netguard.py [--connections 5000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._machine import load_average, machine_line
from quotawrap.intercept import _scope, netguard


def _listener() -> tuple[socket.socket, int]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4096)

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=accept, daemon=True).start()
    return server, server.getsockname()[1]


def _connects(port: int, n: int) -> float:
    """Microseconds per connect+close."""
    start = time.perf_counter_ns()
    for _ in range(n):
        sock = socket.socket()
        sock.connect(("127.0.0.1", port))
        sock.close()
    return (time.perf_counter_ns() - start) / n / 1000


def _in_mark(run: Callable[[], float]) -> float:
    token = _scope.enter("bench")
    try:
        return run()
    finally:
        _scope.leave(token)


def _check_ns(guarded: netguard.GuardedAddresses, address: tuple[str, int], n: int, *, marked: bool) -> float:
    token = _scope.enter("bench") if marked else None
    try:
        start = time.perf_counter_ns()
        for _ in range(n):
            netguard._check(guarded, address)
        return (time.perf_counter_ns() - start) / n
    finally:
        if token is not None:
            _scope.leave(token)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    server, other_port = _listener()
    guarded_server, guarded_port = _listener()
    base_url = f"http://127.0.0.1:{guarded_port}/api/v3"
    n = args.connections
    results: dict[str, list[float]] = {"off": [], "other": [], "guarded": []}
    checks: dict[str, list[float]] = {"other": [], "guarded": []}
    load_before = load_average()
    for _ in range(args.rounds):
        results["off"].append(_connects(other_port, n))
        guarded = netguard.patch(socket, [base_url])
        assert guarded is not None
        try:
            results["other"].append(_connects(other_port, n))
            results["guarded"].append(_in_mark(lambda: _connects(guarded_port, n)))
            checks["other"].append(_check_ns(guarded, ("127.0.0.1", other_port), n * 20, marked=False))
            checks["guarded"].append(_check_ns(guarded, ("127.0.0.1", guarded_port), n * 20, marked=True))
        finally:
            netguard.unpatch(socket)
    server.close()
    guarded_server.close()
    off = statistics.median(results["off"])
    print(f"Machine: {machine_line()}; load before {load_before}, after {load_average()}")
    print(f"{args.rounds} rounds x {n} connect+close to a loopback listener; medians over rounds.\n")
    print("| connection | µs per connect+close | added by the guard | the check alone (ns) |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| no guard | {off:.1f} | – | – |")
    rows = (("other", "guard on, host:port not guarded"), ("guarded", "guard on, guarded port, inside a client"))
    for key, title in rows:
        median = statistics.median(results[key])
        check = statistics.median(checks[key])
        print(f"| {title} | {median:.1f} | {median - off:+.1f} | {check:.0f} |")


if __name__ == "__main__":
    main()
