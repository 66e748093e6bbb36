"""Ledger throughput: reserve+settle pairs per second and latency per pair, SQLite vs Redis.

Each configuration starts P processes (1, 4, 16) that each run the same number of
reserve+settle pairs against one shared ledger and one model-day cap that never binds
(so every pair takes the full path). Throughput is all pairs over the wall time from the
common start to the last process's end; p50/p99 are over every pair of every process.
``--modes``: each settle at once (direct), queued for the background settler as a guarded child
does (settler), or none at all (reserve: the ceiling a settle off the caller's path can approach).

Redis is a private ``redis-server`` (no persistence) started from PATH, or ``REDIS_URL``.

    python bench/bench_ledger.py                 # prints the table
    python bench/bench_ledger.py --write-docs    # also rewrites "## Ledger throughput" in docs/benchmarks.md

With ``--write-docs`` and hiredis installed, Redis is measured once more without hiredis (in a
child process, since redis-py picks its parser at import) so the section shows both.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from _machine import cpu_model  # bench/ is the script's directory

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from quotawrap.core.quota import Limit, beijing_day  # noqa: E402
from quotawrap.core.usage import Usage  # noqa: E402
from quotawrap.ledger import open_ledger  # noqa: E402
from quotawrap.ledger.base import HoldRequest  # noqa: E402

__all__ = ["main"]

PROCESSES = (1, 4, 16)
TOTAL_PAIRS = 4000  # per configuration, split over its processes
WARMUP_PAIRS = 50
LIMITS = [Limit("run_cap", "run", 10**15), Limit("daily_cap", "model_day", 10**15)]
HEADING = "## Ledger throughput"
_MODE_NAMES = {"settler": "settler", "reserve": "reserves alone"}  # how a mode other than direct is shown


def _worker(
    url: str,
    index: int,
    pairs: int,
    start_at: float,
    out: multiprocessing.Queue,  # type: ignore[type-arg]
    mode: str,
) -> None:
    from quotawrap.ledger.base import Settle
    from quotawrap.settling.settler import Settler

    ledger = open_ledger(url)
    settler = Settler(lambda: ledger) if mode == "settler" else None
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
        used = Usage(100, 200 + i % 100, 300 + i % 100)
        if settler is not None:  # what a guarded child does: the settle queued, landed in batches
            settler.submit(Settle(decision.hold_id, "settle", used))
        elif mode == "direct":
            ledger.settle(decision.hold_id, used)
        # mode "reserve": no settle at all, the ceiling that settling off the caller's path can approach

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
        if settler is not None:
            settler.flush()  # the pairs count once every settle has landed
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


def run_config(store: str, url: str, processes: int, mode: str = "direct") -> Result:
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    pairs = max(TOTAL_PAIRS // processes, 100)
    start_at = time.time() + 1.0 + 0.05 * processes
    server_cpu = _server_cpu(url)
    workers = [context.Process(target=_worker, args=(url, i, pairs, start_at, queue, mode)) for i in range(processes)]
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


def _hiredis() -> str:
    """The hiredis version redis-py uses, or "none" (not installed or switched off)."""
    import redis.utils

    if not redis.utils.HIREDIS_AVAILABLE:
        return "none"
    import hiredis

    return str(getattr(hiredis, "__version__", "installed"))


def machine() -> str:
    cpu = cpu_model()
    import redis

    version = "none"
    from tests.redis_server import redis_binary

    binary = redis_binary()
    if binary:
        version = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False).stdout.split()[2]
    return (
        f"{os.cpu_count()} CPUs (`nproc`), {cpu}; Python {platform.python_version()}; "
        f"SQLite {__import__('sqlite3').sqlite_version}; redis-server {version.removeprefix('v=')}, "
        f"redis-py {redis.__version__}, hiredis {_hiredis()}; {platform.system()} {platform.release()}"
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
        text = text[:start] + section.rstrip("\n") + "\n\n" + (text[following + 1 :] if following != -1 else "")
    path.parent.mkdir(exist_ok=True)
    path.write_text(text.rstrip("\n") + "\n")


def _load() -> str:
    return "{:.1f} / {:.1f} / {:.1f}".format(*os.getloadavg())


def _run_rounds(
    stores: Sequence[str], counts: Sequence[int], repeat: int, label: str, modes: Sequence[str] = ("direct",)
) -> list[Result]:
    results: list[Result] = []
    with tempfile.TemporaryDirectory() as tmp:
        urls = {"SQLite": f"sqlite:///{Path(tmp) / 'bench.sqlite3'}"}
        server = None
        if "Redis" in stores:
            urls["Redis"], server = _redis_url()
        try:
            # whole rounds, so that a burst of other work on the machine spreads over every configuration
            for round_ in range(1, repeat + 1):
                for store in stores:
                    for processes in counts:
                        for mode in modes:  # the modes alternate in each round
                            r = run_config(store, urls[store], processes, mode)
                            if store == "Redis" and label:
                                r = dataclasses.replace(r, store=f"Redis, {label}")
                            if mode != "direct":
                                r = dataclasses.replace(r, store=f"{r.store}, {_MODE_NAMES[mode]}")
                            results.append(r)
                            server_cpu = "" if r.server_cpu_us is None else f"  server {r.server_cpu_us:.0f} µs/pair"
                            print(
                                f"round {round_}  {r.store:6} {processes:3} procs  {r.rate:9,.0f} pairs/s"
                                f"  p50 {r.p50_ms:.3f} ms  p99 {r.p99_ms:.3f} ms  client {r.client_cpu_us:.0f} µs/pair"
                                f"{server_cpu}  load {_load()}",
                                flush=True,
                            )
        finally:
            if server is not None:
                server.cleanup()  # type: ignore[attr-defined]
    return results


def _without_hiredis(counts: Sequence[int], repeat: int) -> tuple[list[Result], tuple[str, str]]:
    """Redis again in a child process that cannot import hiredis (redis-py chooses at import).

    Returns its results and the load average before and after them."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        argv = [sys.executable, __file__, "--stores", "Redis", "--without-hiredis"]
        argv += ["--processes", ",".join(map(str, counts)), "--repeat", str(repeat), "--json", str(out)]
        subprocess.run(argv, check=True)
        data = json.loads(out.read_text())
        return [Result(**row) for row in data["results"]], (data["load_before"], data["load_after"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--stores", default="SQLite,Redis", help="comma-separated: SQLite, Redis")
    parser.add_argument("--processes", default=",".join(map(str, PROCESSES)), help="comma-separated counts")
    parser.add_argument("--repeat", type=int, default=3, help="rounds over every configuration (median, range)")
    parser.add_argument("--without-hiredis", action="store_true", help="redis-py's pure-Python parser and packer")
    parser.add_argument("--json", type=Path, help="also write every run's figures to this file")
    parser.add_argument(
        "--modes",
        default="direct",
        help="comma-separated: direct (settle per pair), settler (background batches), reserve (no settle)",
    )
    args = parser.parse_args(argv)
    if args.without_hiredis:
        sys.modules["hiredis"] = None  # type: ignore[assignment]  # before anything imports redis
    stores = [name.strip() for name in args.stores.split(",") if name.strip()]
    counts = [int(n) for n in args.processes.split(",")]
    load_before = _load()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - {"direct", *_MODE_NAMES}
    if unknown:
        parser.error(f"unknown --modes: {', '.join(sorted(unknown))}")
    results = _run_rounds(stores, counts, args.repeat, "no hiredis" if args.without_hiredis else "", modes)
    load_after = _load()
    child_load = None
    if args.write_docs and "Redis" in stores and not args.without_hiredis and _hiredis() != "none":
        more, child_load = _without_hiredis(counts, args.repeat)
        results += more
    if args.json:
        record = {"load_before": load_before, "load_after": load_after, "child_load": child_load}
        args.json.write_text(json.dumps({**record, "results": [dataclasses.asdict(r) for r in results]}))
    rows = summarise(results)
    print()
    print(f"load average before: {load_before}; after: {load_after}")
    print(table(rows))
    if args.write_docs:
        write_docs(section(rows, (load_before, load_after), child_load, args.repeat))
    return 0


def _rates(rows: Sequence[Summary], store: str) -> str:
    """ "1,234 / 2,345 / 3,456 at 1 / 4 / 16 processes" for one store's rows."""
    mine = [r for r in rows if r.store == store]
    rates = " / ".join(f"{r.rate:,.0f}" for r in mine)
    return f"{rates} pairs/s at {' / '.join(str(r.processes) for r in mine)} processes"


def _verdict_rate(rows: Sequence[Summary], store: str, target: float) -> str:
    mine = [r for r in rows if r.store == store]
    if not mine:
        return "not measured"
    passing = [r for r in mine if r.rate >= target]
    if len(passing) == len(mine):
        slowest = min(r.low for r in mine)
        return f"**met** at every process count ({_rates(rows, store)}; slowest single run {slowest:,.0f})"
    one = next((r for r in mine if r.processes == 1), None)
    bound = ""
    if one is not None and one.rate < target:
        # one process waits for each pair before the next: its rate is about 1 / latency per pair
        bound = f"; one process does one pair at a time, 1 / {one.p50_ms:.3f} ms ≈ {1000 / one.p50_ms:,.0f} pairs/s"
    if passing:
        where = " and ".join(str(r.processes) for r in passing)
        others = " and ".join(str(r.processes) for r in mine if r.rate < target)
        return f"**met with {where} processes**, not with {others} ({_rates(rows, store)}{bound})"
    return f"**not met** ({_rates(rows, store)}{bound})"


def _verdict_p50(rows: Sequence[Summary], store: str, target_ms: float) -> str:
    one = next((r for r in rows if r.store == store and r.processes == 1), None)
    if one is None:
        return "not measured with one process"
    word = "**met**" if one.p50_ms <= target_ms else "**not met**"
    return f"{word} with one process ({one.p50_ms:.3f} ms)"


def _cpu_budget(rows: Sequence[Summary], store: str) -> str:
    """The arithmetic of what two cores allow, from the CPU measured at the store's fastest configuration."""
    mine = [r for r in rows if r.store == store and r.server_cpu_us is not None]
    if not mine:
        return ""
    best = max(mine, key=lambda r: r.rate)
    server_cpu = best.server_cpu_us or 0.0
    total = best.client_cpu_us + server_cpu
    cores = os.cpu_count() or 1
    ceiling = cores * 1e6 / total
    return (
        f"{store} at {best.processes} processes: {best.client_cpu_us:.0f} µs of client CPU + {server_cpu:.0f} µs"
        f" of redis-server CPU = {total:.0f} µs per pair. {cores} cores give {cores:,} × 1,000,000 µs of CPU per"
        f" second, so {cores:,} × 1,000,000 / {total:.0f} ≈ {ceiling:,.0f} pairs/s is the most this machine could"
        f" do with nothing else running and both cores busy all the time; the median run did {best.rate:,.0f}"
        f" ({best.rate / ceiling:.0%} of that)."
    )


def _wrap(text: str, indent: str = "") -> str:
    return textwrap.fill(text, width=100, subsequent_indent=indent, break_on_hyphens=False)


def section(rows: Sequence[Summary], load: tuple[str, str], child_load: tuple[str, str] | None, repeat: int) -> str:
    """The docs section; ``load`` (before, after) the main run, ``child_load`` the runs without hiredis."""
    cores = os.cpu_count() or 1
    redis_verdict = f"* Redis >= 5,000 pairs/s: {_verdict_rate(rows, 'Redis', 5000)}."
    if any(r.store == "Redis, no hiredis" for r in rows):
        redis_verdict += f" Without hiredis: {_verdict_rate(rows, 'Redis, no hiredis', 5000)}."
    budgets = [b for b in (_cpu_budget(rows, "Redis"), _cpu_budget(rows, "Redis, no hiredis")) if b]
    verdicts = [
        f"* SQLite >= 2,000 pairs/s: {_verdict_rate(rows, 'SQLite', 2000)}.",
        redis_verdict,
        f"* p50 <= 0.5 ms added per guarded call: SQLite {_verdict_p50(rows, 'SQLite', 0.5)}, Redis"
        f" {_verdict_p50(rows, 'Redis', 0.5)}. A guarded call pays the reserve before it is sent and the settle"
        " after its answer, so the pair is the ledger's whole share of the added latency. With 4 or 16 processes"
        f" on {cores} cores the per-pair figures include waiting for a CPU: there are more processes (and"
        " redis-server) than cores.",
    ]
    times = "time" if repeat == 1 else "times"
    child = "" if child_load is None else f" Runs without hiredis: {child_load[0]} before, {child_load[1]} after."
    return f"""{HEADING}

`python bench/bench_ledger.py --write-docs --repeat {repeat}` ({time.strftime("%Y-%m-%d")}). One
reserve+settle pair is what a guarded call adds to the ledger: a hold taken atomically against a run
cap and a model-day cap, then settled with real usage. P processes each run {TOTAL_PAIRS:,}/P pairs
(after {WARMUP_PAIRS} warm-up pairs) from a common start; pairs/s is all pairs over the wall time,
p50/p99 are per pair over every pair. Each configuration ran {repeat} {times} in whole rounds; the
table gives the medians and the range of pairs/s over the runs. CPU per pair: the benchmark
processes' user + system CPU over their timed pairs, and redis-server's (`INFO cpu`) over the same
interval, divided by the pairs. Redis is a private `redis-server` on loopback TCP without
persistence; SQLite is one WAL file on the local disk (`synchronous=NORMAL`).

{_wrap(f"Machine: {machine()}.")}

{_wrap(f"Load average (1/5/15 min) before the run: {load[0]}; after it: {load[1]}." + child)}
Other work on the same cores (other engineers' test suites) lowers these figures and widens the
ranges; the benchmark's own processes count in the load too.

{table(rows)}

Verdict against the targets:

{chr(10).join(_wrap(v, "  ") for v in verdicts)}

{chr(10).join(_wrap(b) + chr(10) for b in budgets)}
Where the time goes and what was changed (measured on this machine on 2026-11-30 with one process,
cProfile, `INFO commandstats` and `INFO cpu`; see docs/redis.md):

* Before, the client spent ~300 µs of CPU per pair, against ~65 µs for two bare EVALSHA round trips
  through redis-py here. cProfile put the rest in three `strptime` calls per pair, a dozen key
  names formatted twice, a context manager per ledger step, and redis-py's pool bookkeeping per
  command (a `poll()` for stale data, locks, metrics). Now the day arithmetic and the key tuples
  are cached, errors are translated only when something fails, and the two scripts run on a
  connection of the thread's own; hiredis packs commands and parses replies in C. The client
  column above is what is left.
* The server spends ~55 µs per script call (two per pair): ~18 µs in the 26 (reserve) and 28
  (settle) Redis commands, ~5 µs decoding the JSON argument, ~6 µs for the call and the Lua
  library's set-up, the rest in Lua. The reserve script now reads the meta hash with one HMGET and
  the limiter's keys with MGETs. Refreshing TTLs less often (~5 µs per script) and `FUNCTION LOAD`
  (~1.7 µs per script) were measured and not done; docs/redis.md says why.
* Still two round trips per pair: the reserve must be answered before the call is sent and the
  settle needs the call's answer. Nothing is pipelined or skipped in this benchmark.
"""


if __name__ == "__main__":
    sys.exit(main())
