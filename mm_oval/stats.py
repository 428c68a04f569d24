"""Runtime figures of a wrapped model: tokens and KV bytes kept per layer and modality, the bytes the
cache and the method hold (by kind), pages read, prefill and decode time. `get_stats(model)` describes
the last `generate` (or forward) call; `to_prometheus(stats)` writes them in the Prometheus text format.

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

What the decode steps read (`bytes_read`), summed over layers, KV heads and the batch, in the cache's
dtypes, real tokens only (never padding):
- `total`: `summaries` (the page summaries the retrieval policy scanned: those of the candidate pages, as
  its `summary_bytes` counts them: Quest's min/max keys, LOCKS/OVAL's centroid, basis and the coefficients
  of the page's tokens, the router's page embeddings and cross-attention keys/values), `selected` (keys
  and values of the tokens of the pages the policy selected), `always_read` (keys and values read whatever
  the selection: the open page, pinned sink/recent pages, text pages when `read_scope` is "image"; every
  slot without retrieval), `read` (the sum of the three) and `dense` (keys and values of every resident
  slot: what full attention over the kept cache reads); the same under `image` and `text`, by the
  modality of the pages (summaries) or tokens;
- `per_step`: `total` divided by `decode_steps` (the decode forwards; a later turn fed at once is one);
- `read_vs_dense` = read / dense (1.0 without retrieval; above 1 when the summaries cost more than the
  keys they spare), `image_read_vs_dense`, `text_read_vs_dense` per modality;
- `chunks`: `read` and `dense` of the forwards that fed several tokens (a later turn, the question read
  after a compressed context), part of `total`; `one_token_read_vs_dense`: read / dense of the other steps,
  those that feed one token (what `read_bytes_budget` bounds; None without any);
- `over_budget`: with `read_bytes_budget`, the (layer, KV head, step) reads whose summaries and
  always-read pages alone exceeded the head's budget (they read no optional page; with `read_head_budget`
  "shared" the layer's other heads pay for the excess out of the bytes they share), else 0;
- `read_head_budget`: "uniform" (each KV head within its own read budget) or "shared" (a layer's KV heads
  within the sum of theirs);
- `read_chunks`: "retrieval" (a later turn fed at once reads by the retrieval policy) or "dense" (it reads
  every page; counted in the totals above as dense reads); `dense_chunk_reads`: the (layer, forward) reads of
  several tokens that read every page so;
- `dense_layers`: how many of the first layers read every page at every step (counted as dense reads);
- `read_layer_budget`: "uniform" (every layer within the same read budget) or the per-layer division used;
- `unread_pages`: "skip" (a step attends over the pages it reads), "centroid" (the candidate pages it does
  not read enter as their keys' and values' means; those means count in `bytes_read["summaries"]`) or
  "scored" (as their values' means, weighted by the retrieval scorer's estimate of their attention mass).

With `monitor_retrieval` (`RetrievalMonitor`), `retrieval_monitor` measures each layer's page selection at
each decode step against exact attention of the step's newest token over the resident slots, pooled over
steps, layers, the batch and heads (absent without the knob or before any selection):
- `hit_rate`: selected pages that are among the true top-k candidate pages, over the pages selected (k =
  the pages selected for that KV head and step; a page's true mass is its share of exact attention, the
  query heads' page distributions averaged over the KV head's group);
- `attention_mass_recall`: `measures.attention_mass_captured` of the tokens read (selected and
  always-read pages), the mean over (step, layer, sample, query head); `layer_attention_mass_recall`: the
  same per layer, a list indexed by layer (None for a layer never measured, e.g. below `dense_layers`);
- `page_utilisation`: the share of the request's (layer, sample, KV head) candidate pages read at least once;
- `pages_selected` (the denominator of `hit_rate`), `layer_steps` (the selections measured);
- `co_read_density`: how many page pairs are read together: per (step, layer, sample, KV head), the graph
  whose edges are the pairs of candidate pages both read at one of the last `CO_READ_WINDOW` (8) steps
  (router v2's co-read graph, `Router2Config.gcn_window`), its edges over all pairs of candidate pages;
  the mean over them (0: no two pages ever read together; 1: every pair; steps with fewer than two
  candidate pages are left out). A sparse graph is what its GCN term can use;
- `select_ms_p50` / `select_ms_p99`: one layer's `select` (perf_counter; synchronised on CUDA), median and
  99th percentile over the (layer, step) calls; `step_select_ms_p50` / `_p99`: summed over a step's layers.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Info, generate_latest

from .errors import ConfigError
from .telemetry import (  # noqa: F401  (the figures are public here too)
    ALLOCATED_KINDS,
    CO_READ_WINDOW,
    RetrievalMonitor,
    allocated_bytes,
    bytes_read,
    cache_stats,
    plain_cache_bytes,
)
from .wrapper import last_stats


def get_stats(model: Any) -> dict[str, Any]:
    """Stats of the last request served by a model wrapped with `mm_oval.wrap` (the wrapper keeps them;
    `mm_oval.wrapper.last_stats`)."""
    return last_stats(model)


# ---- Prometheus text format -------------------------------------------------------------------------------
_CONFIG_KEYS = ("method", "budget", "text_budget", "eviction_scope", "retrieval", "read_budget", "read_scope",
                "read_bytes_budget", "read_head_budget", "read_chunks", "dense_layers", "read_layer_budget", "unread_pages")  # fmt: skip
_BYTES_PARTS = ("summaries", "selected", "always_read", "read", "dense")


def to_prometheus(
    stats: dict[str, Any], labels: dict[str, str] | None = None, prefix: str = "mm_oval"
) -> str:
    """`stats` (what `get_stats` returns) in the Prometheus text exposition format, through
    `prometheus_client`, for a scrape endpoint or node_exporter's textfile collector. Every metric is a
    gauge of the last request, carrying `labels` (e.g. {"model": "llava-1.5-7b", "rank": "0"}); figures the
    request does not have (no retrieval: no page reads) are left out, never written as 0. The metrics:
    `<prefix>_config_info` (the configuration as labels), `_kv_bytes{state=full|kept}`,
    `_kv_fraction_kept{modality=all|image}`, `_allocated_bytes{kind}`, `_plain_cache_bytes`,
    `_allocated_vs_plain`, `_prefill_seconds`, `_decode_seconds`, `_decode_steps`, `_page_read_fraction`,
    `_bytes_read{part,modality,per=request|step}`, `_read_vs_dense{modality}`, `_read_over_budget`; with
    `monitor_retrieval` (the stats' `retrieval_monitor`), `_retrieval_hit_rate`,
    `_retrieval_attention_mass_recall`, `_retrieval_page_utilisation`, `_retrieval_pages_selected` and
    `_retrieval_select_seconds{per=layer|step,quantile=0.5|0.99}`."""
    if not isinstance(stats, dict) or "allocated_bytes" not in stats:
        raise ConfigError("to_prometheus takes the dict get_stats(model) returns")
    labels = {str(k): str(v) for k, v in (labels or {}).items()}
    names = list(labels)
    registry = CollectorRegistry()

    gauges: dict[str, Gauge] = {}

    def put(name: str, doc: str, value: Any, **extra: str) -> None:
        """Set gauge `<prefix>_<name>` (made on first use: a gauge without labels would show 0 otherwise)."""
        if value is None:
            return
        g = gauges.get(name)
        if g is None:
            g = gauges[name] = Gauge(f"{prefix}_{name}", doc, [*names, *extra], registry=registry)
        (g.labels(**labels, **extra) if names or extra else g).set(float(value))

    info = Info(f"{prefix}_config", "the wrapped model's configuration", names, registry=registry)
    config = {k: str(stats.get(k)) for k in _CONFIG_KEYS if k in stats}
    (info.labels(**labels) if names else info).info(config)
    kv = "keys and values of the prompt: all of it (full) and what the method kept"
    put("kv_bytes", kv, stats.get("kv_bytes_full"), state="full")
    put("kv_bytes", kv, stats.get("kv_bytes_kept"), state="kept")
    kept = "share of the prompt's KV bytes kept"
    put("kv_fraction_kept", kept, stats.get("kv_fraction_kept"), modality="all")
    put("kv_fraction_kept", kept, stats.get("image_kv_fraction_kept"), modality="image")
    for kind, value in stats["allocated_bytes"].items():
        put("allocated_bytes", "bytes the cache and the method hold, by kind", value, kind=kind)
    put(
        "plain_cache_bytes",
        "what a plain DynamicCache holds for the same request",
        stats.get("plain_cache_bytes"),
    )
    put("allocated_vs_plain", "allocated bytes over the plain cache's", stats.get("allocated_vs_plain"))
    put("prefill_seconds", "prefill time, vision tower included", stats.get("prefill_s"))
    put("decode_seconds", "decode time, all steps", stats.get("decode_s"))
    put("decode_steps", "decode forwards", stats.get("decode_steps"))
    put("page_read_fraction", "share of candidate pages read per step", stats.get("page_read_fraction"))
    br = stats.get("bytes_read")
    if br:
        doc = "bytes the decode steps read, by part and modality"
        for per, block in (("request", br.get("total") or {}), ("step", br.get("per_step") or {})):
            for part in _BYTES_PARTS:
                put("bytes_read", doc, block.get(part), part=part, modality="all", per=per)
                for modality in ("image", "text"):
                    v = (block.get(modality) or {}).get(part)
                    put("bytes_read", doc, v, part=part, modality=modality, per=per)
        doc = "bytes read per step over dense attention's"
        put("read_vs_dense", doc, br.get("read_vs_dense"), modality="all")
        put("read_vs_dense", doc, br.get("image_read_vs_dense"), modality="image")
        put("read_vs_dense", doc, br.get("text_read_vs_dense"), modality="text")
        doc = "reads whose summaries and always-read pages exceeded the bytes budget"
        put("read_over_budget", doc, br.get("over_budget"))
    mon = stats.get("retrieval_monitor")
    if mon:
        put("retrieval_hit_rate", "selected pages among the exact top-attention pages (as many), share",
            mon.get("hit_rate"))  # fmt: skip
        put("retrieval_attention_mass_recall", "share of the exact attention mass on the tokens read",
            mon.get("attention_mass_recall"))  # fmt: skip
        put("retrieval_page_utilisation", "share of candidate pages read at least once in the request",
            mon.get("page_utilisation"))  # fmt: skip
        put("retrieval_co_read_density", "page pairs read together within 8 steps, share of candidate pairs",
            mon.get("co_read_density"))  # fmt: skip
        put(
            "retrieval_pages_selected",
            "pages the retrieval selected, all steps and layers",
            mon.get("pages_selected"),
        )
        doc = "time of the retrieval's page selection: one layer's call, or a decode step's (all layers)"
        for per, key in (("layer", "select_ms"), ("step", "step_select_ms")):
            for quantile, p in (("0.5", "p50"), ("0.99", "p99")):
                v = mon.get(f"{key}_{p}")
                put(
                    "retrieval_select_seconds",
                    doc,
                    None if v is None else v / 1e3,
                    per=per,
                    quantile=quantile,
                )
    return generate_latest(registry).decode("utf-8")
