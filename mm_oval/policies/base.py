"""The seams between the cache and the methods.

A policy never touches storage and the cache never decides:
- an `EvictionPolicy` turns what a layer's prefill produced (`PrefillContext`) into a score per
  cached token and KV head (higher = keep); the cache applies budgets, sinks and the recent window;
- a `RetrievalPolicy` builds per-page summaries when pages close (`summarize(PageBatch)`) and, at each
  decode step, scores the pages of each KV head (`score_pages(DecodeContext)`); the cache keeps the
  summaries, picks the top pages (`select`) and computes exact attention over them plus the pages it
  always reads (sinks, recent window, the open page).

Adding a method is one class here (or in a sibling file) plus `register_eviction` / `register_retrieval`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..errors import ConfigError, MmOvalError
from ..stats import iter_tensors

# modality codes used everywhere (cache, policies, stats)
TEXT, IMAGE, PAD = 0, 1, -1


@dataclass(frozen=True)
class Rope:
    """The text model's rotary position embedding, for any positions: `rotary_emb(x, position_ids)` is the
    model's own module (e.g. `LlamaRotaryEmbedding`, `model.model.language_model.rotary_emb`), returning
    cos, sin of shape (B, M, D) with the halves convention of transformers' `rotate_half`. Shared, never
    copied (a `cache.copy()` keeps pointing at the model's module)."""

    rotary_emb: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    # the module is the served model's: the stats' allocated bytes do not count its buffers as the method's
    part_of_served_model: ClassVar[bool] = True

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, M) long positions (padding's -1 read as 0) -> cos, sin, each (B, M, D) fp32."""
        x = torch.zeros(1, dtype=torch.float32, device=positions.device)
        cos, sin = self.rotary_emb(x, positions.clamp(min=0).long())
        return cos.float(), sin.float()

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """RoPE of `x` (B, H, M, D) at `positions` (B, M), in fp32; `inverse=True` undoes it (the
        queries or keys as they were before RoPE)."""
        cos, sin = self.cos_sin(positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        x = x.float()
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos - rot * sin if inverse else x * cos + rot * sin

    def __deepcopy__(self, memo: dict) -> Rope:
        return self


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
    chunk_size: int = 512  # query rows per chunk when a policy computes attention rows
    hidden_states: torch.Tensor | None = None  # (B, N, hidden): the attention module's input (after the
    # layer's input norm), as kvpress's `score(module, hidden_states, ...)` gets it; None unless the policy
    # sets `needs_hidden_states`
    rope: Rope | None = None  # the text model's RoPE (cos, sin for any positions, e.g. future ones)
    request_state: Any = None  # what the policy's `prepare_request` returned for this request

    @property
    def valid(self) -> torch.Tensor:
        return self.modality != PAD

    @property
    def num_kv_groups(self) -> int:
        assert self.queries is not None
        return self.queries.shape[1] // self.keys.shape[1]

    def prerope_queries(self) -> torch.Tensor:
        """(B, Hq, N, D) fp32: the layer's queries before RoPE, formed from `hidden_states` with the attention
        module's `q_proj` (and `q_norm` where the model has one), as kvpress forms them."""
        if self.hidden_states is None or self.module is None or not hasattr(self.module, "q_proj"):
            raise ConfigError(
                "this method forms queries from the layer's hidden states: set needs_hidden_states = True "
                "and run it inside a model wrapped with mm_oval.wrap (a Llama-style attention with q_proj)"
            )
        B, N, _ = self.hidden_states.shape
        q = self.module.q_proj(self.hidden_states).view(B, N, -1, self.module.head_dim).transpose(1, 2)
        norm = getattr(self.module, "q_norm", None)
        return (norm(q) if norm is not None else q).float()


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
        `PrefillContext.request_state` for every layer of this request. Default: nothing to prepare."""
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


@dataclass
class PageBatch:
    """Pages of one layer (all KV heads), handed to `RetrievalPolicy.summarize` when they close: after
    prefill (every prompt page) and during decode (each text page that fills up). Shapes: P pages in
    this batch, T = the longest page. Page `j` here is entry `first_page + j` of the layer's page table."""

    layer_idx: int
    keys: torch.Tensor  # (B, Hkv, P, T, D) after RoPE; rows past a page's length are 0
    values: torch.Tensor  # (B, Hkv, P, T, D)
    mask: torch.Tensor  # (B, Hkv, P, T) bool, True for real tokens
    kind: torch.Tensor  # (B, Hkv, P) int8: TEXT, IMAGE or PAD (an empty page slot of a shorter head)
    first_page: int
    module: Any = None  # the layer's attention module (o_proj, num_key_value_groups, head_dim)
    token_index: torch.Tensor | None = None  # (B, Hkv, P, T) long: prompt index of each token, -1 past a
    # page's length and for generated tokens
    extra: dict = field(default_factory=dict)  # the request's dict; "inputs_embeds" (B, N, hidden) of the
    # prompt when a retrieval policy is configured

    @property
    def lengths(self) -> torch.Tensor:  # (B, Hkv, P) long
        return self.mask.sum(-1)


@dataclass
class DecodeContext:
    """What a retrieval policy sees at one decode step of one layer. P = pages in the layer's table."""

    layer_idx: int
    query: torch.Tensor  # (B, Hq, Q, D) after RoPE (Q = 1 at decode; more when a later turn is fed in)
    summaries: dict[str, torch.Tensor]  # what `summarize` returned, concatenated over pages: (B, Hkv, P, ...)
    page_start: torch.Tensor  # (B, Hkv, P) long, first slot of each page in the head's storage
    page_len: torch.Tensor  # (B, Hkv, P) long, 0 for an empty slot
    page_kind: torch.Tensor  # (B, Hkv, P) int8
    candidates: torch.Tensor  # (B, Hkv, P) bool: pages the budget applies to (others: always / never read)
    scaling: float
    module: Any = None
    extra: dict = field(
        default_factory=dict
    )  # per-step state: "last_hidden" (B, hidden) of the previous token

    @property
    def num_kv_groups(self) -> int:
        return self.query.shape[1] // self.page_start.shape[1]


class RetrievalPolicy:
    """Chooses, at each decode step and layer, which closed pages each KV head reads.

    Subclasses override `summarize` (per-page summaries from keys/values: any dict of tensors with
    leading dims (B, Hkv, P)) and `score_pages` (higher = read). `select` takes the top
    `ceil(read_budget * candidates)` pages per head; override it for another selection rule."""

    name: ClassVar[str] = ""

    def summarize(self, pages: PageBatch) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def score_pages(self, ctx: DecodeContext) -> torch.Tensor:  # (B, Hkv, P) float
        raise NotImplementedError

    def select(self, ctx: DecodeContext, read_budget: float) -> torch.Tensor:
        """-> (B, Hkv, P) bool, the candidate pages read at this step."""
        k = budget_count(float(read_budget), ctx.candidates.sum(-1))  # (B, Hkv)
        return topk_mask(self.score_pages(ctx), ctx.candidates, k)

    def state_tensors(self) -> list[torch.Tensor]:
        """The tensors the policy itself holds (e.g. a router's weights, cached per-layer matrices), counted
        in the stats' `allocated_bytes["method_state"]`; summaries are the cache's and counted there. The
        default walks the policy's attributes; override it when the policy refers to tensors it does not own."""
        return list(iter_tensors(vars(self)))


EVICTION_REGISTRY: dict[str, type[EvictionPolicy]] = {}
RETRIEVAL_REGISTRY: dict[str, type[RetrievalPolicy]] = {}


def register_eviction(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    EVICTION_REGISTRY[cls.name] = cls
    return cls


def register_retrieval(cls: type[RetrievalPolicy]) -> type[RetrievalPolicy]:
    RETRIEVAL_REGISTRY[cls.name] = cls
    return cls


def _load_builtin_policies() -> None:
    """Import the files that register the project's methods (a missing optional file is skipped)."""
    import importlib

    for mod in ("heuristics", "kvp", "pagebases", "router", "expected", "budgets"):
        try:
            importlib.import_module(f"{__package__}.{mod}")
        except ModuleNotFoundError as e:  # a family not built yet
            if e.name != f"{__package__}.{mod}":
                raise


def make_eviction(name: str, **options: Any) -> EvictionPolicy:
    _load_builtin_policies()
    if name not in EVICTION_REGISTRY:
        known = ", ".join(sorted(["full", *EVICTION_REGISTRY]))
        raise ConfigError(f"unknown eviction method {name!r}; known methods: {known}")
    try:
        return EVICTION_REGISTRY[name](**options)
    except TypeError as e:
        if isinstance(e, MmOvalError):  # ModelError is a TypeError: a policy's own error, not bad options
            raise
        raise ConfigError(f"bad options {options} for eviction method {name!r}: {e}") from e


def make_retrieval(name: str, **options: Any) -> RetrievalPolicy:
    _load_builtin_policies()
    if name not in RETRIEVAL_REGISTRY:
        known = ", ".join(sorted(RETRIEVAL_REGISTRY))
        raise ConfigError(f"unknown retrieval method {name!r}; known methods: {known}")
    try:
        return RETRIEVAL_REGISTRY[name](**options)
    except TypeError as e:
        if isinstance(e, MmOvalError):  # ModelError is a TypeError: a policy's own error, not bad options
            raise
        raise ConfigError(f"bad options {options} for retrieval method {name!r}: {e}") from e


def known_methods() -> tuple[list[str], list[str]]:
    """(eviction methods incl. "full", retrieval methods) currently registered."""
    _load_builtin_policies()
    return sorted(["full", *EVICTION_REGISTRY]), sorted(RETRIEVAL_REGISTRY)


def topk_mask(scores: torch.Tensor, eligible: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Per row, True for the `k` highest scores among `eligible` entries (ties: lower index first).
    scores/eligible (..., N), k (...) long."""
    s = scores.float().masked_fill(~eligible, float("-inf"))
    order = s.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return (rank < k.unsqueeze(-1)) & eligible


def budget_count(budget: float | int, n: torch.Tensor) -> torch.Tensor:
    """Tokens kept out of `n` (a tensor of counts) for a budget: a float in (0, 1] is a fraction
    (rounded up), an int a token count (at most n)."""
    if isinstance(budget, bool):
        raise ConfigError("a budget is a fraction in (0, 1] or a token count, not a bool")
    if isinstance(budget, int):
        return n.clamp(max=budget)
    return torch.ceil(n.double() * budget - 1e-9).long().clamp(min=0).minimum(n)
