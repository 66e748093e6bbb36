"""Which model each inference endpoint of the account serves, from the ark management API (``ListEndpoints``).

With VolcEngine credentials set (the billing API's, :mod:`quotawrap.books.balance`), the wrapper lists the
account's endpoints when its run starts and ``quotawrap sync`` lists them too: each pair goes into the
ledger, so a call through an endpoint id counts against its model from its first call on, instead of waiting
for an answer to name the model (README, "One identity per model"). The request and its answer's fields
are the SDK's (``volcenginesdkark``: POST ``Action=ListEndpoints&Version=2024-01-01``, service ``ark``, body
``{PageNumber, PageSize}``, ``Result.Items[].ModelReference.FoundationModel{Name, ModelVersion}``).
"""

from __future__ import annotations

from typing import Any

from ..core.errors import BalanceUnavailable
from ..core.identity import endpoints_from_listing
from .balance import openapi_client

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..config.settings import Settings
    from ..ledger import CallPath

__all__ = ["list_endpoint_models", "sync_endpoints"]

_PAGE_SIZE = 100  # the API's largest page
_MAX_PAGES = 100  # an account with more endpoints than this is listed in part: the rest are learned from answers


def list_endpoint_models(endpoint: str | None = None, region: str = "cn-beijing") -> dict[str, str]:
    """Every endpoint id -> foundation model id of the account (all pages); BalanceUnavailable when the SDK or
    the credentials are missing or the API fails."""
    try:
        import volcenginesdkark
        from volcenginesdkark.models import ListEndpointsRequest
    except ImportError as exc:
        raise BalanceUnavailable("the management API needs the VolcEngine SDK: pip install 'quotawrap[volc]'") from exc
    api = volcenginesdkark.ARKApi(openapi_client(endpoint, region))
    items: list[dict[str, Any]] = []
    try:
        for number in range(1, _MAX_PAGES + 1):
            page = api.list_endpoints(ListEndpointsRequest(page_number=number, page_size=_PAGE_SIZE))
            listed = page.items or []
            items.extend(_wire(entry) for entry in listed)
            if len(listed) < _PAGE_SIZE or number * _PAGE_SIZE >= (page.total_count or 0):
                break
    except Exception as exc:  # the SDK raises its own ApiException and urllib3 errors
        raise BalanceUnavailable(f"ark management API ListEndpoints failed: {exc}") from exc
    return endpoints_from_listing(items)


def _wire(entry: Any) -> dict[str, Any]:
    """An SDK item (snake-case attributes) as the wire's fields that endpoints_from_listing reads."""
    reference = getattr(entry, "model_reference", None)
    foundation = getattr(reference, "foundation_model", None)
    found = {"Name": getattr(foundation, "name", None), "ModelVersion": getattr(foundation, "model_version", None)}
    return {"Id": getattr(entry, "id", None), "ModelReference": {"FoundationModel": found} if foundation else None}


def sync_endpoints(ledger: CallPath, settings: Settings) -> dict[str, str]:
    """List the account's endpoints and keep in the ledger the pairs it does not already have; the pairs listed."""
    listed = list_endpoint_models(settings.billing_endpoint)
    kept = ledger.endpoint_models()
    ledger.put_endpoint_models({endpoint: model for endpoint, model in listed.items() if kept.get(endpoint) != model})
    return listed
