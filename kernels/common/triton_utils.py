"""Triton pieces shared by the kernels: the GQA combination of page scores (twin of gqa.combine_gqa)
and stride helpers. Importing this module needs Triton; `INTERPRETED` says whether Triton's
interpreter runs the kernels (TRITON_INTERPRET=1 before the import)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def last_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x with unit stride in its last dimension (the kernels load rows as contiguous vectors)."""
    return x if x.stride(-1) == 1 else x.contiguous()


@triton.jit
def program_block(H, BLOCK: tl.constexpr):
    """For a grid (B * H, blocks of BLOCK): this program's flat (batch, head) index, its batch (int64, so
    that batch offsets do not overflow) and head, and the offsets of its block along the second axis."""
    pid_bh = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    return pid_bh, (pid_bh // H).to(tl.int64), pid_bh % H, offs


@triton.jit
def query_row(Q, b, stride_qb, stride_qh, row, offs_d, d_mask):
    """Query head `row` of batch b of a (B, Hq, D) decode query, in fp32."""
    return tl.load(Q + b * stride_qb + row * stride_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32)


def raw_page_scores(q: torch.Tensor, num_kv_heads: int, num_pages: int, scale: float | None):
    """What a page-scoring launch starts from: (G, the softmax scale, an fp32 (B, Hkv, G, P) buffer for the
    per-query-head scores that combine_gqa_triton turns into the op's result)."""
    B, Hq, D = q.shape
    G = Hq // num_kv_heads
    raw = torch.empty((B, num_kv_heads, G, num_pages), dtype=torch.float32, device=q.device)
    return G, D**-0.5 if scale is None else scale, raw


@triton.jit
def _combine_gqa_kernel(
    RAW,
    OUT,
    P,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    # RAW (B * Hkv, G, P) -> OUT (B * Hkv, P): log(mean_g softmax_p(RAW[g])); one program per (b, h),
    # two passes over its raw scores (max and sum per query head, then the group average)
    pid = tl.program_id(0)
    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < G
    base = RAW + pid * G * P
    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    z = tl.zeros([BLOCK_G], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        mask = g_mask[:, None] & (offs_p[None, :] < P)
        r = tl.load(base + offs_g[:, None] * P + offs_p[None, :], mask=mask, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(r, 1))
        m_new_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        z = z * tl.exp(m - m_new_safe) + tl.sum(tl.exp(r - m_new_safe[:, None]), 1)
        m = m_new
    m_safe = tl.where(m > float("-inf"), m, 0.0)
    inv_z = tl.where(z > 0, 1.0 / tl.where(z > 0, z, 1.0), 0.0)
    for p0 in range(0, P, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        p_mask = offs_p < P
        mask = g_mask[:, None] & p_mask[None, :]
        r = tl.load(base + offs_g[:, None] * P + offs_p[None, :], mask=mask, other=float("-inf"))
        prob = tl.sum(tl.exp(r - m_safe[:, None]) * inv_z[:, None], 0) / G
        logp = tl.where(prob > 0, tl.log(tl.where(prob > 0, prob, 1.0)), float("-inf"))
        tl.store(OUT + pid * P + offs_p, logp, mask=p_mask)


INTERPRETED = type(_combine_gqa_kernel).__name__ == "InterpretedFunction"


def combine_gqa_triton(raw: torch.Tensor) -> torch.Tensor:
    """raw (B, Hkv, G, P) fp32 contiguous -> (B, Hkv, P) fp32, as gqa.combine_gqa."""
    B, Hkv, G, P = raw.shape
    out = torch.empty((B, Hkv, P), dtype=torch.float32, device=raw.device)
    if P == 0 or B * Hkv == 0:
        return out
    BLOCK_P = min(1024, triton.next_power_of_2(P))
    _combine_gqa_kernel[(B * Hkv,)](raw, out, P, G=G, BLOCK_G=triton.next_power_of_2(G), BLOCK_P=BLOCK_P)
    return out
