"""Tests for the injection path: wrapper.child (child_environment, injection_blockers), bootstrap, sitecustomize."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from quotawrap import bootstrap
from quotawrap.config.settings import Settings
from quotawrap.wrapper.child import HOOK_DIR, PACKAGE_HOME, child_environment, injection_blockers
from tests.conftest import run_python

PATCHED_PROBE = "import json, httpx\nprint(json.dumps(hasattr(httpx.Client._send_single_request, '__wrapped__')))"


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUOTAWRAP_") and k != "PYTHONPATH"}
    env.update(extra)
    return env


def _child(tmp_path: Path, env: dict[str, str], script: str) -> tuple[Any, str]:
    return run_python(script, cwd=tmp_path, env=env)


class TestChildEnvironment:
    def test_hook_dir_first_on_a_fresh_path(self) -> None:
        """Without a PYTHONPATH the child's is just the hook directory."""
        env = child_environment(Settings(), base={})
        assert env["PYTHONPATH"] == HOOK_DIR

    def test_existing_entries_are_kept_after_the_hook(self) -> None:
        """The program's own PYTHONPATH survives, in order, behind the hook."""
        env = child_environment(Settings(), base={"PYTHONPATH": os.pathsep.join(["/a", "/b"])})
        assert env["PYTHONPATH"].split(os.pathsep) == [HOOK_DIR, "/a", "/b"]

    def test_stale_hook_entries_are_removed(self) -> None:
        """A nested run (or a leftover) does not stack the hook twice, however it was spelt."""
        stale = os.pathsep.join(["/a", HOOK_DIR, "/b", HOOK_DIR + "/", HOOK_DIR])
        entries = child_environment(Settings(), base={"PYTHONPATH": stale})["PYTHONPATH"].split(os.pathsep)
        assert entries == [HOOK_DIR, "/a", "/b"]

    def test_idempotent(self) -> None:
        """Wrapping an already wrapped environment changes nothing."""
        once = child_environment(Settings(run_id="r"), base={"PYTHONPATH": "/a"})
        assert child_environment(Settings(run_id="r"), base=once) == once

    def test_empty_entries_keep_meaning_the_working_directory(self) -> None:
        """`PYTHONPATH=:/x` (a sloppy `export PYTHONPATH=$PYTHONPATH:/x`) keeps the cwd importable."""
        env = child_environment(Settings(), base={"PYTHONPATH": os.pathsep + "/x"})
        assert env["PYTHONPATH"].split(os.pathsep) == [HOOK_DIR, "", "/x"]

    def test_the_alert_webhook_stays_with_the_wrapper(self) -> None:
        """QUOTAWRAP_ALERT_WEBHOOK from the caller's shell is the wrapper's credential, not the child's."""
        base = {"QUOTAWRAP_ALERT_WEBHOOK": "https://hooks.example.com/services/T/B/X", "QUOTAWRAP_ALERT_AT": "90"}
        env = child_environment(Settings(alert_webhook="https://hooks.example.com/services/T/B/X"), base=base)
        assert "QUOTAWRAP_ALERT_WEBHOOK" not in env
        assert env["QUOTAWRAP_ALERT_AT"] == "90"  # not a secret: left as the caller's shell had it

    def test_settings_and_home_are_exported(self) -> None:
        """The child gets QUOTAWRAP_HOME and every child setting as QUOTAWRAP_*."""
        env = child_environment(Settings(run_id="r1", cap_tokens=9, store="sqlite:////tmp/l"), base={"X": "1"})
        assert env["X"] == "1"
        assert env["QUOTAWRAP_HOME"] == PACKAGE_HOME
        assert (env["QUOTAWRAP_RUN_ID"], env["QUOTAWRAP_CAP_TOKENS"]) == ("r1", "9")

    def test_stale_quotawrap_variables_do_not_outlive_an_unset_option(self) -> None:
        """QUOTAWRAP_CAP_TOKENS='' in the caller's shell must not reach (and break) the child's guard."""
        env = child_environment(Settings(run_id="r"), base={"QUOTAWRAP_CAP_TOKENS": ""})
        assert "QUOTAWRAP_CAP_TOKENS" not in env
        assert Settings.from_env(env).cap_tokens is None

    def test_real_interpreter_puts_the_hook_first(self, tmp_path: Path) -> None:
        """A child started with this environment has the hook dir at the front of sys.path."""
        env = child_environment(Settings(), base=_clean_env(PYTHONPATH=str(tmp_path)))
        result, _ = _child(tmp_path, env, "import json, sys; print(json.dumps(sys.path))")
        hook_index = result.index(HOOK_DIR)
        assert result.index(str(tmp_path)) == hook_index + 1
        assert result.count(HOOK_DIR) == 1


class TestInjectionBlockers:
    @pytest.mark.parametrize(
        ("command", "expected"),
        [
            (["python", "-I", "x.py"], ["-I"]),
            (["python3", "-IS"], ["-I", "-S"]),
            (["/usr/bin/python3.11", "-E", "x.py"], ["-E"]),
            (["python", "-u", "-S", "x.py"], ["-S"]),
            (["python", "-Ic", "print(1)"], ["-I"]),
            (["python", "-c", "print(1)", "-I"], []),
            (["python", "-m", "mod", "-E"], []),
            (["python", "-mmod", "-E"], []),
            (["python", "x.py", "-I"], []),
            (["python", "-", "-I"], []),
            (["python", "-W", "ignore", "-I", "x.py"], ["-I"]),
            (["python", "-Wignore", "-E", "x.py"], ["-E"]),
            (["python", "-X", "importtime", "-S", "x.py"], ["-S"]),
            (["python", "-I", "-I", "x.py"], ["-I"]),
            (["python", "-s", "x.py"], []),
            (["python", "--check-hash-based-pycs", "always", "-I", "x.py"], ["-I"]),
            (["python"], []),
            (["pytest", "-I"], []),
            (["bash", "-c", "python -I x.py"], []),
            (["uv", "run", "-I"], []),
            (["pythonista", "-I"], []),
            ([], []),
        ],
    )
    def test_table(self, command: list[str], expected: list[str]) -> None:
        """Only the interpreter's own -I/-E/-S (before the script, -c or -m) are reported."""
        assert injection_blockers(command) == expected


class TestBootstrap:
    def test_does_nothing_without_a_run_id(self, tmp_path: Path) -> None:
        """A Python that merely has the hook on its path (no QUOTAWRAP_RUN_ID) is left alone."""
        env = _clean_env(PYTHONPATH=HOOK_DIR, QUOTAWRAP_HOME=PACKAGE_HOME)
        result, _ = _child(
            tmp_path,
            env,
            """
            import json, sys
            quotawrap_at_start = "quotawrap" in sys.modules
            import httpx
            print(json.dumps({
                "quotawrap_at_start": quotawrap_at_start,
                "patched": hasattr(httpx.Client._send_single_request, "__wrapped__"),
            }))
            """,
        )
        assert result == {"quotawrap_at_start": False, "patched": False}

    def test_patches_lazily_with_a_run_id(self, tmp_path: Path) -> None:
        """With a run id nothing heavy loads at start-up; httpx, httpx2 and requests are patched on import."""
        env = _clean_env(PYTHONPATH=HOOK_DIR, QUOTAWRAP_HOME=PACKAGE_HOME, QUOTAWRAP_RUN_ID="r")
        result, stderr = _child(
            tmp_path,
            env,
            """
            import json, sys
            heavy_modules = ("httpx", "httpx2", "requests", "quotawrap.admission.guard", "sqlite3")
            heavy = [m for m in heavy_modules if m in sys.modules]
            import quotawrap.bootstrap as bootstrap
            loaded = bootstrap.loaded
            import httpx, httpx2, requests
            print(json.dumps({
                "heavy_at_start": heavy,
                "loaded": loaded,
                "httpx": hasattr(httpx.Client._send_single_request, "__wrapped__"),
                "httpx_async": hasattr(httpx.AsyncClient._send_single_request, "__wrapped__"),
                "httpx2": hasattr(httpx2.Client._send_single_request, "__wrapped__"),
                "requests": hasattr(requests.adapters.HTTPAdapter.send, "__wrapped__"),
            }))
            """,
        )
        assert result == {
            "heavy_at_start": [],
            "loaded": True,
            "httpx": True,
            "httpx_async": True,
            "httpx2": True,
            "requests": True,
        }
        assert stderr == ""

    def test_initialize_swallows_an_install_failure(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A failing install is one line on stderr, never an exception in the user's interpreter."""
        import quotawrap.intercept

        def broken() -> None:
            raise RuntimeError("cannot patch")

        monkeypatch.setenv("QUOTAWRAP_RUN_ID", "r")
        monkeypatch.setattr(quotawrap.intercept, "install", broken)
        monkeypatch.setattr(bootstrap, "loaded", False)
        bootstrap.initialize()
        assert bootstrap.loaded is False
        assert "could not install interception" in capsys.readouterr().err
        with pytest.raises(RuntimeError, match="cannot patch"):
            bootstrap.initialize(swallow_exceptions=False)

    def test_initialize_without_run_id_does_not_install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """No QUOTAWRAP_RUN_ID: install() is not even called."""
        import quotawrap.intercept

        calls: list[int] = []
        monkeypatch.delenv("QUOTAWRAP_RUN_ID", raising=False)
        monkeypatch.setattr(quotawrap.intercept, "install", lambda: calls.append(1))
        bootstrap.initialize()
        assert calls == []


class TestSitecustomize:
    SCRIPT = """
        import json, sys
        module = sys.modules.get("sitecustomize")
        print(json.dumps({
            "file": getattr(module, "__file__", None),
            "loaded": getattr(module, "loaded", None),
            "bootstrap_loaded": getattr(sys.modules.get("quotawrap.bootstrap"), "loaded", None),
        }))
        """

    def test_loaded_flag_without_run_id(self, tmp_path: Path) -> None:
        """Ours is the sitecustomize that ran; it finished (loaded) without touching quotawrap."""
        result, stderr = _child(tmp_path, _clean_env(PYTHONPATH=HOOK_DIR), self.SCRIPT)
        assert Path(result["file"]).parent == Path(HOOK_DIR)
        assert result["loaded"] is True
        assert result["bootstrap_loaded"] is None
        assert stderr == ""

    def test_loaded_flag_with_run_id(self, tmp_path: Path) -> None:
        """With a run id both our sitecustomize and the bootstrap report loaded."""
        env = _clean_env(PYTHONPATH=HOOK_DIR, QUOTAWRAP_HOME=PACKAGE_HOME, QUOTAWRAP_RUN_ID="r")
        result, _ = _child(tmp_path, env, self.SCRIPT)
        assert (result["loaded"], result["bootstrap_loaded"]) == (True, True)

    def test_never_raises_when_quotawrap_cannot_be_imported(self, tmp_path: Path) -> None:
        """A broken `quotawrap` ahead on the path: the program runs, unguarded, and stderr says so."""
        stub = tmp_path / "stub" / "quotawrap"
        stub.mkdir(parents=True)
        (stub / "__init__.py").write_text("raise RuntimeError('this quotawrap is broken')\n")
        env = _clean_env(
            PYTHONPATH=os.pathsep.join([str(stub.parent), HOOK_DIR]),
            QUOTAWRAP_HOME=str(tmp_path / "nowhere"),
            QUOTAWRAP_RUN_ID="r",
        )
        result, stderr = _child(tmp_path, env, self.SCRIPT)
        assert Path(result["file"]).parent == Path(HOOK_DIR)
        assert result["loaded"] is False
        assert "NOT guarded" in stderr
        assert "this quotawrap is broken" in stderr

    def test_missing_quotawrap_is_not_fatal(self, tmp_path: Path) -> None:
        """An ImportError for quotawrap itself (a stub package without bootstrap) is reported, not raised."""
        stub = tmp_path / "stub" / "quotawrap"
        stub.mkdir(parents=True)
        (stub / "__init__.py").write_text("")
        env = _clean_env(
            PYTHONPATH=os.pathsep.join([str(stub.parent), HOOK_DIR]),
            QUOTAWRAP_HOME=str(tmp_path / "nowhere"),
            QUOTAWRAP_RUN_ID="r",
        )
        result, stderr = _child(tmp_path, env, self.SCRIPT)
        assert result["loaded"] is False
        assert "NOT guarded" in stderr

    def test_chains_the_users_sitecustomize(self, tmp_path: Path) -> None:
        """The program's own sitecustomize (later on the path) still runs."""
        user = tmp_path / "user"
        user.mkdir()
        (user / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE_RAN'] = '1'\n")
        env = _clean_env(PYTHONPATH=os.pathsep.join([HOOK_DIR, str(user)]))
        result, stderr = _child(
            tmp_path, env, "import json, os; print(json.dumps(os.environ.get('USER_SITECUSTOMIZE_RAN')))"
        )
        assert result == "1"
        assert stderr == ""

    def test_a_broken_user_sitecustomize_does_not_stop_ours(self, tmp_path: Path) -> None:
        """The user's sitecustomize raising is reported; interception is still installed."""
        user = tmp_path / "user"
        user.mkdir()
        (user / "sitecustomize.py").write_text("raise ValueError('user bug')\n")
        env = _clean_env(
            PYTHONPATH=os.pathsep.join([HOOK_DIR, str(user)]),
            QUOTAWRAP_HOME=PACKAGE_HOME,
            QUOTAWRAP_RUN_ID="r",
        )
        result, stderr = _child(
            tmp_path,
            env,
            PATCHED_PROBE,
        )
        assert result is True
        assert "user bug" in stderr
