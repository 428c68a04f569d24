"""`PagedLayer`: one decoder layer of a `PagedMultimodalCache`, transformers' `CacheLayerMixin` over the
layer's parts: its storage (`PageStore`), its page summaries, its counts (`ReadTelemetry`). The prefill
pipeline (`prefill.finish_prefill`) builds them; a decode step reads through `decode`."""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import CacheLayerMixin

from ..errors import ConfigError
from . import decode, prefill, summaries

if TYPE_CHECKING:
    from .multimodal import PagedMultimodalCache

# the layer whose `update` just ran; its attention function picks it up (same module, same forward)
_PENDING: contextvars.ContextVar[PagedLayer | None] = contextvars.ContextVar("mm_oval_pending", default=None)


def take_pending(layer_idx: int | None) -> PagedLayer | None:
    layer = _PENDING.get()
    if layer is None or layer.layer_idx != layer_idx:
        return None
    _PENDING.set(None)
    return layer


# what the layer reads as its own from its storage once prefill finished (slot and page tables, views)
STORE_VIEWS = (
    "slot_valid", "slot_page", "page_start", "page_len", "page_kind", "page_pinned",
    "slot_pos", "slot_mod", "slot_src", "slot_rc", "prompt_slots", "prompt_pages", "n_decode", "all_valid",
)  # fmt: skip


class PagedLayer(CacheLayerMixin):
    """One decoder layer's kept tokens, per KV head, page-major (layout of docs/kernels.md). Before its
    prefill finishes `keys` / `values` are the prompt's as the model stored them; after, views of `store`."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, owner: PagedMultimodalCache, layer_idx: int):
        self.store: Any = None  # PageStore, from the end of prefill
        self.telemetry: Any = None  # ReadTelemetry, from the end of prefill
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        # with unread_pages, each closed page's values' mean ("v") and, where the retrieval record holds no key
        # mean, its keys' ("k"): summaries.py
        self.page_means: dict[str, torch.Tensor] = {}
        # unread_pages="scored": the prompt's last queries (times the scaling) that weigh the values' means
        self.value_query: torch.Tensor | None = None
        self.phase = "empty"  # empty -> prefill (full prompt stored) -> decode (compressed + appended)
        self.logical_len = 0

    @property
    def keys(self) -> Any:
        return self.store.keys if self.store is not None else self._keys

    @keys.setter
    def keys(self, value: Any) -> None:
        self._keys = value

    @property
    def values(self) -> Any:
        return self.store.values if self.store is not None else self._values

    @values.setter
    def values(self, value: Any) -> None:
        self._values = value

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
        self.keys = self.values = self.store = self.telemetry = self.value_query = None
        self.page_means = {}
        self.phase = "empty"
        self.logical_len = 0
        self.is_initialized = False

    # ---- prefill ---------------------------------------------------------------------------------------
    def finish_prefill(self, query: torch.Tensor, module: Any, scaling: float) -> None:
        """Score, keep, page, compact and summarise the prompt (`prefill.finish_prefill`)."""
        prefill.finish_prefill(self, query, module, scaling)

    def _summarize(self, first: int, stop: int) -> None:
        summaries.summarize(self, first, stop)

    @property
    def stats(self) -> dict[str, Any]:
        """Tokens and bytes kept for the prompt, by modality (`ReadTelemetry.layer_stats`); {} before."""
        return {} if self.telemetry is None else self.telemetry.layer_stats(self.store, self.layer_idx)

    # ---- decode ------------------------------------------------------------------------------------
    def _append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        new_valid = self.owner.step.new_valid  # (B, q) bool when the new tokens hold padding
        if new_valid is not None and new_valid.shape != (k.shape[0], k.shape[2]):
            new_valid = None
        closed_before, closed_now = self.store.append(k, v, new_valid)
        self.telemetry.on_append(new_valid, k.shape[0], k.shape[1], k.shape[2])
        self.logical_len += k.shape[2]
        if self.owner.retrieval is not None and closed_now > closed_before:
            P0 = self.store.prompt_pages
            self._summarize(P0 + closed_before, P0 + closed_now)

    def read_pages(self, query: torch.Tensor, scaling: float) -> torch.Tensor | None:
        """(B, Hkv, P) bool: the pages each KV head reads at this step; None when it reads them all."""
        return decode.read_pages(self, query, scaling)

    def read_mask(self, query: torch.Tensor, scaling: float) -> torch.Tensor | None:
        """(B, Hkv, Q, L) bool: the slots each KV head reads for the Q newest tokens (None: all of them,
        one new token)."""
        return decode.slot_mask(self.store, self.read_pages(query, scaling), query.shape[2])

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Exact attention of `query` (B, Hq, Q, D) over the slots read; returns (B, Q, Hq, D), by the
        request's decode backend (`decode.choose_backend`)."""
        pages = self.read_pages(query, scaling)  # (B, H, P) bool or None (every page)
        backend = self.owner.decode_backend(query)
        if pages is not None and self.page_means and query.shape[2] == 1:  # unread_pages: the estimate
            out, lse = backend.attend_lse(self, query, pages, scaling)
            return decode.add_unread_pages(self, query, pages, scaling, out, lse)
        return backend.attend(self, query, pages, scaling)


def _store_view(name: str) -> property:
    return property(lambda self: getattr(self.store, name), doc=f"the storage's `{name}` (`PageStore`)")


for _name in STORE_VIEWS:
    setattr(PagedLayer, _name, _store_view(_name))
