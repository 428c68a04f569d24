"""What does an eviction method keep of what the answer reads? On SmolLM2-135M-Instruct and a bundled
long-context text task (default `message_1k`: a 10-word secret message, the answer decoded from the
compressed cache), question-agnostic as the harness runs it (the chat template's head and the context
prefilled and compressed before the question is read), each method's kept tokens are read off the cache per
layer and KV head. Per context the table gives where the answer sits in the context, the mean share of
(layer, KV head) pairs keeping one of its tokens, the same for its cue (the words of its sentence before it,
e.g. "The secret message is:"), the share of the full cache's answer attention that lands on kept tokens
(the attention the question and the full cache's greedy answer pay the context, per pair, averaged over
the pairs: what KVP's agents are trained to keep), the same share of the part of it paid to the answer's
and to the cue's tokens, and whether the method's own greedy answer scores.

    python benchmarks/probe_kept_span.py                       # message_1k, first 10 contexts, 25%, KVP and KVzip
    python benchmarks/probe_kept_span.py --task needle_1k --budget 0.1 --methods kvp:agents=smollm2-context keydiff
    python benchmarks/probe_kept_span.py --methods future_oracle:reduce=sum future_oracle:reduce=max
    python benchmarks/probe_kept_span.py --methods future_oracle:layerwise=false kvzip:layerwise=false

`future_oracle` (a diagnostic registered in this script's process only: it reads the future) keeps, per layer
and KV head, the tokens the full cache's own question and greedy answer pay the most attention, summed over
those queries (`reduce=sum`: exactly the utility KVP's agents are trained to rank by) or their largest
(`reduce=max`): what a perfect KVP would keep; `reduce=question` sums only the question's queries (the last
of which chooses the answer's first token). `layerwise=false` ranks every layer's tokens together, as
KVzip's own allocation (`kvzip:layerwise=false`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from mm_oval.eval.longtext import score_item
from mm_oval.eval.tasks import get_task
from mm_oval.eval.textgen import split_prompt
from probe_kvzip_passkey import key_tokens

import mm_oval
from mm_oval.allocation import Allocation
from mm_oval.config import OvalConfig
from mm_oval.core import PrefillContext
from mm_oval.files import atomic_write_json
from mm_oval.modelfiles import load_model
from mm_oval.policies.base import EvictionPolicy
from mm_oval.registry import EVICTION_REGISTRY
from mm_oval.telemetry import kept_positions
from mm_oval.wrapper import prefill

ANSWER_FIELDS = ("message", "word", "key")  # the item's answer in its meta, by kind


def cue_tokens(tok, ids: list[int], first: int) -> list[int]:
    """The tokens of the answer's sentence before it: back from `first` to the previous sentence's end."""
    start = first
    while start > 0 and not tok.decode([ids[start - 1]]).rstrip().endswith((".", "?", "!", "\n")):
        start -= 1
    return list(range(start, first))


def answer_attention(
    model, ids: torch.Tensor, n: int, kv_heads: int, n_question: int
) -> tuple[list[torch.Tensor], dict]:
    """Per layer, (KV heads, n): the attention the positions after the head (question and answer) pay the
    head's n positions, summed over those queries and each KV head's query heads, normalised per KV head.
    Also the future's utility of each head position per layer, (KV heads, n), max over each KV head's query
    heads of the attention, reduced over the future's queries by `sum` (KVP's training target) and by `max`
    (the largest attention any one future query pays it, as KVzip scores its reconstruction's queries), and
    by `question`: the sum over the question's `n_question` queries only (those whose last one chooses the
    answer's first token)."""
    out = model(input_ids=ids, output_attentions=True, use_cache=False, logits_to_keep=1)
    per_layer, utility = [], {"sum": [], "max": [], "question": []}
    for att in out.attentions:  # (1, query heads, T, T)
        fut = att[0, :, n:, :n].float()  # (query heads, future queries, n)
        summed = fut.sum(1).reshape(kv_heads, -1, n)  # (KV heads, group, n)
        a = summed.sum(1)
        per_layer.append(a / a.sum(-1, keepdim=True))
        utility["sum"].append(summed.amax(1))
        utility["max"].append(fut.amax(1).reshape(kv_heads, -1, n).amax(1))
        utility["question"].append(fut[:, :n_question].sum(1).reshape(kv_heads, -1, n).amax(1))
    return per_layer, utility


FUTURE: dict[str, list[torch.Tensor]] = {}  # the current context's future utility (set before its prefill)


@dataclass
class FutureOracle(EvictionPolicy):
    """A diagnostic, not a method: keeps the tokens the full cache's own future (the question and the full
    cache's greedy answer) pays the most attention, reduced over the future's queries by `reduce` (sum: the
    utility KVP's agents are trained to rank by; max: as KVzip scores its reconstruction's queries). It reads
    the future, so it is registered only in this script's process."""

    name = "future_oracle"
    comparable_across_heads = True
    reduce: str = "sum"
    layerwise: bool = True  # False: every layer's tokens ranked together, as kvzip:layerwise=false

    @property
    def allocation(self) -> Allocation | None:
        return None if self.layerwise else Allocation(share_heads=True, across_layers=True)

    def score(self, ctx: PrefillContext) -> torch.Tensor:
        u = FUTURE[self.reduce][ctx.layer_idx].to(ctx.keys.device)  # (Hkv, n)
        if ctx.keys.shape[0] != 1 or u.shape[-1] != ctx.keys.shape[2]:
            raise ValueError("future_oracle scores one unpadded context at a time")
        return u[None]


def tokens_kept(masks: list[torch.Tensor], positions: list[int]) -> float:
    """Mean over (layer, KV head) pairs of the share of the given positions the pair keeps."""
    return float(torch.stack([m[:, positions].float().mean(-1) for m in masks]).mean())


def attention_kept(masks: list[torch.Tensor], per_layer: list[torch.Tensor]) -> float:
    """Mean over (layer, KV head) pairs of the share of the pair's answer attention on kept positions."""
    return float(torch.stack([(a * m).sum(-1) for m, a in zip(masks, per_layer)]).mean())


def attention_on_kept(
    masks: list[torch.Tensor], per_layer: list[torch.Tensor], positions: list[int]
) -> float:
    """Of all the answer attention the pairs pay the given positions, the share that lands on kept ones (a
    pair that pays them more weighs more)."""
    kept = sum(float((a[:, positions] * m[:, positions]).sum()) for m, a in zip(masks, per_layer))
    return kept / sum(float(a[:, positions].sum()) for a in per_layer)


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="message_1k")
    ap.add_argument("--contexts", type=int, default=10)
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--methods", nargs="+", default=["kvp:agents=smollm2-context", "kvzip"])
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    EVICTION_REGISTRY[FutureOracle.name] = FutureOracle
    model, tok = load_model("smollm2")
    task = get_task(args.task)
    items = task.load(task.bundled["bundled"](), limit=args.contexts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    gen = {"do_sample": False, "max_new_tokens": args.max_new_tokens, "pad_token_id": pad}
    kv_heads = model.config.num_key_value_heads
    prompts = []
    model.set_attn_implementation("eager")  # attention weights for the full cache's answer
    for it in items:
        field = next(f for f in ANSWER_FIELDS if f in it.meta)
        head, tail = split_prompt(tok, it, torch.device("cpu"))
        span = key_tokens(tok, head[0].tolist(), it.meta[field])
        if not span:
            raise SystemExit(f"{it.id}: its answer {it.meta[field]!r} is not spelled out in the context")
        ids = torch.cat([head, tail], dim=1)
        seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **gen)
        att, utility = answer_attention(model, seq[:, :-1], head.shape[1], kv_heads, tail.shape[1])
        prompts.append((it, head, ids, span, cue_tokens(tok, head[0].tolist(), span[0]), att, utility))
    model.set_attn_implementation("sdpa")
    rows = []
    for spec in args.methods:
        mm_oval.wrap(model, OvalConfig.from_spec(spec, args.budget))
        try:
            for it, head, ids, span, cue, att, utility in prompts:
                FUTURE.update(utility)
                cache = prefill(model, input_ids=head, attention_mask=torch.ones_like(head))
                masks = kept_positions(cache, head.shape[1])
                seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, **gen)
                answer = tok.decode(seq[0, ids.shape[1] :], skip_special_tokens=True).strip()
                row = {
                    "method": spec, "context": it.id, "answer_at": round(span[0] / head.shape[1], 2),
                    "answer_tokens": len(span), "answer_kept": round(tokens_kept(masks, span), 3),
                    "cue_tokens": len(cue), "cue_kept": round(tokens_kept(masks, cue), 3) if cue else None,
                    "attention_kept": round(attention_kept(masks, att), 3),
                    "answer_attention_kept": round(attention_on_kept(masks, att, span), 3),
                    "cue_attention_kept": round(attention_on_kept(masks, att, cue), 3) if cue else None,
                    "score": score_item(task.kind, answer, it.meta)["accuracy"], "answer": answer,
                }  # fmt: skip
                rows.append(row)
                print(f"{spec:32s} {it.id}: answer at {row['answer_at']:.0%} ({len(span)} tokens) kept "
                      f"{row['answer_kept']:.1%}, cue ({len(cue)}) {row['cue_kept'] or 0:.1%}; attention kept: "
                      f"{row['attention_kept']:.1%} of all, {row['answer_attention_kept']:.1%} of the answer's, "
                      f"{row['cue_attention_kept'] or 0:.1%} of the cue's; score {row['score']:.0f}")  # fmt: skip
        finally:
            mm_oval.unwrap(model)
    print(f"\n{args.task}, {args.budget:.0%} of the context KV, mean over contexts answered / not answered:")
    for spec in args.methods:
        mine = [r for r in rows if r["method"] == spec]
        right = [r for r in mine if r["score"] > 0]
        wrong = [r for r in mine if r["score"] == 0]

        def avg(rs, k):
            return sum(r[k] or 0 for r in rs) / len(rs) if rs else float("nan")

        print(f"{spec}: {len(right)}/{len(mine)} answered; answer tokens kept {avg(right, 'answer_kept'):.1%} / "
              f"{avg(wrong, 'answer_kept'):.1%}, cue {avg(right, 'cue_kept'):.1%} / {avg(wrong, 'cue_kept'):.1%}, "
              f"attention kept {avg(right, 'attention_kept'):.1%} / {avg(wrong, 'attention_kept'):.1%}, "
              f"of that on the answer {avg(right, 'answer_attention_kept'):.1%} / "
              f"{avg(wrong, 'answer_attention_kept'):.1%}, on the cue {avg(right, 'cue_attention_kept'):.1%} / "
              f"{avg(wrong, 'cue_attention_kept'):.1%}")  # fmt: skip
    if args.json:
        atomic_write_json(args.json, {"task": args.task, "budget": args.budget, "rows": rows}, indent=1)


if __name__ == "__main__":
    main()
