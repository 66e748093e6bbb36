"""The ``quotawrap`` command: ``quotawrap [OPTIONS] -- COMMAND [ARGS...]`` runs COMMAND guarded.

A plain run goes straight to :mod:`quotawrap.wrapper.run` (its arguments read by :mod:`quotawrap.cli.run_args`,
the way click would); everything else, and any run line that parser declines, goes to the click
group in :mod:`quotawrap.cli.commands`. Nothing heavy is imported here: every guarded command pays for
this module's imports before its child starts.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> None:
    if argv is None:
        # The console script: the collector's passes over the start path's objects, which live as long as the
        # process, would only delay the child, so the run freezes them before it starts (a subcommand: below).
        import gc

        gc.disable()
    from ..config.file import load_config_file
    from ..config.settings import RETIRED, env_name, say_retired
    from ..core.errors import EXIT_USAGE, ConfigError
    from ..support.log import fail

    args = list(sys.argv[1:] if argv is None else argv)
    try:
        config = load_config_file()
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE)
    for name in RETIRED:
        if env_name(name) in os.environ:
            say_retired(name)
    from .run_args import parse_run_args

    try:
        parsed = parse_run_args(args, os.environ, config)
    except ConfigError as exc:  # a repeatable option's variable: command_settings' words
        fail(str(exc), EXIT_USAGE)
    if parsed is not None:
        from ..wrapper.run import run_guarded
        from .common import settings_from_values

        run_guarded(settings_from_values(parsed.values), parsed.command, ends_process=argv is None)
    import gc

    gc.enable()  # a subcommand runs as long as it likes: its garbage is collected as ever
    from .commands import click_main

    click_main(args, config)


def __getattr__(name: str) -> Any:
    if name == "cli":  # the click group, for the docs and the tests that drive it
        from .commands import cli

        return cli
    raise AttributeError(name)
