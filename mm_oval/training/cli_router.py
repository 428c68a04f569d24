"""`mm-oval train-router`: distil the hybrid page router of a LLaVA model from its full attention.

mm-oval train-router --out runs/router                       # the bundled tiny LLaVA, zoo train prompts
mm-oval train-router --model llava-hf/llava-1.5-7b-hf --data mmbench_dev.tsv --out runs/router7b
mm-oval train-router --clip-model ViT-B-32 --clip-pretrained /ckpt/open_clip_vit_b32.bin ...
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import ConfigError
from ..files import atomic_write_json
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
    parser.add_argument("--image-tile", type=int, default=2)
    parser.add_argument("--text-page-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--gamma", type=float, default=2.0, help="focal loss exponent")
    parser.add_argument("--route-dim", type=int, default=64)
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
    add_load_arguments(parser, device=False)  # --device above: the router trains where the model is


def run(args: argparse.Namespace) -> int:
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
        route_dim = encoder.dim if encoder is not None else args.route_dim
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
