"""Does KVzip's own score single out the pass key? On SmolLM2-135M-Instruct and the bundled `passkey_1k`
contexts (question-agnostic: the chat template's head and the context, the question not yet read), KVzip's
scores (the largest attention each context token receives while the model reconstructs the context after
its repeat prompt, `mm_oval.policies.kvzip`) are ranked per layer and KV head, and the table gives, for each
token of the key sentence's digits, the share of (layer, KV head) pairs whose top `--budget` share of the
context keeps it. A token scored like the average context token is kept by `--budget` of them.

    python benchmarks/probe_kvzip_passkey.py                   # first 3 contexts, 25%
    python benchmarks/probe_kvzip_passkey.py --contexts 10 --budget 0.1 --json kvzip_probe.json
"""

from __future__ import annotations

import argparse

import torch
from mm_oval.eval.tasks import get_task
from mm_oval.eval.textgen import split_prompt

from mm_oval.files import atomic_write_json
from mm_oval.modelfiles import load_model
from mm_oval.policies.kvzip import KVzip
from mm_oval.smollm2 import gguf_path


def key_tokens(tok, ids: list[int], key: str) -> list[int]:
    """Indices of the tokens that spell `key` wherever it appears in the decoded prompt."""
    starts, text = [], ""
    for i in ids:
        starts.append(len(text))
        text += tok.decode([i])
    hits = [m for m in range(len(text)) if text.startswith(key, m)]
    return [i for i, s in enumerate(starts) if any(h <= s < h + len(key) for h in hits)]


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, default=3)
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    model, tok = load_model("smollm2")
    task = get_task("passkey_1k")
    items = task.load(task.bundled["bundled"](), limit=args.contexts)
    kvzip = KVzip(tokenizer=str(gguf_path().parent))
    rows = []
    for it in items:
        head, _ = split_prompt(tok, it, torch.device("cpu"))
        scores = torch.stack(kvzip.prepare_request(model, head).scores)[:, 0]  # (layers, KV heads, N)
        above = (scores.unsqueeze(-1) < scores.unsqueeze(-2)).float().mean(-1)  # share scoring higher
        kept = above < args.budget
        span = key_tokens(tok, head[0].tolist(), it.meta["key"])
        shares = [round(float(kept[:, :, i].float().mean()), 2) for i in span]
        rows.append(
            {"context": it.id, "tokens": head.shape[1], "key": it.meta["key"], "key_token_kept": shares}
        )
        print(f"{it.id}: {head.shape[1]} tokens, key {it.meta['key']} (twice, {len(span)} digit tokens): "
              f"kept by {shares} of (layer, KV head) pairs at {args.budget:.0%}; average token {args.budget:.2f}")  # fmt: skip
    if args.json:
        atomic_write_json(args.json, {"budget": args.budget, "contexts": rows}, indent=1)


if __name__ == "__main__":
    main()
