"""Quest (Tang et al. 2024), the page-retrieval baseline: each page is summarised by the per-channel
minimum and maximum of its keys, and scored by the upper bound they give on a query's attention logits.
The scoring is the page_score_quest kernel's (mm_oval.kernels); the summaries are built in
page_summaries.py (`key_bounds`, `compact_key_bounds`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import page_score_quest
from .base import DecodeContext, PageBatch, RetrievalPolicy, register_retrieval
from .page_summaries import check_summary_format, compact_key_bounds, key_bounds


@register_retrieval
@dataclass
class Quest(RetrievalPolicy):
    """Quest (Tang et al. 2024): per page and channel, the min and max key; a page's score for query q is
    the upper bound `scale * sum_c max(q_c min_c, q_c max_c)`; the query heads of a KV head are combined
    as log(mean_g softmax_pages(score_g)). Both are the page_score_quest kernel's (mm_oval.kernels).
    Option summary_format: "float" (min / max in the keys' dtype, as its authors store them: the min and max
    of keys are keys' values, so exact) or "compact" (int8 with one fp16 scale per page, rounded outward so
    the score stays an upper bound: page_summaries.compact_key_bounds).

    Applied in every layer by default, as every retrieval policy here is; its authors' evaluation code reads
    the first two layers densely (their attention is the least sparse) and a forward of several tokens
    densely: `dense_layers=2, read_chunks="dense"` (OvalConfig) is their rule, and at one bytes budget it
    spends a share of the bytes on layers 0-1."""

    name = "quest"
    # log of the page's share of the head's bound-softmax over the closed pages: one scale for every head
    comparable_across_heads = True
    summary_format: str = "float"

    def __post_init__(self) -> None:
        self.summary_format = check_summary_format(self.name, self.summary_format)

    def summarize(self, pages: PageBatch) -> dict[str, torch.Tensor]:
        kmin, kmax = key_bounds(pages.keys, pages.mask)
        if self.summary_format == "compact":
            return compact_key_bounds(kmin, kmax)
        return {"kmin": kmin.to(pages.keys.dtype), "kmax": kmax.to(pages.keys.dtype)}

    def score_pages(self, ctx: DecodeContext) -> torch.Tensor:
        q = ctx.query[:, :, -1]  # (B, Hq, D): the newest query row
        if self.summary_format == "compact":  # the int8 levels, scaled per page after the product
            r = ctx.summaries
            return page_score_quest(q, r["kmin_q"], r["kmax_q"], ctx.page_len, ctx.scaling, r["bound_scale"])
        return page_score_quest(q, ctx.summaries["kmin"], ctx.summaries["kmax"], ctx.page_len, ctx.scaling)
