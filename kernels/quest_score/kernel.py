"""Quest page scoring (Triton): the upper bound of q . k over a page from its per-channel key minimum
and maximum, scale * sum_c max(q_c kmin_c, q_c kmax_c), then the GQA combination
(common.triton_utils.combine_gqa_triton).

One program per (batch, KV head, block of BLOCK_P pages): for each query head of the group it reads the
block's kmin/kmax and writes one raw score per page. Reference: naive.py; layout: docs/kernels.md.
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
def _quest_raw_kernel(
    Q,
    KMIN,
    KMAX,
    PL,
    RAW,
    scale,
    stride_qb,
    stride_qh,
    stride_nb,
    stride_nh,
    stride_np,
    stride_xb,
    stride_xh,
    stride_xp,
    stride_lb,
    stride_lh,
    Hkv,
    P,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_bh, b, h, offs_p = program_block(Hkv, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    p_mask = offs_p < P
    d_mask = offs_d < D
    pd_mask = p_mask[:, None] & d_mask[None, :]
    length = tl.load(PL + b * stride_lb + h * stride_lh + offs_p, mask=p_mask, other=0)
    kmin = tl.load(
        KMIN + b * stride_nb + h * stride_nh + offs_p[:, None] * stride_np + offs_d[None, :],
        mask=pd_mask,
        other=0.0,
    ).to(tl.float32)
    kmax = tl.load(
        KMAX + b * stride_xb + h * stride_xh + offs_p[:, None] * stride_xp + offs_d[None, :],
        mask=pd_mask,
        other=0.0,
    ).to(tl.float32)
    for g in tl.static_range(G):
        qg = query_row(Q, b, stride_qb, stride_qh, h * G + g, offs_d, d_mask)
        s = tl.sum(tl.maximum(kmin * qg[None, :], kmax * qg[None, :]), 1) * scale
        s = tl.where(length > 0, s, float("-inf"))
        tl.store(RAW + ((pid_bh * G + g) * P) + offs_p, s, mask=p_mask)


def page_score_quest_triton(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    page_len: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    B, _, D = q.shape
    Hkv, P = kmin.shape[1], kmin.shape[2]
    G, scale, raw = raw_page_scores(q, Hkv, P, scale)
    if P == 0:
        return combine_gqa_triton(raw)
    q, kmin, kmax = (last_contiguous(x) for x in (q, kmin, kmax))
    page_len = page_len.to(torch.int32).contiguous()
    BLOCK_D = triton.next_power_of_2(D)
    BLOCK_P = max(1, min(triton.next_power_of_2(P), 4096 // BLOCK_D))
    _quest_raw_kernel[(B * Hkv, triton.cdiv(P, BLOCK_P))](
        q,
        kmin,
        kmax,
        page_len,
        raw,
        scale,
        q.stride(0),
        q.stride(1),
        kmin.stride(0),
        kmin.stride(1),
        kmin.stride(2),
        kmax.stride(0),
        kmax.stride(1),
        kmax.stride(2),
        page_len.stride(0),
        page_len.stride(1),
        Hkv,
        P,
        G=G,
        D=D,
        BLOCK_P=BLOCK_P,
        BLOCK_D=BLOCK_D,
    )
    return combine_gqa_triton(raw)
