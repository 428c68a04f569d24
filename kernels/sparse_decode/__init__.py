"""Sparse paged decode attention: one decode query per sequence over the selected pages of each KV
head (kernel.py: Triton; naive.py: the reference), and the merge of two partial results."""

from __future__ import annotations

import torch
from mm_oval.kernels.common.dispatch import HAS_TRITON, backend, check, check_gqa

from . import naive

if HAS_TRITON:
    from .kernel import sparse_paged_decode_triton


def sparse_paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_start: torch.Tensor,
    page_len: torch.Tensor,
    page_idx: torch.Tensor,
    scale: float | None = None,
    num_splits: int | None = None,
    max_page_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over the selected pages of each KV head -> (out (B, Hq, D), lse (B, Hq) fp32).
    Layout: docs/kernels.md. `page_idx` entries of a head must be distinct.
    Pass `max_page_len` (>= every page_len, e.g. the cache's page capacity) to spare a device sync."""
    what = "sparse_paged_decode"
    check(
        k_cache.dim() == 4 and v_cache.shape == k_cache.shape,
        f"{what}: k_cache and v_cache must both be (B, Hkv, N, D)",
    )
    check_gqa(q, k_cache.shape[1], what)
    B, Hkv = k_cache.shape[:2]
    check(
        q.shape[0] == B and q.shape[2] == k_cache.shape[3],
        f"{what}: q {tuple(q.shape)} does not match the cache {tuple(k_cache.shape)}",
    )
    check(
        page_start.shape == page_len.shape and page_start.shape[:2] == (B, Hkv),
        f"{what}: page_start and page_len must both be (B, Hkv, P) = ({B}, {Hkv}, P)",
    )
    check(page_idx.dim() == 3 and page_idx.shape[:2] == (B, Hkv), f"{what}: page_idx must be (B, Hkv, S)")
    check(num_splits is None or num_splits >= 1, f"{what}: num_splits must be >= 1")
    fn = sparse_paged_decode_triton if backend(q, k_cache) == "triton" else naive.sparse_paged_decode_naive
    return fn(q, k_cache, v_cache, page_start, page_len, page_idx, scale, num_splits, max_page_len)


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint tokens (a few element-wise ops: torch on every
    device)."""
    check(
        out_a.shape == out_b.shape and lse_a.shape == lse_b.shape,
        "merge_attention: shapes of the two parts differ",
    )
    return naive.merge_attention(out_a, lse_a, out_b, lse_b)
