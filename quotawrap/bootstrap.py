"""What the injected hook (``sitecustomize`` or the ``.pth`` file) calls in every child interpreter.

It registers the process with the wrapper (one 0600 file per pid in the run directory, so the
wrapper can tell a Python process of its tree that runs without the hook), then only registers
post-import hooks: the guard, the ledger and the tokenizers load when the program first
imports an HTTP client, so a child that makes no HTTP calls pays almost nothing at start-up.
"""

from __future__ import annotations

import os
import sys

__all__ = ["RUN_DIR_VARIABLE", "RUN_ID_VARIABLE", "initialize", "loaded", "register_process"]

RUN_ID_VARIABLE = "QUOTAWRAP_RUN_ID"
RUN_DIR_VARIABLE = "QUOTAWRAP_RUN_DIR"
loaded = False


def _cmdline() -> bytes:
    try:
        with open("/proc/self/cmdline", "rb") as handle:
            return handle.read()
    except OSError:  # not Linux: the wrapper cannot watch /proc there anyway
        return "\0".join(getattr(sys, "orig_argv", sys.argv)).encode("utf-8", "surrogateescape") + b"\0"


def register_process() -> None:
    """Tell the wrapper this process (this program image of it) runs with the hook. Never raises.

    ``QUOTAWRAP_RUN_DIR`` may list several directories (a quotawrap run inside another): the
    process registers with every wrapper that watches it.
    """
    run_dirs = os.environ.get(RUN_DIR_VARIABLE)
    if not run_dirs:
        return
    cmdline = _cmdline()
    for run_dir in run_dirs.split(os.pathsep):
        try:
            fd = os.open(
                os.path.join(run_dir, f"proc-{os.getpid()}"),
                os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0),
                0o600,
            )
            try:
                os.write(fd, cmdline)
            finally:
                os.close(fd)
        except FileNotFoundError:
            pass  # that run is over and its directory gone (a grandchild that outlived the wrapper)
        except OSError as exc:
            sys.stderr.write(f"quotawrap: could not register this process with the wrapper: {exc}\n")


def initialize(*, swallow_exceptions: bool = True) -> None:
    """Install interception if this interpreter was launched by quotawrap. Never raises by default.

    Idempotent: the ``.pth`` file and the ``sitecustomize`` may both call it in one process.
    """
    global loaded
    if loaded or not os.environ.get(RUN_ID_VARIABLE):
        return
    try:
        register_process()
        if hasattr(os, "register_at_fork"):  # a forked child runs no site hook, but is guarded
            os.register_at_fork(after_in_child=register_process)
        from .intercept import install

        install()
        loaded = True
    except Exception as exc:
        if not swallow_exceptions:
            raise
        sys.stderr.write(f"quotawrap: could not install interception in this process: {exc!r}\n")
