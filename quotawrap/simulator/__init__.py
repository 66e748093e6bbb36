"""A local VolcEngine Ark API for tests, offline CI and demos: `quotawrap simulate --port N`.

It speaks Ark's inference API (chat completions, bots, responses, embeddings, legacy completions,
streams with include_usage / chunk_include_usage), counts usage itself, injects faults on demand,
keeps an honest bill of every token a real provider would charge, and serves the billing API's
ListResourcePackages over configurable prepaid packages. It refuses what Ark refuses, with Ark's
error bodies (the rules and their sources: `_contract.RULES`, docs/ark-contract.md), unless
`SimConfig.strict` is off; endpoint ids (`SimConfig.endpoints`) answer and bill as their model.

    with ArkSimulator() as sim:
        client = openai.OpenAI(base_url=sim.url, api_key="x")
        ...
        assert sim.billed_total() == ...

Control over HTTP (for tests in other processes): GET /_sim/stats, POST /_sim/reset,
GET|POST /_sim/config (JSON patch of SimConfig), GET|POST /_sim/packages, GET /_sim/health.
Per request: headers `x-sim-<field>` override SimConfig fields (`x-sim-fault: cut`).
"""

from __future__ import annotations

from ._billing import BillRecord
from ._config import FAULTS, PackageSpec, SimConfig, SimConfigError
from ._plan import count_text
from ._server import ArkSimulator, run_forever, serve

__all__ = [
    "FAULTS",
    "ArkSimulator",
    "BillRecord",
    "PackageSpec",
    "SimConfig",
    "SimConfigError",
    "count_text",
    "run_forever",
    "serve",
]
