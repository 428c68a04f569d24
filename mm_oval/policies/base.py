"""The seams between the cache and the methods.

A policy never touches storage and the cache never decides:
- an `EvictionPolicy` turns what a layer's prefill produced (`PrefillContext`) into a score per
  cached token and KV head (higher = keep); the cache applies budgets, sinks and the recent window;
- a `RetrievalPolicy` turns a decode query and the cache's per-page summaries into the pages each
  KV head reads at this step.

Adding a method is one class here (or in a sibling file) plus `register_eviction` / `register_retrieval`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..errors import ConfigError

# modality codes used everywhere (cache, policies, stats)
TEXT, IMAGE, PAD = 0, 1, -1


@dataclass
class PrefillContext:
    """Everything a policy may read about one layer's prompt, for one batch. Shapes:
    B batch, Hq query heads, Hkv KV heads, N prompt tokens (left padding included), D head dim."""

    layer_idx: int
    keys: torch.Tensor  # (B, Hkv, N, D), after RoPE, as cached
    values: torch.Tensor  # (B, Hkv, N, D)
    queries: torch.Tensor | None  # (B, Hq, N, D) after RoPE; None when the policy did not ask for them
    positions: torch.Tensor  # (B, N) original (RoPE) positions; padding has -1
    modality: torch.Tensor  # (B, N) int8: TEXT, IMAGE or PAD
    image_rc: torch.Tensor  # (B, N, 3) long: (image index, row, col) for image tokens, -1 elsewhere
    scaling: float  # the attention's softmax scale
    module: Any = None  # the attention module (o_proj etc.), for policies that need the layer's weights
    extra: dict = field(default_factory=dict)  # per-request state shared across layers (e.g. FastV's ranking)

    @property
    def valid(self) -> torch.Tensor:
        return self.modality != PAD

    @property
    def num_kv_groups(self) -> int:
        assert self.queries is not None
        return self.queries.shape[1] // self.keys.shape[1]


class EvictionPolicy:
    """Scores prompt tokens per KV head once prefill of a layer is done. Subclasses set `name` and
    override `score`. `needs_queries = True` makes the cache pass the layer's queries (the attention
    rows a method uses must then be computed in chunks, never the full N x N matrix)."""

    name: ClassVar[str] = ""
    needs_queries: ClassVar[bool] = False

    def score(self, ctx: PrefillContext) -> torch.Tensor:  # (B, Hkv, N), float; higher = keep
        raise NotImplementedError

    def keep_layer_unchanged(self, layer_idx: int) -> bool:
        """True for layers the method leaves uncompressed (e.g. FastV's first layers)."""
        return False


class RetrievalPolicy:
    """Chooses, at each decode step and layer, which closed pages each KV head reads."""

    name: ClassVar[str] = ""

    def select(self, query: torch.Tensor, summaries: Any, num_pages: int) -> torch.Tensor:
        """query (B, Hq, 1, D) -> page indices (B, Hkv, num_pages), -1 for none."""
        raise NotImplementedError


EVICTION_REGISTRY: dict[str, type[EvictionPolicy]] = {}
RETRIEVAL_REGISTRY: dict[str, type[RetrievalPolicy]] = {}


def register_eviction(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    EVICTION_REGISTRY[cls.name] = cls
    return cls


def register_retrieval(cls: type[RetrievalPolicy]) -> type[RetrievalPolicy]:
    RETRIEVAL_REGISTRY[cls.name] = cls
    return cls


def make_eviction(name: str, **options: Any) -> EvictionPolicy:
    if name not in EVICTION_REGISTRY:
        known = ", ".join(sorted(EVICTION_REGISTRY))
        raise ConfigError(f"unknown eviction method {name!r}; known methods: {known}")
    return EVICTION_REGISTRY[name](**options)


def make_retrieval(name: str, **options: Any) -> RetrievalPolicy:
    if name not in RETRIEVAL_REGISTRY:
        known = ", ".join(sorted(RETRIEVAL_REGISTRY))
        raise ConfigError(f"unknown retrieval method {name!r}; known methods: {known}")
    return RETRIEVAL_REGISTRY[name](**options)
