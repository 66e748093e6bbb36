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
from collections.abc import Sequence
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

    for i in range(WARMUP_PAIRS):  # connections, scripts, caches
        pair(i)
    while time.time() < start_at:
        time.sleep(0.001)
    latencies = []
    began = time.perf_counter()
    for i in range(pairs):
        t0 = time.perf_counter()
        pair(i)
        latencies.append(time.perf_counter() - t0)
    ended = time.perf_counter()
    ledger.close()
    out.put((began, ended, latencies, time.time()))


def run_config(url: str, processes: int) -> tuple[float, float, float]:
    """(pairs per second, p50 ms, p99 ms)."""
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    pairs = max(TOTAL_PAIRS // processes, 100)
    start_at = time.time() + 1.0 + 0.05 * processes
    workers = [context.Process(target=_worker, args=(url, i, pairs, start_at, queue)) for i in range(processes)]
    for worker in workers:
        worker.start()
    results = [queue.get(timeout=600) for _ in workers]
    for worker in workers:
        worker.join()
    finished = max(r[3] for r in results)
    latencies = sorted(lat for r in results for lat in r[2])
    wall = finished - start_at
    p50 = statistics.median(latencies) * 1000
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1000
    return len(latencies) / wall, p50, p99


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


def table(rows: Sequence[tuple[str, int, float, float, float]]) -> str:
    lines = [
        "| store | processes | pairs/s | p50 ms/pair | p99 ms/pair |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for store, processes, rate, p50, p99 in rows:
        lines.append(f"| {store} | {processes} | {rate:,.0f} | {p50:.3f} | {p99:.3f} |")
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    rows: list[tuple[str, int, float, float, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        sqlite_url = f"sqlite:///{Path(tmp) / 'bench.sqlite3'}"
        redis_url, server = _redis_url()
        try:
            for store, url in (("SQLite", sqlite_url), ("Redis", redis_url)):
                for processes in PROCESSES:
                    rate, p50, p99 = run_config(url, processes)
                    rows.append((store, processes, rate, p50, p99))
                    print(f"{store:6} {processes:3} procs  {rate:9,.0f} pairs/s  p50 {p50:.3f} ms  p99 {p99:.3f} ms")
        finally:
            if server is not None:
                server.cleanup()  # type: ignore[attr-defined]
    print()
    print(table(rows))
    if args.write_docs:
        write_docs(section(rows))
    return 0


def section(rows: Sequence[tuple[str, int, float, float, float]]) -> str:
    best = {store: max(r[2] for r in rows if r[0] == store) for store in ("SQLite", "Redis")}
    p50_1 = {store: next(r[3] for r in rows if r[0] == store and r[1] == 1) for store in ("SQLite", "Redis")}
    return f"""{HEADING}

`python bench/bench_ledger.py --write-docs` ({time.strftime("%Y-%m-%d")}). One reserve+settle
pair is what a guarded call adds to the ledger: a hold taken atomically against a run cap and a
model-day cap, then settled with real usage. P processes each run {TOTAL_PAIRS:,}/P pairs (after
{WARMUP_PAIRS} warm-up pairs) from a common start; pairs/s is all pairs over the wall time,
p50/p99 are per pair over every pair. Redis is a private `redis-server` on loopback TCP without
persistence; SQLite is one WAL file on the local disk (`synchronous=NORMAL`).

Machine: {machine()}. Load average when the run ended: {"{:.1f} / {:.1f} / {:.1f}".format(*os.getloadavg())}
(1/5/15 min) — other work on the same 2 cores depresses these numbers; rerun on an idle machine.

{table(rows)}

Targets (issue 4): SQLite >= 2,000 pairs/s (best here {best["SQLite"]:,.0f}), Redis >= 5,000 pairs/s
(best here {best["Redis"]:,.0f}), p50 added latency per guarded call <= 0.5 ms for both: the pair's
p50 with one process is {p50_1["SQLite"]:.3f} ms (SQLite) and {p50_1["Redis"]:.3f} ms (Redis); a
guarded call pays the reserve before it is sent and the settle after its answer, so this is
the ledger's whole share of the added latency. On 2 cores, 16 processes contend with each other
(and with redis-server) for the CPU: the per-pair latency then measures queueing, not the store.

Where Redis's time goes (one process, `INFO commandstats` and cProfile): each of the pair's two
EVALSHA calls costs the server about 70 µs (about 25 Redis commands per pair inside the scripts,
plus the script's per-call setup of its Lua library), and the client spends roughly 0.3 ms of CPU
per pair in redis-py (packing, two loopback round trips, reply parsing). With two cores shared by
the clients and redis-server this bounds the rate near 2,000-3,000 pairs/s, below the 5,000 target.
Ways forward, none done yet: Redis 7 `FUNCTION LOAD` (the library loaded once, not per call),
the `hiredis` reply parser, fewer EXPIRE calls per script (refresh TTLs once per minute).
"""


if __name__ == "__main__":
    sys.exit(main())
