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
- `over_budget`: with `read_bytes_budget`, the (layer, KV head, step) reads whose summaries and
  always-read pages alone exceeded the budget (they read no optional page), else 0.

With `monitor_retrieval` (`RetrievalMonitor`), `retrieval_monitor` measures each layer's page selection at
each decode step against exact attention of the step's newest token over the resident slots, pooled over
steps, layers, the batch and heads (absent without the knob or before any selection):
- `hit_rate`: selected pages that are among the true top-k candidate pages, over the pages selected (k =
  the pages selected for that KV head and step; a page's true mass is its share of exact attention, the
  query heads' page distributions averaged over the KV head's group);
- `attention_mass_recall`: `measures.attention_mass_captured` of the tokens read (selected and
  always-read pages), the mean over (step, layer, sample, query head);
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

import dataclasses
import time
from typing import Any

import torch
from prometheus_client import CollectorRegistry, Gauge, Info, generate_latest

from .core import iter_tensors, topk_mask
from .errors import ConfigError
from .measures import attention_mass_captured, exact_attention, page_mass
from .policies.router2 import CO_READ_WINDOW  # the monitor's co-read window is router v2's

ALLOCATED_KINDS = ("kv", "summaries", "metadata", "method_state")
_KV_ATTRS = ("_k", "_v", "keys", "values")


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
    out["read_bytes_budget"] = cache.config.read_bytes_budget
    out["bytes_read"] = bytes_read(cache)
    monitor = getattr(cache, "monitor", None)
    summary = monitor.summary() if monitor is not None else None
    if summary is not None:
        out["retrieval_monitor"] = summary
    return out


def bytes_read(cache: Any) -> dict[str, Any]:
    """The bytes the decode steps read, summed over layers (see the module docstring, `bytes_read`)."""
    counts = [getattr(layer, "telemetry", None) for layer in cache.layers]  # cache.telemetry.ReadTelemetry
    rows = [c.read_t for c in counts if c is not None]
    kinds = ("summaries", "selected", "always_read", "dense")
    t = torch.stack(rows).sum(0).tolist() if rows else [[0, 0] for _ in kinds]
    steps = int(cache.timings["decode_steps"])

    def block(image: list[int], text: list[int]) -> dict[str, Any]:
        tot = {k: int(i + x) for k, i, x in zip(kinds, image, text)}
        b: dict[str, Any] = dict(tot)
        b["image"] = {k: int(v) for k, v in zip(kinds, image)}
        b["text"] = {k: int(v) for k, v in zip(kinds, text)}
        for d in (b, b["image"], b["text"]):
            d["read"] = d["summaries"] + d["selected"] + d["always_read"]
        return b

    total = block([row[0] for row in t], [row[1] for row in t])

    def mean(d: dict[str, Any]) -> dict[str, Any]:
        return {k: mean(v) if isinstance(v, dict) else (v / steps if steps else None) for k, v in d.items()}

    ratio = lambda d: (d["read"] / d["dense"]) if d["dense"] else None  # noqa: E731
    return {
        "decode_steps": steps,
        "total": total,
        "per_step": mean(total),
        "read_vs_dense": ratio(total),
        "image_read_vs_dense": ratio(total["image"]),
        "text_read_vs_dense": ratio(total["text"]),
        "over_budget": int(cache.counters.get("read_over_budget", 0)),
    }


# ---- retrieval monitor (OvalConfig.monitor_retrieval) -------------------------------------------------------
@dataclasses.dataclass
class RetrievalMonitor:
    """What the retrieval chose against exact attention, accumulated over a request's decode steps and layers
    (a `PagedMultimodalCache` holds one when `monitor_retrieval` is on; `record` is called by each layer's
    `read_pages`). Tallies stay tensors on the cache's device (no host sync per step); the selection times
    are host floats. Its tensors count as the stats' `allocated_bytes["metadata"]`."""

    # per layer: [hits, pages selected, sum of the (B, Hq) recalls, their count] (float64)
    tally: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    # per layer: (B, Hkv, P) bool, the pages that were candidates / were read at some step
    ever_candidate: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    ever_read: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    select_s: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (decode step, seconds)
    # per layer: the last CO_READ_WINDOW steps' chosen pages (B, Hkv, Pc) and [sum of densities, count]
    co_window: dict[int, list[torch.Tensor]] = dataclasses.field(default_factory=dict)
    co_tally: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    @staticmethod
    def clock(device: torch.device) -> float:
        """time.perf_counter(), after the device's queued work on CUDA (the select is timed alone)."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def record(
        self,
        layer_idx: int,
        step: int,
        seconds: float,
        query: torch.Tensor,
        keys: torch.Tensor,
        slot_valid: torch.Tensor,
        slot_page: torch.Tensor,
        scaling: float,
        candidates: torch.Tensor,
        chosen: torch.Tensor,
        read: torch.Tensor,
    ) -> None:
        """One layer's decode step. query (B, Hq, D) the newest token's; keys (B, Hkv, L, D) the resident
        slots, slot_valid (B, Hkv, L), slot_page (B, Hkv, L) their pages; candidates / chosen (B, Hkv, Pc)
        bool the candidate pages and those the policy selected; read (B, Hkv, P) bool every page read."""
        attn = exact_attention(query, keys, slot_valid, scaling)  # (B, Hq, L)
        Hkv = slot_valid.shape[1]
        Pc = candidates.shape[-1]
        # each candidate page's exact attention mass, its query heads' page distributions averaged (the
        # kernels' GQA combination): the true top-k pages per KV head, k = the pages the policy selected
        mass = page_mass(attn, slot_page, read.shape[-1], kv_heads=Hkv)[..., :Pc]
        k = chosen.sum(-1)
        top = topk_mask(mass, candidates, k)
        slots = slot_valid & read.gather(-1, slot_page.clamp(min=0))
        recall = attention_mass_captured(attn, slots)  # (B, Hq)
        row = torch.stack([(top & chosen).sum().double(), k.sum().double(), recall.double().sum(),
                           torch.tensor(float(recall.numel()), dtype=torch.float64, device=recall.device)])  # fmt: skip
        old = self.tally.get(layer_idx)
        self.tally[layer_idx] = row if old is None else old + row
        for store, new in ((self.ever_candidate, candidates), (self.ever_read, chosen)):
            prev = store.get(layer_idx)
            if prev is not None:  # pages closed since: the candidates grew
                new = new | torch.nn.functional.pad(prev, (0, Pc - prev.shape[-1]))
            store[layer_idx] = new
        self.select_s.append((step, seconds))
        self._co_read(layer_idx, candidates, chosen)

    def _co_read(self, layer_idx: int, candidates: torch.Tensor, chosen: torch.Tensor) -> None:
        """The density of this step's co-read graph (pages read together over the window) per (sample, KV
        head), added to the layer's tally."""
        Pc = candidates.shape[-1]
        window = self.co_window.setdefault(layer_idx, [])
        window.append(chosen & candidates)
        del window[:-CO_READ_WINDOW]
        reads = torch.stack([torch.nn.functional.pad(w, (0, Pc - w.shape[-1])) for w in window], -2).float()
        together = (reads.transpose(-1, -2) @ reads) > 0  # (B, Hkv, Pc, Pc): read at one step of the window
        pairs = candidates.unsqueeze(-1) & candidates.unsqueeze(-2)
        pairs &= ~torch.eye(Pc, dtype=torch.bool, device=pairs.device)
        n_pairs = pairs.sum((-1, -2))
        has = n_pairs > 0
        density = (together & pairs).sum((-1, -2)).double() / n_pairs.clamp(min=1)
        row = torch.stack([density[has].sum(), has.sum().double()])
        old = self.co_tally.get(layer_idx)
        self.co_tally[layer_idx] = row if old is None else old + row

    def summary(self) -> dict[str, Any] | None:
        """The stats' `retrieval_monitor` block (see `cache_stats`); None before any monitored step."""
        if not self.tally:
            return None
        hits, selected, recall, n = torch.stack(list(self.tally.values())).sum(0).tolist()
        cand = sum(int(t.sum()) for t in self.ever_candidate.values())
        used = sum(int((r & c).sum()) for r, c in zip(self.ever_read.values(), self.ever_candidate.values()))
        per_call = [s for _, s in self.select_s]
        per_step: dict[int, float] = {}
        for step, sec in self.select_s:
            per_step[step] = per_step.get(step, 0.0) + sec
        q = lambda xs, p: 1e3 * float(torch.tensor(xs, dtype=torch.float64).quantile(p))  # noqa: E731
        co_sum, co_n = torch.stack(list(self.co_tally.values())).sum(0).tolist()
        return {
            "layer_steps": len(per_call),
            "pages_selected": int(selected),
            "hit_rate": hits / selected if selected else None,
            "attention_mass_recall": recall / n if n else None,
            "page_utilisation": used / cand if cand else None,
            "co_read_density": co_sum / co_n if co_n else None,
            "select_ms_p50": q(per_call, 0.5),
            "select_ms_p99": q(per_call, 0.99),
            "step_select_ms_p50": q(list(per_step.values()), 0.5),
            "step_select_ms_p99": q(list(per_step.values()), 0.99),
        }


def get_stats(model: Any) -> dict[str, Any]:
    """Stats of the last request served by a model wrapped with `mm_oval.wrap`."""
    # the wrapper owns the model's wrap state, and imports this module to compute the stats: it is asked at
    # call time (`mm_oval.wrapper.last_stats`)
    from .wrapper import last_stats

    return last_stats(model)


# ---- Prometheus text format -------------------------------------------------------------------------------
_CONFIG_KEYS = ("method", "budget", "text_budget", "eviction_scope", "retrieval", "read_budget", "read_scope",
                "read_bytes_budget")  # fmt: skip
_BYTES_PARTS = ("summaries", "selected", "always_read", "read", "dense")


def to_prometheus(stats: dict[str, Any], labels: dict[str, str] | None = None, prefix: str = "mm_oval") -> str:
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
    put("plain_cache_bytes", "what a plain DynamicCache holds for the same request", stats.get("plain_cache_bytes"))
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
        put("retrieval_pages_selected", "pages the retrieval selected, all steps and layers", mon.get("pages_selected"))
        doc = "time of the retrieval's page selection: one layer's call, or a decode step's (all layers)"
        for per, key in (("layer", "select_ms"), ("step", "step_select_ms")):
            for quantile, p in (("0.5", "p50"), ("0.99", "p99")):
                v = mon.get(f"{key}_{p}")
                put("retrieval_select_seconds", doc, None if v is None else v / 1e3, per=per, quantile=quantile)
    return generate_latest(registry).decode("utf-8")
