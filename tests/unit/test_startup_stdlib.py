"""The start path's small stand-ins for standard-library and platformdirs helpers give their answers.

The wrapper does without ``shutil``, ``tempfile`` and ``platformdirs`` before its child starts (their
imports cost every guarded command a few milliseconds); each stand-in is held here to the original.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
from pathlib import Path

import platformdirs
import pytest

from quotawrap.config.paths import default_store_url, user_state_dir
from quotawrap.support.processes import which
from quotawrap.wrapper.registry import RunDir

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the XDG rule is Linux's")


@linux_only
@pytest.mark.parametrize(
    ("xdg", "home"),
    [
        (None, "/home/someone"),
        ("/var/state", "/home/someone"),
        ("", "/home/someone/"),
        ("relative/state", "/home/someone"),  # a relative XDG variable is ignored
        (None, "/"),
    ],
)
def test_the_state_directory_is_platformdirs_own(monkeypatch: pytest.MonkeyPatch, xdg: str | None, home: str) -> None:
    monkeypatch.setenv("HOME", home)
    if xdg is None:
        monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    else:
        monkeypatch.setenv("XDG_STATE_HOME", xdg)
    assert user_state_dir() == platformdirs.user_state_dir("quotawrap")
    assert default_store_url() == f"sqlite:///{Path(platformdirs.user_state_dir('quotawrap')) / 'ledger.sqlite3'}"


def _program(directory: Path, name: str, mode: int = 0o755) -> Path:
    path = directory / name
    path.write_text("#!/bin/sh\n")
    path.chmod(mode)
    return path


@pytest.mark.skipif(os.name != "posix", reason="the stand-in is POSIX's; elsewhere it is shutil.which")
def test_which_finds_what_shutil_which_finds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    _program(first, "tool", 0o644)  # not executable: skipped
    _program(second, "tool")
    (first / "dir").mkdir()  # a directory is no program
    _program(second, "dir")
    search = os.pathsep.join([str(first), str(first), str(second)])
    for name in ("tool", "dir", "missing", str(second / "tool"), str(first / "tool"), "python3"):
        assert which(name, path=search) == shutil.which(name, path=search), name
    assert which("tool", path="") is None and shutil.which("tool", path="") is None
    monkeypatch.setenv("PATH", search)
    assert which("tool") == shutil.which("tool") == str(second / "tool")
    monkeypatch.delenv("PATH")
    assert which("sh") == shutil.which("sh")


def test_the_run_directory_is_private_and_removed_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    first, second = RunDir(), RunDir()
    assert first.path != second.path and first.path.parent == tmp_path
    assert first.path.name.startswith("quotawrap-run-")
    assert stat.S_IMODE(first.path.stat().st_mode) == 0o700
    (first.path / "proc-1").write_bytes(b"x")
    (first.path / "nested").mkdir()
    (first.path / "nested" / "file").write_text("y")
    first.remove()
    second.remove()
    assert list(tmp_path.iterdir()) == []


def test_an_unusable_temp_directory_falls_back_to_the_next(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path / "does-not-exist"))
    monkeypatch.setenv("TEMP", str(tmp_path))
    run_dir = RunDir()
    try:
        assert run_dir.path.parent == tmp_path
    finally:
        run_dir.remove()


def test_the_host_name_is_socket_gethostname() -> None:
    import socket

    from quotawrap.support.host import hostname

    assert hostname() == socket.gethostname()
