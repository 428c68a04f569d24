"""`python -m mm_oval.eval ...` / `accelerate launch [--num_processes N] -m mm_oval.eval ...`: the same
options as `mm-oval eval`; each process takes a stride of the items, rank 0 scores."""

from __future__ import annotations

import argparse
import logging
import sys

from mm_oval.cli import interrupted_message
from mm_oval.errors import MmOvalError

from . import cli_eval


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mm_oval.eval", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    cli_eval.add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return cli_eval.run(args)
    except MmOvalError as e:
        print(f"mm_oval.eval: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(interrupted_message("mm_oval.eval", "eval"), file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
