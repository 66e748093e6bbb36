"""The README stays true to the code it documents."""

from __future__ import annotations

import re
from pathlib import Path

from quotawrap.cli import cli
from quotawrap.config.settings import OPTIONS, env_name

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

    def test_every_user_extra_is_in_the_install_list(self) -> None:
        """Each optional extra a user installs (all but the test one) has its pip line in the README."""
        import tomllib

        pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
        extras = set(pyproject["project"]["optional-dependencies"]) - {"test"}
        assert {"redis", "volc", "serve", "demo"} <= extras
        for extra in extras:
            assert f"pip install 'quotawrap[{extra}]'" in README, extra

    def test_the_simulators_bill_is_explained(self) -> None:
        """How to read what the simulator billed, with the fields /_sim/stats really returns."""
        from quotawrap.simulator import ArkSimulator

        assert "/_sim/stats" in README and "quotawrap simulate" in README
        with ArkSimulator() as sim:
            fields = sim.stats().keys()
        for field in fields:
            assert f"`{field}`" in README, field
