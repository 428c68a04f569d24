"""Fit KVP's per-head temperatures, for `kvp:layerwise=false,calibrated=true`: SmolLM2-135M-Instruct's text
agents, or bundled-smol's image agents (`--model bundled-smol`).

The per-head agents score a (layer, KV head)'s tokens with the logits of a Plackett-Luce ranking: trained to
order one head's tokens, their scale is free. Ranked together over every layer and head (`layerwise=false`),
a head's log shares `log_softmax(raw)` stand for its share of the attention the answer will pay; this fits,
per (layer, KV head), the temperature tau for which `log_softmax(tau x raw)` is closest to that share (the
cross-entropy of the target's distribution over the context's unprotected tokens, summed over training
contexts; convex in tau, minimised on a log grid from 0.02 to 50). The target is KVP's own (the attention the
full cache's question and greedy answer pay each context token, summed over those queries, max over each KV
head's query heads), on training contexts of the long-context text tasks (eval/longtext.py's generator on
KVP's training seed, never a dev set's). Learned here from the model's attention; the agents are unchanged.

With `--model bundled-smol` the contexts are training scenes of the 576-token generator (`zoo576:train`, the
scenes bundled-smol's agents were trained on, never a dev set's), question-agnostic as the harness runs them:
the cache holds the chat template's head and the image, the candidates are the image tokens, and the target
is the agents' own training target (the attention the reference answer, its follow-up question and that
answer pay each image token: `mm-oval train-kvp`'s trace utility).

    python benchmarks/kvp_temperature.py --out mm_oval/zoo/smollm2_kvp_context/temperature.json
    python benchmarks/kvp_temperature.py --model bundled-smol --agents bundled-smol-image --scenes 48 --out F
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from kvp_layer_budget import training_futures

from mm_oval.allocation import Allocation
from mm_oval.cache import choose_kept, request_info
from mm_oval.config import OvalConfig
from mm_oval.errors import ModelError
from mm_oval.files import atomic_write_json
from mm_oval.modelfiles import load_model
from mm_oval.policies.base import IMAGE
from mm_oval.policies.kvp import load_agents
from mm_oval.policies.kvp_io import bundled_agents_path
from mm_oval.policies.signature import check_signature, model_signature
from mm_oval.training.traces import LONGTEXT_SEED_BASE, capture_sample, load_samples


@dataclass
class Context:
    """One training context as the cache scores it: each layer's (keys, values) of the prompt (B = 1),
    positions / modality / image_rc (1, n), the target (L, Hkv, n) and the candidates (n,), a bool mask."""

    name: str
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    positions: torch.Tensor
    modality: torch.Tensor
    image_rc: torch.Tensor
    utility: torch.Tensor
    free: torch.Tensor


def text_contexts(model, tok, args) -> Iterator[Context]:
    """SmolLM2's training contexts of the long-context text tasks, every unprotected token a candidate."""
    for ctx in training_futures(model, tok, args.kinds.split(","), args.length, args.per_kind, keep_kv=True):
        info = request_info(ctx.head, None, None, 1, args.sinks, args.recent)  # text only: no image tokens
        yield Context(f"{ctx.kind} {ctx.group}", ctx.kv, info.positions, info.modality, info.image_rc,
                      ctx.utility, ~info.protected[0])  # fmt: skip


def image_contexts(model, processor, args) -> Iterator[Context]:
    """bundled-smol's training scenes, question-agnostic (the prompt ends at the image), the image tokens the
    candidates; the target is the trace utility `train-kvp` trains the agents on (zoo data: one follow-up)."""
    for sample in load_samples(f"zoo576:train:{args.scenes}", followups=1):
        tr = capture_sample(
            model, processor, sample, answer="reference", store_queries=False, compress="image"
        )
        kv = [(k[None].float(), v[None].float()) for k, v in zip(tr["keys"], tr["values"], strict=True)]
        modality = tr["modality"].long()
        yield Context(sample.sample_id, kv, tr["positions"].long()[None], modality[None],
                      tr["image_rc"].long()[None], tr["utility"], modality == IMAGE)  # fmt: skip


SHARE_BUDGETS = (0.1, 0.25)


def layer_shares(raw: torch.Tensor, taus: torch.Tensor, budget: float) -> torch.Tensor:
    """(L,): the share of each layer's candidate tokens that `kvp:layerwise=false,calibrated=true` keeps at
    `budget`, over the budget (1 everywhere = the same count per layer), from one context's raw scores of its
    candidates (L, H, n) and the temperatures (L, H): each head's log shares at its temperature, ranked over
    every layer and head by the cache's own choice (`choose_kept`, the candidates alone, as the protected
    tokens are kept apart)."""
    L, H, n = raw.shape
    scores = torch.log_softmax(taus[..., None] * raw.double(), -1).reshape(1, L * H, n)
    info = request_info(torch.zeros(1, n, dtype=torch.long), None, None, 1, 0, 0)
    cfg = OvalConfig(method="kvp", budget=budget, text_budget=budget, sink_tokens=0, recent_tokens=0)
    kept = choose_kept(scores, info, cfg, Allocation(share_heads=True))
    return kept.view(L, H * n).double().mean(-1) / (kept.double().mean())


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "bundled-smol"))
    ap.add_argument("--agents", default="smollm2-context", help="a bundled name or an agents directory")
    ap.add_argument("--kinds", default="passkey,needle,message,doorkeys,keylist,trio", help="smollm2")
    ap.add_argument("--length", default="1k", help="smollm2")
    ap.add_argument("--per-kind", type=int, default=4, help="smollm2")
    ap.add_argument("--sinks", type=int, default=4, help="smollm2")
    ap.add_argument("--recent", type=int, default=16, help="smollm2")
    ap.add_argument("--scenes", type=int, default=48, help="bundled-smol: training scenes")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    path = args.agents if Path(args.agents).is_dir() else bundled_agents_path(name=args.agents)
    loaded = load_agents(path)
    agents = loaded.agents.eval()
    model, processor = load_model(args.model)
    if args.model == "smollm2":
        model.set_attn_implementation("eager")
    try:  # agents trained for another model would get temperatures fitted to attention they never saw
        check_signature(loaded.model, model_signature(model), loaded.source)
    except ModelError as e:
        sys.exit(f"error: {e}; fit them with --model set to the model they were trained for")
    taus = torch.logspace(
        torch.log10(torch.tensor(0.02)), torch.log10(torch.tensor(50.0)), 241, dtype=torch.float64
    )
    ce = None  # (L, H, grid): the cross-entropy summed over contexts
    raws = []  # each context's raw scores of its candidates (L, H, n), for the shares printed at the end
    t0, n_ctx = time.time(), 0
    make = image_contexts if args.model == "bundled-smol" else text_contexts
    contexts = make(model, processor, args)
    for ctx in contexts:
        free = ctx.free
        rows, layer_raws = [], []
        for layer, (k, v) in enumerate(ctx.kv):
            raw = agents.score_layer(layer, k, v, ctx.positions, ctx.modality, ctx.image_rc)[0][:, free]
            t = ctx.utility[layer][:, free].double()
            t = t / t.sum(-1, keepdim=True)  # (H, n): the head's share of the future's attention
            scaled = taus.view(-1, 1, 1) * raw.double()  # (grid, H, n)
            rows.append(torch.logsumexp(scaled, -1) - (scaled * t).sum(-1))  # (grid, H)
            layer_raws.append(raw)
        part = torch.stack(rows).permute(0, 2, 1)  # (L, H, grid)
        raws.append(torch.stack(layer_raws))
        ce = part if ce is None else ce + part
        n_ctx += 1
        print(f"{ctx.name}: {int(free.sum())} tokens ({time.time() - t0:.0f} s)", flush=True)
    best = ce.argmin(-1)  # (L, H)
    fitted = taus[best]
    one = int((taus - 1).abs().argmin())
    gain = (ce[..., one] - ce.gather(-1, best.unsqueeze(-1)).squeeze(-1)) / n_ctx
    if args.model == "bundled-smol":
        data = {"data": f"zoo576:train:{args.scenes}", "followups": 1, "compress": "image",
                "candidates": "image tokens"}  # fmt: skip
        target = "future attention (sum over reference answer + follow-up turn), per head a distribution"
    else:
        data = {"kinds": args.kinds.split(","), "length": args.length, "seed": LONGTEXT_SEED_BASE,
                "sinks": args.sinks, "recent": args.recent}  # fmt: skip
        target = "future attention (sum over question + greedy answer), per head a distribution"
    atomic_write_json(args.out, {
        "temperatures": [[round(float(x), 4) for x in row] for row in fitted],
        "fitted": {"model": args.model, "agents": args.agents, "target": target, "contexts": n_ctx, **data,
                   "command": "python benchmarks/kvp_temperature.py"
                              + (" --model bundled-smol" if args.model == "bundled-smol" else "")
                              + " --out <file>"},
        "cross_entropy_gain_per_context": [[round(float(x), 4) for x in row] for row in gain],
    }, indent=1)  # fmt: skip
    print("temperatures (median per layer):", " ".join(f"{float(r.median()):.2f}" for r in fitted))
    for b in SHARE_BUDGETS:  # how far from the same count per layer each ranking over every layer moves
        for label, t in (("at tau 1", torch.ones_like(fitted)), ("calibrated", fitted)):
            share = torch.stack([layer_shares(r, t, b) for r in raws]).mean(0)
            print(f"{b:.0%}, {label}: each layer's share kept / the budget:",
                  " ".join(f"{float(x):.2f}" for x in share))  # fmt: skip
    print(f"cross-entropy per context and head: {float(ce[..., one].mean()) / n_ctx:.4f} at tau 1, "
          f"{float(ce.gather(-1, best.unsqueeze(-1)).mean()) / n_ctx:.4f} fitted")  # fmt: skip


if __name__ == "__main__":
    main()
