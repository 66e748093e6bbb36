"""The option table and the run's record without their heavy imports: the same values and text as before.

``Settings``/``Option`` are plain classes now, the defaults of the limit math's options are copied
(a default needs no check, so a plain run never imports ``quota``), and a few helpers write JSON
and check characters without json/re. Each is held here to what it replaced.
"""

from __future__ import annotations

import json
import pickle
import re
import shlex
import sqlite3
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quotawrap.config.settings import OPTION_BY_NAME, OPTIONS, Settings, _json_list, _run_id
from quotawrap.core.errors import ConfigError
from quotawrap.core.money import format_cny
from quotawrap.core.quota import QuotaSettings
from quotawrap.core.tags import parse_tags
from quotawrap.ledger import open_ledger
from quotawrap.ledger.sqlite.ledger import SQLiteLedger
from quotawrap.ledger.sqlite.runs import RunBooks, open_runs, tags_json
from quotawrap.support.log import NO_COST

_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20)


def test_the_limit_options_defaults_are_the_limit_maths() -> None:
    quota = QuotaSettings()
    assert OPTION_BY_NAME["daily_cap"].default == quota.daily_cap
    assert OPTION_BY_NAME["small_buffer"].default == quota.small_buffer
    assert OPTION_BY_NAME["usage_wall"].default == quota.usage_wall
    assert OPTION_BY_NAME["balance_wall"].default == quota.balance_wall
    assert OPTION_BY_NAME["balance_lag"].default == quota.balance_lag_s


def test_every_default_passes_its_own_rule() -> None:
    """Defaults skip the check (so the rules' modules stay unloaded): each must pass it anyway."""
    for option in OPTIONS:
        if option.check is not None and option.default is not None:
            for item in option.default if option.multiple else (option.default,):
                assert option.check(item) is None, option.name


def test_a_value_that_is_not_the_default_is_still_checked() -> None:
    with pytest.raises(ConfigError, match="--daily-cap"):
        Settings(daily_cap=-1)
    with pytest.raises(ConfigError, match="--unknown-price"):
        Settings(unknown_price="cheap")
    with pytest.raises(ConfigError, match="--wait"):
        Settings().replace(wait=float("nan"))


def test_settings_behave_as_the_frozen_dataclass_did() -> None:
    settings = Settings(daily_cap=5, tag=("a=b",))
    assert settings == Settings(daily_cap=5, tag=("a=b",)) and settings != Settings()
    assert settings.replace(quiet=True).quiet and not settings.quiet
    assert pickle.loads(pickle.dumps(settings)) == settings
    assert "daily_cap=5" in repr(settings)
    with pytest.raises(AttributeError):
        settings.quiet = True  # type: ignore[misc]
    with pytest.raises(TypeError, match="no_such_option"):
        Settings(no_such_option=1)
    assert settings.quota.daily_cap == 5


@given(st.lists(_TEXT, max_size=5))
def test_child_env_lists_are_jsons(values: list[str]) -> None:
    assert _json_list(values) == json.dumps(values, ensure_ascii=False)


@given(st.dictionaries(_TEXT, _TEXT, max_size=5))
def test_run_tags_are_jsons(tags: dict[str, str]) -> None:
    assert tags_json(tags) == json.dumps(tags)


@given(st.text(max_size=140))
def test_the_run_id_rule_is_the_pattern(text: str) -> None:
    pattern = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,127}")
    assert (_run_id(text) is None) == (pattern.fullmatch(text) is not None)


@given(st.text(max_size=12), st.text(max_size=12))
def test_tag_rules_are_the_patterns(key: str, value: str) -> None:
    # a tag splits at its first "=": a key holding one moves the rest into the value
    key, _, value = f"{key}={value}".partition("=")
    key_ok = re.fullmatch(r"[A-Za-z0-9_.-]+", key.strip()) is not None
    value_ok = bool(value.strip()) and re.search(r"[\x00-\x1f\x7f]", value) is None and len(value) <= 256
    try:
        parse_tags([f"{key}={value}"])
    except ConfigError:
        assert not (key_ok and value_ok)
    else:
        assert key_ok and value_ok


def test_no_cost_is_format_cny_of_zero() -> None:
    assert format_cny(0) == NO_COST


def _row(path: Path, run_id: str) -> tuple[object, ...]:
    with sqlite3.connect(path) as conn:
        return tuple(conn.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,)).fetchone())


def test_the_lean_record_is_the_full_ledgers(tmp_path: Path) -> None:
    """The same run written by SQLiteLedger.start_run/end_run and by the lean books: the same row."""
    from quotawrap.ledger.base import RunRecord

    path = tmp_path / "ledger.sqlite3"
    ledger = SQLiteLedger(path)
    command = shlex.join(["python", "-c", "print('é')"])
    tags = {"user": "ü", "host": "h", "note": 'a "quoted", \\ value'}
    ledger.start_run(RunRecord("full", 1.5, command=command, tags=tags))
    ledger.end_run("full", 3, 2.5)
    ledger.close()
    runs = open_runs(str(path))
    assert runs is not None
    books = RunBooks(f"sqlite:///{path}", runs, open_ledger)
    books.start_run("lean", 1.5, command, tags)
    books.end_run("lean", 3, 2.5)
    assert books.known_models() == [] and not books.pruned_today(0.0)
    books.close()
    assert _row(path, "lean")[1:] == _row(path, "full")[1:]


def test_anything_unusual_takes_the_full_path(tmp_path: Path) -> None:
    """No file, an empty or foreign file, an older schema: open_runs declines (the full ledger decides)."""
    path = tmp_path / "ledger.sqlite3"
    assert open_runs(str(path)) is None  # a new ledger is made complete by the full path
    path.write_bytes(b"")
    assert open_runs(str(path)) is None
    path.write_bytes(b"not a database at all, not at all")
    assert open_runs(str(path)) is None
    path.unlink()
    SQLiteLedger(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE meta SET value = '4' WHERE key = 'schema'")
    assert open_runs(str(path)) is None
    link = tmp_path / "link.sqlite3"
    link.symlink_to(path)
    assert open_runs(str(link)) is None


def test_the_full_ledger_takes_over_from_the_lean_connection(tmp_path: Path) -> None:
    """Once the full ledger opens, the lean connection is closed and the full ledger ends the run."""
    path = tmp_path / "ledger.sqlite3"
    SQLiteLedger(path).close()
    runs = open_runs(str(path))
    assert runs is not None
    books = RunBooks(f"sqlite:///{path}", runs, open_ledger)
    books.start_run("r", 1.0, "true", {})
    assert books.run_totals("r").run_id == "r"  # any other attribute: the full ledger
    books.end_run("r", 0, 2.0)
    books.close()
    assert _row(path, "r")[2] == 2.0
