"""Redundancy-aware selection over KVP scores: keep a token less when one like it is already kept.

The agents score every token on its own, and their training reward adds up the future attention each kept
token receives, so it gains as much from a second copy of a token as from the first. Attention does not:
once one of several tokens with the same key and value is kept, the others add almost nothing to the
output (the kept one takes their share of the attention after the softmax). On an image whose objects
cover many patches, a per-token ranking therefore spends a small budget on every patch of some objects and
none of others. The selection here walks the tokens greedily, best first by

    gain_i = z_i - redundancy * max_{j kept} sim(i, j)

where z is the agents' score standardised over the head's tokens and sim(i, j) is the cosine of the two
keys (clamped at 0), times exp(-d^2 / (2 sigma^2)) for image tokens d patches apart in the same image
(`sigma` 0: the keys alone). Only image tokens are made to compete with each other; text tokens keep the
agents' order. The greedy order is returned as scores (higher first), so the cache's top-k for any budget
is the greedy prefix of that length (the image tokens take the head's image scores in that order, so
they keep the agents' scale beside the text tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError
from .base import IMAGE, PAD


@dataclass(frozen=True)
class RedundancySelection:
    """How the agents' scores become a selection: `redundancy` (>= 0; 0 = the agents' own order) and
    `sigma` (>= 0, in image patches; 0 = no spatial term)."""

    redundancy: float = 0.0
    sigma: float = 0.0

    def __post_init__(self) -> None:
        for name in ("redundancy", "sigma"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not float(v) >= 0.0:
                raise ConfigError(f"KVP option {name} must be a number >= 0, got {v!r}")

    @property
    def active(self) -> bool:
        return float(self.redundancy) > 0.0

    @classmethod
    def from_dict(cls, d: dict | None, where: str = "KVP agents config") -> RedundancySelection:
        d = d or {}
        unknown = set(d) - {"redundancy", "sigma"}
        if unknown:
            raise ConfigError(f"{where}: unknown selection settings {sorted(unknown)}; use redundancy, sigma")
        try:
            return cls(**d)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}; fix the file or retrain with `mm-oval train-kvp`") from e


def pair_kernel(modality: torch.Tensor, image_rc: torch.Tensor, sigma: float) -> torch.Tensor:
    """(B, N) modality, (B, N, 3) image_rc -> (B, N, N): 1 between two image tokens of the same image, times
    exp(-d^2 / (2 sigma^2)) for their distance d in patches when sigma > 0; 0 for every other pair."""
    is_img = modality == IMAGE
    pair = (is_img[:, :, None] & is_img[:, None, :]).float()
    if sigma > 0:
        rc = image_rc[..., 1:3].float()
        d2 = (rc[:, :, None, :] - rc[:, None, :, :]).pow(2).sum(-1)
        same = image_rc[..., 0][:, :, None] == image_rc[..., 0][:, None, :]
        pair = pair * same * torch.exp(-d2 / (2.0 * float(sigma) ** 2))
    return pair


def redundancy_scores(
    scores: torch.Tensor,
    keys: torch.Tensor,
    modality: torch.Tensor,
    image_rc: torch.Tensor,
    sel: RedundancySelection,
    pair: torch.Tensor | None = None,
    max_picks: int | None = None,
) -> torch.Tensor:
    """scores (B, H, N) (padding -inf), keys (B, H, N, D), modality (B, N), image_rc (B, N, 3) -> (B, H, N)
    scores whose order over each head's image tokens is the greedy redundancy-aware order (see the module
    docstring), on the agents' scale; text tokens and padding keep their scores. `pair`: the request's
    `pair_kernel` when the caller keeps it from one layer to the next (it depends on the prompt alone).
    `max_picks`: the most image tokens a head keeps (`PrefillContext.image_keep`): the walk stops there and
    the image tokens it did not reach rank below the ones it picked, in the agents' order. The greedy order
    is prefix-consistent, so any budget of at most `max_picks` keeps what the whole walk would keep."""
    if not sel.active:
        return scores
    B, H, N = scores.shape
    s = scores.float()
    valid = (modality != PAD)[:, None, :].expand(B, H, N)
    img = (modality == IMAGE)[:, None, :].expand(B, H, N)
    n_img = int(img[:, 0].sum(-1).max())
    if n_img == 0:
        return scores
    fin = torch.where(img & torch.isfinite(s), s, torch.zeros_like(s))
    cnt = (img & torch.isfinite(s)).sum(-1, keepdim=True).clamp(min=1)
    mean = fin.sum(-1, keepdim=True) / cnt
    var = (torch.where(img & torch.isfinite(s), (s - mean) ** 2, torch.zeros_like(s))).sum(
        -1, keepdim=True
    ) / cnt
    z = (s - mean) / (var.sqrt() + 1e-6)
    # sim for every pair at once, (B, H, N, N); each greedy step reads the picked token's row
    kn = torch.nn.functional.normalize(keys.float(), dim=-1)
    sim = torch.matmul(kn, kn.transpose(-1, -2)).clamp_(min=0)
    sim.mul_((pair if pair is not None else pair_kernel(modality, image_rc, sel.sigma))[:, None])
    walk = n_img if max_picks is None else max(0, min(n_img, int(max_picks)))
    rank = _greedy_rank(z, sim, img, float(sel.redundancy), walk)
    if walk < n_img:  # the image tokens the walk did not reach follow its picks, in the agents' order
        rest = img & (rank == float(N))
        order = torch.where(rest, z, float("-inf")).argsort(dim=-1, descending=True, stable=True)
        place = torch.empty_like(order).scatter_(-1, order, torch.arange(N, device=s.device).expand(B, H, N))
        rank = torch.where(rest, walk + place.to(rank.dtype), rank)
    # image tokens take the head's image scores in greedy order (the t-th picked gets the t-th best score,
    # made strictly decreasing), so they stay on the agents' scale beside the text tokens, which keep theirs
    vals = s.masked_fill(~img, float("-inf")).sort(dim=-1, descending=True).values
    vals = vals - 1e-4 * torch.arange(N, device=s.device, dtype=s.dtype)
    vals = torch.cummin(vals, dim=-1).values
    r = rank.clamp(max=N - 1).long()
    out = torch.where(img, vals.gather(-1, r), s)
    return out.masked_fill(~valid, float("-inf"))


def _greedy_rank(
    z: torch.Tensor, sim: torch.Tensor, img: torch.Tensor, lam: float, walk: int
) -> torch.Tensor:
    """The first `walk` steps of the greedy walk over each head's image tokens: each step picks the token of
    highest z minus `lam` x its largest similarity to the tokens picked so far. -> (B, H, N) float rank of
    each picked token (its step), N for the others."""
    B, H, N = z.shape
    penalty = torch.zeros_like(z)  # redundancy * max sim to the kept tokens
    gain = z.masked_fill(~img, float("-inf"))
    rank = torch.full((B, H, N), float(N), device=z.device)
    steps = torch.arange(walk, device=z.device, dtype=rank.dtype)
    picks = torch.empty((B, H, walk), dtype=torch.long, device=z.device)
    live = torch.empty((B, H, walk), dtype=torch.bool, device=z.device)
    for t in range(walk):
        best, j = gain.max(-1)  # (B, H); a row whose image tokens are all taken has best -inf
        picks[..., t] = j
        live[..., t] = best > float("-inf")
        row = sim.gather(2, j[..., None, None].expand(B, H, 1, N)).squeeze(2)  # (B, H, N)
        penalty = torch.maximum(penalty, lam * row)
        gain = (z - penalty).masked_fill(gain == float("-inf"), float("-inf"))
        gain.scatter_(-1, j[..., None], float("-inf"))
    # a row that ran out of image tokens "picks" index 0 again: the lowest rank written to a token wins
    rank.scatter_reduce_(-1, picks, torch.where(live, steps.expand(B, H, walk), float(N)), reduce="amin")
    return rank
