"""Can SmolLM2-135M-Instruct answer a multiple-choice question with the option's letter? Text only, with the
answer stated in the question's hint ("In the picture there is a red square and a blue circle." / "What colour
is the square?" / options A-D / LLaVA-1.5's MMBench instruction): the model only has to bind the stated
answer to its letter. Measured zero-shot, then while a LoRA adapter of train-smol's shape (r 16 on every
linear layer, `mm_oval.zoo.smol.lora_config`) trains on such items (cross-entropy on the letter).

    python benchmarks/smol_letters.py --steps 100 --batch 8 --every 50 --out letters.json

Held out: 100 items of another seed. "right": the letter with the highest logit among the options' letters is
the answer's; "loss": the answer letter's cross-entropy over the whole vocabulary (a uniform pick among 4
letters: ln 4 = 1.386). The table says whether bundled-smol's MMBench failure (it maps no answer to a letter,
docs/results/bundled_smol.md) is the language model's limit or its training's.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mm_oval.files import atomic_write_json
from mm_oval.prompts import mmbench_prompt
from mm_oval.zoo.vocab import COLORS, SHAPES

LETTERS = "ABCD"


def make_item(rng: random.Random, tok) -> tuple[list[int], int]:
    """(prompt token ids, index of the right letter) of one item."""
    shape, other = rng.sample(SHAPES, 2)
    color, other_color = rng.sample(COLORS, 2)
    options = [color, *rng.sample([c for c in COLORS if c != color], 3)]
    rng.shuffle(options)
    hint = f"In the picture there is a {color} {shape} and a {other_color} {other}."
    text = mmbench_prompt(f"What color is the {shape}?", hint, options)
    chat = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tok(chat, add_special_tokens=False)["input_ids"], options.index(color)


@torch.no_grad()
def evaluate(model, items: list[tuple[list[int], int]], letter_ids: torch.Tensor) -> dict:
    model.eval()
    right, loss = 0, 0.0
    for ids, gold in items:
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        right += int(logits[letter_ids].argmax()) == gold
        loss += float(F.cross_entropy(logits[None], letter_ids[gold][None]))
    return {"right": round(100.0 * right / len(items), 2), "loss": round(loss / len(items), 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--every", type=int, default=50, help="held-out check every N steps")
    ap.add_argument("--heldout", type=int, default=100)
    ap.add_argument("--lr", type=float, default=2e-4, help="train-smol's LoRA learning rate (default)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="write the table as JSON here")
    args = ap.parse_args()
    if min(args.steps, args.batch, args.every, args.heldout) < 1:
        ap.error("--steps, --batch, --every and --heldout must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    from peft import get_peft_model

    from mm_oval.modelfiles import load_model
    from mm_oval.zoo.smol import lora_config

    torch.manual_seed(0)
    model, tok = load_model("smollm2", device="cpu")
    letter_ids = torch.tensor([tok(x, add_special_tokens=False)["input_ids"][-1] for x in LETTERS])
    held_rng = random.Random("smol-letters-heldout")
    heldout = [make_item(held_rng, tok) for _ in range(args.heldout)]
    rows = [{"step": 0, "items_seen": 0, **evaluate(model, heldout, letter_ids), "sec": 0.0}]
    print(f"step 0 (zero-shot): {rows[-1]['right']}% right, loss {rows[-1]['loss']}", flush=True)
    model = get_peft_model(model, lora_config())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    rng, t0 = random.Random("smol-letters-train"), time.monotonic()
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    for step in range(1, args.steps + 1):
        model.train()
        batch = [make_item(rng, tok) for _ in range(args.batch)]
        n = max(len(ids) for ids, _ in batch)
        ids = torch.full((args.batch, n), pad)
        mask = torch.zeros(args.batch, n, dtype=torch.long)
        for b, (x, _) in enumerate(batch):  # left padding: every prompt ends at the last position
            ids[b, n - len(x) :], mask[b, n - len(x) :] = torch.tensor(x), 1
        logits = model(ids, attention_mask=mask).logits[:, -1].float()
        loss = F.cross_entropy(logits, letter_ids[torch.tensor([g for _, g in batch])])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % args.every == 0 or step == args.steps:
            res = evaluate(model, heldout, letter_ids)
            sec = round(time.monotonic() - t0, 1)
            rows.append({"step": step, "items_seen": step * args.batch, **res, "sec": sec})
            print(
                f"step {step} ({step * args.batch} items): {res['right']}% right, loss {res['loss']}",
                flush=True,
            )
    print("\n| LoRA steps | items trained on | held-out % right | letter loss |")
    print("| ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['step']} | {r['items_seen']} | {r['right']:.2f} | {r['loss']:.4f} |")
    print(f"| chance (4 options) | | 25.00 | {math.log(4):.4f} |")
    if args.out:
        atomic_write_json(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows})
        print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
