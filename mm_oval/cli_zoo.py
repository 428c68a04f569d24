"""`mm-oval zoo generate|train|check`: regenerate the bundled dev sets, train the tiny LLaVA, or measure a
checkpoint's grounding (first-answer accuracy with the real and a blank image, attention on the targets)."""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import fields
from pathlib import Path

from .errors import ConfigError
from .files import atomic_write_text
from .modelfiles import load_model
from .zoo import bundled_model_path
from .zoo.check import grounding_report
from .zoo.generate import DevSizes, generate_dev_sets
from .zoo.generate576 import DevSizes as DevSizes576
from .zoo.generate576 import generate_dev_sets576
from .zoo.train import TinyLlavaTrainConfig, train

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="zoo_command", required=True)
    g = sub.add_parser(
        "generate", help="write the synthetic dev sets (MMBench TSV, VQAv2 JSON, POPE JSONL, images)"
    )
    g.add_argument(
        "--out",
        required=True,
        help="output directory (the bundled copies: eval/data/synth, 576: eval/data/synth576)",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--geometry",
        type=int,
        choices=(64, 576),
        default=64,
        help="image tokens: 64 (8x8 cells, eval/data/synth) or 576 (LLaVA-1.5's 24x24, eval/data/synth576)",
    )
    g.add_argument(
        "--vqa-images",
        type=int,
        default=None,
        help="images with one VQA question of each type (default: 60 with 5 types; 576: 40 with 8)",
    )
    g.add_argument(
        "--pope-images",
        type=int,
        default=None,
        help="images with 6 POPE questions each (default 50; 576: 30)",
    )
    g.add_argument(
        "--mmbench-questions",
        type=int,
        default=None,
        help="base MMBench questions, rotations extra (default 150; 576: 48)",
    )
    g.add_argument(
        "--list-images",
        type=int,
        default=None,
        help="576 only: images with the 2 list questions (default 30)",
    )

    t = sub.add_parser(
        "train", help="train the tiny LLaVA from scratch (resumes from OUT/train_state.ckpt.pt)"
    )
    t.add_argument("--out", required=True, help="run directory; the exported model goes to OUT/model")

    for f in fields(TinyLlavaTrainConfig):
        flag = f"--{f.name.replace('_', '-')}"
        if isinstance(f.default, bool):  # --letter-teacher / --no-letter-teacher
            t.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            t.add_argument(flag, type=type(f.default), default=f.default)

    t5 = sub.add_parser(
        "train576",
        help="build the 576-token tiny LLaVA: train its vision tower (resumes), write the projector and "
        "language model in closed form, export to OUT/model",
    )
    t5.add_argument("--out", required=True, help="run directory; the exported model goes to OUT/model")
    t5.add_argument("--vision-steps", type=int, default=3000, help="length of the cosine schedule")
    t5.add_argument("--batch", type=int, default=12)
    t5.add_argument("--seed", type=int, default=0)
    t5.add_argument("--lr", type=float, default=1e-3)
    t5.add_argument(
        "--init-from", default=None, help="another run's vision_state.pt: a new schedule from its tower"
    )
    t5.add_argument("--stop-at", type=int, default=None, help="end after this step (rerun to resume)")
    for name, default in (("shape", 1.0), ("member-shape", 4.0), ("centre", 100.0), ("own", 100.0)):
        t5.add_argument(
            f"--{name}-weight", type=float, default=default, help="vision loss weight (vision576.LossWeights)"
        )

    c = sub.add_parser("check", help="grounding check of a checkpoint (its geometry read from the model)")
    c.add_argument("--model", default=None, help="checkpoint directory (default: the bundled 64-token one)")
    c.add_argument("--data", default=None, help="dev-set folder (default: the bundled one for the model)")
    c.add_argument("--json", default=None, help="also write the figures to this JSON file")


def run(args: argparse.Namespace) -> int:
    if args.zoo_command == "generate":
        given = {
            k: getattr(args, k)
            for k in ("vqa_images", "pope_images", "mmbench_questions", "list_images")
            if getattr(args, k) is not None
        }
        if args.geometry == 576:
            counts = generate_dev_sets576(args.out, seed=args.seed, sizes=DevSizes576(**given))
        else:
            if "list_images" in given:
                raise ConfigError(
                    "--list-images needs --geometry 576 (the 64-token benchmark has no list task)"
                )
            counts = generate_dev_sets(args.out, seed=args.seed, sizes=DevSizes(**given))
        print(json.dumps(counts))
        return 0
    if args.zoo_command == "train":
        cfg = TinyLlavaTrainConfig(**{f.name: getattr(args, f.name) for f in fields(TinyLlavaTrainConfig)})
        path = train(args.out, cfg)
        print(path)
        return 0
    if args.zoo_command == "train576":
        from .zoo.build576 import train576
        from .zoo.vision576 import LossWeights

        for name in ("vision_steps", "batch"):
            if getattr(args, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        if args.init_from is not None and not Path(args.init_from).is_file():
            raise ConfigError(f"--init-from {args.init_from}: no such file (give a run's vision_state.pt)")
        weights = LossWeights(
            args.shape_weight, args.member_shape_weight, args.centre_weight, args.own_weight
        )
        path = train576(
            args.out, vision_steps=args.vision_steps, batch=args.batch, seed=args.seed, lr=args.lr,
            init_from=args.init_from, weights=weights, stop_at=args.stop_at,
        )  # fmt: skip
        print(path)
        return 0
    if args.zoo_command == "check":
        model, processor = load_model(args.model or bundled_model_path(), "cpu", attn_implementation="eager")
        report = grounding_report(model, processor, data_dir=args.data)
        text = json.dumps(report, indent=1)
        print(text)
        if args.json:
            atomic_write_text(args.json, text)
        return 0
    raise ConfigError(f"unknown zoo command {args.zoo_command!r}")
