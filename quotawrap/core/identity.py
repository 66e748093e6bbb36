"""Which model a call is billed as: one identity per model, whatever string the request names. Pure: no I/O.

Ark bills a model, and keys its free collection by model, but a request may name it several ways:

* a spelling: ``DeepSeek-V4-Flash``, ``" deepseek-v4-flash"``, ``"deepseek-v4-flash\\n"``. Whether Ark
  accepts each is not documented; if it does, it bills the one model, so they are one identity here
  (:func:`canonical`: case and surrounding whitespace). A spelling Ark refuses costs nothing either way.
  Dots and underscores are not folded: Ark's model ids are dashed (``doubao-seed-1-6-250615``), it answers
  a dotted name with 404 (opencode#45992, docs/ark-contract.md), and folding them would re-key the
  ledgers that already use such a name;
* an inference endpoint id (``ep-20250101...``; ``ep-m-...`` for preset endpoints, as Ark's Go SDK tells
  them apart): an endpoint serves one foundation model version, and Ark answers a call through it with that
  model's id in ``model`` ("本次请求实际使用的模型名称和版本", the Chat API doc). :func:`resolve` maps it to
  that model through a table (quotawrap.toml's ``[endpoints]``, the ledger's learned and listed pairs); an
  endpoint not in the table yet resolves to :data:`UNMAPPED`, the ledger's model for calls whose model is
  not known yet (README, "One identity per model").

The foundation model id of an endpoint record is ``<Name>-<ModelVersion>``, the way Ark writes model ids
(``/api/v3/models`` rows ``{"id": "doubao-lite-128k-240428", "name": "doubao-lite-128k", "version":
"240428"}``, docs/ark-contract.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

__all__ = [
    "UNMAPPED",
    "Identity",
    "answered_model",
    "canonical",
    "endpoint_table",
    "endpoints_from_listing",
    "foundation_model_id",
    "is_endpoint_id",
    "resolve",
]

# The model a call through a not yet mapped endpoint id is held as, against every model's day limits until its
# answer names the model (README, "One identity per model"); no name of a model Ark serves has a space or bracket.
UNMAPPED = "(unmapped endpoint)"

_ENDPOINT_PREFIX = "ep-"


class Identity(NamedTuple):
    """What a request's model string resolves to."""

    model: str  # the model every limit, price and report row keys by (UNMAPPED: not known yet)
    endpoint: str | None = None  # the endpoint id the request named, canonical; None for a model name


def canonical(model: str) -> str:
    """A model string as the ledger keys it: the case and the whitespace around it do not make another model."""
    return model.strip().lower()


def is_endpoint_id(model: str) -> bool:
    """Whether a canonical model string is an inference endpoint id (``ep-...``, ``ep-m-...``)."""
    return model.startswith(_ENDPOINT_PREFIX) and len(model) > len(_ENDPOINT_PREFIX)


def resolve(model: str, endpoints: Mapping[str, str]) -> Identity:
    """The identity of a request's ``model``; ``endpoints`` maps canonical endpoint ids to canonical model ids."""
    key = canonical(model)
    if not is_endpoint_id(key):
        return Identity(key)
    return Identity(endpoints.get(key) or UNMAPPED, key)


def answered_model(value: object) -> str | None:
    """The model an answer's ``model`` field names, canonical; None when it names none a call can be billed as
    (missing, not a string, an endpoint id, or our own placeholder)."""
    if not isinstance(value, str):
        return None
    model = canonical(value)
    if not model or is_endpoint_id(model) or model == UNMAPPED:
        return None
    return model


def foundation_model_id(name: object, version: object) -> str | None:
    """``<Name>-<ModelVersion>`` of a management API ``FoundationModel``, canonical; None without a name."""
    if not isinstance(name, str) or not canonical(name):
        return None
    tail = canonical(version) if isinstance(version, str) else ""
    return answered_model(f"{canonical(name)}-{tail}" if tail else name)


def endpoint_table(table: Mapping[str, Any], where: str = "[endpoints]") -> dict[str, str]:
    """quotawrap.toml's ``[endpoints]`` (``"ep-..." = "model-version"``), canonical both sides.

    ``ValueError`` naming the entry for a key that is no endpoint id or a value that is no model id."""
    found: dict[str, str] = {}
    for raw, value in table.items():
        endpoint = canonical(raw)
        if not is_endpoint_id(endpoint):
            raise ValueError(f"{where}: {raw!r} is not an endpoint id (ep-...)")
        model = answered_model(value)
        if model is None:
            raise ValueError(f'{where}: {raw} = {value!r} does not name a model id (e.g. "deepseek-v4-flash-260425")')
        found[endpoint] = model
    return found


def endpoints_from_listing(items: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """Endpoint id -> foundation model id from ListEndpoints' (or GetEndpoint's) records, wire field names.

    An endpoint serving a custom model (``ModelReference.CustomModelId``, no ``FoundationModel``) is left out:
    which model Ark bills it as is not documented, so its first answer tells."""
    found: dict[str, str] = {}
    for item in items:
        endpoint = canonical(str(item.get("Id") or ""))
        reference = item.get("ModelReference")
        foundation = reference.get("FoundationModel") if isinstance(reference, Mapping) else None
        if not is_endpoint_id(endpoint) or not isinstance(foundation, Mapping):
            continue
        model = foundation_model_id(foundation.get("Name"), foundation.get("ModelVersion"))
        if model is not None:
            found[endpoint] = model
    return found
