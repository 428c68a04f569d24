"""Decode step time at LLaVA-1.5-7B's width: the wrapped full cache against retrieval at a bytes budget
(and eviction), measured side by side in one run.

    python benchmarks/bench_decode.py                  # 7B width, 2 layers, 4 images x batch 4, bf16, CPU
    python benchmarks/bench_decode.py --batch 1 --out decode.json
    python benchmarks/bench_decode.py --small          # the tiny shapes (seconds; what the tests run)

The model is bench_memory's: a random LLaVA whose language model has LLaVA-1.5-7B's layer shape (hidden
4096, 32 heads = 32 KV heads of dim 128, MLP 11008) but `--layers` layers (2), LLaVA-1.5's 576 image tokens
per image and `--images` images (4) per prompt, `--batch` prompts. Each configuration prefills the prompt
once into its own cache; then the configurations take turns, one decode step each per round, for `--steps`
rounds (after `--warmup` rounds), so that the machine's load falls on all of them alike. Per configuration:
the median decode step (the whole forward: every layer, the LM head, page scoring and selection), its
ratio to the wrapped full cache's median in the same run, and the bytes its decode steps read (summaries
scanned + KV of the selected and always-read pages) over dense attention's, from `mm_oval.stats`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_memory import add_model_args, random_prompts, sizes

import mm_oval
from mm_oval.config import OvalConfig
from mm_oval.files import atomic_write_json
from mm_oval.stats import cache_stats
from mm_oval.wrapper import prefill
from mm_oval.zoo.model import build_tiny_llava

R = "read_bytes_budget=0.25,image_tile=4"
DEFAULT_METHODS = (
    "full",
    "snapkv:budget=0.25",
    f"quest:{R},summary_format=compact",
    f"quest:{R}",
    f"oval:{R},summary_format=compact",
    f"oval:{R},summary_format=compact,rank=2",
)


def build(args: argparse.Namespace):
    model, processor = build_tiny_llava(seed=0, sizes=sizes(args.small, args.layers))
    dtype = getattr(torch, args.dtype)
    model = model.to(dtype=dtype).eval()
    return model, random_prompts(model, processor, args.images, args.batch, dtype)[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--steps", type=int, default=24, help="timed decode rounds (one step per configuration)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    ap.add_argument(
        "--methods", nargs="+", default=list(DEFAULT_METHODS),
        help="method specs (OvalConfig.from_spec); 'full' = the wrapped full cache, the reference",
    )  # fmt: skip
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    if "full" not in args.methods:
        ap.error("--methods must include 'full' (the ratios are against it)")
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    torch.set_num_threads(args.threads)
    model, inputs = build(args)
    caches = {}
    for spec in args.methods:  # each configuration's own prefill and cache
        mm_oval.wrap(model, OvalConfig.from_spec(spec))
        caches[spec] = prefill(model, **inputs)
    token = inputs["input_ids"][:, -1:]
    masks = {spec: inputs["attention_mask"] for spec in args.methods}
    times: dict[str, list[float]] = {spec: [] for spec in args.methods}
    with torch.no_grad():
        for i in range(args.warmup + args.steps):
            for spec, cache in caches.items():
                masks[spec] = torch.cat([masks[spec], masks[spec][:, -1:]], dim=1)
                t0 = time.perf_counter()
                model(input_ids=token, attention_mask=masks[spec], cache=cache, use_cache=True)
                if i >= args.warmup:
                    times[spec].append(time.perf_counter() - t0)
    ref = statistics.median(times["full"])
    n_prompt = int(inputs["input_ids"].shape[1])
    shape = "tiny" if args.small else "LLaVA-1.5-7B width"
    print(
        f"decode step, {shape}, {args.layers} layers, {args.images} images x batch {args.batch} "
        f"({n_prompt} prompt tokens), {args.dtype}, {args.threads} thread(s), median of {args.steps} steps"
    )
    print(f"{'method':<58} {'ms/step':>9} {'vs full':>8} {'read vs dense':>14}")
    rows = []
    for spec in args.methods:
        med = statistics.median(times[spec])
        read = cache_stats(caches[spec]).get("bytes_read", {}).get("read_vs_dense")
        rows.append({"method": spec, "ms_per_step": 1000 * med, "vs_full": med / ref, "read_vs_dense": read,
                     "steps_ms": [1000 * t for t in times[spec]]})  # fmt: skip
        shown = "-" if read is None else f"{read:.3f}x"
        print(f"{spec:<58} {1000 * med:>9.1f} {med / ref:>7.3f}x {shown:>14}")
    if args.out:
        atomic_write_json(
            args.out,
            {"shape": shape, "layers": args.layers, "images": args.images, "batch": args.batch,
             "prompt_tokens": n_prompt, "dtype": args.dtype, "threads": args.threads, "rows": rows},
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
