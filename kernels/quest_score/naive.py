"""Quest page scoring, the PyTorch reference and the one definition of Quest's page bound: with the
per-channel minimum and maximum of a page's keys, scale * sum_c max(q_c kmin_c, q_c kmax_c) bounds
scale * q . k for every key of the page; `page_score_quest_naive` combines a KV head's query heads
(common.gqa.combine_gqa). Layout: docs/kernels.md."""

from __future__ import annotations

import torch
from mm_oval.kernels.common.gqa import combine_gqa


def page_raw_quest_naive(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    page_len: torch.Tensor,
    scale: float | None = None,
    page_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-query-head Quest bounds (B, Hkv, G, P): scale * sum_c max(q_c kmin_c, q_c kmax_c), the bounds
    times `page_scale` (B, Hkv, P) >= 0 when given (applied to the sum: the same bound)."""
    B, Hq, D = q.shape
    Hkv = kmin.shape[1]
    scale = D**-0.5 if scale is None else scale
    qf = q.float().view(B, Hkv, Hq // Hkv, D)
    # max(q_c kmin_c, q_c kmax_c) is q_c kmax_c where q_c >= 0 and q_c kmin_c where q_c < 0 (kmin <= kmax):
    # two matrix products over the pages, not a (G, P, D) temporary
    s = qf.clamp(min=0) @ kmax.float().transpose(-1, -2) + qf.clamp(max=0) @ kmin.float().transpose(-1, -2)
    if page_scale is not None:
        s = s * page_scale.float()[:, :, None]
    return (s * scale).masked_fill((page_len <= 0)[:, :, None], float("-inf"))


def page_score_quest_naive(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    page_len: torch.Tensor,
    scale: float | None = None,
    page_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quest page scores combined over the GQA group: (B, Hkv, P) fp32, -inf for empty pages."""
    return combine_gqa(page_raw_quest_naive(q, kmin, kmax, page_len, scale, page_scale))
