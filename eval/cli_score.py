"""`mm-oval score`: score an existing predictions file (ours or another toolkit's) with the official rules."""

from __future__ import annotations

import argparse

from .cli_eval import add_data_arguments, add_rules_argument, data_options, per_task, print_summary
from .runner import score_file
from .tasks import all_tasks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_data_arguments(parser)
    tasks = all_tasks()
    parser.add_argument(
        "--predictions",
        required=True,
        help="the predictions file. " + per_task(tasks, {t.name: t.predictions_format for t in tasks}),
    )
    add_rules_argument(parser)
    parser.add_argument("--out", help="write the results JSON here (a folder or a .json path)")


def run(args: argparse.Namespace) -> int:
    results = score_file(args.task, args.data, args.predictions, out=args.out, limit=args.limit,
                         data_options=data_options(args), rules=args.rules)  # fmt: skip
    print_summary(results)
    for note in results["scores"].get("undefined", []):
        print(f"undefined: {note}")
    c = results["counts"]
    print(
        f"{c['predictions']} of {c['items']} questions have a prediction ({c['unknown_ids']} unknown ids ignored)"
    )
    return 0
