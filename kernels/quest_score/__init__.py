"""Quest page scoring from per-channel key bounds (kernel.py: Triton; naive.py: the reference)."""

from __future__ import annotations

import torch
from mm_oval.kernels.common.dispatch import HAS_TRITON, backend, check, check_page_scores

from . import naive

if HAS_TRITON:
    from .kernel import page_score_quest_triton


def page_score_quest(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    page_len: torch.Tensor,
    scale: float | None = None,
    page_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quest bound page scores, GQA-combined: (B, Hkv, P) fp32, -inf for empty pages.
    q (B, Hq, D), kmin and kmax (B, Hkv, P, D); with `page_scale` (B, Hkv, P) >= 0, the bounds are
    kmin * page_scale and kmax * page_scale (a compact record's int8 levels and their per-page scale)."""
    what = "page_score_quest"
    check_page_scores(q, kmin, page_len, what)
    check(kmax.shape == kmin.shape, f"{what}: kmin and kmax must both be (B, Hkv, P, D)")
    check(page_scale is None or page_scale.shape == page_len.shape, f"{what}: page_scale must be (B, Hkv, P)")
    if backend(q, kmin) == "triton":
        if page_scale is not None:
            s = page_scale.float().unsqueeze(-1)
            kmin, kmax = kmin.float() * s, kmax.float() * s
        return page_score_quest_triton(q, kmin, kmax, page_len, scale)
    return naive.page_score_quest_naive(q, kmin, kmax, page_len, scale, page_scale)
