"""Compaction after eviction: the kept tokens of each head gathered into contiguous storage
(kernel.py: Triton; naive.py: the reference)."""

from __future__ import annotations

import torch
from mm_oval.kernels.common.dispatch import HAS_TRITON, backend, check

from . import naive

if HAS_TRITON:
    from .kernel import compact_kv_triton


def compact_kv(
    k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, capacity: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather the kept tokens of each head: index (B, H, M), -1 pads -> (B, H, capacity or M, D) each;
    slots past M or with -1 are 0."""
    what = "compact_kv"
    check(k.dim() == 4 and v.shape == k.shape, f"{what}: k and v must both be (B, H, N, D)")
    check(index.dim() == 3 and index.shape[:2] == k.shape[:2], f"{what}: index must be (B, H, M)")
    check(
        capacity is None or capacity >= index.shape[-1],
        f"{what}: capacity {capacity} < {index.shape[-1]} kept tokens",
    )
    fn = compact_kv_triton if backend(k) == "triton" else naive.compact_kv_naive
    return fn(k, v, index, capacity)
