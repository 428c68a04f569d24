"""`mm-oval demo`: evaluate a bundled tiny LLaVA on its bundled dev sets (VQAv2, POPE, MMBench and, at 576
tokens, the object lists) through the evaluation harness, with the full cache and with KV-cache methods at
one image-KV budget; print one table. `--bench 576` (the default) is the benchmark at LLaVA-1.5's image
geometry (576 image tokens); `--bench 64` the 64-token one the unit tests use.

The setting is question-agnostic (`--compress image`): the image is prefilled and its KV compressed before
the question is read, so every answer token is computed on the compressed cache. (With LLaVA's usual
setting, one-word answers come from the exact prefill and no method can change them.)"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

from .eval.runner import check_method, evaluate
from .eval.tasks import get_task, resolve_data
from .modelfiles import load_model

log = logging.getLogger(__name__)

# per bundled benchmark: model and data names, default tasks and methods
BENCHES = {
    "576": {"model": "bundled576", "data": "bundled576", "tasks": ("vqav2", "pope", "mmbench", "objlist"),
            "methods": ("snapkv", "expected_attention", "kvp:agents=bundled576-image", "oval"), "limit": 24},
    "64": {"model": "bundled", "data": "bundled", "tasks": ("vqav2", "pope", "mmbench"),
           "methods": ("snapkv", "kvp", "oval"), "limit": 0},
}  # fmt: skip
TASKS = BENCHES["576"]["tasks"]
# the 64-token model: the usual 4 sinks + 16 recent tokens would pin a third of its image tokens whatever the
# method; both benchmarks keep the 3 template tokens before the image as sinks and no recent window
METHOD_OPTIONS = "sink_tokens=3,recent_tokens=0"


def _spec(name: str) -> str:
    """A method name, or a name with its own options (`kvp:agents=bundled576-image`), with the demo's
    sink and recent-window options added."""
    return f"{name},{METHOD_OPTIONS}" if ":" in name else f"{name}:{METHOD_OPTIONS}"


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
        choices=tuple(BENCHES),
        default="576",
        help="which bundled benchmark: 576 image tokens (LLaVA-1.5's geometry) or the 64-token one",
    )
    parser.add_argument(
        "--methods",
        default=None,
        help="comma-separated methods besides the full cache (default: "
        + "; ".join(f"--bench {k}: {','.join(v['methods'])}" for k, v in BENCHES.items())
        + ")",
    )
    parser.add_argument(
        "--budget",
        type=_fraction,
        default=0.25,
        help="image-KV budget: share kept (eviction) or read per step (retrieval)",
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
        help="first N questions of each dev set (0: all; default: 24 at 576 tokens, so the demo takes about "
        "70 s on 2 cores, all at 64)",
    )
    parser.add_argument("--batch-size", type=_count(1), default=20)
    parser.add_argument("--compress", choices=("image", "prompt"), default="image")
    parser.add_argument(
        "--out", default=None, help="keep predictions and results here (default: a temporary dir)"
    )


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    bench = BENCHES[args.bench]
    limit = bench["limit"] if args.limit is None else args.limit
    tasks = [t for t in (args.tasks or ",".join(bench["tasks"])).split(",") if t]
    chosen = args.methods if args.methods is not None else ",".join(bench["methods"])
    methods = ["full", *[m for m in chosen.split(",") if m and m != "full"]]
    for task in tasks:  # every task and method is checked before the model loads and the first runs
        resolve_data(bench["data"], get_task(task))  # the task has this benchmark's bundled dev set
    for name in methods[1:]:
        check_method(_spec(name), args.budget)
    model, processor = load_model(bench["model"])
    table: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        for task in tasks:
            for name in methods:
                full = name == "full"
                res = evaluate(
                    model,
                    processor,
                    task,
                    bench["data"],
                    method="full" if full else _spec(name),
                    budget=None if full else args.budget,
                    limit=limit or None,
                    batch_size=args.batch_size,
                    compress=args.compress,
                    out_dir=root / task / name,
                    model_name=bench["model"],
                )
                table.setdefault(name, {})[task] = float(res["primary"])
    print(format_table(table, tasks))
    print(
        f"\n{time.perf_counter() - t0:.0f} s; bundled tiny LLaVA ({args.bench} image tokens), "
        f"{f'first {limit} questions' if limit else 'all questions'} of each dev set; "
        f"methods keep (eviction) or read per step (retrieval) {args.budget:.0%} of the image KV; compress={args.compress}"
    )
    return 0


def format_table(table: dict[str, dict[str, float]], tasks: list[str]) -> str:
    head = "| method | " + " | ".join(get_task(t).metric_label for t in tasks) + " |"
    lines = [head, "|" + "---|" * (len(tasks) + 1)]
    full = table.get("full", {})
    for name, row in table.items():
        cells = []
        for t in tasks:
            v = row.get(t)
            rel = f" ({v / full[t]:.0%} of full)" if name != "full" and v is not None and full.get(t) else ""
            cells.append("-" if v is None else f"{v:.2f}{rel}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
