"""Where does retrieval lose a long-context answer? For contexts that a retrieval configuration gets wrong,
this generates each answer again under that configuration (question-agnostic, as the harness runs it) and
under variants that change which pages some layers read at the one-token decode steps:

- `as is`: the configuration unchanged (it must reproduce the harness's answer);
- `answer read`: every KV head of every layer also reads the pages holding the answer's text in the context
  and `--widen` tokens either side (is it the answer's pages that the selection misses?);
- `dense L0:L1`: layers L0..L1-1 read every page (which layers' sparse reading loses the answer?).

It prints, per context, each variant's answer and score (the task's own rule), and with `--trace` the
decode steps of the `as is` run: how many of the model's KV heads read all of the pages holding the
answer's own tokens at each step, and the layers where none did. A diagnostic, not a method: the variants
read more than the budget.

    python benchmarks/probe_answer_pages.py --task message_1k --data docs/results/seed3 --ids 1k-2,1k-15 \
        --spec oval:read_bytes_budget=0.25,read_head_budget=shared,read_chunks=dense \
        --widen 48 --dense 0:14,14:30 --out runs/probe-answer.json
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
from mm_oval.eval.tasks import Item, get_task, resolve_data
from mm_oval.eval.textgen import generate_text, split_prompt

import mm_oval
from mm_oval.cache import decode
from mm_oval.config import OvalConfig
from mm_oval.errors import MmOvalError
from mm_oval.files import atomic_write_json
from mm_oval.prompts import tokenizer_of

ANSWER_KEYS = ("message", "key", "word")  # where a text task's item holds the answer it asks to copy


def answer_span(tok: Any, item: Item) -> list[int]:
    """Positions (in the question-agnostic head's tokens) of the tokens that overlap the item's answer text
    in its context."""
    text = next((item.meta[k] for k in ANSWER_KEYS if isinstance(item.meta.get(k), str)), None)
    if text is None:
        raise MmOvalError(f"item {item.id}: no answer text in its meta (looked for {', '.join(ANSWER_KEYS)})")
    head, _ = split_prompt(tok, item, torch.device("cpu"))
    decoded = tok.decode(head[0])
    start = decoded.lower().find(text.lower())
    if start < 0:
        raise MmOvalError(f"item {item.id}: its answer {text!r} is not in its context")
    enc = tok(decoded, add_special_tokens=False, return_offsets_mapping=True)
    if len(enc["input_ids"]) != head.shape[1]:
        raise MmOvalError(
            f"item {item.id}: the head does not tokenize back to itself; this tokenizer cannot be probed"
        )
    end = start + len(text)
    return [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < end and b > start]


def _span_pages(store: Any, head: int, lo: int, hi: int) -> list[int]:
    pos, page = store.slot_pos[0, head], store.slot_page[0, head]
    return sorted(set(page[(pos >= lo) & (pos <= hi)].tolist()) - {-1})


@contextlib.contextmanager
def patched_reads(
    span: tuple[int, int],
    force: bool = False,
    dense: tuple[int, int] | None = None,
    trace: list | None = None,
) -> Iterator[None]:
    """While active, each one-token decode step of a wrapped model (batch of one) reads as the retrieval
    chose, except: with `force` every KV head also reads the pages of positions span[0]..span[1]; with
    `dense` = (l0, l1) layers l0..l1-1 read every page. `trace` gets (layer, [share of the span's pages read,
    per KV head]) per layer and step, of the pages finally read."""
    chosen = decode.read_pages

    def read_pages(layer: Any, query: torch.Tensor, scaling: float) -> torch.Tensor | None:
        out = chosen(layer, query, scaling)
        if query.shape[2] != 1:
            return out
        if dense is not None and dense[0] <= layer.layer_idx < dense[1]:
            out = None
        if not (force and out is not None) and trace is None:
            return out  # nothing to add or record: the span's pages are not needed
        heads = range(layer.store.slot_page.shape[1])
        pages = [_span_pages(layer.store, h, *span) for h in heads]
        if force and out is not None:
            out = out.clone()
            for h in heads:
                out[0, h, [p for p in pages[h] if p < out.shape[-1]]] = True
        if trace is not None:
            shares = [
                1.0 if out is None else sum(bool(out[0, h, p]) for p in pages[h]) / max(len(pages[h]), 1)
                for h in heads
            ]
            trace.append((layer.layer_idx, shares))
        return out

    decode.read_pages = read_pages
    try:
        yield
    finally:
        decode.read_pages = chosen


def probe(
    model: Any,
    processor: Any,
    task_name: str,
    items: list[Item],
    spec: str,
    widen: int = 0,
    dense: list[tuple[int, int]] = (),
    max_new_tokens: int = 32,
    trace: bool = False,
) -> list[dict[str, Any]]:
    """One row per item: each variant's answer and score (see the module's doc)."""
    task, tok = get_task(task_name), tokenizer_of(processor)
    cfg = OvalConfig.from_spec(spec)
    layers = model.config.get_text_config().num_hidden_layers
    rows = []
    for it in items:
        span = answer_span(tok, it)
        lo, hi = span[0] - widen, span[-1] + widen
        variants: list[tuple[str, dict]] = [("as is", {}), (f"answer read (+-{widen})", {"force": True})]
        variants += [(f"dense {a}:{b}", {"dense": (a, b)}) for a, b in dense]
        row: dict[str, Any] = {"id": it.id, "answer_tokens": [span[0], span[-1]], "variants": {}}
        for name, kw in variants:
            steps: list = [] if (trace and name == "as is") else None
            # forced: the answer's tokens and `widen` either side; traced: the answer's own tokens
            reads = (lo, hi) if kw.get("force") else (span[0], span[-1])
            with mm_oval.wrapped(model, cfg), patched_reads(reads, trace=steps, **kw):
                ans, _ = generate_text(model, processor, [it], max_new_tokens, compress="context")[0]
            score = task.score([it], {it.id: ans})[task.primary_metric]
            row["variants"][name] = {"answer": ans, "score": score}
            if steps is not None:
                row["trace"] = [
                    {
                        "heads_reading_answer": sum(s == 1.0 for _, hs in steps[k : k + layers] for s in hs),
                        "layers_without": [li for li, hs in steps[k : k + layers] if max(hs) == 0.0],
                    }
                    for k in range(0, len(steps), layers)
                ]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--task", default="message_1k")
    ap.add_argument("--data", default="bundled")
    ap.add_argument("--ids", required=True, help="comma-separated question ids (e.g. 1k-2,1k-15)")
    ap.add_argument("--spec", default="oval:read_bytes_budget=0.25,read_head_budget=shared,read_chunks=dense")
    ap.add_argument(
        "--widen", type=int, default=48, help="tokens either side of the answer read in `answer read`"
    )
    ap.add_argument(
        "--dense", default="", help="comma-separated layer ranges L0:L1 read densely, one variant each"
    )
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--trace", action="store_true", help="also the heads reading the answer at each step")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    a = ap.parse_args(argv)
    try:
        dense = [tuple(int(x) for x in r.split(":")) for r in a.dense.split(",") if r]
        if any(len(r) != 2 or not 0 <= r[0] < r[1] for r in dense):
            raise MmOvalError(
                f"--dense {a.dense!r}: give layer ranges L0:L1 with 0 <= L0 < L1, e.g. 0:14,14:30"
            )
        from mm_oval.modelfiles import load_model

        task = get_task(a.task)
        wanted = [i for i in a.ids.split(",") if i]
        pool = {it.id: it for it in task.load(resolve_data(a.data, task))}
        missing = [i for i in wanted if i not in pool]
        if missing:
            raise MmOvalError(f"--ids: {', '.join(missing)} not in {a.task}'s {a.data} dev set")
        model, processor = load_model(a.model, device="cpu", dtype="float32")
        rows = probe(model, processor, a.task, [pool[i] for i in wanted], a.spec, a.widen, dense,
                     a.max_new_tokens, a.trace)  # fmt: skip
    except MmOvalError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for r in rows:
        print(f"{r['id']} (answer at tokens {r['answer_tokens'][0]}-{r['answer_tokens'][1]})")
        for name, v in r["variants"].items():
            print(f"  {name:22s} {v['score']:6.1f}  {v['answer']!r}")
        for k, s in enumerate(r.get("trace", [])):
            print(
                f"    step {k:2d}: {s['heads_reading_answer']} KV heads read the answer; none in layers {s['layers_without']}"
            )
    if a.out:
        atomic_write_json(
            a.out, {"spec": a.spec, "task": a.task, "data": a.data, "widen": a.widen, "rows": rows}
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
