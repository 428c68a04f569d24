"""`mm-oval eval`: evaluate a (wrapped) LLaVA-style model on one task. Also `accelerate launch -m mm_oval.eval`."""

from __future__ import annotations

import argparse
import json
import logging
import math

from mm_oval.modelfiles import MODEL_HELP, add_load_arguments, load_from_args
from mm_oval.prompts import COMPRESS_AT

from .runner import check_method, evaluate, parse_budget, process_state
from .tasks import TASKS, Task, all_tasks

log = logging.getLogger(__name__)


def positive_int(text: str) -> int:
    """argparse type of a count (--limit, --batch-size, ...): a whole number >= 1, checked before any work."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def budget_value(text: str) -> float | int:
    """argparse type of --budget: a fraction in (0, 1] or a token count >= 1 (the method checks the rest)."""

    try:
        value = parse_budget(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if isinstance(value, float) and not (math.isfinite(value) and 0 < value <= 1):
        raise argparse.ArgumentTypeError(f"a fraction budget is in (0, 1], got {text}")
    if isinstance(value, int) and value < 1:
        raise argparse.ArgumentTypeError(f"a token-count budget is >= 1, got {text}")
    return value


def per_task(tasks: list[Task], text: dict[str, str]) -> str:
    """`text` per task name -> one help line: "VQAv2/TextVQA: a" when the tasks say the same, else "VQAv2: a;
    TextVQA: b" (in registry order)."""
    by_text: dict[str, list[str]] = {}
    for t in tasks:
        if t.name in text:
            by_text.setdefault(text[t.name], []).append(t.title)
    return "; ".join(f"{'/'.join(dict.fromkeys(titles))}: {line}" for line, titles in by_text.items())


def data_option_names() -> list[str]:
    """Every registered task's data options (their `load` keywords), each once, in registry order."""
    return list(dict.fromkeys(o.name for t in all_tasks() for o in t.data_options))


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """--task, --data, each registered task's data options (see `Task.data_options`) and --limit."""
    tasks = all_tasks()
    parser.add_argument("--task", required=True, choices=list(TASKS), help="benchmark")
    bundled = sorted({name for t in tasks for name in t.bundled}, key=lambda n: (len(n), n))
    parser.add_argument(
        "--data",
        required=True,
        help=f"dataset file or folder ({' / '.join(repr(n) for n in bundled)} = the bundled synthetic dev sets "
        f"of the tasks that have them). {per_task(tasks, {t.name: t.data_help for t in tasks})}",
    )
    for name in data_option_names():
        declared = {t.name: o for t in tasks for o in t.data_options if o.name == name}
        flag = next(iter(declared.values())).flag
        parser.add_argument(flag, dest=name, help=per_task(tasks, {k: o.help for k, o in declared.items()}))
    parser.add_argument(
        "--limit",
        type=positive_int,
        help="first N questions only (MMBench: N questions with their rotations)",
    )


def data_options(args: argparse.Namespace) -> dict:
    """The data options given on the command line, for the task's loader (unset ones are None)."""
    return {name: getattr(args, name) for name in data_option_names()}


def add_generation_arguments(parser: argparse.ArgumentParser) -> None:
    """How each item is generated: shared by `eval` and `sweep` (see `generation_options`)."""
    parser.add_argument(
        "--batch-size", type=positive_int, default=1, help="questions per generate call (left padding)"
    )
    default = Task.max_new_tokens
    longer = "; ".join(f"{t.name}: {t.max_new_tokens}" for t in all_tasks() if t.max_new_tokens != default)
    parser.add_argument(
        "--max-new-tokens",
        type=positive_int,
        help=f"default: {default} (short answers)" + (f"; {longer}" if longer else ""),
    )
    parser.add_argument(
        "--multi-turn",
        type=positive_int,
        metavar="K",
        help="K questions per image in one conversation (VQA)",
    )
    parser.add_argument(
        "--compress",
        choices=COMPRESS_AT,
        default="prompt",
        help="compress the cache after the whole prompt (LLaVA's setting) or right after the image, "
        "before the question is read (question-agnostic; the first answer token sees the compressed cache)",
    )
    add_load_arguments(parser, device=False)  # each process of a launch takes its own GPU
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def generation_options(args: argparse.Namespace) -> dict:
    """The keyword arguments of `evaluate` (and `run_sweep`) that the shared command-line options set."""
    return {
        "limit": args.limit,
        "batch_size": args.batch_size,
        "max_new_tokens": args.max_new_tokens,
        "multi_turn": args.multi_turn,
        "compress": args.compress,
        "model_name": args.model,
        "progress": not args.no_progress,
        "data_options": data_options(args),
    }


def add_rules_argument(parser: argparse.ArgumentParser) -> None:
    tasks = all_tasks()
    rules = {t.name: ", ".join(f"{r.name} ({r.repository} @ {r.commit[:7]})" for r in t.rules) for t in tasks}
    parser.add_argument(
        "--rules",
        help="scoring rule where the official sources disagree (default: the task's first). "
        + per_task(tasks, rules),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help=MODEL_HELP)
    add_data_arguments(parser)
    parser.add_argument(
        "--method", default="full", help="'full' (plain model) or a method spec 'name[:key=value,...]'"
    )
    parser.add_argument(
        "--budget", type=budget_value, help="KV budget of the method: a fraction (0.25) or a token count (64)"
    )
    add_generation_arguments(parser)
    add_rules_argument(parser)
    parser.add_argument(
        "--out", required=True, help="output directory (resumable: rerun with the same --out)"
    )


def run(args: argparse.Namespace) -> int:
    check_method(args.method, args.budget)  # a typo in the spec is reported before the model loads
    model, processor, load_s = load_from_args(args)
    results = evaluate(
        model,
        processor,
        args.task,
        args.data,
        method=args.method,
        budget=args.budget,
        out_dir=args.out,
        **generation_options(args),
        extra_timings={"model_load_s": load_s},
        rules=args.rules,
    )

    if process_state().is_main_process:
        print_summary(results)
        print(f"results: {args.out}/results.json")
    return 0


def print_summary(results: dict) -> None:
    scores = {k: v for k, v in results["scores"].items() if not isinstance(v, dict)}
    primary = results["primary"]
    shown = "n/a (no ground truth)" if primary is None else f"{primary:.2f}"
    print(f"{results['task']}: {results['primary_metric']} = {shown}")
    print(json.dumps(scores, indent=1))
    print(rule_line(results["scores"]))


def rule_line(scores: dict) -> str:
    """Which rule, from which source revision, produced the numbers."""
    r = scores.get("rules")
    if not r:
        return "rules: not recorded"
    src = r["source"]
    return f"rules: {r['name']} ({src['repository']} @ {src['commit']}, {src['file']})"
