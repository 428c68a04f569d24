"""KVP: learned per-head eviction agents (inference side).

One small agent per (layer, KV head) scores every cached prompt token from its key, its value and its
position; the cache keeps the best-scored tokens. Trained offline with REINFORCE to rank tokens by the
attention they will receive from the answer (see `mm_oval.training.kvp`). Beyond the paper the agents
also see the token's modality and, for image tokens, its (row, col) in the patch grid, plus its
relative place in the prompt.

The parts live beside this policy: the agents module (`kvp_agents`), their extra per-token features
(`kvp_features`), their files and the bundled agents (`kvp_io`), the model signature they are checked
against (`signature`); scoring runs through the `kvp_score` kernel (mm_oval.kernels).

Scores returned to the cache are per-head log-softmax normalised (a token's log share of its head's
Plackett-Luce mass), so they can also be ranked jointly across the heads of a layer (shared head budget).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..allocation import Allocation
from ..errors import ConfigError, ModelError
from .base import EvictionPolicy, PrefillContext, RequestState, register_eviction
from .kvp_agents import KVPAgentConfig, KVPAgents
from .kvp_io import (
    BUNDLED_AGENTS,
    DEFAULT_AGENTS,
    LoadedAgents,
    bundled_agents_path,
    load_agents,
    save_agents,
)
from .kvp_select import RedundancySelection, pair_kernel, redundancy_scores
from .signature import check_signature, model_signature, probe_from_attention, probe_matches

logger = logging.getLogger(__name__)

__all__ = [
    "KVPAgentConfig",
    "KVPAgents",
    "KVPPolicy",
    "LoadedAgents",
    "bundled_agents_path",
    "load_agents",
    "model_signature",
    "save_agents",
]


@dataclass
class KVPState:
    """KVP's memory of one request: per layer, the per-head log-partition of its prefill scores (the scale
    of the scores of tokens arriving later), and the prompt's `pair_kernel` (the same for every layer)."""

    log_partition: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (B, Hkv, 1)
    # (image_rc, modality, pair): the pair kernel and the prompt layout it was computed for
    pairs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


@register_eviction
class KVPPolicy(EvictionPolicy):
    """Learned eviction. `agents`: a directory written by `mm-oval train-kvp` (or a `KVPAgents`); unset, the
    bundled agents trained for the wrapped model (`DEFAULT_AGENTS`: the 64-token tiny LLaVA's "bundled", the
    576-token one's "bundled576-image", SmolLM2's "smollm2-context", bundled-smol's "bundled-smol-image"); or a
    bundled name: "bundled" (the agents trained for the 64-token tiny LLaVA) or "bundled-joint" (its
    joint-heads agents, for `head_budget="shared"`), "bundled-image" / "bundled-image-joint" (the same
    trained for `compress="image"`, the image compressed before the question is read), "bundled576-image"
    (per-head agents for the 576-token tiny LLaVA, `compress="image"`), "smollm2-context" (SmolLM2 on long
    text, `compress="context"`) or "bundled-smol-image" (the LLaVA on SmolLM2, `compress="image"`).
    `redundancy` / `sigma`: the redundancy-aware selection over the agents' scores (`kvp_select`; default: what
    the agents' config records, else off). `model`, when given, is checked against the agents' recorded shape
    and fingerprint at once; otherwise each layer is checked on first use (shape from the keys, fingerprint
    from the layer's k_proj / v_proj).

    `score` returns (B, Hkv, N) scores whose per-head order is the agents' ranking: raw scores of agents
    trained with `joint_heads` (one scale across a layer's heads: a budget shared by the heads, AdaKV or
    `head_budget="shared"`, accepts them), per-head log-softmax normalised otherwise (refused there:
    `comparable_across_heads`). `score_tokens` scores tokens arriving during decode on the same
    scale (normalised by the prefill's per-head log-partition, kept in the request's `KVPState`)."""

    name = "kvp"
    needs_queries = False
    State = KVPState

    @property
    def comparable_across_heads(self) -> bool:  # type: ignore[override]
        """Joint-heads agents were trained on one ranking over a layer's heads; per-head agents rank each
        head on its own, and their log-softmax normalisation does not make two heads' scores one scale."""
        return bool(self.agents.config.joint_heads)

    def __init__(
        self,
        agents: str | Path | KVPAgents | LoadedAgents | None = None,
        model: Any = None,
        check_weights: bool = True,
        redundancy: float | None = None,
        sigma: float | None = None,
        layer_budget: bool = False,
        layerwise: bool = True,
        calibrated: bool = False,
    ):
        if not isinstance(layer_budget, bool):
            raise ConfigError(
                f"kvp: layer_budget must be true (the per-layer budget fitted with the agents) or false (the same "
                f"count in every layer), got {layer_budget!r}"
            )
        if not isinstance(layerwise, bool):
            raise ConfigError(
                f"kvp: layerwise must be true (each layer keeps its own budget) or false (every layer's and "
                f"head's tokens ranked together by the agents' scores), got {layerwise!r}"
            )
        if not isinstance(calibrated, bool):
            raise ConfigError(
                f"kvp: calibrated must be true (the per-head temperatures fitted beside the agents) or false, "
                f"got {calibrated!r}"
            )
        if calibrated and layerwise:
            raise ConfigError(
                "kvp: calibrated=true rescales each head's scores for a ranking across heads and layers; within "
                "one head it changes nothing: give it layerwise=false"
            )
        if layer_budget and not layerwise:
            raise ConfigError(
                "kvp: layer_budget=true (fitted per-layer counts) and layerwise=false (no per-layer counts: "
                "every layer's tokens ranked together) are two divisions of one budget: choose one"
            )
        self.layer_budget, self.layerwise, self.calibrated = layer_budget, layerwise, calibrated
        if isinstance(agents, KVPAgents):
            loaded = LoadedAgents(agents, {}, {}, "<in-memory>")
        elif isinstance(agents, LoadedAgents):
            loaded = agents
        else:
            if agents is None or agents in BUNDLED_AGENTS:
                path = bundled_agents_path(name=agents or DEFAULT_AGENTS[0])
            else:
                path = Path(agents)
            loaded = load_agents(path)
        # no agents named: the bundled agents of the model this policy is bound to (`bind`), if it has some
        self.chosen_by_default = agents is None
        self._overrides = (redundancy, sigma)
        self.check_weights = check_weights
        self._use(loaded)
        self._checked_layers: set[int] = set()
        if model is not None:
            self.bind(model)

    def _use(self, loaded: LoadedAgents) -> None:
        self.loaded = loaded
        self.agents = loaded.agents.eval()
        c = self.agents.config
        self.layer_weights = load_layer_budget(loaded, c.num_layers) if self.layer_budget else None
        self.temperatures = (
            load_temperatures(loaded, c.num_layers, c.num_kv_heads) if self.calibrated else None
        )
        # the agents' recorded selection (kvp_config.json "selection"), each setting overridable
        rec = RedundancySelection.from_dict(loaded.selection, f"{loaded.source} selection")
        redundancy, sigma = self._overrides
        self.selection = RedundancySelection(
            rec.redundancy if redundancy is None else redundancy, rec.sigma if sigma is None else sigma
        )

    @property
    def allocation(self) -> Allocation | None:
        """With `layer_budget`, the agents' per-layer weights (`Allocation.layer_weights`); with
        `layerwise=False`, every layer's and KV head's tokens ranked together by their scores
        (`Allocation.across_layers`); else None (the configuration's allocation)."""
        if not self.layerwise:
            return Allocation(share_heads=True, across_layers=True)
        return None if self.layer_weights is None else Allocation(layer_weights=self.layer_weights)

    def bind(self, model: Any) -> None:
        """Check the agents against `model` at once (shape, and weights unless `check_weights=False`);
        `mm_oval.wrap` calls this. With no agents named, the first of DEFAULT_AGENTS trained for `model`
        is used (SmolLM2, bundled-smol and the 576-token tiny LLaVA each get their own); a model with none of its own is
        refused as before, naming the command that trains agents for it."""
        if self.loaded.model:
            sig = model_signature(model)
            if self.chosen_by_default:
                self._pick_bundled_for(sig)
            check_signature(self.loaded.model, sig, self.loaded.source, check_weights=self.check_weights)
        self._checked_layers = set(range(self.agents.config.num_layers))

    def _pick_bundled_for(self, sig: dict) -> None:
        for name in DEFAULT_AGENTS:
            loaded = load_agents(bundled_agents_path(name=name))
            try:
                check_signature(loaded.model, sig, loaded.source, check_weights=self.check_weights)
            except ModelError:
                continue
            if loaded.source != self.loaded.source:
                logger.info("kvp: no agents named; using the bundled %r, trained for this model", name)
                self._use(loaded)
            return

    def _check_layer(self, ctx: PrefillContext) -> None:
        if ctx.layer_idx in self._checked_layers:
            return
        m = self.loaded.model
        if m:
            B, Hkv, N, D = ctx.keys.shape
            if (Hkv, D) != (m.get("num_kv_heads"), m.get("head_dim")) or ctx.layer_idx >= m.get(
                "num_layers", 0
            ):
                raise ModelError(
                    f"KVP agents {self.loaded.source} were trained for a model with {m.get('num_layers')} layers "
                    f"x {m.get('num_kv_heads')} KV heads of dim {m.get('head_dim')}; this model's layer "
                    f"{ctx.layer_idx} has {Hkv} KV heads of dim {D}. Train agents for it with `mm-oval train-kvp`"
                )
            probe = m.get("probe") or []
            if self.check_weights and ctx.module is not None and ctx.layer_idx < len(probe):
                got = probe_from_attention(ctx.module)
                if got and not probe_matches(probe[ctx.layer_idx], got):
                    raise ModelError(
                        f"KVP agents {self.loaded.source} were trained for model "
                        f"{m.get('name_or_path') or '?'} (fingerprint {m.get('fingerprint')}); layer "
                        f"{ctx.layer_idx} of this model has other weights. Train agents for this model with "
                        "`mm-oval train-kvp --model <model> --data <data> --out <dir>`"
                    )
        self._checked_layers.add(ctx.layer_idx)

    @torch.no_grad()
    def raw_scores(self, ctx: PrefillContext) -> torch.Tensor:
        self._check_layer(ctx)
        agents = self.agents
        if agents.wk.device != ctx.keys.device:
            agents.to(ctx.keys.device)
        raw = agents.score_layer(
            ctx.layer_idx, ctx.keys, ctx.values, ctx.positions, ctx.modality, ctx.image_rc
        )
        return self._tempered(ctx.layer_idx, raw)

    def _tempered(self, layer_idx: int, raw: torch.Tensor) -> torch.Tensor:
        """`calibrated`: each head's raw scores times its fitted temperature (before the per-head
        normalisation), so that their log shares stand for the head's share of the attention to come."""
        if self.temperatures is None:
            return raw
        return raw * self.temperatures[layer_idx].to(raw.device, raw.dtype).view(1, -1, 1)

    @torch.no_grad()
    def score(self, ctx: PrefillContext) -> torch.Tensor:
        raw = self.raw_scores(ctx)
        if not self.agents.config.joint_heads:  # joint-heads scores are already on one scale
            lse = torch.logsumexp(raw, dim=-1, keepdim=True)  # padding is -inf and drops out
            ctx.request.state_of(self).log_partition[ctx.layer_idx] = lse
            raw = raw - lse
        if not self.selection.active:
            return raw
        return redundancy_scores(
            raw, ctx.keys, ctx.modality, ctx.image_rc, self.selection, self._pairs(ctx), ctx.image_keep
        )

    def _pairs(self, ctx: PrefillContext) -> torch.Tensor:
        """The prompt's `pair_kernel`, computed once for the layers of one request (same image layout)."""
        state = ctx.request.state_of(self)
        kept = state.pairs
        if kept is not None and kept[0].shape == ctx.image_rc.shape and kept[0].device == ctx.image_rc.device:
            if torch.equal(kept[0], ctx.image_rc) and torch.equal(kept[1], ctx.modality):
                return kept[2]
        pair = pair_kernel(ctx.modality, ctx.image_rc, self.selection.sigma)
        state.pairs = (ctx.image_rc.clone(), ctx.modality.clone(), pair)
        return pair

    @torch.no_grad()
    def score_tokens(
        self,
        layer_idx: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        modality: torch.Tensor,
        image_rc: torch.Tensor | None = None,
        request: RequestState | None = None,
    ) -> torch.Tensor:
        """Scores of tokens arriving after prefill (decode): keys/values (B, Hkv, T, D), positions and
        modality (B, T) -> (B, Hkv, T), on the scale of that layer's prefill scores when `request` is the
        request's ctx.request. Relative-position features see the new tokens as the prompt's most recent."""
        if image_rc is None:
            image_rc = torch.full((*positions.shape, 3), -1, dtype=torch.long, device=positions.device)
        raw = self._tempered(
            layer_idx, self.agents.score_layer(layer_idx, keys, values, positions, modality, image_rc)
        )
        lse = request.state_of(self).log_partition.get(layer_idx) if request is not None else None
        return raw - lse if lse is not None else raw


LAYER_BUDGET_FILE = "layer_budget.json"
TEMPERATURE_FILE = "temperature.json"


def _fitted_beside(
    loaded: LoadedAgents, name: str, key: str, option: str, script: str, shape: tuple[int, ...]
):
    """The numbers `key` of `<agents dir>/name` (positive, finite, of `shape`) as a float tensor; a clear error
    naming the command that fits them when the file is missing or malformed."""
    path = Path(loaded.source) / name
    how = f"fit it with `python benchmarks/{script} --out {path}`, or leave {option}=false"
    if not path.is_file():
        raise ConfigError(f"kvp: {option}=true needs {path}, fitted for these agents: {how}")
    try:
        data = json.loads(path.read_text())[key]
        t = torch.tensor(data, dtype=torch.float64)
        ok = tuple(t.shape) == shape and bool(torch.isfinite(t).all()) and bool((t > 0).all())
        ok = ok and all(not isinstance(x, bool) for x in _flat(data))  # numbers, not booleans
    except (ValueError, KeyError, TypeError, RuntimeError):
        ok = False
    if not ok:
        what = " x ".join(str(n) for n in shape)
        raise ConfigError(f'kvp: {path} must hold "{key}": {what} positive numbers for these agents: {how}')
    return t


def _flat(data):
    for x in data:
        yield from _flat(x) if isinstance(x, list) else (x,)


def load_layer_budget(loaded: LoadedAgents, num_layers: int) -> tuple[float, ...]:
    """The per-layer weights fitted beside the agents (`<agents dir>/layer_budget.json`, "weights": one
    positive number per layer), for `layer_budget=true`; a clear error when missing or malformed."""
    t = _fitted_beside(
        loaded, LAYER_BUDGET_FILE, "weights", "layer_budget", "kvp_layer_budget.py", (num_layers,)
    )
    return tuple(float(w) for w in t)


def load_temperatures(loaded: LoadedAgents, num_layers: int, num_kv_heads: int) -> torch.Tensor:
    """The per-head temperatures fitted beside the agents (`<agents dir>/temperature.json`, "temperatures": one
    positive number per layer and KV head), for `calibrated=true`; a clear error when missing or malformed."""
    shape = (num_layers, num_kv_heads)
    return _fitted_beside(
        loaded, TEMPERATURE_FILE, "temperatures", "calibrated", "kvp_temperature.py", shape
    ).float()
