"""Start-up cost of the injected hook in a child interpreter. Prints numbers, asserts nothing.

    python bench/bench_startup.py [--runs 40]

Each variant is a fresh ``python`` process timed from the parent (fork, exec, interpreter start,
the command, exit); the variants are interleaved in rounds and rotated so machine drift hits them
alike. Reported: median and p90 in milliseconds, and the ratio to the plain interpreter.

* ``plain pass``    ``python -c pass``, no hook;
* ``hooked pass``   the same with the wrapper's injection (``PYTHONPATH=<repo>/sitecustomize_hook``,
                    ``QUOTAWRAP_RUN_ID``, ``QUOTAWRAP_HOME=<repo>``): the target case, a child that
                    imports no HTTP client, at most 1.2x plain;
* ``wrapper quiet`` the whole ``quotawrap --quiet -- python -c pass``: the wrapper's own start-up
                    (its settings, the ledger, the run's record) and end (closing the run's books)
                    on top of a hooked child;
* ``wrapper pass``  the whole ``quotawrap -- python -c pass`` as a user types it: the same plus the
                    expiry warnings and the summary on stderr. Issue 12's target for both:
                    at most 1.5x plain + 30 ms;
* ``plain httpx``   ``python -c "import httpx"``;
* ``hooked httpx``  the same, hooked: the lazy patch (guard, ledger and usage modules) is paid here.

``--baseline PATH`` adds ``before quiet`` and ``before pass``: the same two commands with another
checkout's quotawrap (``git worktree add /tmp/base main``), in the same rounds.

Then the ``-X importtime`` top offenders of the wrapper itself, of the hooked ``pass`` child, and of
the lazy patch.

Bytecode: every child gets ``PYTHONPYCACHEPREFIX=<temp dir>`` and may write it, so after the
warm-up runs all modules load from ``.pyc`` as in an installed package, whatever
``PYTHONDONTWRITEBYTECODE`` says in the parent (it is set on some CI machines, and compiling
quotawrap's modules from source would be measured instead). ``--no-pyc`` measures that case
on purpose: no prefix and ``PYTHONDONTWRITEBYTECODE=1``, so the interpreter's own modules load
from their shipped ``.pyc`` while a checkout that was never byte-compiled (no ``__pycache__``
beside quotawrap's sources) is compiled in every child. ``--set-up`` is how issue 12's checker
measures, after the README's set-up (``make demo`` / ``make test``, whose venv target byte-compiles
the checkout): it byte-compiles this checkout (and ``--baseline``'s) as ``make bytecode`` does, then
measures as ``--no-pyc`` (``PYTHONDONTWRITEBYTECODE=1``, the ``.pyc`` beside the sources).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from _machine import load_average, machine_line  # bench/ is the script's directory

__all__ = ["main"]

REPO_ROOT = Path(__file__).resolve().parents[1]
HOOK_DIR = REPO_ROOT / "sitecustomize_hook"
TARGET_RATIO = 1.2
# issue 12: ``quotawrap -- python -c pass`` against ``python -c pass``
WRAPPER_TARGET_RATIO = 1.5
WRAPPER_TARGET_ADDED_MS = 30.0
PYTHON = sys.executable


@dataclass(frozen=True)
class Variant:
    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str]


_BYTECODE: dict[str, str] = {}  # set once by main(): where children keep (or may not write) .pyc


def clean_env() -> dict[str, str]:
    """The parent's environment without anything that would inject or configure quotawrap."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHONPATH", "PYTHONSTARTUP", "PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")
        and not key.startswith("QUOTAWRAP_")
    }
    env.update(_BYTECODE)
    return env


def use_bytecode_cache(prefix: str | None) -> None:
    """Children keep their bytecode under ``prefix``; None: they write none (``--no-pyc``)."""
    _BYTECODE.clear()
    if prefix is None:
        _BYTECODE["PYTHONDONTWRITEBYTECODE"] = "1"
    else:
        _BYTECODE["PYTHONPYCACHEPREFIX"] = prefix


def hooked_env() -> dict[str, str]:
    """What the wrapper gives its child (wrapper/child.child_environment), minus the settings."""
    env = clean_env()
    env["PYTHONPATH"] = str(HOOK_DIR)
    env["QUOTAWRAP_RUN_ID"] = "bench-startup"
    env["QUOTAWRAP_HOME"] = str(REPO_ROOT)
    return env


def wrapper_argv(store: str, *options: str) -> tuple[str, ...]:
    """``quotawrap [OPTIONS] --store ... -- python -c pass``: the console script when installed."""
    script = Path(PYTHON).with_name("quotawrap")
    head = (str(script),) if script.exists() else (PYTHON, "-m", "quotawrap")
    return (*head, *options, "--store", store, "--", PYTHON, "-c", "pass")


def wrapper_env(repo: Path = REPO_ROOT) -> dict[str, str]:
    env = clean_env()
    env["PYTHONPATH"] = str(repo)  # the checkout's quotawrap, installed or not
    return env


def variants(store: str, baseline: Path | None = None) -> list[Variant]:
    """The variants; with ``baseline`` (another checkout, e.g. ``git worktree add /tmp/base main``) its
    wrapper too, in the same rounds, so a before/after ratio does not depend on the machine's load."""
    plain, hooked, wrapper = clean_env(), hooked_env(), wrapper_env()
    chosen = [
        Variant("plain pass", (PYTHON, "-c", "pass"), plain),
        Variant("hooked pass", (PYTHON, "-c", "pass"), hooked),
        Variant("wrapper quiet", wrapper_argv(store, "--quiet"), wrapper),
        Variant("wrapper pass", wrapper_argv(store), wrapper),
    ]
    if baseline is not None:
        before = wrapper_env(baseline)
        chosen += [
            Variant("before quiet", wrapper_argv(store + ".before", "--quiet"), before),
            Variant("before pass", wrapper_argv(store + ".before"), before),
        ]
    return [
        *chosen,
        Variant("plain httpx", (PYTHON, "-c", "import httpx"), plain),
        Variant("hooked httpx", (PYTHON, "-c", "import httpx"), hooked),
    ]


def run_once(variant: Variant) -> float:
    """Wall seconds of one child, from spawn to exit."""
    start = time.perf_counter()
    result = subprocess.run(
        variant.argv, env=dict(variant.env), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False
    )
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"{variant.name}: exit {result.returncode}: {result.stderr.decode()[-500:]}")
    return elapsed


def check_hook_loads() -> None:
    """The hooked child must really load quotawrap's hook, or the figures mean nothing."""
    code = "import sys, quotawrap.bootstrap as b; sys.exit(0 if b.loaded else 1)"
    result = subprocess.run([PYTHON, "-c", code], env=hooked_env(), capture_output=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"the hook did not load in the child: {result.stderr.decode()[-500:]}")


def measure(chosen: Sequence[Variant], runs: int, warmup: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {variant.name: [] for variant in chosen}
    for variant in chosen:  # page cache, .pyc files
        for _ in range(warmup):
            run_once(variant)
    for index in range(runs):
        shift = index % len(chosen)
        for variant in [*chosen[shift:], *chosen[:shift]]:
            samples[variant.name].append(run_once(variant))
    return samples


def p90(values: Sequence[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[8]


def report(samples: Mapping[str, list[float]]) -> bool:
    """Print the table; returns whether the no-HTTP-client target and the wrapper's are met."""
    med = {name: statistics.median(values) * 1000 for name, values in samples.items()}
    baselines = {
        "plain pass": "plain pass",
        "hooked pass": "plain pass",
        "wrapper quiet": "plain pass",
        "wrapper pass": "plain pass",
        "before quiet": "plain pass",
        "before pass": "plain pass",
        "plain httpx": "plain httpx",
        "hooked httpx": "plain httpx",
    }
    header = f"{'variant':<14} {'n':>4} {'median ms':>10} {'p90 ms':>8} {'+median ms':>11} {'ratio':>7}  vs"
    print(header)
    print("-" * len(header))
    for name, values in samples.items():
        base = baselines[name]
        added = "" if base == name else f"{med[name] - med[base]:+.2f}"
        ratio = "" if base == name else f"{med[name] / med[base]:.2f}x"
        print(
            f"{name:<14} {len(values):>4} {med[name]:>10.2f} {p90(values) * 1000:>8.2f} {added:>11} {ratio:>7}"
            f"  {'' if base == name else base}"
        )
    ratio = med["hooked pass"] / med["plain pass"]
    met = ratio <= TARGET_RATIO
    print()
    print(
        f"Target: hooked child that imports no HTTP client ≤ {TARGET_RATIO}x plain: "
        f"{'PASS' if met else 'FAIL'} ({ratio:.2f}x, {med['hooked pass'] - med['plain pass']:+.2f} ms)"
    )
    print(
        f"Lazy patch on first `import httpx`: {med['hooked httpx'] - med['plain httpx']:+.2f} ms "
        f"(of which hook start-up {med['hooked pass'] - med['plain pass']:+.2f} ms)"
    )
    budget = WRAPPER_TARGET_RATIO * med["plain pass"] + WRAPPER_TARGET_ADDED_MS
    for name in ("wrapper quiet", "wrapper pass"):
        wrapper_met = med[name] <= budget
        met = met and wrapper_met
        print(
            f"Target (issue 12): {name} ≤ {WRAPPER_TARGET_RATIO}x plain + {WRAPPER_TARGET_ADDED_MS:g} ms"
            f" = {budget:.1f} ms: {'PASS' if wrapper_met else 'FAIL'} ({med[name]:.1f} ms,"
            f" {med[name] / med['plain pass']:.2f}x; the wrapper's own start and end"
            f" {med[name] - med['hooked pass']:+.1f} ms over a hooked child)"
        )
    for name in ("quiet", "pass"):
        if f"before {name}" in med:
            before, after = med[f"before {name}"], med[f"wrapper {name}"]
            print(
                f"wrapper {name} against the baseline checkout: {before:.1f} -> {after:.1f} ms ({after / before:.2f}x)"
            )
    return met


# -- -X importtime -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImportTime:
    module: str
    depth: int  # nesting level in the import tree (0: imported by the program or site itself)
    self_us: int
    cumulative_us: int


def import_times(argv: Sequence[str], env: Mapping[str, str]) -> list[ImportTime]:
    """The rows of ``python -X importtime ARGV...`` in its order (each module after its imports)."""
    result = subprocess.run(
        [PYTHON, "-X", "importtime", *argv], env=dict(env), capture_output=True, text=True, check=True
    )
    rows = []
    for line in result.stderr.splitlines():
        if not line.startswith("import time:") or "[us]" in line:
            continue
        self_us, cumulative_us, raw_name = line.removeprefix("import time:").split("|", 2)
        name = raw_name.rstrip()
        depth = (len(name) - len(name.lstrip()) - 1) // 2
        rows.append(ImportTime(name.strip(), depth, int(self_us), int(cumulative_us)))
    return rows


def subtree(rows: Sequence[ImportTime], module: str) -> list[ImportTime]:
    """``module``'s row (its heaviest occurrence) and every import made while it was executing."""
    candidates = [index for index, row in enumerate(rows) if row.module == module]
    if not candidates:
        return []
    top = max(candidates, key=lambda index: rows[index].cumulative_us)
    found = [rows[top]]
    for row in reversed(rows[:top]):  # children are printed before their parent
        if row.depth <= rows[top].depth:
            break
        found.append(row)
    return found


def representative_subtree(
    argv: Sequence[str], env: Mapping[str, str], module: str, runs: int
) -> tuple[list[ImportTime], list[int]]:
    """The subtree of the run whose ``module`` cumulative time is the median of ``runs`` runs."""
    trees = [subtree(import_times(argv, env), module) for _ in range(runs)]
    trees = [tree for tree in trees if tree]
    if not trees:
        raise RuntimeError(f"{module} was not imported by {argv}")
    trees.sort(key=lambda tree: tree[0].cumulative_us)
    return trees[len(trees) // 2], [tree[0].cumulative_us for tree in trees]


def print_offenders(title: str, tree: Sequence[ImportTime], cumulative: Sequence[int], top: int) -> None:
    """The heaviest modules of one import subtree, by self time."""
    head = tree[0]
    print(
        f"{title}: `{head.module}` cumulative {head.cumulative_us / 1000:.2f} ms in the median run"
        f" (range {min(cumulative) / 1000:.2f}-{max(cumulative) / 1000:.2f} ms), {len(tree)} modules"
    )
    print(f"  {'self µs':>8} {'cumul. µs':>10}  module")
    for row in sorted(tree, key=lambda row: row.self_us, reverse=True)[:top]:
        print(f"  {row.self_us:>8} {row.cumulative_us:>10}  {'  ' * (row.depth - head.depth)}{row.module}")
    print()


# -- main -------------------------------------------------------------------------------------------


def bytecode_text(no_pyc: bool, checkouts: Sequence[Path]) -> str:
    if not no_pyc:
        return "warm, in a temp prefix (as an installed package)"
    return "none written (PYTHONDONTWRITEBYTECODE=1); " + "; ".join(
        f"{checkout}/quotawrap/__pycache__ "
        + (
            "exists, so quotawrap loads from it"
            if (checkout / "quotawrap" / "__pycache__").is_dir()
            else "absent: quotawrap compiled in every run"
        )
        for checkout in checkouts
    )


def byte_compile(checkout: Path) -> None:
    """What the Makefile's ``bytecode`` target does for a checkout (the venv target runs it)."""
    subprocess.run([PYTHON, "-m", "compileall", "-q", "quotawrap", "sitecustomize_hook"], cwd=checkout, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=40, help="timed runs per variant (default 40)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs per variant first")
    parser.add_argument("--importtime-runs", type=int, default=7, help="runs per -X importtime median")
    parser.add_argument("--top", type=int, default=15, help="offenders to list")
    parser.add_argument("--no-pyc", action="store_true", help="write no bytecode (see the module doc)")
    parser.add_argument("--baseline", type=Path, help="another checkout whose wrapper is timed alongside")
    parser.add_argument(
        "--set-up", action="store_true", help="byte-compile the checkouts as `make` does, then measure as --no-pyc"
    )
    args = parser.parse_args(argv)

    if args.set_up:
        for checkout in [REPO_ROOT, *([args.baseline] if args.baseline else [])]:
            byte_compile(checkout)
        args.no_pyc = True
    with tempfile.TemporaryDirectory(prefix="quotawrap-bench-") as tmp:
        pycache = Path(tmp) / "pycache"
        pycache.mkdir()
        use_bytecode_cache(None if args.no_pyc else str(pycache))
        check_hook_loads()
        store = f"sqlite:///{Path(tmp) / 'ledger.sqlite3'}"
        chosen = variants(store, args.baseline)
        print(f"Child start-up — {machine_line()}")
        print(f"python: {PYTHON}; {args.runs} runs per variant, interleaved and rotated; warmup {args.warmup}")
        checkouts = [REPO_ROOT, *([args.baseline] if args.baseline else [])]
        print(f"bytecode cache: {bytecode_text(args.no_pyc, checkouts)}")
        print(f"load average (1, 5, 15 min) at the start: {load_average()}")
        print()
        samples = measure(chosen, args.runs, args.warmup)
        report(samples)
        print(f"load average at the end of the timed rounds: {load_average()}")
        print()
        import_report(args.importtime_runs, args.top, store)
    return 0


def print_wrapper_offenders(store: str, runs: int, top: int) -> None:
    """The wrapper's own imports (the child is not traced: -X importtime is not inherited), by self time."""
    argv = ["-m", "quotawrap", "--quiet", "--store", store, "--", PYTHON, "-c", "pass"]
    trials = [import_times(argv, wrapper_env()) for _ in range(runs)]
    trials.sort(key=lambda rows: sum(row.self_us for row in rows))
    rows = trials[len(trials) // 2]
    totals = sorted(sum(row.self_us for row in trial) for trial in trials)
    print(
        f"the wrapper (`quotawrap --quiet -- python -c pass`): {len(rows)} modules,"
        f" {totals[len(totals) // 2] / 1000:.2f} ms of self time in the median run"
        f" (range {totals[0] / 1000:.2f}-{totals[-1] / 1000:.2f} ms; -X importtime inflates small modules)"
    )
    print(f"  {'self µs':>8} {'cumul. µs':>10}  module")
    for row in sorted(rows, key=lambda row: row.self_us, reverse=True)[:top]:
        print(f"  {row.self_us:>8} {row.cumulative_us:>10}  {'  ' * row.depth}{row.module}")
    quotawrap_us = sum(row.self_us for row in rows if row.module.split(".")[0] == "quotawrap")
    print(f"  of which quotawrap's own modules: {quotawrap_us / 1000:.2f} ms self")
    print()


def import_report(runs: int, top: int, store: str) -> None:
    hooked = hooked_env()
    print(f"-X importtime, top {top} by self time (median run of {runs})")
    print_wrapper_offenders(store, runs, top)
    tree, cumulative = representative_subtree(["-c", "pass"], hooked, "sitecustomize", runs)
    print_offenders("hooked `pass` child, the hook", tree, cumulative, top)
    tree, cumulative = representative_subtree(["-c", "import httpx"], hooked, "quotawrap.intercept.httpx_adapter", runs)
    print_offenders("hooked `import httpx` child, the lazy patch", tree, cumulative, top)
    if not Path(PYTHON).with_name("quotawrap").exists():
        print("note: no quotawrap console script beside python; the wrapper ran as `python -m quotawrap`")


if __name__ == "__main__":
    raise SystemExit(main())
