"""One layer's kept tokens, per KV head, page-major (layout of docs/kernels.md): the slot storage with
room to grow, the page table, and the compaction of the prompt's kept tokens into it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import kernels
from ..core import PAD, TEXT

# decode slots allocated after prefill (rounded up to whole text pages; doubled each time they fill up)
DECODE_ROOM = 64


def decode_room(text_page_size: int) -> int:
    """Decode slots allocated after prefill: DECODE_ROOM rounded up to a multiple of the text page size."""
    return -(-DECODE_ROOM // text_page_size) * text_page_size


@dataclass(eq=False)
class PageStore:
    """Keys and values of one layer's kept tokens, per KV head, in slots of a storage with room to grow
    (decode writes in place), with the page table over them. `keys`, `values` and the slot and page tables
    (`slot_valid`, `slot_page`, `page_start`, `page_len`, `page_kind`, `page_pinned`) are views of the used
    part; `k`, `v` etc. the whole storage."""

    text_page_size: int
    prompt_slots: int  # L0: slots of the prompt's kept tokens (every head padded to the longest)
    prompt_pages: int  # P0: pages of the prompt
    # per prompt slot: original position, modality, prompt index, (image, row, col); decode slots are all
    # valid text at consecutive positions from `first_pos`
    p_pos: torch.Tensor  # (B, Hkv, L0) long, -1 for an empty slot
    p_mod: torch.Tensor  # (B, Hkv, L0) int8
    p_src: torch.Tensor  # (B, Hkv, L0) long, -1 for an empty slot
    p_rc: torch.Tensor  # (B, Hkv, L0, 3) long
    first_pos: torch.Tensor  # (B,) position of the first decode token, per sample
    all_valid: bool  # no empty slot: decode may skip the mask
    n_decode: int = 0
    cap: int = 0
    k: Any = None
    v: Any = None
    valid: Any = None
    page: Any = None
    pstart: Any = None
    plen: Any = None
    pkind: Any = None
    ppinned: Any = None

    @classmethod
    def compact(
        cls, keys: torch.Tensor, values: torch.Tensor, lay: Any, info: Any, text_page_size: int
    ) -> PageStore:
        """The storage of the prompt's kept tokens laid out by `lay` (a `pages.layout_pages` answer): each
        KV head's kept keys and values copied to its slots, with their per-slot facts from `info`."""
        B, H, N, D = keys.shape
        src = lay.src.clamp(min=0)
        ok = lay.src >= 0
        exp = lambda t: t.unsqueeze(1).expand(B, H, N)  # noqa: E731
        rc = info.image_rc.unsqueeze(1).expand(B, H, N, 3).gather(2, src.unsqueeze(-1).expand(*src.shape, 3))
        store = cls(
            text_page_size=text_page_size,
            prompt_slots=lay.src.shape[2],
            prompt_pages=lay.page_start.shape[-1],
            p_pos=torch.where(ok, exp(info.positions).gather(-1, src), -1),
            p_mod=torch.where(ok, exp(info.modality.long()).gather(-1, src), PAD).to(torch.int8),
            p_src=lay.src,
            p_rc=torch.where(ok.unsqueeze(-1), rc, -1),
            first_pos=info.next_pos.clone(),
            all_valid=bool(ok.all()),
        )
        L0, P0 = store.prompt_slots, store.prompt_pages
        store.alloc(L0 + decode_room(text_page_size), keys.dtype, keys.device, B, H, D)
        store.k[:, :, :L0], store.v[:, :, :L0] = kernels.compact_kv(
            keys, values, torch.where(ok, lay.src, -1)
        )
        store.valid[..., :L0] = ok
        store.page[..., :L0] = lay.slot_page
        store.pstart[..., :P0], store.plen[..., :P0] = lay.page_start, lay.page_len
        store.pkind[..., :P0], store.ppinned[..., :P0] = lay.page_kind, lay.page_pinned
        store.set_views()
        return store

    def alloc(self, cap: int, dtype: torch.dtype, device: torch.device, B: int, H: int, D: int) -> None:
        """Empty storage of `cap` slots per head; the decode slots' pages follow from their place."""
        S = self.text_page_size
        L0, P0 = self.prompt_slots, self.prompt_pages
        self.cap = cap
        self.k = torch.zeros(B, H, cap, D, dtype=dtype, device=device)
        self.v = torch.zeros(B, H, cap, D, dtype=dtype, device=device)
        self.valid = torch.zeros(B, H, cap, dtype=torch.bool, device=device)
        t = torch.arange(cap - L0, device=device)
        self.page = torch.full((B, H, cap), -1, dtype=torch.long, device=device)
        self.page[..., L0:] = P0 + t // S
        n_dec_pages = -(-(cap - L0) // S)
        pcap = P0 + n_dec_pages
        j = torch.arange(n_dec_pages, device=device)
        self.pstart = torch.zeros(B, H, pcap, dtype=torch.long, device=device)
        self.pstart[..., P0:] = L0 + j * S
        self.plen = torch.zeros(B, H, pcap, dtype=torch.long, device=device)
        self.pkind = torch.full((B, H, pcap), TEXT, dtype=torch.int8, device=device)
        self.ppinned = torch.zeros(B, H, pcap, dtype=torch.bool, device=device)

    def grow(self, need: int) -> None:
        """At least `need` slots per head (the decode slots doubled), what is stored kept."""
        B, H, used, D = self.keys.shape
        P = self.page_len.shape[-1]
        old = (self.k, self.v, self.valid, self.pstart, self.plen, self.pkind, self.ppinned)
        old_page = self.page
        cap = max(need, self.prompt_slots + 2 * (self.cap - self.prompt_slots))
        self.alloc(cap, self.k.dtype, self.k.device, B, H, D)
        self.k[:, :, :used], self.v[:, :, :used] = old[0][:, :, :used], old[1][:, :, :used]
        self.valid[..., :used] = old[2][..., :used]
        # the prompt slots' pages (the decode slots' pages follow from their place, set by alloc)
        self.page[..., : self.prompt_slots] = old_page[..., : self.prompt_slots]
        for new_t, old_t in zip((self.pstart, self.plen, self.pkind, self.ppinned), old[3:]):
            new_t[..., :P] = old_t[..., :P]

    def set_views(self) -> None:
        L = self.prompt_slots + self.n_decode
        P = self.prompt_pages + -(-self.n_decode // self.text_page_size)
        self.keys, self.values = self.k[:, :, :L], self.v[:, :, :L]
        self.slot_valid, self.slot_page = self.valid[..., :L], self.page[..., :L]
        self.page_start, self.page_len = self.pstart[..., :P], self.plen[..., :P]
        self.page_kind, self.page_pinned = self.pkind[..., :P], self.ppinned[..., :P]

    def append(self, k: torch.Tensor, v: torch.Tensor, new_valid: torch.Tensor | None) -> tuple[int, int]:
        """Store `q` new tokens (B, Hkv, q, D) after the last slot (`new_valid` (B, q): which are not padding,
        None: all) -> (closed text pages before, after)."""
        q = k.shape[2]
        S = self.text_page_size
        L = self.prompt_slots + self.n_decode
        if L + q > self.cap:
            self.grow(L + q)
        self.k[:, :, L : L + q] = k
        self.v[:, :, L : L + q] = v
        if new_valid is not None:
            self.valid[..., L : L + q] = new_valid.unsqueeze(1)
            self.all_valid = False
        else:
            self.valid[..., L : L + q] = True
        closed_before = self.n_decode // S
        first_open = self.prompt_pages + closed_before
        self.n_decode += q
        last = self.prompt_pages + -(-self.n_decode // S)
        for j in range(first_open, last):  # the pages these tokens went to (usually one)
            self.plen[..., j] = min(S, self.n_decode - (j - self.prompt_pages) * S)
        self.set_views()
        return closed_before, self.n_decode // S

    def _decode_part(self, prompt: torch.Tensor, fill: torch.Tensor | int) -> torch.Tensor:
        B, H = prompt.shape[:2]
        if isinstance(fill, int):
            fill = torch.full(
                (B, H, self.n_decode, *prompt.shape[3:]), fill, dtype=prompt.dtype, device=prompt.device
            )
        return torch.cat([prompt, fill], dim=2)

    @property
    def slot_pos(self) -> torch.Tensor:  # (B, Hkv, L) original position of each slot, -1 if empty
        B, H = self.p_pos.shape[:2]
        t = self.first_pos.view(B, 1, 1) + torch.arange(self.n_decode, device=self.p_pos.device)
        return self._decode_part(self.p_pos, t.expand(B, H, self.n_decode))

    @property
    def slot_mod(self) -> torch.Tensor:  # (B, Hkv, L) int8 TEXT / IMAGE / PAD (empty)
        return self._decode_part(self.p_mod, TEXT)

    @property
    def slot_src(self) -> torch.Tensor:  # (B, Hkv, L) prompt index of each slot, -1 for empty/generated
        return self._decode_part(self.p_src, -1)

    @property
    def slot_rc(self) -> torch.Tensor:  # (B, Hkv, L, 3) (image, row, col) of image slots, -1 elsewhere
        return self._decode_part(self.p_rc, -1)
