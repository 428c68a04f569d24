"""`mm-oval demo`: evaluate the bundled tiny LLaVA on the bundled VQAv2 / POPE / MMBench dev sets through the
evaluation harness, with the full cache and with KV-cache methods at one image-KV budget; print one table.

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
from .eval.tasks import get_task
from .modelfiles import load_model

log = logging.getLogger(__name__)

TASKS = ("vqav2", "pope", "mmbench")
DEFAULT_METHODS = ("snapkv", "kvp", "oval")
# the bundled model has only 64 image tokens: the usual 4 sinks + 16 recent tokens would pin a third of
# them whatever the method; keep the 3 template tokens before the image as sinks and no recent window
METHOD_OPTIONS = "sink_tokens=3,recent_tokens=0"
LABELS = {"vqav2": "VQAv2 acc", "mmbench": "MMBench circular", "pope": "POPE F1", "textvqa": "TextVQA acc"}


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
        "--methods", default=",".join(DEFAULT_METHODS), help="comma-separated methods besides the full cache"
    )
    parser.add_argument(
        "--budget",
        type=_fraction,
        default=0.25,
        help="image-KV budget: share kept (eviction) or read per step (retrieval)",
    )
    parser.add_argument(
        "--tasks", default=",".join(TASKS), help="comma-separated tasks (vqav2, pope, mmbench)"
    )
    parser.add_argument(
        "--limit", type=_count(0), default=0, help="first N questions of each dev set (0: all)"
    )
    parser.add_argument("--batch-size", type=_count(1), default=20)
    parser.add_argument("--compress", choices=("image", "prompt"), default="image")
    parser.add_argument(
        "--out", default=None, help="keep predictions and results here (default: a temporary dir)"
    )


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    tasks = [t for t in args.tasks.split(",") if t]
    methods = ["full", *[m for m in args.methods.split(",") if m and m != "full"]]
    for task in tasks:  # every task and method is checked before the model loads and the first runs
        get_task(task)
    for name in methods[1:]:
        check_method(f"{name}:{METHOD_OPTIONS}", args.budget)
    model, processor = load_model("bundled")
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
                    "bundled",
                    method="full" if full else f"{name}:{METHOD_OPTIONS}",
                    budget=None if full else args.budget,
                    limit=args.limit or None,
                    batch_size=args.batch_size,
                    compress=args.compress,
                    out_dir=root / task / name,
                    model_name="bundled",
                )
                table.setdefault(name, {})[task] = float(res["primary"])
    print(format_table(table, tasks))
    print(
        f"\n{time.perf_counter() - t0:.0f} s; bundled tiny LLaVA, "
        f"{f'first {args.limit} questions' if args.limit else 'all questions'} of each dev set; "
        f"methods keep (eviction) or read per step (retrieval) {args.budget:.0%} of the image KV; compress={args.compress}"
    )
    return 0


def format_table(table: dict[str, dict[str, float]], tasks: list[str]) -> str:
    head = "| method | " + " | ".join(LABELS.get(t, t) for t in tasks) + " |"
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
