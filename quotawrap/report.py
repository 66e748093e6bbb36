"""The run's summary: stderr table and ``--report-json``; both come from one dict."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from .ledger import RunTotals

__all__ = ["format_summary", "run_report", "write_json"]

_COLUMNS = (
    ("calls", "calls"),
    ("settled_tokens", "settled"),
    ("blocked_calls", "blocked"),
    ("overshoot_calls", "overshoot"),
    ("unresolved_calls", "unresolved"),
)


def run_report(
    totals: RunTotals, *, store: str, exit_code: int, watch: bool, cap_tokens: int | None
) -> dict[str, Any]:
    models = {name: dataclasses.asdict(model) for name, model in totals.models.items()}
    return {
        "session": totals.run_id,
        "store": store,
        "exit_code": exit_code,
        "mode": "watch" if watch else "enforce",
        "limits": {"cap_tokens": cap_tokens},
        "models": models,
        "totals": dataclasses.asdict(totals.totals),
    }


def format_summary(report: dict[str, Any]) -> str:
    totals = report["totals"]
    watch = report["mode"] == "watch"
    lines = [
        f"quotawrap: session {report['session']}: {totals['calls']} guarded call(s),"
        f" {totals['settled_tokens']:,} tokens settled, {totals['blocked_calls']} blocked"
        + (f", {totals['would_block_calls']} WOULD have been blocked (watch mode)" if watch else "")
    ]
    if report["models"]:
        width = max(len("model"), *(len(name) for name in report["models"]))
        header = "  " + "model".ljust(width) + "".join(f"  {title:>10}" for _, title in _COLUMNS)
        if watch:
            header += f"  {'would-block':>11}"
        lines.append(header)
        for name, model in sorted(report["models"].items()):
            row = "  " + name.ljust(width) + "".join(f"  {model[key]:>10,}" for key, _ in _COLUMNS)
            if watch:
                row += f"  {model['would_block_calls']:>11,}"
            lines.append(row)
    if totals["unresolved_calls"]:
        lines.append(
            f"  {totals['unresolved_calls']} call(s) ended without usage (cut, abandoned or crashed):"
            " charged at their full reservation"
        )
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: str | os.PathLike[str]) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, target)
