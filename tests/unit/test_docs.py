"""The README stays true to the code it documents."""

from __future__ import annotations

import re
from pathlib import Path

from quotawrap.cli import cli
from quotawrap.settings import OPTIONS, env_name

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")


class TestReadme:
    def test_every_option_is_documented_with_its_variable(self) -> None:
        """Each option's flag and QUOTAWRAP_* variable appear in the README's table row."""
        for option in OPTIONS:
            rows = [line for line in README.splitlines() if line.startswith(f"| `{option.cli_flag}")]
            assert rows, f"{option.cli_flag} missing from README"
            assert f"`{env_name(option.name)}`" in rows[0]

    def test_every_subcommand_is_documented(self) -> None:
        """Each CLI subcommand appears in the README's usage block."""
        for name in cli.commands:
            if name != "run":
                assert re.search(rf"quotawrap {name}\b", README), name

    def test_two_setup_commands(self) -> None:
        """The README gives the two set-up commands, and CI runs the test one."""
        assert "make demo" in README and "make test" in README
        ci = (Path(__file__).resolve().parents[2] / ".ci" / "run").read_text()
        assert "make test" in ci
