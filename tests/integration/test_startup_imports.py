"""What the wrapper has imported when its child starts: nothing a plain run does not need.

No timing: the real CLI runs a real child, and an audit hook (``subprocess.Popen``,
``os.posix_spawn``, ``os.exec``, ``os.fork``) records ``sys.modules`` at the moment the child is
launched. An eager ``import click`` (or the price table, the tokenizers, the status and report
modules) on the way to the child fails it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

_DRIVER = """
import json, sys
import gc
MARK, OUT, ARGS = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
def hook(event, args):
    if event in ("subprocess.Popen", "os.posix_spawn", "os.exec") and MARK in repr(args):
        with open(OUT, "w") as handle:
            json.dump({"modules": sorted(sys.modules), "gc": gc.isenabled()}, handle)
sys.addaudithook(hook)
from quotawrap.cli import main
sys.argv = ["quotawrap", *ARGS]
main()  # as the console script calls it
"""

# Loaded later (the summary, a call's estimate) or never by a plain run: not before the child starts.
NOT_BEFORE_THE_CHILD = (
    "click",
    "quotawrap.cli.commands",
    "quotawrap.cli.ledger_commands",
    "quotawrap.core.prices",
    "quotawrap.core.endpoint_prices",
    "quotawrap.core.estimate",
    "quotawrap.core.tokens",
    "quotawrap.books.status",
    "quotawrap.wrapper.summary",
    "quotawrap.books.report",
    "quotawrap.admission.guard",
    "quotawrap.settling.call",
    "quotawrap.settling.settler",
    "quotawrap.books.sync",  # only a run with a balance source (balance.sync_source tells)
    "quotawrap.core.expiry",
    "quotawrap.intercept.httpx_adapter",
    "quotawrap.intercept.requests_adapter",
    "quotawrap.intercept.aiohttp_adapter",
    "quotawrap.intercept.stdlib_adapter",
    "tokenizers",
    "tiktoken",
    "httpx",
    "secrets",
    # standard-library and third-party helpers whose imports cost more than the start path's own use
    "shutil",  # support.processes.which instead (shutil imports the compressors)
    "tempfile",  # registry's run directory (tempfile imports random, hashlib, shutil)
    "hashlib",  # redact.key_fingerprint imports it when it has a secret to fingerprint
    "platformdirs",  # config.paths.user_state_dir applies its XDG rule on Linux
    "uuid",  # a hold id is drawn in the child (uuid imports platform)
    "socket",  # _host.hostname instead; the watcher's name lookups import it once the child runs
    "subprocess",  # the child and git's queries are spawned with os.posix_spawn
    "ctypes",  # the subreaper's prctl through _ctypes itself
)


def _at_child_start(tmp_path: Path, options: list[str]) -> dict[str, Any]:
    mark = f"started-by-the-test-{tmp_path.name}"
    out = tmp_path / "modules.json"
    args = [*options, "--store", f"sqlite:///{tmp_path / 'l.sqlite3'}", "--", sys.executable, "-c", f"# {mark}"]
    result = subprocess.run(
        [sys.executable, "-c", _DRIVER, mark, str(out), json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert out.exists(), "the child was never launched"
    return dict(json.loads(out.read_text()))


@pytest.mark.parametrize("options", [["--quiet"], []], ids=["quiet", "with-summary"])
def test_the_wrapper_starts_its_child_without_loading_what_it_does_not_need(tmp_path: Path, options: list[str]) -> None:
    loaded = set(_at_child_start(tmp_path, options)["modules"])
    assert (
        "quotawrap.wrapper.run" in loaded and "quotawrap.ledger.sqlite.ledger" in loaded
    )  # the hook saw the real start
    early = sorted(
        name for name in loaded if any(name == bad or name.startswith(f"{bad}.") for bad in NOT_BEFORE_THE_CHILD)
    )
    assert not early, f"imported before the child starts: {early}"


@pytest.mark.parametrize("options", [["--quiet"], []], ids=["quiet", "with-summary"])
def test_the_collector_is_back_on_when_the_child_starts(tmp_path: Path, options: list[str]) -> None:
    """Start-up runs without the garbage collector (cli.main); the run must turn it back on, or a
    long run's cycles (its threads' connections, the live view's frames) would never be collected."""
    assert _at_child_start(tmp_path, options)["gc"] is True


def test_a_subcommand_still_goes_through_click(tmp_path: Path) -> None:
    """The click group is still there for everything but the plain run."""
    result = subprocess.run(
        [sys.executable, "-m", "quotawrap", "--help"], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert result.returncode == 0 and "Usage: quotawrap" in result.stdout


@pytest.mark.parametrize("options", [["--quiet"], []], ids=["quiet", "with-summary"])
def test_the_run_leaves_its_ledger_whole_in_one_file(tmp_path: Path, options: list[str]) -> None:
    """The wrapper's connections are all closed by its exit (the garbage collector spared at exit must
    not keep one open): the last close folds the WAL back, so the ledger file alone holds the run."""
    ledger = tmp_path / "l.sqlite3"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "quotawrap",
            *options,
            "--store",
            f"sqlite:///{ledger}",
            "--",
            sys.executable,
            "-c",
            "pass",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert ledger.exists()
    assert not ledger.with_name("l.sqlite3-wal").exists(), "a connection outlived the run"
