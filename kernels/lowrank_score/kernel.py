"""LOCKS / OVAL page scoring (Triton): estimated log attention mass of each page from its low-rank
basis, then the GQA combination (common.triton_utils.combine_gqa_triton).

One program per (batch, KV head, block of BLOCK_P pages): the group's query rows are loaded once; for
each query head it reads only the block's summaries (mu, basis, coefficients) and writes one raw score
per page, logsumexp_i scale * (q . mu + (B^T q) . c_i). No key or value is read.
Reference: naive.py; layout: docs/kernels.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from mm_oval.kernels.common.triton_utils import (
    combine_gqa_triton,
    last_contiguous,
    program_block,
    query_row,
    raw_page_scores,
)


@triton.jit
def _page_logsumexp(s, t_valid, length):
    """(BLOCK_P, BLOCK_T) scaled token logits -> (BLOCK_P,) log-sum-exp over each page's valid tokens,
    -inf for an empty page."""
    s = tl.where(t_valid, s, float("-inf"))
    has = length > 0
    m_safe = tl.where(has, tl.max(s, 1), 0.0)
    z = tl.sum(tl.exp(s - m_safe[:, None]), 1)
    return tl.where(has, m_safe + tl.log(tl.where(has, z, 1.0)), float("-inf"))


@triton.jit
def _lowrank_raw_kernel(
    Q,
    MU,
    BASIS,
    COEF,
    PL,
    RAW,
    scale,
    stride_qb,
    stride_qh,
    stride_mb,
    stride_mh,
    stride_mp,
    stride_bb,
    stride_bh,
    stride_bp,
    stride_bd,
    stride_cb,
    stride_ch,
    stride_cp,
    stride_ct,
    stride_lb,
    stride_lh,
    Hkv,
    P,
    T,
    R,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid_bh, b, h, offs_p = program_block(Hkv, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, BLOCK_T)
    offs_r = tl.arange(0, BLOCK_R)
    p_mask = offs_p < P
    d_mask = offs_d < D
    r_mask = offs_r < R

    length = tl.load(PL + b * stride_lb + h * stride_lh + offs_p, mask=p_mask, other=0)  # (BLOCK_P,)
    mu = tl.load(
        MU + b * stride_mb + h * stride_mh + offs_p[:, None] * stride_mp + offs_d[None, :],
        mask=p_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(tl.float32)  # (BLOCK_P, BLOCK_D)
    basis = tl.load(
        BASIS
        + b * stride_bb
        + h * stride_bh
        + offs_p[:, None, None] * stride_bp
        + offs_d[None, :, None] * stride_bd
        + offs_r[None, None, :],
        mask=p_mask[:, None, None] & d_mask[None, :, None] & r_mask[None, None, :],
        other=0.0,
    ).to(tl.float32)  # (BLOCK_P, BLOCK_D, BLOCK_R)
    t_valid = offs_t[None, :] < length[:, None]  # (BLOCK_P, BLOCK_T)
    coef = tl.load(
        COEF
        + b * stride_cb
        + h * stride_ch
        + offs_p[:, None, None] * stride_cp
        + offs_t[None, :, None] * stride_ct
        + offs_r[None, None, :],
        mask=t_valid[:, :, None] & (offs_t[None, :, None] < T) & r_mask[None, None, :],
        other=0.0,
    ).to(tl.float32)  # (BLOCK_P, BLOCK_T, BLOCK_R)

    for g in tl.static_range(G):
        qg = query_row(Q, b, stride_qb, stride_qh, h * G + g, offs_d, d_mask)
        qmu = tl.sum(mu * qg[None, :], 1)  # (BLOCK_P,)
        qv = tl.sum(basis * qg[None, :, None], 1)  # (BLOCK_P, BLOCK_R)
        qvc = tl.sum(coef * qv[:, None, :], 2)  # (BLOCK_P, BLOCK_T)
        raw = _page_logsumexp((qmu[:, None] + qvc) * scale, t_valid, length)
        tl.store(RAW + ((pid_bh * G + g) * P) + offs_p, raw, mask=p_mask)


def page_score_lowrank_triton(
    q: torch.Tensor,
    mu: torch.Tensor,
    basis: torch.Tensor,
    coef: torch.Tensor,
    page_len: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    B, _, D = q.shape
    Hkv, P, T, R = mu.shape[1], mu.shape[2], coef.shape[3], coef.shape[4]
    G, scale, raw = raw_page_scores(q, Hkv, P, scale)
    if P == 0:
        return combine_gqa_triton(raw)
    q, mu, basis, coef = (last_contiguous(x) for x in (q, mu, basis, coef))
    page_len = page_len.to(torch.int32).contiguous()
    BLOCK_D = triton.next_power_of_2(D)
    BLOCK_R = triton.next_power_of_2(R)
    BLOCK_T = triton.next_power_of_2(T)
    # about 8k fp32 elements of basis per program
    BLOCK_P = max(1, min(triton.next_power_of_2(P), 8192 // (BLOCK_D * BLOCK_R)))
    _lowrank_raw_kernel[(B * Hkv, triton.cdiv(P, BLOCK_P))](
        q,
        mu,
        basis,
        coef,
        page_len,
        raw,
        scale,
        q.stride(0),
        q.stride(1),
        mu.stride(0),
        mu.stride(1),
        mu.stride(2),
        basis.stride(0),
        basis.stride(1),
        basis.stride(2),
        basis.stride(3),
        coef.stride(0),
        coef.stride(1),
        coef.stride(2),
        coef.stride(3),
        page_len.stride(0),
        page_len.stride(1),
        Hkv,
        P,
        T,
        R,
        G=G,
        D=D,
        BLOCK_P=BLOCK_P,
        BLOCK_D=BLOCK_D,
        BLOCK_T=BLOCK_T,
        BLOCK_R=BLOCK_R,
    )
    return combine_gqa_triton(raw)


@triton.jit
def _lowrank_compact_raw_kernel(
    Q,
    MUQ,
    MUS,
    BQ,
    BS,
    CQ,
    CS,
    PL,
    RAW,
    scale,
    stride_qb,
    stride_qh,
    stride_mb,
    stride_mh,
    stride_mp,
    stride_sb,
    stride_sh,
    stride_bb,
    stride_bh,
    stride_bp,
    stride_bd,
    stride_rb,
    stride_rh,
    stride_rp,
    stride_cb,
    stride_ch,
    stride_cp,
    stride_ct,
    stride_lb,
    stride_lh,
    Hkv,
    P,
    T,
    R,
    HALF,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """The compact record read as stored: int8 centroid with its page scale, the int4 basis two rows per
    byte (row j low nibble, row HALF + j high nibble, stored + 8) with one scale per column, int8
    coefficients with their page scale; unpacked in registers, never written back."""
    pid_bh, b, h, offs_p = program_block(Hkv, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    offs_j = tl.arange(0, BLOCK_H)
    offs_t = tl.arange(0, BLOCK_T)
    offs_r = tl.arange(0, BLOCK_R)
    p_mask = offs_p < P
    d_mask = offs_d < D
    j_mask = offs_j < HALF
    hi_mask = (HALF + offs_j) < D
    r_mask = offs_r < R

    length = tl.load(PL + b * stride_lb + h * stride_lh + offs_p, mask=p_mask, other=0)  # (BLOCK_P,)
    page_s = b * stride_sb + h * stride_sh + offs_p  # the per-page scales share one layout
    mu = (
        tl.load(
            MUQ + b * stride_mb + h * stride_mh + offs_p[:, None] * stride_mp + offs_d[None, :],
            mask=p_mask[:, None] & d_mask[None, :],
            other=0,
        ).to(tl.float32)
        * tl.load(MUS + page_s, mask=p_mask, other=0.0).to(tl.float32)[:, None]
    )
    packed = tl.load(
        BQ
        + b * stride_bb
        + h * stride_bh
        + offs_p[:, None, None] * stride_bp
        + offs_j[None, :, None] * stride_bd
        + offs_r[None, None, :],
        mask=p_mask[:, None, None] & j_mask[None, :, None] & r_mask[None, None, :],
        other=0x88,
    ).to(tl.int32)  # (BLOCK_P, BLOCK_H, BLOCK_R); masked bytes hold two zero levels
    lo = ((packed & 15) - 8).to(tl.float32)
    hi = ((packed >> 4) - 8).to(tl.float32)
    col_scale = tl.load(
        BS + b * stride_rb + h * stride_rh + offs_p[:, None] * stride_rp + offs_r[None, :],
        mask=p_mask[:, None] & r_mask[None, :],
        other=0.0,
    ).to(tl.float32)  # (BLOCK_P, BLOCK_R)
    t_valid = offs_t[None, :] < length[:, None]  # (BLOCK_P, BLOCK_T)
    coef = (
        tl.load(
            CQ
            + b * stride_cb
            + h * stride_ch
            + offs_p[:, None, None] * stride_cp
            + offs_t[None, :, None] * stride_ct
            + offs_r[None, None, :],
            mask=t_valid[:, :, None] & (offs_t[None, :, None] < T) & r_mask[None, None, :],
            other=0,
        ).to(tl.float32)
        * tl.load(CS + page_s, mask=p_mask, other=0.0).to(tl.float32)[:, None, None]
    )

    for g in tl.static_range(G):
        row = Q + b * stride_qb + (h * G + g) * stride_qh
        qg = tl.load(row + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        q_lo = tl.load(row + offs_j, mask=j_mask, other=0.0).to(tl.float32)
        q_hi = tl.load(row + HALF + offs_j, mask=j_mask & hi_mask, other=0.0).to(tl.float32)
        qmu = tl.sum(mu * qg[None, :], 1)  # (BLOCK_P,)
        qv = tl.sum(lo * q_lo[None, :, None] + hi * q_hi[None, :, None], 1) * col_scale  # (BLOCK_P, BLOCK_R)
        qvc = tl.sum(coef * qv[:, None, :], 2)  # (BLOCK_P, BLOCK_T)
        raw = _page_logsumexp((qmu[:, None] + qvc) * scale, t_valid, length)
        tl.store(RAW + ((pid_bh * G + g) * P) + offs_p, raw, mask=p_mask)


def page_score_lowrank_compact_triton(
    q: torch.Tensor,
    record: dict[str, torch.Tensor],
    page_len: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    mu_q, basis_q, coef_q = record["mu_q"], record["basis_q"], record["coef_q"]
    B, _, D = q.shape
    Hkv, P, HALF = mu_q.shape[1], mu_q.shape[2], basis_q.shape[3]
    T, R = coef_q.shape[3], coef_q.shape[4]
    G, scale, raw = raw_page_scores(q, Hkv, P, scale)
    if P == 0:
        return combine_gqa_triton(raw)
    q, mu_q, basis_q, coef_q = (last_contiguous(x) for x in (q, mu_q, basis_q, coef_q))
    mu_s, coef_s = record["mu_scale"].contiguous(), record["coef_scale"].contiguous()  # (B, Hkv, P) both
    col_s = last_contiguous(record["basis_scale"])
    page_len = page_len.to(torch.int32).contiguous()
    BLOCK_D = triton.next_power_of_2(D)
    BLOCK_H = triton.next_power_of_2(HALF)
    BLOCK_R = triton.next_power_of_2(R)
    BLOCK_T = triton.next_power_of_2(T)
    # about 8k basis entries per program, as the float kernel (two per loaded byte)
    BLOCK_P = max(1, min(triton.next_power_of_2(P), 8192 // (2 * BLOCK_H * BLOCK_R)))
    _lowrank_compact_raw_kernel[(B * Hkv, triton.cdiv(P, BLOCK_P))](
        q,
        mu_q,
        mu_s,
        basis_q,
        col_s,
        coef_q,
        coef_s,
        page_len,
        raw,
        scale,
        q.stride(0),
        q.stride(1),
        mu_q.stride(0),
        mu_q.stride(1),
        mu_q.stride(2),
        mu_s.stride(0),
        mu_s.stride(1),
        basis_q.stride(0),
        basis_q.stride(1),
        basis_q.stride(2),
        basis_q.stride(3),
        col_s.stride(0),
        col_s.stride(1),
        col_s.stride(2),
        coef_q.stride(0),
        coef_q.stride(1),
        coef_q.stride(2),
        coef_q.stride(3),
        page_len.stride(0),
        page_len.stride(1),
        Hkv,
        P,
        T,
        R,
        HALF,
        G=G,
        D=D,
        BLOCK_P=BLOCK_P,
        BLOCK_D=BLOCK_D,
        BLOCK_H=BLOCK_H,
        BLOCK_T=BLOCK_T,
        BLOCK_R=BLOCK_R,
    )
    return combine_gqa_triton(raw)
