"""KVP agents: one small scorer per (layer, KV head), stacked into one module.

All agents of a model live in one `KVPAgents` module whose weights are stacked along a leading agent
axis (agent = layer * num_kv_heads + head), so one batched matmul scores every head of a layer (or,
in training, every head of every layer). The arithmetic is the kernels' (mm_oval.kernels.kvp): the
module hands its weights over as `KVPWeights`, scores at inference through the `kvp_score` dispatcher
(Triton on CUDA) and trains through the same reference code with autograd.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError, ModelError
from ..kernels import KVPWeights, kvp_score
from ..kernels.kvp.naive import EXTRA_WEIGHTS, agent_scores, position_table
from .base import PAD
from .kvp_features import EXTRA_FEATURES, extra_features, extra_width


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
        return extra_width(self.extra_features)


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

    _WEIGHTS = (
        "wk", "bk", "lnk_w", "lnk_b", "wv", "bv", "lnv_w", "lnv_b", "pos_emb", "lnp_w", "lnp_b",
        "w1", "b1", "ln1_w", "ln1_b", "w2", "b2",
    )  # fmt: skip

    def weights(self, w: torch.Tensor, with_positions: bool = True) -> KVPWeights:
        """The weights of agents `w` (weight-set indices, see `weight_index`) as the kernels' `KVPWeights`
        (views that keep autograd); `with_positions=False` leaves the position table out (an empty view)
        for callers that bring the position term themselves."""
        names = self._WEIGHTS + (EXTRA_WEIGHTS if self.use_extra else ())
        got = {n: getattr(self, n)[w] for n in names if n != "pos_emb"}
        got["pos_emb"] = self.pos_emb[w] if with_positions else self.pos_emb[:0]
        return KVPWeights(**got)

    def forward(
        self,
        agents: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        extra: torch.Tensor | None,
    ) -> torch.Tensor:
        """agents (A,) long agent ids; keys/values (A, M, D); positions (A, M) or (M,) long; extra (M, X)
        or (A, M, X) or None -> scores (A, M) float32 (mm_oval.kernels.kvp.naive.agent_scores)."""
        w = self.weight_index(agents)
        A, M, _ = keys.shape
        p = positions.long().clamp(0, self.config.pos_table - 1)
        if p.dim() == 1:
            p = p[None].expand(A, M)
        if self.use_extra:
            if extra is None:
                raise ConfigError("these KVP agents read extra per-token features; pass `extra`")
            if extra.dim() == 2:
                extra = extra[None].expand(A, M, extra.shape[-1])
        differentiable = torch.is_grad_enabled() and any(
            t.requires_grad for t in (self.pos_emb, self.lnp_w, self.w1)
        )
        if differentiable:
            return agent_scores(self.weights(w), keys, values, p, extra)
        return agent_scores(
            self.weights(w, with_positions=False), keys, values, p, extra, self._position_term(w, p)
        )

    def position_table(self) -> torch.Tensor:
        """LN_p(pos_emb) @ w1_p for every (weight set, position): (S, P, F). Positions are a table lookup,
        so at inference the position branch is computed once per weights (rebuilt after an update) and
        looked up."""
        params = (self.pos_emb, self.lnp_w, self.lnp_b, self.w1)
        key = tuple((t._version, t.data_ptr(), t.dtype) for t in params)
        cached = getattr(self, "_pos_terms", None)
        if cached is None or cached[0] != key:
            with torch.no_grad():
                all_sets = torch.arange(self.config.num_weight_sets, device=self.pos_emb.device)
                table = position_table(self.weights(all_sets))  # (S, P, F)
            cached = self._pos_terms = (key, table.reshape(-1, table.shape[-1]))
        return cached[1].view(self.config.num_weight_sets, self.config.pos_table, -1)

    def _position_term(self, w: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """The position branch of agents `w` at positions p (A, M), looked up: (A, M, F)."""
        A, M = p.shape
        table = self.position_table()
        flat = table.reshape(-1, table.shape[-1])
        rows = w[:, None] * self.config.pos_table + p  # (A, M) into the flattened (S * P, F) table
        return flat.index_select(0, rows.reshape(-1)).view(A, M, -1)

    def layer_weights(self, layer_idx: int) -> KVPWeights:
        """The agents of one layer as the kernels' `KVPWeights`: detached views of the parameters (copies
        for a shared agent), the extra-feature branch when the agents read extra features, and the
        cached position table as `pos_term`."""
        H = self.config.num_kv_heads
        names = self._WEIGHTS + (EXTRA_WEIGHTS if self.use_extra else ())
        table = self.position_table()
        if self.config.shared:
            pick = lambda t: t.detach()[:1].expand(H, *t.shape[1:]).contiguous()  # noqa: E731
        else:
            pick = lambda t: t.detach()[layer_idx * H : (layer_idx + 1) * H]  # noqa: E731
        return KVPWeights(**{n: pick(getattr(self, n)) for n in names}, pos_term=pick(table))

    def check_layer(self, layer_idx: int, keys: torch.Tensor) -> None:
        """ModelError unless `keys` (B, Hkv, N, D) fit the agents of layer `layer_idx`."""
        _, Hkv, _, D = keys.shape
        c = self.config
        if Hkv != c.num_kv_heads or D != c.head_dim:
            raise ModelError(
                f"KVP agents expect {c.num_kv_heads} KV heads of dim {c.head_dim}, the layer has {Hkv} of dim {D}; "
                "train agents for this model with `mm-oval train-kvp`"
            )
        if not 0 <= layer_idx < c.num_layers:
            raise ModelError(f"KVP agents cover {c.num_layers} layers, asked for layer {layer_idx}")

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
        positions/modality (B, N), image_rc (B, N, 3) -> (B, Hkv, N); padding gets -inf. Without
        gradients this is the `kvp_score` kernel (Triton on CUDA, its reference elsewhere); with them the
        same arithmetic through autograd."""
        self.check_layer(layer_idx, keys)
        B, Hkv, N, D = keys.shape
        c = self.config
        ex = (
            extra_features(positions, modality, image_rc, c.extra_features, c.grid_side)
            if self.use_extra
            else None
        )
        if torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()):
            agents = torch.arange(Hkv, device=keys.device) + layer_idx * Hkv
            k = keys.transpose(0, 1).reshape(Hkv, B * N, D)
            v = values.transpose(0, 1).reshape(Hkv, B * N, D)
            flat = None if ex is None else ex.reshape(B * N, -1)
            s = self.forward(agents, k, v, positions.reshape(B * N), flat).reshape(Hkv, B, N).transpose(0, 1)
        else:
            s = kvp_score(keys, values, positions, self.layer_weights(layer_idx), ex)
        return s.masked_fill(modality[:, None, :] == PAD, float("-inf"))
