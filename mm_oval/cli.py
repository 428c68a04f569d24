"""The `mm-oval` command. Each subcommand lives with its subsystem and is imported only when used,
so `mm-oval --help` is instant: eval/score/sweep (mm_oval.eval), train-kvp, train-router, zoo, chat, demo."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from .errors import MmOvalError

# subcommand -> (module, function building its parser, one-line help). The module's `add_arguments(parser)`
# adds the options and its `run(args) -> int` runs it.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "mm_oval.demo",
        "evaluate the full cache and KV-cache methods on bundled dev sets (SmolLM2 on text and images by default)",
    ),
    "eval": (
        "mm_oval.eval.cli_eval",
        "evaluate a model (optionally wrapped) on a benchmark task (`mm-oval eval --help` lists them)",
    ),
    "score": ("mm_oval.eval.cli_score", "score an existing predictions file with the official rules"),
    "sweep": ("mm_oval.eval.cli_sweep", "evaluate a grid of methods x budgets; write a table and a plot"),
    "train-kvp": ("mm_oval.training.cli_kvp", "capture traces and train KVP eviction agents"),
    "train-router": ("mm_oval.training.cli_router", "train the hybrid image-text page router"),
    "train-smol": (
        "mm_oval.training.cli_smol",
        "train bundled-smol's projector and LoRA adapter (SmolLM2 as a LLaVA's language model)",
    ),
    "zoo": ("mm_oval.cli_zoo", "generate the bundled benchmark / train the bundled tiny LLaVA"),
    "chat": ("mm_oval.cli_chat", "chat about an image with a (wrapped) model"),
}


# commands whose work survives an interruption (per-item predictions in --out): Ctrl-C says how to go on
RESUMABLE = ("eval", "sweep")


def interrupted_message(prog: str, command: str) -> str:
    """The one line printed for Ctrl-C (exit status 130), instead of a traceback."""
    if command in RESUMABLE:
        return (
            f"{prog}: interrupted; the finished predictions are kept in --out: resume with the same command"
        )
    return f"{prog}: interrupted"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mm-oval", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_module, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = build_parser()
    # only the subcommand's module knows its options: parse the first positional, then delegate
    known, rest = top.parse_known_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if known.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    module_name, help_text = SUBCOMMANDS[known.command]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"mm-oval {known.command}", description=help_text)
    module.add_arguments(parser)
    args = parser.parse_args(rest)

    try:
        return int(module.run(args) or 0)
    except MmOvalError as e:
        print(f"mm-oval {known.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(interrupted_message(f"mm-oval {known.command}", known.command), file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
