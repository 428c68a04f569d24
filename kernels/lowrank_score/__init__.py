"""LOCKS / OVAL page scoring from low-rank page bases (kernel.py: Triton; naive.py: the reference)."""

from __future__ import annotations

import torch
from mm_oval.kernels.common.dispatch import HAS_TRITON, backend, check, check_page_scores

from . import naive

if HAS_TRITON:
    from .kernel import page_score_lowrank_compact_triton, page_score_lowrank_triton

COMPACT_KEYS = ("mu_q", "mu_scale", "basis_q", "basis_scale", "coef_q", "coef_scale")


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


def page_score_lowrank_compact(
    q: torch.Tensor,
    record: dict[str, torch.Tensor],
    page_len: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """`page_score_lowrank` of a compact record (docs/oval.md "Compact summaries": mu_q (B, Hkv, P, D) int8
    and mu_scale (B, Hkv, P), basis_q (B, Hkv, P, ceil(D/2), R) uint8 two int4 rows per byte and
    basis_scale (B, Hkv, P, R), coef_q (B, Hkv, P, T, R) int8 and coef_scale (B, Hkv, P)). The Triton
    kernel reads the record as stored and unpacks it in registers; the reference unpacks the basis to
    fp32 a few KV heads at a time (naive.py)."""
    what = "page_score_lowrank_compact"
    missing = [k for k in COMPACT_KEYS if k not in record]
    check(not missing, f"{what}: the compact record lacks {missing}")
    mu_q, basis_q, coef_q = record["mu_q"], record["basis_q"], record["coef_q"]
    check_page_scores(q, mu_q, page_len, what)
    B, Hkv, P, D = mu_q.shape
    check(
        basis_q.dim() == 5 and basis_q.shape[:4] == (B, Hkv, P, (D + 1) // 2),
        f"{what}: basis_q must be (B, Hkv, P, ceil(D/2), R) = ({B}, {Hkv}, {P}, {(D + 1) // 2}, R)",
    )
    R = basis_q.shape[4]
    check(
        coef_q.dim() == 5 and coef_q.shape[:3] == (B, Hkv, P) and coef_q.shape[4] == R,
        f"{what}: coef_q must be (B, Hkv, P, T, R) with R = {R}",
    )
    check(
        record["basis_scale"].shape == (B, Hkv, P, R)
        and record["mu_scale"].shape == record["coef_scale"].shape == (B, Hkv, P),
        f"{what}: scales must be basis_scale (B, Hkv, P, R), mu_scale and coef_scale (B, Hkv, P)",
    )
    if backend(q, mu_q) == "triton":
        return page_score_lowrank_compact_triton(q, record, page_len, scale)
    return naive.page_score_lowrank_compact_naive(q, record, page_len, scale)


def page_log_mass_lowrank(
    q: torch.Tensor,
    summaries: dict[str, torch.Tensor],
    page_len: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Per query head, each page's estimated log attention mass (B, Hkv, G, P) fp32, -inf for empty pages:
    logsumexp over the page's tokens of scale * (q . mu + (B^T q) . c_i), the low-rank score before the GQA
    combination, from a compact record (`COMPACT_KEYS`) or float summaries ("mu", "basis", "coef"). What
    `unread_pages="scored"` puts in the place of a page a step does not read. PyTorch on every device (no
    Triton twin yet: it runs once per layer and step, on the same operands as the page scores)."""
    if "mu_q" in summaries:
        return naive.page_raw_lowrank_compact_naive(q, summaries, page_len, scale)
    return naive.page_raw_lowrank_naive(
        q, summaries["mu"], summaries["basis"], summaries["coef"], page_len, scale
    )
