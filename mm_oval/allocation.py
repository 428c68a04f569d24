"""The budget arithmetic the cache applies for every method (`mm_oval.cache.choose_kept`): how many tokens
each layer keeps (PyramidKV's schedule) and how a layer's KV heads share their count (AdaKV), and the check
that a budget shared by the heads gets scores comparable across heads. Below the policies: storage uses it
without importing them; the methods that choose an allocation (`mm_oval.policies.budgets`: `pyramidkv`,
`adakv`) expose theirs as `policy.allocation`, and their docstrings hold the papers' definitions.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from .core import topk_mask
from .errors import ConfigError


@dataclass(frozen=True)
class Allocation:
    """How the kept tokens of a request are divided. `pyramid_beta`: None keeps the same count in every
    layer, a number >= 1 the PyramidKV schedule of that steepness. `share_heads`: the heads of a layer
    share their budget (AdaKV), each keeping at least `floor(alpha_safeguard x k)` of its uniform count k.
    `layer_weights`: one weight per layer (averaging 1): layer l keeps `weight_l x` the uniform count beyond
    the protected tokens, capped at what it holds, the total unchanged (`weighted_counts`; KVP's learned
    per-layer budget). `across_layers`: every layer's KV heads share one budget, `layers x Hkv x k` tokens
    ranked together by score (KVzip's default allocation, kvpress's `layerwise=False`): a layer whose
    tokens score higher keeps more. It needs scores on one scale across layers and heads; the layers are
    compressed together once the last has scored (`mm_oval.cache.prefill.finish_across_layers`); the
    protected tokens stay in every head."""

    pyramid_beta: float | None = None
    share_heads: bool = False
    alpha_safeguard: float = 0.0
    across_layers: bool = False
    layer_weights: tuple[float, ...] | None = None

    @property
    def per_layer(self) -> bool:
        """Whether each layer's count depends on its place among the layers (a schedule or weights)."""
        return self.pyramid_beta is not None or self.layer_weights is not None

    def layer_counts(self, free: torch.Tensor, decidable: torch.Tensor, num_layers: int) -> torch.Tensor:
        """(..., num_layers): each layer's count beyond the protected tokens under the schedule or weights."""
        if self.layer_weights is not None:
            if len(self.layer_weights) != num_layers:
                raise ConfigError(
                    f"per-layer budget weights for {len(self.layer_weights)} layers, but {num_layers} layers "
                    "evict: use the weights fitted for this model"
                )
            return weighted_counts(free, decidable, self.layer_weights)
        return pyramid_counts(free, decidable, num_layers, float(self.pyramid_beta))

    def with_head_budget(self, head_budget: str) -> Allocation:
        """The configuration's `head_budget="shared"` folded in: the heads share (AdaKV with alpha 0)."""
        if head_budget == "shared" and not self.share_heads:
            return replace(self, share_heads=True, alpha_safeguard=0.0)
        return self

    @classmethod
    def of(cls, policy: Any, head_budget: str = "uniform") -> Allocation:
        """The allocation of a policy (a wrapper's own, else the uniform one) under a configuration's
        `head_budget`."""
        alloc = getattr(policy, "allocation", None) or cls()  # a budget policy's own (pyramidkv, adakv)
        return alloc.with_head_budget(head_budget)


def pyramid_counts(free: torch.Tensor, decidable: torch.Tensor, num_layers: int, beta: float) -> torch.Tensor:
    """PyramidKV's per-layer counts: `free` (...,) tokens each layer keeps under the uniform budget (beyond
    the protected ones) out of `decidable` (...,) -> (..., num_layers) long, falling linearly with depth and
    summing over layers to exactly `num_layers * free`.

    kvpress's formula with its observation window taken out (mm-oval's sinks and recent window are kept
    on top of these counts in every layer): min = c / beta, max = 2c - min; when max exceeds what a layer
    can keep (d), max = d and min = 2c - d; layer l keeps round(max - l (max - min) / (L - 1)) (Python's
    round, half to even, which keeps the symmetric schedule's total). Float rounding that would move the
    total is corrected on the layers nearest a half. kvpress falls back to the uniform budget when the
    deepest layer would keep fewer tokens than its window; with the protected tokens kept apart, no
    fallback is needed. One layer keeps the uniform count."""
    if beta < 1:
        raise ConfigError(f"pyramidkv: beta must be >= 1 (the schedule's steepness), got {beta}")
    c, d = free.double(), decidable.double()
    shape = free.shape
    if num_layers <= 1:
        return free.long().unsqueeze(-1).expand(*shape, max(num_layers, 1)).clone()
    lo = c / beta
    hi = 2 * c - lo
    clamp = hi >= d
    hi = torch.where(clamp, d, hi)
    lo = torch.where(clamp, 2 * c - d, lo)
    step = (hi - lo) / (num_layers - 1)
    li = torch.arange(num_layers, dtype=torch.float64, device=free.device)
    v = hi.unsqueeze(-1) - li * step.unsqueeze(-1)  # (..., L), real counts summing to L * c
    counts = torch.round(v).minimum(d.unsqueeze(-1)).clamp(min=0)
    # exact total: move single tokens where rounding strayed (only float error makes this non-zero), on the
    # layers nearest a half that have room; vectorised, no device sync
    diff = num_layers * free.long() - counts.long().sum(-1)  # (...,)
    sign = diff.sign().unsqueeze(-1).double()
    room = torch.where(sign > 0, counts < d.unsqueeze(-1), counts > 0)
    gap = ((v - counts) * sign).masked_fill(~room, float("-inf"))
    order = gap.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(
        -1, order, torch.arange(num_layers, device=v.device).expand_as(order)
    )
    counts = counts + sign * (rank < diff.abs().unsqueeze(-1)).double()
    return counts.long()


def weighted_counts(free: torch.Tensor, decidable: torch.Tensor, weights: tuple[float, ...]) -> torch.Tensor:
    """Each layer's count beyond the protected tokens under per-layer weights: `free` (...,) tokens each layer
    keeps under the uniform budget out of `decidable` (...,) -> (..., L) long summing to exactly `L x free`
    (when L x free <= L x decidable). Layer l gets `w_l / sum(w) x L x free`, capped at `decidable`; what a
    capped layer cannot take goes to the others in proportion to their weights (water-filling), and the
    rounding remainder to the layers with the largest fractional parts that have room."""
    w = torch.tensor(weights, dtype=torch.float64, device=free.device).clamp(min=0)
    L = w.numel()
    c = free.double().unsqueeze(-1)  # (..., 1)
    d = decidable.double().unsqueeze(-1).expand(*free.shape, L)
    total = (L * c).minimum(L * d[..., :1])
    capped = torch.zeros_like(d, dtype=torch.bool)
    x = torch.zeros_like(d)
    for _ in range(L):  # each round caps at least one more layer, or ends
        ww = w.expand_as(d).masked_fill(capped, 0.0)
        rest = total - torch.where(capped, d, torch.zeros_like(d)).sum(-1, keepdim=True)
        share = ww / ww.sum(-1, keepdim=True).clamp(min=1e-12) * rest
        x = torch.where(capped, d, share)
        over = (x > d) & ~capped
        if not bool(over.any()):
            break
        capped |= over
    counts = torch.floor(x + 1e-9).minimum(d)
    short = (total.squeeze(-1) - counts.sum(-1)).round().long()  # (...,)
    gap = (x - counts).masked_fill(counts >= d, float("-inf"))
    order = gap.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(L, device=d.device).expand_as(order))
    return (counts + (rank < short.unsqueeze(-1)).double()).long()


# ---- the read budget divided over the layers (OvalConfig.read_layer_budget) ---------------------------------
def read_layer_weights(name: str, num_layers: int) -> tuple[float, ...] | None:
    """The per-layer weights of `OvalConfig.read_layer_budget` for a model of `num_layers` layers: None for
    "uniform"; else the "weights" of the JSON file `name` (one positive number per layer, averaging 1;
    benchmarks/retrieval_layer_budget.py fits them). A clear error when missing or malformed."""
    if name == "uniform":
        return None
    path = Path(name)
    if not path.is_file():
        raise ConfigError(
            f"read_layer_budget={name!r} is not a file: give a JSON file of per-layer weights (fit one with "
            "`python benchmarks/retrieval_layer_budget.py --out FILE`), or 'uniform'"
        )
    return _load_read_layer_weights(str(path), path.stat().st_mtime_ns, num_layers)


@functools.lru_cache(maxsize=16)
def _load_read_layer_weights(path: str, mtime_ns: int, num_layers: int) -> tuple[float, ...]:
    how = f'read_layer_budget: {path} must hold "weights": {num_layers} positive numbers (one per layer)'
    try:
        weights = json.loads(Path(path).read_text())["weights"]
        ok = isinstance(weights, list) and len(weights) == num_layers
        ok = ok and all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights)
        ok = ok and all(math.isfinite(w) and w > 0 for w in weights)
    except (OSError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise ConfigError(f"{how} for this model; fit one for it with benchmarks/retrieval_layer_budget.py")
    mean = sum(weights) / num_layers
    if abs(mean - 1.0) > 1e-3:
        raise ConfigError(
            f"{how} averaging 1 (they average {mean:.4f}, which would change the total read): divide them "
            "by their mean"
        )
    return tuple(float(w) for w in weights)


def layer_fractions(weights: tuple[float, ...], fraction: float) -> tuple[float, ...]:
    """Each layer's read fraction under per-layer `weights` (averaging 1) and a model-wide `fraction`:
    `w_l x fraction`, capped at 1 (every page); what a capped layer cannot use goes to the others in
    proportion to their weights (water-filling), so the mean stays `fraction`."""
    L = len(weights)
    capped: set[int] = set()
    out = [0.0] * L
    for _ in range(L):
        rest = L * fraction - len(capped)
        free = sum(w for i, w in enumerate(weights) if i not in capped)
        out = [1.0 if i in capped else w / free * rest for i, w in enumerate(weights)]
        over = {i for i, f in enumerate(out) if f > 1.0}
        if not over:
            break
        capped |= over
    return tuple(min(f, 1.0) for f in out)


def shared_head_keep(
    scores: torch.Tensor, eligible: torch.Tensor, k: torch.Tensor, alpha_safeguard: float = 0.0
) -> torch.Tensor:
    """AdaKV's choice: (B, H, N) scores (protected tokens at +inf), eligible (B, H, N), k (B,) tokens a head
    keeps under the uniform budget -> (B, H, N) bool, `H x k` tokens per sample, each head's top
    `floor(alpha_safeguard x k)` first, the rest the joint top of the (head, token) scores (ties: lower head,
    then lower index)."""
    B, H, N = scores.shape
    s = scores.float().masked_fill(~eligible, float("-inf"))
    if alpha_safeguard > 0:
        safe = torch.floor(k.double() * alpha_safeguard + 1e-9).long()
        guard = topk_mask(s, eligible, safe.view(B, 1).expand(B, H))
        s = s.masked_fill(guard, float("inf"))
    joint = topk_mask(s.reshape(B, H * N), eligible.reshape(B, H * N), k * H)
    return joint.view(B, H, N)


def check_comparable(policy: Any, what: str) -> None:
    """Refuse a policy whose scores are not on one scale across heads, for a budget shared by the heads."""
    if not bool(policy.comparable_across_heads):
        name = getattr(policy, "name", "") or type(policy).__name__
        raise ConfigError(not_comparable_message(name, what))


def not_comparable_message(name: str, what: str) -> str:
    hint = " (KVP: agents trained with joint heads are, e.g. agents=bundled-joint)" if name == "kvp" else ""
    undo = "drop head_budget=shared" if what.startswith("head_budget") else f"{name!r} alone"
    return (
        f"{what} ranks the KV heads of a layer jointly, but the scores of eviction method {name!r} are not "
        f"comparable across heads{hint}: use a scorer whose scores are (snapkv, h2o, tova, keydiff, ...), "
        f"or {undo} (every head keeps its own top-b)"
    )


def check_policy(policy: Any, head_budget: str) -> None:
    """The built policy's check (e.g. KVP's agents known): head_budget="shared" needs comparable scores."""
    if policy is not None and head_budget == "shared":
        check_comparable(policy, "head_budget=shared")
