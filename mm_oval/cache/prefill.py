"""The end of one layer's prefill, in steps: check the prompt, score its tokens with the eviction policy
and keep the budget's top (`choose_tokens`), then `compress`: lay the kept tokens out in pages
(`lay_out_pages`), compact them into the layer's storage (`PageStore.compact`), summarise the pages for the
retrieval policy (`summaries.summarize`, through the layer's `_summarize`) and start the layer's counts
(`ReadTelemetry.start`). `finish_prefill` runs them in that order; the attention over the whole prompt ran
before, the model's own. A budget ranked across the layers waits for every layer's scores
(`finish_across_layers`) and compresses the layers together after the last one."""

from __future__ import annotations

from typing import Any

import torch

from ..allocation import Allocation
from ..core import IMAGE, PAD, PrefillContext, budget_count
from ..errors import ConfigError, DataError
from ..pages import dynamic_labels, kept_labels, layout_pages
from .request import choose_kept
from .storage import PageStore
from .summaries import VALUE_WINDOW
from .telemetry import ReadTelemetry


def finish_prefill(layer: Any, query: torch.Tensor, module: Any, scaling: float) -> None:
    """Compress `layer`'s prompt (its `keys`, `values` as the model's attention stored them) into pages.
    Under a budget ranked across the layers (`Allocation.across_layers`) the layer only scores its tokens
    here; the last layer to score chooses for every layer and compresses them all (`finish_across_layers`),
    so until then each layer holds its whole prompt, as the unwrapped model's cache does."""
    owner, info = layer.owner, layer.owner.info
    keys = layer.keys
    B, H, N, D = keys.shape
    if info.modality.shape != (B, N):
        raise DataError(
            f"the cache was prepared for inputs of shape {tuple(info.modality.shape)} but layer "
            f"{layer.layer_idx} got {N} tokens for batch {B}"
        )
    valid = (info.modality != PAD).unsqueeze(1).expand(B, H, N)
    if owner.retrieval is not None and owner.config.unread_pages == "scored":  # the values' means' weights
        layer.value_query = query[:, :, -VALUE_WINDOW:].float() * scaling
    hidden = owner.step.attention_inputs.pop(layer.layer_idx, None)  # kept when the policy asks for it
    keep = choose_tokens(layer, query, module, scaling, hidden, valid)
    if keep is None:  # scored; kept once every layer has scored
        layer.module = module
        finish_across_layers(owner, valid)
        return
    compress(layer, keep, valid, module)


def compress(layer: Any, keep: torch.Tensor, valid: torch.Tensor, module: Any) -> None:
    """Lay the kept tokens out in pages, compact them into the layer's storage, summarise them for the
    retrieval policy and start the layer's counts: the layer's prefill is done."""
    owner, info = layer.owner, layer.owner.info
    keys, values = layer.keys, layer.values
    lay = lay_out_pages(layer, keep, valid)
    layer.store = PageStore.compact(keys, values, lay, info, owner.config.text_page_size)
    layer.keys = layer.values = None  # the prompt's: the storage's views from now on
    layer.module = module
    layer.summaries = {}
    layer.page_means = {}
    if owner.retrieval is not None:
        layer._summarize(0, layer.store.prompt_pages)  # summaries.summarize
    layer.phase = "decode"
    layer.telemetry = ReadTelemetry.start(layer.store, info, lay)


def choose_tokens(
    layer: Any, query: torch.Tensor, module: Any, scaling: float, hidden: Any, valid: torch.Tensor
) -> torch.Tensor:
    """(B, Hkv, N) bool: the tokens each KV head keeps: every valid one when nothing is evicted (no policy,
    or a layer the policy leaves unchanged), else the protected ones and the budget's top scores."""
    owner, cfg, info = layer.owner, layer.owner.config, layer.owner.info
    policy = owner.eviction
    if policy is None or not cfg.evicts:
        return valid
    if policy.needs_hidden_states and hidden is None:
        raise ConfigError(
            f"eviction method {policy.name!r} reads each layer's hidden states: run it through a "
            "model wrapped with mm_oval.wrap"
        )
    # the budget's division (PyramidKV over the layers that evict, AdaKV over the heads)
    alloc = Allocation.of(policy, cfg.head_budget)
    scores = policy.score(prefill_context(layer, query, module, scaling, hidden, alloc))
    if policy.keep_layer_unchanged(layer.layer_idx):
        return valid
    if scores.shape != valid.shape:
        raise ConfigError(
            f"eviction method {policy.name!r} returned scores of shape {tuple(scores.shape)}, "
            f"expected {tuple(valid.shape)}"
        )
    if alloc.across_layers:  # chosen with the other layers' (finish_across_layers)
        owner.request.layer_scores[layer.layer_idx] = scores
        return None
    rank, n_evicting = 0, 1
    if alloc.per_layer:  # only a per-layer schedule or weights need the layer's place
        evicting = evicting_layers(owner)
        rank, n_evicting = evicting.index(layer.layer_idx), len(evicting)
    return choose_kept(scores, info, cfg, alloc, rank, n_evicting) & valid


def evicting_layers(owner: Any) -> list[int]:
    """The layers the eviction policy compresses (not `keep_layer_unchanged`), in order."""
    return [i for i in range(len(owner.layers)) if not owner.eviction.keep_layer_unchanged(i)]


def finish_across_layers(owner: Any, valid: torch.Tensor) -> None:
    """One choice over every layer (`Allocation.across_layers`): once every layer that evicts has scored its
    prompt (`request.layer_scores`, (B, Hkv, N) each, on one scale across layers and heads), their KV heads
    are ranked together as the heads of one layer are under a shared budget (`choose_kept`: `layers x Hkv
    x k` tokens, the protected ones in every head) and each of those layers is compressed with its slice."""
    scores = owner.request.layer_scores
    evicting = evicting_layers(owner)
    if any(i not in scores for i in evicting):
        return
    joint = torch.cat([scores[i].to(valid.device) for i in evicting], dim=1)
    kept = choose_kept(joint, owner.info, owner.config, Allocation(share_heads=True))
    scores.clear()
    H = valid.shape[1]
    for j, i in enumerate(evicting):
        layer = owner.layers[i]
        here = valid.to(layer.keys.device)  # a model split over devices: each layer's own
        compress(layer, kept[:, j * H : (j + 1) * H].to(here.device) & here, here, layer.module)


def prefill_context(
    layer: Any, query: torch.Tensor, module: Any, scaling: float, hidden: Any, alloc: Allocation
) -> PrefillContext:
    """What the eviction policy reads about this layer's prompt (queries and hidden states if it asks)."""
    owner, info, policy = layer.owner, layer.owner.info, layer.owner.eviction
    return PrefillContext(
        layer_idx=layer.layer_idx,
        keys=layer.keys,
        values=layer.values,
        queries=query if policy.needs_queries else None,
        positions=info.positions,
        modality=info.modality,
        image_rc=info.image_rc,
        scaling=scaling,
        module=module,
        chunk_size=owner.config.chunk_size,
        request=owner.request,
        hidden_states=hidden if policy.needs_hidden_states else None,
        rope=owner.rope,
        image_keep=image_keep(layer, alloc),
    )


def image_keep(layer: Any, alloc: Allocation) -> int | None:
    """The most image tokens one KV head of this layer keeps under `choose_kept`: the budget's count per
    head (protected tokens included), or the layer's KV heads' counts together when they share the
    budget (one head may take them all); None when the count is not bounded that way (PyramidKV's
    schedule, one budget over all tokens)."""
    cfg, info = layer.owner.config, layer.owner.info
    alloc = alloc.with_head_budget(cfg.head_budget)
    if cfg.eviction_scope == "all" or alloc.per_layer or alloc.across_layers:
        return None
    image = info.modality == IMAGE
    n = image.sum(-1)
    k = torch.maximum(budget_count(cfg.budget, n), (info.protected & image).sum(-1))
    if alloc.share_heads:
        k = torch.minimum(k * layer.keys.shape[1], n)
    return int(k.max()) if k.numel() else 0


def lay_out_pages(layer: Any, keep: torch.Tensor, valid: torch.Tensor) -> Any:
    """The page layout of the kept tokens (`pages.layout_pages`): OVAL's pages sized per layer and KV head
    from the keys, runs of kept image tokens ("kept"), or fixed tiles; with nothing evicted every layer has
    the same layout, built once per request."""
    owner, cfg, info = layer.owner, layer.owner.config, layer.owner.info
    args = (info.modality, info.positions, info.image_rc, info.protected, cfg.image_tile, cfg.text_page_size)

    def labels_of(kept: torch.Tensor) -> Any:  # None: fixed tiles; "kept": runs of kept image tokens
        if cfg.page_sizing != "kept":
            return None
        return kept_labels(kept, info.modality, info.image_rc, cfg.image_tile, cfg.text_page_size)

    if cfg.sizing is not None:  # OVAL sizing (dynamic pages need a retrieval method: config.py)
        labels = dynamic_labels(layer.keys, keep, info.modality, info.image_rc, cfg.sizing)
        return layout_pages(keep, *args, labels=labels)
    if keep is not valid:
        return layout_pages(keep, *args, labels=labels_of(keep))
    lay = owner.request.full_layout
    if lay is None or lay.src.shape[1] != keep.shape[1]:
        lay = owner.request.full_layout = layout_pages(keep, *args, labels=labels_of(keep))
    return lay
