"""The guarded call's short-cuts answer as the general rules they stand before (generated cases).

Each short-cut tests ``type(x) is dict`` / ``list`` / ``int`` before the ABC or subclass checks it spares
(what ``json.loads`` gives takes the short way), or remembers an answer that is pure in its inputs. Here
the general rule, written out as it was, is compared with the function on values of every shape: JSON
values, subclasses of dict, list and int, bools, other mappings and sequences.
"""

from __future__ import annotations

import json
import math
import types
from collections import OrderedDict, UserDict
from collections.abc import Iterable, Mapping, Sequence
from decimal import Decimal
from typing import Any

import httpx
import httpx2
from hypothesis import given, settings
from hypothesis import strategies as st

from quotawrap.admission.guard import Guard
from quotawrap.config.settings import Settings
from quotawrap.core import endpoints, estimate, json_bytes, money, usage
from quotawrap.core.endpoint_prices import CostRule
from quotawrap.core.estimate import Estimate
from quotawrap.core.prices import PriceTable, normalize_model
from quotawrap.intercept.httpx_adapter import read_headers
from quotawrap.ledger.base import model_day_key, run_cost_key, run_key


class _Dict(dict[str, Any]):
    pass


class _List(list[Any]):
    pass


class _Int(int):
    pass


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**41), max_value=2**41),
    st.integers(min_value=0, max_value=100).map(_Int),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
    st.binary(max_size=5),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.lists(inner, max_size=3).map(_List),
        st.dictionaries(st.text(max_size=3), inner, max_size=3),
        st.dictionaries(st.text(max_size=3), inner, max_size=3).map(_Dict),
        st.dictionaries(st.text(max_size=3), inner, max_size=3).map(OrderedDict),
        st.dictionaries(st.text(max_size=3), inner, max_size=3).map(UserDict),
        st.dictionaries(st.text(max_size=3), inner, max_size=3).map(types.MappingProxyType),
        st.frozensets(st.integers(), max_size=3),
    ),
    max_leaves=8,
)


def _outcome(function: Any, *args: Any) -> tuple[str, Any]:
    try:
        return "value", function(*args)
    except ValueError as exc:
        return "ValueError", str(exc)
    except usage._Unusable:
        return "unusable", None


# -- the general rules, as written before the short-cuts ------------------------------------------


def _check_body_rule(body: object) -> None:
    if not isinstance(body, Mapping):
        raise ValueError(f"request body must be a JSON object, got {estimate._type_name(body)}")


def _as_list_rule(value: object, where: str, expected: str) -> Sequence[object]:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise ValueError(f"{where} must be {expected}, got {estimate._type_name(value)}")
    return value if isinstance(value, Sequence) else list(value)


def _as_mapping_rule(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a JSON object, got {estimate._type_name(value)}")
    return value


def _count_rule(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise usage._Unusable
    if isinstance(value, int):
        if value < 0:
            raise usage._Unusable
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    raise usage._Unusable


@settings(max_examples=400, deadline=None)
@given(_values)
def test_shape_checks_answer_as_the_abc_rules(value: object) -> None:
    assert _outcome(estimate._check_body, value) == _outcome(_check_body_rule, value)
    assert _outcome(estimate._as_mapping, value, "x") == _outcome(_as_mapping_rule, value, "x")
    ours, rule = _outcome(estimate._as_list, value, "x", "a list"), _outcome(_as_list_rule, value, "x", "a list")
    assert ours == rule
    if ours[0] == "value" and isinstance(value, Sequence):
        assert ours[1] is value  # the very list, never a copy
    assert _outcome(usage._count, value) == _outcome(_count_rule, value)
    assert type(_outcome(usage._count, value)[1]) is type(_outcome(_count_rule, value)[1])  # an _Int stays one


_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-5, 2**41), st.floats(allow_nan=False, allow_infinity=False)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=3)),
    max_leaves=6,
)
_counts = st.one_of(st.none(), st.booleans(), st.integers(-5, 2**41), st.floats(-5, 1e6), st.text(max_size=2))
_usage_objects = st.fixed_dictionaries(
    {},
    optional={
        "prompt_tokens": _counts,
        "completion_tokens": _counts,
        "total_tokens": _counts,
        "input_tokens": _counts,
        "prompt_tokens_details": st.one_of(_json, st.fixed_dictionaries({"cached_tokens": _counts})),
        "completion_tokens_details": st.one_of(_json, st.fixed_dictionaries({"reasoning_tokens": _counts})),
        "prompt_cache_hit_tokens": _counts,
    },
)


@settings(max_examples=300, deadline=None)
@given(_usage_objects, st.sampled_from([dict, _Dict, types.MappingProxyType, UserDict]))
def test_usage_reads_alike_from_json_bytes_and_any_mapping(obj: dict[str, Any], holder: Any) -> None:
    """The dict short-cuts read what the Mapping rule reads: a body as bytes (json.loads' dicts), as any mapping."""
    body = {"choices": [], "usage": obj}
    from_bytes = usage.usage_from_body(json.dumps(body).encode())
    assert from_bytes == usage.usage_from_body(_held(body, holder)) == usage.usage_from_mapping(_held(obj, UserDict))


def _held(value: Any, holder: Any) -> Any:
    """``value`` with each of its dicts, however deep, in ``holder`` instead."""
    if isinstance(value, dict):
        return holder({key: _held(item, holder) for key, item in value.items()})
    return [_held(item, holder) for item in value] if isinstance(value, list) else value


def test_price_for_remembers_what_it_found_and_what_it_did_not() -> None:
    table = PriceTable()
    for model in ("deepseek-v3-1-250821", "DeepSeek-V3.1-250821", "no-such-model", "deepseek-v3-1-250821"):
        assert table.price_for(model) == table._price_for(model)
        assert table.price_for(model) is table.price_for(model)
    assert table._found.keys() == {"deepseek-v3-1-250821", "DeepSeek-V3.1-250821", "no-such-model"}
    assert normalize_model("DeepSeek-V3.1-250821") == "deepseek-v3-1-250821"


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet="abdeksv-._0123456789", max_size=30))
def test_price_for_answers_as_the_lookup_it_remembers(model: str) -> None:
    table = PriceTable()
    first = table.price_for(model)
    assert first == table._price_for(model) == table.price_for(model)


def test_a_room_is_shared_by_the_calls_of_one_model_and_day(tmp_path: Any) -> None:
    guard = Guard(Settings(store=f"sqlite:///{tmp_path}/l.db", run_id="rooms"))
    room = guard._room("m", "2026-12-01")
    assert guard._rooms[("m", "2026-12-01")] is room
    assert guard._room("m", "2026-12-02") is not room
    assert room._keys == {
        "run": run_key("rooms"),
        "model_day": model_day_key("m", "2026-12-01"),
        "run_cost": run_cost_key("rooms"),
    }


def _loaded(function: Any, data: Any) -> tuple[str, Any]:
    try:
        return "value", function(data)
    except Exception as exc:
        return type(exc).__name__, str(exc)


_documents = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=4)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=3)),
    max_leaves=6,
)
_encodings = st.sampled_from(["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le"])


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=12), st.binary(max_size=12).map(lambda tail: b"{" + tail)))
def test_json_bytes_loads_as_json_on_any_bytes(data: bytes) -> None:
    assert _loaded(json_bytes.loads, data) == _loaded(json.loads, data)
    assert _loaded(json_bytes.loads, bytearray(data)) == _loaded(json.loads, bytearray(data))


@settings(max_examples=200, deadline=None)
@given(_documents, _encodings, st.booleans())
def test_json_bytes_loads_as_json_in_any_encoding(document: Any, encoding: str, ascii_only: bool) -> None:
    data = json.dumps(document, ensure_ascii=ascii_only).encode(encoding)
    assert _loaded(json_bytes.loads, data) == _loaded(json.loads, data)
    assert _loaded(json_bytes.loads, data.decode(encoding)) == _loaded(json.loads, data.decode(encoding))


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(["chat", "responses", "embeddings", "video_task", "bot_chat", "batch_chat", "context", "images"]),
    st.integers(0, 10**7),
    st.integers(0, 10**6),
    st.sampled_from(["deepseek-v3-1-250821", "doubao-seed-1-6-250615", "doubao-seedream-4-0", "unknown-model"]),
)
def test_rules_and_reserve_costs_remembered_answer_as_made_anew(
    endpoint: str, input_tokens: int, output: int, model: str
) -> None:
    request = {"model": model, "n": 2, "ttl": 7200}
    guess = Estimate(input_tokens, output)
    rule = CostRule.for_request(endpoint, request, guess)
    assert rule == CostRule.for_request(endpoint, dict(request), Estimate(input_tokens, output))
    if endpoint not in ("images", "context"):
        assert rule is CostRule.for_request(endpoint, request, guess)
    guard = Guard(Settings(run_id="costs"))
    fresh = CostRule(rule.endpoint, rule.images, rule.storage_hours)
    usage_ = usage.Usage(input_tokens, output, input_tokens + output, actions=(("web_search", 2),))
    for _ in range(2):  # made, then remembered
        made = fresh.reserve(guard.books.prices, model, Estimate(input_tokens, output))
        assert guard.books.reserve_cost(model, Estimate(input_tokens, output), rule) == int(made)
        actual, anew = rule.actual(guard.books.prices, model, usage_), fresh.actual(guard.books.prices, model, usage_)
        assert (int(actual), actual.estimated) == (int(anew), anew.estimated)
        if endpoint in ("chat", "responses", "embeddings", "video_task"):  # priced by the table alone
            table = guard.books.prices.actual_cost(model, usage_)
            assert (int(actual), actual.estimated) == (int(table), table.estimated)


def _chat_message_tokens_as_written(message: object, counter: Any, where: str) -> int:
    """The message count as it was: every field's place formatted, absent or not."""
    entry = estimate._as_mapping(message, where)
    total: int = counter.per_message
    total += estimate._content_tokens(entry.get("content"), counter, f"{where}.content")
    total += counter.text(entry.get("name"), f"{where}.name")
    total += counter.text(entry.get("reasoning_content"), f"{where}.reasoning_content")
    total += estimate._function_call_tokens(entry.get("function_call"), counter, f"{where}.function_call")
    tool_calls = entry.get("tool_calls")
    if tool_calls is not None:
        for index, call in enumerate(estimate._as_list(tool_calls, f"{where}.tool_calls", "a list")):
            call_where = f"{where}.tool_calls[{index}]"
            total += estimate._function_call_tokens(
                estimate._as_mapping(call, call_where).get("function"), counter, call_where
            )
    return total


_field_values = st.one_of(
    st.none(), st.text(max_size=8), st.integers(), st.lists(st.text(max_size=4), max_size=2), _json
)
_messages = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "assistant"])},
            optional={
                "content": st.one_of(
                    st.text(max_size=12),
                    st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _field_values})),
                ),
                "name": _field_values,
                "reasoning_content": _field_values,
                "function_call": st.one_of(_field_values, st.fixed_dictionaries({"name": _field_values})),
                "tool_calls": st.one_of(
                    _field_values, st.lists(st.fixed_dictionaries({"function": _json}), max_size=2)
                ),
            },
        ),
        _field_values,
    ),
    max_size=4,
)


@settings(max_examples=300, deadline=None)
@given(_messages, st.one_of(st.none(), st.integers(0, 40)))
def test_messages_count_as_they_did_with_every_place_named(messages: list[Any], stop_above: int | None) -> None:
    body = {"model": "deepseek-v4-flash", "messages": messages, "max_tokens": 16}

    def estimated() -> tuple[str, Any]:
        return _outcome(lambda: estimate.estimate_request("chat", body, stop_above=stop_above))

    ours = estimated()
    new = estimate._chat_message_tokens
    estimate._chat_message_tokens = _chat_message_tokens_as_written  # type: ignore[assignment]
    try:
        assert estimated() == ours
    finally:
        estimate._chat_message_tokens = new  # type: ignore[assignment]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 2**40),
            st.decimals(min_value=0, max_value=10**6, allow_nan=False, allow_infinity=False, places=None),
        ),
        max_size=4,
    )
)
def test_micro_cny_sums_as_the_generator_did(parts: list[tuple[int, Decimal]]) -> None:
    as_written = math.ceil(sum((Decimal(tokens) * price for tokens, price in parts), Decimal(0)))
    assert money.micro_cny(parts) == as_written


_finite_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.text()),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=10,
)
_requests = st.dictionaries(st.text(max_size=6), _finite_json, min_size=1, max_size=5)


@settings(max_examples=300, deadline=None)
@given(_requests, st.sampled_from(["max_completion_tokens", "max_output_tokens"]), st.integers(1, 2**31))
def test_a_bound_added_to_the_sent_bytes_is_what_encoding_anew_gives(
    request: dict[str, Any], field: str, bound: int
) -> None:
    body = estimate.bounded("chat" if field == "max_completion_tokens" else "responses", request, bound)
    anew = endpoints.encode_body(body)
    # compact UTF-8, as httpx encodes json= (and the guard itself): the very same bytes
    assert endpoints.encode_added(endpoints.encode_body(request), request, body) == anew
    assert endpoints.encode_added(httpx.Request("POST", "http://x", json=request).content, request, body) == anew
    # any other spacing or escaping: the same JSON object
    spaced = json.dumps(request).encode()
    assert json.loads(endpoints.encode_added(spaced, request, body)) == json.loads(anew) == body
    # nothing to splice into: encoded anew
    assert endpoints.encode_added(None, request, body) == anew
    assert endpoints.encode_added(b" " + spaced, request, body) == anew


@settings(max_examples=100, deadline=None)
@given(_requests, st.integers(1, 2**31))
def test_a_bound_the_request_named_already_is_encoded_anew(request: dict[str, Any], bound: int) -> None:
    request = {**request, "max_completion_tokens": None}
    body = estimate.bounded("chat", request, bound)
    assert endpoints.encode_added(endpoints.encode_body(request), request, body) == endpoints.encode_body(body)


@settings(max_examples=100, deadline=None)
@given(_requests, st.one_of(st.none(), st.integers(0, 2**31)), st.integers(1, 2**31))
def test_a_bound_sent_in_place_of_max_tokens_leaves_no_max_tokens_in_the_bytes(
    request: dict[str, Any], max_tokens: int | None, bound: int
) -> None:
    """The bound replaces the caller's max_tokens (Ark refuses both): the bytes sent hold the bound alone."""
    request = {**request, "max_tokens": max_tokens}
    body = estimate.bounded("chat", request, bound)
    for raw in (endpoints.encode_body(request), json.dumps(request).encode(), None):
        sent = json.loads(endpoints.encode_added(raw, request, body))
        assert "max_tokens" not in sent and sent["max_completion_tokens"] == bound
        assert sent == {**{k: v for k, v in request.items() if k != "max_tokens"}, "max_completion_tokens": bound}


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=8), st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,10}", fullmatch=True)), _finite_json)
def test_a_member_is_written_as_the_encoder_writes_it(key: str, value: Any) -> None:
    assert endpoints._member(key, value) == endpoints.encode_body({key: value})[1:-1]
    assert endpoints._member(key, len(key) * 977) == endpoints.encode_body({key: len(key) * 977})[1:-1]


_header_names = st.sampled_from(
    ["content-type", "Content-Type", "content-encoding", "CONTENT-ENCODING", "location", "Location", "date", "x-id"]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_header_names, st.binary(max_size=6)), max_size=8), st.sampled_from([httpx, httpx2]))
def test_the_answer_headers_read_in_one_pass_are_what_lookups_give(entries: list[Any], module: Any) -> None:
    headers = module.Headers([(name.encode(), value) for name, value in entries])
    read = read_headers(headers)
    for name in ("content-type", "content-encoding", "location"):
        assert read.get(name) == headers.get(name)
    # as response_started reads a redirect's Location: an empty one is none
    location = read.get("location") or read.get("Location") or None
    assert location == (headers.get("location") or headers.get("Location") or None)
    plain = {"Content-Type": "text/plain"}
    assert read_headers(plain) is plain
