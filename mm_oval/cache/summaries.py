"""The retrieval policy's page summaries of one layer: built when pages close (every prompt page after
prefill, each text page that fills up at decode), in chunks whose temporaries stay within a share of the
layer's KV bytes."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..core import PageBatch
from ..kernels.common.quant import dequantize_int8, quantize_int8
from ..pages import gather_pages

# the share of a layer's KV bytes that the temporaries of building its page summaries may take at once, and
# a floor under it: a short prompt's layer (a few MB of KV) would otherwise be summarised a page or two per
# call, each call a round of small batched eigendecompositions whose overhead, not arithmetic, sets the time
# (a 1k-token SmolLM2 prompt: ~33 calls per layer, a third of the whole retrieval run's time on a CPU)
SUMMARY_TEMP_SHARE = 0.25
SUMMARY_TEMP_FLOOR = 32 * 2**20


def summary_chunk(layer: Any, T: int) -> int:
    """Pages (padded to T tokens) per `summarize` call: as many as keep the call's temporaries (padded page
    keys/values, their fp32 copies, Gram matrices and eigendecompositions, the page tokens' input
    embeddings for a policy that pools them) within SUMMARY_TEMP_SHARE of the layer's KV bytes or
    SUMMARY_TEMP_FLOOR bytes, whichever is more (at least one page)."""
    B, H, L, D = layer.keys.shape
    hidden = 0
    embeds = layer.owner.request.inputs_embeds
    if layer.owner.retrieval.needs_inputs_embeds and embeds is not None:
        hidden = embeds.shape[-1]
    per_page = B * H * T * ((4 * layer.keys.element_size() + 48) * D + 12 * hidden + 32 * T)
    kv = 2 * layer.keys.numel() * layer.keys.element_size()
    return max(1, int(max(SUMMARY_TEMP_SHARE * kv, SUMMARY_TEMP_FLOOR)) // per_page)


def page_width(layer: Any, first: int, stop: int) -> int:
    """The padded width T of pages [first, stop) as gather_pages pads them all at once."""
    length = layer.page_len[..., first:stop]
    return max(int(length.max()) if length.numel() else 0, 1)


def summarize(layer: Any, first: int, stop: int) -> None:
    """Summaries of pages [first, stop), appended to `layer.summaries`. Built in chunks of pages (each
    padded to the width of the whole range, so that the summaries are those of one call) written into one
    preallocated tensor per summary: the temporaries stay within a share of the layer's KV bytes."""
    T = page_width(layer, first, stop)
    step = summary_chunk(layer, T)
    new: dict[str, torch.Tensor] = {}
    slot_src = layer.slot_src
    unread, policy = layer.owner.config.unread_pages, layer.owner.retrieval
    # the keys' mean only where the retrieval record does not already hold it (OVAL / LOCKS keep it)
    own_keys = unread == "centroid" and not getattr(policy, "keeps_key_means", False)
    means = ("k", "v") if own_keys else ("v",) if unread != "skip" else ()
    for a in range(first, stop, step):
        b = min(stop, a + step)
        batch = _page_batch(layer, a, b, T, slot_src)
        part = layer.owner.retrieval.summarize(batch)
        if means:
            _append_means(layer, batch, means)
        if step >= stop - first:
            new = part
            break
        for name, t in part.items():
            if name not in new:
                new[name] = t.new_empty((*t.shape[:2], stop - first, *t.shape[3:]))
            new[name][:, :, a - first : b - first] = t
    for name, t in new.items():
        old = layer.summaries.get(name)
        layer.summaries[name] = t if old is None else torch.cat([old, t], dim=2)


# `unread_pages="scored"` weighs a page's values by the attention the prompt's last VALUE_WINDOW queries pay
# its tokens (each query's softmax within the page, averaged over the window and the KV head's query heads).
# On SmolLM2's training contexts that mean misses the unread pages' output by 0.35 / 0.37 of its norm (pass
# key / message; benchmarks/probe_unread_estimate.py), the plain mean by 1.07 / 1.06; a window of the last
# query alone did worse than 16 in a scratch run (docs/results/smollm2.md)
VALUE_WINDOW = 16


def attended_value_means(
    values: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, query: torch.Tensor
) -> torch.Tensor:
    """(B, Hkv, P, D) fp32: each page's values weighted by the in-page attention of the reference queries
    `query` (B, Hq, W, D), already multiplied by the attention scaling: per query, the softmax of its logits
    over the page's tokens, averaged over the W queries and the KV head's query heads. keys / values
    (B, Hkv, P, T, D), mask (B, Hkv, P, T) bool."""
    B, H, P, T, D = keys.shape
    q = query.reshape(B, H, -1, D)  # a KV head's query heads and window together
    logits = torch.einsum("bhqd,bhptd->bhpqt", q, keys.float()).masked_fill(~mask.unsqueeze(3), float("-inf"))
    w = torch.softmax(logits, -1).nan_to_num(0.0).mean(3)  # (B, H, P, T)
    return torch.einsum("bhpt,bhptd->bhpd", w, values.float())


def _append_means(layer: Any, batch: PageBatch, names: tuple[str, ...]) -> None:
    """Each page's keys' ("k") and values' ("v") means, those of `names`, appended to `layer.page_means`:
    what `unread_pages` reads of a page a step does not read (the values' mean; the keys' too with
    "centroid" when the retrieval record holds no key mean; with "scored" the values' mean is weighted by
    the prompt's last queries' attention, `attended_value_means`, from `layer.value_query`). Stored compact,
    int8 with one fp16 scale per page and KV head (`quantize_int8`, as the compact records' centroids):
    "k", "v" (B, Hkv, P, D) int8, "k_scale", "v_scale" (B, Hkv, P) fp16."""
    m = batch.mask.unsqueeze(-1).float()
    n = m.sum(-2).clamp(min=1)
    ref = layer.value_query  # unread_pages="scored": the values weighted by attention
    for name in names:
        if name == "v" and ref is not None:
            mean = attended_value_means(batch.values, batch.keys, batch.mask, ref)
        else:
            mean = ((batch.keys if name == "k" else batch.values).float() * m).sum(-2) / n
        q, scale = quantize_int8(mean, 1)
        for key, t in ((name, q), (f"{name}_scale", scale)):
            old = layer.page_means.get(key)
            layer.page_means[key] = t if old is None else torch.cat([old, t], dim=2)


def page_mean(layer: Any, name: str) -> torch.Tensor:
    """(B, Hkv, P, D) fp32: the pages' values' ("v") or keys' ("k") means: as `_append_means` stored them,
    or for the keys, the retrieval record's own centroid where it holds one (`keeps_key_means`)."""
    if name == "k" and "k" not in layer.page_means:
        return layer.owner.retrieval.page_key_means(layer.summaries)
    return dequantize_int8(layer.page_means[name], layer.page_means[f"{name}_scale"])


def page_means_bytes(layer: Any) -> int:
    """Bytes a step reads of one page's means beyond its retrieval record: an int8 vector of head_dim and an
    fp16 scale for each mean the layer keeps (the values'; the keys' too when the record holds none)."""
    return sum(1 for name in ("k", "v") if name in layer.page_means) * (layer.store.keys.shape[-1] + 2)


def _page_batch(layer: Any, a: int, b: int, T: int, slot_src: torch.Tensor) -> PageBatch:
    """Pages [a, b) of `layer`, padded to T tokens, as the retrieval policy's `summarize` takes them."""
    k, v, mask, src = gather_pages(
        layer.keys, layer.values, layer.page_start, layer.page_len, slice(a, b), slot_src
    )
    if k.shape[-2] < T:  # the padding gather_pages gives the pages of the whole range
        pad = T - k.shape[-2]
        k, v = F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
        mask, src = F.pad(mask, (0, pad)), F.pad(src, (0, pad), value=-1)
    return PageBatch(
        layer_idx=layer.layer_idx,
        keys=k,
        values=v,
        mask=mask,
        kind=layer.page_kind[..., a:b],
        first_page=a,
        module=layer.module,
        token_index=src,
        request=layer.owner.request,
    )
