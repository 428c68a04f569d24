"""The wrap's own overhead: prefill and decode time of the wrapped model vs the plain model, in one run.

    python benchmarks/bench_wrap.py                       # the bundled tiny LLaVA (random one if absent)
    python benchmarks/bench_wrap.py --model DIR --batch 4 --new-tokens 32 --device cuda
    python benchmarks/bench_wrap.py --methods full snapkv:budget=0.25 knorm --out bench_wrap.json
    python benchmarks/bench_wrap.py --shape mid              # LLaVA-1.5's 576 image tokens, a mid-sized LM

Each configuration is timed with `generate(max_new_tokens=1)` (prefill) and
`generate(max_new_tokens=1 + T)`; decode time per token = the difference / T. Configurations are
interleaved within each repeat (so machine load hits them alike) and the median over repeats is kept.
Ratios are against the plain (unwrapped) model measured in the same run.
A second table gives, per wrapped configuration, the memory of its last request (`mm_oval.stats`): the KV
kept as a share of the prompt's, and what the cache and the method hold (allocated: KV storage with its
decode slots, page summaries, slot/page tables, method state) against the plain cache of that request.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from PIL import Image

import mm_oval
from mm_oval.config import OvalConfig
from mm_oval.files import atomic_write_json
from mm_oval.modelfiles import load_model, resolve_model_path
from mm_oval.stats import get_stats
from mm_oval.zoo.model import TinyLlavaSizes, build_tiny_llava

# a random LLaVA of LLaVA-1.5's prompt length (336 px, patch 14: 576 image tokens) and a mid-sized LM
MID = dict(image_size=336, patch_size=14, vision_hidden=256, vision_layers=2, vision_heads=4, text_hidden=1024,
           text_layers=8, text_heads=16, text_kv_heads=8, text_intermediate=2816, max_positions=2048)  # fmt: skip


def load(model_dir: str | None, device: str, dtype: torch.dtype, shape: str = "tiny"):
    if shape == "mid":
        model, processor = build_tiny_llava(seed=0, sizes=TinyLlavaSizes(**MID))
        return model.to(device=device, dtype=dtype), processor, "random LLaVA, 576 image tokens, LM 1024x8"
    try:
        model, processor = load_model(model_dir or "bundled", device, dtype)
    except mm_oval.MmOvalError:
        if model_dir is not None:
            raise
        model, processor = build_tiny_llava(seed=0)  # an install without the bundled checkpoint
        return model.to(device=device, dtype=dtype), processor, "tiny random LLaVA"
    return model, processor, resolve_model_path(model_dir or "bundled")


def make_inputs(processor, batch: int, device: str, image_size: int):
    g = torch.Generator().manual_seed(0)
    images = [
        Image.fromarray((torch.rand(image_size, image_size, 3, generator=g) * 255).to(torch.uint8).numpy())
        for _ in range(batch)
    ]
    questions = ["what color is the circle ?", "how many red objects are there in the picture ?"]
    texts = [f"USER: <image>\n{questions[i % 2]} ASSISTANT:" for i in range(batch)]
    inputs = processor(images=images, text=texts, return_tensors="pt", padding=True)
    return {k: v.to(device) for k, v in inputs.items()}


def timed_generate(model, inputs, n: int) -> float:
    if inputs["input_ids"].is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    if inputs["input_ids"].is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model", default=None, help="a LLaVA checkpoint directory (default: the bundled tiny model)"
    )
    p.add_argument(
        "--shape",
        default="tiny",
        choices=["tiny", "mid"],
        help="without --model: the tiny model "
        "(bundled, else random) or a random mid-sized one with LLaVA-1.5's 576 image tokens",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--methods",
        nargs="+",
        default=["full", "snapkv:budget=1.0", "snapkv:budget=0.25", "knorm:budget=0.25"],
        help="method specs (OvalConfig.from_spec); 'full' = wrapped at budget 1.0",
    )
    p.add_argument("--threads", type=int, default=1, help="CPU threads for torch (1 is the most stable)")
    p.add_argument("--out", default=None, help="write the table as JSON here")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    model, processor, name = load(args.model, args.device, dtype, args.shape)
    image_size = model.config.vision_config.image_size
    inputs = make_inputs(processor, args.batch, args.device, image_size)
    configs = {"plain": None, **{m: OvalConfig.from_spec(m) for m in args.methods}}

    def run(cfg: OvalConfig | None, n: int) -> float:
        if cfg is None:
            mm_oval.unwrap(model)
        else:
            mm_oval.wrap(model, cfg)
        return timed_generate(model, inputs, n)

    for cfg in configs.values():  # warm-up
        run(cfg, 2)
    times: dict[str, dict[str, list[float]]] = {k: {"prefill": [], "decode": []} for k in configs}
    memory: dict[str, dict] = {}
    for _ in range(args.repeats):
        for key, cfg in configs.items():
            t1 = run(cfg, 1)
            tn = run(cfg, 1 + args.new_tokens)
            times[key]["prefill"].append(t1)
            times[key]["decode"].append((tn - t1) / args.new_tokens)
            if cfg is not None:
                s = get_stats(model)
                memory[key] = {
                    "kv_fraction_kept": s["kv_fraction_kept"],
                    "allocated_vs_plain": s["allocated_vs_plain"],
                    "plain_cache_bytes": s["plain_cache_bytes"],
                    "allocated_bytes": s["allocated_bytes"],
                }
    mm_oval.unwrap(model)

    rows = []
    base = {k: statistics.median(times["plain"][k]) for k in ("prefill", "decode")}
    for key in configs:
        pre, dec = (statistics.median(times[key][k]) for k in ("prefill", "decode"))
        rows.append(
            {
                "config": key,
                "prefill_ms": 1e3 * pre,
                "decode_ms_per_token": 1e3 * dec,
                "prefill_ratio": pre / base["prefill"],
                "decode_ratio": dec / base["decode"],
            }
        )
    n_prompt = int(inputs["input_ids"].shape[1])
    print(
        f"model: {name} | device {args.device} {args.dtype} | batch {args.batch} | prompt {n_prompt} tokens | "
        f"{args.new_tokens} new tokens | median of {args.repeats} | torch threads {torch.get_num_threads()}"
    )
    print(f"{'config':<24}{'prefill ms':>12}{'decode ms/tok':>15}{'prefill x':>11}{'decode x':>10}")
    for r in rows:
        print(
            f"{r['config']:<24}{r['prefill_ms']:>12.2f}{r['decode_ms_per_token']:>15.2f}"
            f"{r['prefill_ratio']:>11.2f}{r['decode_ratio']:>10.2f}"
        )
    mib = 2.0**20
    print(f"\nmemory of the last request ({args.new_tokens} new tokens); MiB, x = against the plain cache")
    print(
        f"{'config':<24}{'kept x':>8}{'alloc x':>9}{'plain':>9}{'kv':>9}{'summaries':>11}"
        f"{'metadata':>10}{'method':>9}"
    )
    for key, m in memory.items():
        a = m["allocated_bytes"]
        kept = m["kv_fraction_kept"]
        print(
            f"{key:<24}{kept if kept is not None else float('nan'):>8.3f}{m['allocated_vs_plain']:>9.3f}"
            f"{m['plain_cache_bytes'] / mib:>9.2f}{a['kv'] / mib:>9.2f}{a['summaries'] / mib:>11.2f}"
            f"{a['metadata'] / mib:>10.2f}{a['method_state'] / mib:>9.2f}"
        )
    for r in rows:
        if r["config"] in memory:
            r["memory"] = memory[r["config"]]
    if args.out:
        payload = {
            "model": name,
            "device": args.device,
            "dtype": args.dtype,
            "batch": args.batch,
            "prompt_tokens": n_prompt,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "rows": rows,
        }
        atomic_write_json(args.out, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
