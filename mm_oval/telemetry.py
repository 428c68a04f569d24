"""What the cache measures about itself, below the wrapper: kept and allocated bytes (`cache_stats`,
`allocated_bytes`, `plain_cache_bytes`), bytes the decode steps read (`bytes_read`) and the retrieval
monitor (`RetrievalMonitor`). The wrapper and the cache import this module; the public face of these figures
is `mm_oval.stats` (`get_stats`, `to_prometheus`), which is documented there."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from .core import iter_tensors, topk_mask
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
        c.add("summaries", [getattr(layer, n, None) for n in ("summaries", "page_means", "value_query")])
    for layer in layers:
        skip = ("owner", "module", "summaries", "page_means", "value_query", *_KV_ATTRS)
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


def kept_positions(cache: Any, n: int) -> list[torch.Tensor]:
    """Per layer, (KV heads, n) bool: which of the first n prompt positions of sample 0 each KV head of the
    compressed cache holds (its prompt slots' original positions; -1 marks an empty slot)."""
    out = []
    for layer in cache.layers:
        pos = layer.slot_pos[0, :, : layer.prompt_slots]
        mask = torch.zeros(pos.shape[0], n + 1, dtype=torch.bool, device=pos.device)
        mask.scatter_(1, torch.where(pos >= 0, pos, n).clamp(max=n), True)
        out.append(mask[:, :n].cpu())
    return out


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
    out["read_head_budget"] = cache.config.read_head_budget
    out["read_chunks"] = cache.config.read_chunks
    out["dense_layers"] = cache.config.dense_layers
    out["read_layer_budget"] = cache.config.read_layer_budget
    out["unread_pages"] = cache.config.unread_pages
    out["dense_chunk_reads"] = int(cache.counters["dense_chunk_reads"])
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
    chunk_rows = [c.chunk_t for c in counts if c is not None and c.chunk_t is not None]
    c = torch.stack(chunk_rows).sum(0).tolist() if chunk_rows else [[0, 0] for _ in kinds]
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

    chunks = block([row[0] for row in c], [row[1] for row in c])
    one = {k: total[k] - chunks[k] for k in (*kinds, "read")}
    ratio = lambda d: (d["read"] / d["dense"]) if d["dense"] else None  # noqa: E731
    return {
        "decode_steps": steps,
        "total": total,
        "chunks": {k: chunks[k] for k in ("read", "dense")},
        "one_token_read_vs_dense": ratio(one),
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
        rows = torch.stack(list(self.tally.values()))  # (layers, 4)
        hits, selected, recall, n = rows.sum(0).tolist()
        cand = sum(int(t.sum()) for t in self.ever_candidate.values())
        used = sum(int((r & c).sum()) for r, c in zip(self.ever_read.values(), self.ever_candidate.values()))
        per_call = [s for _, s in self.select_s]
        per_step: dict[int, float] = {}
        for step, sec in self.select_s:
            per_step[step] = per_step.get(step, 0.0) + sec
        q = lambda xs, p: 1e3 * float(torch.tensor(xs, dtype=torch.float64).quantile(p))  # noqa: E731
        co_sum, co_n = torch.stack(list(self.co_tally.values())).sum(0).tolist()
        per_layer = {li: t[2] / t[3] for li, t in zip(self.tally, rows.tolist())}
        return {
            "layer_steps": len(per_call),
            "pages_selected": int(selected),
            "hit_rate": hits / selected if selected else None,
            "attention_mass_recall": recall / n if n else None,
            # per layer (None for a layer never measured: read densely, or without candidates)
            "layer_attention_mass_recall": [per_layer.get(li) for li in range(max(per_layer) + 1)],
            "page_utilisation": used / cand if cand else None,
            "co_read_density": co_sum / co_n if co_n else None,
            "select_ms_p50": q(per_call, 0.5),
            "select_ms_p99": q(per_call, 0.99),
            "step_select_ms_p50": q(list(per_step.values()), 0.5),
            "step_select_ms_p99": q(list(per_step.values()), 0.99),
        }
