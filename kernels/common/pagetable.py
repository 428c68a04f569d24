"""Page-table helpers: build runs from per-head lengths, pack ragged selections, expand a selection
to the tokens it covers. Layout: docs/kernels.md (page j of head (b, h) is the run
page_start[b, h, j] .. page_start[b, h, j] + page_len[b, h, j] - 1 of that head's token storage)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mm_oval.errors import ConfigError


def paginate(
    lengths: torch.Tensor, page_size: int, num_pages: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed-size pages over each head's valid tokens: lengths (B, H) -> page_start, page_len
    (B, H, P) int32, P = ceil(max length / page_size) unless given; the last page of a head may be
    short (the open page), unused slots have length 0."""
    if page_size < 1:
        raise ConfigError(f"page_size must be >= 1, got {page_size}")
    lengths = lengths.long()
    if lengths.numel() and int(lengths.min()) < 0:
        raise ConfigError("token lengths must be >= 0")
    longest = int(lengths.max()) if lengths.numel() else 0
    P = -(-longest // page_size) if num_pages is None else num_pages
    if P * page_size < longest:
        raise ConfigError(f"{P} pages of {page_size} tokens cannot hold {longest} tokens; raise num_pages")
    j = torch.arange(P, device=lengths.device)
    start = (j * page_size).expand(*lengths.shape, P)
    length = (lengths[..., None] - start).clamp(0, page_size)
    start = torch.where(length > 0, start, torch.zeros_like(start))
    return start.to(torch.int32).contiguous(), length.to(torch.int32).contiguous()


def pad_selection(
    lists: Sequence[Sequence[Sequence[int]]], width: int | None = None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Ragged page lists per (batch, head) -> (B, H, width) int32 with -1 padding."""
    B = len(lists)
    H = len(lists[0]) if B else 0
    if any(len(row) != H for row in lists):
        raise ConfigError("every batch entry must list the same number of heads")
    longest = max((len(sel) for row in lists for sel in row), default=0)
    W = longest if width is None else width
    if longest > W:
        raise ConfigError(f"a head selects {longest} pages, more than width {W}")
    out = torch.full((B, H, W), -1, dtype=torch.int32)
    for b, row in enumerate(lists):
        for h, sel in enumerate(row):
            if len(sel):
                out[b, h, : len(sel)] = torch.as_tensor(list(sel), dtype=torch.int32)
    return out.to(device)


def _selected_runs(
    page_start: torch.Tensor, page_len: torch.Tensor, page_idx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    idx = page_idx.long()
    if page_start.shape[-1] == 0:  # no pages at all: every entry selects nothing
        zero = torch.zeros_like(idx)
        return zero, zero
    ok = (idx >= 0) & (idx < page_start.shape[-1])
    safe = torch.where(ok, idx, torch.zeros_like(idx))
    start = torch.gather(page_start.long(), -1, safe)
    length = torch.where(ok, torch.gather(page_len.long(), -1, safe), torch.zeros_like(safe))
    return start, length.clamp_min(0)


def selected_token_mask(
    page_start: torch.Tensor, page_len: torch.Tensor, page_idx: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """(B, H, num_tokens) bool: the tokens of the selected pages (-1 entries select nothing)."""
    start, length = _selected_runs(page_start, page_len, page_idx)
    start = start.clamp(0, num_tokens)
    end = (start + length).clamp(0, num_tokens)
    delta = torch.zeros((*page_idx.shape[:-1], num_tokens + 1), dtype=torch.long, device=page_idx.device)
    delta.scatter_add_(-1, start, torch.ones_like(start))
    delta.scatter_add_(-1, end, -torch.ones_like(end))
    return delta.cumsum(-1)[..., :num_tokens] > 0


def selected_token_count(page_len: torch.Tensor, page_idx: torch.Tensor) -> torch.Tensor:
    """(B, H) number of tokens the selection reads (pages counted as often as they are listed)."""
    _, length = _selected_runs(torch.zeros_like(page_len), page_len, page_idx)
    return length.sum(-1)
