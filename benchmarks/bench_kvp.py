"""KVP benchmark: held-out normalised cost against the baselines, ablations, head-budget sharing, and the
cost of scoring relative to the prefill it follows. Prints tables; writes a JSON of every figure.

    python benchmarks/bench_kvp.py --model bundled --work runs/kvp_bench \
        --train-traces runs/kvp/traces/train --heldout-traces runs/kvp/traces/heldout

Held-out traces are captured into --work when not given (--heldout zoo:heldout:200). Ablation variants are
trained on --train-traces with the same settings as the committed agents (--ablation-steps) and evaluated on
the same held-out traces; without --train-traces the ablations are skipped.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from mm_oval.files import atomic_write_bytes
from mm_oval.modelfiles import load_model
from mm_oval.policies.base import Rope, make_eviction, topk_mask
from mm_oval.policies.budgets import pyramid_counts, shared_head_keep
from mm_oval.policies.kvp_agents import KVPAgentConfig
from mm_oval.policies.kvp_io import bundled_agents_path, load_agents
from mm_oval.training.kvp import (
    KVPTrainConfig,
    agent_scorer,
    eligible_mask,
    heldout_cost,
    oracle_scorer,
    policy_scorer,
    train_agents,
)
from mm_oval.training.traces import capture_sample, capture_traces, iter_traces, load_samples

log = logging.getLogger("bench_kvp")
BUDGETS = (0.1, 0.25, 0.5)
BASELINES = ("random", "streamingllm", "knorm", "keydiff", "h2o", "tova", "snapkv", "expected_attention")
ATTENTION_FREE = {"kvp", "random", "streamingllm", "knorm", "keydiff"}
ALLOCATORS = ("pyramidkv", "adakv")  # budgets over layers / heads, SnapKV's scores underneath by default


def table(rows: dict[str, dict], title: str, shared: bool = False) -> str:
    head = f"{'method':<26}{'cost':>8}{'cost img':>10}"
    head += "".join(f"{'ev' + str(int(b * 100)):>8}" for b in BUDGETS)
    head += "".join(f"{'img' + str(int(b * 100)):>8}" for b in BUDGETS)
    out = [title, head]
    for name, r in rows.items():
        line = f"{name:<26}{r['cost']:>8.4f}{r['cost_image']:>10.4f}"
        line += "".join(f"{r['evicted'][b]:>8.2f}" for b in BUDGETS)
        line += "".join(f"{r['evicted_image'][b]:>8.2f}" for b in BUDGETS)
        out.append(line)
    return "\n".join(out)


def allocated_cost(policy, scorer, traces: list[dict], sinks: int, recent: int) -> dict:
    """PyramidKV / AdaKV on traces: the per-head ranking is the scorer's (so are `cost` and `cost_image`); the
    share of future attention evicted at each budget follows the policy's allocation (the cache's own
    definitions, `mm_oval.policies.budgets`): per layer the PyramidKV count of ceil(b * decidable tokens),
    the heads' total shared by score with AdaKV's safeguard."""
    row = asdict(heldout_cost(scorer, traces, sinks, recent, BUDGETS))
    alloc = policy.allocation
    acc = {"evicted": {b: [0.0, 0.0] for b in BUDGETS}, "evicted_image": {b: [0.0, 0.0] for b in BUDGETS}}
    for t in traces:
        L, H, n = t["utility"].shape
        elig = eligible_mask(torch.tensor([n]), n, sinks, recent)[0]
        masks = {"evicted": elig, "evicted_image": elig & (t["modality"].long() == 1)}
        for layer in range(L):
            s, u = scorer(t, layer).float(), t["utility"][layer].float()
            for key, mask in masks.items():
                m = int(mask.sum())
                if m == 0:
                    continue
                e = mask[None].expand(H, n)
                for b in BUDGETS:
                    k = torch.tensor([math.ceil(b * m)])
                    if alloc.pyramid_beta is not None:
                        k = pyramid_counts(k, torch.tensor([m]), L, alloc.pyramid_beta)[:, layer]
                    if alloc.share_heads:
                        keep = shared_head_keep(s[None], e[None], k, alloc.alpha_safeguard)[0]
                    else:
                        keep = topk_mask(s, e, k.expand(H))
                    acc[key][b][0] += float((u * (e & ~keep)).sum())
                    acc[key][b][1] += float((u * e).sum())
    for key, d in acc.items():
        row[key] = {b: 100.0 * ev / max(tot, 1e-12) for b, (ev, tot) in d.items()}
    return row


def kvzip_scorer(model, processor, held: list[dict], heldout: str, followups: int):
    """KVzip as a trace scorer: it needs the model (its reconstruction pass), not only a trace's tensors, so
    each held-out trace's sample is found again by its id in `heldout` and its prompt, tokenised as the
    capture tokenised it, goes through KVzip's pre-pass. None (with a warning) when the samples are not found
    or the prompt differs from the trace's."""
    from mm_oval.errors import MmOvalError
    from mm_oval.training.traces import _conversation, _tokenise

    pol = make_eviction("kvzip")
    try:
        pol.bind(model)
        by_id = {
            s.sample_id: s
            for s in load_samples(heldout, followups=followups if heldout.startswith("zoo") else 0)
        }
    except MmOvalError as e:
        log.warning("kvzip skipped: %s", e)
        return None
    scores: dict[str, list[torch.Tensor]] = {}
    for t in held:
        sample = by_id.get(t["sample_id"])
        if sample is None:
            log.warning(
                "kvzip skipped: held-out sample %s is not in %s (pass --heldout)", t["sample_id"], heldout
            )
            return None
        prompt = processor.apply_chat_template(_conversation(sample, None), add_generation_prompt=True)
        inputs = _tokenise(processor, sample, prompt)
        state = pol.prepare_request(
            model, inputs["input_ids"], inputs.get("attention_mask"), inputs.get("pixel_values")
        )
        if state.scores[0].shape[-1] != t["utility"].shape[-1]:
            log.warning("kvzip skipped: sample %s's prompt is not the trace's", t["sample_id"])
            return None
        scores[t["sample_id"]] = [s[0].float() for s in state.scores]
    return lambda trace, layer: scores[trace["sample_id"]][layer]


def scoring_cost(model, processor, agents, samples, reps: int = 5) -> dict:
    """Median wall time of one prefill (the model's forward over the prompt) and of KVP scoring every layer's
    KV heads for that prompt, measured alternately in one run; plus the FLOP ratio of the two."""
    from mm_oval.training.traces import _conversation, _tokenise

    prefill, scoring = [], []
    n_tokens = []
    for s in samples:
        tr = capture_sample(model, processor, s, store_queries=False)
        prompt = processor.apply_chat_template(_conversation(s, None), add_generation_prompt=True)
        inputs = _tokenise(processor, s, prompt)
        L = tr["keys"].shape[0]
        pos = tr["positions"][None].long()
        mod = tr["modality"][None].long()
        rc = tr["image_rc"][None].long()
        keys = [tr["keys"][i][None].float() for i in range(L)]
        vals = [tr["values"][i][None].float() for i in range(L)]
        n_tokens.append(pos.shape[1])
        with torch.no_grad():
            for _ in range(reps):
                t0 = time.perf_counter()
                model(**inputs, use_cache=True)
                t1 = time.perf_counter()
                for i in range(L):
                    agents.score_layer(i, keys[i], vals[i], pos, mod, rc)
                t2 = time.perf_counter()
                prefill.append(t1 - t0)
                scoring.append(t2 - t1)
    c = agents.config
    per_token_agent = 2 * (2 * c.head_dim * c.proj + (2 * c.proj + c.pos_dim) * c.hidden + c.hidden)
    if c.extra_width:
        per_token_agent += 2 * (c.extra_width * c.extra_dim + c.extra_dim * c.hidden)
    kvp_flops = per_token_agent * c.num_layers * c.num_kv_heads
    lm_params = sum(
        p.numel() for n, p in model.named_parameters() if "language_model" in n and "embed" not in n
    )
    model_flops = 2 * lm_params  # per prompt token, language model only (attention over the prompt excluded)
    # the paper-size agent on LLaVA-1.5-7B's shape (32 layers x 32 KV heads, d 128; ~6.5 G non-embedding params)
    big_agent = 2 * (2 * 128 * 256 + (2 * 256 + 32) * 256 + 256)
    big = big_agent * 32 * 32 / (2 * 6.5e9)
    med_p, med_s = statistics.median(prefill), statistics.median(scoring)
    return {
        "prompt_tokens": statistics.median(n_tokens),
        "prefill_ms": 1e3 * med_p,
        "kvp_scoring_ms": 1e3 * med_s,
        "time_ratio": med_s / med_p,
        "kvp_flops_per_token": kvp_flops,
        "lm_flops_per_token": model_flops,
        "flop_ratio": kvp_flops / model_flops,
        "flop_ratio_llava7b_paper_agents": big,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="bundled")
    ap.add_argument("--agents", default=None, help="agents directory (default: the bundled agents)")
    ap.add_argument("--work", default="runs/kvp_bench", help="where captured traces and ablation runs go")
    ap.add_argument(
        "--heldout", default="zoo:heldout:200", help="held-out prompts, when --heldout-traces is not given"
    )
    ap.add_argument("--followups", type=int, default=1)
    ap.add_argument("--heldout-traces", default=None)
    ap.add_argument("--train-traces", default=None, help="train traces for the ablations (skipped without)")
    ap.add_argument("--ablation-steps", type=int, default=None, help="default: the committed agents' steps")
    ap.add_argument("--timing-samples", type=int, default=8)
    ap.add_argument("--out", default="benchmarks/results/kvp.json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)

    loaded = load_agents(args.agents or bundled_agents_path())
    model, processor = load_model(args.model, "cpu")
    from mm_oval.policies.signature import check_signature, model_signature

    check_signature(loaded.model, model_signature(model), loaded.source)
    cfg = loaded.agents.config
    work = Path(args.work)
    if args.heldout_traces:
        held_dir = Path(args.heldout_traces)
    else:
        held_dir = work / "heldout"
        samples = load_samples(
            args.heldout, followups=args.followups if args.heldout.startswith("zoo") else 0
        )
        capture_traces(
            model, processor, samples, held_dir, data_spec=f"{args.heldout} followups={args.followups}"
        )
    held = list(iter_traces(held_dir))
    log.info("%d held-out traces from %s", len(held), held_dir)
    results: dict = {"heldout_traces": str(held_dir), "num_heldout": len(held), "agents": loaded.source}

    # 1. KVP vs the baselines
    kvp_cost = heldout_cost(
        agent_scorer(loaded.agents), held, cfg.sinks, cfg.recent, shared_normalise=not cfg.joint_heads
    )
    rows = {"kvp": asdict(kvp_cost)}
    rope = Rope(model.model.language_model.rotary_emb)  # what the cache hands a method besides the traces
    for name in BASELINES:
        pol = make_eviction(name)
        if pol.needs_queries and "queries" not in held[0]:
            log.warning("%s skipped: the traces hold no queries", name)
            continue
        rows[name] = asdict(heldout_cost(policy_scorer(pol, rope), held, cfg.sinks, cfg.recent))
    kvzip = kvzip_scorer(model, processor, held, args.heldout, args.followups)
    if kvzip is not None:
        rows["kvzip"] = asdict(heldout_cost(kvzip, held, cfg.sinks, cfg.recent))
    for name in ALLOCATORS:
        pol = make_eviction(name)
        if pol.needs_queries and "queries" not in held[0]:
            log.warning("%s skipped: the traces hold no queries", name)
            continue
        rows[name] = allocated_cost(pol, policy_scorer(pol, rope), held, cfg.sinks, cfg.recent)
    rows["optimal"] = asdict(heldout_cost(oracle_scorer, held, cfg.sinks, cfg.recent, shared_normalise=False))
    results["methods"] = rows
    print(
        table(
            rows,
            "held-out normalised cost (AUC / optimal AUC, 1 = optimal) and % of future attention evicted at each "
            "budget (ev: all decidable tokens, img: image tokens only)",
        )
    )
    free = {k: v["cost"] for k, v in rows.items() if k in ATTENTION_FREE}
    print(f"lowest attention-free cost: {min(free, key=free.get)}")

    # 2. uniform vs shared head budget (same total memory per layer)
    print(
        "\nhead budget (% of future attention evicted, all decidable tokens): uniform per head vs shared by a layer's heads"
    )
    print(
        f"{'method':<12}"
        + "".join(f"{'uni' + str(int(b * 100)):>9}{'shared' + str(int(b * 100)):>10}" for b in BUDGETS)
    )
    hb = {}
    for name in ("kvp", "optimal"):
        r = rows[name]
        hb[name] = {"uniform": r["evicted"], "shared": r["evicted_shared_heads"]}
        print(
            f"{name:<12}"
            + "".join(f"{r['evicted'][b]:>9.2f}{r['evicted_shared_heads'][b]:>10.2f}" for b in BUDGETS)
        )
    results["head_budget"] = hb

    # 3. ablations, trained identically on the same traces
    if args.train_traces:
        train = list(iter_traces(args.train_traces))
        tcfg = KVPTrainConfig(
            **{
                k: v
                for k, v in loaded.training.get("train", {}).items()
                if k in KVPTrainConfig.__dataclass_fields__
            }
        )
        if args.ablation_steps:
            tcfg = KVPTrainConfig(**{**asdict(tcfg), "steps": args.ablation_steps})
        base = asdict(cfg)
        variants = {
            "per-head, all features": {},
            "shared agent": {"shared": True},
            "no modality/2-D features": {"extra_features": ("relpos",)},
            "paper agent (no extras)": {"extra_features": ()},
            "joint-heads training": {"joint_heads": not cfg.joint_heads},
        }
        abl = {"kvp (committed agents)": rows["kvp"]}
        for vname, change in variants.items():
            acfg = KVPAgentConfig(**{**base, **change})
            t0 = time.time()
            res = train_agents(train, acfg, tcfg)
            log.info("ablation %r: %d steps in %.0f s", vname, tcfg.steps, time.time() - t0)
            hc = heldout_cost(
                agent_scorer(res.agents), held, cfg.sinks, cfg.recent, shared_normalise=not acfg.joint_heads
            )
            abl[vname] = asdict(hc)
        results["ablations"] = {"train_steps": tcfg.steps, "train_traces": len(train), "rows": abl}
        print()
        print(
            table(
                abl, f"ablations ({tcfg.steps} steps each on {len(train)} train traces, same held-out traces)"
            )
        )
        jname = "kvp, joint-heads trained" if not cfg.joint_heads else "kvp, per-head trained"
        r = abl["joint-heads training"]
        hb[jname] = {"uniform": r["evicted"], "shared": r["evicted_shared_heads"]}
        print(f"\nhead budget for the other training mode ({jname}):")
        print(
            f"{'':<12}"
            + "".join(f"{r['evicted'][b]:>9.2f}{r['evicted_shared_heads'][b]:>10.2f}" for b in BUDGETS)
        )

    # 4. scoring cost vs prefill
    timing_samples = load_samples("zoo:heldout:" + str(args.timing_samples)) if args.timing_samples else []
    if timing_samples:
        sc = scoring_cost(model, processor, loaded.agents, timing_samples)
        results["scoring_cost"] = sc
        print(
            f"\nscoring cost (CPU, 1 thread, {sc['prompt_tokens']:.0f}-token prompts): prefill {sc['prefill_ms']:.2f} ms, "
            f"KVP scoring of all {cfg.num_layers}x{cfg.num_kv_heads} heads {sc['kvp_scoring_ms']:.2f} ms, "
            f"ratio {100 * sc['time_ratio']:.1f}%"
        )
        print(
            f"FLOPs per prompt token: KVP {sc['kvp_flops_per_token']:,} vs language model {sc['lm_flops_per_token']:,} "
            f"({100 * sc['flop_ratio']:.1f}%); paper-size agents on LLaVA-1.5-7B's shape (computed): "
            f"{100 * sc['flop_ratio_llava7b_paper_agents']:.2f}%"
        )
    out = Path(args.out)
    atomic_write_bytes(out, json.dumps(results, indent=1, default=str).encode())
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
