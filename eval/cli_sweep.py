"""`mm-oval sweep`: evaluate methods x budgets on one task; write a markdown table and a PNG plot."""

from __future__ import annotations

import argparse

from mm_oval.modelfiles import MODEL_HELP, load_from_args

from .cli_eval import add_data_arguments, add_generation_arguments, add_rules_argument, generation_options
from .runner import process_state
from .sweep import check_cells, markdown_table, parse_budgets, parse_methods, run_sweep


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help=MODEL_HELP)
    add_data_arguments(parser)
    parser.add_argument(
        "--methods",
        nargs="+",
        required=True,
        help="method specs: 'snapkv,knorm' or several arguments; a spec with options ('kvp:key=value,...') "
        "is one argument",
    )
    parser.add_argument(
        "--budgets", nargs="+", required=True, help="e.g. 0.1,0.25,0.5 (fractions) or 32,64 (tokens)"
    )
    parser.add_argument("--no-full", action="store_true", help="skip the full-cache reference run")
    add_generation_arguments(parser)
    add_rules_argument(parser)
    parser.add_argument("--out", required=True, help="output directory (each cell resumable)")


def run(args: argparse.Namespace) -> int:
    methods = parse_methods(args.methods)
    budgets = parse_budgets(args.budgets)
    check_cells(None, [(m, b) for m in methods if m != "full" for b in budgets])  # before the model loads
    model, processor, load_s = load_from_args(args)
    summary = run_sweep(
        model,
        processor,
        args.task,
        args.data,
        methods,
        budgets,
        args.out,
        include_full=not args.no_full,
        **generation_options(args),
        extra_timings={"model_load_s": load_s},
        rules=args.rules,
    )
    if process_state().is_main_process:
        print(markdown_table(summary))
        print(f"table: {args.out}/sweep.md  plot: {args.out}/sweep.png")
    return 0
