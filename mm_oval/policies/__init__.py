"""Eviction and retrieval policies. One family per file; each method is one class and one registry line."""

from . import (
    expected,  # noqa: F401  (registers expected_attention)
    kvzip,  # noqa: F401  (registers kvzip)
)
from .base import EVICTION_REGISTRY, RETRIEVAL_REGISTRY, EvictionPolicy, PrefillContext, RetrievalPolicy

__all__ = ["EVICTION_REGISTRY", "RETRIEVAL_REGISTRY", "EvictionPolicy", "PrefillContext", "RetrievalPolicy"]
