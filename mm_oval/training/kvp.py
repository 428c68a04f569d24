"""Offline RL training of the KVP agents (REINFORCE with a leave-one-out baseline).

A context is one (sample, layer, KV head): the prompt's eligible tokens (all but the always-kept sinks
and recent window) with their future utility u. The agent's scores define a Plackett-Luce distribution
over rankings; K rankings per context are sampled at once by Gumbel-sort. A ranking's reward is budget
free: -(sum_j j * u_sigma(j)) / (same for the optimal ranking), i.e. the area under the evicted-utility
curve over every budget, normalised so the optimal ranking scores exactly -1. The gradient is REINFORCE
with the RLOO baseline (each sample's reward minus the mean of the other K-1), advantages normalised,
no entropy bonus. AdamW with warmup + cosine decay, gradient clipping, EMA weights for inference.
No model runs during training: everything comes from captured traces (mm_oval.training.traces).

`train(model, processor, out, PipelineConfig(...))` is the whole pipeline `mm-oval train-kvp` runs: traces ->
agents -> held-out cost (against the registered attention-free policies and the oracle) -> saved agents.
"""

from __future__ import annotations

import io
import json
import logging
import math
import random
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError, DataError, ResultsError
from ..files import atomic_write_bytes, atomic_write_json, load_checkpoint
from ..geometry import FIXED, family_of, grid_shape
from ..policies.base import PAD, PrefillContext, make_eviction
from ..policies.kvp_agents import EXTRA_FEATURES, KVPAgentConfig, KVPAgents
from ..policies.kvp_features import extra_features
from ..policies.kvp_io import save_agents
from ..policies.kvp_select import RedundancySelection
from ..policies.signature import model_signature
from .traces import (
    capture_traces,
    check_utility,
    load_samples,
    load_traces,
    parse_longtext_spec,
    select_utility,
)

logger = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"
NEG = -1.0e4  # score given to tokens outside the ranking (finite, so Plackett-Luce terms stay finite)


# ----------------------------------------------------------------------------------------------------------
# reward, rankings, RLOO
# ----------------------------------------------------------------------------------------------------------


def ranking_auc(u_ranked: torch.Tensor) -> torch.Tensor:
    """Sum over rank j (1-based) of j * u at that rank: (..., N) -> (...). Lower is better."""
    j = torch.arange(1, u_ranked.shape[-1] + 1, device=u_ranked.device, dtype=u_ranked.dtype)
    return (u_ranked * j).sum(-1)


def ranking_reward(order: torch.Tensor, utility: torch.Tensor) -> torch.Tensor:
    """Budget-free reward of rankings. order (..., N) token indices, best first; utility (..., N) aligned
    with the tokens (0 for tokens outside the ranking). Returns -AUC(order) / AUC(optimal): exactly -1 for
    an optimal ranking, below -1 for worse ones."""
    u_ranked = torch.gather(utility.expand_as(order), -1, order)
    opt = ranking_auc(utility.sort(dim=-1, descending=True).values)
    return -ranking_auc(u_ranked) / opt.clamp(min=1e-12)


def gumbel_rankings(scores: torch.Tensor, k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """K Plackett-Luce samples per row in one shot: argsort(scores + Gumbel) descending. (C, N) -> (C, K, N)."""
    u = torch.rand((scores.shape[0], k, scores.shape[1]), generator=generator, device=scores.device)
    g = -torch.log(-torch.log(u.clamp(1e-10, 1 - 1e-10)))
    return torch.argsort(scores[:, None, :].detach() + g, dim=-1, descending=True)


def plackett_luce_logprob(scores: torch.Tensor, order: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """log P(order) under Plackett-Luce with logits `scores`. scores (C, N); order (C, K, N) with the
    `valid` tokens (C, N) ranked before the others (their scores must be NEG); only valid ranks count."""
    s = torch.gather(scores[:, None, :].expand_as(order), -1, order)  # (C, K, N) scores in rank order
    tail = torch.logcumsumexp(s.flip(-1), dim=-1).flip(-1)  # log sum_{r >= j} exp(s_r)
    m = valid.sum(-1)  # (C,)
    ranks = torch.arange(order.shape[-1], device=order.device)
    counted = ranks[None, None, :] < m[:, None, None]
    return ((s - tail) * counted).sum(-1)


def rloo_loss(
    scores: torch.Tensor,
    utility: torch.Tensor,
    valid: torch.Tensor,
    k: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE with the leave-one-out baseline. scores/utility/valid (C, N). Returns (loss, mean reward of
    the sampled rankings). Contexts with no utility or fewer than 2 valid tokens are skipped."""
    if k < 2:
        raise ConfigError(f"RLOO needs at least 2 sampled rankings per context, got {k}")
    scores = scores.masked_fill(~valid, NEG)
    utility = utility * valid
    keep = (valid.sum(-1) >= 2) & (utility.sum(-1) > 0)
    if not bool(keep.any()):
        return scores.sum() * 0.0, torch.tensor(float("nan"))
    scores, utility, valid = scores[keep], utility[keep], valid[keep]
    order = gumbel_rankings(scores, k, generator)  # (C, K, N)
    with torch.no_grad():
        reward = ranking_reward(order, utility[:, None, :])  # (C, K)
        baseline = (reward.sum(-1, keepdim=True) - reward) / (k - 1)
        adv = reward - baseline
        adv = adv / (adv.std() + 1e-6)
    logp = plackett_luce_logprob(scores, order, valid)
    return -(adv * logp).mean(), reward.mean()


# ----------------------------------------------------------------------------------------------------------
# batches from traces
# ----------------------------------------------------------------------------------------------------------


def eligible_mask(n_valid: torch.Tensor, n_max: int, sinks: int, recent: int) -> torch.Tensor:
    """(B,) prompt lengths -> (B, n_max) bool: tokens the policy decides about (not sinks, not recent)."""
    i = torch.arange(n_max)[None, :]
    n = n_valid[:, None]
    return (i >= sinks) & (i < n - recent) & (i < n)


@dataclass
class TraceBatch:
    keys: torch.Tensor  # (A, B*N, D) A = L * Hkv agents
    values: torch.Tensor
    positions: torch.Tensor  # (B*N,)
    extra: torch.Tensor | None  # (B*N, E)
    utility: torch.Tensor  # (A, B, N)
    eligible: torch.Tensor  # (B, N)
    modality: torch.Tensor  # (B, N)

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.utility.shape  # type: ignore[return-value]


def collate_traces(traces: list[dict], cfg: KVPAgentConfig) -> TraceBatch:
    B = len(traces)
    L, Hkv, _, D = traces[0]["keys"].shape
    if (L, Hkv, D) != (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim):
        raise DataError(
            f"traces have {L} layers x {Hkv} KV heads of dim {D}, the agents {cfg.num_layers} x "
            f"{cfg.num_kv_heads} of dim {cfg.head_dim}: traces and agents belong to different models"
        )
    lens = torch.tensor([t["keys"].shape[2] for t in traces])
    N = int(lens.max())
    keys = torch.zeros(B, L * Hkv, N, D)
    values = torch.zeros(B, L * Hkv, N, D)
    util = torch.zeros(B, L * Hkv, N)
    pos = torch.zeros(B, N, dtype=torch.long)
    mod = torch.full((B, N), PAD, dtype=torch.long)
    rc = torch.full((B, N, 3), -1, dtype=torch.long)
    for b, t in enumerate(traces):
        n = t["keys"].shape[2]
        keys[b, :, :n] = t["keys"].reshape(L * Hkv, n, D).float()
        values[b, :, :n] = t["values"].reshape(L * Hkv, n, D).float()
        util[b, :, :n] = t["utility"].reshape(L * Hkv, n).float()
        pos[b, :n] = t["positions"].long()
        mod[b, :n] = t["modality"].long()
        rc[b, :n] = t["image_rc"].long()
    extra = None
    if cfg.extra_width:
        extra = extra_features(pos, mod, rc, cfg.extra_features, cfg.grid_side).reshape(B * N, -1)
    elig = eligible_mask(lens, N, cfg.sinks, cfg.recent)
    return TraceBatch(
        keys=keys.transpose(0, 1).reshape(L * Hkv, B * N, D),
        values=values.transpose(0, 1).reshape(L * Hkv, B * N, D),
        positions=pos.reshape(B * N),
        extra=extra,
        utility=util.transpose(0, 1).contiguous(),
        eligible=elig,
        modality=mod,
    )


def batch_scores(agents: KVPAgents, batch: TraceBatch) -> torch.Tensor:
    """Scores of every agent on its own tokens: (A, B, N)."""
    A, B, N = batch.shape
    ids = torch.arange(A)
    return agents(ids, batch.keys, batch.values, batch.positions, batch.extra).reshape(A, B, N)


def contexts(scores: torch.Tensor, batch: TraceBatch, cfg: KVPAgentConfig) -> tuple[torch.Tensor, ...]:
    """(A, B, N) agent scores -> (scores, utility, valid) per ranking context: one context per (agent,
    sample), or with `joint_heads` one per (layer, sample) over the tokens of all its KV heads."""
    A, B, N = scores.shape
    valid = batch.eligible[None].expand(A, B, N)
    if not cfg.joint_heads:
        return scores.reshape(A * B, N), batch.utility.reshape(A * B, N), valid.reshape(A * B, N)
    L, H = cfg.num_layers, cfg.num_kv_heads

    def joint(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(L, H, B, N).permute(0, 2, 1, 3).reshape(L * B, H * N)

    return joint(scores), joint(batch.utility), joint(valid)


# ----------------------------------------------------------------------------------------------------------
# the trainer
# ----------------------------------------------------------------------------------------------------------


@dataclass
class KVPTrainConfig:
    """The paper's settings (AdamW 5e-5 -> 1e-6 cosine, 100 warmup, clip 5, wd 1e-3, 4000 steps, batch
    128 contexts, EMA 0.99) scaled to small agents and CPU budgets: fewer steps, a larger learning rate."""

    steps: int = 600
    batch_samples: int = 16  # samples per step; contexts per step = batch_samples * layers * kv_heads
    rankings: int = 8  # K Plackett-Luce samples per context
    lr: float = 1e-3
    lr_min: float = 1e-5
    warmup: int = 50
    clip: float = 5.0
    weight_decay: float = 1e-3
    ema: float = 0.99
    seed: int = 0
    checkpoint_every: int = 100

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_samples < 1:
            raise ConfigError("train-kvp: --steps and --batch must be at least 1")
        if not 0.0 <= self.ema < 1.0:
            raise ConfigError(f"train-kvp: EMA decay must be in [0, 1), got {self.ema}")

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        t = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr_min + 0.5 * (self.lr - self.lr_min) * (1 + math.cos(math.pi * min(1.0, t)))


@dataclass
class TrainResult:
    agents: KVPAgents  # the EMA weights
    steps_done: int
    history: list[dict] = field(default_factory=list)


def _ema_update(ema: KVPAgents, model: KVPAgents, decay: float) -> None:
    with torch.no_grad():
        for pe, pm in zip(ema.parameters(), model.parameters()):
            pe.lerp_(pm, 1.0 - decay)


def _save_checkpoint(path: Path, payload: dict) -> None:
    buf = io.BytesIO()
    torch.save(payload, buf)
    atomic_write_bytes(path, buf.getvalue())


def train_agents(
    traces: list[dict],
    agent_cfg: KVPAgentConfig,
    cfg: KVPTrainConfig,
    out_dir: str | Path | None = None,
    progress: Callable[[int, dict], None] | None = None,
) -> TrainResult:
    """Train agents on captured traces. With `out_dir`, a checkpoint is written every
    `checkpoint_every` steps and at the end; calling again with the same settings resumes from it."""
    if not traces:
        raise DataError("train-kvp: no training traces")
    torch.manual_seed(cfg.seed)
    agents = KVPAgents(agent_cfg)
    ema = KVPAgents(agent_cfg)
    ema.load_state_dict(agents.state_dict())
    ema.requires_grad_(False)
    opt = torch.optim.AdamW(agents.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    start, history = 0, []
    ckpt_path = Path(out_dir) / CHECKPOINT if out_dir is not None else None
    settings = {"agent": asdict(agent_cfg), "train": asdict(cfg), "num_traces": len(traces)}
    settings = json.loads(json.dumps(settings))  # tuples -> lists, as stored
    if ckpt_path is not None and ckpt_path.is_file():
        ck = load_checkpoint(ckpt_path, "KVP training checkpoint")
        expected = {"settings", "agents", "ema", "optimizer", "step", "history"}
        if not expected <= set(ck):
            raise DataError(
                f"{ckpt_path} is not a KVP training checkpoint (it lacks {sorted(expected - set(ck))}); "
                "use another --out directory or delete it to start over"
            )
        if ck["settings"] != settings:
            raise ResultsError(
                f"{ckpt_path} belongs to a run with other settings ({ck['settings']}); "
                "use another --out directory or delete the checkpoint to start over"
            )
        agents.load_state_dict(ck["agents"])
        ema.load_state_dict(ck["ema"])
        opt.load_state_dict(ck["optimizer"])
        start, history = int(ck["step"]), list(ck["history"])
        logger.info("resuming KVP training from %s at step %d", ckpt_path, start)

    def checkpoint(step: int) -> None:
        if ckpt_path is None:
            return
        _save_checkpoint(
            ckpt_path,
            {
                "settings": settings,
                "agents": agents.state_dict(),
                "ema": ema.state_dict(),
                "optimizer": opt.state_dict(),
                "step": step,
                "history": history,
            },
        )

    agents.train()
    t0 = time.time()
    for step in range(start, cfg.steps):
        # everything random in a step derives from (seed, step): a resumed run repeats the same batches
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        rng = random.Random(cfg.seed * 1_000_003 + step)
        idx = rng.sample(range(len(traces)), min(cfg.batch_samples, len(traces)))
        batch = collate_traces([traces[i] for i in idx], agent_cfg)
        A, B, N = batch.shape
        scores, util, valid = contexts(batch_scores(agents, batch), batch, agent_cfg)
        loss, reward = rloo_loss(scores, util, valid, cfg.rankings, g)
        for group in opt.param_groups:
            group["lr"] = cfg.lr_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(agents.parameters(), cfg.clip)
        opt.step()
        _ema_update(ema, agents, min(cfg.ema, (1 + step) / (10 + step)))
        rec = {"step": step + 1, "reward": float(reward), "grad_norm": float(gnorm), "lr": cfg.lr_at(step)}
        history.append(rec)
        if progress:
            progress(step + 1, rec)
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            checkpoint(step + 1)
    logger.info("KVP training: %d steps in %.1f s", cfg.steps - start, time.time() - t0)
    ema.eval()
    return TrainResult(ema, cfg.steps, history)


# ----------------------------------------------------------------------------------------------------------
# held-out evaluation
# ----------------------------------------------------------------------------------------------------------

Scorer = Callable[[dict, int], torch.Tensor]  # (trace, layer) -> (Hkv, n) scores, higher = keep


def trace_context(trace: dict, layer: int) -> PrefillContext:
    """A B=1 PrefillContext of one captured layer, as the cache would hand it to a policy."""
    keys = trace["keys"][layer][None].float()
    q = trace.get("queries")
    return PrefillContext(
        layer_idx=layer,
        keys=keys,
        values=trace["values"][layer][None].float(),
        queries=q[layer][None].float() if q is not None else None,
        positions=trace["positions"][None].long(),
        modality=trace["modality"][None].long(),
        image_rc=trace["image_rc"][None].long(),
        scaling=keys.shape[-1] ** -0.5,
    )


def agent_scorer(agents: KVPAgents) -> Scorer:
    def score(trace: dict, layer: int) -> torch.Tensor:
        ctx = trace_context(trace, layer)
        with torch.no_grad():
            return agents.score_layer(layer, ctx.keys, ctx.values, ctx.positions, ctx.modality, ctx.image_rc)[
                0
            ]

    return score


def policy_scorer(policy: Any, rope: Any = None) -> Scorer:
    """Any EvictionPolicy (e.g. from EVICTION_REGISTRY) as a scorer on traces. `rope`: the traced model's
    `policies.base.Rope`, for methods that need RoPE at other positions (expected_attention)."""

    request: dict[str, Any] = {"trace": None, "state": None}  # one RequestState per trace: the policy's
    # memory of the trace's request (e.g. KVP's pair kernel) serves its layers, as in the cache

    def score(trace: dict, layer: int) -> torch.Tensor:
        ctx = trace_context(trace, layer)
        ctx.rope = rope
        if request["trace"] is not trace:
            request["trace"], request["state"] = trace, ctx.request
        ctx.request = request["state"]
        if getattr(policy, "needs_queries", False) and ctx.queries is None:
            raise DataError(
                f"{getattr(policy, 'name', policy)} needs queries; capture traces with queries stored"
            )
        with torch.no_grad():
            return policy.score(ctx)[0].float()

    return score


def baseline_scorer(name: str, **options: Any) -> Scorer:
    """A registered eviction policy (`make_eviction(name, **options)`) as a scorer on traces: the baselines
    of the held-out table are the methods `mm_oval.wrap` runs, not copies of them."""
    return policy_scorer(make_eviction(name, **options))


def random_scorer(seed: int = 0) -> Scorer:
    return baseline_scorer("random", seed=seed)


def oracle_scorer(trace: dict, layer: int) -> torch.Tensor:
    """The future utility itself: the best any scorer can do (not a policy: it reads the future)."""
    return trace["utility"][layer].float()


recency_scorer = baseline_scorer("streamingllm")
knorm_scorer = baseline_scorer("knorm")
keydiff_scorer = baseline_scorer("keydiff")


@dataclass
class HeldoutCost:
    """Mean normalised cost (AUC / optimal AUC, 1 = optimal) and, per budget fraction of the eligible
    tokens, the share of utility evicted (%), for all eligible tokens and for image tokens only."""

    cost: float
    cost_image: float
    evicted: dict[float, float]
    evicted_image: dict[float, float]
    evicted_shared_heads: dict[float, float]


def _evicted_share(
    scores: torch.Tensor, u: torch.Tensor, valid: torch.Tensor, frac: float
) -> tuple[float, float]:
    """scores/u/valid (H, n) -> (evicted utility, total utility) keeping top ceil(frac * m) per row."""
    ev, tot = 0.0, 0.0
    for h in range(scores.shape[0]):
        m = int(valid[h].sum())
        if m == 0:
            continue
        s = scores[h][valid[h]]
        uu = u[h][valid[h]]
        keep = math.ceil(frac * m)
        order = torch.argsort(s, descending=True)
        ev += float(uu[order[keep:]].sum())
        tot += float(uu.sum())
    return ev, tot


def _evicted_shared(
    scores: torch.Tensor, u: torch.Tensor, valid: torch.Tensor, frac: float, normalise: bool = True
) -> tuple[float, float]:
    """One ranking over all heads of the layer (per-head log-softmax normalised unless the scores are
    already on one scale), the same total budget as `frac` per head."""
    s = torch.nan_to_num(scores.float(), nan=0.0, posinf=1e9, neginf=-1e9).masked_fill(~valid, float("-inf"))
    if normalise:
        s = s - torch.logsumexp(s, dim=-1, keepdim=True)
    keep = sum(math.ceil(frac * int(m)) for m in valid.sum(-1))  # as many tokens as the uniform budgets
    s, uu = s[valid], u[valid]
    order = torch.argsort(s, descending=True)
    return float(uu[order[keep:]].sum()), float(uu.sum())


def heldout_cost(
    scorer: Scorer,
    traces: list[dict],
    sinks: int,
    recent: int,
    budgets: tuple[float, ...] = (0.1, 0.25, 0.5),
    shared_normalise: bool = True,
) -> HeldoutCost:
    costs, costs_img = [], []
    ev = {b: [0.0, 0.0] for b in budgets}
    ev_img = {b: [0.0, 0.0] for b in budgets}
    ev_sh = {b: [0.0, 0.0] for b in budgets}
    for t in traces:
        L, Hkv, n = t["utility"].shape
        elig = eligible_mask(torch.tensor([n]), n, sinks, recent)[0]
        img = elig & (t["modality"].long() == 1)
        for layer in range(L):
            s = scorer(t, layer).float()
            u = t["utility"][layer].float()
            for mask, out in ((elig, costs), (img, costs_img)):
                if int(mask.sum()) < 2:
                    continue
                sm = s[:, mask]
                um = u[:, mask]
                order = torch.argsort(sm, dim=-1, descending=True)
                r = ranking_reward(order, um)
                ok = um.sum(-1) > 0
                out.extend((-r[ok]).tolist())
            for b in budgets:
                for mask, acc in ((elig, ev), (img, ev_img)):
                    e, tot = _evicted_share(s, u, mask[None].expand(Hkv, n), b)
                    acc[b][0] += e
                    acc[b][1] += tot
                e, tot = _evicted_shared(s, u, elig[None].expand(Hkv, n), b, shared_normalise)
                ev_sh[b][0] += e
                ev_sh[b][1] += tot

    def pct(d: dict) -> dict[float, float]:
        return {b: 100.0 * e / max(tot, 1e-12) for b, (e, tot) in d.items()}

    mean = lambda xs: float(sum(xs) / max(1, len(xs)))  # noqa: E731
    return HeldoutCost(mean(costs), mean(costs_img), pct(ev), pct(ev_img), pct(ev_sh))


# ----------------------------------------------------------------------------------------------------------
# the pipeline: traces -> agents -> held-out cost -> saved agents
# ----------------------------------------------------------------------------------------------------------

HELDOUT_BASELINES = ("random", "streamingllm", "knorm", "keydiff")  # registered, attention-free policies
HELDOUT_BUDGETS = (0.1, 0.25, 0.5)

# (stage, done, total, info): stage is "capture train", "capture heldout" or "train kvp"
Progress = Callable[[str, int, int, dict], None]


@dataclass
class PipelineConfig:
    """What `train` captures and which agents it trains (`KVPTrainConfig` says how)."""

    # zoo:train[:N], longtext:train[:N[:LENGTHS[:KINDS]]] (text, a plain LM), an MMBench .tsv, a .jsonl {image,
    # question, answer} (traces.load_samples)
    data: str
    heldout_data: str | None = None  # default: zoo:/longtext:heldout:N for generated data, else the last 10%
    samples: int | None = None  # at most this many training prompts
    heldout_samples: int = 200
    # later questions per image (zoo data) or per text context (longtext data: every question of a context of
    # several, each asked of the context on its own) whose tokens also read the cache; None: 1 for zoo data,
    # 0 for text (one question per context)
    followups: int | None = None
    answer: str = "reference"  # future tokens: "reference" (teacher-forced) or "greedy"
    store_queries: bool = True
    shard_size: int = 128
    compress: str = "prompt"  # where the traces' prompt ends: "prompt" or "image"
    # what the agents learn to keep (traces.select_utility): the attention the future pays ("future"), KVzip's
    # reconstruction attention ("reconstruction", text only) or both ("mixed")
    utility: str = "future"
    reconstruction_weight: float = 1.0  # with utility "mixed": the reconstruction share's weight
    seed: int = 0
    proj: int = 64
    hidden: int = 64
    features: tuple[str, ...] = EXTRA_FEATURES
    shared: bool = False
    joint_heads: bool = False
    sinks: int = 4
    recent: int = 16
    # rows of the agents' absolute position table (later positions share its last row); None: the model's
    # positions, at most 6000. Positions the traces never reach keep their random initial rows, so contexts
    # longer than the training ones want a table no longer than those
    pos_table: int | None = None
    # the selection recorded beside the agents (policies.kvp_select): it changes no weight, only how the
    # cache turns the agents' scores into kept tokens
    redundancy: float = 0.0
    sigma: float = 0.0


@dataclass
class PipelineResult:
    agents: KVPAgents
    heldout: dict[str, dict]  # method -> asdict(HeldoutCost)
    training: dict[str, Any]  # what save_agents recorded beside the agents


def _split_samples(cfg: PipelineConfig) -> tuple[list, list, str, int]:
    """(training samples, held-out samples, the held-out data's name, followups)."""
    zoo = cfg.data.startswith("zoo")
    text = cfg.data.startswith("longtext")
    if cfg.followups is not None and cfg.followups < 0:
        raise ConfigError(f"followups must be >= 0, got {cfg.followups}")
    if cfg.followups and not (zoo or text):
        raise ConfigError("follow-up questions are generated: --followups takes zoo: or longtext: data")
    fu = cfg.followups if cfg.followups is not None else (1 if zoo else 0)
    if text and fu and cfg.compress != "context":
        raise ConfigError(
            "text follow-ups are the other questions of the context, asked of the compressed context: "
            "--followups with longtext data needs --compress context"
        )
    train = load_samples(cfg.data, limit=cfg.samples, seed=cfg.seed, followups=fu)
    if cfg.heldout_data:
        held = load_samples(cfg.heldout_data, limit=cfg.heldout_samples, seed=cfg.seed, followups=fu)
        return train, held, cfg.heldout_data, fu
    if zoo:
        spec = f"zoo:heldout:{cfg.heldout_samples}"
        return train, load_samples(spec, seed=cfg.seed, followups=fu), spec, fu
    if text:  # the same lengths, the generator's held-out seed
        _, _, lengths, kinds = parse_longtext_spec(cfg.data)
        spec = f"longtext:heldout:{cfg.heldout_samples}:{','.join(lengths)}:{','.join(kinds)}"
        return train, load_samples(spec, seed=cfg.seed, followups=fu), spec, fu
    k = max(1, len(train) // 10)
    return train[:-k], train[-k:], f"{cfg.data} (last {k})", fu


def agent_config(signature: dict, cfg: PipelineConfig, fixed_grid: bool = True) -> KVPAgentConfig:
    """The agents' shape for a model (`model_signature`) and the pipeline's settings. The grid feature's
    side is fixed only where every image has one grid of one size (`fixed_grid`: LLaVA-1.5); otherwise the
    features read each prompt's own grid."""
    return KVPAgentConfig(
        num_layers=signature["num_layers"],
        num_kv_heads=signature["num_kv_heads"],
        head_dim=signature["head_dim"],
        proj=cfg.proj,
        hidden=cfg.hidden,
        pos_table=cfg.pos_table or min(int(signature["max_positions"]), 6000),
        extra_features=tuple(cfg.features),
        shared=cfg.shared,
        joint_heads=cfg.joint_heads,
        grid_side=grid_shape(signature.get("image_seq_length") or 0)[1]
        if fixed_grid and signature.get("image_seq_length")
        else 0,
        sinks=cfg.sinks,
        recent=cfg.recent,
    )


def heldout_table(
    agents: KVPAgents, held: list[dict], seed: int = 0, budgets: tuple[float, ...] = HELDOUT_BUDGETS
) -> dict[str, dict]:
    """The held-out cost of the agents, of the registered attention-free baselines and of the oracle.
    Scores on one scale across heads (the oracle's utility, joint-heads agents) are ranked across heads as
    they are; the others are log-softmax normalised per head first."""
    c = agents.config
    scorers: dict[str, Scorer] = {"kvp": agent_scorer(agents)}
    for name in HELDOUT_BASELINES:
        scorers[name] = baseline_scorer(name, **({"seed": seed} if name == "random" else {}))
    scorers["optimal"] = oracle_scorer
    table = {}
    for name, scorer in scorers.items():
        on_one_scale = name == "optimal" or (name == "kvp" and c.joint_heads)
        hc = heldout_cost(scorer, held, c.sinks, c.recent, budgets, shared_normalise=not on_one_scale)
        table[name] = asdict(hc)
    return table


def format_heldout(table: dict[str, dict], budgets: tuple[float, ...] = HELDOUT_BUDGETS) -> str:
    """The held-out table as `train-kvp` prints it."""
    lines = [
        "held-out normalised cost (1 = optimal) and % of future attention evicted per budget:",
        f"{'method':<14}{'cost':>8}{'cost img':>10}"
        + "".join(f"{'ev@' + str(int(b * 100)) + '%':>9}" for b in budgets),
    ]
    for name, r in table.items():
        ev = r["evicted"]
        lines.append(
            f"{name:<14}{r['cost']:>8.4f}{r['cost_image']:>10.4f}"
            + "".join(f"{ev[b]:>9.2f}" for b in budgets)
        )
    return "\n".join(lines)


def train(
    model: Any,
    processor: Any,
    out_dir: str | Path,
    cfg: PipelineConfig,
    train_cfg: KVPTrainConfig | None = None,
    progress: Progress | None = None,
) -> PipelineResult:
    """The KVP pipeline. Captures training and held-out traces from `model` (out/traces/{train,heldout}),
    trains agents on them (checkpoints in out/checkpoint.pt), scores them and the baselines on the held-out
    traces (out/heldout.json) and saves the agents for the model (out/kvp_agents.safetensors +
    kvp_config.json, loaded by `mm_oval.wrap(model, method="kvp", method_options={"agents": out})`).
    Every stage resumes from what a previous call with the same settings left in `out_dir`."""
    out = Path(out_dir)
    selection = RedundancySelection(cfg.redundancy, cfg.sigma)  # a bad setting fails before any capture
    check_utility(cfg.utility, cfg.reconstruction_weight)  # likewise
    train_cfg = train_cfg if train_cfg is not None else KVPTrainConfig(seed=cfg.seed)
    signature = model_signature(model)
    train_samples, held_samples, held_spec, fu = _split_samples(cfg)
    dirs = {}
    for name, samples, spec in (("train", train_samples, cfg.data), ("heldout", held_samples, held_spec)):
        stage = f"capture {name}"
        dirs[name] = capture_traces(
            model,
            processor,
            samples,
            out / "traces" / name,
            data_spec=f"{spec} followups={fu} seed={cfg.seed}",
            answer=cfg.answer,
            shard_size=cfg.shard_size,
            store_queries=cfg.store_queries,
            progress=(lambda i, n, s=stage: progress(s, i, n, {})) if progress else None,
            compress=cfg.compress,
            reconstruction=cfg.utility != "future",
        )
    w = cfg.reconstruction_weight
    train_traces = [select_utility(t, cfg.utility, w) for t in load_traces([dirs["train"]])]
    held = [select_utility(t, cfg.utility, w) for t in load_traces([dirs["heldout"]])]
    res = train_agents(
        train_traces,
        agent_config(signature, cfg, fixed_grid=family_of(model) == FIXED),
        train_cfg,
        out_dir=out,
        progress=(lambda step, rec: progress("train kvp", step, train_cfg.steps, rec)) if progress else None,
    )
    table = heldout_table(res.agents, held, cfg.seed)
    atomic_write_json(out / "heldout.json", {str(k): v for k, v in table.items()}, indent=1)
    training = {
        "train": asdict(train_cfg),
        "data": cfg.data,
        "heldout_data": held_spec,
        "train_samples": len(train_traces),
        "heldout_samples": len(held),
        "followups": fu,
        "answer": cfg.answer,
        "compress": cfg.compress,
        "utility": cfg.utility,
        "reconstruction_weight": cfg.reconstruction_weight,
        "heldout_cost": {k: v["cost"] for k, v in table.items()},
    }
    save_agents(res.agents, out, signature, training, asdict(selection) if selection.active else None)
    logger.info("agents written to %s", out)
    return PipelineResult(res.agents, table, training)


def __getattr__(name: str) -> Any:
    if name == "TrainConfig":  # the former name, shared with another module's training settings
        warnings.warn(
            f"{__name__}.TrainConfig is now KVPTrainConfig (the KVP agents' training settings)",
            FutureWarning,
            stacklevel=2,
        )
        return KVPTrainConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
