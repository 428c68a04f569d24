"""LOCKS / OVAL page scoring from low-rank page bases (kernel.py: Triton; naive.py: the reference)."""

from __future__ import annotations

import torch

from ..common.dispatch import HAS_TRITON, backend, check, check_page_scores
from . import naive

if HAS_TRITON:
    from .kernel import page_score_lowrank_triton


def page_score_lowrank(
    q: torch.Tensor,
    mu: torch.Tensor,
    basis: torch.Tensor,
    coef: torch.Tensor,
    page_len: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """LOCKS / OVAL page scores, GQA-combined: (B, Hkv, P) fp32 = log(mean_g softmax_pages(s_g)), -inf
    for empty pages. q (B, Hq, D), mu (B, Hkv, P, D), basis (B, Hkv, P, D, R), coef (B, Hkv, P, T, R)."""
    what = "page_score_lowrank"
    check_page_scores(q, mu, page_len, what)
    B, Hkv, P, D = mu.shape
    check(
        basis.dim() == 5 and basis.shape[:4] == (B, Hkv, P, D),
        f"{what}: basis must be (B, Hkv, P, D, R) = ({B}, {Hkv}, {P}, {D}, R)",
    )
    R = basis.shape[4]
    check(
        coef.dim() == 5 and coef.shape[:3] == (B, Hkv, P) and coef.shape[4] == R,
        f"{what}: coef must be (B, Hkv, P, T, R) with R = {R}",
    )
    fn = page_score_lowrank_triton if backend(q, mu) == "triton" else naive.page_score_lowrank_naive
    return fn(q, mu, basis, coef, page_len, scale)
