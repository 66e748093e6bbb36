"""What every bench script prints about the machine it ran on (one helper, not one per script)."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path

__all__ = ["cpu_model", "load_average", "machine_line"]


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def machine_line() -> str:
    return f"{os.cpu_count()} CPU ({cpu_model()}), Python {platform.python_version()}, {platform.system()}"


def load_average() -> str:
    """Other work on the machine shows in the p90 more than in the medians; say how much there was."""
    try:
        return " ".join(f"{value:.2f}" for value in os.getloadavg())
    except OSError:
        return "unknown"
