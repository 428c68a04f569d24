"""LOCKS and OVAL page retrieval: each closed page gets a rank-r basis of its keys (LOCKS: key PCA,
eta = 0; OVAL: output-aware, eta > 0; built in page_summaries.py), and each decode step scores the pages
from their bases alone through the page_score_lowrank kernel (mm_oval.kernels), never reading keys.
A KV head's query heads are combined by the kernels' GQA combination (softmax over pages averaged over
the group, as a log)."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import ConfigError
from ..kernels import page_log_mass_lowrank, page_score_lowrank, page_score_lowrank_compact
from .base import DecodeContext, PageBatch, RetrievalPolicy, register_retrieval
from .page_summaries import (
    check_summary_format,
    compact_basis_bytes,
    compact_page_bases,
    dequantize_int8,
    layer_output_metric,
    page_bases,
)


def mean_over_queries(per_query: list[torch.Tensor]) -> torch.Tensor:
    """Combine log page scores of several query rows (a later turn fed in at once) as log mean exp."""
    if len(per_query) == 1:
        return per_query[0]
    stacked = torch.stack(per_query, 0)
    return torch.logsumexp(stacked, 0) - math.log(len(per_query))


@dataclass
class _BasisRetrieval(RetrievalPolicy):
    """Shared body of LOCKS and OVAL: a rank-r page basis per page and KV head, scored without keys."""

    # a page's score is the log of its estimated share of the KV head's attention over the closed pages
    # (the GQA combination's softmax over pages): one scale for every head, so heads may share a read budget
    comparable_across_heads: ClassVar[bool] = True
    estimates_page_mass: ClassVar[bool] = True  # `page_log_mass`: the score before the GQA combination
    keeps_key_means: ClassVar[bool] = True  # the record's centroid is the page's keys' mean

    rank: int = 8
    eta: float = 0.0
    coef_rows: int = 32  # coefficient rows stored per page: pages up to this many tokens, padded to it
    # "compact" (the default, as OVAL's and LOCKS's released code store it): int4 basis with per-column scales,
    # int8 coefficients and centroid (docs/oval.md); "float": the exactness reference, in the keys' dtype
    summary_format: str = "compact"
    # the former spelling of coef_rows (read as coef_rows, with a FutureWarning); unrelated to
    # OvalConfig.max_page_tokens, the largest dynamic page
    max_page_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_page_tokens is not None:
            warnings.warn(
                f"{self.name}: the retrieval option max_page_tokens is now called coef_rows (the coefficient "
                f"rows stored per page; OvalConfig.max_page_tokens is the largest dynamic page): pass "
                f"retrieval_options={{'coef_rows': {self.max_page_tokens!r}}}",
                FutureWarning,
                stacklevel=2,
            )
            self.coef_rows, self.max_page_tokens = self.max_page_tokens, None
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"{self.name}: rank must be an int >= 1, got {self.rank!r}")
        if not isinstance(self.eta, (int, float)) or not 0.0 <= float(self.eta) <= 1.0:
            raise ConfigError(f"{self.name}: eta must lie in [0, 1], got {self.eta!r}")
        if isinstance(self.coef_rows, bool) or not isinstance(self.coef_rows, int):
            raise ConfigError(f"{self.name}: coef_rows must be an int, got {self.coef_rows!r}")
        self.eta = float(self.eta)
        self.summary_format = check_summary_format(self.name, self.summary_format)
        self._metrics: dict = {}

    def summarize(self, pages: PageBatch) -> dict[str, torch.Tensor]:
        t = pages.keys.shape[-2]
        if t > self.coef_rows:
            raise ConfigError(
                f"{self.name}: a page of {t} tokens exceeds coef_rows={self.coef_rows}; "
                f"pass retrieval_options={{'coef_rows': {t}}} or use smaller pages"
            )
        metric = None
        if self.eta > 0:
            if pages.module is None or not hasattr(pages.module, "o_proj"):
                raise ConfigError(f"{self.name}: eta > 0 needs the layer's attention module (its o_proj)")
            metric = layer_output_metric(pages.module, self._metrics).to(pages.keys.device)[None, :, None]
        s = page_bases(
            pages.keys, pages.mask, rank=self.rank, eta=self.eta, values=pages.values, metric=metric
        )
        coef = torch.nn.functional.pad(s.coeffs, (0, 0, 0, self.coef_rows - t))
        if self.summary_format == "compact":
            return compact_page_bases(s.centroid, s.basis, coef)
        return {"mu": s.centroid, "basis": s.basis, "coef": coef}

    def summary_bytes(self, summaries: dict[str, torch.Tensor], page_len: torch.Tensor) -> torch.Tensor:
        """Per page: the centroid (D) and basis (D r) and the coefficients of its real tokens (T r), in the
        summaries' dtype; the coefficient rows padding a page to coef_rows are not read. Compact
        records: `page_summaries.compact_basis_bytes` (packed basis, int8 coefficients and centroid,
        their scales)."""
        if self.summary_format == "compact":
            mu_q, basis_q = summaries["mu_q"], summaries["basis_q"]
            return compact_basis_bytes(mu_q.shape[-1], basis_q.shape[-1], page_len)
        basis = summaries["basis"]
        d, r = basis.shape[-2:]
        return (d + d * r + page_len.long() * r) * basis.element_size()

    def score_pages(self, ctx: DecodeContext) -> torch.Tensor:
        sm = ctx.summaries
        if self.summary_format == "compact":  # read as stored (off CUDA: unpacked in small chunks)
            rows = [
                page_score_lowrank_compact(ctx.query[:, :, i], sm, ctx.page_len, ctx.scaling)
                for i in range(ctx.query.shape[2])
            ]
            return mean_over_queries(rows)
        rows = [
            page_score_lowrank(
                ctx.query[:, :, i], sm["mu"], sm["basis"], sm["coef"], ctx.page_len, ctx.scaling
            )
            for i in range(ctx.query.shape[2])
        ]
        return mean_over_queries(rows)

    def page_key_means(self, summaries: dict[str, torch.Tensor]) -> torch.Tensor:
        """The record's centroid (int8 with an fp16 scale per page in a compact record)."""
        if "mu_q" in summaries:
            return dequantize_int8(summaries["mu_q"], summaries["mu_scale"])
        return summaries["mu"].float()

    def page_log_mass(self, ctx: DecodeContext) -> torch.Tensor:
        """Each page's log attention mass for each query head as its basis estimates it (the score before
        the GQA combination): the keys' centroid and low-rank coefficients stand in for its keys."""
        return page_log_mass_lowrank(ctx.query[:, :, -1], ctx.summaries, ctx.page_len, ctx.scaling)


@register_retrieval
@dataclass
class LocksRetrieval(_BasisRetrieval):
    """LOCKS: page-local key PCA (the eta = 0 case of OVAL). Options: rank (8), coef_rows (32),
    summary_format ("float" or "compact")."""

    name: ClassVar[str] = "locks"

    def __post_init__(self) -> None:
        if self.eta != 0.0:
            raise ConfigError("locks is OVAL with eta = 0; use retrieval 'oval' with an eta option instead")
        super().__post_init__()


@register_retrieval
@dataclass
class OvalRetrieval(_BasisRetrieval):
    """OVAL: output-aware page bases. Options: eta (0.5; 0 = LOCKS, 1 = output-only), rank (8),
    coef_rows (32), summary_format ("float" or "compact")."""

    name: ClassVar[str] = "oval"
    eta: float = 0.5
