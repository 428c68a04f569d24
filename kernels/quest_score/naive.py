"""Quest page scoring, the PyTorch reference and the one definition of Quest's page bound: with the
per-channel minimum and maximum of a page's keys, scale * sum_c max(q_c kmin_c, q_c kmax_c) bounds
scale * q . k for every key of the page; `page_score_quest_naive` combines a KV head's query heads
(common.gqa.combine_gqa). Layout: docs/kernels.md."""

from __future__ import annotations

import torch

from ..common.gqa import combine_gqa


def page_raw_quest_naive(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    page_len: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Per-query-head Quest bounds (B, Hkv, G, P): scale * sum_c max(q_c kmin_c, q_c kmax_c)."""
    B, Hq, D = q.shape
    Hkv = kmin.shape[1]
    scale = D**-0.5 if scale is None else scale
    qf = q.float().view(B, Hkv, Hq // Hkv, 1, D)
    lo = qf * kmin.float()[:, :, None]
    hi = qf * kmax.float()[:, :, None]
    s = torch.maximum(lo, hi).sum(dim=-1) * scale
    return s.masked_fill((page_len <= 0)[:, :, None], float("-inf"))


def page_score_quest_naive(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    page_len: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Quest page scores combined over the GQA group: (B, Hkv, P) fp32, -inf for empty pages."""
    return combine_gqa(page_raw_quest_naive(q, kmin, kmax, page_len, scale))
