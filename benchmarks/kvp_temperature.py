"""Fit KVP's per-head temperatures on SmolLM2-135M-Instruct, for `kvp:layerwise=false,calibrated=true`.

The per-head agents score a (layer, KV head)'s tokens with the logits of a Plackett-Luce ranking: trained to
order one head's tokens, their scale is free. Ranked together over every layer and head (`layerwise=false`),
a head's log shares `log_softmax(raw)` stand for its share of the attention the answer will pay; this fits,
per (layer, KV head), the temperature tau for which `log_softmax(tau x raw)` is closest to that share (the
cross-entropy of the target's distribution over the context's unprotected tokens, summed over training
contexts; convex in tau, minimised on a log grid from 0.02 to 50). The target is KVP's own (the attention the
full cache's question and greedy answer pay each context token, summed over those queries, max over each KV
head's query heads), on training contexts of the long-context text tasks (eval/longtext.py's generator on
KVP's training seed, never a dev set's). Learned here from the model's attention; the agents are unchanged.

    python benchmarks/kvp_temperature.py --out mm_oval/zoo/smollm2_kvp_context/temperature.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from kvp_layer_budget import training_futures

from mm_oval.cache import request_info
from mm_oval.files import atomic_write_json
from mm_oval.modelfiles import load_model
from mm_oval.policies.kvp import load_agents
from mm_oval.policies.kvp_io import bundled_agents_path
from mm_oval.training.traces import LONGTEXT_SEED_BASE


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", default="smollm2-context", help="a bundled name or an agents directory")
    ap.add_argument("--kinds", default="passkey,needle,message,doorkeys,keylist,trio")
    ap.add_argument("--length", default="1k")
    ap.add_argument("--per-kind", type=int, default=4)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--recent", type=int, default=16)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model, tok = load_model("smollm2")
    model.set_attn_implementation("eager")
    path = args.agents if Path(args.agents).is_dir() else bundled_agents_path(name=args.agents)
    agents = load_agents(path).agents.eval()
    taus = torch.logspace(
        torch.log10(torch.tensor(0.02)), torch.log10(torch.tensor(50.0)), 241, dtype=torch.float64
    )
    ce = None  # (L, H, grid): the cross-entropy summed over contexts
    t0, n_ctx = time.time(), 0
    for ctx in training_futures(model, tok, args.kinds.split(","), args.length, args.per_kind, keep_kv=True):
        info = request_info(ctx.head, None, None, 1, args.sinks, args.recent)  # text only: no image tokens
        free = ~info.protected[0]
        rows = []
        for layer, (k, v) in enumerate(ctx.kv):
            raw = agents.score_layer(layer, k, v, info.positions, info.modality, info.image_rc)[0][:, free]
            t = ctx.utility[layer][:, free].double()
            t = t / t.sum(-1, keepdim=True)  # (H, n): the head's share of the future's attention
            scaled = taus.view(-1, 1, 1) * raw.double()  # (grid, H, n)
            rows.append(torch.logsumexp(scaled, -1) - (scaled * t).sum(-1))  # (grid, H)
        part = torch.stack(rows).permute(0, 2, 1)  # (L, H, grid)
        ce = part if ce is None else ce + part
        n_ctx += 1
        print(f"{ctx.kind} {ctx.group}: {int(free.sum())} tokens ({time.time() - t0:.0f} s)", flush=True)
    best = ce.argmin(-1)  # (L, H)
    fitted = taus[best]
    one = int((taus - 1).abs().argmin())
    gain = (ce[..., one] - ce.gather(-1, best.unsqueeze(-1)).squeeze(-1)) / n_ctx
    atomic_write_json(args.out, {
        "temperatures": [[round(float(x), 4) for x in row] for row in fitted],
        "fitted": {"model": "smollm2", "agents": args.agents,
                   "target": "future attention (sum over question + greedy answer), per head a distribution",
                   "contexts": n_ctx, "kinds": args.kinds.split(","), "length": args.length,
                   "seed": LONGTEXT_SEED_BASE, "sinks": args.sinks, "recent": args.recent,
                   "command": "python benchmarks/kvp_temperature.py --out <file>"},
        "cross_entropy_gain_per_context": [[round(float(x), 4) for x in row] for row in gain],
    }, indent=1)  # fmt: skip
    print("temperatures (median per layer):", " ".join(f"{float(r.median()):.2f}" for r in fitted))
    print(f"cross-entropy per context and head: {float(ce[..., one].mean()) / n_ctx:.4f} at tau 1, "
          f"{float(ce.gather(-1, best.unsqueeze(-1)).mean()) / n_ctx:.4f} fitted")  # fmt: skip


if __name__ == "__main__":
    main()
