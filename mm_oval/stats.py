"""Runtime figures of a wrapped model: tokens and KV bytes kept per layer and modality, pages read,
prefill and decode time. `get_stats(model)` describes the last `generate` (or forward) call."""

from __future__ import annotations

from typing import Any

from .errors import ConfigError


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
    out: dict[str, Any] = {
        "method": cache.config.method,
        "budget": cache.config.budget,
        "text_budget": cache.config.text_budget,
        "scope": cache.config.scope,
        "retrieval": cache.config.retrieval,
        "read_budget": cache.config.read_budget,
        "layers": layers,
        "kv_bytes_full": int(full),
        "kv_bytes_kept": int(kept),
        "kv_fraction_kept": (kept / full) if full else None,
        "image_kv_fraction_kept": (totals["image_bytes_kept"] / totals["image_bytes_full"])
        if totals.get("image_bytes_full")
        else None,
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
