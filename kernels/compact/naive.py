"""Compaction, the PyTorch reference: gather the kept tokens of each head into contiguous storage."""

from __future__ import annotations

import torch


def compact_kv_naive(
    k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, capacity: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v (B, H, N, D); index (B, H, M) token indices per head, -1 pads ->
    (B, H, capacity or M, D) each, the gathered tokens; slots past M or with -1 are 0."""
    B, H, _, D = k.shape
    M = index.shape[-1]
    C = M if capacity is None else capacity
    idx = index.long()
    ok = idx >= 0
    g = idx.clamp_min(0)[..., None].expand(B, H, M, D)
    outs = []
    for x in (k, v):
        y = torch.zeros((B, H, C, D), dtype=x.dtype, device=x.device)
        y[:, :, :M] = torch.where(ok[..., None], torch.gather(x, 2, g), torch.zeros((), dtype=x.dtype))
        outs.append(y)
    return outs[0], outs[1]
