"""Where a guarded call's time and CPU go, per step, in the guarded child AND in the wrapper (issue 12).

    python bench/bench_guard_steps.py [--calls 800] [--stores sqlite,redis] [--repeat 2] [--compare main=DIR]

The same set-up as ``bench_agent_overhead.py`` (the bundled simulator in its own process, an agent on the
real ``openai`` SDK making sequential small chat calls, ``quotawrap run --quiet --store ...``), with timers
wrapped around the guard's steps inside the agent (installed before its first call, by replacing the
functions on their classes and modules: each timer adds well under a µs). It prints per step the median,
p90 and mean µs per call (a step nested in another counts in both), and the CPU per call, over the timed
calls, of the agent, of the wrapper (per thread: its main thread watches the process tree, the relay's
lands the child's settles), of the simulator and of redis-server: everything that competes for the
cores. ``--compare NAME=DIR`` profiles another checkout too, in alternation. Not a pass/fail bench: these
are the figures each latency change is judged by, before it goes through ``bench_agent_overhead.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from _machine import load_average, machine_line  # bench/ is the script's directory
from bench_agent_overhead import MODEL, REPO_ROOT, guarded_prefix, redis_store, simulator

# Each entry: (module, attribute path, label). Missing ones (another checkout) are skipped.
STEPS = [
    ("quotawrap.intercept.httpx_adapter", "_prepared", "adapter: request copy (_prepared)"),
    ("quotawrap.intercept.httpx_adapter", "_observe", "adapter: response_started + tee set-up"),
    ("quotawrap.admission.guard", "Guard.begin", "Guard.begin (all of the reserve)"),
    ("quotawrap.admission.guard", "Guard.route", "  route"),
    ("quotawrap.core.endpoints", "parse_json_body", "  parse the body"),
    ("quotawrap.admission.room", "Room.evicted", "  eviction short-cut"),
    ("quotawrap.admission.call", "Estimator.__call__", "  estimate"),
    ("quotawrap.core.endpoint_prices", "CostRule.for_request", "  cost rule"),
    ("quotawrap.admission.call", "Admission.plan", "  plan the bound"),
    ("quotawrap.admission.call", "usage_bound", "  usage bound"),
    ("quotawrap.admission.call", "Admission.hold", "  hold request"),
    ("quotawrap.admission.call", "key_fingerprint", "    key fingerprint"),
    ("quotawrap.settling.books", "Books.reserve_cost", "    reserve cost"),
    ("quotawrap.ledger.sqlite.ledger", "SQLiteLedger.reserve", "  SQLite reserve"),
    ("quotawrap.ledger.sqlite.ledger", "_Transaction.__enter__", "    lock + BEGIN IMMEDIATE"),
    ("quotawrap.ledger.sqlite.ledger", "_Transaction.__exit__", "    COMMIT"),
    ("quotawrap.ledger.redis.ledger", "RedisLedger.reserve", "  Redis reserve"),
    ("quotawrap.admission.call", "Admission._admit", "  admit: a draw from the advance, or a reserve"),
    ("quotawrap.admission.advances", "Advances.draw", "    the draw"),
    ("quotawrap.settling.draw_notes", "DrawNotes.write", "      its note (DrawNotes.write)"),
    ("quotawrap.admission.call", "Admission.admitted", "  admitted (body, bound event, GuardedCall)"),
    ("quotawrap.settling.call", "GuardedCall.finish", "GuardedCall.finish (usage, settle hand-off)"),
    ("quotawrap.settling.call", "GuardedCall._outcome", "  read the usage"),
    ("quotawrap.settling.books", "Books.actual_cost", "  price it"),
    ("quotawrap.settling.sink", "Landing.land", "  hand the settle on (Landing.land)"),
    ("quotawrap.settling.handoff", "Sender.send", "  send to the wrapper"),
    ("quotawrap.settling.sink", "Landing.landed", "  after the send (learn, audit)"),
]

# The timers both processes install (the agent around the guard's steps, the wrapper around the relay's):
# each (module, attribute path, label) step is replaced by a wrapper that appends (wall ns, thread CPU ns)
# to samples[label] while enabled(), then calls after(label, args) if given. Missing steps are skipped.
PATCHING = r"""
import functools, importlib, json, os, sys, time


def patch(steps, samples, enabled=lambda: True, after=None):
    for module_name, path, label in steps:
        try:
            owner = importlib.import_module(module_name)
            *parents, name = path.split(".")
            for parent in parents:
                owner = getattr(owner, parent)
            original = getattr(owner, name)
        except (ImportError, AttributeError):
            continue
        if isinstance(vars(owner).get(name), staticmethod):  # set back on the class, it would take self
            continue
        setattr(owner, name, timed(original, label, samples[label], enabled, after))


def timed(function, label, bucket, enabled, after):
    clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if not enabled():
            return function(*args, **kwargs)
        start, cpu = clock(), cpu_clock()
        try:
            return function(*args, **kwargs)
        finally:
            bucket.append((clock() - start, cpu_clock() - cpu))
            if after is not None:
                after(label, args)

    return wrapper
"""

AGENT_PROFILE = r"""
STEPS = json.loads(os.environ["QW_STEPS"])
_samples = {label: [] for _m, _a, label in STEPS}
_timing = [False]


def _install():
    patch(STEPS, _samples, lambda: _timing[0])


def _cpu(pid):
    # utime + stime of every thread of pid, in clock ticks, per thread id
    out = {}
    with __import__("contextlib").suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            out[tid] = int(fields[11]) + int(fields[12])
    return out
"""


WRAPPER_STEPS = [
    ("quotawrap.settling.handoff", "Relay._land", "relay: land a batch"),
    ("quotawrap.settling.handoff", "Relay._drain", "relay: drain the socket"),
    ("quotawrap.settling.handoff", "Relay._take", "relay: decode one"),
    ("quotawrap.settling.handoff", "Relay._linger", "relay: linger"),
    ("quotawrap.settling.handoff", "Relay._next", "relay: wait for one settle (in linger too)"),
    ("quotawrap.ledger.sqlite.ledger", "SQLiteLedger.settle_many", "SQLite settle_many"),
    ("quotawrap.ledger.sqlite.ledger", "_Transaction.__enter__", "  lock + BEGIN IMMEDIATE"),
    ("quotawrap.ledger.sqlite.ledger", "_Transaction.__exit__", "  COMMIT"),
    ("quotawrap.ledger.redis.ledger", "RedisLedger.settle_many", "Redis settle_many"),
]

# Runs ``quotawrap run ...`` with timers (wall and the thread's own CPU) around the relay's steps; writes them
# to $QW_WRAPPER_OUT at exit, with the number of settles landed.
WRAPPER_SHIM = r"""
import atexit, runpy

STEPS = json.loads(os.environ["QW_WRAPPER_STEPS"])
samples = {label: [] for _m, _a, label in STEPS}
landed = [0]


def count_landed(label, args):
    if label.endswith("settle_many"):
        landed[0] += len(args[1])


patch(STEPS, samples, after=count_landed)


@atexit.register
def dump():
    with open(os.environ["QW_WRAPPER_OUT"], "w") as handle:
        json.dump({"steps": samples, "landed": landed[0]}, handle)


sys.argv = ["quotawrap", *sys.argv[1:]]
runpy.run_module("quotawrap", run_name="__main__", alter_sys=True)
"""


AGENT_LOOP = r"""
base_url, calls, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
MODEL = sys.argv[5]
import openai

client = openai.OpenAI(base_url=base_url, api_key="sk-bench-not-a-key", max_retries=0)
messages = [{"role": "user", "content": "彩虹有几种颜色？Answer in one short sentence."}]


def once():
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64).choices[0].message.content


watched = {"wrapper": os.getppid(), **{k: int(v) for k, v in json.loads(os.environ["QW_PIDS"]).items()}}
_install()
for _ in range(warmup):
    once()
times = []
before = {name: _cpu(pid) for name, pid in watched.items()}
cpu_start = time.process_time_ns()
_timing[0] = True
for _ in range(calls):
    start = time.perf_counter_ns()
    once()
    times.append(time.perf_counter_ns() - start)
_timing[0] = False
cpu_ns = time.process_time_ns() - cpu_start
after = {name: _cpu(pid) for name, pid in watched.items()}
ticks = {}
for name, pid in watched.items():
    for tid, value in after[name].items():
        label = name
        if name == "wrapper":
            label = "wrapper main thread" if int(tid) == pid else "wrapper other threads"
        ticks[label] = ticks.get(label, 0) + value - before[name].get(tid, 0)
result = {"times": times, "cpu_ns": cpu_ns, "steps": _samples, "ticks": ticks, "hz": os.sysconf("SC_CLK_TCK")}
print(json.dumps(result))
"""


def run_profiled(
    prefix: Sequence[str], code: Path, agent: Path, sim_url: str, calls: int, warmup: int, pids: dict[str, int]
) -> dict[str, object]:
    import subprocess

    out = agent.with_name("wrapper.json")
    shim = agent.with_name("wrapper_shim.py")
    shim.write_text(PATCHING + WRAPPER_SHIM)
    assert prefix[1:3] == ["-m", "quotawrap"]
    argv = [prefix[0], str(shim), *prefix[3:], sys.executable, str(agent), sim_url, str(calls), str(warmup), "0", MODEL]
    env = {**os.environ, "PYTHONPATH": str(code), "QW_STEPS": json.dumps(STEPS), "QW_PIDS": json.dumps(pids)}
    env |= {"QW_WRAPPER_STEPS": json.dumps(WRAPPER_STEPS), "QW_WRAPPER_OUT": str(out)}
    done = subprocess.run(argv, capture_output=True, text=True, check=False, cwd=code, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"exit {done.returncode}: {done.stderr[-2000:]}")
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    result["wrapper"] = json.loads(out.read_text())
    return result


def _server_pid(url: str) -> int | None:
    import redis

    with contextlib.suppress(Exception):
        return int(redis.Redis.from_url(url).info("server")["process_id"])
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=800)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=2, help="profiled runs per cell, alternated")
    parser.add_argument("--stores", default="sqlite,redis")
    parser.add_argument("--compare", action="append", default=[], metavar="NAME=DIR")
    args = parser.parse_args(argv)
    checkouts = {"this": REPO_ROOT} | {
        name: Path(path).resolve() for name, path in (entry.split("=", 1) for entry in args.compare)
    }
    stores = [s for s in args.stores.split(",") if s]
    print(f"Guarded call per step (issue 12) — {machine_line()}; load before {load_average()}")
    with (
        tempfile.TemporaryDirectory(prefix="quotawrap-steps-") as tmp,
        simulator() as sim_url,
        redis_store() if "redis" in stores else contextlib.nullcontext(None) as redis_url,
    ):
        sim_pid = _simulator_pid(sim_url)
        agent = Path(tmp) / "agent.py"
        agent.write_text(PATCHING + AGENT_PROFILE + AGENT_LOOP)
        os.environ["XDG_STATE_HOME"] = str(Path(tmp) / "state")
        cells: list[tuple[str, str, list[str], Path, dict[str, int]]] = []
        for store in stores:
            for index, (name, code) in enumerate(checkouts.items()):
                pids = {"simulator": sim_pid} if sim_pid else {}
                if store == "sqlite":
                    url = f"sqlite:///{Path(tmp) / f'ledger{index}.sqlite3'}"
                else:
                    assert redis_url is not None
                    url = f"{redis_url.rsplit('/', 1)[0]}/{index}"
                    server = _server_pid(url)
                    if server:
                        pids["redis-server"] = server
                cells.append((store, name, guarded_prefix(url, sim_url), code, pids))
        results: dict[tuple[str, str], list[dict[str, object]]] = {(c[0], c[1]): [] for c in cells}
        for repeat in range(args.repeat):
            order = cells if repeat % 2 == 0 else cells[::-1]
            for store, name, prefix, code, pids in order:
                results[(store, name)].append(run_profiled(prefix, code, agent, sim_url, args.calls, args.warmup, pids))
            print(f"  repeat {repeat + 1}/{args.repeat} done, load {load_average()}", flush=True)
    for (store, name), runs in results.items():
        report(store, name, runs, args.calls)
    print(f"load after {load_average()}")
    return 0


def _simulator_pid(url: str) -> int | None:
    """The simulator's pid: the process listening on the URL's port (from /proc/net/tcp and the fds)."""
    port = int(url.rsplit(":", 1)[1].split("/", 1)[0])
    inode = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as handle:
            for line in handle.readlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                    inode = fields[9]
    if inode is None:
        return None
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                        return int(pid)
    return None


def report(store: str, name: str, runs: list[dict[str, object]], calls: int) -> None:
    times = [t for run in runs for t in run["times"]]  # type: ignore[attr-defined]
    cpu = statistics.median(int(run["cpu_ns"]) / calls / 1e3 for run in runs)  # type: ignore[call-overload]
    median = statistics.median(times) / 1e6
    print(f"\n== {store}, {name}: {len(runs)} runs x {calls} calls; agent median {median:.3f} ms/call,", end="")
    print(f" agent CPU {cpu:.0f} µs/call (timers included)")
    print(f"  {'step (wall µs, then its thread CPU µs)':<48} {'median':>8} {'p90':>8} {'mean':>8}", end="")
    print(f" {'CPU med':>8} {'CPU mean':>8} {'per call':>8} {'>1ms':>5}")
    for _module, _path, label in STEPS:
        pairs = [pair for run in runs for pair in run["steps"][label]]  # type: ignore[index]
        if not pairs:
            continue
        values = [wall for wall, _cpu in pairs]
        cpus = [cpu for _wall, cpu in pairs]
        per_call = len(values) / (calls * len(runs))
        p90 = statistics.quantiles(values, n=10)[8] if len(values) > 1 else values[0]
        slow = sum(1 for v in values if v >= 1_000_000)
        print(
            f"  {label:<48} {statistics.median(values) / 1e3:>8.1f} {p90 / 1e3:>8.1f}"
            f" {statistics.mean(values) / 1e3:>8.1f} {statistics.median(cpus) / 1e3:>8.1f}"
            f" {statistics.mean(cpus) / 1e3:>8.1f} {per_call:>8.2f} {slow:>5}"
        )
    print("  CPU per timed call, µs (clock ticks over the run):")
    labels = sorted({label for run in runs for label in run["ticks"]})  # type: ignore[attr-defined]
    for label in labels:
        per_call = [
            run["ticks"].get(label, 0) / int(run["hz"]) / calls * 1e6  # type: ignore[attr-defined,call-overload]
            for run in runs
        ]
        if max(per_call) > 0:
            runs_text = ", ".join(f"{v:.0f}" for v in per_call)
            print(f"    {label:<28} {statistics.median(per_call):>7.0f}  (runs: {runs_text})")
    landed = sum(int(run["wrapper"]["landed"]) for run in runs)  # type: ignore[index]
    print(f"  in the wrapper, per settle landed ({landed} over the runs, warm-up included), µs:")
    print(f"    {'step':<34} {'calls/settle':>12} {'wall med':>9} {'wall/settle':>11} {'CPU/settle':>10}")
    for _module, _path, label in WRAPPER_STEPS:
        pairs = [pair for run in runs for pair in run["wrapper"]["steps"].get(label, [])]  # type: ignore[index]
        if not pairs or not landed:
            continue
        walls = [wall for wall, _cpu in pairs]
        print(
            f"    {label:<34} {len(pairs) / landed:>12.2f} {statistics.median(walls) / 1e3:>9.1f}"
            f" {sum(walls) / landed / 1e3:>11.1f} {sum(cpu for _wall, cpu in pairs) / landed / 1e3:>10.1f}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
