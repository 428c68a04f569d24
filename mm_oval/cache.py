"""`PagedMultimodalCache`: a transformers `Cache` whose layers keep, per KV head, the tokens an eviction
policy chose at the end of prefill, laid out in pages, and attend at decode over all of them or over the
pages a retrieval policy picks.

How it plugs into an unmodified model (the attention hand-off, the one place it is described):
1. the attention module calls `cache.update(keys, values, layer_idx)` just before its attention function;
   the layer (`PagedLayer.update`) stores the new keys/values and leaves itself in `_PENDING`, a context
   variable, for that attention function;
2. the attention function mm-oval registered (`mm_oval.wrapper`, `mm_oval_<inner>`) picks the layer up
   with `take_pending(module.layer_idx)` (None: this forward is not through a `PagedMultimodalCache`, e.g.
   a policy's own pass with a `DynamicCache`, and the model's own attention runs unchanged);
3. prefill (`layer.phase == "prefill"`): the model's own attention runs over the whole prompt, then
   `layer.finish_prefill(query, module, scaling)` scores the tokens with the eviction policy, keeps the
   budget's top, lays the kept tokens out in pages and summarises them for the retrieval policy;
4. decode: `layer.attend(query, scaling)` is exact attention over the kept slots (with retrieval, over the
   pages `read_pages` selects plus the always-read ones), the model's attention function is not called.
`get_seq_length()` is the logical length (prompt + generated), which `generate` uses to slice the inputs;
RoPE positions come from the attention mask and stay the original ones.

What the policies read besides keys and values comes from the cache's typed state (`mm_oval.core`):
`cache.request` (a `RequestState`, per request) and `cache.step` (a `StepState`, per forward), set by the
wrapped model's hooks (`mm_oval.wrapper`) and by the policies themselves.
"""

from __future__ import annotations

import contextvars
import copy
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, CacheLayerMixin

from . import kernels
from .allocation import Allocation, check_policy, pyramid_counts, shared_head_keep
from .config import OvalConfig
from .core import (
    IMAGE,
    PAD,
    TEXT,
    BytesBudget,
    DecodeContext,
    PageBatch,
    PrefillContext,
    RequestState,
    Rope,
    StepState,
    budget_count,
    topk_mask,
)
from .errors import ConfigError, DataError
from .geometry import Geometry, fixed_grid_rc
from .pages import dynamic_labels, gather_pages, kept_labels, layout_pages
from .stats import RetrievalMonitor

if TYPE_CHECKING:
    from .policies.base import EvictionPolicy, RetrievalPolicy

logger = logging.getLogger(__name__)

# the layer whose `update` just ran; its attention function picks it up (same module, same forward)
_PENDING: contextvars.ContextVar[PagedLayer | None] = contextvars.ContextVar("mm_oval_pending", default=None)


def take_pending(layer_idx: int | None) -> PagedLayer | None:
    layer = _PENDING.get()
    if layer is None or layer.layer_idx != layer_idx:
        return None
    _PENDING.set(None)
    return layer


# the share of a layer's KV bytes that the temporaries of building its page summaries may take at once
SUMMARY_TEMP_SHARE = 0.25

# what a decode step reads, the rows of `PagedLayer._read_t` (see mm_oval.stats, `bytes_read`)
READ_KINDS = ("summaries", "selected", "always_read", "dense")
# off the kernel path, a decode step attends over the pages it reads gathered (PagedLayer._attend_gathered)
# rather than over every slot with a mask when the gathered width (the most pages a KV head reads times the
# longest page read) is at most this share of the slots
GATHER_SHARE = 0.5
# the gathered keys and values of the KV heads one SDPA call takes at a time (a share of a core's cache)
GATHER_CHUNK_BYTES = 1 << 20


def kv_bytes_per_token(keys: torch.Tensor) -> int:
    """Bytes of one token's key and value in one KV head, for storage like `keys` (..., D)."""
    return 2 * keys.shape[-1] * keys.element_size()


def page_kv_bytes(page_len: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, P) long: the key and value bytes of each page's tokens in its KV head: the bytes of a page
    that the stats' `bytes_read`, a bytes budget and bench_retrieval count."""
    return page_len.long() * kv_bytes_per_token(keys)


def pages_within_bytes(page_bytes: torch.Tensor, cand: torch.Tensor, left: torch.Tensor) -> torch.Tensor:
    """(..., P) page bytes, (..., P) bool candidates, (...) bytes left for optional pages -> (...) long: the
    most candidate pages that fit `left` whichever are picked (the count of the largest ones that fit).
    For pages of one size this is the count `core.fill_by_score` (what the cache reads) reads; the
    retrieval benchmark's oracle and random rows use it."""
    sizes = torch.where(cand, page_bytes, 0).sort(-1, descending=True).values.cumsum(-1)
    return (sizes <= left.unsqueeze(-1)).sum(-1).minimum(cand.sum(-1))


@dataclass
class RequestInfo:
    """What the cache knows about each prompt token of the request (B samples, N tokens)."""

    modality: torch.Tensor  # (B, N) int8: TEXT, IMAGE, PAD
    positions: torch.Tensor  # (B, N) long, original RoPE positions, -1 for padding
    image_rc: torch.Tensor  # (B, N, 3) long: (image, row, col), -1 for non-image tokens
    protected: torch.Tensor  # (B, N) bool: sink or recent-window token

    @property
    def next_pos(self) -> torch.Tensor:  # (B,) position of the first token after the prompt
        return self.positions.amax(-1) + 1


def request_info(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    image_token_id: int | None,
    tokens_per_image: int,
    sink_tokens: int,
    recent_tokens: int,
    geometry: Geometry | None = None,
) -> RequestInfo:
    """Per prompt token: modality, position, (grid, row, col), protection. The image tokens and their
    (row, col) come from `geometry` (mm_oval.geometry.image_geometry: any supported model family); without
    one, from `image_token_id` with `tokens_per_image` tokens per square image (LLaVA-1.5's layout)."""
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ConfigError(
            "mm-oval reads padding from a 2-D attention_mask (batch, tokens); a prepared 4-D mask is not supported"
        )
    valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    if geometry is not None:
        is_img = geometry.is_image & valid
        rc = geometry.image_rc
    else:
        is_img = (input_ids == image_token_id) & valid
        rc = fixed_grid_rc(is_img, tokens_per_image)
    modality = torch.full_like(input_ids, TEXT, dtype=torch.int8)
    modality[is_img] = IMAGE
    modality[~valid] = PAD
    positions = valid.long().cumsum(-1) - 1
    positions = positions.masked_fill(~valid, -1)
    image_rc = torch.where(is_img.unsqueeze(-1), rc, torch.full_like(rc, -1))
    n_valid = valid.sum(-1, keepdim=True)
    protected = valid & ((positions < sink_tokens) | (positions >= n_valid - recent_tokens))
    return RequestInfo(modality, positions, image_rc, protected)


def choose_kept(
    scores: torch.Tensor,
    info: RequestInfo,
    config: OvalConfig,
    allocation: Allocation | None = None,
    layer: int = 0,
    num_layers: int = 1,
) -> torch.Tensor:
    """(B, Hkv, N) scores -> (B, Hkv, N) bool: per sample and KV head, the protected tokens plus the
    top-scored ones, within each modality's budget (eviction_scope "image") or all together ("all").

    `allocation` (mm_oval.policies.budgets; default: the uniform one) divides the budget: with a PyramidKV
    schedule, `layer` of `num_layers` (the layers that evict) keeps the protected tokens plus its share of
    the rest, the layers' counts summing to `num_layers` times the uniform count; with heads shared (AdaKV,
    or head_budget "shared", which is AdaKV with alpha 0) the KV heads of the layer keep Hkv times a head's
    count between them, the top of all (head, token) scores together after each head's safeguard: a head
    whose tokens score higher keeps more, another fewer (protected tokens still in every head)."""
    B, H, N = scores.shape
    alloc = (allocation or Allocation()).with_head_budget(config.head_budget)
    mod = info.modality.unsqueeze(1).expand(B, H, N)
    prot = info.protected.unsqueeze(1).expand(B, H, N)
    # protected tokens above every score, also a method's own +inf (SnapKV's observation window); a token's
    # -inf or NaN ranks it last among its modality's, never behind a token of another group (exact counts)
    big = torch.finfo(torch.float32).max
    s = torch.nan_to_num(scores.float(), nan=-big, posinf=big, neginf=-big).masked_fill(prot, float("inf"))
    counts = {}
    for m, budget in ((IMAGE, config.budget), (TEXT, config.text_budget)):
        n = (info.modality == m).sum(-1)  # (B,)
        p = (info.protected & (info.modality == m)).sum(-1)
        counts[m] = (budget_count(budget, n), p, n)
    im, tx = counts[IMAGE], counts[TEXT]
    groups = [((mod != PAD), im[0] + tx[0], im[1] + tx[1], im[2] + tx[2])]
    if config.eviction_scope != "all":
        groups = [((mod == m), k, p, n) for m, (k, p, n) in counts.items()]
    keep = torch.zeros_like(prot)
    for eligible, k, p, n in groups:
        k = torch.maximum(k, p)  # (B,) tokens per head
        if alloc.pyramid_beta is not None:  # this layer's share of the layers' total beyond the protected
            k = p + pyramid_counts(k - p, n - p, num_layers, alloc.pyramid_beta)[:, layer]
        if alloc.share_heads:
            keep |= shared_head_keep(s, eligible, k, alloc.alpha_safeguard)
        else:
            keep |= topk_mask(s, eligible, k.view(B, 1).expand(B, H))
    return keep


class PagedLayer(CacheLayerMixin):
    """One decoder layer's kept tokens, per KV head, page-major (layout of docs/kernels.md)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, owner: PagedMultimodalCache, layer_idx: int):
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.phase = "empty"  # empty -> prefill (full prompt stored) -> decode (compressed + appended)
        self.logical_len = 0

    # ---- transformers' CacheLayerMixin -------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[2]
        if self.phase == "empty":
            if self.owner.info is None:
                raise ConfigError(
                    "this PagedMultimodalCache was not prepared for a request: run it through a model wrapped "
                    "with mm_oval.wrap (with input_ids), or call cache.prepare(...) first"
                )
            self.keys, self.values = key_states, value_states
            self.phase = "prefill"
            self.logical_len = q
        else:
            if self.phase == "prefill":
                raise ConfigError(
                    f"layer {self.layer_idx}: prefill did not finish; the model's attention must be mm-oval's "
                    "(wrap the model with mm_oval.wrap)"
                )
            self._append(key_states, value_states)
        _PENDING.set(self)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # prefill: the model's own mask over the prompt; decode: mm-oval builds its own per-head mask
        return query_length, 0

    def get_seq_length(self) -> int:
        return self.logical_len

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = self._k = self._v = None
        self._stats_t = self._read_t = self._resident = self._head_resident = None
        self.phase = "empty"
        self.logical_len = 0
        self.is_initialized = False

    # ---- prefill: eviction and pages -------------------------------------------------------------
    def _image_keep(self, alloc: Allocation) -> int | None:
        """The most image tokens one KV head of this layer keeps under `choose_kept`: the budget's count per
        head (protected tokens included), or the layer's KV heads' counts together when they share the
        budget (one head may take them all); None when the count is not bounded that way (PyramidKV's
        schedule, one budget over all tokens)."""
        cfg, info = self.owner.config, self.owner.info
        alloc = alloc.with_head_budget(cfg.head_budget)
        if cfg.eviction_scope == "all" or alloc.pyramid_beta is not None:
            return None
        image = info.modality == IMAGE
        n = image.sum(-1)
        k = torch.maximum(budget_count(cfg.budget, n), (info.protected & image).sum(-1))
        if alloc.share_heads:
            k = torch.minimum(k * self.keys.shape[1], n)
        return int(k.max()) if k.numel() else 0

    def finish_prefill(self, query: torch.Tensor, module: Any, scaling: float) -> None:
        owner, cfg, info = self.owner, self.owner.config, self.owner.info
        keys, values = self.keys, self.values
        B, H, N, D = keys.shape
        if info.modality.shape != (B, N):
            raise DataError(
                f"the cache was prepared for inputs of shape {tuple(info.modality.shape)} but layer "
                f"{self.layer_idx} got {N} tokens for batch {B}"
            )
        valid = (info.modality != PAD).unsqueeze(1).expand(B, H, N)
        keep = valid
        policy = owner.eviction
        hidden = owner.step.attention_inputs.pop(self.layer_idx, None)  # kept when the policy asks for it
        if policy is not None and cfg.evicts:
            if policy.needs_hidden_states and hidden is None:
                raise ConfigError(
                    f"eviction method {policy.name!r} reads each layer's hidden states: run it through a "
                    "model wrapped with mm_oval.wrap"
                )
            # the budget's division (PyramidKV over the layers that evict, AdaKV over the heads)
            alloc = Allocation.of(policy, cfg.head_budget)
            ctx = PrefillContext(
                layer_idx=self.layer_idx,
                keys=keys,
                values=values,
                queries=query if policy.needs_queries else None,
                positions=info.positions,
                modality=info.modality,
                image_rc=info.image_rc,
                scaling=scaling,
                module=module,
                chunk_size=cfg.chunk_size,
                request=owner.request,
                hidden_states=hidden if policy.needs_hidden_states else None,
                rope=owner.rope,
                image_keep=self._image_keep(alloc),
            )
            scores = policy.score(ctx)
            if not policy.keep_layer_unchanged(self.layer_idx):
                if scores.shape != (B, H, N):
                    raise ConfigError(
                        f"eviction method {policy.name!r} returned scores of shape {tuple(scores.shape)}, "
                        f"expected {(B, H, N)}"
                    )
                rank, n_evicting = 0, 1
                if alloc.pyramid_beta is not None:  # only a per-layer schedule needs the layer's place
                    evicting = [i for i in range(len(owner.layers)) if not policy.keep_layer_unchanged(i)]
                    rank, n_evicting = evicting.index(self.layer_idx), len(evicting)
                keep = choose_kept(scores, info, cfg, alloc, rank, n_evicting) & valid
        args = (
            info.modality,
            info.positions,
            info.image_rc,
            info.protected,
            cfg.image_tile,
            cfg.text_page_size,
        )
        sizing = cfg.sizing  # None for fixed pages (dynamic ones need a retrieval method: config.py)

        def labels_of(kept: torch.Tensor):  # None: fixed tiles; "kept": runs of kept image tokens
            if cfg.page_sizing != "kept":
                return None
            return kept_labels(kept, info.modality, info.image_rc, cfg.image_tile, cfg.text_page_size)

        if sizing is not None:  # OVAL sizing: pages chosen per layer and KV head from the keys
            labels = dynamic_labels(keys, keep, info.modality, info.image_rc, sizing)
            lay = layout_pages(keep, *args, labels=labels)
        elif keep is valid:  # nothing evicted: every layer has the same layout, built once per request
            lay = owner.request.full_layout
            if lay is None or lay.src.shape[1] != H:
                lay = owner.request.full_layout = layout_pages(keep, *args, labels=labels_of(keep))
        else:
            lay = layout_pages(keep, *args, labels=labels_of(keep))
        src = lay.src.clamp(min=0)
        ok = lay.src >= 0
        exp = lambda t: t.unsqueeze(1).expand(B, H, N)  # noqa: E731
        # per-slot facts of the prompt slots (decode slots are all valid text at consecutive positions)
        self._p_pos = torch.where(ok, exp(info.positions).gather(-1, src), -1)
        self._p_mod = torch.where(ok, exp(info.modality.long()).gather(-1, src), PAD).to(torch.int8)
        self._p_src = lay.src
        rc = info.image_rc.unsqueeze(1).expand(B, H, N, 3).gather(2, src.unsqueeze(-1).expand(*src.shape, 3))
        self._p_rc = torch.where(ok.unsqueeze(-1), rc, -1)
        self.prompt_slots = L0 = lay.src.shape[2]
        self.prompt_pages = P0 = lay.page_start.shape[-1]
        self.first_pos = info.next_pos.clone()  # position of the first decode token, per sample
        self.n_decode = 0
        self.all_valid = bool(ok.all())  # no empty slot: decode may skip the mask
        # storage with room to grow (decode writes in place; `keys` etc. are views of the used part)
        self._alloc(L0 + self._room(L0), keys.dtype, keys.device, B, H, D)
        self._k[:, :, :L0], self._v[:, :, :L0] = kernels.compact_kv(keys, values, torch.where(ok, lay.src, -1))
        self._valid[..., :L0] = ok
        self._page[..., :L0] = lay.slot_page
        self._pstart[..., :P0], self._plen[..., :P0] = lay.page_start, lay.page_len
        self._pkind[..., :P0], self._ppinned[..., :P0] = lay.page_kind, lay.page_pinned
        self._set_views()
        self.module = module
        self.summaries: dict[str, torch.Tensor] = {}
        if owner.retrieval is not None:
            self._summarize(0, self.prompt_pages)
        self.phase = "decode"
        self._record_prefill_stats(valid, info)
        self._p_image = self._p_mod == IMAGE  # image slots (all in the prompt part)
        # per prompt page: its valid slots and whether they are image slots (a page holds one modality),
        # so a step's bytes read over the prompt are counted per page, not per slot
        self._p_count = torch.zeros(B, H, P0, dtype=torch.long, device=keys.device)
        self._p_count.scatter_add_(-1, lay.slot_page.clamp(min=0), ok.long())
        self._p_page_image = lay.page_kind == IMAGE
        # bytes read at decode, summed over steps: rows summaries, selected, always_read, dense; columns
        # image, text (a tensor: no device sync per step; `stats` reads it)
        self._read_t = torch.zeros(len(READ_KINDS), 2, dtype=torch.long, device=keys.device)
        # resident (valid) slots, image and text, kept up to date as decode appends tokens: what dense
        # attention reads each step, without a pass over the slot table per step
        self._resident = self._by_modality(self.slot_valid)
        self._head_resident = self.slot_valid.sum(-1)  # (B, Hkv): the same per KV head, image and text

    # ---- storage -------------------------------------------------------------------------------------
    def _room(self, used: int) -> int:
        """Decode slots allocated after prefill (doubled when full): a multiple of the text page size."""
        S = self.owner.config.text_page_size
        return -(-64 // S) * S

    def _alloc(self, cap: int, dtype: torch.dtype, device: torch.device, B: int, H: int, D: int) -> None:
        S = self.owner.config.text_page_size
        L0, P0 = self.prompt_slots, self.prompt_pages
        self._cap = cap
        self._k = torch.zeros(B, H, cap, D, dtype=dtype, device=device)
        self._v = torch.zeros(B, H, cap, D, dtype=dtype, device=device)
        self._valid = torch.zeros(B, H, cap, dtype=torch.bool, device=device)
        t = torch.arange(cap - L0, device=device)
        self._page = torch.full((B, H, cap), -1, dtype=torch.long, device=device)
        self._page[..., L0:] = P0 + t // S
        n_dec_pages = -(-(cap - L0) // S)
        pcap = P0 + n_dec_pages
        j = torch.arange(n_dec_pages, device=device)
        self._pstart = torch.zeros(B, H, pcap, dtype=torch.long, device=device)
        self._pstart[..., P0:] = L0 + j * S
        self._plen = torch.zeros(B, H, pcap, dtype=torch.long, device=device)
        self._pkind = torch.full((B, H, pcap), TEXT, dtype=torch.int8, device=device)
        self._ppinned = torch.zeros(B, H, pcap, dtype=torch.bool, device=device)

    def _grow(self, need: int) -> None:
        B, H, used, D = self.keys.shape
        P = self.page_len.shape[-1]
        old = (self._k, self._v, self._valid, self._pstart, self._plen, self._pkind, self._ppinned)
        old_page = self._page
        cap = max(need, self.prompt_slots + 2 * (self._cap - self.prompt_slots))
        self._alloc(cap, self._k.dtype, self._k.device, B, H, D)
        self._k[:, :, :used], self._v[:, :, :used] = old[0][:, :, :used], old[1][:, :, :used]
        self._valid[..., :used] = old[2][..., :used]
        # the prompt slots' pages (the decode slots' pages follow from their place, set by _alloc)
        self._page[..., : self.prompt_slots] = old_page[..., : self.prompt_slots]
        for new_t, old_t in zip((self._pstart, self._plen, self._pkind, self._ppinned), old[3:]):
            new_t[..., :P] = old_t[..., :P]

    def _set_views(self) -> None:
        L = self.prompt_slots + self.n_decode
        P = self.prompt_pages + -(-self.n_decode // self.owner.config.text_page_size)
        self.keys, self.values = self._k[:, :, :L], self._v[:, :, :L]
        self.slot_valid, self.slot_page = self._valid[..., :L], self._page[..., :L]
        self.page_start, self.page_len = self._pstart[..., :P], self._plen[..., :P]
        self.page_kind, self.page_pinned = self._pkind[..., :P], self._ppinned[..., :P]

    def _decode_part(self, prompt: torch.Tensor, fill: torch.Tensor | int) -> torch.Tensor:
        B, H = prompt.shape[:2]
        if isinstance(fill, int):
            fill = torch.full(
                (B, H, self.n_decode, *prompt.shape[3:]), fill, dtype=prompt.dtype, device=prompt.device
            )
        return torch.cat([prompt, fill], dim=2)

    @property
    def slot_pos(self) -> torch.Tensor:  # (B, Hkv, L) original position of each slot, -1 if empty
        B, H = self._p_pos.shape[:2]
        t = self.first_pos.view(B, 1, 1) + torch.arange(self.n_decode, device=self._p_pos.device)
        return self._decode_part(self._p_pos, t.expand(B, H, self.n_decode))

    @property
    def slot_mod(self) -> torch.Tensor:  # (B, Hkv, L) int8 TEXT / IMAGE / PAD (empty)
        return self._decode_part(self._p_mod, TEXT)

    @property
    def slot_src(self) -> torch.Tensor:  # (B, Hkv, L) prompt index of each slot, -1 for empty/generated
        return self._decode_part(self._p_src, -1)

    @property
    def slot_rc(self) -> torch.Tensor:  # (B, Hkv, L, 3) (image, row, col) of image slots, -1 elsewhere
        return self._decode_part(self._p_rc, -1)

    def _summary_chunk(self, T: int) -> int:
        """Pages (padded to T tokens) per `summarize` call: as many as keep the call's
        temporaries (padded page keys/values, their fp32 copies, Gram matrices and eigendecompositions, the
        page tokens' input embeddings for a policy that pools them) within SUMMARY_TEMP_SHARE of the
        layer's KV bytes (at least one page)."""
        B, H, L, D = self.keys.shape
        hidden = 0
        embeds = self.owner.request.inputs_embeds
        if self.owner.retrieval.needs_inputs_embeds and embeds is not None:
            hidden = embeds.shape[-1]
        per_page = B * H * T * ((4 * self.keys.element_size() + 48) * D + 12 * hidden + 32 * T)
        kv = 2 * self.keys.numel() * self.keys.element_size()
        return max(1, int(SUMMARY_TEMP_SHARE * kv) // per_page)

    def _page_width(self, first: int, stop: int) -> int:
        """The padded width T of pages [first, stop) as gather_pages pads them all at once."""
        length = self.page_len[..., first:stop]
        return max(int(length.max()) if length.numel() else 0, 1)

    def _summarize(self, first: int, stop: int) -> None:
        """Summaries of pages [first, stop), appended to `summaries`. Built in chunks of pages (each padded
        to the width of the whole range, so that the summaries are those of one call) written into one
        preallocated tensor per summary: the temporaries stay within a share of the layer's KV bytes."""
        T = self._page_width(first, stop)
        step = self._summary_chunk(T)
        new: dict[str, torch.Tensor] = {}
        slot_src = self.slot_src
        for a in range(first, stop, step):
            b = min(stop, a + step)
            k, v, mask, src = gather_pages(
                self.keys, self.values, self.page_start, self.page_len, slice(a, b), slot_src
            )
            if k.shape[-2] < T:  # the padding gather_pages gives the pages of the whole range
                pad = T - k.shape[-2]
                k, v = F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
                mask, src = F.pad(mask, (0, pad)), F.pad(src, (0, pad), value=-1)
            batch = PageBatch(
                layer_idx=self.layer_idx,
                keys=k,
                values=v,
                mask=mask,
                kind=self.page_kind[..., a:b],
                first_page=a,
                module=self.module,
                token_index=src,
                request=self.owner.request,
            )
            part = self.owner.retrieval.summarize(batch)
            del k, v, mask, src, batch
            if step >= stop - first:
                new = part
                break
            for name, t in part.items():
                if name not in new:
                    new[name] = t.new_empty((*t.shape[:2], stop - first, *t.shape[3:]))
                new[name][:, :, a - first : b - first] = t
        for name, t in new.items():
            old = self.summaries.get(name)
            self.summaries[name] = t if old is None else torch.cat([old, t], dim=2)

    def _record_prefill_stats(self, valid: torch.Tensor, info: RequestInfo) -> None:
        """Counts as tensors (no device sync here); `stats` turns them into numbers when read."""
        mod = self._p_mod
        self._stats_t = {
            "image_full": (info.modality == IMAGE).sum(),
            "text_full": (info.modality == TEXT).sum(),
            "image_kept": (mod == IMAGE).sum(),
            "text_kept": (mod == TEXT).sum(),
            "pages": (self.page_len > 0).sum(),
        }

    @property
    def stats(self) -> dict[str, Any]:
        """Tokens and bytes kept for the prompt, by modality: tokens summed over the batch and averaged over
        KV heads, bytes exact (keys + values of every head). `bytes_allocated`: the key and value storage
        as allocated (every head padded to the longest one, and the decode slots, used or not)."""
        t = getattr(self, "_stats_t", None)
        if t is None:
            return {}
        B, H, L, D = self.keys.shape
        per_token = 2 * D * self.keys.element_size()  # keys + values, one KV head
        out: dict[str, Any] = {"layer": self.layer_idx}
        for name in ("image", "text"):
            full, kept = int(t[f"{name}_full"]) * H, int(t[f"{name}_kept"])
            out[f"{name}_tokens_full"] = full / H
            out[f"{name}_tokens_kept"] = kept / H
            out[f"{name}_bytes_full"] = full * per_token
            out[f"{name}_bytes_kept"] = kept * per_token
        out["bytes_allocated"] = sum(t.untyped_storage().nbytes() for t in (self._k, self._v))
        out["pages"] = int(t["pages"]) / H
        return out

    # ---- decode ------------------------------------------------------------------------------------
    def _append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        q = k.shape[2]
        S = self.owner.config.text_page_size
        L = self.prompt_slots + self.n_decode
        if L + q > self._cap:
            self._grow(L + q)
        self._k[:, :, L : L + q] = k
        self._v[:, :, L : L + q] = v
        new_valid = self.owner.step.new_valid  # (B, q) bool when the new tokens hold padding
        if new_valid is not None and new_valid.shape == (k.shape[0], q):
            self._valid[..., L : L + q] = new_valid.unsqueeze(1)
            self.all_valid = False
            self._resident[1] += new_valid.sum() * k.shape[1]  # generated tokens are text
            self._head_resident += new_valid.sum(-1, keepdim=True)
        else:
            self._valid[..., L : L + q] = True
            self._resident[1] += k.shape[0] * k.shape[1] * q
            self._head_resident += q
        closed_before = self.n_decode // S
        first_open = self.prompt_pages + closed_before
        self.n_decode += q
        self.logical_len += q
        last = self.prompt_pages + -(-self.n_decode // S)
        for j in range(first_open, last):  # the pages these tokens went to (usually one)
            self._plen[..., j] = min(S, self.n_decode - (j - self.prompt_pages) * S)
        self._set_views()
        closed_now = self.n_decode // S
        if self.owner.retrieval is not None and closed_now > closed_before:
            self._summarize(self.prompt_pages + closed_before, self.prompt_pages + closed_now)

    def _by_modality(self, slots: torch.Tensor) -> torch.Tensor:
        """(B, Hkv, L) bool slots -> (2,) long: how many are image slots, how many text."""
        image = (slots[..., : self.prompt_slots] & self._p_image).sum()
        return torch.stack([image, slots.sum() - image])

    def _pages_by_modality(self, pages: torch.Tensor) -> torch.Tensor:
        """(B, Hkv, P) bool pages -> (2,) long: the valid slots of those pages, image and text (as
        `_by_modality` of their slots): prompt pages counted per page, decode slots (text) per slot."""
        P0, L0 = self.prompt_pages, self.prompt_slots
        prompt = pages[..., :P0] * self._p_count
        image = (prompt * self._p_page_image).sum()
        dec = self.slot_valid[..., L0:] & pages.gather(-1, self.slot_page[..., L0:].clamp(min=0))
        return torch.stack([image, prompt.sum() - image + dec.sum()])

    def _count_read(self, always: torch.Tensor | None, chosen: torch.Tensor | None, summary: torch.Tensor) -> None:
        """Adds one decode step's bytes read to `_read_t`: `always` / `chosen` (B, Hkv, P) bool pages read
        whatever the selection / selected by the retrieval policy (None, None: every slot is read),
        `summary` (2,) the summary bytes scanned, image and text."""
        per_token = kv_bytes_per_token(self.keys)
        dense = self._resident
        if always is None:
            read_always, selected = dense, torch.zeros_like(dense)
        else:
            read_always = self._pages_by_modality(always)
            selected = self._pages_by_modality(chosen)
        self._read_t += torch.stack([summary, selected * per_token, read_always * per_token, dense * per_token])

    def _bytes_budget(
        self, cand: torch.Tensor, always: torch.Tensor, summary: torch.Tensor, fraction: float
    ) -> BytesBudget:
        """Per KV head, the bytes left for the pages the policy selects: `fraction` of the dense bytes
        (every resident slot) less the summaries scanned (`summary`, (B, Hkv)) and the always-read pages'
        KV (`always`, (B, Hkv, P) bool), with each candidate page's KV bytes. A head whose summaries and
        always-read pages alone exceed the budget reads no optional page (counted in
        `counters["read_over_budget"]`)."""
        per_token = kv_bytes_per_token(self.keys)
        P_s = cand.shape[-1]
        page_bytes = page_kv_bytes(self.page_len, self.keys)
        dense = self._head_resident * per_token
        left = fraction * dense - summary - (page_bytes * always).sum(-1)
        self.owner.counters["read_over_budget"] += (left < 0).sum()
        return BytesBudget(page_bytes[..., :P_s], left)

    def read_pages(self, query: torch.Tensor, scaling: float) -> torch.Tensor | None:
        """(B, Hkv, P) bool: the pages each KV head reads at this step; None when it reads them all.
        Counts the step's bytes read (`_count_read`)."""
        owner = self.owner
        if owner.retrieval is None or not self.summaries:
            self._count_read(None, None, self._read_t.new_zeros(2))
            return None
        P_s = next(iter(self.summaries.values())).shape[2]  # pages with a summary (closed pages)
        kind = self.page_kind[..., :P_s]
        plen = self.page_len[..., :P_s]
        cand = (plen > 0) & ~self.page_pinned[..., :P_s]
        if owner.config.read_scope == "image":
            cand &= kind == IMAGE
        ctx = DecodeContext(
            layer_idx=self.layer_idx,
            query=query,
            summaries=self.summaries,
            page_start=self.page_start[..., :P_s],
            page_len=plen,
            page_kind=kind,
            candidates=cand,
            scaling=scaling,
            module=self.module,
            step=owner.step,
        )
        summary = torch.where(cand, owner.retrieval.summary_bytes(self.summaries, plen), 0)  # scanned
        B, H, P = self.page_len.shape
        rest = torch.ones(B, H, P - P_s, dtype=torch.bool, device=cand.device)  # the open page
        always = torch.cat([~cand, rest], -1) & (self.page_len > 0)
        budget: float | BytesBudget = owner.config.read_budget
        if owner.config.read_bytes_budget is not None:
            budget = self._bytes_budget(cand, always, summary.sum(-1), owner.config.read_bytes_budget)
        monitor = owner.monitor
        t0 = monitor.clock(query.device) if monitor is not None else 0.0
        chosen = owner.retrieval.select(ctx, budget) & cand
        seconds = monitor.clock(query.device) - t0 if monitor is not None else 0.0
        owner.counters["candidate_pages"] += cand.sum()
        owner.counters["pages_read"] += chosen.sum()
        image = kind == IMAGE
        scanned = torch.stack([(summary * image).sum(), (summary * ~image).sum()])
        picked = chosen
        chosen = torch.cat([chosen, torch.zeros_like(rest)], -1)
        self._count_read(always, chosen, scanned)
        if monitor is not None:  # against exact attention of the newest token
            monitor.record(self.layer_idx, owner.timings["decode_steps"], seconds, query[:, :, -1], self.keys,
                           self.slot_valid, self.slot_page, scaling, cand, picked, chosen | always)  # fmt: skip
        return chosen | always

    def read_mask(self, query: torch.Tensor, scaling: float) -> torch.Tensor | None:
        """(B, Hkv, Q, L) bool: the slots each KV head reads for the Q newest tokens (None: all of them,
        one new token)."""
        return self._slot_mask(self.read_pages(query, scaling), query.shape[2])

    def _slot_mask(self, pages: torch.Tensor | None, q: int) -> torch.Tensor | None:
        """The slots of the pages read (`read_pages`' answer) as `read_mask` gives them."""
        B, H, L = self.slot_valid.shape
        if pages is None and q == 1 and self.all_valid:
            return None
        slots = self.slot_valid
        if pages is not None:
            slots = slots & pages.gather(-1, self.slot_page.clamp(min=0))
        if q == 1:
            return slots.unsqueeze(2)
        mask = slots.unsqueeze(2).expand(B, H, q, L).clone()
        # the q newest slots: causal among themselves
        mask[..., L - q :] &= torch.ones(q, q, dtype=torch.bool, device=slots.device).tril()
        return mask

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Exact attention of `query` (B, Hq, Q, D) over the slots read; returns (B, Q, Hq, D).
        One token on the kernel path (CUDA by default): mm_oval.kernels.sparse_paged_decode over the pages
        read; otherwise SDPA, over the pages read gathered (`_attend_gathered`) when they are a small share
        of the cache, else over every slot with a per-head mask."""
        B, Hq, q, D = query.shape
        H = self.keys.shape[1]
        G = Hq // H
        pages = self.read_pages(query, scaling)  # (B, H, P) bool or None (every page)
        if q == 1 and self.owner.use_kernels(query):
            read = (self.page_len > 0) if pages is None else pages
            P = read.shape[-1]
            page_idx = torch.where(read, torch.arange(P, device=read.device), -1)
            cfg = self.owner.config
            out, _ = kernels.sparse_paged_decode(
                query[:, :, 0],
                self.keys,
                self.values,
                self.page_start,
                self.page_len,
                page_idx,
                scale=scaling,
                max_page_len=cfg.max_page_len,
            )
            return out.unsqueeze(1)
        # GQA without repeating keys: the G query heads of a KV head become G * q rows
        qg = query.reshape(B, H, G * q, D)
        if q == 1 and pages is not None:
            # the most pages a KV head reads and the longest page read: the gathered width is their product;
            # a sparse step attends over the pages read only
            n_pages, longest = torch.stack([pages.sum(-1).max(), (self.page_len * pages).max()]).tolist()
            if 0 < n_pages * longest <= GATHER_SHARE * self.keys.shape[2]:
                out = self._attend_gathered(qg, pages, n_pages, max(longest, 1), scaling)
                return out.reshape(B, Hq, q, D).transpose(1, 2).contiguous()
        mask = self._slot_mask(pages, q)  # (B, H, q, L) or None
        mg = (
            None
            if mask is None
            else mask.unsqueeze(2).expand(B, H, G, q, mask.shape[-1]).reshape(B, H, G * q, -1)
        )
        out = F.scaled_dot_product_attention(qg, self.keys, self.values, attn_mask=mg, scale=scaling)
        return out.reshape(B, Hq, q, D).transpose(1, 2).contiguous()

    def _attend_gathered(
        self, qg: torch.Tensor, pages: torch.Tensor, width: int, block: int, scaling: float
    ) -> torch.Tensor:
        """SDPA of `qg` (B, H, G, D) over the pages `pages` (B, H, P) bool only: each KV head's read pages,
        in page order, copied as blocks of `block` slots (the longest page read) into (B, H, width * block,
        D) in the storage dtype, `width` the most pages a head reads; the rows past a page's slots, a
        head's padding blocks and empty slots are masked. The same attention as the masked SDPA over every
        slot (a page's slots are the run page_start .. page_start + page_len of its head's storage); a
        decode step that reads a small share of the cache moves only that share, one copy per page, and
        builds nothing the size of the cache (off the kernel path). The KV heads go a few at a time (their
        gathered keys and values about GATHER_CHUNK_BYTES), each group's SDPA reading its blocks while the
        copy left them in the CPU's cache, through a buffer the cache's layers share
        (`PagedMultimodalCache.scratch`), allocated once rather than at every step and layer."""
        B, H, P = pages.shape
        cap, D = self._k.shape[2], self._k.shape[3]
        dev = pages.device
        # each head's read pages in page order, as columns 0 .. width-1; the other pages go to column width
        col = torch.where(pages, pages.cumsum(-1) - 1, width)
        start = torch.zeros(B, H, width + 1, dtype=torch.long, device=dev)
        length = torch.zeros_like(start)
        start.scatter_(-1, col, self.page_start)
        length.scatter_(-1, col, self.page_len * pages)  # padding columns: no slot
        # the first row of each block in the flat storage (B * H * cap rows); a block that would run past
        # the storage's end starts earlier, its page's slots `shift` rows into it
        n_rows = B * H * cap
        head = torch.arange(B * H, device=dev).view(B, H, 1) * cap
        first = (head + start[..., :width]).reshape(-1)
        row0 = first.clamp(max=n_rows - block)
        shift = (first - row0).view(-1, 1)
        length = length[..., :width].reshape(-1, 1)
        t = torch.arange(block, device=dev)
        valid_windows = self._valid.view(n_rows).as_strided((n_rows - block + 1, block), (1, 1))
        valid = torch.index_select(valid_windows, 0, row0) & (t >= shift) & (t < shift + length)
        valid = valid.view(B * H, 1, 1, width * block)
        # blocks copied as 8-byte words where a slot's row divides evenly (fewer, wider items copy faster);
        # the blocks are overlapping windows of the storage, one per slot, of which index_select takes some
        word = torch.int64 if (D * self._k.element_size()) % 8 == 0 else self._k.dtype
        windows = []
        for store in (self._k, self._v):
            flat = store.view(n_rows, D).view(word)
            w = flat.shape[1]
            windows.append(flat.as_strided((n_rows - block + 1, block * w), (w, 1)))
        # a few KV heads at a time, so that SDPA reads the blocks while the copy left them in cache
        heads = B * H
        per_head = 2 * width * block * D * self._k.element_size()
        c = max(1, min(heads, GATHER_CHUNK_BYTES // per_head))
        buf = self.owner.scratch(2 * c * width * block * D, self._k.dtype, dev).view(2, c, width * block, D)
        qf = qg.reshape(heads, 1, qg.shape[2], D)
        out = qf.new_empty(qf.shape)
        rows = row0.view(heads, width)
        for a in range(0, heads, c):
            b = min(heads, a + c)
            idx = rows[a:b].reshape(-1)
            k, v = buf[0, : b - a], buf[1, : b - a]
            torch.index_select(windows[0], 0, idx, out=k.view(word).view(idx.numel(), -1))
            torch.index_select(windows[1], 0, idx, out=v.view(word).view(idx.numel(), -1))
            out[a:b] = F.scaled_dot_product_attention(
                qf[a:b], k.unsqueeze(1), v.unsqueeze(1), attn_mask=valid[a:b], scale=scaling
            )
        return out.view(qg.shape)


class PagedMultimodalCache(Cache):
    """The cache of one request (batch), serving the policies of its model's wrap. Built by the wrapped
    model's `generate`; build one yourself with `mm_oval.wrapper.new_cache` / `new_request` / `prefill`
    (e.g. for a multi-turn session)."""

    def __init__(
        self,
        text_config: Any,
        config: OvalConfig,
        eviction: EvictionPolicy | None = None,
        retrieval: RetrievalPolicy | None = None,
    ):
        n_layers = text_config.num_hidden_layers
        super().__init__(layers=[PagedLayer(self, i) for i in range(n_layers)])
        self.config = config
        if (eviction is None and config.method != "full") or (retrieval is None and config.retrieval):
            raise ConfigError(  # the policies are the wrap's, built once (mm_oval.wrapper.make_policies)
                "a cache serves its wrapped model's policies: build it with mm_oval.wrapper.new_cache(model)"
            )
        check_policy(eviction, config.head_budget)  # a budget shared by the heads needs comparable scores
        self.eviction = eviction
        self.retrieval = retrieval
        self.info: RequestInfo | None = None
        self.request = RequestState()  # what the request carries from layer to layer, step to step
        self.step = StepState()  # the forward now running (prefill or a decode step)
        self.geometry: Geometry | None = None  # the request's image geometry, when prepared with one
        self.rope: Rope | None = None  # the text model's RoPE, set by the wrapped model before prefill
        # tensors once counted; read_over_budget: (KV head, step, layer) triples whose summaries and
        # always-read pages alone exceed the bytes budget (they read no optional page)
        self.counters: dict[str, Any] = {"candidate_pages": 0, "pages_read": 0, "read_over_budget": 0}
        self.kernels: bool | None = None  # decode through mm_oval.kernels; None = on CUDA only
        self._scratch: torch.Tensor | None = None  # PagedLayer._attend_gathered's buffer
        self.timings = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0}
        # retrieval against exact attention, per decode step and layer (stats' retrieval_monitor)
        self.monitor = RetrievalMonitor() if config.monitor_retrieval else None

    def scratch(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat buffer of at least `numel` entries, shared by the layers' decode steps (one layer at a
        time uses it) and grown when a step needs more; what it holds does not outlive the step."""
        buf = self._scratch
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = self._scratch = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]

    def use_kernels(self, query: torch.Tensor) -> bool:
        return query.is_cuda if self.kernels is None else self.kernels

    def prepare(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        image_token_id: int | None = None,
        tokens_per_image: int = 0,
        geometry: Geometry | None = None,
    ) -> None:
        """Ready the cache for one request: the image tokens and their (grid, row, col) from `geometry`
        (mm_oval.geometry.image_geometry), or from `image_token_id` and `tokens_per_image` (LLaVA-1.5)."""
        if self.get_seq_length() != 0:
            raise ConfigError(
                "this cache already holds a request; build a new one (or cache.copy()) per request"
            )
        self.info = request_info(
            input_ids,
            attention_mask,
            image_token_id,
            tokens_per_image,
            self.config.sink_tokens,
            self.config.recent_tokens,
            geometry,
        )
        self.geometry = geometry

    def copy(self) -> PagedMultimodalCache:
        """An independent copy (e.g. to ask several questions about one compressed image)."""
        # share what is not per-request state: the model's modules and the policies
        memo: dict[int, Any] = {id(self.eviction): self.eviction, id(self.retrieval): self.retrieval}
        if self._scratch is not None:  # a step's buffer: the copy makes its own when it needs one
            memo[id(self._scratch)] = None
        for layer in self.layers:
            m = getattr(layer, "module", None)
            if m is not None:
                memo[id(m)] = m
        return copy.deepcopy(self, memo)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise ConfigError("beam search is not supported by mm-oval's cache; use greedy or sampling")
