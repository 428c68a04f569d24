"""The types shared by storage (`mm_oval.cache`, `mm_oval.pages`) and the methods (`mm_oval.policies`):
modality codes, the model's RoPE, what a cache hands a policy (`PrefillContext`, `PageBatch`,
`DecodeContext`), the typed state of one request and one step, the budget arithmetic both use, and
`iter_tensors`, the tensors an object holds (what a policy reports as its own and the stats count).
It sits below both: it imports neither.

State a policy reads or writes lives in two objects owned by the cache, never in string-keyed dicts:
- `RequestState` (`cache.request`): one per request, shared by the layers' prefill and by every decode
  step: the prompt's `inputs_embeds`, what the eviction policy's `prepare_request` returned, the cache's
  own layout when nothing is evicted, when the request's clock started, and each policy's own memory of
  the request (`state_of(policy)`: a fresh instance of the policy's `State` class);
- `StepState` (`cache.step`): one forward through the wrapped model (the prefill, or one decode step):
  its phase, when its clock started, which of the tokens fed are padding, each layer's attention input
  when the eviction policy reads hidden states, the previous token's final hidden state, and each
  policy's memory of this forward (`state_of(policy)`: a fresh instance of its `StepScratch` class).
Neither names a method: a method that keeps memory declares its own state class.
The wrapper fills only what the configured policies declare they need (`EvictionPolicy.needs_queries`,
`needs_hidden_states`; `RetrievalPolicy.needs_inputs_embeds`, `needs_last_hidden`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, is_dataclass
from typing import Any, ClassVar, Literal

import torch

from .errors import ConfigError

# modality codes used everywhere (cache, policies, stats)
TEXT, IMAGE, PAD = 0, 1, -1

Phase = Literal["idle", "prefill", "decode"]


@dataclass
class RequestState:
    """What one request (a batch of prompts) carries from layer to layer and step to step. Owned by its
    `PagedMultimodalCache` (`cache.request`); a `cache.copy()` copies it."""

    # (B, N, hidden) the prompt's input embeddings (after the image features are merged in), kept when the
    # retrieval policy sets `needs_inputs_embeds` (the router pools them into page contents)
    inputs_embeds: torch.Tensor | None = None
    # what the eviction policy's `prepare_request` returned (KVzip's reconstruction scores), or None
    prepared: Any = None
    # the cache's page layout when nothing is evicted (every layer the same, built once per request)
    full_layout: Any = None
    # layer -> (B, Hkv, N): each layer's prefill scores while they wait for the other layers' when the budget
    # is ranked across the layers (`Allocation.across_layers`); emptied once the choice is made
    layer_scores: dict[int, torch.Tensor] = field(default_factory=dict)
    # `time.perf_counter()` when the request started (before the vision tower and the policy's own pass)
    started: float | None = None
    # True while the wrapped model's `generate` runs the request: it computes the stats once, at its end
    run_by_generate: bool = False
    # id(policy) -> the policy's `State` for this request (what it carries from layer to layer and step to
    # step, e.g. FastV's ranking, KVP's log-partition); made on first use, copied with the request
    policy_states: dict[int, Any] = field(default_factory=dict)

    def state_of(self, policy: Any) -> Any:
        """This request's instance of `policy.State` (a fresh one on the policy's first use in the request)."""
        return _state_of(self.policy_states, policy, "State")


@dataclass
class StepState:
    """One forward through the wrapped model: the prefill, or one decode step (one new token, or a later
    turn's tokens). Owned by the cache (`cache.step`); the wrapper's hooks set it at the forward's start
    (`begin`) and read its clock at the end."""

    phase: Phase = "idle"
    # `time.perf_counter()` when this forward's clock started (the prefill's: when the request started)
    started: float | None = None
    # (B, Q) bool: which of the Q tokens fed are not padding (a batch of later turns of unequal length);
    # None when none is padding
    new_valid: torch.Tensor | None = None
    # layer -> (B, N, hidden): the layer's attention input during prefill (after its input norm), kept when
    # the eviction policy sets `needs_hidden_states`; the layer takes it when its prefill finishes
    attention_inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    # (B, hidden): the final hidden state (after the last norm) of the previous forward's last token, whose
    # logits chose the token fed now; kept when the retrieval policy sets `needs_last_hidden`
    last_hidden: torch.Tensor | None = None
    # id(policy) -> the policy's `StepScratch` for this forward (what its layers share, e.g. a router's text
    # state of `last_hidden`); made on first use, dropped when the next forward begins
    policy_states: dict[int, Any] = field(default_factory=dict)

    def begin(self, phase: Phase, started: float, new_valid: torch.Tensor | None = None) -> None:
        """A new forward: its phase, clock and padding; `last_hidden` (the previous forward's) stays."""
        self.phase, self.started, self.new_valid = phase, started, new_valid
        self.attention_inputs = {}
        self.policy_states = {}

    def state_of(self, policy: Any) -> Any:
        """This forward's instance of `policy.StepScratch` (a fresh one on its first use in the forward)."""
        return _state_of(self.policy_states, policy, "StepScratch")


def _state_of(states: dict[int, Any], policy: Any, kind: str) -> Any:
    """The instance of `policy`'s state class `kind` in `states`, made on first use. Keyed by the policy's
    identity: a cache's `copy()` shares its policies, so the copy's states stay theirs."""
    state = states.get(id(policy))
    if state is None:
        cls = getattr(policy, kind, None)
        if cls is None:
            raise TypeError(
                f"{type(policy).__name__} declares no {kind} class (set `{kind} = <a dataclass>`)"
            )
        state = states[id(policy)] = cls()
    return state


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
    chunk_size: int = 512  # query rows per chunk when a policy computes attention rows
    hidden_states: torch.Tensor | None = None  # (B, N, hidden): the attention module's input (after the
    # layer's input norm), as kvpress's `score(module, hidden_states, ...)` gets it; None unless the policy
    # sets `needs_hidden_states`
    rope: Rope | None = None  # the text model's RoPE (cos, sin for any positions, e.g. future ones)
    request: RequestState = field(default_factory=RequestState)  # the request's state, shared by
    # the layers (what `prepare_request` returned, state a policy passes from one layer to the next)
    image_keep: int | None = None  # the most image tokens one KV head of this layer keeps (its budget's
    # count, protected ones included), when the budget fixes it per head; None: any number, up to all

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
    request: RequestState = field(default_factory=RequestState)  # the request's state:
    # `inputs_embeds` (B, N, hidden) of the prompt when the retrieval policy sets `needs_inputs_embeds`

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
    step: StepState = field(default_factory=StepState)  # this step's state: `last_hidden`
    # (B, hidden) of the previous token when the retrieval policy sets `needs_last_hidden`
    request: RequestState = field(default_factory=RequestState)  # the request's state (a policy's own
    # memory of earlier steps: `request.state_of(policy)`)

    @property
    def num_kv_groups(self) -> int:
        return self.query.shape[1] // self.page_start.shape[1]


@dataclass
class BytesBudget:
    """A decode step's bytes budget, per KV head (what the cache makes of `read_bytes_budget`): the KV bytes
    of each page and the bytes left for the pages a policy selects, once the summaries scanned and the
    always-read pages are counted. `select` fills it with the best-scoring pages (`fill_by_score`)."""

    page_bytes: torch.Tensor  # (B, Hkv, P) long
    left: torch.Tensor  # (B, Hkv)


@dataclass
class SharedHeads:
    """A read budget the KV heads of a layer share (`OvalConfig.read_head_budget="shared"`): the pages
    `budget` would give each head, pooled (the heads' page counts, or their bytes left, summed) and filled
    with the best-scoring pages of any head. Scores must be on one scale across heads (the policy's
    `comparable_across_heads`: OVAL, LOCKS and Quest score a page by its estimated share of the head's
    attention over the closed pages, router v2 puts its logits on its base's scale), so the layer reads, at
    the same bytes, more pages in a head whose attention is spread and fewer in one whose attention sits on
    a few pages."""

    budget: float | torch.Tensor | BytesBudget


def fill_by_score(
    scores: torch.Tensor, eligible: torch.Tensor, page_bytes: torch.Tensor, left: torch.Tensor
) -> torch.Tensor:
    """Per row, True for the highest-scoring `eligible` pages, best first, while their bytes together fit
    `left` (the first page that does not fit ends the selection, so the pages read are always the top of
    the ranking). scores/eligible/page_bytes (..., P), left (...) -> (..., P) bool."""
    s = scores.float().masked_fill(~eligible, float("-inf"))
    order = s.argsort(dim=-1, descending=True, stable=True)
    size = torch.where(eligible, page_bytes, 0).gather(-1, order)
    fits = size.cumsum(-1) <= left.unsqueeze(-1)
    chosen = torch.zeros_like(eligible).scatter_(-1, order, fits)
    return chosen & eligible


def select_by_score(
    scores: torch.Tensor, candidates: torch.Tensor, read_budget: float | torch.Tensor | BytesBudget
) -> torch.Tensor:
    """The candidate pages a read budget reads, best scores first: scores/candidates (B, Hkv, P), the budget a
    fraction of the candidates (rounded up), a (B, Hkv) long tensor of page counts, or a `BytesBudget`
    (`fill_by_score`), or any of these shared by the heads (`SharedHeads`) -> (B, Hkv, P) bool.
    `RetrievalPolicy.select`'s rule."""
    if isinstance(read_budget, SharedHeads):
        return _select_shared(scores, candidates, read_budget.budget)
    if isinstance(read_budget, BytesBudget):
        return fill_by_score(scores, candidates, read_budget.page_bytes, read_budget.left)
    return topk_mask(scores, candidates, _page_counts(read_budget, candidates))


def _page_counts(read_budget: float | torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """(B, Hkv) long: the pages a fraction of the candidates (rounded up) or a tensor of counts reads per head."""
    n = candidates.sum(-1)
    if isinstance(read_budget, torch.Tensor):
        return read_budget.clamp(min=0).minimum(n)
    return budget_count(float(read_budget), n)


def _select_shared(
    scores: torch.Tensor, candidates: torch.Tensor, budget: float | torch.Tensor | BytesBudget
) -> torch.Tensor:
    """`select_by_score` over one ranking of a row's (KV head, page) pairs, at the heads' budgets summed."""
    B, H, P = scores.shape

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(B, 1, H * P)

    pooled: torch.Tensor | BytesBudget
    if isinstance(budget, BytesBudget):
        pooled = BytesBudget(flat(budget.page_bytes), budget.left.sum(-1, keepdim=True))
    else:
        pooled = _page_counts(budget, candidates).sum(-1, keepdim=True)
    return select_by_score(flat(scores), flat(candidates), pooled).reshape(B, H, P)


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


_SCALARS = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device)


def _is_hf_model(o: Any) -> bool:
    # without importing transformers here (core stays light): an object can only be a Hugging Face model
    # once transformers is loaded
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(o, transformers.PreTrainedModel)


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor reachable from `obj` through dicts (values), lists, tuples, sets, dataclass instances
    and `nn.Module`s (their parameters, buffers and tensor attributes). Other objects, and a Hugging Face
    model (the served model's weights) or an object marking itself `part_of_served_model` (e.g. the RoPE
    module the policies share with the model), are not entered."""
    seen: set[int] = set()
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            yield o
            continue
        if (
            isinstance(o, _SCALARS)
            or _is_hf_model(o)
            or getattr(type(o), "part_of_served_model", False)
            or id(o) in seen
        ):
            continue  # a policy may refer to the model it serves (or a module of it): its weights are not the method's
        seen.add(id(o))
        if isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif isinstance(o, torch.nn.Module) or (is_dataclass(o) and not isinstance(o, type)):
            stack.extend(vars(o).values())
