"""What the page summaries hold and what building them costs in peak memory, at LLaVA-1.5-7B's width.

    python benchmarks/bench_memory.py --batch 1            # 7B width, 2 layers, 4 images, bf16, CPU
    python benchmarks/bench_memory.py --batch 4 --out memory.json
    python benchmarks/bench_memory.py --small              # the tiny shapes (seconds; what the tests run)

A random LLaVA whose language model has LLaVA-1.5-7B's layer shape (bench_overhead.LLAVA7B: hidden 4096, 32
heads = 32 KV heads of dim 128, MLP 11008) but `--layers` layers (2), LLaVA-1.5's 576 image tokens per image
(336 px, patch 14; bench_wrap.MID's small vision tower) and `--images` images (4) per prompt, `--batch`
prompts. Each configuration runs `generate(max_new_tokens=2)` (prefill, summaries, one decode step) in its
own process, so one configuration's freed memory is not another's:

Retrieval configurations run at their defaults (4x4 image tiles; Quest's float bounds, compact LOCKS / OVAL
rank 8; the first router and router v2 with random weights of the model's shapes, router v2 over compact
OVAL rank 2 like its default bundled weights) reading `--read-budget` of the pages.

- kv / summaries / method MiB: the cache's allocated bytes after the request (mm_oval.stats: KV storage with
  its decode slots, page summaries, method state such as the kept `inputs_embeds`), and summaries / kv;
- peak MiB: the process's peak resident memory during the request above its resident memory before the
  model was wrapped (Linux: /proc/self/status VmHWM, reset through /proc/self/clear_refs after a warm-up
  request of one image; glibc's mmap threshold is fixed at 64 KiB in the child, so freed tensors leave
  the resident set); `+dense`: that peak less dense's (a peak is a maximum over time: summaries built in
  one layer's attention add to the peak only what they hold when the model's own activations peak);
- build MiB: the most one summary build (`PagedLayer._summarize`: a layer's prompt pages, or pages
  closing at decode) raised the resident memory above where it started, the summaries it made included
  (`output`): what building summaries adds; `/layer kv` divides by one layer's full KV (in the title).

A configuration that would allocate more than `--max-extra-gib` above its starting address space fails in
its own process (the row says so) rather than taking the machine's memory.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_overhead import LLAVA7B
from bench_wrap import MID
from PIL import Image

import mm_oval
from mm_oval.cache import PagedLayer
from mm_oval.config import OvalConfig
from mm_oval.files import atomic_write_json
from mm_oval.stats import get_stats
from mm_oval.zoo.model import TinyLlavaSizes, build_tiny_llava

CONFIGS = ("dense", "snapkv", "quest", "locks", "oval", "router", "router2")
MIB = 2.0**20


def sizes(small: bool, layers: int) -> TinyLlavaSizes:
    if small:
        return TinyLlavaSizes(text_layers=layers)
    s = LLAVA7B
    vision = {
        k: MID[k] for k in ("image_size", "patch_size", "vision_hidden", "vision_layers", "vision_heads")
    }
    return TinyLlavaSizes(**vision, text_hidden=s["hidden"], text_layers=layers, text_heads=s["heads"],
                          text_kv_heads=s["kv_heads"], text_intermediate=s["mlp"], max_positions=4096)  # fmt: skip


def config(name: str, router_dir: str, read_budget: float) -> OvalConfig:
    if name == "dense":
        return OvalConfig()
    if name == "snapkv":
        return OvalConfig(method="snapkv", budget=0.25)
    options = {"weights": router_dir} if name in ("router", "router2") else {}
    return OvalConfig(retrieval=name, retrieval_options=options, read_budget=read_budget)


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The random LLaVA's shape and run options, shared with bench_decode: 7B width (or the tiny model's
    with --small), the batch of prompts of --images images, --layers, --dtype, --threads."""
    ap.add_argument("--small", action="store_true", help="the tiny model's shapes instead of 7B width")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--images", type=int, default=4, help="images per prompt (576 tokens each at 7B width)")
    ap.add_argument("--layers", type=int, default=2, help="language-model layers")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1, help="CPU threads for torch (1 is the most stable)")


def random_prompts(model, processor, n_images: int, batch: int, dtype: torch.dtype):
    """`batch` prompts of `n_images` random images each and one question -> (images, processor inputs)."""
    side = model.config.vision_config.image_size
    g = torch.Generator().manual_seed(0)
    images = [
        [Image.fromarray((torch.rand(side, side, 3, generator=g) * 255).to(torch.uint8).numpy())
         for _ in range(n_images)]
        for _ in range(batch)
    ]  # fmt: skip
    prompt = "USER: " + "<image>\n" * n_images + "what color is the circle ? ASSISTANT:"
    inputs = processor(images=images, text=[prompt] * batch, return_tensors="pt", padding=True)
    inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
    return images, inputs


def _status_mib(key: str) -> float:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{key}:\s+(\d+)", text).group(1)) / 1024.0


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


class _Peaks:
    """The request's peak resident memory and that of each summary build (`PagedLayer._summarize`), from
    the one VmHWM: reset before each build, and folded into the request's running peak before each reset."""

    def __init__(self) -> None:
        self.request = 0.0
        self.build = 0.0  # the most one build call added to the resident memory it started from (MiB)
        self.build_output = 0.0  # the summaries that call added (MiB)

    def fold(self) -> None:
        self.request = max(self.request, _status_mib("VmHWM"))

    def measure_builds(self) -> None:
        real = PagedLayer._summarize
        peaks = self

        def measured(layer: PagedLayer, first: int, stop: int) -> None:
            held = lambda: sum(t.untyped_storage().nbytes() for t in layer.summaries.values()) / MIB  # noqa: E731
            peaks.fold()
            start, before = _status_mib("VmRSS"), held()
            _reset_peak()
            real(layer, first, stop)
            added = _status_mib("VmHWM") - start
            if added > peaks.build:
                peaks.build, peaks.build_output = added, held() - before

        PagedLayer._summarize = measured


def child(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model, processor = build_tiny_llava(seed=0, sizes=sizes(args.small, args.layers))
    model = model.to(dtype=dtype)
    text = model.config.text_config
    if args.child == "router":  # a random router of the model's shapes (no trained one exists for it)
        from mm_oval.policies.router import HybridRouter, RouterConfig, save_router

        shapes = RouterConfig(text.hidden_size, text.num_hidden_layers, text.num_key_value_heads)
        save_router(HybridRouter(shapes), args.router_dir)
    if args.child == "router2":  # random weights over compact OVAL rank 2, as the default bundled ones
        from mm_oval.policies.router2 import save_router2
        from mm_oval.training.router import new_router2

        net = new_router2(model, base="oval", base_options={"rank": 2})
        torch.manual_seed(0)
        with torch.no_grad():  # a fresh router's correction is zero (it would read no record): make it not
            for p in net.parameters():
                p.normal_(0.0, 0.02)
        save_router2(net, args.router_dir)
    before = _status_mib("VmRSS")  # the same for every configuration: the peak is counted from here
    model = mm_oval.wrap(model, config(args.child, args.router_dir, args.read_budget))
    images, inputs = random_prompts(model, processor, args.images, args.batch, dtype)
    n_prompt = int(inputs["input_ids"].shape[1])
    with torch.no_grad():  # warm-up on one image: what the first call loads is not the request's
        one = processor(images=[images[0][0]], text=["USER: <image>\nhi ASSISTANT:"], return_tensors="pt")
        one["pixel_values"] = one["pixel_values"].to(dtype)
        model.generate(**one, max_new_tokens=2, do_sample=False)
        del one
    space = _status_mib("VmSize")
    limit = int((space + 1024 * args.max_extra_gib) * MIB)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    peaks = _Peaks()
    peaks.measure_builds()
    _reset_peak()
    t0 = time.perf_counter()
    error = None
    try:
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=2, min_new_tokens=2, do_sample=False)
    except (RuntimeError, MemoryError) as e:  # the address-space limit: the allocation that did not fit
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    seconds = time.perf_counter() - t0
    peaks.fold()
    peak = peaks.request - before
    d = text.hidden_size // text.num_attention_heads
    layer_kv = 2 * args.batch * text.num_key_value_heads * n_prompt * d * torch.finfo(dtype).bits // 8
    row = {"config": args.child, "prompt_tokens": n_prompt, "peak_mib": peak, "seconds": seconds,
           "build_peak_mib": peaks.build, "build_output_mib": peaks.build_output, "layer_kv_bytes": layer_kv,
           "error": error}  # fmt: skip
    if error is None:
        s = get_stats(model)
        a = s["allocated_bytes"]
        row.update(kv_bytes=a["kv"], summary_bytes=a["summaries"], method_bytes=a["method_state"])
    return row


def run_child(name: str, args: argparse.Namespace, tmp: str) -> dict:
    out = Path(tmp) / f"{name}.json"
    cmd = [sys.executable, __file__, "--child", name, "--child-out", str(out), "--router-dir",
           str(Path(tmp) / "router"), "--batch", str(args.batch), "--images", str(args.images), "--layers",
           str(args.layers), "--dtype", args.dtype, "--threads", str(args.threads), "--read-budget",
           str(args.read_budget), "--max-extra-gib", str(args.max_extra_gib)] + (["--small"] if args.small else [])  # fmt: skip
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_file():
        tail = (proc.stderr or "").strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        return {"config": name, "error": tail[0][:200]}
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--read-budget", type=float, default=0.25)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--max-extra-gib", type=float, default=12.0,
                    help="address space a configuration may add before its allocations fail")  # fmt: skip
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--router-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        atomic_write_json(args.child_out, child(args))
        return 0
    names = list(dict.fromkeys(["dense", *args.configs]))  # dense is the reference of `+dense`
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_child(name, args, tmp) for name in names]
    dense = next((r for r in rows if r["config"] == "dense" and r.get("error") is None), None)
    ok = [r for r in rows if "peak_mib" in r]
    n, layer_kv = (ok[0]["prompt_tokens"], ok[0]["layer_kv_bytes"]) if ok else (0, 0)
    shape = "tiny shapes" if args.small else "LLaVA-1.5-7B width (random weights)"
    title = (
        f"mm-oval memory at {shape}: {args.layers} layers, {args.images} images, batch {args.batch}, "
        f"{n} prompt tokens, {args.dtype}, CPU; one layer's full KV = {layer_kv / MIB:.1f} MiB"
    )
    print(title)
    print(f"{'config':<8}{'kv MiB':>9}{'summ MiB':>10}{'summ/kv':>9}{'method MiB':>12}{'peak MiB':>10}"
          f"{'+dense':>9}{'/layer kv':>11}{'build MiB':>11}{'(output)':>10}{'/layer kv':>11}{'s':>7}")  # fmt: skip
    for r in rows:
        if r.get("error") is not None and "kv_bytes" not in r:
            print(f"{r['config']:<8} failed: {r['error']}")
            continue
        added = r["peak_mib"] - dense["peak_mib"] if dense else float("nan")
        r["peak_over_dense_mib"] = added
        lkv = layer_kv / MIB
        print(
            f"{r['config']:<8}{r['kv_bytes'] / MIB:>9.1f}{r['summary_bytes'] / MIB:>10.1f}"
            f"{r['summary_bytes'] / r['kv_bytes']:>9.3f}{r['method_bytes'] / MIB:>12.1f}{r['peak_mib']:>10.1f}"
            f"{added:>9.1f}{added / lkv:>11.2f}{r['build_peak_mib']:>11.1f}{r['build_output_mib']:>10.1f}"
            f"{r['build_peak_mib'] / lkv:>11.2f}{r['seconds']:>7.1f}"
        )
    if args.out:
        payload = {"title": title, "batch": args.batch, "images": args.images, "layers": args.layers,
                   "dtype": args.dtype, "small": args.small, "layer_kv_bytes": layer_kv, "rows": rows}  # fmt: skip
        atomic_write_json(args.out, payload, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
