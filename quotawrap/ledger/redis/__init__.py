"""The Redis ledger, along its seams: options (the store URL), keys (every key name and each
script's KEYS), client (connection, scripts, errors: the only place redis-py's ``Any`` goes),
lua/ (one file per script, lib.lua shared), litellm (the LiteLLM limiter's keys), records
(string formats), history (the read-side queries: runs, call records, totals, packages, series),
member_keys (the gateway's member keys) and ledger (the orchestration)."""

from .ledger import RedisLedger
from .options import RedisOptions

__all__ = ["RedisLedger", "RedisOptions"]
