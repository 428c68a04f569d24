"""KVP: learned per-head eviction agents (inference side).

One small agent per (layer, KV head) scores every cached prompt token from its key, its value and its
position; the cache keeps the best-scored tokens. Trained offline with REINFORCE to rank tokens by the
attention they will receive from the answer (see `mm_oval.training.kvp`). Beyond the paper the agents
also see the token's modality and, for image tokens, its (row, col) in the patch grid, plus its
relative place in the prompt.

All agents of a model live in one `KVPAgents` module whose weights are stacked along a leading agent
axis (agent = layer * num_kv_heads + head), so one batched matmul scores every head of a layer (or,
in training, every head of every layer). The layout is documented in docs/kvp.md for the Triton kernel.

Scores returned to the cache are per-head log-softmax normalised (a token's log share of its head's
Plackett-Luce mass), so they can also be ranked jointly across the heads of a layer (shared head budget).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, ModelError
from .base import IMAGE, PAD, TEXT, EvictionPolicy, PrefillContext, register_eviction

logger = logging.getLogger(__name__)

CONFIG_NAME = "kvp_config.json"
WEIGHTS_NAME = "kvp_agents.safetensors"
FORMAT = "mm-oval-kvp"
FORMAT_VERSION = 1
EXTRA_FEATURES = ("modality", "grid", "relpos")
_FOURIER = (1.0, 2.0, 4.0)
# width of each extra feature group (see `extra_features`)
_EXTRA_WIDTH = {"modality": 2, "grid": 2 + 4 * len(_FOURIER), "relpos": 2 + 2 * len(_FOURIER)}


# ----------------------------------------------------------------------------------------------------------
# model signature: what the agents were trained for
# ----------------------------------------------------------------------------------------------------------


def text_config_of(model_or_config: Any) -> Any:
    cfg = getattr(model_or_config, "config", model_or_config)
    return getattr(cfg, "text_config", None) or cfg


def decoder_layers(model: Any) -> Any:
    """The language model's decoder layers of a LLaVA-style (or plain causal) model."""
    for path in ("model.language_model.layers", "language_model.model.layers", "model.layers"):
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        return obj
    raise ModelError(
        f"cannot find the decoder layers of {type(model).__name__}; KVP supports LLaVA-style models whose "
        "language model is a Llama/Mistral/Qwen2-like decoder (model.model.language_model.layers)"
    )


def _probe_from_attention(attn: Any) -> list[float]:
    """A few raw weights of one attention module: cheap, dtype-robust evidence of which model this is."""
    vals: list[float] = []
    for name in ("k_proj", "v_proj"):
        lin = getattr(attn, name, None)
        if lin is None or not hasattr(lin, "weight"):
            return []
        vals.extend(float(x) for x in lin.weight.detach()[0, :4].float().cpu())
    return vals


def model_signature(model: Any) -> dict:
    """Shape and weight fingerprint of a model, as recorded in a KVP checkpoint's JSON config."""
    tc = text_config_of(model)
    num_heads = int(tc.num_attention_heads)
    head_dim = int(getattr(tc, "head_dim", None) or tc.hidden_size // num_heads)
    layers = decoder_layers(model)
    probe = [_probe_from_attention(layer.self_attn) for layer in layers]
    cfg = model.config
    sig = {
        "num_layers": int(tc.num_hidden_layers),
        "num_kv_heads": int(getattr(tc, "num_key_value_heads", None) or num_heads),
        "num_heads": num_heads,
        "head_dim": head_dim,
        "hidden_size": int(tc.hidden_size),
        "max_positions": int(getattr(tc, "max_position_embeddings", 4096)),
        "image_token_id": getattr(cfg, "image_token_id", None),
        "image_seq_length": getattr(cfg, "image_seq_length", None),
        "name_or_path": str(getattr(cfg, "_name_or_path", "") or ""),
        "probe": probe,
    }
    sig["fingerprint"] = fingerprint_digest(probe)
    return sig


def fingerprint_digest(probe: list[list[float]]) -> str:
    rounded = [[float(f"{x:.2g}") for x in row] for row in probe]
    return hashlib.sha256(json.dumps(rounded).encode()).hexdigest()[:16]


def _probe_matches(a: list[float], b: list[float]) -> bool:
    if len(a) != len(b):
        return False
    if not a:
        return True
    ta, tb = torch.tensor(a), torch.tensor(b)
    return bool(torch.allclose(ta, tb, rtol=2e-2, atol=1e-3))


# ----------------------------------------------------------------------------------------------------------
# the agents
# ----------------------------------------------------------------------------------------------------------


@dataclass
class KVPAgentConfig:
    """Shape of the agents. The paper's reference: proj 256, position table 6000 x 32, hidden 256, no
    extra features. Field names of the weights follow docs/kernels.md (`KVPWeights`)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    proj: int = 64  # E: key / value projection width
    pos_table: int = 1024  # rows of the absolute position table (positions are clamped)
    pos_dim: int = 16  # Ep
    hidden: int = 64  # F: hidden width of the MLP
    extra_dim: int = 16  # Ex: width of the projected extra features
    extra_features: tuple[str, ...] = EXTRA_FEATURES
    shared: bool = False  # one agent for every (layer, head) instead of one each (ablation)
    grid_side: int = 0  # image patch grid side (e.g. 8 for 64 image tokens); 0 = infer per prompt
    sinks: int = 4  # always-kept first tokens (excluded from training rankings)
    recent: int = 16  # always-kept last prompt tokens (excluded from training rankings)
    # trained on one ranking over all KV heads of a layer: raw scores are comparable across heads (for a
    # budget shared by the heads); otherwise each head ranks its own tokens and scores are normalised per head
    joint_heads: bool = False

    def __post_init__(self) -> None:
        self.extra_features = tuple(self.extra_features)
        unknown = set(self.extra_features) - set(EXTRA_FEATURES)
        if unknown:
            raise ConfigError(f"unknown KVP features {sorted(unknown)}; choose from {list(EXTRA_FEATURES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "proj", "hidden", "pos_table", "pos_dim"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"KVP agent config: {name} must be positive, got {getattr(self, name)}")

    @property
    def num_agents(self) -> int:
        return self.num_layers * self.num_kv_heads

    @property
    def num_weight_sets(self) -> int:
        return 1 if self.shared else self.num_agents

    @property
    def extra_width(self) -> int:
        return sum(_EXTRA_WIDTH[f] for f in self.extra_features)


def extra_features(
    positions: torch.Tensor,
    modality: torch.Tensor,
    image_rc: torch.Tensor,
    features: tuple[str, ...],
    grid_side: int = 0,
) -> torch.Tensor:
    """Per-token features shared by all agents: (..., N) inputs -> (..., N, E) float32.

    modality: one-hot text / image. grid: normalised (row, col) of image tokens and their Fourier
    features (zeros for text). relpos: place in the prompt (position / last position, and log-distance
    to the end) with Fourier features."""
    out: list[torch.Tensor] = []
    pos = positions.float()
    valid = modality != PAD
    if "modality" in features:
        out.append(torch.stack([(modality == TEXT).float(), (modality == IMAGE).float()], dim=-1))
    if "grid" in features:
        is_img = (modality == IMAGE) & (image_rc[..., 1] >= 0)
        rc = image_rc[..., 1:3].float().clamp(min=0)
        if grid_side > 1:
            side = torch.full_like(rc[..., :1], float(grid_side - 1))
        else:  # infer the grid from the prompt itself
            side = rc.masked_fill(~is_img[..., None], 0).amax(dim=-2, keepdim=True).amax(-1, keepdim=True)
            side = side.clamp(min=1.0).expand_as(rc[..., :1])
        rcn = (rc / side).clamp(0, 1)
        feats = [rcn]
        for f in _FOURIER:
            feats += [torch.sin(math.pi * f * rcn), torch.cos(math.pi * f * rcn)]
        g = torch.cat(feats, dim=-1) * is_img[..., None].float()
        out.append(g)
    if "relpos" in features:
        last = pos.masked_fill(~valid, -1).amax(dim=-1, keepdim=True).clamp(min=1.0)
        q = (pos / last).clamp(0, 1)
        dist = torch.log1p((last - pos).clamp(min=0)) / math.log1p(4096.0)
        feats = [q[..., None], dist[..., None]]
        for f in _FOURIER:
            feats += [torch.sin(math.pi * f * q)[..., None], torch.cos(math.pi * f * q)[..., None]]
        out.append(torch.cat(feats, dim=-1))
    if not out:
        return positions.new_zeros((*positions.shape, 0), dtype=torch.float32)
    return torch.cat(out, dim=-1) * valid[..., None].float()


def _ln(x: torch.Tensor, g: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-agent LayerNorm (eps 1e-5): x (A, M, C), g/b (A, C)."""
    return F.layer_norm(x, x.shape[-1:], eps=1e-5) * g[:, None, :] + b[:, None, :]


class KVPAgents(nn.Module):
    """Every agent of a model, weights stacked on a leading axis of size `num_weight_sets`
    (num_layers * num_kv_heads, agent = layer * num_kv_heads + head; or 1 when `shared`). Per agent,
    with the parameter names of docs/kernels.md:

        ek = LN_k(k @ wk + bk)     ev = LN_v(v @ wv + bv)     ep = LN_p(pos_emb[clamp(p)])
        z  = concat(ek, ev, ep) @ w1 + b1  [+ LN_e(x @ we + be) @ w1x  when extra features are on]
        score = silu(LN_1(z)) . w2 + b2

    Without extra features this is exactly the paper's agent and the kernels' `kvp_score` layout
    (`layer_weights`); the extra term adds the modality / 2-D grid / relative-position features."""

    def __init__(self, config: KVPAgentConfig):
        super().__init__()
        self.config = config
        c = config
        S, D, E, Ep, Fh = c.num_weight_sets, c.head_dim, c.proj, c.pos_dim, c.hidden
        X = c.extra_width
        self.use_extra = X > 0

        def lin(i: int, o: int) -> tuple[nn.Parameter, nn.Parameter]:
            bound = 1.0 / math.sqrt(i)  # nn.Linear's default init
            return nn.Parameter(torch.empty(S, i, o).uniform_(-bound, bound)), nn.Parameter(torch.zeros(S, o))

        def norm(o: int) -> tuple[nn.Parameter, nn.Parameter]:
            return nn.Parameter(torch.ones(S, o)), nn.Parameter(torch.zeros(S, o))

        self.wk, self.bk = lin(D, E)
        self.lnk_w, self.lnk_b = norm(E)
        self.wv, self.bv = lin(D, E)
        self.lnv_w, self.lnv_b = norm(E)
        self.pos_emb = nn.Parameter(torch.randn(S, c.pos_table, Ep))
        self.lnp_w, self.lnp_b = norm(Ep)
        self.w1, self.b1 = lin(2 * E + Ep, Fh)
        if self.use_extra:
            self.we, self.be = lin(X, c.extra_dim)
            self.lne_w, self.lne_b = norm(c.extra_dim)
            self.w1x = nn.Parameter(
                torch.empty(S, c.extra_dim, Fh).uniform_(-(c.extra_dim**-0.5), c.extra_dim**-0.5)
            )
        self.ln1_w, self.ln1_b = norm(Fh)
        self.w2 = nn.Parameter(torch.empty(S, Fh).uniform_(-(Fh**-0.5), Fh**-0.5))
        self.b2 = nn.Parameter(torch.zeros(S))

    def weight_index(self, agents: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(agents) if self.config.shared else agents

    def forward(
        self,
        agents: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        extra: torch.Tensor | None,
    ) -> torch.Tensor:
        """agents (A,) long agent ids; keys/values (A, M, D); positions (A, M) or (M,) long; extra (M, X)
        or (A, M, X) or None -> scores (A, M) float32."""
        w = self.weight_index(agents)
        A, M, _ = keys.shape
        dt = self.wk.dtype
        ek = _ln(torch.baddbmm(self.bk[w][:, None], keys.to(dt), self.wk[w]), self.lnk_w[w], self.lnk_b[w])
        ev = _ln(torch.baddbmm(self.bv[w][:, None], values.to(dt), self.wv[w]), self.lnv_w[w], self.lnv_b[w])
        p = positions.long().clamp(0, self.config.pos_table - 1)
        if p.dim() == 1:
            p = p[None].expand(A, M)
        E2 = 2 * self.config.proj
        w1 = self.w1[w]
        z = torch.baddbmm(self.b1[w][:, None], torch.cat([ek, ev], dim=-1), w1[:, :E2])
        z = z + self._position_term(w, p, w1)
        if self.use_extra:
            assert extra is not None
            if extra.dim() == 2:
                extra = extra[None].expand(A, M, extra.shape[-1])
            ex = _ln(
                torch.baddbmm(self.be[w][:, None], extra.to(dt), self.we[w]), self.lne_w[w], self.lne_b[w]
            )
            z = z + torch.bmm(ex, self.w1x[w])
        h = F.silu(_ln(z, self.ln1_w[w], self.ln1_b[w]))
        return (torch.bmm(h, self.w2[w][..., None]).squeeze(-1) + self.b2[w][:, None]).float()

    def _position_term(self, w: torch.Tensor, p: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
        """LN_p(pos_emb[p]) @ w1_p per agent: (A, M, F). Positions are a table lookup, so at inference the term
        of every (agent, position) is computed once per weights and looked up."""
        E2 = 2 * self.config.proj
        A, M = p.shape
        if torch.is_grad_enabled() and any(t.requires_grad for t in (self.pos_emb, self.lnp_w, self.w1)):
            ep = torch.gather(self.pos_emb[w], 1, p[..., None].expand(A, M, self.pos_emb.shape[-1]))
            return torch.bmm(_ln(ep, self.lnp_w[w], self.lnp_b[w]), w1[:, E2:])
        params = (self.pos_emb, self.lnp_w, self.lnp_b, self.w1)
        key = tuple((t._version, t.data_ptr(), t.dtype) for t in params)
        cached = getattr(self, "_pos_terms", None)
        if cached is None or cached[0] != key:
            with torch.no_grad():
                table = torch.bmm(_ln(self.pos_emb, self.lnp_w, self.lnp_b), self.w1[:, E2:])  # (S, P, F)
            cached = self._pos_terms = (key, table.reshape(-1, table.shape[-1]))
        rows = w[:, None] * self.config.pos_table + p  # (A, M) into the flattened (S * P, F) table
        return cached[1].index_select(0, rows.reshape(-1)).view(A, M, -1)

    def layer_weights(self, layer_idx: int) -> Any:
        """The agents of one layer as the kernels' `KVPWeights` (agents without extra features only)."""
        if self.use_extra:
            raise ConfigError("agents with extra features have no kernel layout; score them with score_layer")
        from ..kernels.reference import KVPWeights

        H = self.config.num_kv_heads
        idx = self.weight_index(torch.arange(H) + layer_idx * H)
        names = ["wk", "bk", "lnk_w", "lnk_b", "wv", "bv", "lnv_w", "lnv_b", "pos_emb", "lnp_w", "lnp_b"]
        names += ["w1", "b1", "ln1_w", "ln1_b", "w2", "b2"]
        return KVPWeights(**{n: getattr(self, n).detach()[idx].contiguous() for n in names})

    def score_layer(
        self,
        layer_idx: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        modality: torch.Tensor,
        image_rc: torch.Tensor,
    ) -> torch.Tensor:
        """Raw scores of one layer's tokens, every KV head in one pass: keys/values (B, Hkv, N, D),
        positions/modality (B, N), image_rc (B, N, 3) -> (B, Hkv, N); padding gets -inf."""
        B, Hkv, N, D = keys.shape
        c = self.config
        if Hkv != c.num_kv_heads or D != c.head_dim:
            raise ModelError(
                f"KVP agents expect {c.num_kv_heads} KV heads of dim {c.head_dim}, the layer has {Hkv} of dim {D}; "
                "train agents for this model with `mm-oval train-kvp`"
            )
        if not 0 <= layer_idx < c.num_layers:
            raise ModelError(f"KVP agents cover {c.num_layers} layers, asked for layer {layer_idx}")
        agents = torch.arange(Hkv, device=keys.device) + layer_idx * Hkv
        k = keys.transpose(0, 1).reshape(Hkv, B * N, D)
        v = values.transpose(0, 1).reshape(Hkv, B * N, D)
        ex = None
        if self.use_extra:
            ex = extra_features(positions, modality, image_rc, c.extra_features, c.grid_side).reshape(
                B * N, -1
            )
        s = self.forward(agents, k, v, positions.reshape(B * N), ex).reshape(Hkv, B, N).transpose(0, 1)
        return s.masked_fill(modality[:, None, :] == PAD, float("-inf"))


# ----------------------------------------------------------------------------------------------------------
# saving / loading
# ----------------------------------------------------------------------------------------------------------


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes the file private; results and agents are shared files
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_agents(
    agents: KVPAgents, directory: str | Path, model_sig: dict, training: dict | None = None
) -> Path:
    """Write kvp_agents.safetensors + kvp_config.json (model shape, fingerprint, agent shape, training)."""
    from safetensors.torch import save

    directory = Path(directory)
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in agents.state_dict().items()}
    _atomic_write_bytes(directory / WEIGHTS_NAME, save(tensors))
    cfg = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "model": model_sig,
        "agent": asdict(agents.config),
        "training": training or {},
    }
    _atomic_write_bytes(directory / CONFIG_NAME, json.dumps(cfg, indent=1).encode())
    return directory


@dataclass
class LoadedAgents:
    agents: KVPAgents
    model: dict
    training: dict = field(default_factory=dict)
    source: str = ""


def load_agents(directory: str | Path, device: str | torch.device | None = None) -> LoadedAgents:
    from safetensors.torch import load_file

    directory = Path(directory)
    cfg_path = directory / CONFIG_NAME
    if not cfg_path.is_file() or not (directory / WEIGHTS_NAME).is_file():
        raise ModelError(
            f"{directory} holds no KVP agents (expected {CONFIG_NAME} and {WEIGHTS_NAME}); "
            "train them with `mm-oval train-kvp --model ... --data ... --out DIR`"
        )
    from safetensors import SafetensorError

    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"{cfg_path} is not valid JSON ({e}); retrain or restore the agents") from e
    if (
        not isinstance(cfg, dict)
        or cfg.get("format") != FORMAT
        or int(cfg.get("version", -1)) > FORMAT_VERSION
    ):
        fmt = cfg.get("format") if isinstance(cfg, dict) else type(cfg).__name__
        raise ModelError(f"{cfg_path} is not a KVP agents config this mm-oval can read ({fmt!r})")
    try:
        acfg = KVPAgentConfig(**cfg["agent"])
        if not isinstance(cfg["model"], dict):
            raise TypeError("'model' is not a dict")
    except (KeyError, TypeError) as e:
        raise ModelError(f"{cfg_path} is incomplete ({e}); retrain or restore the agents") from e
    agents = KVPAgents(acfg)
    weights = directory / WEIGHTS_NAME
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as e:
        raise ModelError(f"{weights} is truncated or corrupt ({e}); retrain or restore the agents") from e
    missing = set(agents.state_dict()) - set(state)
    if missing:
        raise ModelError(f"{weights} lacks {sorted(missing)}; the agents file is incomplete")
    try:
        agents.load_state_dict(state)
    except RuntimeError as e:
        raise ModelError(f"{weights} does not match {cfg_path} ({e}); retrain or restore the agents") from e
    agents.eval().requires_grad_(False)
    if device is not None:
        agents.to(device)
    return LoadedAgents(agents, cfg["model"], cfg.get("training", {}), str(directory))


SHAPE_KEYS = ("num_layers", "num_kv_heads", "head_dim", "num_heads")
_KVP_HINT = (
    "these agents belong to another model; train agents for this one with "
    "`mm-oval train-kvp --model <model> --data <data> --out <dir>` and pass agents=<dir>"
)


def check_signature(
    trained_for: dict,
    actual: dict,
    source: str = "",
    what: str = "KVP agents",
    hint: str = _KVP_HINT,
    keys: tuple[str, ...] = SHAPE_KEYS,
    check_weights: bool = True,
) -> None:
    """Raise ModelError when `what` (KVP agents, a router) trained for a model with signature `trained_for`
    is used on a model with signature `actual` (both `model_signature` dicts): other shapes (`keys`) or, with
    `check_weights`, other weights (the per-layer k_proj / v_proj probe). The message names both."""
    shape_a = {k: trained_for.get(k) for k in keys}
    shape_b = {k: actual.get(k) for k in keys}
    if shape_a != shape_b:
        raise ModelError(
            f"{what} {source}: trained for a model of shape {shape_a}, this model has shape {shape_b}: {hint}"
        )
    pa, pb = trained_for.get("probe") or [], actual.get("probe") or []
    if check_weights and pa and pb and not all(_probe_matches(a, b) for a, b in zip(pa, pb)):
        raise ModelError(
            f"{what} {source}: trained for model {trained_for.get('name_or_path') or '?'} "
            f"(fingerprint {trained_for.get('fingerprint')}), this model's weights differ "
            f"(fingerprint {actual.get('fingerprint')}): {hint}"
        )


# names `agents` may take instead of a directory -> the package-data folder of the bundled tiny LLaVA's agents:
# traces of whole prompts (compressed after the question, `--compress prompt`) or of prompts cut after the
# image (`--compress image`, the question-agnostic setting; trained with 3 sinks and no recent window, as
# the sweeps run it); per-head rankings, or one ranking over each layer's heads for `head_budget="shared"`
BUNDLED_AGENTS = {
    "bundled": "tiny_llava_kvp",
    "bundled-joint": "tiny_llava_kvp_joint",
    "bundled-image": "tiny_llava_kvp_image",
    "bundled-image-joint": "tiny_llava_kvp_image_joint",
}


def bundled_agents_path(joint_heads: bool = False, name: str | None = None) -> Path:
    """The agents trained for the bundled tiny LLaVA (package data): `name` one of BUNDLED_AGENTS, or by
    default the per-head agents of whole prompts (`joint_heads`: their joint-heads twin)."""
    name = name or ("bundled-joint" if joint_heads else "bundled")
    return Path(str(resources.files("mm_oval.zoo").joinpath(BUNDLED_AGENTS[name])))


# ----------------------------------------------------------------------------------------------------------
# the eviction policy
# ----------------------------------------------------------------------------------------------------------


@register_eviction
class KVPPolicy(EvictionPolicy):
    """Learned eviction. `agents`: a directory written by `mm-oval train-kvp` (or a `KVPAgents`), or
    "bundled" (the default: the agents trained for the bundled tiny LLaVA) or "bundled-joint" (its
    joint-heads agents, for `head_budget="shared"`), "bundled-image" / "bundled-image-joint" (the same
    trained for `compress="image"`, the image compressed before the question is read). `model`, when given, is checked against
    the agents' recorded shape and fingerprint at once; otherwise each layer is checked on first use
    (shape from the keys, fingerprint from the layer's k_proj / v_proj).

    `score` returns (B, Hkv, N) scores whose per-head order is the agents' ranking: raw scores of agents
    trained with `joint_heads` (one scale across a layer's heads: a budget shared by the heads, AdaKV or
    `head_budget="shared"`, accepts them), per-head log-softmax normalised otherwise (refused there:
    `comparable_across_heads`). `score_tokens` scores tokens arriving during decode on the same
    scale (normalised by the prefill's per-head log-partition, kept in ctx.extra)."""

    name = "kvp"
    needs_queries = False

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
    ):
        if isinstance(agents, KVPAgents):
            loaded = LoadedAgents(agents, {}, {}, "<in-memory>")
        elif isinstance(agents, LoadedAgents):
            loaded = agents
        else:
            if agents is None or agents in BUNDLED_AGENTS:
                path = bundled_agents_path(name=agents or "bundled")
            else:
                path = Path(agents)
            loaded = load_agents(path)
        self.loaded = loaded
        self.agents = loaded.agents.eval()
        self.check_weights = check_weights
        self._checked_layers: set[int] = set()
        if model is not None:
            self.bind(model)

    def bind(self, model: Any) -> None:
        """Check the agents against `model` at once (shape, and weights unless `check_weights=False`);
        `mm_oval.wrap` calls this."""
        if self.loaded.model:
            check_signature(
                self.loaded.model,
                model_signature(model),
                self.loaded.source,
                check_weights=self.check_weights,
            )
        self._checked_layers = set(range(self.agents.config.num_layers))

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
                got = _probe_from_attention(ctx.module)
                if got and not _probe_matches(probe[ctx.layer_idx], got):
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
        return agents.score_layer(
            ctx.layer_idx, ctx.keys, ctx.values, ctx.positions, ctx.modality, ctx.image_rc
        )

    @torch.no_grad()
    def score(self, ctx: PrefillContext) -> torch.Tensor:
        raw = self.raw_scores(ctx)
        if self.agents.config.joint_heads:  # already on one scale across the layer's heads
            return raw
        lse = torch.logsumexp(raw, dim=-1, keepdim=True)  # padding is -inf and drops out
        ctx.extra.setdefault("kvp_log_partition", {})[ctx.layer_idx] = lse
        return raw - lse

    @torch.no_grad()
    def score_tokens(
        self,
        layer_idx: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        modality: torch.Tensor,
        image_rc: torch.Tensor | None = None,
        extra: dict | None = None,
    ) -> torch.Tensor:
        """Scores of tokens arriving after prefill (decode): keys/values (B, Hkv, T, D), positions and
        modality (B, T) -> (B, Hkv, T), on the scale of that layer's prefill scores when `extra` is the
        request's ctx.extra. Relative-position features see the new tokens as the prompt's most recent."""
        if image_rc is None:
            image_rc = torch.full((*positions.shape, 3), -1, dtype=torch.long, device=positions.device)
        raw = self.agents.score_layer(layer_idx, keys, values, positions, modality, image_rc)
        lse = (extra or {}).get("kvp_log_partition", {}).get(layer_idx)
        return raw - lse if lse is not None else raw
