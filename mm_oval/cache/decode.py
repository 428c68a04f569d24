"""A decode step of one layer: which pages each KV head reads (`read_pages`: the retrieval policy's choice
within the read budget, plus the pages always read) and exact attention over them, by one of three
backends with one interface, chosen once per request (`choose_backend`):
- `KernelDecode`: mm_oval.kernels.sparse_paged_decode over the pages read (one new token; CUDA by default);
- `GatheredDecode`: SDPA over the pages read copied together, when they are a small share of the cache;
- `MaskedDecode`: SDPA over every slot with a per-head mask (what the others fall back to)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .. import kernels
from ..allocation import layer_fractions, read_layer_weights
from ..core import IMAGE, BytesBudget, DecodeContext, SharedHeads
from .summaries import page_mean, page_means_bytes
from .telemetry import kv_bytes_per_token, page_kv_bytes

# off the kernel path, a decode step attends over the pages it reads gathered (GatheredDecode) rather than
# over every slot with a mask when the gathered width (the most pages a KV head reads times the longest
# page read) is at most this share of the slots
GATHER_SHARE = 0.5
# the gathered keys and values of the KV heads one SDPA call takes at a time (a share of a core's cache)
GATHER_CHUNK_BYTES = 1 << 20


# ---- which pages a step reads ----------------------------------------------------------------------------
@dataclass(frozen=True)
class ReadRule:
    """How a request's layers read the cache after its prefill, from the configuration, built once per cache
    (`ReadRule.of`): which forwards read every page, and each layer's read budget otherwise.
    - `dense_chunks`: a forward of several tokens (a later turn, the question after a compressed context)
      reads every page (`read_chunks="dense"`, Quest's rule);
    - `dense_layers`: layers below it read every page at every step;
    - `fractions`: each layer's read budget, a fraction of its candidate pages or, with `of_bytes`, of dense
      attention's bytes (`read_budget` / `read_bytes_budget`, divided over the layers by
      `read_layer_budget`);
    - `shared_heads`: a layer's KV heads read within the sum of their budgets (`read_head_budget`);
    - `unread`: what a one-token step does with the candidate pages it does not read (`unread_pages`):
      "skip"; "centroid": each page's keys' and values' means are read too, each unread page entering the
      attention as one token of them; "scored": the values' means are read, each unread page entering with
      the logit the retrieval scorer estimates for its mass (`add_unread_pages`)."""

    dense_chunks: bool
    dense_layers: int
    fractions: tuple[float, ...]
    of_bytes: bool
    shared_heads: bool
    unread: str = "skip"

    @classmethod
    def of(cls, config: Any, num_layers: int) -> ReadRule:
        of_bytes = config.read_bytes_budget is not None
        fraction = config.read_bytes_budget if of_bytes else config.read_budget
        weights = read_layer_weights(config.read_layer_budget, num_layers)
        fractions = (fraction,) * num_layers if weights is None else layer_fractions(weights, fraction)
        return cls(config.read_chunks == "dense", config.dense_layers, fractions, of_bytes,
                   config.read_head_budget == "shared", config.unread_pages)  # fmt: skip

    def reads_all(self, layer_idx: int, several: bool) -> bool:
        """Whether this forward of layer `layer_idx` reads every page (`several`: it feeds several tokens)."""
        return (several and self.dense_chunks) or layer_idx < self.dense_layers


def read_pages(layer: Any, query: torch.Tensor, scaling: float) -> torch.Tensor | None:
    """(B, Hkv, P) bool: the pages each KV head of `layer` reads at this step; None when it reads them all
    (no retrieval, or the cache's `ReadRule` says so). Counts the step's bytes read (and, with
    `monitor_retrieval`, records the choice)."""
    owner, store, tel = layer.owner, layer.store, layer.telemetry
    several = query.shape[2] > 1  # a later turn fed at once
    rule: ReadRule | None = owner.read_rule
    if rule is None or not layer.summaries or rule.reads_all(layer.layer_idx, several):
        tel.count_read(store, None, None, tel.read_t.new_zeros(2), several=several)
        dense_chunk = rule is not None and several and rule.dense_chunks
        owner.counters["dense_chunk_reads"] += int(dense_chunk and layer.layer_idx >= rule.dense_layers)
        return None
    ctx = decode_context(layer, query, scaling)
    cand, P_s = ctx.candidates, ctx.candidates.shape[-1]
    summary = owner.retrieval.summary_bytes(layer.summaries, ctx.page_len)
    if rule.unread != "skip":  # the means a page keeps beside its record (`summaries.page_means_bytes`)
        summary = summary + page_means_bytes(layer)
    summary = torch.where(cand, summary, 0)  # scanned
    B, H, P = store.page_len.shape
    rest = torch.ones(B, H, P - P_s, dtype=torch.bool, device=cand.device)  # the open page
    always = torch.cat([~cand, rest], -1) & (store.page_len > 0)
    budget: float | BytesBudget | SharedHeads = rule.fractions[layer.layer_idx]
    if rule.of_bytes:
        budget = bytes_budget(layer, cand, always, summary.sum(-1), budget)
    if rule.shared_heads:
        budget = SharedHeads(budget)
    monitor = owner.monitor
    t0 = monitor.clock(query.device) if monitor is not None else 0.0
    chosen = owner.retrieval.select(ctx, budget) & cand
    seconds = monitor.clock(query.device) - t0 if monitor is not None else 0.0
    owner.counters["candidate_pages"] += cand.sum()
    owner.counters["pages_read"] += chosen.sum()
    image = ctx.page_kind == IMAGE
    scanned = torch.stack([(summary * image).sum(), (summary * ~image).sum()])
    picked = chosen
    chosen = torch.cat([chosen, torch.zeros_like(rest)], -1)
    tel.count_read(store, always, chosen, scanned, several=several)
    if monitor is not None:  # against exact attention of the newest token
        monitor.record(layer.layer_idx, owner.timings["decode_steps"], seconds, query[:, :, -1], store.keys,
                       store.slot_valid, store.slot_page, scaling, cand, picked, chosen | always)  # fmt: skip
    return chosen | always


def add_unread_pages(
    layer: Any,
    query: torch.Tensor,
    pages: torch.Tensor,
    scaling: float,
    out: torch.Tensor,
    lse_read: torch.Tensor,
) -> torch.Tensor:
    """`unread_pages` "centroid" or "scored", at a step feeding one token (a forward of several read by
    retrieval attends over its pages only): the step's output `out` (B, 1, Hq, D), exact attention over the
    pages read (`pages` (B, Hkv, P) bool; `lse_read` (B, Hkv, G) the log-sum-exp of its logits, from the
    decode backend's `attend_lse`), with each candidate page not read added as one token with its
    values' mean as the value (stored as int8, `summaries.page_mean`) and as its logit
    - "centroid": its keys' mean k_p as the key (int8 too: the retrieval record's own centroid where it holds
      one, OVAL's and LOCKS's), plus log n_p (n_p its tokens: the page's mass if its keys were all k_p; by
      Jensen, never above the page's true log-mass);
    - "scored": the retrieval scorer's estimate of the page's log-mass (`page_log_mass`: OVAL / LOCKS score
      each token of the page from its low-rank record), which reads no key mean.
    The two parts are combined by their log-sum-exps. A page whose keys and values are all equal enters
    exactly (up to the int8 rounding of its means); elsewhere it is an estimate."""
    store = layer.store
    v_mean = page_mean(layer, "v")
    B, Hq, _, D = query.shape
    H, P_s = v_mean.shape[1], v_mean.shape[2]
    G = Hq // H
    # closed pages with tokens that were not read: the candidates left out (every other page is always read)
    unread = (store.page_len[..., :P_s] > 0) & ~pages[..., :P_s]
    q = query[:, :, -1].float().reshape(B, H, G, D)  # a KV head's query heads together
    if layer.owner.read_rule.unread == "scored":
        page_logits = layer.owner.retrieval.page_log_mass(decode_context(layer, query, scaling)).float()
    else:
        n = store.page_len[..., :P_s].float().clamp(min=1).log()
        k_mean = page_mean(layer, "k")[:, :, :P_s].float()
        page_logits = torch.einsum("bhgd,bhpd->bhgp", q, k_mean) * scaling + n.unsqueeze(2)
    page_logits = page_logits.masked_fill(~unread.unsqueeze(2), float("-inf"))
    lse_unread = page_logits.logsumexp(-1)  # -inf where every candidate was read
    weights = torch.softmax(page_logits, -1).nan_to_num(0.0)
    o_unread = torch.einsum("bhgp,bhpd->bhgd", weights, v_mean).reshape(B, 1, Hq, D)
    share = torch.sigmoid(lse_unread - lse_read).nan_to_num(0.0).reshape(B, 1, Hq, 1)
    return (out.float() * (1 - share) + o_unread * share).to(out.dtype)


def decode_context(layer: Any, query: torch.Tensor, scaling: float) -> DecodeContext:
    """What the retrieval policy sees at this step: the closed pages (those with a summary) and which of
    them are candidates (non-empty, not pinned; image pages only with read_scope "image")."""
    owner, store = layer.owner, layer.store
    P_s = next(iter(layer.summaries.values())).shape[2]  # pages with a summary (closed pages)
    kind = store.page_kind[..., :P_s]
    plen = store.page_len[..., :P_s]
    cand = (plen > 0) & ~store.page_pinned[..., :P_s]
    if owner.config.read_scope == "image":
        cand &= kind == IMAGE
    return DecodeContext(
        layer_idx=layer.layer_idx,
        query=query,
        summaries=layer.summaries,
        page_start=store.page_start[..., :P_s],
        page_len=plen,
        page_kind=kind,
        candidates=cand,
        scaling=scaling,
        module=layer.module,
        step=owner.step,
        request=owner.request,
    )


def bytes_budget(
    layer: Any, cand: torch.Tensor, always: torch.Tensor, summary: torch.Tensor, fraction: float
) -> BytesBudget:
    """Per KV head, the bytes left for the pages the policy selects: `fraction` of the dense bytes
    (every resident slot) less the summaries scanned (`summary`, (B, Hkv)) and the always-read pages'
    KV (`always`, (B, Hkv, P) bool), with each candidate page's KV bytes. A head whose summaries and
    always-read pages alone exceed the budget reads no optional page (counted in
    `counters["read_over_budget"]`)."""
    store = layer.store
    per_token = kv_bytes_per_token(store.keys)
    P_s = cand.shape[-1]
    page_bytes = page_kv_bytes(store.page_len, store.keys)
    dense = layer.telemetry.head_resident * per_token
    left = fraction * dense - summary - (page_bytes * always).sum(-1)
    layer.owner.counters["read_over_budget"] += (left < 0).sum()
    return BytesBudget(page_bytes[..., :P_s], left)


def slot_mask(store: Any, pages: torch.Tensor | None, q: int) -> torch.Tensor | None:
    """(B, Hkv, q, L) bool: the slots of the pages read (`read_pages`' answer) for the q newest tokens
    (None: all of them, one new token)."""
    B, H, L = store.slot_valid.shape
    if pages is None and q == 1 and store.all_valid:
        return None
    slots = store.slot_valid
    if pages is not None:
        slots = slots & pages.gather(-1, store.slot_page.clamp(min=0))
    if q == 1:
        return slots.unsqueeze(2)
    mask = slots.unsqueeze(2).expand(B, H, q, L).clone()
    # the q newest slots: causal among themselves
    mask[..., L - q :] &= torch.ones(q, q, dtype=torch.bool, device=slots.device).tril()
    return mask


# ---- attention over the pages read ------------------------------------------------------------------------
class MaskedDecode:
    """SDPA of every query row over every slot with a per-head mask of the slots read: any step."""

    name = "masked"

    def attend(
        self, layer: Any, query: torch.Tensor, pages: torch.Tensor | None, scaling: float
    ) -> torch.Tensor:
        """Exact attention of `query` (B, Hq, Q, D) over the slots of `pages` (B, Hkv, P) bool (None: every
        page) -> (B, Q, Hq, D)."""
        store = layer.store
        B, Hq, q, D = query.shape
        H = store.keys.shape[1]
        G = Hq // H
        qg = query.reshape(B, H, G * q, D)  # GQA without repeating keys: a KV head's G query heads as rows
        mask = slot_mask(store, pages, q)  # (B, H, q, L) or None
        mg = (
            None
            if mask is None
            else mask.unsqueeze(2).expand(B, H, G, q, mask.shape[-1]).reshape(B, H, G * q, -1)
        )
        out = F.scaled_dot_product_attention(qg, store.keys, store.values, attn_mask=mg, scale=scaling)
        return out.reshape(B, Hq, q, D).transpose(1, 2).contiguous()

    def attend_lse(
        self, layer: Any, query: torch.Tensor, pages: torch.Tensor, scaling: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One new token (`query` (B, Hq, 1, D)): `attend`'s output and the log-sum-exp of its logits over
        the slots read, (B, Hkv, G) fp32 (-inf where none is read), what `add_unread_pages` merges with."""
        store = layer.store
        B, Hq, _, D = query.shape
        H = store.keys.shape[1]
        qg = query.reshape(B, H, Hq // H, D).float()
        slots = slot_mask(store, pages, 1)  # (B, H, 1, L)
        logits = torch.matmul(qg, store.keys.float().transpose(-1, -2)) * scaling
        out, lse = _softmax_with_lse(logits.masked_fill(~slots, float("-inf")), store.values)
        return out.reshape(B, 1, Hq, D).to(query.dtype), lse


class KernelDecode(MaskedDecode):
    """One new token: mm_oval.kernels.sparse_paged_decode over the pages read; more (a later turn fed at
    once): the masked SDPA."""

    name = "kernel"

    def attend(
        self, layer: Any, query: torch.Tensor, pages: torch.Tensor | None, scaling: float
    ) -> torch.Tensor:
        if query.shape[2] != 1:
            return super().attend(layer, query, pages, scaling)
        return self.attend_lse(layer, query, pages, scaling)[0]

    def attend_lse(
        self, layer: Any, query: torch.Tensor, pages: torch.Tensor | None, scaling: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        store = layer.store
        read = (store.page_len > 0) if pages is None else pages
        B, H, P = read.shape
        page_idx = torch.where(read, torch.arange(P, device=read.device), -1)
        out, lse = kernels.sparse_paged_decode(
            query[:, :, 0],
            store.keys,
            store.values,
            store.page_start,
            store.page_len,
            page_idx,
            scale=scaling,
            max_page_len=layer.owner.config.max_page_len,
        )
        return out.unsqueeze(1), lse.view(B, H, -1)


class GatheredDecode(MaskedDecode):
    """One new token reading a small share of the cache (the most pages a KV head reads times the longest
    page read at most GATHER_SHARE of the slots): SDPA over the pages read only, gathered (`gathered`);
    any other step: the masked SDPA."""

    name = "gathered"

    def attend(
        self, layer: Any, query: torch.Tensor, pages: torch.Tensor | None, scaling: float
    ) -> torch.Tensor:
        if query.shape[2] == 1 and pages is not None:
            got = self._gathered_step(layer, query, pages, scaling, with_lse=False)
            if got is not None:
                return got[0]
        return super().attend(layer, query, pages, scaling)

    def attend_lse(
        self, layer: Any, query: torch.Tensor, pages: torch.Tensor, scaling: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        got = self._gathered_step(layer, query, pages, scaling, with_lse=True)
        return got if got is not None else super().attend_lse(layer, query, pages, scaling)

    def _gathered_step(
        self, layer: Any, query: torch.Tensor, pages: torch.Tensor, scaling: float, with_lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The gathered attention of one new token (output (B, 1, Hq, D) and, `with_lse`, its log-sum-exp
        (B, Hkv, G)), or None when the pages read are too large a share of the cache to gather."""
        B, Hq, q, D = query.shape
        store = layer.store
        # the most pages a KV head reads and the longest page read: the gathered width is their product
        n_pages, longest = torch.stack([pages.sum(-1).max(), (store.page_len * pages).max()]).tolist()
        if not 0 < n_pages * longest <= GATHER_SHARE * store.keys.shape[2]:
            return None
        qg = query.reshape(B, store.keys.shape[1], -1, D)
        out, lse = self.gathered(layer, qg, pages, n_pages, max(longest, 1), scaling, with_lse)
        return out.reshape(B, Hq, q, D).transpose(1, 2).contiguous(), lse

    def gathered(
        self,
        layer: Any,
        qg: torch.Tensor,
        pages: torch.Tensor,
        width: int,
        block: int,
        scaling: float,
        with_lse: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """SDPA of `qg` (B, H, G, D) over the pages `pages` (B, H, P) bool only: each KV head's read pages,
        in page order, copied as blocks of `block` slots (the longest page read) into (B, H, width * block,
        D) in the storage dtype, `width` the most pages a head reads; the rows past a page's slots, a
        head's padding blocks and empty slots are masked. The same attention as the masked SDPA over every
        slot (a page's slots are the run page_start .. page_start + page_len of its head's storage); a
        decode step that reads a small share of the cache moves only that share, one copy per page, and
        builds nothing the size of the cache. The KV heads go a few at a time (their gathered keys and
        values about GATHER_CHUNK_BYTES), each group's SDPA reading its blocks while the copy left them in
        the CPU's cache, through a buffer the cache's layers share (`PagedMultimodalCache.scratch`).
        Returns the output and, `with_lse`, the log-sum-exp of each row's logits over the slots read
        ((B, H, G) fp32; the attention is then computed in fp32 by hand, as SDPA does not return it)."""
        store = layer.store
        D, dev, heads = store.k.shape[3], pages.device, qg.shape[0] * qg.shape[1]
        row0, valid = _block_rows(store, pages, width, block)
        # blocks copied as 8-byte words where a slot's row divides evenly (fewer, wider items copy faster);
        # the blocks are overlapping windows of the storage, one per slot, of which index_select takes some
        word = torch.int64 if (D * store.k.element_size()) % 8 == 0 else store.k.dtype
        n_rows = store.k.shape[0] * store.k.shape[1] * store.k.shape[2]
        windows = []
        for kv in (store.k, store.v):
            flat = kv.view(n_rows, D).view(word)
            w = flat.shape[1]
            windows.append(flat.as_strided((n_rows - block + 1, block * w), (w, 1)))
        per_head = 2 * width * block * D * store.k.element_size()
        c = max(1, min(heads, GATHER_CHUNK_BYTES // per_head))
        buf = layer.owner.scratch(2 * c * width * block * D, store.k.dtype, dev).view(2, c, width * block, D)
        qf = qg.reshape(heads, 1, qg.shape[2], D)
        out = qf.new_empty(qf.shape)
        lse = qf.new_empty(qf.shape[:3], dtype=torch.float32) if with_lse else None
        rows = row0.view(heads, width)
        for a in range(0, heads, c):  # a few KV heads at a time: SDPA reads the blocks while still in cache
            b = min(heads, a + c)
            idx = rows[a:b].reshape(-1)
            k, v = buf[0, : b - a], buf[1, : b - a]
            torch.index_select(windows[0], 0, idx, out=k.view(word).view(idx.numel(), -1))
            torch.index_select(windows[1], 0, idx, out=v.view(word).view(idx.numel(), -1))
            if lse is None:
                out[a:b] = F.scaled_dot_product_attention(
                    qf[a:b], k.unsqueeze(1), v.unsqueeze(1), attn_mask=valid[a:b], scale=scaling
                )
                continue
            logits = torch.matmul(qf[a:b].float(), k.unsqueeze(1).float().transpose(-1, -2)) * scaling
            o, lse[a:b] = _softmax_with_lse(logits.masked_fill(~valid[a:b], float("-inf")), v.unsqueeze(1))
            out[a:b] = o.to(out.dtype)
        return out.view(qg.shape), None if lse is None else lse.view(qg.shape[:3])


def _softmax_with_lse(logits: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention from masked fp32 logits (..., G, L) over `values` (..., L, D): (output fp32 (..., G, D),
    log-sum-exp (..., G)); a row with no slot gives zeros and -inf."""
    lse = logits.logsumexp(-1)
    p = torch.exp(logits - lse.unsqueeze(-1).clamp_min(torch.finfo(torch.float32).min))
    return torch.matmul(p, values.float()), lse


def _block_rows(store: Any, pages: torch.Tensor, width: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For `GatheredDecode.gathered`: the first row of each gathered block in the flat storage (B * H * cap
    rows; (B * H * width,) long) and which rows of the blocks are read ((B * H, 1, 1, width * block) bool).
    A block that would run past the storage's end starts earlier, its page's slots `shift` rows into it."""
    B, H, P = pages.shape
    cap, dev = store.k.shape[2], pages.device
    # each head's read pages in page order, as columns 0 .. width-1; the other pages go to column width
    col = torch.where(pages, pages.cumsum(-1) - 1, width)
    start = torch.zeros(B, H, width + 1, dtype=torch.long, device=dev)
    length = torch.zeros_like(start)
    start.scatter_(-1, col, store.page_start)
    length.scatter_(-1, col, store.page_len * pages)  # padding columns: no slot
    n_rows = B * H * cap
    head = torch.arange(B * H, device=dev).view(B, H, 1) * cap
    first = (head + start[..., :width]).reshape(-1)
    row0 = first.clamp(max=n_rows - block)
    shift = (first - row0).view(-1, 1)
    length = length[..., :width].reshape(-1, 1)
    t = torch.arange(block, device=dev)
    valid_windows = store.valid.view(n_rows).as_strided((n_rows - block + 1, block), (1, 1))
    valid = torch.index_select(valid_windows, 0, row0) & (t >= shift) & (t < shift + length)
    return row0, valid.view(B * H, 1, 1, width * block)


def choose_backend(cache: Any, query: torch.Tensor) -> MaskedDecode:
    """The request's decode backend: the kernel on its path (`cache.use_kernels`), else the gathered SDPA
    when a retrieval policy picks pages (without one every step reads every slot: the masked SDPA)."""
    if cache.use_kernels(query):
        return KernelDecode()
    return GatheredDecode() if cache.retrieval is not None else MaskedDecode()
