"""Quest page scoring from per-channel key bounds (kernel.py: Triton; naive.py: the reference)."""

from __future__ import annotations

import torch

from ..common.dispatch import HAS_TRITON, backend, check, check_page_scores
from . import naive

if HAS_TRITON:
    from .kernel import page_score_quest_triton


def page_score_quest(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    page_len: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Quest bound page scores, GQA-combined: (B, Hkv, P) fp32, -inf for empty pages.
    q (B, Hq, D), kmin and kmax (B, Hkv, P, D)."""
    what = "page_score_quest"
    check_page_scores(q, kmin, page_len, what)
    check(kmax.shape == kmin.shape, f"{what}: kmin and kmax must both be (B, Hkv, P, D)")
    fn = page_score_quest_triton if backend(q, kmin) == "triton" else naive.page_score_quest_naive
    return fn(q, kmin, kmax, page_len, scale)
