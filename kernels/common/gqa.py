"""The GQA combination of page scores, the one definition every page-scoring method uses.

Per-query-head scores of a KV head's pages become one score per page: the softmax over pages of each
query head of the group, averaged over the group, as a log. exp() of a head's row sums to 1 (0 for a
head without pages) and empty pages (-inf raw score) stay -inf. The Triton twin is
`triton_utils.combine_gqa_triton`.
"""

from __future__ import annotations

import torch


def combine_gqa(raw: torch.Tensor) -> torch.Tensor:
    """raw (B, Hkv, G, P) per-query-head page scores, -inf for empty pages -> (B, Hkv, P) fp32:
    log(mean_g softmax_pages(raw[:, :, g]))."""
    raw = raw.float()
    m = raw.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(raw - m)
    z = e.sum(dim=-1, keepdim=True)
    prob = torch.where(z > 0, e / z.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(e))
    return torch.log(prob.mean(dim=2))
