"""Sparse paged decode attention, the PyTorch reference (the definition the Triton kernel is tested
against, and the implementation used off CUDA), and the merge of two partial attention results.
Shapes and layouts: docs/kernels.md. Everything is computed in fp32."""

from __future__ import annotations

import torch
from mm_oval.kernels.common.pagetable import selected_token_mask


def sparse_paged_decode_naive(
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
    """Attention of one decode query per sequence over the selected pages of each KV head.

    q (B, Hq, D); k_cache, v_cache (B, Hkv, N, D); page_start, page_len (B, Hkv, P);
    page_idx (B, Hkv, S), -1 pads. Returns out (B, Hq, D) in q's dtype and lse (B, Hq) fp32
    (natural log-sum-exp of the scaled scores; -inf and out 0 for a head that reads nothing).
    `num_splits` and `max_page_len` (an upper bound of page_len, saving the kernel a device sync)
    only shape the Triton kernel's work; the result does not depend on them.
    """
    del num_splits, max_page_len
    B, Hq, D = q.shape
    Hkv, N = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    mask = selected_token_mask(page_start, page_len, page_idx, N)  # (B, Hkv, N)
    # read only the selected tokens: their indices first (stable), padded to the longest selection
    count = mask.sum(-1)  # (B, Hkv)
    width = int(count.max()) if count.numel() else 0
    valid = torch.arange(width, device=q.device) < count[..., None]
    if width == N and bool(valid.all()):  # every token is read: no gather
        k_sel, v_sel = k_cache.float(), v_cache.float()
    else:
        rows = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)[..., :width]  # (B, Hkv, width)
        flat = (rows + torch.arange(B * Hkv, device=q.device).view(B, Hkv, 1) * N).reshape(-1)
        k_sel = k_cache.reshape(B * Hkv * N, D).index_select(0, flat).view(B, Hkv, width, D).float()
        v_sel = v_cache.reshape(B * Hkv * N, D).index_select(0, flat).view(B, Hkv, width, D).float()
    qf = q.float().view(B, Hkv, G, D)
    s = torch.einsum("bhgd,bhnd->bhgn", qf, k_sel) * scale
    s = s.masked_fill(~valid[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, Hkv, G); -inf where nothing is read
    p = torch.exp(s - lse[..., None].clamp_min(torch.finfo(torch.float32).min))
    out = torch.einsum("bhgn,bhnd->bhgd", p, v_sel)
    return out.reshape(B, Hq, D).to(q.dtype), lse.reshape(B, Hq)


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges two partial attention results over disjoint token sets: out (..., D), lse (...)."""
    lse = torch.logaddexp(lse_a.float(), lse_b.float())
    safe = torch.where(torch.isinf(lse) & (lse < 0), torch.zeros_like(lse), lse)
    wa = torch.exp(lse_a.float() - safe)
    wb = torch.exp(lse_b.float() - safe)
    out = out_a.float() * wa[..., None] + out_b.float() * wb[..., None]
    return out.to(out_a.dtype), lse
