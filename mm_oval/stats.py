"""Runtime figures of a wrapped model: tokens and KV bytes kept per layer and modality, the bytes the
cache and the method hold (by kind), pages read, prefill and decode time. `get_stats(model)` describes
the last `generate` (or forward) call.

Two kinds of memory figures, side by side:
- kept (`kv_bytes_kept`, `kv_fraction_kept`, ...): keys and values of the prompt tokens the method kept,
  the figure methods are compared at;
- allocated (`allocated_bytes`): every tensor the cache and the method hold at the end of the request,
  each storage counted once (views share storage), by kind: `kv` (key/value storage including padding to
  the longest head and the preallocated decode slots), `summaries` (page summaries of retrieval methods),
  `metadata` (slot and page tables, positions, the request's token facts, the cache's own layout and
  padding mask in its request and step state), `method_state` (the prompt's `inputs_embeds` kept for
  retrieval, the rest of the request's and step's state (`cache.request`, `cache.step`: what the eviction
  policy's request pass returned, FastV's ranking, KVP's log-partition, the last hidden state), the
  policies' own tensors such as learned weights and cached tables); `allocated_vs_plain` divides the total by `plain_cache_bytes`,
  what a plain Hugging Face `DynamicCache` holds for the same request (keys and values of every prompt
  position, padding included, and of every token fed after it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from transformers import PreTrainedModel

from .errors import ConfigError

ALLOCATED_KINDS = ("kv", "summaries", "metadata", "method_state")
_KV_ATTRS = ("_k", "_v", "keys", "values")
_SCALARS = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device)


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor reachable from `obj` through dicts (values), lists, tuples, sets, dataclass instances
    and `nn.Module`s (their parameters, buffers and tensor attributes). Other objects, and a Hugging Face
    model (the served model's weights) or an object marking itself `part_of_served_model` (e.g. the RoPE
    module the policies share with the model), are not entered."""
    seen: set[int] = set()
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            yield o
            continue
        if (
            isinstance(o, _SCALARS)
            or isinstance(o, PreTrainedModel)
            or getattr(type(o), "part_of_served_model", False)
            or id(o) in seen
        ):
            continue  # a policy may refer to the model it serves (or a module of it): its weights are not the method's
        seen.add(id(o))
        if isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif isinstance(o, torch.nn.Module) or (dataclasses.is_dataclass(o) and not isinstance(o, type)):
            stack.extend(vars(o).values())


def _storage(t: torch.Tensor) -> tuple[Any, int]:
    """(a key identifying the tensor's storage, its size in bytes)."""
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # no plain storage (e.g. sparse): count the tensor itself
        return ("tensor", id(t)), t.numel() * t.element_size()
    return (t.device, s.data_ptr(), s.nbytes()), s.nbytes()


class _Counter:
    """Adds the storages of tensors to kinds, each storage once (the first kind that reaches it)."""

    def __init__(self) -> None:
        self.seen: set[Any] = set()
        self.bytes = dict.fromkeys(ALLOCATED_KINDS, 0)

    def add(self, kind: str, obj: Any) -> None:
        for t in iter_tensors(obj):
            key, n = _storage(t)
            if key not in self.seen:
                self.seen.add(key)
                self.bytes[kind] += n


def allocated_bytes(cache: Any) -> dict[str, int]:
    """Bytes held by a `PagedMultimodalCache` and its policies, by kind (see the module docstring), with
    the sum as "total". The model's own modules (which the layers refer to) are not counted."""
    c = _Counter()
    layers = list(cache.layers)
    for layer in layers:  # first: a view of the KV storage elsewhere is still KV
        c.add("kv", [getattr(layer, name, None) for name in _KV_ATTRS])
    for layer in layers:
        c.add("summaries", getattr(layer, "summaries", None))
    for layer in layers:
        skip = ("owner", "module", "summaries", *_KV_ATTRS)
        c.add("metadata", {k: v for k, v in vars(layer).items() if k not in skip})
    skip = ("layers", "config", "eviction", "retrieval", "request", "step")
    c.add("metadata", {k: v for k, v in vars(cache).items() if k not in skip})
    request, step = getattr(cache, "request", None), getattr(cache, "step", None)
    if request is not None:  # the cache's own layout is metadata; the rest is the methods' state
        c.add("metadata", request.full_layout)
        c.add("method_state", {k: v for k, v in vars(request).items() if k != "full_layout"})
    if step is not None:  # which new tokens are padding is the cache's; the hidden states the methods'
        c.add("metadata", step.new_valid)
        c.add("method_state", {k: v for k, v in vars(step).items() if k != "new_valid"})
    for policy in (getattr(cache, "eviction", None), getattr(cache, "retrieval", None)):
        if policy is not None:
            c.add("method_state", list(policy.state_tensors()))
    out = dict(c.bytes)
    out["total"] = sum(c.bytes.values())
    return out


def plain_cache_bytes(cache: Any) -> int:
    """Bytes of keys and values a plain `DynamicCache` holds for the same request: every layer, every prompt
    position of the batch (padding included) and every token fed after the prompt, in the cache's dtype."""
    info = getattr(cache, "info", None)
    if info is None:
        return 0
    n_prompt = int(info.modality.shape[1])
    total = 0
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if keys is None or getattr(layer, "phase", "empty") == "empty":
            continue
        B, H, _, D = keys.shape
        n_fed = n_prompt + int(getattr(layer, "n_decode", 0))
        total += 2 * B * H * n_fed * D * keys.element_size()
    return total


def cache_stats(cache: Any) -> dict[str, Any]:
    """JSON-serialisable summary of a `PagedMultimodalCache` after a request."""
    layers = [dict(layer.stats) for layer in cache.layers if layer.stats]
    totals: dict[str, float] = {}
    for row in layers:
        for k, v in row.items():
            if k != "layer":
                totals[k] = totals.get(k, 0) + v
    full = totals.get("image_bytes_full", 0) + totals.get("text_bytes_full", 0)
    kept = totals.get("image_bytes_kept", 0) + totals.get("text_bytes_kept", 0)
    allocated = allocated_bytes(cache)
    plain = plain_cache_bytes(cache)
    out: dict[str, Any] = {
        "method": cache.config.method,
        "budget": cache.config.budget,
        "text_budget": cache.config.text_budget,
        "eviction_scope": cache.config.eviction_scope,
        "retrieval": cache.config.retrieval,
        "read_budget": cache.config.read_budget,
        "read_scope": cache.config.read_scope,
        "layers": layers,
        "kv_bytes_full": int(full),
        "kv_bytes_kept": int(kept),
        "kv_fraction_kept": (kept / full) if full else None,
        "image_kv_fraction_kept": (totals["image_bytes_kept"] / totals["image_bytes_full"])
        if totals.get("image_bytes_full")
        else None,
        "allocated_bytes": allocated,
        "plain_cache_bytes": plain,
        "allocated_vs_plain": (allocated["total"] / plain) if plain else None,
        "prefill_s": cache.timings["prefill_s"],
        "decode_s": cache.timings["decode_s"],
        "decode_steps": cache.timings["decode_steps"],
    }
    cand = int(cache.counters["candidate_pages"])
    out["page_read_fraction"] = (int(cache.counters["pages_read"]) / cand) if cand else None
    return out


def get_stats(model: Any) -> dict[str, Any]:
    """Stats of the last request served by a model wrapped with `mm_oval.wrap`."""
    state = getattr(model, "_mm_oval", None)
    if state is None:
        raise ConfigError("this model is not wrapped: call mm_oval.wrap(model, ...) first")
    if state.last_stats is None:
        raise ConfigError("no request has run through the wrapped model yet: call model.generate(...) first")
    return state.last_stats
