"""``json.loads`` of a body as bytes, without json's encoding sniff on the usual UTF-8 object. Pure.

:func:`loads_request` reads a request body the guard may write out again: Python's decoder takes
``NaN``/``Infinity`` (not JSON) and turns ``1e400`` into ``inf``, which its encoder writes back as
``Infinity``, so such bodies are refused as unreadable rather than sent on changed into something
that is not JSON. A number that overflows a 64-bit float is one the provider cannot read either.

``json.loads(bytes)`` first asks ``json.detect_encoding`` (a dozen byte tests in Python) which of
UTF-8/16/32 the bytes are in, then decodes. A guarded call loads two such bodies, its request and
its answer, and both open an object: for bytes that start with ``{`` and a nonzero byte, the sniff
answers UTF-8 whatever follows, so they are decoded as it would decode them, without asking.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["loads", "loads_request"]


def loads(data: str | bytes | bytearray) -> Any:
    """``json.loads(data)``: the same value, the same errors."""
    if type(data) is bytes and data[:1] == b"{" and data[1:2] != b"\x00":
        return json.loads(data.decode("utf-8", "surrogatepass"))
    return json.loads(data)


def _finite(text: str) -> float:
    value = float(text)
    if value - value != 0.0:  # inf - inf is nan, and nan != 0
        raise ValueError(f"request body has a number out of range of a 64-bit float: {text[:40]}")
    return value


def _not_json(name: str) -> Any:
    raise ValueError(f"request body is not JSON: {name} is not a JSON value")


# Built once: json.loads with any option builds a decoder per call. parse_float is asked only for
# numbers with a fraction or an exponent, parse_constant only for NaN and Infinity.
_REQUEST_DECODER = json.JSONDecoder(parse_float=_finite, parse_constant=_not_json)


def loads_request(data: bytes | bytearray | str) -> Any:
    """:func:`loads` that refuses what would not be JSON once written again: ``ValueError`` naming it."""
    if type(data) is bytes and data[:1] == b"{" and data[1:2] != b"\x00":
        return _REQUEST_DECODER.decode(data.decode("utf-8", "surrogatepass"))
    if isinstance(data, (bytes, bytearray)):
        data = data.decode(json.detect_encoding(data), "surrogatepass")
    return _REQUEST_DECODER.decode(data)
