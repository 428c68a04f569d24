"""LOCKS / OVAL page scoring, the PyTorch reference and the one definition of the low-rank page score:
a page of tokens k_i = mu + B c_i (centroid mu, basis B (D x R), coefficients c_i) scores
logsumexp_i scale * (q . mu + (B^T q) . c_i) for a query head, the estimated log attention mass of the
page; `page_score_lowrank_naive` combines a KV head's query heads (common.gqa.combine_gqa).
How the summaries are built: mm_oval.policies.page_summaries. Layout: docs/kernels.md."""

from __future__ import annotations

import torch

from ..common.gqa import combine_gqa


def page_raw_lowrank_naive(
    q: torch.Tensor,
    mu: torch.Tensor,
    basis: torch.Tensor,
    coef: torch.Tensor,
    page_len: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Per-query-head LOCKS/OVAL page scores (B, Hkv, G, P): logsumexp_i scale*(q.mu + (V^T q).c_i)."""
    B, Hq, D = q.shape
    Hkv, _, T = mu.shape[1], mu.shape[2], coef.shape[3]
    G = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    qf = q.float().view(B, Hkv, G, D)
    qmu = torch.einsum("bhgd,bhpd->bhgp", qf, mu.float())
    qv = torch.einsum("bhgd,bhpdr->bhgpr", qf, basis.float())
    qvc = torch.einsum("bhgpr,bhptr->bhgpt", qv, coef.float())
    s = (qmu[..., None] + qvc) * scale
    tok = torch.arange(T, device=q.device)
    valid = tok[None, None, None, :] < page_len[..., None].long()  # (B, Hkv, P, T)
    s = s.masked_fill(~valid[:, :, None], float("-inf"))
    return torch.logsumexp(s, dim=-1)


def page_score_lowrank_naive(
    q: torch.Tensor,
    mu: torch.Tensor,
    basis: torch.Tensor,
    coef: torch.Tensor,
    page_len: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """LOCKS / OVAL page scores combined over the GQA group: (B, Hkv, P) fp32, -inf for empty pages."""
    return combine_gqa(page_raw_lowrank_naive(q, mu, basis, coef, page_len, scale))


def page_score_lowrank_compact_naive(
    q: torch.Tensor,
    record: dict[str, torch.Tensor],
    page_len: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """LOCKS / OVAL page scores of a compact record (mm_oval.policies.page_summaries.compact_page_bases),
    GQA-combined: the record unpacked to fp32 (`scoring_operands`), then the float definition above."""
    from ...policies.page_summaries import scoring_operands  # the record's one definition (no import cycle)

    mu, basis, coef = scoring_operands(record)
    return page_score_lowrank_naive(q, mu, basis, coef, page_len, scale)
