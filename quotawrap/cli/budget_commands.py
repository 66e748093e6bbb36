"""``quotawrap budget set|list|rm``: the budgets every guarded process on a ledger enforces (issue 33).

Anyone who can reach the ledger may change its budgets (README, "Team budgets"): the ledger's file mode or
the Redis server's password is the gate, as it is for every other counter in it.
"""

from __future__ import annotations

import json
from typing import Any

import click

from ..core.errors import EXIT_USAGE, ConfigError
from ..ledger import open_store
from ..support.log import fail
from .common import command_settings, echo, settings_options

__all__ = ["budget_group"]


@click.group("budget")
def budget_group() -> None:
    """Budgets per tag, user, team, model or key, held in the ledger: every guarded process on it enforces them."""


@budget_group.command("set")
@settings_options(["store"])
@click.argument("spec")
@click.option("--soft", is_flag=True, help="Warn when it is nearly or fully used instead of refusing calls.")
def budget_set(spec: str, soft: bool, **values: Any) -> None:
    """Set a budget: SELECTOR:AMOUNT/PERIOD[,soft], e.g. team=search:200k/day or '*:cny300/month'.

    SELECTOR is '*' or NAME=VALUE pairs joined by ',' (model=..., key=..., or any tag); AMOUNT is tokens (500k,
    2M) or CNY (¥300, cny300, 300cny); PERIOD is run, hour, day, week or month, in Beijing time. Setting the
    same selector and period again changes its amount and keeps what it counted.
    """
    from ..core.budgets import parse_budget

    try:
        budget = parse_budget(spec, soft=soft)
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE)
    ledger = open_store(command_settings(values))
    changed = ledger.set_budget(budget)
    echo(f"budget {budget.spec} {'set' if changed else 'already set'}")


@budget_group.command("rm")
@settings_options(["store"])
@click.argument("spec")
def budget_rm(spec: str, **values: Any) -> None:
    """Remove the budget of this selector and period (the amount does not matter), e.g. team=search:0/day."""
    from ..core.budgets import parse_budget

    try:
        budget = parse_budget(spec)
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE)
    ledger = open_store(command_settings(values))
    if not ledger.remove_budget(budget.id):
        fail(f"no budget {budget.selector} per {budget.period} ({budget.unit}); `quotawrap budget list` shows them", 1)
    echo(f"budget {budget.selector} per {budget.period} removed")


@budget_group.command("list")
@settings_options(["store"])
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def budget_list(as_json: bool, **values: Any) -> None:
    """Every budget of the ledger: used, in flight, left, and when it resets."""
    from ..ledger.base import ledger_clock

    ledger = open_store(command_settings(values))
    uses = ledger.budget_uses(ledger_clock(ledger)(), "")  # the ledger's own: a run's end with it
    if as_json:
        click.echo(json.dumps([use.as_json() for use in uses], indent=2, sort_keys=True))
    elif not uses:
        echo("no budgets (add one with `quotawrap budget set SPEC`)")
    else:
        echo("\n".join(use.line() for use in uses))
