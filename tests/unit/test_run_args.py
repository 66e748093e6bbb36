"""quotawrap.cli.run_args reads a plain run's command line exactly as click's ``run`` does, or declines.

Generated command lines, variables and config files go through both: wherever the fast parser
answers, its settings and command (or its one-line error) equal what click's path produces.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quotawrap.cli.commands import cli, click_main
from quotawrap.cli.common import settings_from_values
from quotawrap.cli.run_args import SUBCOMMANDS, parse_run_args
from quotawrap.config.settings import OPTIONS, Option, env_name, parse_value
from quotawrap.wrapper import run as run_module

_BY_NAME = {option.name: option for option in OPTIONS}

# Words a user may write for each type: valid ones, ones an option's rule refuses, ones click refuses.
_INTS = ["0", "5", "-1", "1_000", " 7 ", "+3", "x", "0x10", "", "2.5"]
_FLOATS = ["0", "1.5", "-2", "nan", "inf", "1e3", "x", "", " 4 "]
_TEXT: dict[str, list[str]] = {
    "store": ["sqlite:///tmp/l.sqlite3", "ftp://x/y", "redis://127.0.0.1:6379/0", "l.sqlite3"],
    "run_id": ["run-1", "../x", "a.b:c"],
    "tag": ["team=infra", "no-equals", "k=v,w"],
    "unknown_price": ["conservative", "error", "guess"],
    "package_match": ["m=text", "bad"],
    "retention": ["90d", "off", "12h", "soon"],
}
_BOOL_ENV = ["1", "0", "true", "False", " on ", "y", "n", "maybe", "", "t"]
_COMMANDS = [["python", "-c", "pass"], ["true"], ["-", "x"], ["sh", "--", "-c"], []]


def _words(option: Option) -> list[str]:
    if option.type is int:
        return _INTS
    if option.type is float:
        return _FLOATS
    return _TEXT.get(option.name, ["value", "a,b", '["x", "y"]'])


@st.composite
def _flag(draw: st.DrawFn) -> list[str]:
    option = draw(st.sampled_from(OPTIONS))
    if option.type is bool:
        word = draw(st.sampled_from([option.cli_flag, "--no-" + option.cli_flag[2:], option.cli_flag + "=1"]))
        return [word]
    value = draw(st.sampled_from(_words(option)))
    if draw(st.booleans()):
        return [f"{option.cli_flag}={value}"]
    return [option.cli_flag, value]


@st.composite
def _command_line(draw: st.DrawFn) -> list[str]:
    args: list[str] = ["run"] if draw(st.integers(0, 9)) == 0 else []
    for flag in draw(st.lists(_flag(), max_size=5)):
        args += flag
    if draw(st.integers(0, 14)) == 0:
        args.append(draw(st.sampled_from(["-h", "--help", "--cap-tok", "-q", "--version"])))
    command = draw(st.sampled_from(_COMMANDS))
    if draw(st.integers(0, 3)) or (command and command[0].startswith("-")):
        args.append("--")
    return args + command


@st.composite
def _environment(draw: st.DrawFn) -> dict[str, str]:
    env: dict[str, str] = {}
    for option in draw(st.lists(st.sampled_from(OPTIONS), max_size=3, unique=True)):
        words = _BOOL_ENV if option.type is bool else _words(option)
        env[env_name(option.name)] = draw(st.sampled_from(words))
    return env


@st.composite
def _config(draw: st.DrawFn) -> dict[str, Any]:
    """What load_config_file returns: typed values, each parsed as from quotawrap.toml."""
    config: dict[str, Any] = {}
    for option in draw(st.lists(st.sampled_from(OPTIONS), max_size=3, unique=True)):
        raw: Any = draw(st.sampled_from(["1", "true"] if option.type is bool else _words(option)))
        try:
            config[option.name] = parse_value(option, [raw] if option.multiple else raw)
        except Exception:
            continue
    return config


def _fast(args: Sequence[str], config: dict[str, Any]) -> tuple[str, Any] | None:
    try:
        parsed = parse_run_args(args, os.environ, config)
    except Exception as exc:
        return ("error", str(exc))
    if parsed is None:
        return None
    try:
        return ("run", (settings_from_values(parsed.values), parsed.command))
    except SystemExit:
        return ("exit", None)


def _click(args: Sequence[str], config: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> tuple[str, Any]:
    seen: list[Any] = []

    def capture(settings: Any, command: Sequence[str]) -> None:
        seen.append((settings, tuple(command)))
        raise SystemExit(0)

    monkeypatch.setattr(run_module, "run_guarded", capture)
    with contextlib.suppress(SystemExit):  # click's own usage errors, and the capture's exit
        click_main(list(args), config)
    return ("run", seen[0]) if seen else ("exit", None)


@pytest.fixture
def scratch_environ() -> Iterator[None]:
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


_answered: list[bool] = []


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(args=_command_line(), env=_environment(), config=_config())
def test_where_the_fast_parser_answers_click_gives_the_same_run(
    args: list[str],
    env: dict[str, str],
    config: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    scratch_environ: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in list(os.environ):
        if name.startswith("QUOTAWRAP_"):
            del os.environ[name]
    os.environ.update(env)
    capsys.readouterr()
    fast = _fast(args, config)
    _answered.append(fast is not None)
    if fast is None:
        return  # declined: click parses it, as before
    if fast[0] == "error":  # a repeatable option's malformed variable: command_settings' words
        capsys.readouterr()
        slow = _click(args, config, monkeypatch)
        assert slow == ("exit", None)
        assert fast[1] in capsys.readouterr().err
        return
    fast_error = capsys.readouterr().err
    slow = _click(args, config, monkeypatch)
    slow_error = capsys.readouterr().err
    assert fast == slow, (args, env, config)
    assert fast_error == slow_error


def test_the_generated_lines_mostly_take_the_fast_path() -> None:
    """Runs after the property: a parser that declined everything would pass it vacuously."""
    assert len(_answered) >= 300
    assert sum(_answered) >= len(_answered) // 4, f"{sum(_answered)} of {len(_answered)} answered"


def test_the_subcommand_names_are_the_groups() -> None:
    assert set(cli.commands) == SUBCOMMANDS


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["-h"],
        ["--version"],
        ["status"],
        ["--quiet", "--help", "--", "true"],
        ["--cap-tokens", "abc", "--", "true"],
        ["--quiet=1", "--", "true"],
        ["--quiet"],
        ["--quiet", "--"],
        ["--cap-tokens"],
        ["--tag", "--", "true"],
        ["--unknown-flag", "--", "true"],
        ["statu"],  # no program of that name where a subcommand goes: click judges the typo
    ],
)
def test_what_only_click_may_judge_is_declined(args: list[str]) -> None:
    assert parse_run_args(args, {}, {}) is None


def test_a_flag_beats_its_variable_which_beats_the_config_file() -> None:
    cap = _BY_NAME["cap_tokens"]
    env = {env_name(cap.name): "20", env_name("tag"): "a=1"}
    parsed = parse_run_args(["--cap-tokens", "10", "--", "true"], env, {"cap_tokens": 30, "tag": ("b=2",)})
    assert parsed is not None
    assert parsed.values["cap_tokens"] == 10 and parsed.values["tag"] == ("a=1",)
    parsed = parse_run_args(["true"], env, {"cap_tokens": 30})
    assert parsed is not None and parsed.values["cap_tokens"] == 20 and parsed.command == ("true",)
    parsed = parse_run_args(["true"], {}, {"cap_tokens": 30})
    assert parsed is not None and parsed.values["cap_tokens"] == 30
