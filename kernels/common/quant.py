"""The quantised storage formats the kernels read: symmetric round-to-nearest quantisers with fp16 scales.

A scale is the largest magnitude it covers over the largest level (7 for int4, 127 for int8), made fp16 and
rounded up, so that no value falls outside the levels; an all-zero group has scale 0. Used by the compact
LOCKS / OVAL record (lowrank_score.record), Quest's compact key bounds and the router's int8 records.
"""

from __future__ import annotations

import torch

INT4_LEVEL = 7
INT8_LEVEL = 127


def fp16_scale(amax: torch.Tensor, level: int) -> torch.Tensor:
    """An fp16 scale for a group of largest magnitude amax, as small as fp16 allows with level * scale >= amax
    (the product is exact in fp32), 0 only when amax is 0; groups beyond 65504 * level saturate at 65504."""
    a = amax.float()
    s = (a / level).clamp(max=65504.0).to(torch.float16)
    for _ in range(2):  # fp16 (and the fp32 quotient) round to nearest: step up to the next fp16 where short
        short = (s.float() * level < a) & (s < 65504.0)
        s = torch.where(short, (s.view(torch.int16) + 1).view(torch.float16), s)
    return s


def safe_scale(scale: torch.Tensor) -> torch.Tensor:
    s = scale.float()
    return torch.where(s > 0, s, torch.ones_like(s))


def quantize_int4_columns(basis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Basis (..., D, r) -> packed (..., H, r) uint8 with H = ceil(D/2), and scale (..., r) fp16, one scale
    per column.

    Each entry is round(x / scale) in [-7, 7] (symmetric, round to nearest), stored as the nibble x + 8;
    byte j of a column holds row j (low nibble) and row H + j (high nibble), the two halves of the column
    (an odd D is padded with a zero row). H r + 2 r bytes; `dequantize_int4_columns` undoes it to within
    scale / 2 per entry."""
    x = basis.float()
    d = x.shape[-2]
    scale = fp16_scale(x.abs().amax(-2), INT4_LEVEL)  # (..., r)
    q = torch.round(x / safe_scale(scale).unsqueeze(-2)).clamp(-INT4_LEVEL, INT4_LEVEL)
    q = (q + 8).to(torch.uint8)  # 1 .. 15
    if d % 2:
        q = torch.nn.functional.pad(q, (0, 0, 0, 1), value=8)
    half = q.shape[-2] // 2
    packed = q[..., :half, :] | (q[..., half:, :] << 4)
    return packed, scale


def int4_levels(packed: torch.Tensor, d: int) -> torch.Tensor:
    """The levels (integers in [-7, 7], as fp32) of a `quantize_int4_columns` record:
    (..., H, r) -> (..., D, r)."""
    half = packed.shape[-2]
    out = packed.new_empty((*packed.shape[:-2], 2 * half, packed.shape[-1]), dtype=torch.float32)
    # one pass each straight into the fp32 result: the unpacking costs little more than writing it
    out[..., :half, :] = packed & 0x0F
    out[..., half:, :] = packed >> 4
    return out[..., :d, :].sub_(8)


def dequantize_int4_columns(packed: torch.Tensor, scale: torch.Tensor, d: int) -> torch.Tensor:
    """Inverse of `quantize_int4_columns`: packed (..., H, r) uint8, scale (..., r) -> (..., D, r) fp32."""
    return int4_levels(packed, d).mul_(scale.float().unsqueeze(-2))


def quantize_int8(x: torch.Tensor, group_dims: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., *group) -> int8 of x's shape and scale (...) fp16: one scale per group of the last `group_dims`
    dims, round(x / scale) in [-127, 127]. numel + 2 bytes per group; back within scale / 2 per entry."""
    xf = x.float()
    dims = tuple(range(-group_dims, 0))
    scale = fp16_scale(xf.abs().amax(dims), INT8_LEVEL)
    s = safe_scale(scale).reshape(*scale.shape, *([1] * group_dims))
    return torch.round(xf / s).clamp(-INT8_LEVEL, INT8_LEVEL).to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantize_int8`: q (..., *group) int8, scale (...) -> fp32 of q's shape."""
    extra = q.dim() - scale.dim()
    return q.float() * scale.float().reshape(*scale.shape, *([1] * extra))
