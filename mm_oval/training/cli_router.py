"""`mm-oval train-router`: distil the hybrid page router of a LLaVA model from its full attention.

mm-oval train-router --out runs/router                       # the bundled tiny LLaVA, zoo train prompts
mm-oval train-router --model llava-hf/llava-1.5-7b-hf --data mmbench_dev.tsv --out runs/router7b
mm-oval train-router --clip-model ViT-B-32 --clip-pretrained /ckpt/open_clip_vit_b32.bin ...
mm-oval train-router --version 2 --base quest --model bundled576 --data zoo576:256 --val zoo576:64 --out runs/r2

`--version 2` trains router v2 (mm_oval.policies.router2): base scorer + zero-initialised correction. Its
captures are kept in --out (capture_train.safetensors, capture_val.safetensors) and the weights are written
after every epoch, so a run stopped part-way resumes with --resume.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import DEFAULT_IMAGE_TILE
from ..errors import ConfigError
from ..files import FolderLock, atomic_write_json
from ..modelfiles import add_load_arguments, load_from_args
from ..policies.router import load_router, save_router
from .router import (
    OpenClipPageEncoder,
    TrainOptions,
    capture_router_data,
    clip_page_init,
    load_prompts,
    new_router,
    pca_page_init,
    train_router,
)

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="model directory or hub id (default: the bundled tiny LLaVA)"
    )
    parser.add_argument(
        "--out", required=True, help="directory for router.safetensors, router.json, history.json"
    )
    parser.add_argument(
        "--data", default="zoo:384", help="zoo:N (generator train split), toy:N, an MMBench .tsv or a .jsonl"
    )
    parser.add_argument(
        "--val", default="zoo:96", help="held-out prompts, same forms (zoo uses another seed)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--prompt-queries", type=int, default=4, help="last prompt positions routed as well")
    parser.add_argument(
        "--image-tile",
        type=int,
        default=DEFAULT_IMAGE_TILE,
        help="image pages: tiles of this side (default: %(default)s, as wrap)",
    )
    parser.add_argument("--text-page-size", type=int, default=16)
    parser.add_argument(
        "--sink-tokens",
        type=int,
        default=4,
        help="first tokens pinned (always read, never a candidate page) while capturing, as the cache the router "
        "will serve pins them (default: %(default)s, as wrap; the bundled-smol sweeps use 3)",
    )
    parser.add_argument(
        "--recent-tokens",
        type=int,
        default=16,
        help="last prompt tokens pinned while capturing (default: %(default)s, as wrap; the sweeps use 0)",
    )
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--gamma", type=float, default=2.0, help="focal loss exponent")
    parser.add_argument("--route-dim", type=int, default=None, help="default: 64 (router), 16 (router v2)")
    parser.add_argument(
        "--init", default=None, help="start from this router directory (e.g. with --lora-only)"
    )
    parser.add_argument("--lora-only", action="store_true", help="train only the output layer's LoRA")
    parser.add_argument(
        "--clip-model", default=None, help="open_clip architecture to initialise page embeddings"
    )
    parser.add_argument("--clip-pretrained", default=None, help="open_clip tag or local checkpoint path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (1 is fastest for tiny models)"
    )
    parser.add_argument("--version", type=int, choices=(1, 2), default=1, help="1: the router; 2: router v2")
    parser.add_argument("--base", choices=("quest", "oval"), default="quest", help="router v2's base scorer")
    parser.add_argument(
        "--base-options",
        default="{}",
        help="router v2: the base scorer's options as JSON, e.g. '{\"rank\": 1}'",
    )
    parser.add_argument("--no-content", action="store_true", help="router v2 without the content term")
    parser.add_argument(
        "--locality",
        action="store_true",
        help="router v2 with the distance-decay term (off: it added nothing)",
    )
    parser.add_argument("--gcn", action="store_true", help="router v2 with the co-read graph (GCN) term")
    parser.add_argument(
        "--objective",
        choices=("focal", "gumbel"),
        default="focal",
        help="router v2: focal loss or Gumbel top-k",
    )
    parser.add_argument(
        "--teacher",
        choices=("mass", "error"),
        default="mass",
        help="router v2: what a page is worth reading: its exact attention mass, or (error) how far its exact "
        "contribution to the output is from the base's mass estimate times its values' plain mean",
    )
    parser.add_argument("--resume", action="store_true", help="router v2: continue the run in --out")
    add_load_arguments(parser, device=False)  # --device above: the router trains where the model is


def run(args: argparse.Namespace) -> int:
    # one run at a time in --out: a second one (here or on another machine sharing the folder) stops at once
    with FolderLock(Path(args.out)):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    for name in ("sink_tokens", "recent_tokens"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.version == 2:
        return run2(args)
    if args.lora_only and not args.init:
        raise ConfigError("--lora-only fine-tunes an existing router: pass --init DIR")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, processor, _ = load_from_args(args, args.model or "bundled")
    encoder = None
    if args.clip_model:
        encoder = OpenClipPageEncoder(args.clip_model, args.clip_pretrained, args.device)
    elif args.clip_pretrained:
        raise ConfigError("--clip-pretrained needs --clip-model (the open_clip architecture name)")
    kw = dict(
        max_new_tokens=args.max_new_tokens,
        prompt_queries=args.prompt_queries,
        image_tile=args.image_tile,
        text_page_size=args.text_page_size,
        sink_tokens=args.sink_tokens,
        recent_tokens=args.recent_tokens,
        keep_tiles=encoder is not None,
    )
    train_prompts = load_prompts(args.data, seed=args.seed + 1000)
    val_prompts = load_prompts(args.val, seed=args.seed + 2000) if args.val else []
    log.info("capturing full-attention targets for %d + %d prompts", len(train_prompts), len(val_prompts))
    train = capture_router_data(model, processor, tqdm(train_prompts, desc="capture train"), **kw)
    val = (
        capture_router_data(model, processor, tqdm(val_prompts, desc="capture val"), **kw)
        if val_prompts
        else []
    )
    if args.init:
        router = load_router(args.init, model)
    else:
        route_dim = encoder.dim if encoder is not None else (args.route_dim or 64)
        router = new_router(model, route_dim=route_dim)
        if encoder is not None:
            clip_page_init(router, train, encoder, f"{args.clip_model}:{args.clip_pretrained}")
        else:
            pca_page_init(router, train)
    bar = tqdm(total=args.epochs, desc="train router")
    history = train_router(
        router,
        train,
        val,
        TrainOptions(
            epochs=args.epochs,
            lr=args.lr,
            batch=args.batch,
            gamma=args.gamma,
            lora_only=args.lora_only,
            seed=args.seed,
        ),
        progress=lambda row: (bar.update(1), bar.set_postfix({k: round(v, 4) for k, v in row.items()})),
    )
    bar.close()
    out = save_router(router, args.out)
    atomic_write_json(Path(out) / "history.json", {"args": vars(args), "history": history})
    if history and "val_router" in history[-1]:
        h = history[-1]
        log.info(
            "held-out share of candidate attention mass at read budget 25%%: router %.3f, oracle %.3f, random %.3f",
            h["val_router"],
            h["val_oracle"],
            h["val_random"],
        )
    log.info("router written to %s", out)
    return 0


def check_capture_options(path: Path, options: dict) -> None:
    """Refuse to reuse a capture made with other options (another model, data, base scorer, page layout or
    pinned tokens): its targets would be another setting's, and the router trained on them would be too."""
    from .router import capture_options

    made = capture_options(path)
    if made is None:
        raise ConfigError(
            f"{path} does not record the options it was captured with (an older capture): delete it to "
            "capture again, or train in a new --out"
        )
    differ = sorted(k for k in options.keys() | made.keys() if made.get(k) != options.get(k))
    if differ:
        what = "; ".join(f"{k}: {made.get(k)!r} there, {options.get(k)!r} now" for k in differ)
        raise ConfigError(
            f"{path} was captured with other options ({what}): pass the same options, train in a new --out, "
            "or delete the capture to make it again"
        )


def run2(args: argparse.Namespace) -> int:
    """Router v2: capture (or reuse the captures in --out), train with a checkpoint per epoch, save."""
    import json

    from ..policies.base import make_retrieval
    from ..policies.router2 import CONFIG_FILE, load_router2, save_router2
    from .router import (
        Train2Options,
        capture_router2_data,
        load_router2_capture,
        new_router2,
        pca_page_init2,
        save_router2_capture,
        train_router2,
    )

    if args.clip_model or args.lora_only or args.init:
        raise ConfigError(
            "--version 2 takes no --clip-model, --lora-only or --init (use --resume to continue)"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, processor, _ = load_from_args(args, args.model or "bundled")
    try:
        base_options = json.loads(args.base_options)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"--base-options {args.base_options!r} is not JSON ({e}); e.g. '{{\"rank\": 1}}'"
        ) from e
    if not isinstance(base_options, dict):
        raise ConfigError(f"--base-options must be a JSON object, got {args.base_options!r}")
    base = make_retrieval(args.base, **base_options)
    kw = dict(
        max_new_tokens=args.max_new_tokens,
        prompt_queries=args.prompt_queries,
        image_tile=args.image_tile,
        text_page_size=args.text_page_size,
        sink_tokens=args.sink_tokens,
        recent_tokens=args.recent_tokens,
    )
    if args.teacher != "mass":  # (captures made before the option hold the mass teacher)
        kw["teacher"] = args.teacher
    sets = {}
    for split, spec, seed in (("train", args.data, 1000), ("val", args.val, 2000)):
        path = out / f"capture_{split}.safetensors"
        # what a capture depends on: a reused one must have been made with the same
        options = {
            **kw, "model": args.model or "bundled", "data": spec, "seed": args.seed + seed, "base": args.base,
            "base_options": base_options,
        }  # fmt: skip
        if not spec:
            sets[split] = []
        elif path.is_file():
            check_capture_options(path, options)
            sets[split] = load_router2_capture(path)
            log.info("reusing %d captured %s prompts from %s", len(sets[split]), split, path)
        else:
            prompts = load_prompts(spec, seed=args.seed + seed)
            sets[split] = capture_router2_data(
                model, processor, tqdm(prompts, desc=f"capture {split}"), base, **kw
            )
            save_router2_capture(sets[split], path, options)
    history_path = out / "history.json"
    start, history = 0, []
    if args.resume and (out / CONFIG_FILE).is_file() and history_path.is_file():
        net = load_router2(out, model)
        history = json.loads(history_path.read_text())["history"]
        start = len(history)
        log.info("resuming router v2 training in %s after epoch %d", out, start)
    else:
        net = new_router2(
            model, base=args.base, base_options=base_options, route_dim=args.route_dim or 16, content=not args.no_content,
            locality=args.locality, gcn=args.gcn,
        )  # fmt: skip
        pca_page_init2(net, sets["train"])

    def checkpoint(epoch: int, rows: list) -> None:
        save_router2(net, out)
        atomic_write_json(history_path, {"args": vars(args), "history": history + rows})

    bar = tqdm(total=args.epochs, initial=start, desc="train router2")
    rows = train_router2(
        net,
        sets["train"],
        sets["val"],
        Train2Options(
            epochs=args.epochs,
            lr=args.lr,
            batch=args.batch,
            gamma=args.gamma,
            objective=args.objective,
            seed=args.seed,
        ),
        progress=lambda row: (bar.update(1), bar.set_postfix({k: round(v, 4) for k, v in row.items()})),
        start_epoch=start,
        checkpoint=checkpoint,
    )
    bar.close()
    checkpoint(args.epochs, rows)
    if sets["val"] and rows and not any(r.get("kept") for r in rows):
        log.warning(
            "no epoch beat the starting weights on the held-out prompts: the saved router v2 selects what it "
            "started from (a fresh one: its base scorer; `weights=none` reads no page record)"
        )
    if sets["val"]:  # the weights kept (the held-out best), not the last epoch's
        from .router import evaluate_router2

        h = {
            f"val{int(b * 100)}_{k}": v
            for b in (0.10, 0.25)
            for k, v in evaluate_router2(net, sets["val"], b).items()
        }
        what = "attention mass" if args.teacher == "mass" else "estimate error (the error teacher)"
        log.info(
            "held-out share of candidate %s at 10%% / 25%% of the pages: router2 %.3f / %.3f, "
            "base %.3f / %.3f, oracle %.3f / %.3f", what,
            h["val10_router2"], h["val25_router2"], h["val10_base"], h["val25_base"],
            h["val10_oracle"], h["val25_oracle"],
        )  # fmt: skip
        from .router import fit_min_read_pages

        floor, by_pages = fit_min_read_pages(net, sets["val"])
        net.config.min_read_pages = floor
        save_router2(net, out)
        behind = [r["pages"] for r in by_pages if r["router2"] < r["base"]]
        log.info(
            "held-out reads of 1-%d pages where the correction chooses worse than its base: %s; below %d pages "
            "a step uses the base's choice (min_read_pages)",
            len(by_pages), behind or "none", floor,
        )  # fmt: skip
    log.info("router v2 written to %s", out)
    return 0
