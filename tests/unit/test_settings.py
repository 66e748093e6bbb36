"""Tests for quotawrap.config.settings: one options table behind flags, QUOTAWRAP_* variables, toml and the child."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from quotawrap.cli import cli, main
from quotawrap.config.file import load_config_file
from quotawrap.config.settings import OPTIONS, Option, Settings, env_name, parse_value
from quotawrap.core.errors import ConfigError
from quotawrap.ledger import RunTotals
from quotawrap.wrapper import launcher

CHILD_OPTIONS = [option for option in OPTIONS if option.child]
NUMERIC_OPTIONS = [option for option in OPTIONS if option.type in (int, float) and not option.multiple]
BOOL_OPTIONS = [option for option in OPTIONS if option.type is bool]

# Environment variables cannot hold NUL, and os.environ refuses lone surrogates.
_ENV_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=20)
# One item of a repeatable option: the child format is a JSON list of stripped items, so an item
# may hold commas (a tag "note=a,b") but no surrounding whitespace.
_ITEM = _ENV_TEXT.map(str.strip).filter(lambda item: item != "")


def _passes(option: Option, value: Any) -> bool:
    try:
        option.validate(value)
    except ConfigError:
        return False
    return True


# Text options whose rule allows only a few shapes: generated in those shapes, not filtered into them.
_SHAPED: dict[str, st.SearchStrategy[Any]] = {
    "unknown_price": st.sampled_from(["conservative", "error"]),
    "reasoning_reserve": st.sampled_from(["ceiling", "learned", "cut"]),
    "run_id": st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,30}", fullmatch=True),
    "store": _ENV_TEXT.filter(lambda text: "://" not in text and not text.startswith("sqlite:")),
    "package_match": st.lists(st.tuples(_ITEM, _ITEM).map("=".join), max_size=4).map(tuple),
    "base_url": st.lists(
        st.from_regex(r"https?://[a-z0-9.-]{1,20}(:[1-9][0-9]{0,3})?(/[A-Za-z0-9_.~,%-]*){0,3}", fullmatch=True),
        max_size=4,
    ).map(tuple),
}


def _value_strategy(option: Option) -> st.SearchStrategy[Any]:
    """Any value the option's own rule accepts."""
    if option.name in _SHAPED:
        plain: st.SearchStrategy[Any] = _SHAPED[option.name]
    elif option.multiple:
        return st.lists(_ITEM, max_size=4).map(tuple)
    elif option.type is bool:
        return st.booleans()
    # Every numeric rule refuses values below zero: generated from zero up, so the filter below rarely refuses
    # one (refusing half of each of a dozen options' values tripped Hypothesis's filter_too_much check).
    elif option.type is int:
        plain = st.integers(0, 10**12)
    elif option.type is float:
        plain = st.floats(min_value=0.0, max_value=100_000.0)
    else:
        plain = _ENV_TEXT
    plain = plain.filter(lambda value: _passes(option, value))
    return st.none() | plain if option.default is None and not option.multiple else plain


_SETTINGS = st.fixed_dictionaries({option.name: _value_strategy(option) for option in CHILD_OPTIONS}).map(
    Settings.from_values
)


@pytest.fixture(autouse=True)
def _no_quotawrap_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The developer's own QUOTAWRAP_* variables must not leak into these tests."""
    for name in [name for name in os.environ if name.startswith("QUOTAWRAP_")]:
        monkeypatch.delenv(name)


class TestChildEnvRoundTrip:
    @given(_SETTINGS)
    def test_identity_for_every_child_option(self, settings: Settings) -> None:
        """Settings -> child_env -> from_env gives back every option the child needs."""
        back = Settings.from_env(settings.child_env())
        for option in CHILD_OPTIONS:
            assert getattr(back, option.name) == getattr(settings, option.name), option.name

    def test_every_variable_is_quotawrap_prefixed_and_textual(self) -> None:
        """child_env writes only QUOTAWRAP_* strings, one per child option that has a value."""
        settings = Settings(store="sqlite:////tmp/x", cap_tokens=5, run_id="r")
        env = settings.child_env()
        assert all(name.startswith("QUOTAWRAP_") and isinstance(value, str) for name, value in env.items())
        expected = {env_name(o.name) for o in CHILD_OPTIONS if getattr(settings, o.name) is not None}
        assert set(env) == expected

    def test_parent_only_options_stay_in_the_parent(self) -> None:
        """--report-json, --quiet and --fail-on-block mean nothing to the child."""
        settings = Settings(report_json="/tmp/r.json", quiet=True, fail_on_block=True)
        env = settings.child_env()
        for option in OPTIONS:
            if not option.child:
                assert env_name(option.name) not in env

    def test_false_booleans_travel(self) -> None:
        """A switched-off default-on option (--no-inject-usage) reaches the child switched off."""
        assert Settings.from_env(Settings(inject_usage=False).child_env()).inject_usage is False

    def test_missing_variables_mean_defaults(self) -> None:
        """An empty environment is the default settings."""
        assert Settings.from_env({}) == Settings()

    def test_repeatable_values_split_on_commas_and_strip(self) -> None:
        """QUOTAWRAP_MODEL='a, b,,c' is three patterns."""
        assert Settings.from_env({"QUOTAWRAP_MODEL": "a, b,,c"}).model == ("a", "b", "c")


class TestParseErrors:
    @pytest.mark.parametrize("option", NUMERIC_OPTIONS, ids=lambda option: option.name)
    def test_numbers(self, option: Option) -> None:
        """A variable that is not a number is a ConfigError naming the variable."""
        with pytest.raises(ConfigError, match=env_name(option.name)):
            Settings.from_env({env_name(option.name): "lots"})

    @pytest.mark.parametrize("option", BOOL_OPTIONS, ids=lambda option: option.name)
    def test_booleans(self, option: Option) -> None:
        """A variable that is not a boolean is a ConfigError naming the variable."""
        with pytest.raises(ConfigError, match=env_name(option.name)):
            Settings.from_env({env_name(option.name): "maybe"})

    @pytest.mark.parametrize("raw", [[1], {"a": 1}, True])
    def test_wrong_toml_types_for_a_float(self, raw: Any) -> None:
        """A toml list, table or boolean where a number belongs is a ConfigError, not a TypeError or 1.0."""
        option = next(o for o in OPTIONS if o.name == "hold_ttl")
        with pytest.raises(ConfigError, match="QUOTAWRAP_HOLD_TTL"):
            parse_value(option, raw)

    @pytest.mark.parametrize("raw", [[1], True, 1.5])
    def test_wrong_toml_types_for_an_int(self, raw: Any) -> None:
        """A toml list, boolean or fraction where a whole number belongs is a ConfigError."""
        option = next(o for o in OPTIONS if o.name == "cap_tokens")
        with pytest.raises(ConfigError, match="QUOTAWRAP_CAP_TOKENS"):
            parse_value(option, raw)

    def test_int_accepts_separators(self) -> None:
        """2_000_000 and 2,000,000 are both two million."""
        option = next(o for o in OPTIONS if o.name == "daily_cap")
        assert parse_value(option, "2_000_000") == parse_value(option, "2,000,000") == 2_000_000

    def test_float_parses(self) -> None:
        """Floats come from text and from toml numbers alike."""
        option = next(o for o in OPTIONS if o.name == "hold_ttl")
        assert parse_value(option, "1.5") == 1.5
        assert parse_value(option, 2) == 2.0


class TestBoolParsing:
    @pytest.mark.parametrize("raw", ["1", "true", "TRUE", " yes ", "on", "On", True])
    def test_true(self, raw: Any) -> None:
        """The usual spellings of yes are True."""
        assert parse_value(next(o for o in BOOL_OPTIONS), raw) is True

    @pytest.mark.parametrize("raw", ["0", "false", "False", "no", "off", "", False])
    def test_false(self, raw: Any) -> None:
        """The usual spellings of no (and an empty value) are False."""
        assert parse_value(next(o for o in BOOL_OPTIONS), raw) is False

    def test_env_switches_watch_on(self) -> None:
        """QUOTAWRAP_WATCH=yes is watch mode."""
        assert Settings.from_env({"QUOTAWRAP_WATCH": "yes"}).watch is True

    def test_reasoning_reserve_from_env_and_its_rule(self) -> None:
        """QUOTAWRAP_REASONING_RESERVE picks the policy (default ceiling); anything else names the option."""
        assert Settings().reasoning_reserve == "ceiling"
        assert Settings.from_env({"QUOTAWRAP_REASONING_RESERVE": "cut"}).reasoning_reserve == "cut"
        with pytest.raises(ConfigError, match=r"--reasoning-reserve.*ceiling, learned, cut"):
            Settings.from_env({"QUOTAWRAP_REASONING_RESERVE": "generous"})


class TestConfigFile:
    def test_missing_file_is_no_error(self, tmp_path: Path) -> None:
        """No quotawrap.toml: no settings from it."""
        assert load_config_file(tmp_path / "quotawrap.toml") == {}

    def test_typed_values_and_dashed_keys(self, tmp_path: Path) -> None:
        """Keys may use dashes; values come back typed."""
        path = tmp_path / "quotawrap.toml"
        path.write_text(
            'cap-tokens = 50_000\nmodel = ["deepseek-*", "doubao"]\nwatch = true\nhold_ttl = 60\n'
            'base_url = "http://a/v1,http://b/v1"\n'
        )
        assert load_config_file(path) == {
            "cap_tokens": 50_000,
            "model": ("deepseek-*", "doubao"),
            "watch": True,
            "hold_ttl": 60.0,
            "base_url": ("http://a/v1", "http://b/v1"),
        }

    def test_reasoning_reserve_in_the_file(self, tmp_path: Path) -> None:
        """The shape-4 policy is a setting like the others: quotawrap.toml may name it."""
        path = tmp_path / "quotawrap.toml"
        path.write_text('reasoning-reserve = "learned"\n')
        assert load_config_file(path) == {"reasoning_reserve": "learned"}

    def test_unknown_key_is_an_error(self, tmp_path: Path) -> None:
        """A misspelt setting is refused, naming the file and the key."""
        path = tmp_path / "quotawrap.toml"
        path.write_text("cap_tokenz = 5\n")
        with pytest.raises(ConfigError, match=r"quotawrap\.toml.*cap_tokenz"):
            load_config_file(path)

    def test_sections_are_left_to_other_features(self, tmp_path: Path) -> None:
        """A [table] that is not a setting is no error."""
        path = tmp_path / "quotawrap.toml"
        path.write_text('cap_tokens = 7\n[prices]\n"deepseek-v3" = 2\n')
        assert load_config_file(path) == {"cap_tokens": 7}

    def test_bad_toml_names_the_file(self, tmp_path: Path) -> None:
        """A syntax error is a ConfigError naming the file."""
        path = tmp_path / "quotawrap.toml"
        path.write_text("cap_tokens = = 5\n")
        with pytest.raises(ConfigError, match=r"quotawrap\.toml"):
            load_config_file(path)

    def test_bad_value_names_the_file_and_the_key(self, tmp_path: Path) -> None:
        """A wrong type is a ConfigError naming the file and the setting."""
        path = tmp_path / "quotawrap.toml"
        path.write_text("hold_ttl = [1, 2]\n")
        with pytest.raises(ConfigError, match=r"quotawrap\.toml.*hold_ttl"):
            load_config_file(path)

    def test_quotawrap_config_variable_points_elsewhere(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """$QUOTAWRAP_CONFIG names the file when no path is given."""
        path = tmp_path / "elsewhere.toml"
        path.write_text("daily_cap = 9\n")
        monkeypatch.setenv("QUOTAWRAP_CONFIG", str(path))
        monkeypatch.chdir(tmp_path)
        assert load_config_file() == {"daily_cap": 9}

    def test_working_directory_file(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """./quotawrap.toml is read by default."""
        (tmp_path / "quotawrap.toml").write_text("daily_cap = 11\n")
        monkeypatch.chdir(tmp_path)
        assert load_config_file() == {"daily_cap": 11}


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[Settings]]:
    """Run the real `run` command with the child replaced by a recorder of its settings."""
    from quotawrap.books.balance import ACCESS_KEY_VARIABLES

    for name in ACCESS_KEY_VARIABLES:  # no background billing sync in these runs
        monkeypatch.delenv(name, raising=False)
    seen: list[Settings] = []

    def fake_run_child(settings: Settings, command: Any, ledger: Any, **_options: Any) -> launcher.ChildResult:
        seen.append(settings)
        return launcher.ChildResult(0, RunTotals(settings.run_id or "", {}), 0)

    monkeypatch.setattr(launcher, "run_child", fake_run_child)
    monkeypatch.chdir(tmp_path)
    yield seen


def _invoke(
    args: list[str], env: dict[str, str], toml: dict[str, Any], seen: list[Settings], tmp_path: Path
) -> Settings:
    store = ["--store", f"sqlite:///{tmp_path / 'ledger.sqlite3'}", "--quiet"]
    result = CliRunner().invoke(
        cli, [*store, *args, "--", "true"], env=env, default_map={"run": toml}, catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    return seen[-1]


class TestPrecedence:
    @pytest.mark.parametrize(
        ("flag", "env", "toml", "expected"),
        [
            (["--cap-tokens", "300"], {"QUOTAWRAP_CAP_TOKENS": "200"}, {"cap_tokens": 100}, 300),
            ([], {"QUOTAWRAP_CAP_TOKENS": "200"}, {"cap_tokens": 100}, 200),
            ([], {}, {"cap_tokens": 100}, 100),
            ([], {}, {}, None),
        ],
    )
    def test_flag_over_env_over_toml(
        self,
        captured: list[Settings],
        tmp_path: Path,
        flag: list[str],
        env: dict[str, str],
        toml: dict[str, Any],
        expected: int | None,
    ) -> None:
        """--cap-tokens beats QUOTAWRAP_CAP_TOKENS beats quotawrap.toml beats the default."""
        assert _invoke(flag, env, toml, captured, tmp_path).cap_tokens == expected

    def test_bool_flag_beats_env(self, captured: list[Settings], tmp_path: Path) -> None:
        """--no-watch wins over QUOTAWRAP_WATCH=1 and toml watch = true."""
        settings = _invoke(["--no-watch"], {"QUOTAWRAP_WATCH": "1"}, {"watch": True}, captured, tmp_path)
        assert settings.watch is False

    def test_bool_env_beats_toml(self, captured: list[Settings], tmp_path: Path) -> None:
        """QUOTAWRAP_INJECT_USAGE=0 wins over toml inject_usage = true."""
        settings = _invoke([], {"QUOTAWRAP_INJECT_USAGE": "0"}, {"inject_usage": True}, captured, tmp_path)
        assert settings.inject_usage is False

    def test_repeatable_flag_beats_env_and_toml(self, captured: list[Settings], tmp_path: Path) -> None:
        """--model given twice replaces the environment's and the file's lists."""
        settings = _invoke(
            ["--model", "a", "--model", "b"],
            {"QUOTAWRAP_MODEL": "c,d"},
            {"model": ("e",)},
            captured,
            tmp_path,
        )
        assert settings.model == ("a", "b")

    def test_repeatable_flag_values_keep_their_commas(self, captured: list[Settings], tmp_path: Path) -> None:
        """--tag note=a,b is one tag whose value has a comma, in the wrapper and in the child's env."""
        settings = _invoke(["--tag", "note=a,b", "--tag", "team=x"], {}, {}, captured, tmp_path)
        assert {"note=a,b", "team=x"} <= set(settings.tag)
        assert Settings.from_env(settings.child_env()).tag == settings.tag

    def test_repeatable_env_may_be_a_json_list(self, captured: list[Settings], tmp_path: Path) -> None:
        """QUOTAWRAP_PACKAGE_MATCH='["m=a, b"]' is one entry with its comma."""
        settings = _invoke([], {"QUOTAWRAP_PACKAGE_MATCH": '["m=a, b"]'}, {}, captured, tmp_path)
        assert settings.package_match == ("m=a, b",)

    def test_repeatable_env_is_comma_separated(self, captured: list[Settings], tmp_path: Path) -> None:
        """QUOTAWRAP_BASE_URL='a,b' is two base URLs, beating the file's."""
        settings = _invoke(
            [],
            {"QUOTAWRAP_BASE_URL": "http://a/v1,http://b/v1"},
            {"base_url": ("http://c",)},
            captured,
            tmp_path,
        )
        assert settings.base_url == ("http://a/v1", "http://b/v1")

    def test_main_reads_quotawrap_toml_from_the_working_directory(
        self, captured: list[Settings], tmp_path: Path
    ) -> None:
        """`quotawrap` itself feeds ./quotawrap.toml to every option."""
        (tmp_path / "quotawrap.toml").write_text("cap-tokens = 1234\nhold_ttl = 5\n")
        with pytest.raises(SystemExit) as exit_info:
            main(["--store", f"sqlite:///{tmp_path / 'l.sqlite3'}", "--quiet", "--", "true"])
        assert exit_info.value.code == 0
        assert (captured[-1].cap_tokens, captured[-1].hold_ttl) == (1234, 5.0)

    def test_main_refuses_an_unknown_toml_key(
        self, captured: list[Settings], tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A bad quotawrap.toml is a usage error (exit 2) before anything runs."""
        (tmp_path / "quotawrap.toml").write_text("cap_tokenz = 5\n")
        with pytest.raises(SystemExit) as exit_info:
            main(["--quiet", "--", "true"])
        assert exit_info.value.code == 2
        assert "cap_tokenz" in capsys.readouterr().err
        assert captured == []


class TestRetiredOptions:
    """An option taken out (RETIRED) is still taken wherever it was given, ignored, and named once on stderr
    with what replaced it: an old script, shell or quotawrap.toml keeps running."""

    @pytest.mark.parametrize(
        ("args", "env", "toml"),
        [
            (["--no-settle-relay"], {}, ""),
            (["--settle-relay"], {}, ""),
            ([], {"QUOTAWRAP_SETTLE_RELAY": "0"}, ""),
            ([], {}, "settle_relay = false\n"),
            ([], {}, "settle-relay = true\n"),
            (["--no-settle-relay"], {"QUOTAWRAP_SETTLE_RELAY": "0"}, "settle_relay = false\n"),
        ],
        ids=["flag-off", "flag-on", "variable", "toml", "toml-dashed", "all-three-said-once"],
    )
    def test_a_retired_option_is_ignored_with_one_line_naming_its_successor(
        self,
        captured: list[Settings],
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str],
        args: list[str],
        env: dict[str, str],
        toml: str,
    ) -> None:
        from quotawrap.config import settings as table

        monkeypatch.setattr(table, "_retired_said", set())  # said once per process: this test's process is shared
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        if toml:
            (tmp_path / "quotawrap.toml").write_text(toml)
        with pytest.raises(SystemExit) as exit_info:
            main(["--store", f"sqlite:///{tmp_path / 'l.sqlite3'}", "--quiet", *args, "--", "true"])
        assert exit_info.value.code == 0
        said = capsys.readouterr().err.splitlines()
        assert len(said) == 1 and "settle-relay" in said[0] and "--no-advances" in said[0], said
        assert captured[-1].draws_ahead  # ignored: the run keeps its advances and their relay

    def test_the_retired_flag_is_not_offered(self) -> None:
        """--help lists only the options that work; the retired flag is accepted, not advertised."""
        result = CliRunner().invoke(cli, ["run", "--help"])
        assert result.exit_code == 0 and "--no-advances" in result.output
        assert "settle-relay" not in result.output

    def test_the_child_is_not_handed_a_retired_variable(self) -> None:
        """The wrapper said it once; a quotawrap nested in the child does not say it again."""
        env = launcher.child_environment(Settings(), {"QUOTAWRAP_SETTLE_RELAY": "0", "HOME": "/home/x"})
        assert "QUOTAWRAP_SETTLE_RELAY" not in env and env["HOME"] == "/home/x"


class TestEndToEnd:
    def test_toml_env_and_flag_reach_the_child(self, tmp_path: Path) -> None:
        """A real `python -m quotawrap` run: the child sees the winning values as QUOTAWRAP_* variables."""
        (tmp_path / "quotawrap.toml").write_text("cap_tokens = 777\nhold_ttl = 9\ndaily_cap = 5\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("QUOTAWRAP_")}
        env["QUOTAWRAP_HOLD_TTL"] = "8"
        probe = (
            "import json, os; print(json.dumps({k: v for k, v in os.environ.items() if k.startswith('QUOTAWRAP_')}))"
        )
        report = tmp_path / "report.json"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "quotawrap",
                "--store",
                f"sqlite:///{tmp_path / 'l.sqlite3'}",
                "--daily-cap",
                "6",
                "--quiet",
                "--report-json",
                str(report),
                "--",
                sys.executable,
                "-c",
                probe,
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        child = json.loads(proc.stdout.strip().splitlines()[-1])
        assert child["QUOTAWRAP_CAP_TOKENS"] == "777"
        assert math.isclose(float(child["QUOTAWRAP_HOLD_TTL"]), 8.0)
        assert child["QUOTAWRAP_DAILY_CAP"] == "6"
        assert child["QUOTAWRAP_RUN_ID"]
        assert "QUOTAWRAP_REPORT_JSON" not in child
        assert json.loads(report.read_text())["limits"]["cap_tokens"] == 777


class TestOptionRules:
    """Each option's rule lives in OPTIONS once and applies however the value arrives."""

    @pytest.mark.parametrize("option", NUMERIC_OPTIONS, ids=lambda option: option.name)
    def test_every_number_refuses_negative_nan_and_infinite(self, option: Option) -> None:
        """-1, nan and inf are refused by every numeric option, naming its flag and variable."""
        bad = [-1] if option.type is int else [-1.0, math.nan, math.inf]
        for value in bad:
            with pytest.raises(ConfigError, match=f"{option.cli_flag} \\({env_name(option.name)}\\)"):
                Settings(**{option.name: value})

    def test_the_child_environment_is_checked_too(self) -> None:
        """A child rebuilding its settings from a bad variable gets the same ConfigError as the CLI."""
        with pytest.raises(ConfigError, match="--hold-ttl"):
            Settings.from_env({"QUOTAWRAP_HOLD_TTL": "nan"})

    def test_a_bad_webhook_is_refused_without_showing_it(self) -> None:
        """--alert-webhook's URL is its credential: a value that is no URL is refused without being echoed."""
        with pytest.raises(ConfigError) as refused:
            Settings(alert_webhook="hooks.slack.com/services/T0/B0/XYZSECRET")
        assert "--alert-webhook (QUOTAWRAP_ALERT_WEBHOOK): must be an http:// or https:// URL" in str(refused.value)
        assert "XYZSECRET" not in str(refused.value)

    @pytest.mark.parametrize("text", ["50,,", "0", "fifty", "2000"])
    def test_alert_at_is_a_list_of_percents(self, text: str) -> None:
        """--alert-at takes percents above 0, from flags, the environment and toml alike."""
        with pytest.raises(ConfigError, match="--alert-at"):
            Settings.from_env({"QUOTAWRAP_ALERT_AT": text})
        assert Settings(alert_at="90,95").alert_at == "90,95"

    def test_defaults_and_zero_caps_pass(self) -> None:
        """The defaults pass their own rules, and a cap of 0 (block everything) is a valid choice."""
        assert Settings(cap_tokens=0, daily_cap=0, cap_cost=0.0).daily_cap == 0


BASE_URLS_KEPT = [
    "https://ark.cn-beijing.volces.com/api/v3",
    "http://127.0.0.1:8080/api/v3",
    "http://localhost/v1",
    "HTTPS://EXAMPLE.COM",
    "http://[::1]:9000/v1",
    "http://user:secret@host:443/x",
    "http://host:/v1",  # an empty port is the scheme's default, as urllib reads it
    "http://host?x=1",
]
BASE_URLS_REFUSED = [
    ("http://127.0.0.1:notaport/v3", "port"),
    ("http://host:0/v1", "port"),
    ("http://host:70000/v1", "port"),
    ("http://host:-1/v1", "port"),
    ("http://host:８０/v1", "port"),  # fullwidth digits: no port a socket takes
    ("ftp://x", "http:// or https://"),
    ("127.0.0.1:8080/api/v3", "http:// or https://"),
    ("ws://host/v1", "http:// or https://"),
    ("http:///v3", "no host"),
    ("http://user@/v3", "no host"),
    ("http://[::1/v1", "IPv6"),
    ("http://[::1]x/v1", "IPv6"),
    ("http://exa mple.com/v1", "spaces"),
    ("http://host/v1\n", "control"),
]


@pytest.mark.parametrize("url", BASE_URLS_KEPT)
def test_a_base_url_urllib_reads_is_kept(url: str) -> None:
    """The check reads host and port as urllib does (it is not imported on a run's start path)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    assert parts.scheme.lower() in ("http", "https") and parts.hostname and (parts.port or 1) > 0
    assert Settings(base_url=(url,)).base_url == (url,)


@pytest.mark.parametrize(("url", "problem"), BASE_URLS_REFUSED)
def test_a_base_url_no_client_could_reach_is_refused_naming_the_flag(url: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=r"--base-url \(QUOTAWRAP_BASE_URL\): .*" + problem):
        Settings(base_url=("https://ark.cn-beijing.volces.com/api/v3", url))


def test_a_bad_base_url_in_the_environment_is_refused_too() -> None:
    with pytest.raises(ConfigError, match="--base-url"):
        Settings.from_env({"QUOTAWRAP_BASE_URL": "http://127.0.0.1:notaport/v3"})


def _help_texts() -> list[tuple[str, str]]:
    import click

    def walk(command: click.Command, path: str) -> list[tuple[str, str]]:
        found = [(path, command.help or "")]
        found += [(f"{path} {param.opts[0]}", getattr(param, "help", None) or "") for param in command.params]
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                found += walk(sub, f"{path} {name}")
        return found

    return walk(cli, "quotawrap")


# Words of the project's own history and internals, meaningless to someone reading --help.
_JARGON = ("seed", "v6", "§", "issue", "soft-evict", "snapshot", "lease", "B0", "reconcil", "collection cap", "binds")


@pytest.mark.parametrize("word", _JARGON)
def test_help_texts_speak_the_users_words(word: str) -> None:
    """Every command's and option's help says what it does, not where it came from."""
    used = [where for where, text in _help_texts() if word.lower() in text.lower()]
    assert not used, f"{word!r} in the help of {used}"
    assert len(_help_texts()) > 150  # the walk reaches every command's options
