"""Tests for quotawrap.intercept._importhook: post-import hooks, each run in a fresh interpreter.

A hook is global state of the import system (sys.meta_path, sys.modules), so every case runs
in a subprocess with a throwaway module written to tmp_path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_python

PACKAGE_HOME = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, script: str) -> tuple[Any, str]:
    """Run ``script`` with tmp_path importable; it prints one JSON value as its last line."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(PACKAGE_HOME)])}
    env.pop("QUOTAWRAP_RUN_ID", None)
    return run_python(script, cwd=tmp_path, env=env)


@pytest.fixture
def probe_module(tmp_path: Path) -> str:
    """A throwaway module that records when its body has run."""
    (tmp_path / "qw_probe.py").write_text("BODY_RAN = True\n\ndef answer():\n    return 42\n")
    return "qw_probe"


class TestFirstImport:
    def test_hook_runs_after_the_module_body(self, tmp_path: Path, probe_module: str) -> None:
        """The hook sees the fully executed module, on the program's own import."""
        result, _ = _run(
            tmp_path,
            """
            import json, sys
            from quotawrap.intercept._importhook import when_imported
            seen = []
            when_imported("qw_probe", lambda module: seen.append(getattr(module, "BODY_RAN", False)))
            before = "qw_probe" in sys.modules
            import qw_probe
            print(json.dumps({"before": before, "seen": seen}))
            """,
        )
        assert result == {"before": False, "seen": [True]}

    def test_registering_does_not_import(self, tmp_path: Path, probe_module: str) -> None:
        """when_imported is lazy: the module is not imported until the program imports it."""
        result, _ = _run(
            tmp_path,
            """
            import json, sys
            from quotawrap.intercept._importhook import when_imported
            when_imported("qw_probe", lambda module: None)
            print(json.dumps("qw_probe" in sys.modules))
            """,
        )
        assert result is False

    def test_hook_runs_once_however_often_imported(self, tmp_path: Path, probe_module: str) -> None:
        """A second `import` (from sys.modules) does not run the hook again."""
        result, _ = _run(
            tmp_path,
            """
            import json, importlib
            from quotawrap.intercept._importhook import when_imported
            calls = []
            when_imported("qw_probe", calls.append)
            import qw_probe
            import qw_probe
            importlib.import_module("qw_probe")
            print(json.dumps(len(calls)))
            """,
        )
        assert result == 1

    def test_hook_can_patch_what_the_program_then_uses(self, tmp_path: Path, probe_module: str) -> None:
        """What the hook changes is what `from module import name` hands out afterwards."""
        result, _ = _run(
            tmp_path,
            """
            import json
            from quotawrap.intercept._importhook import when_imported
            def patch(module):
                module.answer = lambda: "patched"
            when_imported("qw_probe", patch)
            from qw_probe import answer
            print(json.dumps(answer()))
            """,
        )
        assert result == "patched"

    def test_package_hook_sees_its_submodules(self, tmp_path: Path) -> None:
        """A package's hook runs after its __init__ imported its submodules (requests.adapters)."""
        package = tmp_path / "qw_pkg"
        package.mkdir()
        (package / "__init__.py").write_text("from . import adapters\n")
        (package / "adapters.py").write_text("class HTTPAdapter:\n    pass\n")
        result, _ = _run(
            tmp_path,
            """
            import json
            from quotawrap.intercept._importhook import when_imported
            seen = []
            when_imported("qw_pkg", lambda module: seen.append(hasattr(module.adapters, "HTTPAdapter")))
            import qw_pkg
            print(json.dumps(seen))
            """,
        )
        assert result == [True]

    def test_other_modules_keep_their_own_loader(self, tmp_path: Path, probe_module: str) -> None:
        """Only modules with hooks are wrapped; the hooked one still serves its source."""
        (tmp_path / "qw_other.py").write_text("X = 1\n")
        result, _ = _run(
            tmp_path,
            """
            import inspect, json
            from quotawrap.intercept._importhook import when_imported
            when_imported("qw_probe", lambda module: None)
            import qw_other, qw_probe
            print(json.dumps({
                "other": type(qw_other.__loader__).__name__,
                "probe": type(qw_probe.__loader__).__name__,
                "source": "def answer" in inspect.getsource(qw_probe),
            }))
            """,
        )
        assert result["other"] != "_Loader"
        assert result["probe"] == "_Loader"
        assert result["source"] is True

    def test_several_hooks_run_in_order(self, tmp_path: Path, probe_module: str) -> None:
        """Hooks for one module run in registration order."""
        result, _ = _run(
            tmp_path,
            """
            import json
            from quotawrap.intercept._importhook import when_imported
            order = []
            when_imported("qw_probe", lambda module: order.append("first"))
            when_imported("qw_probe", lambda module: order.append("second"))
            import qw_probe
            print(json.dumps(order))
            """,
        )
        assert result == ["first", "second"]


class TestAlreadyImported:
    def test_runs_at_once(self, tmp_path: Path, probe_module: str) -> None:
        """A module imported before the hook was registered is handed to it immediately."""
        result, _ = _run(
            tmp_path,
            """
            import json
            import qw_probe
            from quotawrap.intercept._importhook import when_imported
            seen = []
            when_imported("qw_probe", lambda module: seen.append(module is qw_probe))
            print(json.dumps(seen))
            """,
        )
        assert result == [True]


class TestRaisingHook:
    def test_import_still_succeeds(self, tmp_path: Path, probe_module: str) -> None:
        """A hook that raises costs the program nothing: the import works, a line on stderr says why."""
        result, stderr = _run(
            tmp_path,
            """
            import json
            from quotawrap.intercept._importhook import when_imported
            def broken(module):
                raise RuntimeError("no luck")
            later = []
            when_imported("qw_probe", broken)
            when_imported("qw_probe", later.append)
            import qw_probe
            print(json.dumps({"answer": qw_probe.answer(), "later": len(later)}))
            """,
        )
        assert result == {"answer": 42, "later": 1}
        assert "could not instrument qw_probe" in stderr
        assert "no luck" in stderr

    def test_already_imported_does_not_raise_either(self, tmp_path: Path, probe_module: str) -> None:
        """Registering a raising hook for an imported module does not raise into the registrant."""
        result, stderr = _run(
            tmp_path,
            """
            import json
            import qw_probe
            from quotawrap.intercept._importhook import when_imported
            def broken(module):
                raise RuntimeError("no luck")
            when_imported("qw_probe", broken)
            print(json.dumps("survived"))
            """,
        )
        assert result == "survived"
        assert "could not instrument qw_probe" in stderr

    def test_module_that_fails_to_import_skips_hooks(self, tmp_path: Path) -> None:
        """The user's own ImportError is theirs: it propagates and no hook sees a half-made module."""
        (tmp_path / "qw_broken.py").write_text("raise ImportError('broken on purpose')\n")
        result, _ = _run(
            tmp_path,
            """
            import json
            from quotawrap.intercept._importhook import when_imported
            seen = []
            when_imported("qw_broken", seen.append)
            try:
                import qw_broken
            except ImportError as exc:
                error = str(exc)
            print(json.dumps({"error": error, "seen": len(seen)}))
            """,
        )
        assert result == {"error": "broken on purpose", "seen": 0}
