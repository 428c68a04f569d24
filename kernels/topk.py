"""Top-k page selection per (batch, KV head) with always-kept pages (Triton).

One program per (batch, KV head) holds that head's page scores in registers (P is a few thousand at
most: 32k tokens / 16-token pages = 2048), writes the kept pages first (skipping duplicates and
out-of-range entries), masks them, then takes the arg-max k times (ties: lowest index, as the
reference's stable sort). Reference: reference.select_pages_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _select_pages_kernel(
    SC,
    KEEP,
    OUT,
    stride_sb,
    stride_sh,
    stride_kb,
    stride_kh,
    Hkv,
    P,
    K0,
    k,
    BLOCK_P: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // Hkv).to(tl.int64)
    h = pid % Hkv
    offs_p = tl.arange(0, BLOCK_P)
    offs_k = tl.arange(0, BLOCK_K)
    s = tl.load(SC + b * stride_sb + h * stride_sh + offs_p, mask=offs_p < P, other=float("-inf")).to(
        tl.float32
    )
    s = tl.where(s == s, s, float("-inf"))  # NaN never selected
    taken = tl.zeros([BLOCK_P], dtype=tl.int32)
    res = tl.full([BLOCK_K], -1, dtype=tl.int32)
    pos = tl.zeros([1], dtype=tl.int32)
    for i in range(0, K0):
        kp = tl.load(KEEP + b * stride_kb + h * stride_kh + i + tl.zeros([1], dtype=tl.int32))
        hit = offs_p == kp
        seen = tl.sum(tl.where(hit, taken, 0), 0, keep_dims=True)
        ok = (kp >= 0) & (kp < P) & (seen == 0)
        res = tl.where((offs_k == pos) & ok, kp, res)
        taken = tl.where(hit & ok, 1, taken)
        pos += ok.to(tl.int32)
    s = tl.where(taken > 0, float("-inf"), s)
    for _ in range(0, k):
        best = tl.max(s, 0, keep_dims=True)
        arg = tl.argmax(s, 0, keep_dims=True)
        ok = (pos < k) & (best > float("-inf"))
        res = tl.where((offs_k == pos) & ok, arg.to(tl.int32), res)
        pos += ok.to(tl.int32)
        s = tl.where(offs_p == arg, float("-inf"), s)
    tl.store(OUT + pid * k + offs_k, res, mask=offs_k < k)


def select_pages_triton(scores: torch.Tensor, k: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    B, Hkv, P = scores.shape
    out = torch.empty((B, Hkv, k), dtype=torch.int32, device=scores.device)
    if k == 0:
        return out
    if keep is None or keep.shape[-1] == 0:
        keep = torch.full((B, Hkv, 1), -1, dtype=torch.int32, device=scores.device)
    keep = keep.to(torch.int32).contiguous()
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    _select_pages_kernel[(B * Hkv,)](
        scores,
        keep,
        out,
        scores.stride(0),
        scores.stride(1),
        keep.stride(0),
        keep.stride(1),
        Hkv,
        P,
        keep.shape[-1],
        k,
        BLOCK_P=triton.next_power_of_2(max(P, 1)),
        BLOCK_K=triton.next_power_of_2(k),
        num_warps=4 if P <= 1024 else 8,
    )
    return out
