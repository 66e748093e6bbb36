"""Every file quotawrap writes goes through here: owner-only, never through a symlink.

Files are created ``0600`` with ``O_NOFOLLOW`` (a symlink planted at the path is refused, not
followed to its target); missing directories are created ``0700``, each level, not just the last.
:func:`prepare` runs at start for every path a run will write, so a bad path is one clear error
before the child starts instead of a warning per call.
"""

from __future__ import annotations

import contextlib
import os
import stat

__all__ = [
    "RUN_DIR_PREFIX",
    "append_private",
    "ledger_used",
    "mark_ledger_use",
    "new_private_dir",
    "prepare",
    "private_dir",
    "remove_tree",
    "write_private",
]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def private_dir(directory: str | os.PathLike[str]) -> None:
    """Create ``directory`` and any missing parents ``0700``; an existing one is left as it is."""
    from pathlib import Path  # not on a guarded command's start path unless it writes this file

    path = Path(directory)
    missing = []
    while not path.exists():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for level in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            level.mkdir(mode=0o700)


def _open_private(path: str | os.PathLike[str], flags: int) -> int:
    """Open for writing, creating ``0600``; refuse a symlink or anything but a regular file."""
    fd = os.open(path, flags | os.O_WRONLY | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o600)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def append_private(path: str | os.PathLike[str], data: bytes) -> None:
    """Append ``data`` in one locked write, so concurrent writers' lines stay whole."""
    fd = _open_private(path, os.O_APPEND)
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX)  # lines over PIPE_BUF are not atomic by O_APPEND alone
        _write_all(fd, data)
    finally:
        os.close(fd)


def write_private(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path``'s content atomically (a new ``0600`` file renamed over it); refuses a symlink."""
    from pathlib import Path  # not on a guarded command's start path unless it writes this file

    target = Path(path)
    if target.is_symlink():
        raise OSError(f"{target} is a symbolic link; quotawrap does not write through links")
    private_dir(target.parent)
    tmp = target.with_name(f".{target.name}.{os.urandom(4).hex()}.tmp")  # secrets.token_hex's bytes, unimported
    fd = _open_private(tmp, os.O_EXCL)
    try:
        _write_all(fd, data)
    finally:
        os.close(fd)
    try:
        os.replace(tmp, target)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def prepare(path: str | os.PathLike[str]) -> str | None:
    """Make ``path`` writable before the run starts; the problem in words, or None when it is fine."""
    from pathlib import Path  # not on a guarded command's start path unless it writes this file

    target = Path(path)
    if target.is_symlink():
        return f"{target} is a symbolic link; quotawrap does not write through links"
    if target.exists() and not target.is_file():
        return f"{target} exists and is not a regular file"
    try:
        private_dir(target.parent)
    except OSError as exc:
        return f"cannot create its directory {target.parent}: {exc.strerror or exc}"
    if not os.access(target.parent, os.W_OK | os.X_OK):
        return f"its directory {target.parent} is not writable"
    return None


# tempfile.gettempdir's order; tempfile and shutil themselves (random, hashlib, the compressors) would
# delay every guarded command's child with their imports
_TEMP_VARIABLES = ("TMPDIR", "TEMP", "TMP")
_TEMP_DIRS = ("/tmp", "/var/tmp", "/usr/tmp")


RUN_DIR_PREFIX = "quotawrap-run-"  # a run's private directory (QUOTAWRAP_RUN_DIR)
# The wrapper's settle relay (handoff.Relay): named to the child before it is bound, here so that
# naming it does not load the relay (and threading) before the child starts.
SOCKET_VARIABLE = "QUOTAWRAP_SETTLE_SOCKET"
_SOCKET_NAME = "settle.sock"
_LEDGER_MARK = "ledger-opened-"  # then the pid: a process of the run opened the ledger for guarded calls
_marked_by: int | None = None  # the pid that left its marks (a forked child leaves its own)


def mark_ledger_use(environ: Mapping[str, str] | None = None) -> None:
    """Leave a mark in every run directory this process belongs to (``QUOTAWRAP_RUN_DIR``): it opens the
    ledger and may hold calls. Made before the first reserve (a file, once per process), so a wrapper
    that finds none knows no hold of its run can exist, even one of a SIGKILLed child. Never raises."""
    global _marked_by
    if _marked_by == os.getpid():
        return
    env = os.environ if environ is None else environ
    for directory in (env.get("QUOTAWRAP_RUN_DIR") or "").split(os.pathsep):
        if directory:
            with contextlib.suppress(OSError):
                mark = os.path.join(directory, f"{_LEDGER_MARK}{os.getpid()}")
                os.close(os.open(mark, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    _marked_by = os.getpid()


def ledger_used(run_dir: str) -> bool:
    """Whether any process of the run opened the ledger (:func:`mark_ledger_use`); True when unsure."""
    try:
        return any(name.startswith(_LEDGER_MARK) for name in os.listdir(run_dir))
    except OSError:
        return True


def relay_path(directory: str) -> str:
    """Where the wrapper of a run in ``directory`` binds its settle relay's socket."""
    return os.path.join(directory, _SOCKET_NAME)


def new_private_dir(prefix: str) -> str:
    """A new directory, mode 0700 and never an existing path (``tempfile.mkdtemp``'s promise)."""
    candidates = [os.environ[name] for name in _TEMP_VARIABLES if os.environ.get(name)]
    error: OSError | None = None
    for base in [*candidates, *_TEMP_DIRS, os.getcwd()]:
        for _attempt in range(100):
            path = os.path.join(os.path.abspath(base), prefix + os.urandom(6).hex())
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                continue  # another's name: draw again
            except OSError as exc:  # not there or not writable: the next candidate
                error = exc
                break
            return path
    raise error or FileExistsError(f"no free name for a {prefix} directory")


def remove_tree(path: str) -> None:
    """``shutil.rmtree(path, ignore_errors=True)`` for the run directory (files, maybe a few directories)."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(path):
            with contextlib.suppress(OSError):
                if entry.is_dir(follow_symlinks=False):
                    remove_tree(entry.path)
                else:
                    os.unlink(entry.path)
    with contextlib.suppress(OSError):
        os.rmdir(path)
