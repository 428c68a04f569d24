"""Expected Attention (Devoto, Jeblick and Jégou 2025, "Expected Attention: KV cache compression by
estimating attention from future queries distribution", arXiv:2510.00636; kvpress `ExpectedAttentionPress`,
the reference definition).

The queries that will read the cache have not been computed yet; model them as Gaussian. Their mean `mu`
and covariance `S` (per query head, before RoPE) are estimated from the prompt's queries, then moved to
the positions that follow the prompt with the RoPE rotation averaged over the next `n_future_positions`
positions, `R = mean_p R(p)`: `mu' = R mu`, `S' = R S R^T`. For a Gaussian query q,
`E[exp(s q.k)] = exp(s mu'.k + s^2 k^T S' k / 2)` (s the attention's softmax scale, 1/sqrt(d) in kvpress),
so a key's expected attention is the softmax over the prompt's keys of

    s * mu'.k + s^2 / 2 * k^T S' k                (the second term only with use_covariance)

averaged over the query heads of its KV head, then weighted by its value's norm: `(a + epsilon) * |v|`
(with use_vnorm: a key that draws attention but carries a small value changes the output little).
The first `n_sink` tokens are left out of the statistics and of the softmax (their queries and keys are
outliers) and ranked above every other token, as kvpress does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError, ModelError
from ..geometry import language_model
from .base import EvictionPolicy, PrefillContext, register_eviction


@register_eviction
@dataclass
class ExpectedAttention(EvictionPolicy):
    """Expected Attention (kvpress `ExpectedAttentionPress`): each key scored by the attention the future
    queries are expected to pay it, under the mean and covariance of the prompt's queries with RoPE averaged
    over the next `n_future_positions` positions; see the module docstring for the formula.
    Options and defaults are kvpress's: `n_future_positions` (512), `n_sink` (4), `use_covariance` (True),
    `use_vnorm` (True), `epsilon` (0.0).

    Choices the multimodal, batched setting asks for (kvpress works on one unpadded text sequence):
    - queries before RoPE are the layer's queries with RoPE undone, the same numbers kvpress forms from the
      hidden states with `q_proj`, without a second projection of the prompt;
    - statistics and softmax use the sample's own tokens only: padding never counts, `n_sink` is the first
      `n_sink` positions of each sample, and the future positions start at each sample's own next position.
      With `compress="image"` the prompt is the part up to the image, so the statistics come from the
      template head and the image tokens, and the future starts where the question will;
    - image and text tokens share one softmax (one scale), so with `eviction_scope="all"` they compete on the same
      footing; with `eviction_scope="image"` each modality's budget takes its own top;
    - the scale is the attention module's (`ctx.scaling`), which is kvpress's 1/sqrt(d) for LLaVA's
      language models;
    - the sink tokens score one above the sample's highest score (kvpress: the batch's), which keeps a
      sample's scores independent of the rest of its batch.
    Scores are softmax probabilities per query head (times value norms), comparable across heads, as kvpress's
    `AdaKVPress(ExpectedAttentionPress())` uses them.

    Cost: the statistics take the prompt's queries once (O(N D^2) per head for the covariance), the scores
    one O(D^2) quadratic form per key and head, computed `chunk_size` tokens at a time; no attention matrix."""

    name = "expected_attention"
    needs_queries = True
    comparable_across_heads = True
    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    def __post_init__(self) -> None:
        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        if not is_int(self.n_future_positions) or self.n_future_positions < 1:
            raise ConfigError(
                f"expected_attention: n_future_positions must be an int >= 1, got {self.n_future_positions!r}"
            )
        if not is_int(self.n_sink) or self.n_sink < 0:
            raise ConfigError(f"expected_attention: n_sink must be an int >= 0, got {self.n_sink!r}")
        for opt in ("use_covariance", "use_vnorm"):
            if not isinstance(getattr(self, opt), bool):
                raise ConfigError(
                    f"expected_attention: {opt} must be true or false, got {getattr(self, opt)!r}"
                )
        eps = self.epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < float("inf"):
            raise ConfigError(f"expected_attention: epsilon must be a number >= 0, got {eps!r}")
        self.epsilon = float(eps)

    def bind(self, model: object) -> None:
        """The future positions need the language model's RoPE (`mm_oval.wrap` calls this)."""
        lm = language_model(model)
        if getattr(lm, "rotary_emb", None) is None:
            raise ModelError(
                f"expected_attention needs the language model's rotary embedding (RoPE), which "
                f"{type(lm).__name__} does not have (no .rotary_emb): use another method for this model"
            )

    def query_statistics(self, ctx: PrefillContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Mean (B, Hq, D) and covariance (B, Hq, D, D) of the queries before RoPE, over each sample's
        tokens past the first `n_sink` (padding excluded), moved to the future positions by the averaged
        RoPE rotation. fp32."""
        rope = ctx.rope
        q = ctx.queries
        B, Hq, N, D = q.shape
        use = ctx.valid & (ctx.positions >= self.n_sink)  # (B, N)
        count = use.sum(-1).clamp(min=1).view(B, 1, 1).float()
        step = max(1, int(ctx.chunk_size))
        chunks = [slice(s, min(N, s + step)) for s in range(0, N, step)]

        def pre_rope(c: slice) -> torch.Tensor:  # (B, Hq, n, D) fp32, zero where not used
            x = rope.rotate(q[:, :, c], ctx.positions[:, c], inverse=True)
            return x * use[:, None, c, None]

        mu = sum(pre_rope(c).sum(2) for c in chunks) / count  # (B, Hq, D)
        cov = None
        if self.use_covariance:
            cov = torch.zeros(B, Hq, D, D, dtype=torch.float32, device=q.device)
            for c in chunks:
                x = (pre_rope(c) - mu.unsqueeze(2)) * use[:, None, c, None]
                cov += torch.einsum("bhni,bhnj->bhij", x, x)
            cov /= count.unsqueeze(-1)
        # the RoPE rotation averaged over the next positions: mean_p (diag(cos_p) + diag(sin_p) P), with
        # P x = rotate_half(x)
        first = ctx.positions.amax(-1, keepdim=True).clamp(min=-1) + 1  # (B, 1), each sample's next position
        future = first + torch.arange(self.n_future_positions, device=q.device)
        cos, sin = rope.cos_sin(future)
        c, s = cos.mean(1), sin.mean(1)  # (B, D)
        half = D // 2
        P = torch.zeros(D, D, dtype=torch.float32, device=q.device)
        P[:half, half:] = -torch.eye(half, device=q.device)
        P[half:, :half] = torch.eye(half, device=q.device)
        R = torch.diag_embed(c) + s.unsqueeze(-1) * P  # (B, D, D)
        R = R.unsqueeze(1)  # (B, 1, D, D), the same for every head
        mu = (R @ mu.unsqueeze(-1)).squeeze(-1)
        if cov is not None:
            cov = R @ cov @ R.transpose(-1, -2)
        return mu, cov

    def score(self, ctx: PrefillContext) -> torch.Tensor:
        if ctx.queries is None or ctx.rope is None:
            raise ConfigError(
                "expected_attention needs the layer's queries and the model's RoPE: run it through a model "
                "wrapped with mm_oval.wrap"
            )
        mu, cov = self.query_statistics(ctx)
        B, Hkv, N, D = ctx.keys.shape
        G = ctx.num_kv_groups
        mu = mu.view(B, Hkv, G, D)
        cov = cov.view(B, Hkv, G, D, D) if cov is not None else None
        scale = float(ctx.scaling)
        logits = torch.empty(B, Hkv, G, N, dtype=torch.float32, device=ctx.keys.device)
        step = max(1, int(ctx.chunk_size))
        for s0 in range(0, N, step):
            k = ctx.keys[:, :, s0 : s0 + step].float()  # (B, Hkv, n, D)
            part = scale * torch.einsum("bhgd,bhnd->bhgn", mu, k)
            if cov is not None:
                kc = torch.einsum("bhnd,bhgde->bhgne", k, cov)
                part += 0.5 * scale * scale * (kc * k.unsqueeze(2)).sum(-1)
            logits[..., s0 : s0 + step] = part
        scored = ctx.valid & (ctx.positions >= self.n_sink)  # (B, N)
        logits = logits.masked_fill(~scored.view(B, 1, 1, N), float("-inf"))
        a = torch.softmax(logits, dim=-1).nan_to_num(0.0).mean(2)  # (B, Hkv, N)
        if self.use_vnorm:
            a = (a + self.epsilon) * ctx.values.float().norm(dim=-1)
        a = a.masked_fill(~scored.view(B, 1, N), 0.0)
        sink = ctx.valid & (ctx.positions < self.n_sink)
        top = a.amax(dim=(1, 2), keepdim=True) + 1.0  # (B, 1, 1)
        return torch.where(sink.view(B, 1, N), top, a)
