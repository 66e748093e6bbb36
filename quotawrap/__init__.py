"""quotawrap: an exact, local, atomic spend guard for the LLM calls of any Python program.

Kept import-light on purpose: the injected ``sitecustomize`` imports this package in every
child interpreter, so nothing heavy may load here.
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
