"""`mm-oval train-kvp`: capture traces from a model, train KVP agents on them, report held-out cost.

    mm-oval train-kvp --model bundled --data zoo:train:1500 --heldout-data zoo:heldout:200 --out runs/kvp
    mm-oval train-kvp --model smollm2 --data longtext:train:192:512,1k --compress context --answer greedy \
        --no-queries --pos-table 512 --out runs/kvp-smol

This module parses the options and calls the pipeline, `mm_oval.training.kvp.train`. Every stage resumes:
traces are captured in shards (out/traces/{train,heldout}), training checkpoints to out/checkpoint.pt. The
agents land in out/ (kvp_agents.safetensors + kvp_config.json) and load with
`mm_oval.wrap(model, method="kvp", method_options={"agents": "out"})`.
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ..errors import ConfigError
from ..files import FolderLock
from ..modelfiles import MODEL_HELP, add_load_arguments, load_from_args
from ..policies.kvp_agents import EXTRA_FEATURES
from ..prompts import COMPRESS_AT
from .kvp import KVPTrainConfig, PipelineConfig, format_heldout, train
from .traces import UTILITIES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument(
        "--data",
        required=True,
        help="training prompts: zoo:train[:N] (bundled generator), longtext:train[:N[:LENGTHS]] (the long-context "
        "text tasks from a training seed, LENGTHS a comma list of 512,1k,2k,4k; a plain LM), an MMBench .tsv, "
        "a .jsonl {image, question, answer}",
    )
    p.add_argument(
        "--heldout-data",
        default=None,
        help="held-out prompts (default: zoo:heldout:N / longtext:heldout:N for generated data, else the last "
        "10%% of --data)",
    )
    p.add_argument("--out", required=True, help="output directory (traces, checkpoint, agents, heldout.json)")
    p.add_argument("--samples", type=int, default=None, help="at most this many training prompts")
    p.add_argument("--heldout-samples", type=int, default=200, help="held-out prompts (default 200)")
    p.add_argument(
        "--followups",
        type=int,
        default=None,
        help="later questions per image (zoo data, default 1) or per text context (longtext data, default 0: "
        "one question per context; N > 0: a context of several questions asks its first and N more, each "
        "of the compressed context, and the agents learn to keep what all of them read; --compress context)",
    )
    p.add_argument(
        "--answer",
        choices=["reference", "greedy"],
        default="reference",
        help="future tokens: the reference answer (teacher-forced) or the model's greedy answer",
    )
    p.add_argument(
        "--no-queries",
        action="store_true",
        help="do not store prompt queries (SnapKV / TOVA cannot then be scored on the traces)",
    )
    p.add_argument("--shard-size", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument(
        "--batch", type=int, default=16, help="samples per step (contexts = samples x layers x KV heads)"
    )
    p.add_argument("--rankings", type=int, default=8, help="Plackett-Luce rankings sampled per context (K)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--proj", type=int, default=64, help="key / value projection width (paper: 256)")
    p.add_argument("--hidden", type=int, default=64, help="MLP hidden width (paper: 256)")
    p.add_argument(
        "--features",
        default=",".join(EXTRA_FEATURES),
        help="extra features: any of modality,grid,relpos, or 'none' (the paper's agent)",
    )
    p.add_argument("--shared", action="store_true", help="one agent shared by every (layer, head) (ablation)")
    p.add_argument(
        "--joint-heads",
        action="store_true",
        help="rank the tokens of all KV heads of a layer together in training (scores comparable across heads)",
    )
    p.add_argument(
        "--compress",
        choices=COMPRESS_AT,
        default="prompt",
        help="where the traces' prompt ends: after the question (prompt) or right after the image (image: "
        "the question-agnostic setting of `eval --compress image`, the question counts as future); context: "
        "the same for text data, the prompt ends at the context (`eval --compress context`)",
    )
    p.add_argument(
        "--utility",
        choices=UTILITIES,
        default="future",
        help="what the agents learn to keep: the attention the future (question, answer) pays each token "
        "(future, default), KVzip's reconstruction attention (reconstruction: question-agnostic, no future "
        "needed; text data) or both, each normalised per layer and KV head (mixed)",
    )
    p.add_argument(
        "--reconstruction-weight",
        type=float,
        default=1.0,
        help="with --utility mixed: the weight of the reconstruction share against the future's (default 1)",
    )
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--recent", type=int, default=16)
    p.add_argument(
        "--pos-table",
        type=int,
        default=None,
        help="rows of the agents' position table, later positions sharing the last (default: the model's "
        "positions, at most 6000); no longer than the training contexts when longer ones are evaluated",
    )
    p.add_argument(
        "--redundancy",
        type=float,
        default=0.0,
        help="record a redundancy-aware selection with the agents: a token's score is lowered by this much "
        "times its similarity to the tokens already kept (default 0: the agents' own order)",
    )
    p.add_argument(
        "--sigma",
        type=float,
        default=0.0,
        help="with --redundancy: the spatial reach (in image patches) of that similarity (0: keys alone)",
    )
    add_load_arguments(p)


def load(args: argparse.Namespace) -> tuple[Any, Any]:
    """(model, processor) for --model; `smollm2` gives SmolLM2-135M-Instruct and its tokenizer."""
    model, processor, _ = load_from_args(args)
    return model, processor


def parse_features(text: str) -> tuple[str, ...]:
    if text.strip().lower() in ("", "none"):
        return ()
    feats = tuple(f.strip() for f in text.split(",") if f.strip())
    bad = [f for f in feats if f not in EXTRA_FEATURES]
    if bad:
        raise ConfigError(f"--features: unknown {bad}; choose from {list(EXTRA_FEATURES)} or 'none'")
    return feats


def run(args: argparse.Namespace) -> int:
    # one run at a time in --out: a second one (here or on another machine sharing the folder) stops at once
    with FolderLock(Path(args.out)):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    # the options are named as the pipeline's fields, but for the two that need translating
    same = {f.name: getattr(args, f.name) for f in fields(PipelineConfig) if hasattr(args, f.name)}
    same["features"] = parse_features(args.features)
    cfg = PipelineConfig(**same, store_queries=not args.no_queries)
    train_cfg = KVPTrainConfig(
        steps=args.steps, batch_samples=args.batch, rankings=args.rankings, lr=args.lr, seed=args.seed
    )
    model, processor = load(args)
    bars: dict[str, tqdm] = {}

    def progress(stage: str, done: int, total: int, info: dict) -> None:
        bar = bars.get(stage)
        if bar is None:
            for other in bars.values():
                other.close()
            bar = bars[stage] = tqdm(total=total, desc=stage, unit="it", leave=False)
        bar.update(done - bar.n)
        if "reward" in info:
            bar.set_postfix(reward=f"{info['reward']:.4f}")

    try:
        result = train(model, processor, args.out, cfg, train_cfg, progress=progress)
    finally:
        for bar in bars.values():
            bar.close()
    print(format_heldout(result.heldout))
    return 0
