"""Secrets are hidden from stored command lines and URLs; private files refuse links and stay 0600."""

from __future__ import annotations

import os
import shlex
import stat
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from quotawrap.config.settings import Settings
from quotawrap.core.redact import join_command, key_fingerprint, redact_argv, redact_command_line, redact_url
from quotawrap.ledger import RunTotals
from quotawrap.support.files import append_private, prepare, write_private
from quotawrap.wrapper.summary import run_report


class TestRedact:
    @pytest.mark.parametrize(
        ("argv", "expected"),
        [
            (["x.py", "--api-key", "sk-abc123456"], ["x.py", "--api-key", "***"]),
            (["x.py", "--api-key=whatever"], ["x.py", "--api-key=***"]),
            (["x.py", "token=abc", "OPENAI_API_KEY=k"], ["x.py", "token=***", "OPENAI_API_KEY=***"]),
            (["curl", "-H", "Authorization: Bearer abcdefgh"], ["curl", "-H", "Authorization: Bearer ***"]),
            (["x.py", "--note", "uses sk-proj-abcdef123"], ["x.py", "--note", "uses ***"]),
            (["x.py", "--store", "redis://:pw@h:6379/0"], ["x.py", "--store", "redis://:***@h:6379/0"]),
            (["x.py", "--model", "m", "--n=3", "keyboard=1"], ["x.py", "--model", "m", "--n=3", "keyboard=1"]),
            (["x.py", "--no-auth", "--model", "m"], ["x.py", "--no-auth", "--model", "m"]),
        ],
    )
    def test_secret_arguments_and_values_are_hidden(self, argv: list[str], expected: list[str]) -> None:
        """Secret names hide their value (both spellings), secret-looking values hide themselves, the rest stays."""
        assert redact_argv(argv) == expected

    @pytest.mark.parametrize(
        ("url", "expected"),
        [
            ("redis://user:pw@h:1/0", "redis://user:***@h:1/0"),
            ("redis://:pw@h:1/0", "redis://:***@h:1/0"),
            ("rediss://h:1/0?password=pw&ssl_cert_reqs=none", "rediss://h:1/0?password=***&ssl_cert_reqs=none"),
            ("https://TOKEN@example.com/x", "https://***@example.com/x"),
            ("sqlite:////tmp/ledger.sqlite3", "sqlite:////tmp/ledger.sqlite3"),
        ],
    )
    def test_every_password_form_in_a_url_is_hidden(self, url: str, expected: str) -> None:
        """Userinfo passwords, lone userinfo tokens and password query parameters are hidden."""
        assert redact_url(url) == expected

    def test_a_stored_line_that_does_not_split_is_still_redacted(self) -> None:
        """An unbalanced quote cannot be split; the secret-looking value is hidden anyway."""
        assert "sk-abcdef1234" not in redact_command_line("python 'x.py --key sk-abcdef1234")

    def test_the_report_json_store_field_hides_the_password(self) -> None:
        """--report-json's store field never carries the Redis password."""
        report = run_report(RunTotals("r", {}), settings=Settings(store="redis://:s3cret@h:1/0"), exit_code=0)
        assert report["store"] == "redis://:***@h:1/0"


def test_key_fingerprint_is_the_keys_own_when_remembered() -> None:
    """Fingerprints are remembered per Authorization header: asked again, or for another key in between,
    each key keeps its own (and a fingerprint never shows the key)."""
    import hashlib

    def expected(secret: str) -> str:
        return "sha256:" + hashlib.sha256(secret.encode()).hexdigest()[:16]

    keys = [f"sk-test-{n}" for n in range(70)]  # more than are remembered at once
    for key in [*keys, *reversed(keys)]:
        fingerprint = key_fingerprint({"authorization": f"Bearer {key}"})
        assert fingerprint == expected(key) and key not in fingerprint
    assert key_fingerprint({"Authorization": "Bearer sk-test-3"}) == expected("sk-test-3")
    assert key_fingerprint({}) is None


class TestPrivateFiles:
    def test_new_files_are_0600_whatever_the_umask(self, tmp_path: Path) -> None:
        """append_private and write_private create owner-only files under a permissive umask."""
        old = os.umask(0)
        try:
            append_private(tmp_path / "a.jsonl", b"x\n")
            write_private(tmp_path / "deep" / "r.json", b"{}")
        finally:
            os.umask(old)
        assert stat.S_IMODE((tmp_path / "a.jsonl").stat().st_mode) == 0o600
        assert stat.S_IMODE((tmp_path / "deep" / "r.json").stat().st_mode) == 0o600
        assert stat.S_IMODE((tmp_path / "deep").stat().st_mode) == 0o700

    def test_a_symlink_is_refused_never_followed(self, tmp_path: Path) -> None:
        """Appending or writing to a symlink fails; the target keeps its bytes."""
        target = tmp_path / "target"
        target.write_bytes(b"keep")
        link = tmp_path / "link"
        link.symlink_to(target)
        with pytest.raises(OSError):
            append_private(link, b"evil")
        with pytest.raises(OSError):
            write_private(link, b"evil")
        assert target.read_bytes() == b"keep" and prepare(link) is not None

    def test_prepare_makes_missing_directories_0700(self, tmp_path: Path) -> None:
        """prepare creates every missing level 0700 and finds nothing wrong with a fresh path."""
        assert prepare(tmp_path / "a" / "b" / "f.json") is None
        assert {stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "a", tmp_path / "a" / "b")} == {0o700}


# Arguments built from the pieces the patterns look for, and from anything at all
_PIECES = [
    "-",
    "--",
    "=",
    "?",
    "&",
    "://",
    "@",
    ":",
    " ",
    "/",
    ".",
    "_",
    "x",
    "K",
    "\u017f",
    "\u212a",
    "0123456789",
    "sk",
    "sk-",
    "SK-",
    "ak-",
    "key",
    "KEY",
    "api",
    "pass",
    "PaSs",
    "pwd",
    "auth",
    "token",
    "secret",
    "cookie",
    "credential",
    "Bearer ",
    "basic ",
    "ghp_",
    "github_pat_",
    "AKLT",
    "xoxb-",
    "AIza",
    "abcdefghijklmnopqrstuvwx",
]
_arguments = st.one_of(st.lists(st.sampled_from(_PIECES), max_size=8).map("".join), st.text(max_size=20))


@given(st.lists(_arguments, max_size=4))
@example(["github_pat_0123456789"])  # found by this test: "github" holds no "gh"
def test_a_command_line_of_plain_arguments_has_nothing_to_hide(argv: list[str]) -> None:
    """The shortcut that keeps `re` off a guarded command's start: an argument it calls plain is one the
    patterns leave as it is, alone or beside other plain arguments."""
    from quotawrap.core import redact

    if all(redact.plain_argument(arg) for arg in argv):
        assert redact._redact_each(argv) == argv


@given(st.lists(st.text(max_size=12), max_size=5))
def test_join_command_is_shlex_join(argv: list[str]) -> None:
    assert join_command(argv) == shlex.join(argv)


def test_a_usual_command_line_is_plain() -> None:
    """The shortcut pays: the commands people guard are plain (not a superset that is always taken)."""
    from quotawrap.core.redact import plain_argument

    for argv in (["python", "-c", "pass"], ["python", "agent.py", "--model", "deepseek-v4", "--workers=8"]):
        assert all(plain_argument(arg) for arg in argv)
    assert not plain_argument("--api-key") and not plain_argument("sk-abc") and not plain_argument("a=b?c")
