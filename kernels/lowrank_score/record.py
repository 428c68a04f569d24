"""The compact LOCKS / OVAL record that `page_score_lowrank_compact` reads, built from the float page
summaries (centroid, basis, coefficients) and read back.

Bytes of one page of the record (`compact_basis_bytes`), D channels, rank r, T tokens:
  basis     ceil(D/2) r  (int4, two per byte)  + 2 r  (one fp16 scale per basis column)
  coef      T r          (int8, real tokens)   + 2    (one fp16 scale per page)
  centroid  D            (int8)                + 2    (one fp16 scale per page)
"""

from __future__ import annotations

import torch
from mm_oval.kernels.common.quant import (
    dequantize_int4_columns,
    dequantize_int8,
    int4_levels,
    quantize_int4_columns,
    quantize_int8,
)


def compact_page_bases(
    centroid: torch.Tensor, basis: torch.Tensor, coef: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The compact LOCKS / OVAL record of pages: centroid (..., P, D), basis (..., P, D, r), coef
    (..., P, T, r) (rows past a page's tokens zero) -> {mu_q (..., P, D) int8, mu_scale (..., P) fp16,
    basis_q (..., P, ceil(D/2), r) uint8, basis_scale (..., P, r) fp16, coef_q (..., P, T, r) int8,
    coef_scale (..., P) fp16}: the centroid int8 with one scale per page, the basis int4 with one scale per
    column, the coefficients int8 with one scale per page. Bytes read per page: `compact_basis_bytes`."""
    mu_q, mu_scale = quantize_int8(centroid, 1)
    basis_q, basis_scale = quantize_int4_columns(basis)
    coef_q, coef_scale = quantize_int8(coef, 2)
    return {
        "mu_q": mu_q,
        "mu_scale": mu_scale,
        "basis_q": basis_q,
        "basis_scale": basis_scale,
        "coef_q": coef_q,
        "coef_scale": coef_scale,
    }


def expand_page_bases(record: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `compact_page_bases`: (centroid, basis, coef) in fp32, the page-scoring kernel's layout."""
    mu = dequantize_int8(record["mu_q"], record["mu_scale"])
    basis = dequantize_int4_columns(record["basis_q"], record["basis_scale"], mu.shape[-1])
    return mu, basis, dequantize_int8(record["coef_q"], record["coef_scale"])


def scoring_operands(record: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the page-scoring kernel takes for a compact record, fp32: (centroid, basis levels, coefficients
    times the basis column scales). B c_i is that of `expand_page_bases` (column j of B is levels_j s_j: s_j
    moves to row j of the coefficients), so the scores are the same; the large basis is only unpacked."""
    mu = dequantize_int8(record["mu_q"], record["mu_scale"])
    levels = int4_levels(record["basis_q"], mu.shape[-1])
    coef = dequantize_int8(record["coef_q"], record["coef_scale"])
    return mu, levels, coef.mul_(record["basis_scale"].float().unsqueeze(-2))


def compact_basis_bytes(d: int, r: int, page_len: torch.Tensor) -> torch.Tensor:
    """Bytes of a page's compact LOCKS / OVAL record that scoring reads: the packed basis and its column
    scales, the int8 coefficients of the page's `page_len` tokens and their scale, the int8 centroid and its
    scale (the coefficient rows padding a page are not read)."""
    return (d + 1) // 2 * r + 2 * r + page_len.long() * r + 2 + d + 2
