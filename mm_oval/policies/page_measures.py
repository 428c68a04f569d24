"""Measures of a page retrieval, from the keys themselves: the exact log attention mass of each page
(what LOCKS / OVAL / Quest estimate), which tokens a selection reads, and how much of the exact
attention mass the read tokens hold."""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def exact_page_log_mass(
    query: torch.Tensor, keys: torch.Tensor, token_mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """The quantity LOCKS/OVAL estimate, from the keys themselves: query (B, Hq, D), keys (B, Hkv, P, T, D),
    token_mask (B, Hkv, P, T) -> log sum_i exp(scaling q . k_i) per page, (B, Hq, P)."""
    b, hq, d = query.shape
    hkv = keys.shape[1]
    q = query.float().reshape(b, hkv, hq // hkv, d)
    logits = torch.einsum("bhgd,bhptd->bhgpt", q, keys.float()) * scaling
    logits = logits.masked_fill(~token_mask.bool().unsqueeze(2), NEG_INF)
    return torch.logsumexp(logits, -1).reshape(b, hq, -1)


def read_tokens(token_page: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """token_page (B, Hkv, N) page index of each cached token (-1 = in no closed page, e.g. the open page:
    always read); selected (B, Hkv, k) page indices (-1 = none) -> (B, Hkv, N) bool: the token is read."""
    hit = (token_page.unsqueeze(-1) == selected.unsqueeze(-2)) & (selected.unsqueeze(-2) >= 0)
    return hit.any(-1) | (token_page < 0)


def attention_mass_captured(attn: torch.Tensor, read: torch.Tensor, top: int | None = None) -> torch.Tensor:
    """Fraction of the exact attention mass that the read tokens hold, per query head.

    attn (B, Hq, N) exact attention probabilities of one decode query over the cache; read (B, Hkv, N) bool.
    With `top`, the fraction of the mass of the `top` highest-attention tokens that is read (OVAL's
    "true top-k attention mass captured"). Returns (B, Hq)."""
    b, hq, n = attn.shape
    hkv = read.shape[1]
    r = read.repeat_interleave(hq // hkv, dim=1).float()
    a = attn.float()
    if top is not None and top < n:
        val, idx = a.topk(top, dim=-1)
        return (val * r.gather(-1, idx)).sum(-1) / val.sum(-1).clamp_min(1e-30)
    return (a * r).sum(-1) / a.sum(-1).clamp_min(1e-30)
