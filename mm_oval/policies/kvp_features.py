"""The per-token features KVP agents may read beyond key, value and position: the token's modality, its
(row, col) in the image patch grid, and its relative place in the prompt. Shared by all agents of a
model (one (..., N, X) tensor per request), computed the same way in training and at inference."""

from __future__ import annotations

import math

import torch

from .base import IMAGE, PAD, TEXT

EXTRA_FEATURES = ("modality", "grid", "relpos")
FOURIER = (1.0, 2.0, 4.0)
# width of each extra feature group (see `extra_features`)
EXTRA_WIDTH = {"modality": 2, "grid": 2 + 4 * len(FOURIER), "relpos": 2 + 2 * len(FOURIER)}


def extra_width(features: tuple[str, ...]) -> int:
    """X, the width of the features `features` select."""
    return sum(EXTRA_WIDTH[f] for f in features)


def extra_features(
    positions: torch.Tensor,
    modality: torch.Tensor,
    image_rc: torch.Tensor,
    features: tuple[str, ...],
    grid_side: int = 0,
) -> torch.Tensor:
    """Per-token features shared by all agents: (..., N) inputs -> (..., N, E) float32.

    modality: one-hot text / image. grid: normalised (row, col) of image tokens and their Fourier
    features (zeros for text). relpos: place in the prompt (position / last position, and log-distance
    to the end) with Fourier features."""
    out: list[torch.Tensor] = []
    pos = positions.float()
    valid = modality != PAD
    if "modality" in features:
        out.append(torch.stack([(modality == TEXT).float(), (modality == IMAGE).float()], dim=-1))
    if "grid" in features:
        is_img = (modality == IMAGE) & (image_rc[..., 1] >= 0)
        rc = image_rc[..., 1:3].float().clamp(min=0)
        if grid_side > 1:
            side = torch.full_like(rc[..., :1], float(grid_side - 1))
        else:  # infer the grid from the prompt itself
            side = rc.masked_fill(~is_img[..., None], 0).amax(dim=-2, keepdim=True).amax(-1, keepdim=True)
            side = side.clamp(min=1.0).expand_as(rc[..., :1])
        rcn = (rc / side).clamp(0, 1)
        feats = [rcn]
        for f in FOURIER:
            feats += [torch.sin(math.pi * f * rcn), torch.cos(math.pi * f * rcn)]
        g = torch.cat(feats, dim=-1) * is_img[..., None].float()
        out.append(g)
    if "relpos" in features:
        last = pos.masked_fill(~valid, -1).amax(dim=-1, keepdim=True).clamp(min=1.0)
        q = (pos / last).clamp(0, 1)
        dist = torch.log1p((last - pos).clamp(min=0)) / math.log1p(4096.0)
        feats = [q[..., None], dist[..., None]]
        for f in FOURIER:
            feats += [torch.sin(math.pi * f * q)[..., None], torch.cos(math.pi * f * q)[..., None]]
        out.append(torch.cat(feats, dim=-1))
    if not out:
        return positions.new_zeros((*positions.shape, 0), dtype=torch.float32)
    return torch.cat(out, dim=-1) * valid[..., None].float()
