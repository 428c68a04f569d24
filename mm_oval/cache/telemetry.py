"""What a layer's cache measures about itself, kept beside its storage rather than in it: the prompt's
tokens and bytes kept, the bytes each decode step reads (summaries scanned, selected and always-read pages'
KV, against dense attention over the resident slots) and the retrieval monitor's per-step records.
`mm_oval.stats` turns these into the request's figures (`cache_stats`, `bytes_read`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..core import IMAGE, TEXT

# what a decode step reads, the rows of `ReadTelemetry.read_t` (see mm_oval.stats, `bytes_read`)
READ_KINDS = ("summaries", "selected", "always_read", "dense")


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


@dataclass(eq=False)
class ReadTelemetry:
    """One layer's counts, as tensors (no device sync per step; `stats` turns them into numbers when read)."""

    prefill: dict[str, torch.Tensor]  # the prompt's tokens, full and kept, by modality; its pages
    p_image: torch.Tensor  # (B, Hkv, L0) bool: image slots (all in the prompt part)
    # per prompt page: its valid slots and whether they are image slots (a page holds one modality), so a
    # step's bytes read over the prompt are counted per page, not per slot
    p_count: torch.Tensor  # (B, Hkv, P0) long
    p_page_image: torch.Tensor  # (B, Hkv, P0) bool
    # bytes read at decode, summed over steps: rows READ_KINDS; columns image, text
    read_t: torch.Tensor
    # the part of read_t read by forwards of several tokens (a later turn fed at once), the same layout
    chunk_t: Any = None
    # resident (valid) slots, image and text, kept up to date as decode appends tokens: what dense
    # attention reads each step, without a pass over the slot table per step
    resident: Any = None
    head_resident: Any = None  # (B, Hkv): the same per KV head, image and text

    @classmethod
    def start(cls, store: Any, info: Any, lay: Any) -> ReadTelemetry:
        """The counts of a layer whose prefill just laid out `store` (from `lay`, for the prompt `info`)."""
        keys = store.keys
        B, H = keys.shape[:2]
        mod = store.p_mod
        prefill = {
            "image_full": (info.modality == IMAGE).sum(),
            "text_full": (info.modality == TEXT).sum(),
            "image_kept": (mod == IMAGE).sum(),
            "text_kept": (mod == TEXT).sum(),
            "pages": (store.page_len > 0).sum(),
        }
        p_count = torch.zeros(B, H, store.prompt_pages, dtype=torch.long, device=keys.device)
        p_count.scatter_add_(-1, lay.slot_page.clamp(min=0), (lay.src >= 0).long())
        read_t = torch.zeros(len(READ_KINDS), 2, dtype=torch.long, device=keys.device)
        t = cls(prefill, mod == IMAGE, p_count, lay.page_kind == IMAGE, read_t, torch.zeros_like(read_t))
        t.resident = t.by_modality(store, store.slot_valid)
        t.head_resident = store.slot_valid.sum(-1)
        return t

    def on_append(self, new_valid: torch.Tensor | None, B: int, H: int, q: int) -> None:
        """`q` tokens appended to every head (`new_valid` (B, q): which are not padding; None: all)."""
        if new_valid is not None:
            self.resident[1] += new_valid.sum() * H  # generated tokens are text
            self.head_resident += new_valid.sum(-1, keepdim=True)
        else:
            self.resident[1] += B * H * q
            self.head_resident += q

    def by_modality(self, store: Any, slots: torch.Tensor) -> torch.Tensor:
        """(B, Hkv, L) bool slots -> (2,) long: how many are image slots, how many text."""
        image = (slots[..., : store.prompt_slots] & self.p_image).sum()
        return torch.stack([image, slots.sum() - image])

    def pages_by_modality(self, store: Any, pages: torch.Tensor) -> torch.Tensor:
        """(B, Hkv, P) bool pages -> (2,) long: the valid slots of those pages, image and text (as
        `by_modality` of their slots): prompt pages counted per page, decode slots (text) per slot."""
        P0, L0 = store.prompt_pages, store.prompt_slots
        prompt = pages[..., :P0] * self.p_count
        image = (prompt * self.p_page_image).sum()
        dec = store.slot_valid[..., L0:] & pages.gather(-1, store.slot_page[..., L0:].clamp(min=0))
        return torch.stack([image, prompt.sum() - image + dec.sum()])

    def count_read(
        self,
        store: Any,
        always: torch.Tensor | None,
        chosen: torch.Tensor | None,
        summary: torch.Tensor,
        several: bool = False,
    ) -> None:
        """Adds one decode step's bytes read to `read_t`: `always` / `chosen` (B, Hkv, P) bool pages read
        whatever the selection / selected by the retrieval policy (None, None: every slot is read),
        `summary` (2,) the summary bytes scanned, image and text; `several`: the step fed several tokens
        (a later turn), also added to `chunk_t`."""
        per_token = kv_bytes_per_token(store.keys)
        dense = self.resident
        if always is None:
            read_always, selected = dense, torch.zeros_like(dense)
        else:
            read_always = self.pages_by_modality(store, always)
            selected = self.pages_by_modality(store, chosen)
        step = torch.stack([summary, selected * per_token, read_always * per_token, dense * per_token])
        self.read_t += step
        if several:
            self.chunk_t += step

    def layer_stats(self, store: Any, layer_idx: int) -> dict[str, Any]:
        """Tokens and bytes kept for the prompt, by modality: tokens summed over the batch and averaged over
        KV heads, bytes exact (keys + values of every head). `bytes_allocated`: the key and value storage
        as allocated (every head padded to the longest one, and the decode slots, used or not)."""
        t = self.prefill
        B, H, L, D = store.keys.shape
        per_token = 2 * D * store.keys.element_size()  # keys + values, one KV head
        out: dict[str, Any] = {"layer": layer_idx}
        for name in ("image", "text"):
            full, kept = int(t[f"{name}_full"]) * H, int(t[f"{name}_kept"])
            out[f"{name}_tokens_full"] = full / H
            out[f"{name}_tokens_kept"] = kept / H
            out[f"{name}_bytes_full"] = full * per_token
            out[f"{name}_bytes_kept"] = kept * per_token
        out["bytes_allocated"] = sum(t.untyped_storage().nbytes() for t in (store.k, store.v))
        out["pages"] = int(t["pages"]) / H
        return out
