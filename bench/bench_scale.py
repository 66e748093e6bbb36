"""What the guard costs as processes grow: calls per second and added ms per call against unguarded, in one run.

    python bench/bench_scale.py [--procs 1,8,32] [--stores sqlite,redis] [--rounds 3] [--calls 300]
                                [--layout one-run|runs] [--stream] [--simulators 1]
                                [--env KEY=VALUE ...] [--compare NAME:KEY=VALUE,KEY=VALUE ...]

The bundled simulator (``quotawrap simulate``, zero latency, short answers) runs in its own process
(``--simulators K``: K of them, the workers spread over them, so one simulator does not cap a large
machine). An agent on the real ``openai`` SDK makes sequential small chat calls in each of N worker
processes (``--procs``), unguarded (``python agent.py``) and guarded (``quotawrap run --quiet --store ...
-- python agent.py``) with the SQLite ledger and with Redis (a private ``redis-server`` on a free loopback
port). ``--layout one-run`` (default): one wrapper, its agent forks the N workers (multiprocessing, as a
parallel agent does), so they share the run's settle relay, draw notes and ledger; ``--layout runs``: N
wrappers of one worker each, sharing the ledger only.

Every worker warms up (``--warmup`` calls), says it is ready and waits; the timed window opens for all
at once and closes when the last worker is done, so start-up (interpreters, the wrapper's, imports) and
the wrapper's close are outside it. Per cell: calls per second over the window (all workers' calls),
the median and p90 of one call as timed inside the workers, and the CPU spent in the window per call by
the workers, the wrapper(s) and redis-server (the simulator's is left out: it serves both sides). Each
guarded figure is also given as a ratio to the unguarded one of the same round: cells are interleaved
and rotated per round, so drift on a shared machine hits them alike. Caps are raised out of the way so
no call is refused.

Switches for the guarded runs: ``--env KEY=VALUE`` is set in every guarded run's environment (the
wrapper's, and so its child's); ``--compare NAME:KEY=VALUE,...`` (repeatable) adds a set of variables
whose guarded cells run in the same rounds as the others, each with a ledger of its own. With one
``--compare`` the cells without it run too, as the reference; with several, the first is the reference.
Each set is then printed against the reference: its calls per second and added ms per call, as the median
of the per-round differences. ``PYTHONPATH=DIR`` in a set runs another checkout's quotawrap (a ledger of
its own: another version may keep another schema), e.g. ``--compare main:PYTHONPATH=/tmp/main``; a
set's values may not hold a comma. Prints numbers, asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from _machine import load_average, machine_line  # bench/ is the script's directory
from bench_agent_overhead import MODEL, REPO_ROOT, guarded_prefix, redis_store, simulator
from bench_guard_steps import _server_pid

READY_TIMEOUT_S = 600.0  # 32 wrappers starting on two busy cores take tens of seconds
PLAIN = "unguarded"

# A worker: warm up, say so, wait for the common start, time its calls, write what it saw.
AGENT = r"""
import json, multiprocessing, os, sys, time
import openai

urls, procs, first = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
calls, warmup, stream, model, folder = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "1", sys.argv[7], sys.argv[8]
messages = [{"role": "user", "content": "彩虹有几种颜色？Answer in one short sentence."}]


def once(client):
    if stream:
        for _chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=64, stream=True):
            pass
    else:
        client.chat.completions.create(model=model, messages=messages, max_tokens=64).choices[0].message.content


def client_for(index):
    return openai.OpenAI(base_url=urls[index % len(urls)], api_key="sk-bench-not-a-key", max_retries=0)


def work(index):
    client = client_for(index)
    for _ in range(warmup):
        once(client)
    open(os.path.join(folder, f"ready-{index}"), "w").close()
    go = os.path.join(folder, "go")
    while not os.path.exists(go):
        time.sleep(0.002)
    times = []
    cpu, start = time.process_time_ns(), time.monotonic_ns()  # this process's CPU, every thread
    for _ in range(calls):
        began = time.perf_counter_ns()
        once(client)
        times.append(time.perf_counter_ns() - began)
    end, cpu = time.monotonic_ns(), time.process_time_ns() - cpu
    path = os.path.join(folder, f"out-{index}.json")
    with open(path + ".part", "w") as handle:
        json.dump({"times": times, "cpu_ns": cpu, "start_ns": start, "end_ns": end}, handle)
    os.replace(path + ".part", path)


if __name__ == "__main__":
    once(client_for(first))  # lazy imports (the SDK's, a guard's tokenizer) once, before the fork, not per worker
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=work, args=(first + i,)) for i in range(procs)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    sys.exit(1 if any(worker.exitcode for worker in workers) else 0)
"""


@dataclasses.dataclass(frozen=True)
class Cell:
    name: str  # "unguarded", "sqlite", "redis@NAME"
    store: str | None  # None: unguarded
    url: str | None  # the ledger
    env: Mapping[str, str]  # set in the guarded runs' environment


@dataclasses.dataclass(frozen=True)
class Sample:
    """One cell's run: every timed call, and the window they fell in."""

    times_ns: list[int]
    window_s: float
    cpu_s: float  # workers + wrapper(s) + redis-server, in the window

    @property
    def calls_per_s(self) -> float:
        return len(self.times_ns) / self.window_s

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ns) / 1e6

    @property
    def cpu_us_per_call(self) -> float:
        return self.cpu_s * 1e6 / len(self.times_ns)


def assignment(item: str, what: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key.replace("_", "").isalnum() or key[0].isdigit():
        raise argparse.ArgumentTypeError(f"{what}: {item!r} is not KEY=VALUE")
    return key, value


def assignments(text: str, what: str) -> dict[str, str]:
    """``KEY=VALUE[,KEY=VALUE...]`` as a dict; an empty text is no variable."""
    return dict(assignment(item, what) for item in text.split(",") if item)


def env_sets(base: Mapping[str, str], compare: Sequence[str]) -> list[tuple[str, dict[str, str]]]:
    """(name, variables) per set of guarded cells; the first is the reference the others are printed against."""
    sets = [("", dict(base))]
    named = []
    for entry in compare:
        name, sep, rest = entry.partition(":")
        if not sep or not name or "=" in name:
            raise argparse.ArgumentTypeError(f"--compare {entry!r}: expected NAME:KEY=VALUE[,KEY=VALUE...]")
        named.append((name, {**base, **assignments(rest, f"--compare {name}")}))
    if len({name for name, _ in named}) < len(named):
        raise argparse.ArgumentTypeError("--compare: each set needs a name of its own")
    return sets + named if len(named) == 1 else named or sets


def proc_cpu_s(pid: int) -> float:
    """User + system CPU of a live process, every thread (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_cell(
    cell: Cell, procs: int, layout: str, folder: Path, agent: Path, sim_urls: Sequence[str], args: argparse.Namespace
) -> Sample:
    folder.mkdir()
    prefix: list[str] = []
    if cell.url is not None:
        prefix = guarded_prefix(cell.url, sim_urls[0])
        prefix[-1:] = [*(f"--base-url={url}" for url in sim_urls[1:]), "--"]
    groups = [(procs, 0)] if layout == "one-run" else [(1, index) for index in range(procs)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **cell.env}
    tail = [str(args.calls), str(args.warmup), "1" if args.stream else "0", MODEL, str(folder)]
    started: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        for count, first in groups:
            argv = [*prefix, sys.executable, str(agent), ",".join(sim_urls), str(count), str(first), *tail]
            errors = folder / f"stderr-{first}.txt"
            with errors.open("wb") as sink:  # a file, not a pipe: 32 processes' output never blocks one
                process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, cwd=folder, env=env)
            started.append((process, errors))
        _wait_for(folder, "ready-", procs, started)
        watched = [process.pid for process, _ in started]
        if cell.store == "redis" and cell.url is not None:
            server = _server_pid(cell.url)
            watched += [server] if server else []
        cpu_before = sum(map(proc_cpu_s, watched))
        (folder / "go").touch()
        _wait_for(folder, "out-", procs, started)
        cpu_window = sum(map(proc_cpu_s, watched)) - cpu_before
        for process, errors in started:
            if process.wait(timeout=READY_TIMEOUT_S) != 0:
                raise RuntimeError(f"{cell.name}: exit {process.returncode}: {errors.read_text()[-2000:]}")
    finally:
        for process, _ in started:
            if process.poll() is None:
                process.kill()
                process.wait()
    outs = [json.loads((folder / f"out-{index}.json").read_text()) for index in range(procs)]
    window = (max(out["end_ns"] for out in outs) - min(out["start_ns"] for out in outs)) / 1e9
    workers_cpu = sum(out["cpu_ns"] for out in outs) / 1e9
    return Sample([t for out in outs for t in out["times"]], window, workers_cpu + cpu_window)


def _wait_for(folder: Path, prefix: str, count: int, started: Sequence[tuple[subprocess.Popen[bytes], Path]]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while sum(1 for path in folder.iterdir() if path.name.startswith(prefix) and path.suffix != ".part") < count:
        for process, errors in started:
            if process.poll() not in (None, 0):
                raise RuntimeError(f"agent exited {process.returncode}: {errors.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{folder.name}: fewer than {count} workers reached {prefix!r} in time")
        time.sleep(0.01)


def ledger_url(store: str, index: int, tmp: Path, redis_url: str | None) -> str:
    if store == "sqlite":
        return f"sqlite:///{tmp / f'ledger{index}.sqlite3'}"
    if redis_url is None:
        raise SystemExit("bench_scale: Redis needs redis-server on PATH or REDIS_URL")
    return f"{redis_url.rsplit('/', 1)[0]}/{index}"  # a database of its own on the same server


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", default="1,8,32", help="comma-separated worker process counts (default 1,8,32)")
    parser.add_argument("--stores", default="sqlite,redis", help="comma-separated: sqlite, redis")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--calls", type=int, default=300, help="timed calls per worker (default 300)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed calls first in each worker (default 20)")
    parser.add_argument("--layout", choices=("one-run", "runs"), default="one-run")
    parser.add_argument("--stream", action="store_true", help="streamed calls (default: not streamed)")
    parser.add_argument("--simulators", type=int, default=1, help="simulator processes (default 1)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="set in every guarded run")
    parser.add_argument(
        "--compare", action="append", default=[], metavar="NAME:KEY=VALUE,...", help="a set of guarded cells more"
    )
    args = parser.parse_args(argv)
    try:
        base = dict(assignment(item, "--env") for item in args.env)
        sets = env_sets(base, args.compare)
        procs_list = [int(p) for p in args.procs.split(",") if p]
    except (argparse.ArgumentTypeError, ValueError) as exc:
        parser.error(str(exc))
    stores = [s for s in args.stores.split(",") if s]
    if not procs_list or min(procs_list) < 1 or set(stores) - {"sqlite", "redis"} or args.simulators < 1:
        parser.error("--procs takes counts >= 1, --stores sqlite and/or redis, --simulators >= 1")
    if len(stores) * len(sets) > 15:
        parser.error("at most 15 guarded cells per process count (one Redis database each)")

    import openai

    print(f"Scale: guarded against unguarded as processes grow — {machine_line()}")
    print(
        f"openai {openai.__version__}; layout {args.layout}; {args.rounds} rounds x {args.calls} calls per worker"
        f" ({'streamed' if args.stream else 'not streamed'}), {args.simulators} simulator(s), runs interleaved"
    )
    for name, variables in sets:
        shown = ", ".join(f"{k}={v}" for k, v in variables.items()) or "(none)"
        print(f"  guarded set {name or '(reference)'}: {shown}")
    load_before = load_average()
    print(f"load average before: {load_before}", flush=True)
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="quotawrap-scale-bench-")))
        sim_urls = [stack.enter_context(simulator()) for _ in range(args.simulators)]
        redis_url = stack.enter_context(redis_store()) if "redis" in stores else None
        agent = tmp / "agent.py"
        agent.write_text(AGENT)
        os.environ["XDG_STATE_HOME"] = str(tmp / "state")  # the wrappers' events and logs stay here
        cells = [Cell(PLAIN, None, None, {})]
        for store in stores:
            for index, (name, variables) in enumerate(sets, start=1):
                url = ledger_url(store, index, tmp, redis_url)
                cells.append(Cell(store + (f"@{name}" if name else ""), store, url, variables))
        samples: dict[tuple[int, str], list[Sample]] = {(p, c.name): [] for p in procs_list for c in cells}
        runs = 0
        for round_index in range(args.rounds):
            for procs in procs_list:
                shift = round_index % len(cells)
                for cell in cells[shift:] + cells[:shift]:
                    runs += 1
                    sample = run_cell(cell, procs, args.layout, tmp / f"run{runs}", agent, sim_urls, args)
                    samples[(procs, cell.name)].append(sample)
            print(f"  round {round_index + 1}/{args.rounds} done, load {load_average()}", flush=True)
    load_after = load_average()
    report(samples, procs_list, cells, stores, sets)
    print(f"load average before: {load_before}; after: {load_after}")
    return 0


def report(
    samples: Mapping[tuple[int, str], list[Sample]],
    procs_list: Sequence[int],
    cells: Sequence[Cell],
    stores: Sequence[str],
    sets: Sequence[tuple[str, Mapping[str, str]]],
) -> None:
    print()
    print(
        f"{'procs':>5} {'cell':<18} {'calls/s':>9} {'x unguarded':>12} {'median ms':>10} {'+ms/call':>9}"
        f" {'x unguarded':>12} {'p90 ms':>8} {'CPU µs/call':>12} {'+CPU':>6}  per round: x calls/s"
    )
    for procs in procs_list:
        plain = samples[(procs, PLAIN)]
        plain_cps = statistics.median(s.calls_per_s for s in plain)
        plain_ms = statistics.median(t for s in plain for t in s.times_ns) / 1e6
        plain_cpu = statistics.median(s.cpu_us_per_call for s in plain)
        for cell in cells:
            mine = samples[(procs, cell.name)]
            times = [t for s in mine for t in s.times_ns]
            cps = statistics.median(s.calls_per_s for s in mine)
            median = statistics.median(times) / 1e6
            p90 = statistics.quantiles(times, n=10)[8] / 1e6 if len(times) > 1 else median
            cpu = statistics.median(s.cpu_us_per_call for s in mine)
            line = f"{procs:>5} {cell.name:<18} {cps:>9.0f}"
            if cell.store is None:
                line += f" {'':>12} {median:>10.3f} {'':>9} {'':>12} {p90:>8.3f} {cpu:>12.0f}"
            else:
                per_round = [g.calls_per_s / p.calls_per_s for g, p in zip(mine, plain, strict=True)]
                line += (
                    f" {cps / plain_cps:>11.2f}x {median:>10.3f} {median - plain_ms:>+9.3f}"
                    f" {median / plain_ms:>11.2f}x {p90:>8.3f} {cpu:>12.0f} {cpu - plain_cpu:>+6.0f}"
                    f"  {min(per_round):.2f}-{max(per_round):.2f}"
                )
            print(line)
    if len(sets) < 2:
        return
    reference = sets[0][0]
    print()
    print(f"Each set against {reference or 'the reference'} (median of per-round differences, same rounds):")
    for name, _ in sets[1:]:
        for store in stores:
            for procs in procs_list:
                ref = samples[(procs, store + (f"@{reference}" if reference else ""))]
                mine = samples[(procs, f"{store}@{name}")]
                pairs = list(zip(mine, ref, strict=True))
                cps_change = statistics.median(m.calls_per_s / r.calls_per_s - 1 for m, r in pairs)
                ms_change = statistics.median(m.median_ms - r.median_ms for m, r in pairs)
                print(
                    f"  {name:<12} {store:<7} {procs:>3} procs: calls/s {cps_change:+.1%}, ms per call {ms_change:+.3f}"
                )


if __name__ == "__main__":
    raise SystemExit(main())
