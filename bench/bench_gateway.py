"""What the gateway costs: added latency over calling the provider directly, and guarded requests/s.

    python bench/bench_gateway.py [--calls 400] [--load-calls 3000] [--clients 32]

Three processes, as in use: the Ark simulator (`quotawrap simulate`, zero latency, short answers),
a gateway (`quotawrap serve`, SQLite ledger in a temp dir, forwarding to the simulator) and this
script as the client. Prints numbers, asserts nothing.

* Latency: one keep-alive client sends the same small chat completion, alternately straight to the
  simulator and through the gateway (so drift on a noisy machine hits both alike), plain and
  streamed; p50/p99 per path, and the gateway's added p50 (target: at most 1 ms).
* Throughput: ``--clients`` concurrent clients (aiohttp, one event loop) send ``--load-calls``
  guarded requests through the gateway; requests/s over the wall time, and the same load straight
  to the simulator for reference. Every answer must be a 200 (the caps are raised out of the way).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
from _machine import load_average, machine_line  # bench/ is the script's directory

MODEL = "deepseek-v4-flash"
HEADERS = {"authorization": "Bearer sk-bench-not-a-key", "content-type": "application/json"}
TARGET_ADDED_MS = 1.0
PATHS = ("direct", "gateway", "floor")


def body(*, stream: bool) -> bytes:
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "彩虹有几种颜色？Answer in one short sentence."}],
        "max_tokens": 64,
        "stream": stream,
    }
    if stream:
        request["stream_options"] = {"include_usage": True}
    return json.dumps(request, ensure_ascii=False).encode()


@contextmanager
def process(argv: Sequence[str]) -> Iterator[str]:
    """A quotawrap subcommand that prints its URL on stdout; stopped with SIGTERM."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            found = re.search(r"(http://\S+)", line)
            if found:
                yield found.group(1)
                break
        else:
            raise RuntimeError(f"{argv} printed no URL")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latency(urls: dict[str, str], calls: int) -> dict[tuple[str, bool], list[float]]:
    """Per (path, streamed): milliseconds per call, the paths interleaved in rotating order."""
    samples: dict[tuple[str, bool], list[float]] = {}
    with httpx.Client(timeout=30) as client:
        for warm in range(20):
            for url in urls.values():
                client.post(f"{url}/chat/completions", content=body(stream=warm % 2 == 0), headers=HEADERS)
        for n in range(calls):
            stream = n % 2 == 1
            order = list(urls.items())
            order = order[n % len(order) :] + order[: n % len(order)]
            for path, url in order:
                start = time.perf_counter()
                if stream:
                    request = client.build_request(
                        "POST", f"{url}/chat/completions", content=body(stream=True), headers=HEADERS
                    )
                    response = client.send(request, stream=True)
                    for _ in response.iter_raw():
                        pass
                    response.close()
                else:
                    response = client.post(f"{url}/chat/completions", content=body(stream=False), headers=HEADERS)
                elapsed = time.perf_counter() - start
                assert response.status_code == 200, response.status_code
                samples.setdefault((path, stream), []).append(elapsed * 1000)
    return samples


async def load(base: str, total: int, clients: int) -> tuple[float, int]:
    import aiohttp

    done = 0
    failures = 0
    payload = body(stream=False)

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal done, failures
        while done < total:
            done += 1
            async with session.post(f"{base}/chat/completions", data=payload, headers=HEADERS) as response:
                await response.read()
                failures += response.status != 200

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))  # warm the connections
        done = 0
        start = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(clients)))
        wall = time.perf_counter() - start
    return total / wall, failures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400, help="latency samples per path (half streamed)")
    parser.add_argument("--load-calls", type=int, default=3000)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--store", default=None, help="the gateways' ledger (default: SQLite in a temp dir)")
    args = parser.parse_args(argv)
    print(f"machine: {machine_line()}; ledger: {(args.store or 'sqlite').split(':')[0]}")
    print(f"load average before: {load_average()}")
    quotawrap = [sys.executable, "-m", "quotawrap"]
    with tempfile.TemporaryDirectory() as tmp:
        store = args.store or f"sqlite:///{Path(tmp) / 'ledger.sqlite3'}"
        simulate = [*quotawrap, "simulate", "--port", "0", "--reply-tokens", "12", "--reasoning-tokens", "0"]
        with process(simulate) as sim_url:
            serve = [*quotawrap, "serve", "--port", "0", "--store", store, "--base-url", sim_url, "--quiet"]
            serve += ["--daily-cap", "1000000000", "--usage-wall", "1000000000"]
            # the floor: the same gateway guarding no model, so only the proxying is left
            with process(serve) as gateway_url, process([*serve, "--model", "no-such-model"]) as floor_url:
                urls = {"direct": sim_url, "gateway": gateway_url, "floor": floor_url}
                samples = latency(urls, args.calls)
                rps = {path: asyncio.run(load(url, args.load_calls, args.clients)) for path, url in urls.items()}
    print(f"load average after: {load_average()}")
    print()
    print("| call | path | p50 ms | p99 ms | added p50 ms |")
    print("| --- | --- | ---: | ---: | ---: |")
    names = {"direct": "straight to the simulator", "gateway": "gateway, guarded", "floor": "gateway, guarding nothing"}
    for stream in (False, True):
        direct_p50 = statistics.median(samples[("direct", stream)])
        for path in PATHS:
            values = samples[(path, stream)]
            p50 = statistics.median(values)
            added = f"{p50 - direct_p50:+.3f}" if path != "direct" else "–"
            kind = "streamed" if stream else "plain"
            print(f"| {kind} | {names[path]} | {p50:.3f} | {percentile(values, 0.99):.3f} | {added} |")
    print()
    print(f"{args.clients} concurrent clients, {args.load_calls} plain calls per path:")
    for path in PATHS:
        per_s, failures = rps[path]
        print(f"  {names[path]:<28} {per_s:>7,.0f} requests/s ({failures} not 200)")
    worst = max(
        statistics.median(samples[("gateway", s)]) - statistics.median(samples[("direct", s)]) for s in (False, True)
    )
    verdict = "met" if worst <= TARGET_ADDED_MS else "NOT met"
    print(f"target: gateway adds <= {TARGET_ADDED_MS} ms p50: {verdict} (worst added p50 {worst:.3f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
