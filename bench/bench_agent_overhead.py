"""Issue 12's own figure: latency a guarded call adds, whole process, guarded against plain.

    python bench/bench_agent_overhead.py [--rounds 5] [--calls 1500] [--stores sqlite,redis]

The bundled simulator (``quotawrap simulate``, zero latency, short answers) runs in its own process.
An agent script on the real ``openai`` SDK makes ``--calls`` sequential small chat calls to it, each
timed inside the agent with ``perf_counter_ns``, and prints its per-call nanoseconds. It runs plain
(``python agent.py``) and guarded (``quotawrap run --quiet --store ... -- python agent.py``), with the
SQLite ledger and with Redis (a private ``redis-server`` on a free loopback port), streamed and not.
The runs are interleaved and rotated per round, so drift on a shared machine hits them alike; caps
are raised out of the way so no call is refused. Prints the median per call of every cell (its p90, p99
and mean too: the tail a change may trade for the median), the median added per call against plain and
a verdict: at most 0.25 ms (SQLite) and 0.40 ms (Redis).
CPU µs/call is the agent process's own CPU over its timed calls, every thread (a guarded child's
settler included): steadier than wall time on a shared machine. +run CPU is the whole run's CPU (the
wrapper's, which lands the child's settles and competes for the cores, and the agent's; start-up and
warm-up included) per call made, against the plain run's. The load average is printed before
and after: on a loaded machine both sides slow down and the difference grows, so compare figures
measured at a similar load; ``--compare before=DIR`` runs another checkout's guard in the same rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from _machine import load_average, machine_line  # bench/ is the script's directory

REPO_ROOT = Path(__file__).resolve().parents[1]
TARGET_MS = {"sqlite": 0.25, "redis": 0.40}
MODEL = "deepseek-v4-flash"

AGENT = r"""
import json, sys, time
import openai

base_url, calls, warmup, stream = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
client = openai.OpenAI(base_url=base_url, api_key="sk-bench-not-a-key", max_retries=0)
messages = [{"role": "user", "content": "彩虹有几种颜色？Answer in one short sentence."}]


def once():
    if stream:
        for _chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, stream=True):
            pass
    else:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64).choices[0].message.content


MODEL = sys.argv[5]
for _ in range(warmup):
    once()
times = []
cpu_start = time.process_time_ns()  # this process's CPU, every thread (a guarded child's settler too)
for _ in range(calls):
    start = time.perf_counter_ns()
    once()
    times.append(time.perf_counter_ns() - start)
print(json.dumps({"times": times, "cpu_ns": time.process_time_ns() - cpu_start}))
"""


@contextlib.contextmanager
def simulator(*options: str) -> Iterator[str]:
    """A simulator process's base URL; ``options`` for `quotawrap simulate` (default: short answers, no thinking)."""
    argv = [sys.executable, "-m", "quotawrap", "simulate", "--port", "0"]
    argv += list(options) or ["--reply-tokens", "12", "--reasoning-tokens", "0"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO_ROOT)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            found = re.search(r"(http://\S+)", line)
            if found:
                yield found.group(1).rstrip("/")
                break
        else:
            raise RuntimeError("the simulator printed no URL")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@contextlib.contextmanager
def redis_store() -> Iterator[str | None]:
    sys.path.insert(0, str(REPO_ROOT))
    from tests.redis_server import RedisServer, redis_binary

    binary = redis_binary()
    if binary is None:
        url = os.environ.get("REDIS_URL")
        yield url
        return
    server = RedisServer(binary).start()
    try:
        yield server.url
    finally:
        server.stop()


def run_agent(
    argv_prefix: Sequence[str], code: Path, agent: Path, sim_url: str, calls: int, warmup: int, stream: bool
) -> tuple[list[int], int, int]:
    """The agent's per-call nanoseconds, its CPU nanoseconds per call (all its threads), and the whole run's
    (the wrapper's too, start and warm-up included) per call made."""
    argv = [*argv_prefix, sys.executable, str(agent), sim_url, str(calls), str(warmup), "1" if stream else "0", MODEL]
    env = {**os.environ, "PYTHONPATH": str(code)}  # which quotawrap checkout the wrapper and its child import
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(argv, capture_output=True, text=True, check=False, cwd=code, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])}...: exit {done.returncode}: {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    whole = (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) * 1e9 / (calls + warmup)
    return list(result["times"]), int(result["cpu_ns"]) // calls, int(whole)


def guarded_prefix(store: str, sim_url: str) -> list[str]:
    return [
        sys.executable, "-m", "quotawrap", "run", "--quiet", "--store", store, "--base-url", sim_url,
        "--daily-cap", str(10**12), "--usage-wall", str(10**12), "--",
    ]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--calls", type=int, default=1500, help="timed calls per agent run (default 1500)")
    parser.add_argument("--warmup", type=int, default=30, help="untimed calls first in each agent run")
    parser.add_argument("--stores", default="sqlite,redis", help="comma-separated: sqlite, redis")
    parser.add_argument("--modes", default="plain,stream", help="comma-separated: plain (non-streamed), stream")
    parser.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="also run the guarded cells with the quotawrap checkout in DIR (e.g. before=/tmp/main): before -> after",
    )
    args = parser.parse_args(argv)
    checkouts = {"": REPO_ROOT} | {
        f"@{name}": Path(path).resolve() for name, path in (entry.split("=", 1) for entry in args.compare)
    }
    stores = [s for s in args.stores.split(",") if s]
    modes = [m == "stream" for m in args.modes.split(",") if m]

    print(f"Added latency per guarded call, whole process (issue 12) — {machine_line()}")
    import openai

    print(f"openai {openai.__version__}; {args.rounds} rounds x {args.calls} calls per cell, runs interleaved")
    load_before = load_average()
    print(f"load average before: {load_before}")
    with (
        tempfile.TemporaryDirectory(prefix="quotawrap-agent-bench-") as tmp,
        simulator() as sim_url,
        redis_store() if "redis" in stores else contextlib.nullcontext(None) as redis_url,
    ):
        agent = Path(tmp) / "agent.py"
        agent.write_text(AGENT)
        prefixes: dict[str, tuple[list[str], Path]] = {"plain": ([], REPO_ROOT)}
        for store in stores:
            if store == "redis" and redis_url is None:
                raise SystemExit("bench_agent_overhead: Redis needs redis-server on PATH or REDIS_URL")
            # A ledger per checkout: another version may keep another schema, and refuses this one's.
            for index, (suffix, code) in enumerate(checkouts.items()):
                if store == "sqlite":
                    url = f"sqlite:///{Path(tmp) / f'ledger{index}.sqlite3'}"
                else:
                    assert redis_url is not None
                    url = f"{redis_url.rsplit('/', 1)[0]}/{index}"  # its own database on the same server
                prefixes[store + suffix] = (guarded_prefix(url, sim_url), code)
        os.environ["XDG_STATE_HOME"] = str(Path(tmp) / "state")  # the wrapper's events and logs stay here
        names = list(prefixes)
        samples: dict[tuple[str, bool], list[int]] = {(n, s): [] for n in names for s in modes}
        per_round: dict[tuple[str, bool], list[float]] = {(n, s): [] for n in names for s in modes}
        cpu_per_call: dict[tuple[str, bool], list[float]] = {(n, s): [] for n in names for s in modes}
        run_cpu: dict[tuple[str, bool], list[float]] = {(n, s): [] for n in names for s in modes}
        for round_index in range(args.rounds):
            order = names[round_index % len(names) :] + names[: round_index % len(names)]
            for stream in modes:
                for name in order:
                    prefix, code = prefixes[name]
                    times, cpu, whole = run_agent(prefix, code, agent, sim_url, args.calls, args.warmup, stream)
                    samples[(name, stream)] += times
                    cpu_per_call[(name, stream)].append(cpu / 1e3)
                    run_cpu[(name, stream)].append(whole / 1e3)
                    per_round[(name, stream)].append(statistics.median(times) / 1e6)
            print(f"  round {round_index + 1}/{args.rounds} done, load {load_average()}", flush=True)
    load_after = load_average()
    print()
    for suffix, code in checkouts.items():
        print(f"code{suffix or ' (this checkout)'}: {code}")
    print(
        f"{'ledger':<16} {'streamed':<9} {'median ms':>10} {'p90 ms':>8} {'p99 ms':>8} {'mean ms':>8}"
        f" {'+median ms':>11} {'ratio':>6}"
        f" {'CPU µs/call':>12} {'+CPU':>6} {'+run CPU':>8}  verdict"
    )
    verdicts = []
    for stream in modes:
        base = statistics.median(samples[("plain", stream)]) / 1e6
        for name in names:
            values = samples[(name, stream)]
            median = statistics.median(values) / 1e6
            p90 = statistics.quantiles(values, n=10)[8] / 1e6
            p99 = statistics.quantiles(values, n=100)[98] / 1e6
            mean = statistics.fmean(values) / 1e6
            added = median - base
            verdict = ""
            if name != "plain":
                pairs = zip(per_round[(name, stream)], per_round[("plain", stream)], strict=True)
                rounds_added = [guarded - plain for guarded, plain in pairs]
                spread = (
                    f" (per round {min(rounds_added):+.3f} to {max(rounds_added):+.3f},"
                    f" median {statistics.median(rounds_added):+.3f})"
                )
                target = TARGET_MS[name.split("@")[0]]
                ok = added <= target
                verdict = f"{'PASS' if ok else 'FAIL'} (target <= {target:.2f} ms){spread}"
                if "@" not in name:  # the verdict is this checkout's; a compared one is for before -> after
                    verdicts.append(ok)
            added_text = "" if name == "plain" else f"{added:+.3f}"
            ratio = "" if name == "plain" else f"{median / base:.2f}x"
            streamed = "yes" if stream else "no"
            cpu = statistics.median(cpu_per_call[(name, stream)])
            cpu_base = statistics.median(cpu_per_call[("plain", stream)])
            cpu_added = "" if name == "plain" else f"{cpu - cpu_base:+.0f}"
            whole = statistics.median(run_cpu[(name, stream)]) - statistics.median(run_cpu[("plain", stream)])
            whole_added = "" if name == "plain" else f"{whole:+.0f}"
            print(
                f"{name:<16} {streamed:<9} {median:>10.3f} {p90:>8.3f} {p99:>8.3f} {mean:>8.3f}"
                f" {added_text:>11} {ratio:>6} {cpu:>12.0f} {cpu_added:>6} {whole_added:>8}  {verdict}"
            )
    print()
    print(f"load average before: {load_before}; after: {load_after}")
    print(f"verdict: {'PASS' if all(verdicts) else 'FAIL'} ({sum(verdicts)} of {len(verdicts)} cells within target)")
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
