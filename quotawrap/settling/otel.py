"""OpenTelemetry GenAI metrics of guarded calls, opt-in (``--otel``, ``QUOTAWRAP_OTEL=1``).

Each call that settles with a usage records ``gen_ai.client.token.usage`` (a histogram of tokens, per the
GenAI semantic conventions) twice: its input tokens and its output tokens (reasoning included), with
``gen_ai.token.type``, ``gen_ai.operation.name``, ``gen_ai.request.model`` and the provider
(``gen_ai.provider.name``, and the older ``gen_ai.system`` beside it). They go to the process's global
meter provider: the one the program, or ``opentelemetry-instrument``, set up and exports from.

Recorded where the call's books are written, in the process that made it (a guarded child, the gateway),
once its settle has landed. Off, it costs one attribute test per call; on, the OpenTelemetry API is imported
on the first call that settles, not before.
"""

from __future__ import annotations

from typing import Any

from ..support.log import warn

__all__ = ["OPERATIONS", "PROVIDER", "TOKEN_BUCKETS", "TOKEN_USAGE", "record_token_usage", "sdk_missing"]

TOKEN_USAGE = "gen_ai.client.token.usage"
# quotawrap guards Ark's endpoints and bills every guarded call as Ark does (its limits are Ark's free quota)
PROVIDER = "volcengine"
# The ledger's endpoint label -> gen_ai.operation.name (the conventions' well-known values)
OPERATIONS = {
    "chat": "chat",
    "batch_chat": "chat",
    "bot_chat": "chat",
    "context_chat": "chat",
    "responses": "chat",
    "completions": "text_completion",
    "embeddings": "embeddings",
    "batch_embeddings": "embeddings",
}
# The conventions' advised boundaries for token counts (powers of 4)
TOKEN_BUCKETS = tuple(4**n for n in range(14))

_MISSING = "--otel: the OpenTelemetry SDK is not installed: pip install 'quotawrap[otel]'"
_histogram: list[Any] = []  # the instrument, made on first use (or None once the API is known missing)


def sdk_missing() -> str | None:
    """The one-line message when ``--otel`` is asked for and the SDK cannot be imported, else None."""
    from importlib.util import find_spec

    try:
        found = find_spec("opentelemetry.sdk") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else _MISSING


def _instrument() -> Any:
    if not _histogram:
        try:
            from opentelemetry import metrics
        except ImportError:
            warn(_MISSING)  # once: the instrument is None from now on
            _histogram.append(None)
            return None
        meter = metrics.get_meter("quotawrap")
        description = "Number of input and output tokens used."
        try:
            histogram = meter.create_histogram(
                TOKEN_USAGE, "{token}", description, explicit_bucket_boundaries_advisory=list(TOKEN_BUCKETS)
            )
        except TypeError:  # an API older than 1.23 takes no advice
            histogram = meter.create_histogram(TOKEN_USAGE, "{token}", description)
        _histogram.append(histogram)
    return _histogram[0]


def record_token_usage(model: str, endpoint: str, input_tokens: int, output_tokens: int) -> None:
    """Record one settled call's tokens. Never raises (a metric never fails a call)."""
    try:
        histogram = _instrument()
        if histogram is None:
            return
        attributes = {
            "gen_ai.operation.name": OPERATIONS.get(endpoint, "generate_content"),
            "gen_ai.provider.name": PROVIDER,
            "gen_ai.system": PROVIDER,
            "gen_ai.request.model": model,
        }
        histogram.record(input_tokens, {**attributes, "gen_ai.token.type": "input"})
        histogram.record(output_tokens, {**attributes, "gen_ai.token.type": "output"})
    except Exception as exc:
        warn(f"--otel: could not record a call's tokens ({type(exc).__name__}: {exc})")
