"""Page retrieval quality and cost: how much of full attention's image mass each retrieval method's pages
hold, at read budgets of 10/25/50% of the image pages, and what scoring costs next to a decode step.

    python benchmarks/bench_retrieval.py                      # the bundled tiny LLaVA and its router
    python benchmarks/bench_retrieval.py --model DIR --router DIR --prompts 64 --out bench_retrieval.json

Quality. Prompts come from the bundled generator with a seed no training used. The plain model answers
greedily; one teacher-forced forward over prompt + answer captures every layer's queries, keys and values
(`mm_oval.measures.capture_qk`); a page's exact mass is `mm_oval.measures.page_mass`.
Routed queries are the last prompt positions and every answer position. Pages are the cache's own layout
(nothing evicted): 2x2 patch tiles for the image, 16-token text pages. Each method summarises the pages
through its real policy class (`summarize`, `score_pages`); candidates are the image pages not pinned by
sinks / the recent window (what a read budget applies to). Reported per method and budget, averaged over
routed queries, layers and query heads that put more than 1e-4 of their attention on the candidate pages
(a head that does not look at the image has no share to capture; it is left out for every method):
  image_mass  share of the exact attention mass on candidate pages that the selected pages hold;
  top16_mass  share of the mass of the 16 highest-attention candidate tokens that the selected pages hold
              (tokens tied with the 16th count too: a head with an even spread has no "top 16");
  focused_mass  image_mass over the focused (row, head) pairs only: those whose 16 highest-attention
              candidate tokens hold at least half of their image mass (where the choice of pages matters).
`oracle` picks, per KV head, the pages with the largest exact share averaged over the group's query
heads (the best any method can do on image_mass), `random` is the expected share.

Bytes. What a decode step at that row would read, per KV head, as the cache counts it (mm_oval.cache:
`page_kv_bytes`, each policy's `summary_bytes`): the candidate pages' summaries (none for oracle and
random), the selected pages' keys and values, and the rest of the tokens up to the row (always read),
over dense attention's (every token up to the row); `read_vs_dense` per method and page budget. At equal
bytes (`quality_at_bytes`, `read_vs_dense_at_bytes`) the budget is that share of dense bytes, turned into
a page count per KV head (`pages_within_bytes`: the pages here are fixed tiles of one size, for which
that count is what the cache's own rule, `fill_by_score`, reads): where the summaries and the always-read
tokens exceed it, no optional page is read.

Router v2 (`router2`) rows: `--router2 NAME=DIR ...`, or the bundled one when it was trained for the model
(`--model bundled576`). Predict-ahead: for every method that scores pages from the query, the share of the
pages it picks from the exact query that its pick from the previous position's query holds
(`mm_oval.policies.router2.predict_ahead_hit_rate`), per KV head, at each page budget; layer-ahead: the same
from the layer before's query at the same position (`predict_ahead="layer"`). `--width-cost` times
router v2's correction against one decode layer at LLaVA-1.5-7B's shape and reports its largest tensor
against one layer's full KV.

Cost. The model is wrapped with each retrieval method at read budget 25% and generates; the time spent
in the policy's `score_pages` + `select` is measured inside the same decode steps as the step time, so
the share printed is a ratio from one run.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import time
from typing import Any

import torch

import mm_oval
from mm_oval.cache import kv_bytes_per_token, page_kv_bytes, pages_within_bytes, request_info
from mm_oval.config import OvalConfig
from mm_oval.files import atomic_write_json
from mm_oval.measures import capture_qk, group_mean, page_mass
from mm_oval.pages import layout_pages
from mm_oval.policies.base import (
    IMAGE,
    PAD,
    DecodeContext,
    PageBatch,
    RequestState,
    StepState,
    make_retrieval,
)
from mm_oval.policies.router2 import predict_ahead_hit_rate
from mm_oval.stats import get_stats
from mm_oval.training.router import hidden_and_embeds_hooks, hooked, zoo_prompts
from mm_oval.wrapper import wrap_info

BUDGETS = (0.10, 0.25, 0.50)
BYTES_BUDGETS = (0.05, 0.10, 0.25, 0.50)  # fractions of dense attention's bytes per decode step
MIN_IMAGE_MASS = 1e-4  # a query head with less attention than this on the candidate image pages is left out


def load(model_dir: str | None):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    if model_dir == "bundled576":
        from mm_oval.zoo import bundled576_model_path

        model_dir = str(bundled576_model_path())
    if model_dir is None:
        try:
            from mm_oval.zoo import bundled_model_path

            model_dir = str(bundled_model_path())
        except mm_oval.MmOvalError:
            from mm_oval.zoo.model import build_tiny_llava

            model, processor = build_tiny_llava(seed=0)
            return model, processor, "tiny random LLaVA (bundled model absent)"
    model = LlavaForConditionalGeneration.from_pretrained(model_dir).eval()
    return model, AutoProcessor.from_pretrained(model_dir), model_dir


def methods_for(
    router_dir: str | None,
    has_router: bool,
    ranks: list[int],
    router2: dict[str, str] | None = None,
    keep: list[str] | None = None,
) -> dict[str, tuple[str, dict]]:
    """The methods compared: quest, locks/oval at each rank, the router when it fits the model, each router v2
    in `router2` (row name -> weights); `keep`: only the rows named there."""
    m: dict[str, tuple[str, dict]] = {"quest": ("quest", {})}
    for r in ranks:
        m[f"locks r={r}"] = ("locks", {"rank": r})
        for eta in (0.25, 0.5, 1.0):
            m[f"oval r={r} eta={eta:g}"] = ("oval", {"rank": r, "eta": eta})
    if has_router:
        m["router"] = ("router", {"weights": router_dir} if router_dir else {})
    for name, weights in (router2 or {}).items():
        m[name] = ("router2", {"weights": weights})
    if keep:
        m = {k: v for k, v in m.items() if k in keep}
    return m


def router2_rows(specs: list[str] | None, model) -> dict[str, str]:
    """`--router2 NAME=DIR` (or DIR, named router2) rows; without any, the bundled router v2 when it was
    trained for this model."""
    from mm_oval.policies.router2 import bundled_router2_path, load_router2

    if specs is None:
        try:
            load_router2(bundled_router2_path(), model)
        except mm_oval.MmOvalError as e:
            print(f"router2 skipped: {e}")
            return {}
        return {"router2": "bundled576"}
    rows = {}
    for spec in specs:
        name, _, weights = spec.rpartition("=")
        rows[name or "router2"] = weights
    return rows


@torch.no_grad()
def quality(
    model, processor, prompts, methods, new_tokens: int, prompt_queries: int, top_tokens: int
) -> dict:
    cfg = model.config
    text = cfg.text_config
    hkv, hq = text.num_key_value_heads, text.num_attention_heads
    group = hq // hkv
    lm = model.model.language_model
    policies = {name: make_retrieval(kind, **opts) for name, (kind, opts) in methods.items()}
    sums: dict[tuple[str, float, str], float] = {}
    sums_at_bytes: dict[tuple[str, float, str], float] = {}
    # bytes read and dense bytes, summed over (row, layer, KV head), per (method, page or bytes budget)
    read: dict[tuple[str, float], float] = {}
    read_at_bytes: dict[tuple[str, float], float] = {}
    dense_sum = 0.0
    count = 0
    # predict-ahead hit rate [sum, count] per (how, method, budget); how: "step" (the previous position's
    # query of the layer) or "layer" (the layer before's query at the same position)
    ahead: dict[tuple[str, str, float], list[float]] = {}
    # (row, query head) pairs each metric averages over: the denominators
    heads = {"image_mass": 0, "top16_mass": 0, "focused_mass": 0}
    box: dict[str, Any] = {}
    hooks = hidden_and_embeds_hooks(lm, box)
    with hooked(model, hooks):
        for prompt in prompts:
            msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt.text}]}]
            chat = processor.apply_chat_template(msgs, add_generation_prompt=True)
            inputs = processor(images=[prompt.image], text=[chat], return_tensors="pt")
            n = inputs["input_ids"].shape[1]
            model.set_attn_implementation("sdpa")
            seq = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
            with capture_qk(lm) as cap:
                model(input_ids=seq, pixel_values=inputs["pixel_values"], attention_mask=torch.ones_like(seq))
            ids = seq
            total = ids.shape[1]
            tpi = int((inputs["input_ids"] == cfg.image_token_id).sum())
            info = request_info(ids[:, :n], None, cfg.image_token_id, tpi, 4, 16)
            keep = (info.modality != PAD).unsqueeze(1).expand(1, hkv, n)
            lay = layout_pages(keep, info.modality, info.positions, info.image_rc, info.protected, 2, 16)
            p = int((lay.page_len[0, 0] > 0).sum())
            page_len = lay.page_len[..., :p]
            kind = lay.page_kind[..., :p]
            cand = (kind == IMAGE) & ~lay.page_pinned[..., :p]
            n_cand = int(cand[0, 0].sum())
            t = int(page_len.max())
            offs = torch.arange(t)
            slot = (lay.page_start[..., :p, None] + offs).clamp(max=lay.src.shape[-1] - 1)
            tok_idx = torch.where(
                offs < page_len[..., None], lay.src.gather(-1, slot.flatten(2)).view(1, hkv, p, t), -1
            )
            tok_page = torch.full((n,), -1, dtype=torch.long)
            ok = lay.src[0, 0] >= 0
            tok_page[lay.src[0, 0][ok]] = lay.slot_page[0, 0][ok]
            cand_tok = torch.zeros(n, dtype=torch.bool)
            cand_tok[tok_page >= 0] = cand[0, 0][tok_page[tok_page >= 0]]
            last_img = int((info.modality[0] == IMAGE).nonzero().max())
            rows = list(range(max(n - prompt_queries, last_img + 2), total))
            prev_q = None  # the layer before's queries (layer-ahead prediction)
            for layer, qk in sorted(cap.layers.items()):
                q, k, v, scale = qk.query, qk.key, qk.value, qk.scaling
                mask = tok_idx >= 0
                gk = k[:, :, :n].gather(
                    2, tok_idx.clamp(min=0).flatten(2).unsqueeze(-1).expand(-1, -1, -1, k.shape[-1])
                )
                gv = v[:, :, :n].gather(
                    2, tok_idx.clamp(min=0).flatten(2).unsqueeze(-1).expand(-1, -1, -1, v.shape[-1])
                )
                gk = gk.view(1, hkv, p, t, -1) * mask.unsqueeze(-1)
                gv = gv.view(1, hkv, p, t, -1) * mask.unsqueeze(-1)
                module = lm.layers[layer].self_attn
                batch = PageBatch(
                    layer,
                    gk,
                    gv,
                    mask,
                    kind,
                    0,
                    module,
                    token_index=tok_idx,
                    request=RequestState(inputs_embeds=box["embeds"]),
                )
                summaries = {name: pol.summarize(batch) for name, pol in policies.items()}
                # what a decode step reads, as the cache counts it (mm_oval.cache, stats' bytes_read): the
                # candidates' summaries, the selected pages' KV, the rest always; oracle and random scan none
                per_token = kv_bytes_per_token(k)
                page_kv = page_kv_bytes(page_len, k)[0].double()  # (Hkv, P)
                cand_kv = (page_kv * cand[0]).sum(-1)  # (Hkv,)
                scanned = {
                    name: (pol.summary_bytes(summaries[name], page_len)[0] * cand[0]).sum(-1).double()
                    for name, pol in policies.items()
                }
                scanned["oracle"] = scanned["random"] = torch.zeros(hkv, dtype=torch.double)
                kk = k.repeat_interleave(group, dim=1)[0]  # (Hq, total, D)
                for i in rows:
                    logits = (
                        torch.einsum("hd,htd->ht", q[0, :, i].float(), kk[:, : i + 1].float()) * scale
                    )  # (Hq, i+1)
                    att = torch.softmax(logits.float(), -1)[:, :n]  # mass on prompt tokens
                    att = torch.nn.functional.pad(att, (0, n - att.shape[-1]))
                    img_att = att * cand_tok  # (Hq, n)
                    mass_of_page = page_mass(img_att, tok_page, p)  # (Hq, P)
                    # a query head that puts (almost) no mass on the candidate pages has no share to
                    # capture: it is left out for every method and for random alike
                    mass = img_att.sum(-1)  # (Hq,)
                    looks = mass > MIN_IMAGE_MASS
                    tot = mass.clamp_min(1e-12)
                    topv = img_att.topk(min(top_tokens, int(cand_tok.sum())), -1).values  # (Hq, k)
                    # the top tokens: at or above the k-th largest attention (ties included, so a head that
                    # spreads its mass evenly has every candidate token in its "top")
                    top_att = img_att * (img_att >= topv[:, -1:] * (1 - 1e-4))
                    # focused heads: the top tokens hold at least half of the head's image mass (an even
                    # spread over 60 candidates gives 16 tokens ~0.27): where the choice of pages matters
                    focused = looks & (topv.sum(-1) >= 0.5 * mass)
                    rows_of = {"image_mass": looks, "top16_mass": looks, "focused_mass": focused}
                    ctx = DecodeContext(
                        layer,
                        q[:, :, i : i + 1],
                        {},
                        lay.page_start[..., :p],
                        page_len,
                        kind,
                        cand,
                        scale,
                        module,
                        StepState(last_hidden=box["hidden"][:, i - 1]),
                    )
                    dense = float((i + 1) * per_token)  # every token up to this row, per KV head
                    always = dense - cand_kv
                    dense_sum += dense * hkv

                    # (Hkv,) per method and bytes budget: the most pages within that share of dense bytes
                    pages_at = {
                        (name, f): pages_within_bytes(page_kv, cand[0], f * dense - always - spent)
                        for name, spent in scanned.items()
                        for f in BYTES_BUDGETS
                    }

                    picks, picks_b = {}, {}
                    for name, pol in policies.items():
                        ctx.summaries = summaries[name]
                        picks[name] = {b: pol.select(ctx, b)[0] for b in BUDGETS}  # (Hkv, P) bool
                        # predict-ahead: this row's pages chosen from another query (the router routes from
                        # the hidden state alone)
                        guesses = {}
                        if i > rows[0] and name != "router":
                            guesses["step"] = q[:, :, i - 1 : i]
                        if prev_q is not None and name != "router":
                            guesses["layer"] = prev_q[:, :, i : i + 1]
                        for how, guess in guesses.items():
                            for b in BUDGETS:
                                hit = predict_ahead_hit_rate(pol, ctx, guess, b)[0]  # (Hkv,)
                                tally = ahead.setdefault((how, name, b), [0.0, 0])
                                tally[0] += float(hit.sum())
                                tally[1] += hit.numel()
                        picks_b[name] = {
                            f: pol.select(ctx, pages_at[(name, f)][None])[0] for f in BYTES_BUDGETS
                        }
                    # the oracle: the pages with the largest group-mean share of each head's image mass
                    # (the metric below is that mean share, so these pages maximise it)
                    gm = group_mean(mass_of_page / tot.unsqueeze(-1), hkv)
                    ctx.summaries = {}
                    order = gm.masked_fill(~cand[0], -1.0).argsort(-1, descending=True).argsort(-1)
                    for b in BUDGETS:
                        kb = math.ceil(n_cand * b - 1e-9)
                        picks.setdefault("oracle", {})[b] = (order < kb) & cand[0]
                    for f in BYTES_BUDGETS:
                        picks_b.setdefault("oracle", {})[f] = (
                            order < pages_at[("oracle", f)][:, None]
                        ) & cand[0]
                    for target, bytes_read, chosen in (
                        (sums, read, picks),
                        (sums_at_bytes, read_at_bytes, picks_b),
                    ):
                        for name, per_b in chosen.items():
                            for b, sel in per_b.items():
                                sel_q = sel.repeat_interleave(group, 0)  # (Hq, P)
                                share = (mass_of_page * sel_q).sum(-1) / tot
                                read_tok = sel_q.gather(1, tok_page.clamp(min=0).expand(hq, n)) & (
                                    tok_page >= 0
                                )
                                top_share = (top_att * read_tok).sum(-1) / top_att.sum(-1).clamp_min(1e-12)
                                for metric, val in (
                                    ("image_mass", share),
                                    ("top16_mass", top_share),
                                    ("focused_mass", share),
                                ):
                                    key = (name, b, metric)
                                    target[key] = target.get(key, 0.0) + float(val[rows_of[metric]].sum())
                                step = scanned[name] + always + (page_kv * sel).sum(-1)
                                bytes_read[(name, b)] = bytes_read.get((name, b), 0.0) + float(step.sum())
                    for b in BUDGETS:
                        r = math.ceil(n_cand * b - 1e-9) / max(n_cand, 1)
                        for metric, m in rows_of.items():
                            sums[("random", b, metric)] = sums.get(("random", b, metric), 0.0) + r * int(
                                m.sum()
                            )
                        step = always + r * cand_kv  # expected
                        read[("random", b)] = read.get(("random", b), 0.0) + float(step.sum())
                    for f in BYTES_BUDGETS:
                        kf = pages_at[("random", f)]  # (Hkv,)
                        r_q = (kf.double() / max(n_cand, 1)).repeat_interleave(group)  # (Hq,)
                        for metric, m in rows_of.items():
                            key = ("random", f, metric)
                            sums_at_bytes[key] = sums_at_bytes.get(key, 0.0) + float(r_q[m].sum())
                        step = always + kf.double() / max(n_cand, 1) * cand_kv  # expected
                        read_at_bytes[("random", f)] = read_at_bytes.get(("random", f), 0.0) + float(
                            step.sum()
                        )
                    count += 1
                    for metric, m in rows_of.items():
                        heads[metric] += int(m.sum())
                prev_q = q
    q = {f"{name}|{b}|{metric}": v / max(heads[metric], 1) for (name, b, metric), v in sums.items()} | {
        "rows": count,
        "head_rows": heads["image_mass"],
        "focused_rows": heads["focused_mass"],
    }
    at_bytes = {
        f"{name}|{f}|{metric}": v / max(heads[metric], 1) for (name, f, metric), v in sums_at_bytes.items()
    }
    ratio = lambda d: {f"{name}|{b}": v / max(dense_sum, 1.0) for (name, b), v in d.items()}  # noqa: E731
    return q, {
        **{
            key: {f"{name}|{b}": v / max(n, 1) for (h, name, b), (v, n) in ahead.items() if h == how}
            for how, key in (("step", "predict_ahead_hit"), ("layer", "layer_ahead_hit"))
        },
        "quality_at_bytes": at_bytes,
        "read_vs_dense": ratio(read),
        "read_vs_dense_at_bytes": ratio(read_at_bytes),
    }


def cost(model, processor, prompts, methods, new_tokens: int, repeats: int) -> dict:
    """Decode ms/step with each retrieval at read budget 0.25, and the ms/step spent choosing pages."""
    inputs = []
    for prompt in prompts:
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt.text}]}]
        chat = processor.apply_chat_template(msgs, add_generation_prompt=True)
        inputs.append(processor(images=[prompt.image], text=[chat], return_tensors="pt"))
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in ["none", *methods]}
    for _ in range(repeats):
        for name in runs:  # interleaved, so machine load hits every method alike
            if name == "none":
                cfg = OvalConfig()
            else:
                kind, opts = methods[name]
                cfg = OvalConfig(retrieval=kind, retrieval_options=opts, read_budget=0.25)
            wrapped = mm_oval.wrap(model, cfg)
            spent = [0.0]
            pol = wrap_info(wrapped).retrieval
            if pol is not None:
                inner = pol.select

                def timed(ctx, rb, _inner=inner, spent=spent):
                    t0 = time.perf_counter()
                    out = _inner(ctx, rb)
                    spent[0] += time.perf_counter() - t0
                    return out

                pol.select = timed
            steps, decode = 0, 0.0
            try:
                for inp in inputs:
                    wrapped.generate(
                        **inp, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
                    )
                    st = get_stats(wrapped)
                    steps += st["decode_steps"]
                    decode += st["decode_s"]
            finally:
                model = mm_oval.unwrap(wrapped)
            runs[name].append((decode / max(steps, 1), spent[0] / max(steps, 1)))
    return {
        name: {
            "decode_ms_per_step": 1e3 * statistics.median(r[0] for r in rs),
            "select_ms_per_step": 1e3 * statistics.median(r[1] for r in rs),
        }
        for name, rs in runs.items()
    }


def width_cost(batch: int = 4, images: int = 4, text_tokens: int = 100, repeats: int = 5) -> dict:
    """Router v2's own work per decode step and layer (the correction: cross-attention, routing vector, page
    logits, locality) at LLaVA-1.5-7B's layer shape (hidden 4096, 32 KV heads of 128, MLP 11008), `images`
    576-token images at batch `batch`, timed next to one LlamaDecoderLayer decoding one token over that KV;
    and the largest tensors router v2 makes, next to one layer's full KV (fp16)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from mm_oval.policies.router2 import Router2Config, Router2Net, pool_token_embeddings

    hidden, heads, head_dim, inter = 4096, 32, 128, 11008
    n = images * 576 + text_tokens
    pages = images * 144 + math.ceil(text_tokens / 16)
    cfg = LlamaConfig(
        hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=heads,
        num_hidden_layers=1, max_position_embeddings=n + 8,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(cfg, 0).eval()
    rope = LlamaRotaryEmbedding(cfg)
    net = Router2Net(Router2Config(hidden, 32, heads)).eval()
    x = torch.randn(batch, 1, hidden)
    k = torch.randn(batch, heads, n, head_dim)
    emb = torch.randn(batch, heads, pages, net.config.route_dim)
    kind = torch.full((batch, heads, pages), IMAGE, dtype=torch.int8)
    valid = torch.ones(batch, heads, pages, dtype=torch.bool)
    base = torch.randn(batch, heads, pages)
    pos = torch.full((batch, 1), n)

    class _Cache:  # the layer's past keys/values, as a Cache's update() hands them to attention
        def update(self, key, value, layer_idx, *a, **kw):
            return torch.cat([k, key], 2), torch.cat([k, value], 2)

    def run_layer():
        layer(x, position_embeddings=rope(x, pos), cache=_Cache(), position_ids=pos, attention_mask=None)

    def run_router():
        t = net.text_state(x[:, 0])
        net.correction(t, emb, kind, valid, base, 5)

    times = {}
    with torch.no_grad():
        for name, fn in (("decode_layer", run_layer), ("router2", run_router)):
            fn()
            t0 = time.perf_counter()
            for _ in range(repeats):
                fn()
            times[name] = (time.perf_counter() - t0) / repeats * 1e3
        # the largest tensor router v2's summarize makes: page embeddings pooled from per-token projections
        tok = net.token_embeddings(torch.randn(batch, n, hidden))
        idx = torch.arange(pages * 4).clamp(max=n - 1).view(1, 1, pages, 4).expand(batch, heads, pages, 4)
        pooled = pool_token_embeddings(tok, idx)
    gathered = batch * heads * pages * 4 * net.config.route_dim * 4  # the (B, Hkv, P, T, R) fp32 gather
    gathered = max(gathered, batch * 256 * hidden * 4)  # or a 256-token chunk of the normalised embeddings
    kv_layer = 2 * batch * heads * n * head_dim * 2
    out = {
        "decode_layer_ms": times["decode_layer"],
        "router2_ms": times["router2"],
        "router2_share": times["router2"] / times["decode_layer"],
        "largest_router2_tensor_bytes": gathered,
        "router2_record_bytes_fp16": pooled.numel() * 2,
        "layer_kv_bytes_fp16": kv_layer,
    }
    print(
        f"\nrouter v2 at LLaVA-1.5-7B's layer shape ({images} images x batch {batch}, {n} tokens, {pages} pages, "
        f"fp32 CPU): decode layer {out['decode_layer_ms']:.1f} ms, router v2 correction {out['router2_ms']:.2f} ms "
        f"({out['router2_share']:.2%}); largest router v2 tensor {gathered / 2**20:.1f} MiB, its page record "
        f"{out['router2_record_bytes_fp16'] / 2**20:.1f} MiB per layer, one layer's full KV {kv_layer / 2**20:.0f} MiB"
    )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument(
        "--router", default=None, help="router directory (default: the bundled router, when present)"
    )
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--prompt-queries", type=int, default=4)
    ap.add_argument("--top-tokens", type=int, default=16)
    ap.add_argument(
        "--ranks",
        type=int,
        nargs="+",
        default=[1, 2],
        help="basis ranks of LOCKS/OVAL (a rank >= the page's token count is exact: 2x2 tiles hold 4 tokens)",
    )
    ap.add_argument(
        "--router2",
        nargs="+",
        default=None,
        help="router v2 rows, NAME=DIR or DIR (default: the bundled router v2 when it fits the model)",
    )
    ap.add_argument(
        "--methods", nargs="+", default=None, help="only these rows (e.g. quest 'oval r=2 eta=0.5')"
    )
    ap.add_argument(
        "--width-cost",
        action="store_true",
        help="also time router v2 against a decode layer at LLaVA-1.5-7B's shape",
    )
    ap.add_argument("--cost-prompts", type=int, default=8)
    ap.add_argument("--cost-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--seed", type=int, default=5000, help="prompt generator seed (router training uses 1000/2000)"
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    model, processor, where = load(args.model)
    has_router = True
    try:
        from mm_oval.policies.router import bundled_router_path, load_router

        load_router(args.router or bundled_router_path(), model)  # refuses a router trained for another model
    except mm_oval.MmOvalError as e:
        print(f"router skipped: {e}")
        has_router = False
    methods = methods_for(
        args.router, has_router, args.ranks, router2_rows(args.router2, model), args.methods
    )
    geometry = 576 if getattr(model.config, "image_seq_length", 0) == 576 else 64
    prompts = zoo_prompts(args.prompts, args.seed, geometry)
    t0 = time.perf_counter()
    q, by_bytes = quality(
        model, processor, prompts, methods, args.new_tokens, args.prompt_queries, args.top_tokens
    )
    t_quality = time.perf_counter() - t0
    names = ["oracle", *methods, "random"]
    print(
        f"model: {where}; {len(prompts)} prompts, {q['rows']} routed (query, layer) rows, {q['head_rows']} (row, query head) pairs looking at the image, {q['focused_rows']} focused ({t_quality:.0f} s)"
    )
    for metric in ("image_mass", "top16_mass", "focused_mass"):
        print(
            f"\n{metric}: share held by the selected image pages (read budget = share of candidate image pages)"
        )
        print(
            f"{'method':<22}"
            + "".join(f"{int(b * 100):>8d}%" for b in BUDGETS)
            + "".join(f"{f'read@{int(b * 100)}%':>10}" for b in BUDGETS)
        )
        rvd = by_bytes["read_vs_dense"]
        for name in names:
            print(
                f"{name:<22}"
                + "".join(f"{q[f'{name}|{b}|{metric}']:>9.3f}" for b in BUDGETS)
                + "".join(f"{rvd[f'{name}|{b}']:>9.2f}x" for b in BUDGETS)
            )
    at, rvd_b = by_bytes["quality_at_bytes"], by_bytes["read_vs_dense_at_bytes"]
    for metric in ("image_mass", "top16_mass", "focused_mass"):
        print(
            f"\n{metric} at equal bytes: share held by the selected image pages (budget = bytes read per step as "
            "a share of dense attention's: summaries scanned + selected and always-read KV; read@ is what was "
            "read, above the budget where the always-read pages alone exceed it)"
        )
        print(
            f"{'method':<22}"
            + "".join(f"{int(f * 100):>8d}%" for f in BYTES_BUDGETS)
            + "".join(f"{f'read@{int(f * 100)}%':>10}" for f in BYTES_BUDGETS)
        )
        for name in names:
            print(
                f"{name:<22}"
                + "".join(f"{at[f'{name}|{f}|{metric}']:>9.3f}" for f in BYTES_BUDGETS)
                + "".join(f"{rvd_b[f'{name}|{f}']:>9.2f}x" for f in BYTES_BUDGETS)
            )
    for key, title in (
        ("predict_ahead_hit", "predict-ahead: share of the pages the exact scores choose that the pages chosen "
         "from the previous position's query hold"),
        ("layer_ahead_hit", "layer-ahead: the same, the pages chosen from the layer before's query at the same "
         "position"),
    ):  # fmt: skip
        hits = by_bytes[key]
        print(f"\n{title}")
        print(f"{'method':<22}" + "".join(f"{int(b * 100):>8d}%" for b in BUDGETS))
        for name in methods:
            if f"{name}|{BUDGETS[0]}" in hits:
                print(f"{name:<22}" + "".join(f"{hits[f'{name}|{b}']:>9.3f}" for b in BUDGETS))
    r = max(args.ranks)  # scoring cost does not depend on eta
    timed = {
        k: v
        for k, v in methods.items()
        if k in ("quest", "router", f"locks r={r}", f"oval r={r} eta=0.5") or v[0] == "router2"
    }
    c = cost(model, processor, prompts[: args.cost_prompts], timed, args.cost_tokens, args.repeats)
    base = c["none"]["decode_ms_per_step"]
    print(
        f"\ncost at read budget 25% ({args.cost_prompts} prompts x {args.cost_tokens} tokens, median of {args.repeats})"
    )
    print(f"{'method':<22}{'decode ms/step':>16}{'vs none':>9}{'select ms/step':>16}{'select share':>14}")
    for name, r in c.items():
        d, s = r["decode_ms_per_step"], r["select_ms_per_step"]
        print(f"{name:<22}{d:>16.2f}{d / base:>9.2f}{s:>16.3f}{s / d:>14.1%}")
    width = width_cost() if args.width_cost else None
    if args.out:
        atomic_write_json(
            args.out,
            {"model": where, "args": vars(args), "quality": q, "cost": c, "width_cost": width, **by_bytes},
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
