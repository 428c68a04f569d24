"""The seams between the cache and the methods.

A policy never touches storage and the cache never decides:
- an `EvictionPolicy` turns what a layer's prefill produced (`PrefillContext`) into a score per
  cached token and KV head (higher = keep); the cache applies budgets, sinks and the recent window;
- a `RetrievalPolicy` builds per-page summaries when pages close (`summarize(PageBatch)`) and, at each
  decode step, scores the pages of each KV head (`score_pages(DecodeContext)`); the cache keeps the
  summaries, picks the top pages (`select`) and computes exact attention over them plus the pages it
  always reads (sinks, recent window, the open page).

Adding a method is one class here (or in a sibling file) plus `register_eviction` / `register_retrieval`.
What a policy reads beyond the layer's keys and values it declares with class attributes
(`needs_queries`, `needs_hidden_states`, `needs_inputs_embeds`, `needs_last_hidden`); the wrapped model
captures only what the configured policies declare. A policy that remembers something from one layer or
step to the next declares its state class (a dataclass) and never keeps it on itself (one policy serves
many requests, and a cache's copy shares it): `State`, made fresh per request and copied with it
(`ctx.request.state_of(self)`), and `StepScratch`, made fresh per forward (`ctx.step.state_of(self)`).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

# the shared types and the registry live below the seam (storage and the configuration use them without
# the policies); they are re-exported here, where a method's author looks for them
from ..core import (  # noqa: F401
    IMAGE,
    PAD,
    TEXT,
    BytesBudget,
    DecodeContext,
    PageBatch,
    PrefillContext,
    RequestState,
    Rope,
    SharedHeads,
    StepState,
    budget_count,
    fill_by_score,
    iter_tensors,
    select_by_score,
    topk_mask,
)
from ..registry import (  # noqa: F401
    EVICTION_REGISTRY,
    RETRIEVAL_REGISTRY,
    known_methods,
    make_eviction,
    make_retrieval,
    register_eviction,
    register_retrieval,
)


class EvictionPolicy:
    """Scores prompt tokens per KV head once prefill of a layer is done. Subclasses set `name` and
    override `score`. `needs_queries = True` makes the cache pass the layer's queries (the attention
    rows a method uses must then be computed in chunks, never the full N x N matrix).
    `needs_hidden_states = True` makes a wrapped model keep each layer's attention input during prefill
    and pass it as `ctx.hidden_states` (other methods pay nothing); `ctx.module` and `ctx.rope` form queries
    from it (`ctx.prerope_queries()`, RoPE at any position).
    Scores of padding tokens are ignored (the cache never keeps padding)."""

    name: ClassVar[str] = ""
    needs_queries: ClassVar[bool] = False
    needs_hidden_states: ClassVar[bool] = False
    # the policy's per-request memory (e.g. FastV's ranking): a fresh instance per request,
    # `ctx.request.state_of(self)`; None: the policy keeps nothing between layers
    State: ClassVar[type | None] = None
    # True when the scores of a layer's KV heads are on one scale, so that a budget shared by the heads (AdaKV,
    # head_budget="shared") may rank them jointly; False makes the configuration refuse such a budget
    # (policies/budgets.py). A policy whose answer depends on its options makes this a property.
    comparable_across_heads: ClassVar[bool] = False

    def score(self, ctx: PrefillContext) -> torch.Tensor:  # (B, Hkv, N), float; higher = keep
        raise NotImplementedError

    def keep_layer_unchanged(self, layer_idx: int) -> bool:
        """True for layers the method leaves uncompressed (e.g. FastV's first layers)."""
        return False

    def prepare_request(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        *,
        chunk_size: int = 512,
    ) -> Any:
        """Called once per request, before the prefill forward (by the wrapped model's `generate` and by
        `mm_oval.wrapper.prefill`), with the request's prompt. A method that needs its own pass over the
        prompt (KVzip's context reconstruction) runs it here; what it returns is handed back to `score` as
        `PrefillContext.request.prepared` for every layer of this request. Default: nothing to prepare."""
        return None

    @property
    def has_request_pass(self) -> bool:
        """Whether `prepare_request` does anything (the wrapper skips it otherwise): true for a class that
        overrides it; a policy that delegates to another answers for that one."""
        return type(self).prepare_request is not EvictionPolicy.prepare_request

    def state_tensors(self) -> list[torch.Tensor]:
        """The tensors the policy itself holds (learned weights, cached tables), counted in the stats'
        `allocated_bytes["method_state"]`. The default walks the policy's attributes (dicts, lists,
        dataclasses, `nn.Module`s); override it when the policy refers to tensors it does not own."""
        return list(iter_tensors(vars(self)))


class RetrievalPolicy:
    """Chooses, at each decode step and layer, which closed pages each KV head reads.

    Subclasses override `summarize` (per-page summaries from keys/values: any dict of tensors with
    leading dims (B, Hkv, P)) and `score_pages` (higher = read). `select` takes the top
    `ceil(read_budget * candidates)` pages per head; override it for another selection rule."""

    name: ClassVar[str] = ""
    # True makes a wrapped model keep the prompt's input embeddings (`PageBatch.request.inputs_embeds`)
    needs_inputs_embeds: ClassVar[bool] = False
    # True makes a wrapped model keep the previous token's final hidden state (`DecodeContext.step.last_hidden`)
    needs_last_hidden: ClassVar[bool] = False
    # True: `score_pages` puts every KV head's pages on one scale (e.g. the log of each page's estimated share
    # of the head's attention), so a layer's heads may share their read budget (`read_head_budget="shared"`,
    # `SharedHeads`); False makes the configuration refuse that
    comparable_across_heads: ClassVar[bool] = False
    # True: `page_log_mass` estimates each page's log attention mass from its summary (OVAL, LOCKS), which
    # `unread_pages="scored"` needs
    estimates_page_mass: ClassVar[bool] = False
    # True: `page_key_means` reads each page's keys' mean from its summary (OVAL, LOCKS: the centroid), which
    # `unread_pages="centroid"` then uses instead of keeping its own copy
    keeps_key_means: ClassVar[bool] = False
    # the policy's per-request memory of earlier steps (`ctx.request.state_of(self)`, fresh per request) and
    # what the layers of one decode step share (`ctx.step.state_of(self)`, fresh per forward); None: none
    State: ClassVar[type | None] = None
    StepScratch: ClassVar[type | None] = None

    def summarize(self, pages: PageBatch) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def score_pages(self, ctx: DecodeContext) -> torch.Tensor:  # (B, Hkv, P) float
        raise NotImplementedError

    def select(
        self, ctx: DecodeContext, read_budget: float | torch.Tensor | BytesBudget | SharedHeads
    ) -> torch.Tensor:
        """-> (B, Hkv, P) bool, the candidate pages read at this step. `read_budget` is a fraction of the
        candidates, a (B, Hkv) long tensor of page counts, or a `BytesBudget` (what the cache makes of a
        bytes budget: the best-scoring pages while their bytes fit, so small pages are not charged as
        large ones), each per KV head or shared by the layer's heads (`SharedHeads`)."""
        return select_by_score(self.score_pages(ctx), ctx.candidates, read_budget)

    def page_key_means(self, summaries: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """(B, Hkv, P, D) fp32: each page's keys' mean as its summary holds it; None when it holds none (the
        default). Only called where `keeps_key_means` is True."""
        return None

    def page_log_mass(self, ctx: DecodeContext) -> torch.Tensor | None:
        """(B, Hkv, G, P) fp32: per query head, each page's estimated log attention mass from its summary
        (log sum_i exp(scaling q . k_i) over the page's tokens, on the logits' scale) for the newest query
        row, -inf for an empty page; None when the policy's summaries give no such estimate (the default;
        Quest's bounds are not one). What `unread_pages="scored"` puts in place of a page not read."""
        return None

    def summary_bytes(self, summaries: dict[str, torch.Tensor], page_len: torch.Tensor) -> torch.Tensor:
        """(B, Hkv, P) long: the bytes of each page's summary that scoring it reads, per KV head (the
        stats' `bytes_read["summaries"]` and a bytes budget count them). `summaries` is the cache's dict
        of (B, Hkv, P, ...) tensors, `page_len` (B, Hkv, P) the pages' token counts. Default: every
        summary tensor's entries of the page, in its dtype; a policy whose scoring reads less (or more)
        overrides it."""
        per_page = 0
        for t in summaries.values():
            per_page += math.prod(t.shape[3:]) * t.element_size()
        return torch.full_like(page_len, per_page, dtype=torch.long)

    def state_tensors(self) -> list[torch.Tensor]:
        """The tensors the policy itself holds (e.g. a router's weights, cached per-layer matrices), counted
        in the stats' `allocated_bytes["method_state"]`; summaries are the cache's and counted there. The
        default walks the policy's attributes; override it when the policy refers to tensors it does not own."""
        return list(iter_tensors(vars(self)))
