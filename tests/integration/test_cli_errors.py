"""Bad options and store or dependency problems: one line naming the cure and an exit code, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import redis

from tests.conftest import run_cli, run_quotawrap
from tests.redis_server import free_port, private_server

BAD_OPTIONS = [
    ("--cap-cost", "nan"),
    ("--cap-cost", "inf"),
    ("--cap-cost", "-1"),
    ("--image-tokens", "-1"),
    ("--thinking-floor", "-1"),
    ("--default-max-tokens", "-5"),
    ("--balance-lag", "nan"),
    ("--cap-tokens", "-1"),
    ("--daily-cap", "-1"),
    ("--hold-ttl", "nan"),
    ("--hold-ttl", "0"),
    ("--sync-interval", "inf"),
    ("--unknown-price", "guess"),
    ("--package-match", "no-equals-sign"),
    ("--run-id", "../../etc/x"),
    ("--retention", "soon"),
    ("--base-url", "http://127.0.0.1:notaport/v3"),
    ("--base-url", "ftp://x"),
    ("--base-url", "http:///api/v3"),
    ("--retention", "30x"),
    ("--store", "redis://127.0.0.1:notaport/0"),
    ("--store", "ftp://somewhere/ledger"),
]


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


class TestOptionsAreCheckedAtStart:
    @pytest.mark.parametrize(("flag", "value"), BAD_OPTIONS, ids=[f"{f}={v}" for f, v in BAD_OPTIONS])
    def test_a_bad_flag_is_exit_2_before_the_child_runs(self, tmp_path: Path, flag: str, value: str) -> None:
        """Each bad value: exit 2, one line naming the flag; the child never starts."""
        marker = tmp_path / "ran"
        result = run_quotawrap(
            ["--store", f"sqlite:///{tmp_path / 'l.sqlite3'}", flag, value] if flag != "--store" else [flag, value],
            [sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
        )
        assert result.returncode == 2, result.stderr
        assert flag in one_line(result.stderr)
        assert not marker.exists()

    def test_the_same_rule_holds_for_variables_and_the_config_file(self, tmp_path: Path) -> None:
        """QUOTAWRAP_HOLD_TTL=nan and hold_ttl = nan in quotawrap.toml are refused like --hold-ttl nan."""
        store = ["--store", f"sqlite:///{tmp_path / 'l.sqlite3'}"]
        from_env = run_quotawrap(store, ["true"], env={"QUOTAWRAP_HOLD_TTL": "nan"})
        assert from_env.returncode == 2 and "--hold-ttl" in one_line(from_env.stderr)
        (tmp_path / "quotawrap.toml").write_text("cap_tokens = -3\n")
        from_toml = run_quotawrap(store, ["true"], cwd=tmp_path)
        assert from_toml.returncode == 2 and "--cap-tokens" in one_line(from_toml.stderr)

    def test_a_password_in_a_bad_store_url_is_not_printed(self) -> None:
        """The error about a bad Redis URL shows the URL with its password hidden."""
        result = run_cli("status", "--store", "redis://:hunter2secret@127.0.0.1:port/0")
        assert result.returncode == 2
        assert "hunter2secret" not in result.stderr and "***" in one_line(result.stderr)


class TestStoreProblemsAreOneLine:
    @pytest.mark.parametrize("command", ["status", "sessions", "report", "sync"])
    def test_redis_down_is_exit_4_for_every_subcommand(self, command: str) -> None:
        """A Redis nobody listens on: exit 4 and one line naming the store and what to check."""
        extra = ["--balance", "m=5"] if command == "sync" else []
        result = run_cli(command, "--store", f"redis://127.0.0.1:{free_port()}/0", *extra)
        assert result.returncode == 4, result.stderr
        assert "running and reachable" in one_line(result.stderr)

    @pytest.mark.parametrize("command", ["status", "sessions"])
    def test_a_wrong_redis_password_is_exit_4_and_not_echoed(self, command: str) -> None:
        """A server that wants another password: exit 4, one line, and the password given is not shown."""
        with private_server(appendonly=False) as server:
            redis.Redis(port=server.port).config_set("requirepass", "the-right-one")
            result = run_cli(command, "--store", f"redis://:wrong-pass-123@127.0.0.1:{server.port}/0")
        assert result.returncode == 4, result.stderr
        line = one_line(result.stderr)
        assert "password" in line and "wrong-pass-123" not in line

    @pytest.mark.parametrize("command", [["status"], ["sessions"], ["--", "true"]])
    def test_a_redis_store_without_the_redis_package_names_the_extra(self, command: list[str]) -> None:
        """No redis package installed: exit 4 and the pip command that fixes it."""
        script = (
            "import sys; sys.modules['redis'] = None\n"  # what an install without the extra looks like
            "from quotawrap.cli import main\n"
            f"main({['--store', 'redis://127.0.0.1:6379/0'] if command[0] == '--' else []!r} + {command!r}"
            f" + {['--store', 'redis://127.0.0.1:6379/0'] if command[0] != '--' else []!r})\n"
        )
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert result.returncode == 4, result.stderr
        assert "pip install 'quotawrap[redis]'" in one_line(result.stderr)


class TestTyposAreRefused:
    """A misspelt option or subcommand is a usage error naming the closest match, never the command to run."""

    @pytest.mark.parametrize(
        ("args", "named", "suggested"),
        [
            (["--cap-tokns", "5000", "--", sys.executable, "-c", "pass"], "--cap-tokns", "--cap-tokens"),
            (["-q", "--", "true"], "-q", None),
            (["--quiet", "--cap-tokns=5", "true"], "--cap-tokns", "--cap-tokens"),
            (["statu"], "statu", "status"),
            (["sesions", "--json"], "sesions", "sessions"),
        ],
    )
    def test_exit_2_with_click_words_and_the_child_never_runs(
        self, tmp_path: Path, args: list[str], named: str, suggested: str | None
    ) -> None:
        result = run_cli(*args, env={"XDG_STATE_HOME": str(tmp_path)})
        assert result.returncode == 2, result.stderr
        assert f"No such {'option' if named.startswith('-') else 'command'} '{named}'" in result.stderr
        if suggested:
            assert f"'{suggested}'" in result.stderr.rpartition("Error:")[2]
        assert "command not found" not in result.stderr and "Traceback" not in result.stderr
        assert not (tmp_path / "quotawrap").exists()  # no run was recorded

    def test_a_program_of_any_name_still_runs(self, tmp_path: Path) -> None:
        """The implicit run is kept: a word naming a program runs it, with or without ``--``; a name that is
        no program and no subcommand is the command that was not found (127)."""
        env = {"XDG_STATE_HOME": str(tmp_path)}
        assert run_cli("--quiet", sys.executable, "-c", "import sys; sys.exit(5)", env=env).returncode == 5
        assert run_cli("true", env=env).returncode == 0
        missing = run_cli("no-such-program-xyz", env=env)
        assert missing.returncode == 127 and "command not found: no-such-program-xyz" in missing.stderr
        after_dashes = run_cli("--", "statu", env=env)
        assert after_dashes.returncode == 127 and "command not found: statu" in after_dashes.stderr

    def test_a_bare_quotawrap_prints_the_usage(self) -> None:
        result = run_cli()
        assert result.returncode == 2
        assert "Usage: quotawrap" in result.stderr and "Commands:" in result.stderr
        assert "Missing argument" not in result.stderr


class TestTheGatewaysOptions:
    """serve and --proxy check their options as the run does: one line, exit 2, no traceback, nothing served."""

    @pytest.mark.parametrize(
        ("args", "named"),
        [
            (["serve", "--port", "70000"], "'--port'"),
            (["serve", "--base-url", "http://127.0.0.1:notaport/v3"], "--base-url"),
            (["serve", "--base-url", "ftp://x"], "--base-url"),
            (["--proxy", "--base-url", "http://127.0.0.1:notaport/v3", "--", "true"], "--base-url"),
            (["simulate", "--port", "70000"], "'--port'"),
        ],
    )
    def test_a_bad_port_or_base_url_is_exit_2(self, tmp_path: Path, args: list[str], named: str) -> None:
        result = run_cli(*args, env={"XDG_STATE_HOME": str(tmp_path)}, timeout=60)
        assert result.returncode == 2, result.stderr
        assert named in result.stderr and "Traceback" not in result.stderr
        assert "listening" not in result.stdout + result.stderr


BAD_REDIS_URLS = [
    "unix:///x.sock?db=x",
    "redis://127.0.0.1:6379/0?socket_timeout=abc",
    "redis://127.0.0.1:6379/0?health_check_interval=zz",
    "rediss://127.0.0.1:6379/0?ssl_cert_reqs=bogus",
]


class TestRedisUrlsAndPackage:
    @pytest.mark.parametrize("url", BAD_REDIS_URLS)
    @pytest.mark.parametrize("command", [["--"], ["status"]])
    def test_a_parameter_redis_py_refuses_is_exit_2(self, tmp_path: Path, url: str, command: list[str]) -> None:
        """One line naming the parameter, exit 2 (a usage error, not an outage), and the child never runs."""
        marker = tmp_path / "ran"
        args = [*command, "touch", str(marker)] if command == ["--"] else command
        result = run_cli("--store", url, *args) if command == ["--"] else run_cli(*args, "--store", url)
        assert result.returncode == 2, result.stderr
        assert "store URL" in one_line(result.stderr)
        assert not marker.exists()

    @pytest.mark.parametrize("command", [["--", "true"], ["status"], ["serve", "--port", "0"]])
    def test_a_redis_package_that_raises_on_import_is_exit_4(self, tmp_path: Path, command: list[str]) -> None:
        """A broken install raises anything on import, not only ImportError: one line naming the cure, exit 4."""
        broken = tmp_path / "site" / "redis"
        broken.mkdir(parents=True)
        (broken / "__init__.py").write_text("raise RuntimeError('half an install')\n")
        store = ["--store", f"redis://127.0.0.1:{free_port()}/0"]
        args = [*store, *command] if command[0] == "--" else [*command, *store]
        result = run_cli(*args, env={"PYTHONPATH": str(tmp_path / "site")}, timeout=60)
        assert result.returncode == 4, result.stderr
        line = one_line(result.stderr)
        assert "half an install" in line and "pip install --force-reinstall 'quotawrap[redis]'" in line


def test_the_demo_without_the_openai_sdk_names_what_to_install(tmp_path: Path) -> None:
    """A plain install has no openai SDK, which the demo's agent calls through: one line, exit 4, no traceback;
    an SDK that raises on import is named with its reinstall."""
    script = (
        "import sys; sys.modules['openai'] = None\nfrom quotawrap.cli import main\nmain(['demo', '--calls', '1'])\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 4, result.stderr
    assert "needs the openai package: pip install 'quotawrap[demo]'" in one_line(result.stderr)
    broken = tmp_path / "site" / "openai"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise OSError('half an install')\n")
    result = run_cli("demo", "--calls", "1", env={"PYTHONPATH": str(tmp_path / "site")})
    assert result.returncode == 4, result.stderr
    assert "half an install" in one_line(result.stderr) and "quotawrap[demo]" in result.stderr
