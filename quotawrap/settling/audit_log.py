"""The ``--audit-log`` JSONL file: one call record per line, appended by every guarded process."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from ..core.errors import ConfigError
from ..ledger.base import CallRecord
from ..support.files import append_private

__all__ = ["append_jsonl", "read_jsonl"]


def append_jsonl(path: str | os.PathLike[str], record: CallRecord) -> None:
    """Append one record as one line; O_APPEND and a single write keep concurrent writers whole."""
    data = asdict(record)
    data["outcome"] = record.outcome
    line = (json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
    append_private(path, line)


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[CallRecord]:
    """Records of an audit log; a damaged line is reported, not silently skipped."""
    fields = set(CallRecord.__dataclass_fields__)
    with Path(path).open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
                yield CallRecord(**{key: value for key, value in data.items() if key in fields})
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"{path}:{number}: not an audit record ({exc})") from None
