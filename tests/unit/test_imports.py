"""The import rules hold for the package, and the checker catches a broken one."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.check_imports import import_graph, problems, pure_modules


def _package(root: Path, files: dict[str, str]) -> Path:
    package = root / "quotawrap"
    for name, source in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source), encoding="utf-8")
    return package


class TestImportRules:
    """No import cycle among quotawrap modules; pure modules stay free of I/O."""

    def test_the_package_keeps_the_rules(self) -> None:
        """quotawrap itself has no cycle and its pure modules import nothing that does I/O."""
        assert problems() == []

    def test_the_pure_modules_exist(self) -> None:
        """The rule checks real modules: each pure module present today is found by the checker."""
        internal, _ = import_graph(Path(__file__).resolve().parents[2] / "quotawrap")
        for name in (
            "quotawrap.core.quota",
            "quotawrap.core.estimate",
            "quotawrap.core.usage",
            "quotawrap.core.sse",
            "quotawrap.core.tags",
            "quotawrap.serve._http",
            "quotawrap.core.endpoints",
            "quotawrap.core.money",
        ):
            assert name in pure_modules(internal) and name in internal

    def test_a_cycle_through_a_lazy_import_is_caught(self, tmp_path: Path) -> None:
        """A cycle closed by an import inside a function (invisible at import time) still fails the check."""
        package = _package(
            tmp_path,
            {
                "__init__.py": "",
                "prices.py": "from .settings import X\n",
                "settings.py": "def f():\n    from . import prices\n",
            },
        )
        assert problems(package, layers=None) == ["import cycle: quotawrap.prices <-> quotawrap.settings"]

    def test_a_cycle_between_a_package_and_its_submodule_is_caught(self, tmp_path: Path) -> None:
        """An adapter importing from its parent package, which imports the adapter, is a cycle."""
        package = _package(
            tmp_path,
            {
                "__init__.py": "",
                "intercept/__init__.py": "from .adapter import patch\ndef get_guard(): ...\n",
                "intercept/adapter.py": "def patch():\n    from . import get_guard\n",
            },
        )
        assert problems(package, layers=None) == ["import cycle: quotawrap.intercept <-> quotawrap.intercept.adapter"]

    def test_a_pure_module_importing_io_is_caught(self, tmp_path: Path) -> None:
        """A pure module reaching an I/O module of ours or of the standard library fails the check."""
        package = _package(
            tmp_path,
            {
                "__init__.py": "",
                "core/__init__.py": "",
                "core/quota.py": "import os.path\nfrom .. import ledger\n",
                "ledger.py": "import sqlite3\n",
            },
        )
        assert problems(package, layers=None) == [
            "quotawrap.core.quota (pure) imports quotawrap.ledger, which is not pure",
            "quotawrap.core.quota (pure) imports os.path, an I/O module",
        ]

    def test_a_cycle_through_an_annotation_only_import_is_caught(self, tmp_path: Path) -> None:
        """An import under ``if TYPE_CHECKING:`` never runs, yet it ties the two modules' types together: a cycle
        it closes fails the check, whether the guard is a local flag or ``typing.TYPE_CHECKING``."""
        for n, flag in enumerate(
            ("TYPE_CHECKING = False\nif TYPE_CHECKING:", "import typing\nif typing.TYPE_CHECKING:")
        ):
            files = {
                "__init__.py": "",
                "guard.py": "from .tasks import TaskPolled\n",
                "tasks.py": f"{flag}\n    from .guard import Guard\nTaskPolled = 1\n",
            }
            assert problems(_package(tmp_path / str(n), files), layers=None) == [
                "import cycle: quotawrap.guard <-> quotawrap.tasks"
            ]

    def test_a_protocol_in_the_lower_module_closes_no_cycle(self, tmp_path: Path) -> None:
        """The cure for such a cycle: the lower module names what it uses in a Protocol and imports nothing back."""
        files = {
            "__init__.py": "",
            "guard.py": "from .tasks import TaskPolled\n",
            "tasks.py": "from typing import Protocol\nclass Services(Protocol): ...\nTaskPolled = 1\n",
        }
        assert problems(_package(tmp_path, files), layers=None) == []


class TestLayers:
    """Each module sits in a layer and imports only down, or within its own package."""

    LAYERS = (("core",), ("ledger",), ("books", "serve"), ("cli",), ("",))

    def test_an_import_up_the_layers_is_caught(self, tmp_path: Path) -> None:
        files = {"__init__.py": "", "ledger/__init__.py": "", "ledger/a.py": "from ..books import x\n"}
        files |= {"books/__init__.py": "x = 1\n"}
        assert problems(_package(tmp_path, files), layers=self.LAYERS) == [
            "quotawrap.ledger.a imports quotawrap.books, a higher layer"
        ]

    def test_an_import_between_siblings_of_one_layer_is_caught(self, tmp_path: Path) -> None:
        files = {"__init__.py": "", "books/__init__.py": "", "serve/__init__.py": "from ..books import y\n"}
        assert problems(_package(tmp_path, files), layers=self.LAYERS) == [
            "quotawrap.serve imports quotawrap.books, an independent package of its layer"
        ]

    def test_a_module_in_no_layer_is_caught(self, tmp_path: Path) -> None:
        files = {"__init__.py": "", "dashboard/__init__.py": ""}
        assert problems(_package(tmp_path, files), layers=self.LAYERS) == [
            "quotawrap.dashboard is in no layer: add its package to LAYERS in tests/check_imports.py"
        ]

    def test_imports_down_and_within_a_package_pass(self, tmp_path: Path) -> None:
        files = {"__init__.py": "", "core/__init__.py": "", "core/a.py": "from . import b\n", "core/b.py": ""}
        files |= {"cli/__init__.py": "def main():\n    from ..core import a\n"}
        assert problems(_package(tmp_path, files), layers=self.LAYERS) == []
