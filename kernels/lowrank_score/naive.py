"""LOCKS / OVAL page scoring, the PyTorch reference and the one definition of the low-rank page score:
a page of tokens k_i = mu + B c_i (centroid mu, basis B (D x R), coefficients c_i) scores
logsumexp_i scale * (q . mu + (B^T q) . c_i) for a query head, the estimated log attention mass of the
page; `page_score_lowrank_naive` combines a KV head's query heads (common.gqa.combine_gqa).
How the float summaries are built: mm_oval.policies.page_summaries; the compact record: record.py.
Layout: docs/kernels.md.

This is also the path off CUDA, so it is written as batched matrix products over the stored layouts
(no einsum, which would permute and copy the (P, D, R) bases at every step), over the coefficient rows up
to the longest page only, and a compact record is read with its scales applied to the small products
rather than to the unpacked basis."""

from __future__ import annotations

import torch
from mm_oval.kernels.common.gqa import combine_gqa


def _page_logsumexp(
    qmu: torch.Tensor, qvc: torch.Tensor, page_len: torch.Tensor, scale: float
) -> torch.Tensor:
    """qmu (B, Hkv, P, G) = q . mu, qvc (B, Hkv, P, T, G) = (B^T q) . c_i -> (B, Hkv, G, P): logsumexp over
    each page's first page_len tokens of scale * (qmu + qvc), -inf for an empty page."""
    T = qvc.shape[3]
    s = (qvc + qmu.unsqueeze(3)) * scale
    valid = torch.arange(T, device=s.device) < page_len.unsqueeze(-1).long()  # (B, Hkv, P, T)
    s = s.masked_fill(~valid.unsqueeze(-1), float("-inf"))
    return torch.logsumexp(s, dim=3).transpose(2, 3)


def _tokens_read(coef: torch.Tensor, page_len: torch.Tensor) -> int:
    """How many coefficient rows scoring reads: up to the longest page (at least one)."""
    longest = int(page_len.max()) if page_len.numel() else 0
    return max(1, min(coef.shape[3], longest))


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
    Hkv = mu.shape[1]
    G = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    qf = q.float().view(B, Hkv, G, D)
    qmu = torch.matmul(mu.float(), qf.transpose(-1, -2))  # (B, Hkv, P, G)
    qv = torch.matmul(
        qf.unsqueeze(2), basis.float()
    )  # (B, Hkv, 1, G, D) @ (B, Hkv, P, D, R) -> (.., P, G, R)
    c = coef[:, :, :, : _tokens_read(coef, page_len)].float()
    qvc = torch.matmul(c, qv.transpose(-1, -2))  # (B, Hkv, P, T, G)
    return _page_logsumexp(qmu, qvc, page_len, scale)


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


UNPACK_CHUNK = 1 << 18  # fp32 numbers of unpacked basis at a time: 1 MiB, which stays in a CPU core's L2


def _nibble_products(qp: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """qp (N, 1, G, 2H) fp32, packed (N, P, H, R) uint8 -> (N, P, G, R): qp times the basis nibbles
    (row j of a column the low nibble of byte j, row H + j the high one), unpacked a few KV heads at a
    time into one small buffer rather than the whole basis at once, which on CPU costs more to write and
    read back than the product itself."""
    N, P, half, R = packed.shape
    G = qp.shape[2]
    out = torch.empty(N, P, G, R, dtype=torch.float32, device=packed.device)
    step = max(1, UNPACK_CHUNK // max(1, P * 2 * half * R))
    buf = torch.empty(min(step, N), P, 2 * half, R, dtype=torch.float32, device=packed.device)
    for i in range(0, N, step):
        j = min(N, i + step)
        b = buf[: j - i]
        b[:, :, :half] = packed[i:j] & 0x0F
        b[:, :, half:] = packed[i:j] >> 4
        torch.matmul(qp[i:j], b, out=out[i:j])
    return out


def page_score_lowrank_compact_naive(
    q: torch.Tensor,
    record: dict[str, torch.Tensor],
    page_len: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """LOCKS / OVAL page scores of a compact record (record.compact_page_bases), GQA-combined."""
    return combine_gqa(page_raw_lowrank_compact_naive(q, record, page_len, scale))


def page_raw_lowrank_compact_naive(
    q: torch.Tensor,
    record: dict[str, torch.Tensor],
    page_len: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Per-query-head LOCKS / OVAL page scores of a compact record (B, Hkv, G, P): the scores of the
    dequantised record (`scoring_operands`) under the float definition above, computed on the stored
    levels. The basis is unpacked to its nibbles (level + 8) and multiplied by the query as they are, the + 8
    taken off the (P, G, R) product, and the column, coefficient and centroid scales multiply the products,
    never the unpacked basis."""
    mu_q, basis_q, coef_q = record["mu_q"], record["basis_q"], record["coef_q"]
    B, Hq, D = q.shape
    Hkv, P = mu_q.shape[1], mu_q.shape[2]
    half, R = basis_q.shape[-2:]
    G = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    qf = q.float().view(B, Hkv, G, D)
    # byte j of a basis column holds row j (low nibble) and row half + j (high nibble); an odd D's padding
    # row meets a zero query channel
    qp = qf if 2 * half == D else torch.nn.functional.pad(qf, (0, 2 * half - D))
    qv = _nibble_products(qp.reshape(B * Hkv, 1, G, 2 * half), basis_q.reshape(B * Hkv, P, half, R))
    qv = qv.view(B, Hkv, P, G, R) - 8.0 * qp.sum(-1)[:, :, None, :, None]
    qv = qv * (record["basis_scale"].float() * record["coef_scale"].float().unsqueeze(-1)).unsqueeze(-2)
    c = coef_q[:, :, :, : _tokens_read(coef_q, page_len)].float()
    qvc = torch.matmul(c, qv.transpose(-1, -2))  # (B, Hkv, P, T, G)
    qmu = torch.matmul(mu_q.float(), qf.transpose(-1, -2)) * record["mu_scale"].float().unsqueeze(-1)
    return _page_logsumexp(qmu, qvc, page_len, scale)
