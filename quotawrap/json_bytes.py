"""``json.loads`` of a body as bytes, without json's encoding sniff on the usual UTF-8 object. Pure.

``json.loads(bytes)`` first asks ``json.detect_encoding`` (a dozen byte tests in Python) which of
UTF-8/16/32 the bytes are in, then decodes. A guarded call loads two such bodies, its request and
its answer, and both open an object: for bytes that start with ``{`` and a nonzero byte, the sniff
answers UTF-8 whatever follows, so they are decoded as it would decode them, without asking.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["loads"]


def loads(data: str | bytes | bytearray) -> Any:
    """``json.loads(data)``: the same value, the same errors."""
    if type(data) is bytes and data[:1] == b"{" and data[1:2] != b"\x00":
        return json.loads(data.decode("utf-8", "surrogatepass"))
    return json.loads(data)
