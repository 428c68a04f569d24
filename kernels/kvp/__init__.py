"""KVP agent scoring: every KV head's agent of one layer over that layer's keys, values, positions and
per-token extra features (kernel.py: Triton; naive.py: the reference and the agents' arithmetic)."""

from __future__ import annotations

import torch
from mm_oval.kernels.common.dispatch import HAS_TRITON, backend, check

from . import naive
from .naive import KVPWeights

if HAS_TRITON:
    from .kernel import kvp_score_triton


def kvp_score(
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    weights: KVPWeights,
    extra: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scores of the KVP agents of one layer: keys, values (B, H, N, D), positions (B, N), extra (B, N, X)
    per-token features when the agents read them (`weights.extra_width` = X) -> (B, H, N) fp32."""
    what = "kvp_score"
    check(
        keys.dim() == 4 and values.shape == keys.shape, f"{what}: keys and values must both be (B, H, N, D)"
    )
    B, H, N, D = keys.shape
    check(
        positions.shape == (B, N),
        f"{what}: positions must be (B, N) = ({B}, {N}), got {tuple(positions.shape)}",
    )
    check(
        weights.num_heads == H and weights.head_dim == D,
        f"{what}: the agents are for {weights.num_heads} heads of dim {weights.head_dim}, the layer has {H} of dim {D}",
    )
    X = weights.extra_width
    if X:
        check(
            extra is not None and tuple(extra.shape) == (B, N, X),
            f"{what}: these agents read {X} extra features per token; pass extra of shape ({B}, {N}, {X}), "
            f"got {None if extra is None else tuple(extra.shape)}",
        )
    else:
        check(extra is None, f"{what}: these agents read no extra features; pass extra=None")
    fn = kvp_score_triton if backend(keys) == "triton" else naive.kvp_score_naive
    return fn(keys, values, positions, weights, extra)
