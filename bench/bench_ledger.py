"""Ledger throughput: reserve+settle pairs per second and latency per pair, SQLite vs Redis.

Each configuration starts P processes (1, 4, 16) that each run the same number of
reserve+settle pairs against one shared ledger and one model-day cap that never binds
(so every pair takes the full path). Throughput is all pairs over the wall time from the
common start to the last process's end; p50/p99 are over every pair of every process.

Redis is a private ``redis-server`` (no persistence) started from PATH, or ``REDIS_URL``.

    python bench/bench_ledger.py                 # prints the table
    python bench/bench_ledger.py --write-docs    # also rewrites "## Ledger throughput" in docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from quotawrap.ledger import open_ledger  # noqa: E402
from quotawrap.ledger.base import HoldRequest  # noqa: E402
from quotawrap.quota import Limit, beijing_day  # noqa: E402
from quotawrap.usage import Usage  # noqa: E402

__all__ = ["main"]

PROCESSES = (1, 4, 16)
TOTAL_PAIRS = 4000  # per configuration, split over its processes
WARMUP_PAIRS = 50
LIMITS = [Limit("run_cap", "run", 10**15), Limit("daily_cap", "model_day", 10**15)]
HEADING = "## Ledger throughput"


def _worker(url: str, index: int, pairs: int, start_at: float, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    ledger = open_ledger(url)
    day = beijing_day(time.time())
    pid, host = os.getpid(), "bench"
    limits_for = lambda snapshot: LIMITS  # noqa: E731

    def pair(i: int) -> None:
        request = HoldRequest(
            run_id=f"bench-{index % 2}",
            model="bench-model",
            day=day,
            reserve=1000,
            endpoint="/api/v3/chat/completions",
            pid=pid,
            host=host,
            expires_at=time.time() + 600,
        )
        decision = ledger.reserve(request, limits_for)
        ledger.settle(decision.hold_id, Usage(100, 200 + i % 100, 300 + i % 100))

    try:
        for i in range(WARMUP_PAIRS):  # connections, scripts, caches
            pair(i)
        while time.time() < start_at:
            time.sleep(0.001)
        latencies = []
        cpu0 = time.process_time()
        for i in range(pairs):
            t0 = time.perf_counter()
            pair(i)
            latencies.append(time.perf_counter() - t0)
        cpu = time.process_time() - cpu0
        ledger.close()
    except BaseException:
        # a failed worker must fail the run at once, not leave the parent waiting on the queue
        out.put(traceback.format_exc())
        raise
    out.put((latencies, cpu, time.time()))


@dataclass(frozen=True)
class Result:
    """One configuration's run: throughput, latency per pair, and CPU spent per pair on each side."""

    store: str
    processes: int
    rate: float  # pairs per second
    p50_ms: float
    p99_ms: float
    client_cpu_us: float  # CPU of the benchmark processes per pair (user + system)
    server_cpu_us: float | None  # redis-server's CPU per pair (INFO cpu); None for SQLite


@dataclass(frozen=True)
class Summary:
    store: str
    processes: int
    rate: float  # median pairs/s over the repeats
    low: float
    high: float
    p50_ms: float
    p99_ms: float
    client_cpu_us: float
    server_cpu_us: float | None
    runs: int


def _server_cpu(url: str) -> Callable[[], float] | None:
    """redis-server's CPU seconds so far (user + system, every thread), or None for SQLite."""
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return None
    import redis

    client = redis.Redis.from_url(url)

    def read() -> float:
        info = client.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    return read


def run_config(store: str, url: str, processes: int) -> Result:
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    pairs = max(TOTAL_PAIRS // processes, 100)
    start_at = time.time() + 1.0 + 0.05 * processes
    server_cpu = _server_cpu(url)
    workers = [context.Process(target=_worker, args=(url, i, pairs, start_at, queue)) for i in range(processes)]
    for worker in workers:
        worker.start()
    while time.time() < start_at:
        time.sleep(0.001)
    server_cpu0 = server_cpu() if server_cpu else 0.0
    results = []
    for _ in workers:
        result = queue.get(timeout=600)
        if isinstance(result, str):
            for worker in workers:
                worker.kill()
            raise SystemExit(f"bench_ledger: a {store} worker failed:\n{result}")
        results.append(result)
    server_used = server_cpu() - server_cpu0 if server_cpu else None
    for worker in workers:
        worker.join()
    finished = max(r[2] for r in results)
    latencies = sorted(lat for r in results for lat in r[0])
    total = len(latencies)
    return Result(
        store,
        processes,
        total / (finished - start_at),
        statistics.median(latencies) * 1000,
        latencies[min(total - 1, int(total * 0.99))] * 1000,
        sum(r[1] for r in results) / total * 1e6,
        None if server_used is None else server_used / total * 1e6,
    )


def _redis_url() -> tuple[str, object | None]:
    from tests.redis_server import RedisServer, redis_binary

    binary = redis_binary()
    if binary is not None:
        server = RedisServer(binary).start()
        return server.url, server
    url = os.environ.get("REDIS_URL")
    if not url:
        raise SystemExit("bench_ledger: needs redis-server on PATH or REDIS_URL")
    return url, None


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import redis

    version = "none"
    from tests.redis_server import redis_binary

    binary = redis_binary()
    if binary:
        import subprocess

        version = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False).stdout.split()[2]
    return (
        f"{os.cpu_count()} CPUs (`nproc`), {cpu}; Python {platform.python_version()}; "
        f"SQLite {__import__('sqlite3').sqlite_version}; redis-server {version.removeprefix('v=')}, "
        f"redis-py {redis.__version__}; {platform.system()} {platform.release()}"
    )


def summarise(results: Sequence[Result]) -> list[Summary]:
    """Per store and process count: the median of each figure over the repeats, and the rate's range."""
    summaries = []
    for store in dict.fromkeys(r.store for r in results):
        for processes in dict.fromkeys(r.processes for r in results if r.store == store):
            runs = [r for r in results if (r.store, r.processes) == (store, processes)]
            server = [r.server_cpu_us for r in runs if r.server_cpu_us is not None]
            summaries.append(
                Summary(
                    store,
                    processes,
                    statistics.median(r.rate for r in runs),
                    min(r.rate for r in runs),
                    max(r.rate for r in runs),
                    statistics.median(r.p50_ms for r in runs),
                    statistics.median(r.p99_ms for r in runs),
                    statistics.median(r.client_cpu_us for r in runs),
                    statistics.median(server) if server else None,
                    len(runs),
                )
            )
    return summaries


def table(rows: Sequence[Summary]) -> str:
    lines = [
        "| store | processes | pairs/s (median) | range over runs | p50 ms/pair | p99 ms/pair"
        " | client CPU µs/pair | server CPU µs/pair |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        server = "–" if r.server_cpu_us is None else f"{r.server_cpu_us:.0f}"
        lines.append(
            f"| {r.store} | {r.processes} | {r.rate:,.0f} | {r.low:,.0f}–{r.high:,.0f} | {r.p50_ms:.3f} |"
            f" {r.p99_ms:.3f} | {r.client_cpu_us:.0f} | {server} |"
        )
    return "\n".join(lines)


def write_docs(section: str) -> None:
    path = ROOT / "docs" / "benchmarks.md"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start = text.find(HEADING)
    if start == -1:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        following = text.find("\n## ", start + len(HEADING))
        text = text[:start] + section + (text[following + 1 :] if following != -1 else "")
    path.parent.mkdir(exist_ok=True)
    path.write_text(text.rstrip("\n") + "\n")


def _load() -> str:
    return "{:.1f} / {:.1f} / {:.1f}".format(*os.getloadavg())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--stores", default="SQLite,Redis", help="comma-separated: SQLite, Redis")
    parser.add_argument("--processes", default=",".join(map(str, PROCESSES)), help="comma-separated counts")
    parser.add_argument("--repeat", type=int, default=3, help="rounds over every configuration (median, range)")
    args = parser.parse_args(argv)
    stores = [name.strip() for name in args.stores.split(",") if name.strip()]
    counts = [int(n) for n in args.processes.split(",")]
    results: list[Result] = []
    load_before = _load()
    with tempfile.TemporaryDirectory() as tmp:
        urls = {"SQLite": f"sqlite:///{Path(tmp) / 'bench.sqlite3'}"}
        server = None
        if "Redis" in stores:
            urls["Redis"], server = _redis_url()
        try:
            # whole rounds, so that a burst of other work on the machine spreads over every configuration
            for round_ in range(1, args.repeat + 1):
                for store in stores:
                    for processes in counts:
                        r = run_config(store, urls[store], processes)
                        results.append(r)
                        server_cpu = "" if r.server_cpu_us is None else f"  server {r.server_cpu_us:.0f} µs/pair"
                        print(
                            f"round {round_}  {store:6} {processes:3} procs  {r.rate:9,.0f} pairs/s"
                            f"  p50 {r.p50_ms:.3f} ms  p99 {r.p99_ms:.3f} ms  client {r.client_cpu_us:.0f} µs/pair"
                            f"{server_cpu}  load {_load()}",
                            flush=True,
                        )
        finally:
            if server is not None:
                server.cleanup()  # type: ignore[attr-defined]
    rows = summarise(results)
    print()
    print(f"load average before: {load_before}; after: {_load()}")
    print(table(rows))
    if args.write_docs:
        write_docs(section(rows, load_before, args.repeat))
    return 0


def section(rows: Sequence[Summary], load_before: str, repeat: int) -> str:
    best = {store: max((r.rate for r in rows if r.store == store), default=0.0) for store in ("SQLite", "Redis")}
    p50_1 = {store: next((r.p50_ms for r in rows if r.store == store and r.processes == 1), 0.0) for store in best}
    return f"""{HEADING}

`python bench/bench_ledger.py --write-docs --repeat {repeat}` ({time.strftime("%Y-%m-%d")}).

Machine: {machine()}. Load average (1/5/15 min) before the run: {load_before}; after: {_load()}.

{table(rows)}

Targets (issue 4): SQLite >= 2,000 pairs/s (best median here {best["SQLite"]:,.0f}), Redis >= 5,000
pairs/s (best median here {best["Redis"]:,.0f}), p50 per pair with one process <= 0.5 ms:
{p50_1["SQLite"]:.3f} ms (SQLite), {p50_1["Redis"]:.3f} ms (Redis).
"""


if __name__ == "__main__":
    sys.exit(main())
