"""Which Python processes of the run carry the hook, and which connections went around it.

The hook writes ``proc-<pid>`` (its command line) into the run directory as it loads; the
wrapper walks its child tree through ``/proc`` and names every Python process that has not
registered: one whose environment lost ``QUOTAWRAP_RUN_ID`` (``env={}``) or that runs with
``-S`` is known at once; any other gets a grace period to register (start-up under load), and
one that exits unregistered is reported too. A process that is not Python cannot carry the hook;
it is reported when it holds a connection to a guarded host (:mod:`.sockets`). ``--strict`` stops
such a process at once.

The connection guard appends refused and let-through connections to ``connections.jsonl``.
All files are 0600 in a 0700 directory created for the run, and removed with it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

from ..core.redact import redact_argv
from ..support.files import RUN_DIR_PREFIX, new_private_dir, remove_tree
from .sockets import open_peers

# Loaded once the child runs, beside its start, where every import delays it: no dataclasses, pathlib, json,
# signal, and the patterns compiled when a command is first redacted.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

    from .sockets import GuardedPeers

__all__ = ["ProcessWatcher", "RunDir", "UnguardedProcess", "publish_unguarded"]

_POLL_S = 0.05  # often enough to see short-lived processes, rare enough that reading /proc costs little CPU
_GRACE_S = 5.0  # start-up under heavy load: a hooked interpreter registers within milliseconds
_SHORT_GRACE_S = 0.5  # when neither the sitecustomize nor the .pth can reach the interpreter


def _python_name(name: str) -> bool:
    """Whether an executable's name is a CPython's, ``^python[0-9.]*[dmu]*$``, read without ``re``."""
    if not name.startswith("python"):
        return False
    rest = name[6:].lstrip("0123456789.")
    return rest.strip("dmu") == ""


class UnguardedProcess:
    """A process of the run that ran without the hook: its pid, command, why, and whether --strict stopped it."""

    __slots__ = ("command", "pid", "reason", "stopped")

    def __init__(self, pid: int, command: str, reason: str, stopped: bool = False) -> None:
        self.pid, self.command, self.reason, self.stopped = pid, command, reason, stopped

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UnguardedProcess) and self.as_dict() == other.as_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable, as the dataclass was

    def __repr__(self) -> str:
        return f"UnguardedProcess({', '.join(f'{key}={value!r}' for key, value in self.as_dict().items())})"

    def as_dict(self) -> dict[str, object]:
        return {"pid": self.pid, "command": self.command, "reason": self.reason, "stopped": self.stopped}


def publish_unguarded(events_log: str | None, record: UnguardedProcess) -> None:
    """Append ``record`` to the run's events log, where ``quotawrap status`` finds it while the run lives."""
    from ..support.events import EventLog

    EventLog(events_log).write({"ev": "unguarded", **record.as_dict(), "wrapper_pid": os.getpid()})


class RunDir:
    """The run's private directory, handed to the children as ``QUOTAWRAP_RUN_DIR``."""

    def __init__(self, path: str | None = None) -> None:
        """A new directory, or ``path``: one :func:`files.new_private_dir` made for the run."""
        self.directory = path or new_private_dir(RUN_DIR_PREFIX)

    @property
    def path(self) -> Path:
        from pathlib import Path

        return Path(self.directory)

    def registered(self, pid: int) -> bytes | None:
        return _read(os.path.join(self.directory, f"proc-{pid}"))

    def connections(self) -> list[dict[str, object]]:
        """What the connection guards recorded: one dict per connection, refused or let through."""
        raw = _read(os.path.join(self.directory, "connections.jsonl"))
        if not raw:
            return []
        import json

        records = []
        for line in raw.decode("utf-8", errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    records.append(record)
        return records

    def remove(self) -> None:
        remove_tree(self.directory)


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError:  # gone, or not ours to read (or a directory)
        return None


def _children(pid: int) -> Iterator[int]:
    for task in _listdir(f"/proc/{pid}/task"):
        raw = _read(f"/proc/{pid}/task/{task}/children")
        if raw:
            for word in raw.split():
                yield int(word)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _tree(root: int) -> set[int]:
    seen: set[int] = set()
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        todo.extend(_children(pid))
    return seen


def _is_python(pid: int) -> bool:
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return False
    return _python_name(os.path.basename(exe.removesuffix(" (deleted)")))


def _argv(raw: bytes) -> list[str]:
    return [part.decode("utf-8", "replace") for part in raw.split(b"\0") if part]


def _interpreter_flags(argv: list[str]) -> set[str]:
    flags: set[str] = set()
    for arg in argv[1:]:
        if arg == "-" or not arg.startswith("-") or arg.startswith("--"):
            break
        letters = arg[1:]
        for letter in letters:
            if letter in "cmWX":
                return flags
            flags.add(letter)
    return flags


def _certain_reason(pid: int, argv: list[str]) -> str | None:
    """Why the hook cannot load in this process, when that is certain from outside."""
    environ = _read(f"/proc/{pid}/environ")
    if environ is not None and b"QUOTAWRAP_RUN_ID=" not in environ:
        return "its environment has no QUOTAWRAP_RUN_ID (a cleared or replaced environment)"
    if "S" in _interpreter_flags(argv):
        return "Python runs with -S (no site hooks at all)"
    return None


def _environ(raw: bytes) -> dict[str, str]:
    pairs = (item.partition(b"=") for item in raw.split(b"\0") if item)
    return {key.decode("utf-8", "replace"): value.decode("utf-8", "replace") for key, _sep, value in pairs}


def _has_pth(pid: int, argv0: str, environ: dict[str, str]) -> bool:
    """Whether the interpreter argv[0] names has quotawrap-hook.pth in its site-packages."""
    if "/" not in argv0:
        import shutil  # a rare case, judged on the watcher's thread

        found = shutil.which(argv0, path=environ.get("PATH", os.defpath))
        argv0 = found or argv0
    elif not argv0.startswith("/"):
        argv0 = os.path.join(f"/proc/{pid}/cwd", argv0)
    from pathlib import Path

    prefix = Path(os.path.dirname(argv0)).parent
    return any(prefix.glob("lib/python*/site-packages/quotawrap-hook.pth"))


def _hookless(pid: int, argv: list[str], environ: dict[str, str], hook_dir: str) -> bool:
    """True when neither the sitecustomize (PYTHONPATH) nor the .pth can load in this process."""
    flags = _interpreter_flags(argv)
    on_path = hook_dir in environ.get("PYTHONPATH", "").split(os.pathsep) and not flags & {"I", "E"}
    return not on_path and not (argv and _has_pth(pid, argv[0], environ))


class ProcessWatcher:
    """Polls the child's process tree; collects Python processes that run without the hook."""

    def __init__(
        self,
        root: int,
        run_dir: RunDir,
        *,
        strict: bool,
        hook_dir: str = "",
        peers: GuardedPeers | None = None,
        on_unguarded: Callable[[UnguardedProcess], None] | None = None,  # as each is found (for `status`)
    ) -> None:
        self._on_unguarded = on_unguarded
        self._hook_dir = hook_dir
        self._peers = peers
        self._root = root
        self._run_dir = run_dir
        self._strict = strict
        self._first_seen: dict[tuple[int, bytes], float] = {}
        self._decided: set[tuple[int, bytes]] = set()
        self.unguarded: list[UnguardedProcess] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="quotawrap-procwatch", daemon=True)
        self._resolving = False

    def start(self) -> ProcessWatcher:
        self.poll()  # at once: a short-lived child may be gone before the first tick
        self._thread.start()
        return self

    def _resolve_names(self) -> None:
        """The guarded names' addresses, looked up once the first process that is not Python shows up
        (only such a process's connections are checked; literal addresses count at once): a run of
        Python processes only never pays for the lookups (and their imports) beside its child."""
        if self._peers is not None and not self._resolving:
            self._resolving = True
            threading.Thread(target=self._peers.resolve, name="quotawrap-resolve", daemon=True).start()

    def stop(self) -> list[UnguardedProcess]:
        """Stop watching; processes seen but never registered are judged now."""
        self._stop.set()
        self._thread.join()
        self.poll()
        for key in list(self._first_seen):  # still starting, or still running without it, at the end
            if key not in self._decided and not self._is_registered(*key):
                self._judge(key, "quotawrap's hook had not loaded when the run ended", alive=False)
        return self.unguarded

    def _loop(self) -> None:
        warned = False
        while not self._stop.wait(_POLL_S):
            try:
                self.poll()
            except Exception as exc:  # the watcher must never take the run down, nor stop watching
                if not warned:
                    from ..support.log import warn

                    warn(f"trouble watching the child's processes (still watching): {exc!r}")
                    warned = True

    def _cannot_load(self, pid: int, argv: list[str]) -> bool:
        raw = _read(f"/proc/{pid}/environ")
        return raw is not None and _hookless(pid, argv, _environ(raw), self._hook_dir)

    def _fork_of_hooked(self, pid: int, cmdline: bytes) -> bool:
        """A fork of a hooked process, not yet exec'd (subprocess between fork and exec) or never."""
        stat = _read(f"/proc/{pid}/stat")
        if not stat:
            return False
        try:
            ppid = int(stat[stat.rfind(b")") + 2 :].split()[1])
        except (ValueError, IndexError):
            return False
        return self._is_registered(ppid, cmdline)

    def _is_registered(self, pid: int, cmdline: bytes) -> bool:
        registered = self._run_dir.registered(pid)
        return registered is not None and registered == cmdline

    def poll(self) -> None:
        now = time.monotonic()
        alive: set[tuple[int, bytes]] = set()
        for pid in _tree(self._root):
            cmdline = _read(f"/proc/{pid}/cmdline")
            if not cmdline:
                continue
            if not _is_python(pid):
                self._check_connections(pid, cmdline)
                continue
            key = (pid, cmdline)
            alive.add(key)
            if key in self._decided:
                continue
            if self._is_registered(pid, cmdline):
                self._decided.add(key)  # this image is guarded; a later exec is a new key
                self._first_seen.pop(key, None)
                continue
            if self._fork_of_hooked(pid, cmdline):
                continue  # the hook is in its memory (or it is about to exec, a new key then)
            first = self._first_seen.setdefault(key, now)
            argv = _argv(cmdline)
            reason = _certain_reason(pid, argv)
            if reason is None and now - first >= _SHORT_GRACE_S and self._cannot_load(pid, argv):
                reason = (
                    "neither quotawrap's sitecustomize (PYTHONPATH replaced, or -I/-E)"
                    " nor its .pth (another interpreter) can load there"
                )
            if reason is None and now - first >= _GRACE_S:
                reason = f"quotawrap's hook did not load within {_GRACE_S:g} s"
            if reason is not None:
                self._judge(key, reason, alive=True)
        for key in list(self._first_seen):
            if key in alive or key in self._decided or self._is_registered(*key):
                continue
            now_running = _read(f"/proc/{key[0]}/cmdline")
            if now_running:  # the same pid runs another program: it was caught between fork and exec
                self._first_seen.pop(key)
                continue
            self._judge(key, "it ended without quotawrap's hook having loaded", alive=False)

    def _check_connections(self, pid: int, cmdline: bytes) -> None:
        """A process the hook cannot load in (not Python) that holds a connection to a guarded host."""
        key = (pid, cmdline)
        if self._peers is None or key in self._decided:
            return
        self._resolve_names()
        for peer in open_peers(pid):
            if self._peers.guarded(peer):
                host, port = peer
                where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
                reason = f"it is not a Python program and connected to {where}; run it under --proxy"
                self._judge(key, reason, alive=True, kind="Process")
                return

    def _judge(self, key: tuple[int, bytes], reason: str, *, alive: bool, kind: str = "Python process") -> None:
        self._decided.add(key)
        pid, cmdline = key
        record = UnguardedProcess(pid, " ".join(redact_argv(_argv(cmdline))), reason)
        if alive and self._strict:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, 9)  # SIGKILL; --strict: it must not send a single unguarded call
                record.stopped = True
        self.unguarded.append(record)
        if self._on_unguarded is not None:
            self._on_unguarded(record)
        from ..support.log import warn

        what = "STOPPED (--strict)" if record.stopped else "its LLM calls are NOT guarded"
        warn(f"{kind} {pid} ({record.command}) runs without quotawrap's hook: {reason}; {what}")
