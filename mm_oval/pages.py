"""Page layout of the kept tokens of one layer: image pages are 2-D patch tiles, text pages runs of
consecutive kept text tokens. Everything is vectorised over (batch, KV head).

The storage of each (b, h) is page-major: the tokens of page 0 (in position order), then page 1, ...
Pages are ordered by their first position, so image tiles sit where their image sits in the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .core import IMAGE, PAD, TEXT


@dataclass
class Layout:
    """Where each kept token goes. L = slots per head (the longest head), P = pages per head (the most)."""

    src: torch.Tensor  # (B, Hkv, L) long: prompt index of the token in each slot, -1 for an empty slot
    slot_page: torch.Tensor  # (B, Hkv, L) long: page of each slot, -1 for an empty slot
    page_start: torch.Tensor  # (B, Hkv, P) long
    page_len: torch.Tensor  # (B, Hkv, P) long, 0 for an empty page slot
    page_kind: torch.Tensor  # (B, Hkv, P) int8: TEXT, IMAGE or PAD
    page_pinned: torch.Tensor  # (B, Hkv, P) bool: holds a sink or recent token (always read)


def layout_pages(
    keep: torch.Tensor,
    modality: torch.Tensor,
    positions: torch.Tensor,
    image_rc: torch.Tensor,
    protected: torch.Tensor,
    image_tile: int,
    text_page_size: int,
) -> Layout:
    """keep (B, Hkv, N) bool; modality/positions/protected (B, N); image_rc (B, N, 3)."""
    B, H, N = keep.shape
    device = keep.device
    mod = modality.unsqueeze(1).expand(B, H, N)
    is_img = keep & (mod == IMAGE)
    is_txt = keep & (mod == TEXT)

    # text pages: every `text_page_size` kept text tokens, in position order (storage order is position order)
    text_ord = is_txt.long().cumsum(-1) - 1
    n_text_labels = -(-N // text_page_size)
    label = torch.where(is_txt, text_ord // text_page_size, torch.full_like(text_ord, -1))

    # image pages: tiles of image_tile x image_tile patches of one image
    rc = image_rc.unsqueeze(1).expand(B, H, N, 3)
    if bool(is_img.any()):
        max_rc = image_rc.clamp(min=0).amax(dim=(0, 1))  # (3,)
        tiles_r = int(max_rc[1]) // image_tile + 1
        tiles_c = int(max_rc[2]) // image_tile + 1
        tile = (rc[..., 0] * tiles_r + rc[..., 1] // image_tile) * tiles_c + rc[..., 2] // image_tile
        label = torch.where(is_img, n_text_labels + tile, label)
        n_labels = n_text_labels + (int(max_rc[0]) + 1) * tiles_r * tiles_c
    else:
        n_labels = n_text_labels

    kept = label >= 0
    safe_label = label.clamp(min=0)
    big = torch.iinfo(torch.long).max
    pos = positions.unsqueeze(1).expand(B, H, N).long()
    first_pos = torch.full((B, H, n_labels), big, dtype=torch.long, device=device)
    first_pos.scatter_reduce_(-1, safe_label, torch.where(kept, pos, big), reduce="amin")
    present = first_pos < big
    # page rank of each label: labels ordered by first position; absent labels last
    order = first_pos.argsort(dim=-1, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(n_labels, device=device).expand_as(order))
    n_pages = present.sum(-1)  # (B, H)
    P = max(int(n_pages.max()) if n_pages.numel() else 0, 1)

    tok_page = torch.where(kept, rank.gather(-1, safe_label), torch.full_like(label, -1))
    # storage order: by page, then by position
    key = torch.where(kept, tok_page * (int(pos.max().clamp(min=0)) + 1 + 1) + pos, big)
    n_kept = kept.sum(-1)
    L = max(int(n_kept.max()) if n_kept.numel() else 0, 1)
    src = key.argsort(dim=-1, stable=True)[..., :L]
    slot_ok = torch.arange(L, device=device) < n_kept.unsqueeze(-1)
    src = torch.where(slot_ok, src, torch.full_like(src, -1))
    slot_page = torch.where(slot_ok, tok_page.gather(-1, src.clamp(min=0)), torch.full_like(src, -1))

    page_len = torch.zeros((B, H, P), dtype=torch.long, device=device)
    page_len.scatter_add_(-1, slot_page.clamp(min=0), slot_ok.long())
    page_start = page_len.cumsum(-1) - page_len
    page_kind = torch.full((B, H, P), PAD, dtype=torch.int8, device=device)
    kind_tok = torch.where(kept, mod.long(), torch.full_like(label, -2))
    kind_page = torch.full((B, H, P), -2, dtype=torch.long, device=device)
    kind_page.scatter_reduce_(-1, tok_page.clamp(min=0), kind_tok, reduce="amax")
    page_kind = torch.where(kind_page >= 0, kind_page, torch.full_like(kind_page, PAD)).to(torch.int8)
    prot = (protected.unsqueeze(1).expand(B, H, N) & kept).long()
    pinned = torch.zeros((B, H, P), dtype=torch.long, device=device)
    pinned.scatter_reduce_(-1, tok_page.clamp(min=0), prot, reduce="amax")
    return Layout(src, slot_page, page_start, page_len, page_kind, pinned.bool())


def gather_pages(
    keys: torch.Tensor,
    values: torch.Tensor,
    page_start: torch.Tensor,
    page_len: torch.Tensor,
    pages: slice,
    slot_src: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Pad the pages `pages` of every (b, h) into (B, Hkv, P, T, D) keys/values, a (B, Hkv, P, T) mask and,
    when `slot_src` (B, Hkv, L) is given, the prompt index of each page token (-1 past a page's length)."""
    start = page_start[..., pages]
    length = page_len[..., pages]
    T = max(int(length.max()) if length.numel() else 0, 1)
    offs = torch.arange(T, device=keys.device)
    mask = offs < length.unsqueeze(-1)  # (B, H, P, T)
    idx = (start.unsqueeze(-1) + offs).clamp(max=keys.shape[2] - 1)
    idx = torch.where(mask, idx, torch.zeros_like(idx))
    B, H, P, _ = idx.shape
    D = keys.shape[-1]
    flat = idx.reshape(B, H, P * T, 1).expand(B, H, P * T, D)
    k = keys.gather(2, flat).reshape(B, H, P, T, D) * mask.unsqueeze(-1)
    v = values.gather(2, flat).reshape(B, H, P, T, D) * mask.unsqueeze(-1)
    src = None
    if slot_src is not None:
        src = slot_src.gather(2, idx.reshape(B, H, P * T)).reshape(B, H, P, T).masked_fill(~mask, -1)
    return k, v, mask, src
