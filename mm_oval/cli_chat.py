"""`mm-oval chat`: chat about one or more images with a (wrapped) LLaVA-style model, or about a text with a
plain language model, from the command line.

    mm-oval chat --image scene.png --method snapkv --budget 0.25             # questions from stdin
    mm-oval chat --image scene.png --prompt "what color is the circle ?" --stats
    mm-oval chat --model smollm2 --context report.txt --method kvp --budget 0.25 --prompt "what is the pass key ?"

The conversation is a `mm_oval.chat.Chat`; this module parses the options, runs the REPL (/stats, /reset,
/quit) and prints what the cache kept (`format_stats`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from .chat import Chat
from .config import OvalConfig
from .errors import DataError, MmOvalError
from .eval.runner import parse_budget
from .modelfiles import MODEL_HELP, add_load_arguments, load_from_args
from .prompts import load_image
from .wrapper import wrap


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="bundled",
        help=f"{MODEL_HELP} (default: bundled)",
    )
    parser.add_argument(
        "--image", action="append", default=[], metavar="PATH", help="an image to chat about (repeatable)"
    )
    parser.add_argument(
        "--context",
        metavar="FILE",
        help="a plain language model's context: this UTF-8 text file is prefilled and the cache compressed "
        "before the first question is read (question-agnostic); the questions are turns over it",
    )
    parser.add_argument(
        "--method",
        default="full",
        help="KV-cache method spec, as for mm_oval.wrap: full, snapkv, kvp, 'full:retrieval=oval,read_budget=0.25', ...",
    )
    parser.add_argument(
        "--budget",
        default=None,
        help="KV budget: a fraction like 0.25 or a token count like 16, of the image tokens (a plain language "
        "model: of its prompt, the context with --context)",
    )
    parser.add_argument(
        "--prompt",
        action="append",
        default=[],
        metavar="TEXT",
        help="ask TEXT and exit instead of reading questions from stdin (repeat for several turns)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--stats", action="store_true", help="after each answer, print what the cache kept")
    add_load_arguments(parser)


def format_stats(stats: dict[str, Any]) -> str:
    """A few lines saying what the cache kept (for `mm-oval chat --stats`)."""

    def kib(n: float) -> str:
        return f"{n / 1024:.1f} KiB" if n < 1024**2 else f"{n / 1024**2:.1f} MiB"

    method = stats["method"] + (f" + {stats['retrieval']} retrieval" if stats.get("retrieval") else "")
    frac = stats.get("kv_fraction_kept")
    img = stats.get("image_kv_fraction_kept")
    lines = [
        f"[stats] method {method}, budget {stats['budget']}: prompt KV kept {kib(stats['kv_bytes_kept'])} "
        f"of {kib(stats['kv_bytes_full'])}"
        + (f" ({frac:.1%})" if frac is not None else "")
        + (f"; image KV kept {img:.1%}" if img is not None else "")
    ]
    if stats.get("page_read_fraction") is not None:
        lines.append(
            f"[stats] retrieval read {stats['page_read_fraction']:.1%} of the candidate pages per step"
        )
    lines.append(
        f"[stats] conversation {stats.get('cache_tokens', '?')} tokens, cache holds {stats.get('cache_slots', 0):.0f} "
        f"per KV head; prefill {stats['prefill_s'] * 1000:.0f} ms, decode {stats['decode_s'] * 1000:.0f} ms "
        f"over {stats['decode_steps']} steps"
    )
    images = any(row["image_tokens_full"] for row in stats["layers"])  # none in a text conversation
    for row in stats["layers"]:
        kept = f"text {row['text_tokens_kept']:g}/{row['text_tokens_full']:g}"
        if images:
            kept = f"image tokens kept {row['image_tokens_kept']:g}/{row['image_tokens_full']:g}, {kept}"
        else:
            kept = f"tokens kept: {kept}"
        lines.append(f"[stats] layer {row['layer']}: {kept}, pages {row['pages']:g}")
    return "\n".join(lines)


HELP = "commands: /stats (what the cache kept), /reset (new conversation), /quit"


def read_context(path: str) -> str:
    """The text of a --context file; a DataError naming the file when it is missing, unreadable, not UTF-8
    or empty."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise DataError(f"context file {path} does not exist; pass the path of a UTF-8 text file") from None
    except UnicodeDecodeError as e:
        raise DataError(f"context file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DataError(f"context file {path} cannot be read ({e.strerror})") from None
    if not text.strip():
        raise DataError(f"context file {path} is empty; pass the text the questions are about")
    return text


def run(args: argparse.Namespace, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    """`mm-oval chat`. Ctrl-C while a question is answered drops that turn and keeps the session; Ctrl-C
    anywhere else (at the prompt, while the model loads) ends it with one line and exit status 130."""
    try:
        return _run(args, stdin or sys.stdin, stdout or sys.stdout)
    except KeyboardInterrupt:
        print("\nmm-oval chat: interrupted", file=sys.stderr, flush=True)
        return 130


def _run(args: argparse.Namespace, stdin: TextIO, stdout: TextIO) -> int:
    budget = parse_budget(args.budget)
    config = OvalConfig.from_spec(args.method, budget)  # bad specs fail before the model loads
    images = [load_image(p) for p in args.image]
    context = read_context(args.context) if args.context is not None else None
    model, processor, _ = load_from_args(args)
    wrap(model, config)  # once for the session; the Chat uses this wrap's policies
    chat = Chat(
        model, processor, images=images, context=context, config=config, max_new_tokens=args.max_new_tokens
    )

    def answer(question: str) -> None:
        print(chat.ask(question), file=stdout, flush=True)
        if args.stats:
            print(format_stats(chat.stats()), file=stdout, flush=True)

    if args.prompt:
        for question in args.prompt:
            answer(question)
        return 0
    interactive = stdin.isatty()
    if interactive:
        print(f"chatting with {args.model} ({config.method}); {HELP}", file=stdout)
    while True:
        if interactive:
            print("> ", end="", file=stdout, flush=True)
        line = stdin.readline()
        if not line:
            break
        question = line.strip()
        if not question:
            continue
        if question in ("/quit", "/exit"):
            break
        if question == "/reset":
            chat.reset()
            continue
        if question == "/stats":
            print(format_stats(chat.stats()) if chat.turns else "[stats] nothing asked yet", file=stdout)
            continue
        if question.startswith("/"):
            print(f"unknown command {question}; {HELP}", file=stdout)
            continue
        try:
            answer(question)
        except MmOvalError as e:  # say what went wrong and keep the session (the conversation starts over)
            chat.reset()
            print(f"error: {e} (the conversation starts over)", file=sys.stderr, flush=True)
        except KeyboardInterrupt:
            chat.reset()
            print("\ninterrupted (the conversation starts over)", file=sys.stderr, flush=True)
    return 0
