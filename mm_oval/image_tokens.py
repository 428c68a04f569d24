"""How many tokens one image takes in a LLaVA prompt, and where each of them sits on the patch grid: one
definition for the chat, the trainers and the harness.

The count is the vision tower's (image_size // patch_size)^2 (+1 with the "full" feature strategy, which keeps
the CLS token), else the model's `config.image_seq_length`. An image's tokens come in one contiguous run,
row-major on a grid that is square when the count is a square (LLaVA-1.5: 24 x 24), else one row.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .errors import ModelError


def tokens_per_image(config: Any, default: int | None = None) -> int:
    """The image token count of a LLaVA config; `default` (or a ModelError) when the config does not say."""
    n = getattr(config, "image_seq_length", None)
    vc = getattr(config, "vision_config", None)
    if vc is not None and getattr(vc, "image_size", None) and getattr(vc, "patch_size", None):
        n = (vc.image_size // vc.patch_size) ** 2
        if getattr(config, "vision_feature_select_strategy", "default") == "full":
            n += 1
    if n:
        return int(n)
    if default is not None:
        return int(default)
    raise ModelError("cannot tell how many tokens one image takes (no vision_config.image_size/patch_size)")


def grid_shape(tokens: int) -> tuple[int, int]:
    """(rows, cols) of an image's `tokens` patches: square when `tokens` is a square, else one row."""
    side = math.isqrt(max(int(tokens), 1))
    return (side, side) if side * side == tokens else (1, max(int(tokens), 1))


def grid_coords(input_ids: torch.Tensor, image_token_id: int, tokens: int) -> torch.Tensor:
    """(N,) ids -> (N, 3) long: (image index, row, col) of each image token, -1 elsewhere."""
    rc = torch.full((input_ids.shape[-1], 3), -1, dtype=torch.long)
    pos = (input_ids == image_token_id).nonzero().flatten()
    k = torch.arange(pos.numel())
    cols = grid_shape(tokens)[1]
    off = k % tokens
    rc[pos] = torch.stack([k // tokens, off // cols, off % cols], dim=1)
    return rc
