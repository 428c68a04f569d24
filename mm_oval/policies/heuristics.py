"""The standard eviction baselines, each a small `EvictionPolicy`.

Attention-free: random, streamingllm, knorm, keydiff. Attention-based (they read a few attention rows,
computed here in chunks of query rows, never the N x N matrix): h2o, tova, snapkv, fastv.
GQA: a KV head's score combines its query heads (mean over the group unless said otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from .base import IMAGE, PAD, EvictionPolicy, PrefillContext, register_eviction

# ---- attention rows, chunked ----------------------------------------------------------------------


def attention_rows(ctx: PrefillContext, rows: torch.Tensor) -> torch.Tensor:
    """Softmax attention of the query rows `rows` (R,) of every query head over the prompt's keys,
    causal and without padding: (B, Hq, R, N) fp32. Use for a few rows (TOVA, SnapKV's window)."""
    q = ctx.queries[:, :, rows].float()  # (B, Hq, R, D)
    G = ctx.num_kv_groups
    k = ctx.keys.float().repeat_interleave(G, dim=1)  # (B, Hq, N, D)
    logits = torch.matmul(q, k.transpose(-1, -2)) * ctx.scaling
    N = k.shape[2]
    causal = torch.arange(N, device=q.device).view(1, -1) <= rows.view(-1, 1)  # (R, N)
    allowed = causal.view(1, 1, *causal.shape) & ctx.valid.view(ctx.valid.shape[0], 1, 1, N)
    return torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)


def column_sums(ctx: PrefillContext) -> torch.Tensor:
    """Attention received by each key from every valid query row (H2O's accumulated score), computed
    `ctx.chunk_size` rows at a time: (B, Hq, N) fp32."""
    B, Hq, N, _ = ctx.queries.shape
    total = torch.zeros(B, Hq, N, dtype=torch.float32, device=ctx.queries.device)
    valid_q = ctx.valid.view(B, 1, N, 1)
    for s in range(0, N, ctx.chunk_size):
        rows = torch.arange(s, min(N, s + ctx.chunk_size), device=ctx.queries.device)
        a = attention_rows(ctx, rows) * valid_q[:, :, rows]
        total += a.sum(2)
    return total


def group_reduce(x: torch.Tensor, groups: int, how: str = "mean") -> torch.Tensor:
    """(B, Hq, ...) -> (B, Hkv, ...), combining the query heads of each KV head."""
    B, Hq = x.shape[:2]
    x = x.view(B, Hq // groups, groups, *x.shape[2:])
    return x.amax(2) if how == "max" else x.mean(2)


def _per_kv_head(ctx: PrefillContext, s: torch.Tensor) -> torch.Tensor:
    """(B, N) -> (B, Hkv, N)."""
    return s.unsqueeze(1).expand(-1, ctx.keys.shape[1], -1)


# ---- attention-free --------------------------------------------------------------------------------


@register_eviction
@dataclass
class RandomEviction(EvictionPolicy):
    """Uniformly random tokens (seeded)."""

    name = "random"
    # i.i.d. uniform in every head: ranked jointly, the heads' shares are as random as the tokens
    comparable_across_heads = True
    seed: int = 0

    def score(self, ctx: PrefillContext) -> torch.Tensor:
        g = torch.Generator(device="cpu").manual_seed(self.seed + 7919 * ctx.layer_idx)
        return torch.rand(ctx.keys.shape[:3], generator=g).to(ctx.keys.device)


@register_eviction
@dataclass
class StreamingLLM(EvictionPolicy):
    """Sinks + the most recent tokens (Xiao et al. 2023): the score is the position."""

    name = "streamingllm"
    comparable_across_heads = True  # the position, the same in every head

    def score(self, ctx: PrefillContext) -> torch.Tensor:
        return _per_kv_head(ctx, ctx.positions.float())


@register_eviction
@dataclass
class KNorm(EvictionPolicy):
    """Keep the keys of smallest L2 norm (Devoto et al. 2024: low key norm goes with high attention)."""

    name = "knorm"
    # key norms have a scale of their own in each head (some heads' keys are several times longer): a joint
    # ranking would hand the whole budget to the heads with short keys
    comparable_across_heads = False

    def score(self, ctx: PrefillContext) -> torch.Tensor:
        return -ctx.keys.float().norm(dim=-1)


@register_eviction
@dataclass
class KeyDiff(EvictionPolicy):
    """Keep the keys most different from the mean key direction (Park et al. 2025): score = -cos(k, anchor)."""

    name = "keydiff"
    # a cosine, in [-1, 1] in every head: a head whose keys all point the same way (redundant) gives up tokens
    comparable_across_heads = True

    def score(self, ctx: PrefillContext) -> torch.Tensor:
        k = F.normalize(ctx.keys.float(), dim=-1)
        w = ctx.valid.unsqueeze(1).unsqueeze(-1).float()
        anchor = F.normalize((k * w).sum(2, keepdim=True) / w.sum(2, keepdim=True).clamp(min=1), dim=-1)
        return -(k * anchor).sum(-1)


# ---- attention-based -------------------------------------------------------------------------------


@register_eviction
@dataclass
class H2O(EvictionPolicy):
    """Heavy hitters (Zhang et al. 2023): attention accumulated by each key over all prompt queries."""

    name = "h2o"
    needs_queries = True
    comparable_across_heads = True  # attention: every query row of every head spreads the same mass, 1

    def score(self, ctx: PrefillContext) -> torch.Tensor:
        return group_reduce(column_sums(ctx), ctx.num_kv_groups)


@register_eviction
@dataclass
class TOVA(EvictionPolicy):
    """Token omission via attention (Oren et al. 2024): the last prompt token's attention.
    `per_head=False` (the paper's choice) averages over all heads so every KV head keeps the same tokens."""

    name = "tova"
    needs_queries = True
    comparable_across_heads = True  # one attention row per head, each summing to 1
    per_head: bool = True

    def score(self, ctx: PrefillContext) -> torch.Tensor:
        N = ctx.keys.shape[2]
        a = attention_rows(ctx, torch.tensor([N - 1], device=ctx.keys.device))[:, :, 0]  # (B, Hq, N)
        if not self.per_head:
            return _per_kv_head(ctx, a.mean(1))
        return group_reduce(a, ctx.num_kv_groups)


@register_eviction
@dataclass
class SnapKV(EvictionPolicy):
    """SnapKV (Li et al. 2024): the last `window` prompt queries vote (attention summed over the window),
    smoothed by 1-D pooling (`kernel`, `pooling` avgpool|maxpool); the window itself is always kept."""

    name = "snapkv"
    needs_queries = True
    comparable_across_heads = True  # attention mass from the window, the same total in every head (AdaKV's)
    window: int = 32
    kernel: int = 5
    pooling: str = "avgpool"

    def __post_init__(self) -> None:
        if (
            self.pooling not in ("avgpool", "maxpool")
            or self.kernel < 1
            or self.kernel % 2 == 0
            or self.window < 1
        ):
            raise ConfigError("snapkv: window >= 1, kernel an odd int >= 1, pooling avgpool or maxpool")

    def score(self, ctx: PrefillContext) -> torch.Tensor:
        N = ctx.keys.shape[2]
        w = min(self.window, N)
        rows = torch.arange(N - w, N, device=ctx.keys.device)
        votes = attention_rows(ctx, rows).sum(2)  # (B, Hq, N)
        votes = group_reduce(votes, ctx.num_kv_groups)  # (B, Hkv, N)
        B, H, _ = votes.shape
        flat = votes.reshape(B * H, 1, N)
        pad = self.kernel // 2
        if self.pooling == "avgpool":
            pooled = F.avg_pool1d(flat, self.kernel, stride=1, padding=pad, count_include_pad=False)
        else:
            pooled = F.max_pool1d(flat, self.kernel, stride=1, padding=pad)
        s = pooled.reshape(B, H, N)
        s[..., N - w :] = float("inf")  # the observation window is kept
        return s


@dataclass
class FastVState:
    """FastV's memory of one request: the ranking its layer computed, read by the layers above."""

    rank: torch.Tensor | None = None  # (B, N) the last prompt token's attention to each image token


@register_eviction
@dataclass
class FastV(EvictionPolicy):
    """FastV-style (Chen et al. 2024): image tokens ranked once by the last prompt token's attention at
    layer `layer` (mean over heads); layers up to `layer` keep everything, the layers above drop the
    low-ranked image tokens (every KV head the same). Use it with eviction_scope="image"."""

    name = "fastv"
    needs_queries = True
    comparable_across_heads = True  # one ranking (mean over heads) shared by every head
    State = FastVState
    layer: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.layer, bool) or not isinstance(self.layer, int) or self.layer < 0:
            raise ConfigError(f"fastv: layer must be an int >= 0 (the layer that ranks), got {self.layer!r}")

    def bind(self, model: Any) -> None:
        """Check `layer` against the model (`mm_oval.wrap` calls this): the layers up to `layer` keep every
        token, so a layer at or past the model's last evicts nothing."""
        cfg = getattr(model, "config", model)
        n = int((getattr(cfg, "text_config", None) or cfg).num_hidden_layers)
        if self.layer > n - 2:
            raise ConfigError(
                f"fastv: layer={self.layer} on a model of {n} layers evicts nothing (layers 0..{self.layer} "
                f"keep every token); pass method_options={{'layer': L}} with L in 0..{max(n - 2, 0)}"
                + ("" if n >= 2 else " (a 1-layer model cannot use fastv)")
            )

    def keep_layer_unchanged(self, layer_idx: int) -> bool:
        return layer_idx <= self.layer

    def score(self, ctx: PrefillContext) -> torch.Tensor:
        B, H, N, _ = ctx.keys.shape
        if ctx.layer_idx == self.layer:
            a = attention_rows(ctx, torch.tensor([N - 1], device=ctx.keys.device))[:, :, 0].mean(1)  # (B, N)
            ctx.request.state_of(self).rank = a.masked_fill(ctx.modality != IMAGE, 0.0)
        if ctx.layer_idx <= self.layer:
            return torch.zeros(B, H, N, device=ctx.keys.device)
        rank = ctx.request.state_of(self).rank
        if rank is None:
            raise ConfigError(f"fastv: layer={self.layer} is not a layer of this model")
        return _per_kv_head(ctx, rank.masked_fill(ctx.modality == PAD, 0.0))
