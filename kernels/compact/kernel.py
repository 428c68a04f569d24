"""Compaction (Triton): gather the kept tokens of each head into contiguous storage after eviction.

One program per (batch * head, block of BLOCK_M output slots) copies BLOCK_M rows of K and of V
(each row D contiguous elements: coalesced), zero-filling the slots that have no token (-1 or past M).
Reference: reference.compact_kv_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from mm_oval.kernels.common.triton_utils import last_contiguous, program_block


@triton.jit
def _compact_kernel(
    K,
    V,
    IDX,
    KO,
    VO,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_ib,
    stride_ih,
    H,
    M,
    C,
    D,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_bh, b, h, offs_m = program_block(H, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    idx = tl.load(IDX + b * stride_ib + h * stride_ih + offs_m, mask=offs_m < M, other=-1).to(tl.int64)
    has = idx >= 0
    src_mask = has[:, None] & d_mask[None, :]
    dst_mask = (offs_m < C)[:, None] & d_mask[None, :]
    safe = tl.where(has, idx, 0)
    dst = (pid_bh.to(tl.int64) * C + offs_m)[:, None] * D + offs_d[None, :]
    k = tl.load(
        K + b * stride_kb + h * stride_kh + safe[:, None] * stride_kn + offs_d[None, :],
        mask=src_mask,
        other=0.0,
    )
    tl.store(KO + dst, k, mask=dst_mask)
    v = tl.load(
        V + b * stride_vb + h * stride_vh + safe[:, None] * stride_vn + offs_d[None, :],
        mask=src_mask,
        other=0.0,
    )
    tl.store(VO + dst, v, mask=dst_mask)


def compact_kv_triton(
    k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, capacity: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, _, D = k.shape
    M = index.shape[-1]
    C = M if capacity is None else capacity
    k = last_contiguous(k)
    v = last_contiguous(v)
    index = index.contiguous()
    k_out = torch.empty((B, H, C, D), dtype=k.dtype, device=k.device)
    v_out = torch.empty((B, H, C, D), dtype=v.dtype, device=v.device)
    if C == 0 or B * H == 0:
        return k_out, v_out
    BLOCK_D = triton.next_power_of_2(D)
    BLOCK_M = max(1, min(64, 8192 // BLOCK_D))
    _compact_kernel[(B * H, triton.cdiv(C, BLOCK_M))](
        k,
        v,
        index,
        k_out,
        v_out,
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        index.stride(0),
        index.stride(1),
        H,
        M,
        C,
        D,
        BLOCK_M=BLOCK_M,
        BLOCK_D=BLOCK_D,
    )
    return k_out, v_out
