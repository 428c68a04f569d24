"""KVP agent scoring, the PyTorch reference and the one definition of the agents' arithmetic.

Per agent (one per KV head of a layer), with the weights of `KVPWeights`:

    ek = LN_k(k @ wk + bk)     ev = LN_v(v @ wv + bv)     ep = LN_p(pos_emb[clamp(p, 0, L - 1)])
    z  = concat(ek, ev, ep) @ w1 + b1   [+ LN_e(x @ we + be) @ w1x   with extra per-token features x]
    score = silu(LN_1(z)) . w2 + b2

`agent_scores` computes it over stacked agents (the layout `mm_oval.policies.kvp_agents.KVPAgents`
trains in); `kvp_score_naive` is the kernel's signature on top of it. Everything in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from mm_oval.errors import ConfigError

LN_EPS = 1e-5
EXTRA_WEIGHTS = ("we", "be", "lne_w", "lne_b", "w1x")


@dataclass
class KVPWeights:
    """The KVP agents of one layer, every tensor stacked over the layer's H KV heads; linear weights
    are (H, in, out). The extra-feature branch (`we` .. `w1x`) is None for agents without extra
    features; `pos_term` is an optional precomputed position branch. Layout table: docs/kernels.md."""

    wk: torch.Tensor  # (H, D, E)
    bk: torch.Tensor  # (H, E)
    lnk_w: torch.Tensor  # (H, E)
    lnk_b: torch.Tensor  # (H, E)
    wv: torch.Tensor  # (H, D, E)
    bv: torch.Tensor  # (H, E)
    lnv_w: torch.Tensor  # (H, E)
    lnv_b: torch.Tensor  # (H, E)
    pos_emb: torch.Tensor  # (H, L, Ep)
    lnp_w: torch.Tensor  # (H, Ep)
    lnp_b: torch.Tensor  # (H, Ep)
    w1: torch.Tensor  # (H, 2E + Ep, F)
    b1: torch.Tensor  # (H, F)
    ln1_w: torch.Tensor  # (H, F)
    ln1_b: torch.Tensor  # (H, F)
    w2: torch.Tensor  # (H, F)
    b2: torch.Tensor  # (H,)
    we: torch.Tensor | None = None  # (H, X, Ex)
    be: torch.Tensor | None = None  # (H, Ex)
    lne_w: torch.Tensor | None = None  # (H, Ex)
    lne_b: torch.Tensor | None = None  # (H, Ex)
    w1x: torch.Tensor | None = None  # (H, Ex, F)
    # the position branch precomputed for every table row, position_table(self) (H, L, F): when given,
    # scoring looks a row up instead of computing LN_p(pos_emb[p]) @ w1[2E:] per token
    pos_term: torch.Tensor | None = None

    @property
    def num_heads(self) -> int:
        return self.wk.shape[0]

    @property
    def head_dim(self) -> int:
        return self.wk.shape[1]

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """(E, Ep, L, F)."""
        return self.wk.shape[2], self.pos_emb.shape[2], self.pos_emb.shape[1], self.w1.shape[2]

    @property
    def extra_width(self) -> int:
        """X, the width of the per-token extra features the agents read (0: none)."""
        return 0 if self.we is None else self.we.shape[1]

    def apply(self, fn) -> KVPWeights:
        """fn applied to every tensor (the absent extra-feature branch stays None)."""
        return KVPWeights(
            **{f.name: None if (t := getattr(self, f.name)) is None else fn(t) for f in fields(self)}
        )

    def to(self, *args, **kwargs) -> KVPWeights:
        return self.apply(lambda t: t.to(*args, **kwargs))

    def contiguous(self) -> KVPWeights:
        return self.apply(lambda t: t.contiguous())

    @staticmethod
    def random(
        num_heads: int,
        head_dim: int,
        proj: int = 256,
        pos_dim: int = 32,
        pos_rows: int = 6000,
        hidden: int = 256,
        generator: torch.Generator | None = None,
        device: torch.device | str = "cpu",
        extra: int = 0,
        extra_dim: int = 16,
    ) -> KVPWeights:
        """Randomly initialised agents (Linear-like scales, LayerNorm weights near 1), with an extra-feature
        branch of `extra` inputs when extra > 0: for tests and benchmarks."""
        H, D, E, Ep, L, Fh, X = num_heads, head_dim, proj, pos_dim, pos_rows, hidden, extra

        def r(*shape: int, std: float) -> torch.Tensor:
            return (torch.randn(*shape, generator=generator) * std).to(device)

        branch = {}
        if X:
            branch = dict(
                we=r(H, X, extra_dim, std=X**-0.5),
                be=r(H, extra_dim, std=0.1),
                lne_w=1 + r(H, extra_dim, std=0.1),
                lne_b=r(H, extra_dim, std=0.1),
                w1x=r(H, extra_dim, Fh, std=extra_dim**-0.5),
            )
        return KVPWeights(
            wk=r(H, D, E, std=D**-0.5),
            bk=r(H, E, std=0.1),
            lnk_w=1 + r(H, E, std=0.1),
            lnk_b=r(H, E, std=0.1),
            wv=r(H, D, E, std=D**-0.5),
            bv=r(H, E, std=0.1),
            lnv_w=1 + r(H, E, std=0.1),
            lnv_b=r(H, E, std=0.1),
            pos_emb=r(H, L, Ep, std=1.0),
            lnp_w=1 + r(H, Ep, std=0.1),
            lnp_b=r(H, Ep, std=0.1),
            w1=r(H, 2 * E + Ep, Fh, std=(2 * E + Ep) ** -0.5),
            b1=r(H, Fh, std=0.1),
            ln1_w=1 + r(H, Fh, std=0.1),
            ln1_b=r(H, Fh, std=0.1),
            w2=r(H, Fh, std=Fh**-0.5),
            b2=r(H, std=0.1),
            **branch,
        )


def layer_norm(x: torch.Tensor, g: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-agent LayerNorm: x (A, M, C), g/b (A, C)."""
    return F.layer_norm(x, x.shape[-1:], eps=LN_EPS) * g[:, None, :] + b[:, None, :]


def position_table(w: KVPWeights) -> torch.Tensor:
    """The position branch's contribution to z for every table row: LN_p(pos_emb) @ w1[2E:], (A, L, F)."""
    return torch.bmm(layer_norm(w.pos_emb, w.lnp_w, w.lnp_b), w.w1[:, 2 * w.wk.shape[2] :])


def agent_scores(
    w: KVPWeights,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    extra: torch.Tensor | None = None,
    position_term: torch.Tensor | None = None,
) -> torch.Tensor:
    """Stacked agents: w's leading axis A; keys/values (A, M, D); positions (A, M) long (clamped here);
    extra (A, M, X) when the agents read extra features; `position_term` (A, M, F), rows of
    `position_table` already looked up, replaces the position branch. -> scores (A, M) fp32."""
    A, M, _ = keys.shape
    E2 = 2 * w.wk.shape[2]
    dt = w.wk.dtype
    ek = layer_norm(torch.baddbmm(w.bk[:, None], keys.to(dt), w.wk), w.lnk_w, w.lnk_b)
    ev = layer_norm(torch.baddbmm(w.bv[:, None], values.to(dt), w.wv), w.lnv_w, w.lnv_b)
    z = torch.baddbmm(w.b1[:, None], torch.cat([ek, ev], dim=-1), w.w1[:, :E2])
    if position_term is None:
        p = positions.long().clamp(0, w.pos_emb.shape[1] - 1)
        ep = torch.gather(w.pos_emb, 1, p[..., None].expand(A, M, w.pos_emb.shape[-1]))
        position_term = torch.bmm(layer_norm(ep, w.lnp_w, w.lnp_b), w.w1[:, E2:])
    z = z + position_term
    if w.we is not None:
        if extra is None:
            raise ConfigError("these KVP agents read extra per-token features; pass `extra`")
        ex = layer_norm(torch.baddbmm(w.be[:, None], extra.to(dt), w.we), w.lne_w, w.lne_b)
        z = z + torch.bmm(ex, w.w1x)
    h = F.silu(layer_norm(z, w.ln1_w, w.ln1_b))
    return (torch.bmm(h, w.w2[..., None]).squeeze(-1) + w.b2[:, None]).float()


def kvp_score_naive(
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    weights: KVPWeights,
    extra: torch.Tensor | None = None,
) -> torch.Tensor:
    """keys, values (B, H, N, D); positions (B, N); extra (B, N, X) per-token features shared by the
    heads (when the agents read them) -> agent scores (B, H, N) fp32 (higher = keep)."""
    B, H, N, D = keys.shape
    w = weights.to(torch.float32)
    k = keys.float().transpose(0, 1).reshape(H, B * N, D)
    v = values.float().transpose(0, 1).reshape(H, B * N, D)
    p = positions.reshape(1, B * N).expand(H, B * N)
    ex = None if extra is None else extra.float().reshape(1, B * N, -1).expand(H, B * N, extra.shape[-1])
    term = None
    if w.pos_term is not None:
        term = w.pos_term[:, positions.long().clamp(0, w.pos_term.shape[1] - 1).reshape(B * N)]
    return agent_scores(w, k, v, p, ex, term).reshape(H, B, N).transpose(0, 1)
