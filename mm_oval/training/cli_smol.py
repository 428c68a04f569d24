"""`mm-oval train-smol`: train bundled-smol's projector and LoRA adapter (mm_oval.training.smol).

    mm-oval train-smol --out runs/smol                 # until stopped; resumes from runs/smol/checkpoint
    mm-oval train-smol --out runs/smol --steps 2000    # until 2,000 steps in total
    mm-oval train-smol --out runs/smol --minutes 30    # 30 more minutes
    mm-oval train-smol --out runs/smol --check 24      # no training: the held-out check on 24 scenes
    mm-oval train-smol --out runs/check --check 24 --parts bundled   # the same check of bundled-smol's own parts
    mm-oval train-smol --out runs/more --init bundled --seed 1 --mmbench-fraction 0.6   # bundled-smol, trained on
    cp -r runs/smol runs/smol-cool                     # a release: a copy whose learning rates decay to 0
    mm-oval train-smol --out runs/smol-cool --steps 4300 --cooldown 300    # over its last 300 steps

It checkpoints every --checkpoint-every steps (and on exit), logs the learning curve to OUT/log.jsonl (loss per
step; held-out accuracy and answer loss by question type, and on a blank image, every --eval-every steps),
and writes the committable parts to OUT/parts (load them with
`mm_oval.zoo.smol.load_bundled_smol(parts=OUT/parts)`; copy them to mm_oval/zoo/bundled_smol to make them
`bundled-smol`'s). One run at a time holds --out.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import torch

from ..errors import ConfigError
from ..files import FolderLock
from ..modelfiles import default_device
from .smol import SmolTrainConfig, Trainer, format_check

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = SmolTrainConfig()
    p.add_argument(
        "--out", required=True, help="run directory (checkpoint/, log.jsonl, parts/); resumes from it"
    )
    p.add_argument(
        "--steps", type=int, default=None, help="stop at this many steps in total (default: never)"
    )
    p.add_argument("--minutes", type=float, default=None, help="stop after this many minutes of this run")
    p.add_argument("--seed", type=int, default=d.seed, help="data and projector seed (default 0)")
    p.add_argument("--questions", type=int, default=d.questions_per_image, help="questions packed per image")
    p.add_argument("--images-per-step", type=int, default=d.images_per_step)
    p.add_argument(
        "--images-per-forward",
        type=int,
        default=d.images_per_forward,
        help="images padded into one forward (default 1; on a GPU, e.g. all of a step's)",
    )
    p.add_argument("--workers", type=int, default=d.workers, help="data worker processes (default 0: none)")
    p.add_argument("--lr-projector", type=float, default=d.lr_projector)
    p.add_argument("--lr-lora", type=float, default=d.lr_lora)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument(
        "--cooldown",
        type=int,
        default=0,
        metavar="N",
        help="decay the learning rates linearly to 0 over the N steps before --steps (a release made from a copy "
        "of the run directory; default 0: constant)",
    )
    p.add_argument("--no-lora", action="store_true", help="train the projector only")
    p.add_argument(
        "--lm-dtype",
        choices=("auto", "bfloat16", "float32"),
        default=d.lm_dtype,
        help="the frozen language model's dtype (auto: bfloat16 on CUDA, float32 on the CPU)",
    )
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    p.add_argument(
        "--eval-every", type=int, default=d.eval_every, help="held-out check every N steps (0: never)"
    )
    p.add_argument(
        "--eval-images", type=int, default=d.eval_images, help="held-out scenes (8 questions each)"
    )
    p.add_argument(
        "--check",
        type=int,
        default=None,
        metavar="SCENES",
        help="do not train: run the held-out check on this many scenes at the checkpoint in --out (the same "
        "options as its training), print it and write OUT/check-STEP-SCENES.json",
    )
    p.add_argument(
        "--parts",
        default=None,
        metavar="DIR",
        help="with --check: check these trained parts instead of a checkpoint (a train-smol OUT/parts folder, "
        "or 'bundled' for bundled-smol's own); writes OUT/check-parts-SCENES.json",
    )
    p.add_argument(
        "--init",
        default=None,
        metavar="DIR",
        help="start the run from trained parts (a train-smol OUT/parts folder, or 'bundled' for bundled-smol's "
        "own) and train them on; with another --seed it draws scenes they were not trained on",
    )
    p.add_argument(
        "--mmbench-fraction",
        type=float,
        default=d.mmbench_fraction,
        help="share of the questions asked in MMBench form (options, a letter to answer; default %(default)s)",
    )
    p.add_argument(
        "--answer-hint-fraction",
        type=float,
        default=d.answer_hint_fraction,
        help="of the MMBench-form questions, the share whose hint states the answer ('the answer is red .'): "
        "a lesson in option letters apart from the image (default %(default)s)",
    )
    p.add_argument("--device", default=None, help="cuda, cpu (default: the GPU when there is one)")


def run(args: argparse.Namespace) -> int:
    cfg = _config(args)  # bad options are refused before anything is created in --out
    # one run at a time in --out: a second one (here or on another machine sharing the folder) stops at once
    with FolderLock(Path(args.out)):
        return _run(args, cfg)


def _config(args: argparse.Namespace) -> SmolTrainConfig:
    if args.check is not None and args.check < 1:
        raise ConfigError(f"--check takes a number of scenes >= 1, got {args.check}")
    if args.init is not None and args.parts is not None:
        raise ConfigError("--init starts a training run from parts, --parts checks parts: give one of them")
    if args.init is not None:
        from ..zoo.smol import has_trained_parts, parts_folder

        if not has_trained_parts(parts_folder(args.init)):
            raise ConfigError(
                f"--init {args.init}: no trained projector there; give a train-smol OUT/parts folder or 'bundled'"
            )
    if args.parts is not None:
        if args.check is None:
            raise ConfigError("--parts names the trained parts --check checks; add --check SCENES")
        from ..zoo.smol import has_trained_parts
        from .smol import CHECKPOINT, STATE

        folder = _parts_folder(args)
        if not has_trained_parts(folder):
            raise ConfigError(
                f"--parts {args.parts}: no trained projector in {folder}; give a train-smol OUT/parts folder "
                "or 'bundled'"
            )
        if (Path(args.out) / CHECKPOINT / STATE).is_file():
            raise ConfigError(
                f"--parts checks trained parts, but {args.out} holds a training checkpoint that would replace "
                "them; give another --out"
            )
    cfg = SmolTrainConfig(
        seed=args.seed,
        questions_per_image=args.questions,
        images_per_step=args.images_per_step,
        lr_projector=args.lr_projector,
        lr_lora=args.lr_lora,
        warmup_steps=args.warmup_steps,
        cooldown_steps=args.cooldown,
        cooldown_end=args.steps if args.cooldown else None,
        lora=not args.no_lora,
        lm_dtype=args.lm_dtype,
        checkpoint_every=args.checkpoint_every,
        eval_every=args.eval_every,
        eval_images=args.eval_images,
        images_per_forward=args.images_per_forward,
        workers=args.workers,
        mmbench_fraction=args.mmbench_fraction,
        answer_hint_fraction=args.answer_hint_fraction,
        init_parts=args.init,
    )
    cfg.validate()
    return cfg


def _run(args: argparse.Namespace, cfg: SmolTrainConfig) -> int:
    from ..zoo.smol import build_smol_llava

    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
    device = torch.device(args.device) if args.device else default_device()
    model, processor = build_smol_llava(seed=cfg.seed)
    if args.parts is not None:
        _load_parts(model, args)
    model.to(device)
    trainer = Trainer(model, processor, args.out, cfg)
    if args.check is not None:
        res, path = trainer.check(args.check, tag="parts" if args.parts is not None else None)
        if args.parts is not None:
            what = f"the parts in {args.parts}"
        elif trainer.step:
            what = f"step {trainer.step}"
        elif args.init is not None:
            what = f"step 0 (the parts in {args.init}, no checkpoint in {args.out})"
        else:
            what = f"step 0 (no checkpoint in {args.out}: untrained)"
        print(f"train-smol: held-out check at {what}, {args.check} scenes ({res['sec']} s):")
        print(format_check(res))
        print(f"written to {path}")
        return 0
    last = trainer.run(steps=args.steps, minutes=args.minutes)
    print(f"train-smol: step {trainer.step}, last loss {last.get('loss')}; parts in {trainer.export()}")
    return 0


def _parts_folder(args: argparse.Namespace) -> Path:
    from ..zoo.smol import parts_folder

    return parts_folder(args.parts)


def _load_parts(model, args: argparse.Namespace) -> None:
    """The trained parts of --parts, merged into `model`; the trainer's own adapter then starts at zero, so
    the model answers as the parts make it."""
    from ..zoo.smol import load_trained_parts

    load_trained_parts(model, _parts_folder(args), merge=True)
