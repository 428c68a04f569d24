"""Fit KVP's per-layer budget on SmolLM2-135M-Instruct: how the tokens kept should be divided over the layers.

On training contexts of the long-context text tasks (eval/longtext.py's generator on the KVP training seed,
never the dev set's), question-agnostic as the harness runs them, it computes KVP's own target (the attention
the full cache's question and greedy answer pay each context token, summed over those queries, max over each
KV head's query heads: the utility KVP's agents learn to rank by), ranks every (layer, KV head, token) of a
context together at each of `--budgets` of the context KV (the cache's own choice, `choose_kept` over every
layer's heads at once, as `kvzip:layerwise=false`; the protected tokens apart), and records the share
of its tokens each layer keeps. A layer's weight is its mean share over the contexts and budgets divided by
the mean over the layers (so the weights average 1); `kvp:layer_budget=true` then gives layer l
`weight_l x` the uniform count (beyond the protected tokens, capped at what the layer holds, the total
unchanged). Learned here (from the model's attention on training contexts); nothing is fitted on a dev set.

    python benchmarks/kvp_layer_budget.py --out mm_oval/zoo/smollm2_kvp_context/layer_budget.json
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from mm_oval.eval import longtext
from mm_oval.eval.textgen import split_prompt
from probe_kept_span import answer_attention

from mm_oval.allocation import Allocation
from mm_oval.cache import choose_kept, request_info
from mm_oval.config import OvalConfig
from mm_oval.files import atomic_write_json
from mm_oval.modelfiles import load_model
from mm_oval.training.traces import LONGTEXT_LENGTHS, LONGTEXT_SEED_BASE


@dataclass
class Future:
    """One training context: its kind and group, the prompt's head (template + context) and the full cache's
    future (question + greedy answer) after it, the future's utility of each head token per layer
    (L, Hkv, n; KVP's target) and, with `keep_kv`, each layer's (keys, values) of the head, as the cache
    stores them."""

    kind: str
    group: str
    head: torch.Tensor
    utility: torch.Tensor
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None


@torch.no_grad()
def training_futures(
    model, tok, kinds, length: str, per_kind: int, keep_kv: bool = False
) -> Iterator[Future]:
    """The training contexts (eval/longtext.py's generator on KVP's training seed, one question per context)
    with KVP's target: the attention the full cache's question and greedy answer pay each context token,
    summed over those queries, max over each KV head's query heads."""
    kv_heads = model.config.num_key_value_heads
    spec = {"seed": LONGTEXT_SEED_BASE, "per_length": per_kind,
            "lengths": {length: LONGTEXT_LENGTHS[length]}}  # fmt: skip
    for kind in kinds:
        budget_tokens = longtext.TASK_CLASSES[f"{kind}_1k"].max_new_tokens
        seen = set()
        for it in longtext.generate(kind, length, spec):
            if it.group in seen:  # one question per context
                continue
            seen.add(it.group)
            head, tail = split_prompt(tok, it, torch.device("cpu"))
            ids = torch.cat([head, tail], dim=1)
            seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=budget_tokens, pad_token_id=tok.pad_token_id)  # fmt: skip
            n = head.shape[1]
            kv = None
            if keep_kv:  # the head's keys and values as its own prefill stores them (causal: the same)
                out = model(input_ids=head, use_cache=True, logits_to_keep=1)
                kv = [(layer.keys, layer.values) for layer in out.cache.layers]
            _, utility = answer_attention(model, seq[:, :-1], n, kv_heads, tail.shape[1])
            yield Future(kind, str(it.group), head, torch.stack(utility["sum"]), kv)


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default="passkey,needle,message,doorkeys,keylist,trio")
    ap.add_argument("--length", default="1k")
    ap.add_argument("--per-kind", type=int, default=4)
    ap.add_argument("--budgets", default="0.1,0.25")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--recent", type=int, default=16)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    budgets = [float(b) for b in args.budgets.split(",")]
    model, tok = load_model("smollm2")
    model.set_attn_implementation("eager")
    shares: dict[float, list[torch.Tensor]] = {b: [] for b in budgets}
    t0, n_ctx = time.time(), 0
    for ctx in training_futures(model, tok, args.kinds.split(","), args.length, args.per_kind):
        head, u = ctx.head, ctx.utility
        L, H, n = u.shape
        # the cache's own choice over every layer (what `layerwise=false` keeps): sinks and recent window
        # in every head, the rest ranked together
        info = request_info(head, None, None, 1, args.sinks, args.recent)  # text only: no image tokens
        free = ~info.protected[0]
        for b in budgets:
            cfg = OvalConfig(method="kvzip", method_options={"layerwise": False}, budget=b, text_budget=b,
                             sink_tokens=args.sinks, recent_tokens=args.recent)  # fmt: skip
            kept = choose_kept(u.reshape(1, L * H, n), info, cfg, Allocation(share_heads=True))
            shares[b].append(kept.view(L, H, n)[:, :, free].float().mean((1, 2)))
        n_ctx += 1
        print(f"{ctx.kind} {ctx.group}: {n} tokens ({time.time() - t0:.0f} s)", flush=True)
    per_budget = {b: torch.stack(v).mean(0) for b, v in shares.items()}
    weights = torch.stack([s / s.mean() for s in per_budget.values()]).mean(0)
    atomic_write_json(args.out, {
        "weights": [round(float(w), 4) for w in weights],
        "fitted": {"model": "smollm2", "target": "future attention (sum over question + greedy answer)",
                   "contexts": n_ctx, "kinds": args.kinds.split(","), "length": args.length,
                   "seed": LONGTEXT_SEED_BASE, "budgets": budgets, "sinks": args.sinks, "recent": args.recent,
                   "command": "python benchmarks/kvp_layer_budget.py --out <file>"},
        "shares": {str(b): [round(float(x), 4) for x in s] for b, s in per_budget.items()},
    }, indent=1)  # fmt: skip
    print("weights:", " ".join(f"{w:.2f}" for w in weights))


if __name__ == "__main__":
    main()
