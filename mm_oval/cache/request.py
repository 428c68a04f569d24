"""What the cache knows about a request's prompt tokens (`RequestInfo`: modality, position, image place,
protection) and which of them each KV head keeps under the budget (`choose_kept`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..allocation import Allocation, shared_head_keep
from ..config import OvalConfig
from ..core import IMAGE, PAD, TEXT, budget_count, topk_mask
from ..errors import ConfigError
from ..geometry import Geometry, fixed_grid_rc


@dataclass
class RequestInfo:
    """What the cache knows about each prompt token of the request (B samples, N tokens)."""

    modality: torch.Tensor  # (B, N) int8: TEXT, IMAGE, PAD
    positions: torch.Tensor  # (B, N) long, original RoPE positions, -1 for padding
    image_rc: torch.Tensor  # (B, N, 3) long: (image, row, col), -1 for non-image tokens
    protected: torch.Tensor  # (B, N) bool: sink or recent-window token

    @property
    def next_pos(self) -> torch.Tensor:  # (B,) position of the first token after the prompt
        return self.positions.amax(-1) + 1


def request_info(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    image_token_id: int | None,
    tokens_per_image: int,
    sink_tokens: int,
    recent_tokens: int,
    geometry: Geometry | None = None,
) -> RequestInfo:
    """Per prompt token: modality, position, (grid, row, col), protection. The image tokens and their
    (row, col) come from `geometry` (mm_oval.geometry.image_geometry: any supported model family); without
    one, from `image_token_id` with `tokens_per_image` tokens per square image (LLaVA-1.5's layout)."""
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ConfigError(
            "mm-oval reads padding from a 2-D attention_mask (batch, tokens); a prepared 4-D mask is not supported"
        )
    valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    if geometry is not None:
        is_img = geometry.is_image & valid
        rc = geometry.image_rc
    else:
        is_img = (input_ids == image_token_id) & valid
        rc = fixed_grid_rc(is_img, tokens_per_image)
    modality = torch.full_like(input_ids, TEXT, dtype=torch.int8)
    modality[is_img] = IMAGE
    modality[~valid] = PAD
    positions = valid.long().cumsum(-1) - 1
    positions = positions.masked_fill(~valid, -1)
    image_rc = torch.where(is_img.unsqueeze(-1), rc, torch.full_like(rc, -1))
    n_valid = valid.sum(-1, keepdim=True)
    protected = valid & ((positions < sink_tokens) | (positions >= n_valid - recent_tokens))
    return RequestInfo(modality, positions, image_rc, protected)


def choose_kept(
    scores: torch.Tensor,
    info: RequestInfo,
    config: OvalConfig,
    allocation: Allocation | None = None,
    layer: int = 0,
    num_layers: int = 1,
) -> torch.Tensor:
    """(B, Hkv, N) scores -> (B, Hkv, N) bool: per sample and KV head, the protected tokens plus the
    top-scored ones, within each modality's budget (eviction_scope "image") or all together ("all").

    `allocation` (mm_oval.policies.budgets; default: the uniform one) divides the budget: with a PyramidKV
    schedule, `layer` of `num_layers` (the layers that evict) keeps the protected tokens plus its share of
    the rest, the layers' counts summing to `num_layers` times the uniform count; with heads shared (AdaKV,
    or head_budget "shared", which is AdaKV with alpha 0) the KV heads of the layer keep Hkv times a head's
    count between them, the top of all (head, token) scores together after each head's safeguard: a head
    whose tokens score higher keeps more, another fewer (protected tokens still in every head)."""
    B, H, N = scores.shape
    alloc = (allocation or Allocation()).with_head_budget(config.head_budget)
    mod = info.modality.unsqueeze(1).expand(B, H, N)
    prot = info.protected.unsqueeze(1).expand(B, H, N)
    # protected tokens above every score, also a method's own +inf (SnapKV's observation window); a token's
    # -inf or NaN ranks it last among its modality's, never behind a token of another group (exact counts)
    big = torch.finfo(torch.float32).max
    s = torch.nan_to_num(scores.float(), nan=-big, posinf=big, neginf=-big).masked_fill(prot, float("inf"))
    counts = {}
    for m, budget in ((IMAGE, config.budget), (TEXT, config.text_budget)):
        n = (info.modality == m).sum(-1)  # (B,)
        p = (info.protected & (info.modality == m)).sum(-1)
        counts[m] = (budget_count(budget, n), p, n)
    im, tx = counts[IMAGE], counts[TEXT]
    groups = [((mod != PAD), im[0] + tx[0], im[1] + tx[1], im[2] + tx[2])]
    if config.eviction_scope != "all":
        groups = [((mod == m), k, p, n) for m, (k, p, n) in counts.items()]
    keep = torch.zeros_like(prot)
    for eligible, k, p, n in groups:
        k = torch.maximum(k, p)  # (B,) tokens per head
        if alloc.per_layer:  # this layer's share of the layers' total beyond the protected
            k = p + alloc.layer_counts(k - p, n - p, num_layers)[:, layer]
        if alloc.share_heads:
            keep |= shared_head_keep(s, eligible, k, alloc.alpha_safeguard)
        else:
            keep |= topk_mask(s, eligible, k.view(B, 1).expand(B, H))
    return keep
