"""Budget allocation for any scorer: over layers (PyramidKV) and over a layer's KV heads (AdaKV).

Both methods keep the scorer's ranking and change only how many tokens each layer or head keeps, at the
total of the uniform budget. Each is a policy that delegates scoring to a registered method (`scorer`,
SnapKV by default); options the wrapper does not know go to the scorer, so a method spec reads
`pyramidkv:scorer=keydiff,beta=20` or `adakv:scorer=snapkv,window=16,alpha_safeguard=0.2`, and the two
compose (`adakv:scorer=pyramidkv`, or `pyramidkv:scorer=kvzip,head_budget=shared`: a spec names one
scorer; deeper nesting takes built policies, `make_eviction("adakv", scorer=make_eviction("pyramidkv",
scorer="keydiff"))`). The cache applies the
allocation (`mm_oval.cache.choose_kept`), per sample and modality, with sinks and the recent window kept
first as for every method; the definitions it and the benchmarks use (`Allocation`, `pyramid_counts`,
`shared_head_keep`, the comparability check) live in `mm_oval/allocation.py`, below the policies, and are
re-exported here.

- PyramidKV (Cai et al. 2024, arXiv 2406.02069; kvpress `PyramidKVPress.get_layer_budget`): the tokens a
  layer keeps beyond the protected ones fall linearly with depth, from `2c - c/beta` at the first layer to
  `c/beta` at the last (c = the uniform budget's count beyond the protected tokens), the first clamped to
  what a layer can keep; the layers' counts sum to the uniform total exactly.
- AdaKV (Feng et al. 2024, arXiv 2407.11550; kvpress `AdaKVPress`): the KV heads of a layer keep
  `Hkv x k` tokens between them, the top of all (head, token) scores ranked together, each head first
  keeping its top `floor(alpha_safeguard x k)` (the paper's safeguard). `head_budget="shared"` is this
  allocation with `alpha_safeguard=0` over the configured method. A joint ranking needs scores on one
  scale across heads: each policy declares `comparable_across_heads`, and the configuration refuses a
  scorer that is not.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, ClassVar

import torch

from ..allocation import (  # noqa: F401  (re-exported: the definitions, where the methods are)
    Allocation,
    check_comparable,
    check_policy,
    not_comparable_message,
    pyramid_counts,
    shared_head_keep,
)
from ..errors import ConfigError
from ..registry import load_builtin_policies, register_spec_check
from .base import (
    EVICTION_REGISTRY,
    EvictionPolicy,
    PrefillContext,
    make_eviction,
    register_eviction,
)

DEFAULT_SCORER = "snapkv"


# ---- the wrappers ----------------------------------------------------------------------------------


class BudgetPolicy(EvictionPolicy):
    """A policy that scores with another (`scorer`: a registered name, with its options among this
    policy's keyword arguments, or an `EvictionPolicy`) and sets how many tokens each layer / head keeps
    (`allocation`). Everything the cache asks of a policy is the scorer's: `score`, `needs_queries`,
    `needs_hidden_states`, `prepare_request`, `bind`, `keep_layer_unchanged`, `state_tensors`,
    `comparable_across_heads`, and any other attribute (e.g. KVP's `score_tokens`)."""

    own_options: ClassVar[tuple[str, ...]] = ()

    def __init__(self, scorer: str | EvictionPolicy = DEFAULT_SCORER, **scorer_options: Any):
        if isinstance(scorer, EvictionPolicy):
            if scorer_options:
                raise ConfigError(
                    f"{self.name}: options {sorted(scorer_options)} go to a scorer named by string; the scorer "
                    f"given is already built ({type(scorer).__name__})"
                )
            self.scorer = scorer
        elif isinstance(scorer, str) and scorer not in ("full", self.name):
            try:
                self.scorer = make_eviction(scorer, **scorer_options)
            except ConfigError as e:
                raise ConfigError(f"{self.name}: scorer {scorer!r}: {e}") from e
        else:
            raise ConfigError(
                f"{self.name}: scorer must be a registered eviction method other than 'full' and "
                f"{self.name!r} (default {DEFAULT_SCORER!r}), got {scorer!r}"
            )
        inner = getattr(self.scorer, "allocation", None)
        if isinstance(inner, Allocation) and inner.across_layers:
            raise ConfigError(
                f"{self.name}: its scorer {self.scorer.name!r} already ranks every layer's tokens together "
                f"(layerwise=false), which leaves no per-layer budget for {self.name} to divide: use "
                f"{self.scorer.name!r} alone, or give it layerwise=true"
            )
        if isinstance(inner, Allocation) and inner.layer_weights is not None:
            raise ConfigError(
                f"{self.name}: its scorer {self.scorer.name!r} divides the budget over the layers itself "
                f"(layer_budget=true): use {self.scorer.name!r} alone, or give it layer_budget=false"
            )

    @property
    def allocation(self) -> Allocation:
        raise NotImplementedError

    def _inner_allocation(self) -> Allocation:
        return self.scorer.allocation if isinstance(self.scorer, BudgetPolicy) else Allocation()

    # ---- delegation ----
    @property
    def needs_queries(self) -> bool:  # type: ignore[override]
        return bool(self.scorer.needs_queries)

    @property
    def needs_hidden_states(self) -> bool:  # type: ignore[override]
        return bool(getattr(self.scorer, "needs_hidden_states", False))

    @property
    def comparable_across_heads(self) -> bool:  # type: ignore[override]
        return bool(self.scorer.comparable_across_heads)

    def score(self, ctx: PrefillContext) -> torch.Tensor:
        return self.scorer.score(ctx)

    def keep_layer_unchanged(self, layer_idx: int) -> bool:
        return self.scorer.keep_layer_unchanged(layer_idx)

    def prepare_request(self, *args: Any, **kwargs: Any) -> Any:
        return self.scorer.prepare_request(*args, **kwargs)

    @property
    def has_request_pass(self) -> bool:  # type: ignore[override]
        return bool(self.scorer.has_request_pass)

    def bind(self, model: Any) -> None:
        bind = getattr(self.scorer, "bind", None)
        if bind is not None:
            bind(model)

    def state_tensors(self) -> list[torch.Tensor]:
        return list(self.scorer.state_tensors())

    def __getattr__(self, name: str) -> Any:  # only for attributes this class lacks
        scorer = self.__dict__.get("scorer")
        if scorer is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(scorer, name)

    def __repr__(self) -> str:
        own = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.own_options)
        return f"{type(self).__name__}(scorer={self.scorer!r}{', ' if own else ''}{own})"


@register_eviction
class PyramidKV(BudgetPolicy):
    """PyramidKV (Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
    Funneling"; kvpress `PyramidKVPress`): lower layers keep more tokens, higher layers fewer, on the
    paper's linear schedule (`pyramid_counts`, steepness `beta`, default 20 as kvpress), with the layers'
    total equal to the uniform budget's, per sample and modality (sinks and the recent window kept in
    every layer on top of the schedule). The ranking within a layer is the scorer's (SnapKV by default, as
    the paper; any registered method). Layers the scorer leaves whole (FastV's first layers) are outside
    the schedule: it runs over the layers that evict. With SnapKV underneath, its observation window is
    scored +inf as usual; a deep layer whose count is below the window's keeps the window's earliest."""

    name = "pyramidkv"
    own_options = ("beta",)

    def __init__(
        self, scorer: str | EvictionPolicy = DEFAULT_SCORER, beta: float = 20, **scorer_options: Any
    ):
        if (
            isinstance(beta, bool)
            or not isinstance(beta, (int, float))
            or not math.isfinite(beta)
            or beta < 1
        ):
            raise ConfigError(
                f"pyramidkv: beta must be a number >= 1 (the schedule's steepness), got {beta!r}"
            )
        super().__init__(scorer, **scorer_options)
        if self._inner_allocation().pyramid_beta is not None:
            raise ConfigError("pyramidkv: the scorer is already a pyramidkv; nest it once")
        self.beta = beta

    @property
    def allocation(self) -> Allocation:
        return replace(self._inner_allocation(), pyramid_beta=float(self.beta))


@register_eviction
class AdaKV(BudgetPolicy):
    """AdaKV (Feng et al. 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for
    Efficient LLM Inference"; kvpress `AdaKVPress`): per sample, layer and modality, the KV heads share
    `Hkv x k` tokens (k the uniform per-head count): the top of all (head, token) scores together, after
    each head keeps its top `floor(alpha_safeguard x k)` (default 0.2, as kvpress). A head whose tokens
    score higher keeps more. Sinks and the recent window stay in every head, counted in its share. The
    scorer (SnapKV by default, as the paper) must declare `comparable_across_heads`."""

    name = "adakv"
    own_options = ("alpha_safeguard",)

    def __init__(
        self,
        scorer: str | EvictionPolicy = DEFAULT_SCORER,
        alpha_safeguard: float = 0.2,
        **scorer_options: Any,
    ):
        a = alpha_safeguard
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0:
            raise ConfigError(
                f"adakv: alpha_safeguard must be in [0, 1] (each head keeps at least that share of its "
                f"uniform budget), got {a!r}"
            )
        super().__init__(scorer, **scorer_options)
        if self._inner_allocation().share_heads:
            raise ConfigError("adakv: the scorer already shares the heads' budget (adakv); nest it once")
        check_comparable(self.scorer, "adakv")
        self.alpha_safeguard = float(a)

    @property
    def allocation(self) -> Allocation:
        return replace(self._inner_allocation(), share_heads=True, alpha_safeguard=self.alpha_safeguard)


# ---- checks ----------------------------------------------------------------------------------------


def _chain(method: str, options: dict[str, Any]) -> tuple[list[type], Any, dict[str, Any]]:
    """Unfold a spec's wrappers: (the wrapper classes outermost first, the scorer: a name, a built policy
    or whatever was passed, the options left for it)."""
    wrappers: list[type] = []
    name: Any = method
    while isinstance(name, str) and isinstance(EVICTION_REGISTRY.get(name), type):
        cls = EVICTION_REGISTRY[name]
        if not issubclass(cls, BudgetPolicy) or len(wrappers) > 8:
            break
        wrappers.append(cls)
        name = options.get("scorer", DEFAULT_SCORER)
        options = {k: v for k, v in options.items() if k != "scorer" and k not in cls.own_options}
    return wrappers, name, options


def declared_comparable(name: str, options: dict[str, Any]) -> bool | None:
    """What a method spec declares about comparability across heads, from the classes alone (nothing is
    built or loaded): True / False, or None when it depends on the built policy (KVP's agents) or on a
    name the registry does not know (the policy's construction reports that)."""
    _, scorer, _ = _chain(name, options)
    if isinstance(scorer, EvictionPolicy):
        v = scorer.comparable_across_heads
    elif isinstance(scorer, str) and scorer in EVICTION_REGISTRY:
        v = getattr(EVICTION_REGISTRY[scorer], "comparable_across_heads", False)
    else:
        return None
    return v if isinstance(v, bool) else None


def check_spec(method: str, options: dict[str, Any], head_budget: str) -> None:
    """The configuration's check (no policy built): a budget shared by the heads (method adakv, or
    head_budget="shared") over a scorer whose class says its scores are not comparable across heads is
    refused; so is adakv with head_budget="shared" (the heads' budget would be shared twice)."""
    if method == "full":
        return
    load_builtin_policies()
    wrappers, scorer, _ = _chain(method, options)
    adakv = any(issubclass(c, AdaKV) for c in wrappers)
    if adakv and head_budget == "shared":
        raise ConfigError(
            "adakv already shares the heads' budget: leave head_budget at 'uniform' (head_budget=shared is "
            "adakv with alpha_safeguard=0)"
        )
    if (adakv or head_budget == "shared") and declared_comparable(method, options) is False:
        name = scorer if isinstance(scorer, str) else getattr(scorer, "name", type(scorer).__name__)
        raise ConfigError(not_comparable_message(name, "adakv" if adakv else "head_budget=shared"))


register_spec_check(check_spec)  # the configuration runs it for every eviction spec
