"""Sparse paged decode attention (Triton).

One program per (batch, KV head, split): the query heads of the GQA group sit together in the M
dimension of the tile (padded to 16 for tl.dot), so the K/V of a page are read once for the whole
group. The program walks its share of the selected pages in one flat loop over BLOCK_N-token tiles;
a tile holds PPT selected pages of up to CHUNK tokens each (a page is a contiguous run of that head's
storage, so each tile row is D contiguous elements: coalesced), pages longer than CHUNK take several
tiles. The softmax is online, in fp32 (exp2 domain). With few (batch, head) programs the selected pages are split over `num_splits`
programs per head and the partial results are merged by log-sum-exp in a second small kernel.
Reference: reference.sparse_paged_decode_ref; layout: docs/kernels.md.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from mm_oval.kernels.common.triton_utils import last_contiguous

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)


@triton.jit
def _sparse_decode_kernel(
    Q,
    K,
    V,
    PS,
    PL,
    PI,
    O_part,
    L_part,
    scale_log2,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_pb,
    stride_ph,
    stride_ib,
    stride_ih,
    Hkv,
    S,
    pages_per_split,
    num_splits,
    chunks_per_page,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PPT: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid_bh // Hkv).to(tl.int64)  # int64: b * stride_kb passes 2**31 at batch 16, 32k context
    h = pid_bh % Hkv

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < G
    d_mask = offs_d < D

    q_ptrs = Q + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    pt_base = b * stride_pb + h * stride_ph
    idx_base = PI + b * stride_ib + h * stride_ih

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)

    # One flat loop over tiles, so the compiler can pipeline the loads of the next tiles: a tile is
    # chunk `c` (CHUNK tokens) of PPT consecutive selected pages; pages longer than CHUNK take
    # `chunks_per_page` tiles. BLOCK_N = PPT * CHUNK token rows per tile.
    s_lo = split * pages_per_split
    s_hi = tl.minimum(s_lo + pages_per_split, S)
    offs_pp = tl.arange(0, PPT)
    offs_c = tl.arange(0, CHUNK)
    num_tiles = tl.cdiv(s_hi - s_lo, PPT) * chunks_per_page
    for t in range(0, num_tiles):
        group = t // chunks_per_page
        c0 = (t % chunks_per_page) * CHUNK
        slot = s_lo + group * PPT + offs_pp
        page = tl.load(idx_base + slot, mask=slot < s_hi, other=-1)
        has_page = page >= 0
        start = tl.load(PS + pt_base + page, mask=has_page, other=0)
        length = tl.load(PL + pt_base + page, mask=has_page, other=0)
        tok = c0 + offs_c
        valid = tl.reshape(tok[None, :] < length[:, None], (BLOCK_N,))
        rows = tl.reshape(start[:, None] + tok[None, :], (BLOCK_N,))
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_base + rows[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + rows[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k)) * scale_log2  # (BLOCK_G, BLOCK_N), fp32
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = tl.where(m_new > float("-inf"), m_new, 0.0)  # a tile of padding must not make NaNs
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(qk - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    read = l_i > 0
    out = acc / tl.where(read, l_i, 1.0)[:, None]
    lse = tl.where(read, (m_i + tl.log2(tl.where(read, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    # partial buffers: O_part (B * Hkv, num_splits, G, D), L_part (B * Hkv, num_splits, G), contiguous
    row = (pid_bh * num_splits + split) * G + offs_g
    tl.store(O_part + row[:, None] * D + offs_d[None, :], out, mask=g_mask[:, None] & d_mask[None, :])
    tl.store(L_part + row, lse, mask=g_mask)


@triton.jit
def _merge_splits_kernel(
    O_part,
    L_part,
    Out,
    Lse,
    num_splits,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # one program per (batch * KV head, group member) = per query head (query head index = pid)
    pid = tl.program_id(0)
    bh = pid // G
    g = pid % G
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    m = tl.full([1], float("-inf"), dtype=tl.float32)
    for sp in range(0, num_splits):
        m = tl.maximum(m, tl.load(L_part + (bh * num_splits + sp) * G + g + tl.zeros([1], dtype=tl.int32)))
    m_safe = tl.where(m > float("-inf"), m, 0.0)
    den = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for sp in range(0, num_splits):
        row = (bh * num_splits + sp) * G + g
        lse_s = tl.load(L_part + row + tl.zeros([1], dtype=tl.int32))
        w = tl.exp(lse_s - m_safe)
        den += w
        o = tl.load(O_part + row * D + offs_d, mask=d_mask, other=0.0)
        acc += o * w
    read = den > 0
    out = acc / tl.where(read, den, 1.0)
    lse = tl.where(read, m_safe + tl.log(tl.where(read, den, 1.0)), float("-inf"))
    tl.store(Out + pid * D + offs_d, out.to(Out.dtype.element_ty), mask=d_mask)
    tl.store(Lse + pid + tl.zeros([1], dtype=tl.int32), lse)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a couple of splits so both paths run


def choose_num_splits(batch_heads: int, num_selected: int, device: torch.device) -> int:
    """Split the selected pages over programs until there are about four programs per SM (two resident
    per SM at the kernel's shared-memory use, so two waves)."""
    target = 4 * _num_sms(device)
    if batch_heads >= target or num_selected <= 1:
        return 1
    return max(1, min(num_selected, -(-target // batch_heads), 64))


def sparse_paged_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_start: torch.Tensor,
    page_len: torch.Tensor,
    page_idx: torch.Tensor,
    scale: float | None = None,
    num_splits: int | None = None,
    max_page_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    G = Hq // Hkv
    S = page_idx.shape[-1]
    scale = D**-0.5 if scale is None else scale
    out_dtype = q.dtype
    q = q.to(k_cache.dtype)  # tl.dot wants one input dtype: the query takes the cache's
    q = last_contiguous(q)
    k_cache = last_contiguous(k_cache)
    v_cache = last_contiguous(v_cache)
    page_start = page_start.to(torch.int32).contiguous()
    page_len = page_len.to(torch.int32).contiguous()
    page_idx = page_idx.to(torch.int32).contiguous()
    if max_page_len is None:  # a device sync: callers that know their page capacity pass it
        max_page_len = int(page_len.max()) if page_len.numel() else 0
    BLOCK_G = max(16, triton.next_power_of_2(G))
    BLOCK_D = max(16, triton.next_power_of_2(D))
    BLOCK_N = 64 if BLOCK_D <= 128 else 32
    CHUNK = min(triton.next_power_of_2(max(max_page_len, 1)), BLOCK_N)
    PPT = BLOCK_N // CHUNK
    chunks_per_page = -(-max_page_len // CHUNK)
    if num_splits is None:
        num_splits = choose_num_splits(B * Hkv, S, q.device)
    num_splits = max(1, min(num_splits, max(S, 1)))
    pages_per_split = -(-S // num_splits) if S else 0
    if num_splits > 1:  # whole tiles of PPT pages per split
        pages_per_split = -(-pages_per_split // PPT) * PPT
    num_splits = max(1, -(-S // pages_per_split)) if S else 1

    o_part = torch.empty((B * Hkv, num_splits, G, D), dtype=torch.float32, device=q.device)
    l_part = torch.empty((B * Hkv, num_splits, G), dtype=torch.float32, device=q.device)
    _sparse_decode_kernel[(B * Hkv, num_splits)](
        q,
        k_cache,
        v_cache,
        page_start,
        page_len,
        page_idx,
        o_part,
        l_part,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        page_start.stride(0),
        page_start.stride(1),
        page_idx.stride(0),
        page_idx.stride(1),
        Hkv,
        S,
        pages_per_split,
        num_splits,
        chunks_per_page,
        G=G,
        D=D,
        BLOCK_G=BLOCK_G,
        BLOCK_D=BLOCK_D,
        BLOCK_N=BLOCK_N,
        PPT=PPT,
        CHUNK=CHUNK,
        num_warps=4,
        num_stages=3,
    )
    if num_splits == 1:
        return o_part.view(B, Hq, D).to(out_dtype), l_part.view(B, Hq)
    out = torch.empty((B, Hq, D), dtype=out_dtype, device=q.device)
    lse = torch.empty((B, Hq), dtype=torch.float32, device=q.device)
    _merge_splits_kernel[(B * Hq,)](
        o_part, l_part, out, lse, num_splits, G=G, D=D, BLOCK_D=BLOCK_D, num_warps=1
    )
    return out, lse
