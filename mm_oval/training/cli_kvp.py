"""`mm-oval train-kvp`: capture traces from a model, train KVP agents on them, report held-out cost.

    mm-oval train-kvp --model bundled --data zoo:train:1500 --heldout-data zoo:heldout:200 --out runs/kvp

Every stage resumes: traces are captured in shards (out/traces/{train,heldout}), training checkpoints to
out/checkpoint.pt. The agents land in out/ (kvp_agents.safetensors + kvp_config.json) and load with
`mm_oval.wrap(model, method="kvp", method_options={"agents": "out"})`.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import asdict
from pathlib import Path

from ..errors import ConfigError
from ..files import atomic_write_json
from ..modelfiles import load_model
from ..policies.kvp import EXTRA_FEATURES, KVPAgentConfig, model_signature, save_agents

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", required=True, help="model directory or hub id; 'bundled' = the bundled tiny LLaVA"
    )
    p.add_argument(
        "--data",
        required=True,
        help="training prompts: zoo:train[:N] (bundled generator), an MMBench .tsv, a .jsonl {image, question, answer}",
    )
    p.add_argument(
        "--heldout-data",
        default=None,
        help="held-out prompts (default: zoo:heldout:N for zoo data, else the last 10%% of --data)",
    )
    p.add_argument("--out", required=True, help="output directory (traces, checkpoint, agents, heldout.json)")
    p.add_argument("--samples", type=int, default=None, help="at most this many training prompts")
    p.add_argument("--heldout-samples", type=int, default=200, help="held-out prompts (default 200)")
    p.add_argument(
        "--followups",
        type=int,
        default=1,
        help="zoo data: later questions per image whose tokens also read the cache (default 1)",
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
        choices=("prompt", "image"),
        default="prompt",
        help="where the traces' prompt ends: after the question (prompt) or right after the image (image: "
        "the question-agnostic setting of `eval --compress image`, the question counts as future)",
    )
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--recent", type=int, default=16)
    p.add_argument("--device", default=None, help="device for capture (default: cuda if available)")
    p.add_argument(
        "--allow-pickle-weights",
        action="store_true",
        help="load a model folder that has only pickled *.bin weights (safetensors is expected)",
    )


def parse_features(text: str) -> tuple[str, ...]:
    if text.strip().lower() in ("", "none"):
        return ()
    feats = tuple(f.strip() for f in text.split(",") if f.strip())
    bad = [f for f in feats if f not in EXTRA_FEATURES]
    if bad:
        raise ConfigError(f"--features: unknown {bad}; choose from {list(EXTRA_FEATURES)} or 'none'")
    return feats


def _bar(total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="it", leave=False)


def run(args: argparse.Namespace) -> int:
    from .kvp import (
        TrainConfig,
        agent_scorer,
        heldout_cost,
        keydiff_scorer,
        knorm_scorer,
        oracle_scorer,
        random_scorer,
        recency_scorer,
        train_agents,
    )
    from .traces import capture_traces, load_samples, load_traces

    out = Path(args.out)
    feats = parse_features(args.features)
    train_cfg = TrainConfig(
        steps=args.steps, batch_samples=args.batch, rankings=args.rankings, lr=args.lr, seed=args.seed
    )
    model, processor = load_model(args.model, args.device, allow_pickle_weights=args.allow_pickle_weights)
    sig = model_signature(model)
    fu = args.followups if args.data.startswith("zoo") else 0
    train_samples = load_samples(args.data, limit=args.samples, seed=args.seed, followups=fu)
    if args.heldout_data:
        held_spec = args.heldout_data
        held_samples = load_samples(held_spec, limit=args.heldout_samples, seed=args.seed, followups=fu)
    elif args.data.startswith("zoo"):
        held_spec = f"zoo:heldout:{args.heldout_samples}"
        held_samples = load_samples(held_spec, seed=args.seed, followups=fu)
    else:
        k = max(1, len(train_samples) // 10)
        held_spec = f"{args.data} (last {k})"
        train_samples, held_samples = train_samples[:-k], train_samples[-k:]
    dirs = {}
    for name, samples, spec in (("train", train_samples, args.data), ("heldout", held_samples, held_spec)):
        bar = _bar(len(samples), f"capture {name}")
        d = capture_traces(
            model,
            processor,
            samples,
            out / "traces" / name,
            data_spec=f"{spec} followups={fu} seed={args.seed}",
            answer=args.answer,
            shard_size=args.shard_size,
            store_queries=not args.no_queries,
            progress=lambda i, n, b=bar: b.update(i - b.n),
            compress=args.compress,
        )
        bar.close()
        dirs[name] = d
    del model
    train = load_traces([dirs["train"]])
    held = load_traces([dirs["heldout"]])
    tc = model_signature_cfg = sig
    agent_cfg = KVPAgentConfig(
        num_layers=tc["num_layers"],
        num_kv_heads=tc["num_kv_heads"],
        head_dim=tc["head_dim"],
        proj=args.proj,
        hidden=args.hidden,
        pos_table=min(int(tc["max_positions"]), 6000),
        extra_features=feats,
        shared=args.shared,
        joint_heads=args.joint_heads,
        grid_side=int(round((tc.get("image_seq_length") or 0) ** 0.5)),
        sinks=args.sinks,
        recent=args.recent,
    )
    bar = _bar(train_cfg.steps, "train kvp")
    res = train_agents(
        train,
        agent_cfg,
        train_cfg,
        out_dir=out,
        progress=lambda s, rec: (bar.update(s - bar.n), bar.set_postfix(reward=f"{rec['reward']:.4f}")),
    )
    bar.close()
    methods = {
        "kvp": agent_scorer(res.agents),
        "random": random_scorer(args.seed),
        "streamingllm": recency_scorer,
        "knorm": knorm_scorer,
        "keydiff": keydiff_scorer,
        "optimal": oracle_scorer,
    }
    table = {}
    for name, scorer in methods.items():
        on_one_scale = name == "optimal" or (name == "kvp" and agent_cfg.joint_heads)
        hc = heldout_cost(scorer, held, args.sinks, args.recent, shared_normalise=not on_one_scale)
        table[name] = asdict(hc)
    lines = [
        f"{'method':<14}{'cost':>8}{'cost img':>10}"
        + "".join(f"{'ev@' + str(int(b * 100)) + '%':>9}" for b in (0.1, 0.25, 0.5))
    ]
    for name, r in table.items():
        ev = r["evicted"]
        lines.append(
            f"{name:<14}{r['cost']:>8.4f}{r['cost_image']:>10.4f}"
            + "".join(f"{ev[b]:>9.2f}" for b in (0.1, 0.25, 0.5))
        )
    print("held-out normalised cost (1 = optimal) and % of future attention evicted per budget:")
    print("\n".join(lines))
    atomic_write_json(out / "heldout.json", {str(k): v for k, v in table.items()}, indent=1)
    training = {
        "train": asdict(train_cfg),
        "data": args.data,
        "heldout_data": held_spec,
        "train_samples": len(train),
        "heldout_samples": len(held),
        "followups": fu,
        "answer": args.answer,
        "compress": args.compress,
        "heldout_cost": {k: v["cost"] for k, v in table.items()},
    }
    save_agents(res.agents, out, model_signature_cfg, training)
    logger.info("agents written to %s", out)
    return 0
