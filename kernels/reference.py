"""PyTorch references of every kernel, with the kernels' signatures.

They are the definition of what each kernel computes (tests compare the Triton code against them) and
the implementation used on CPU. Shapes and layouts: docs/kernels.md. Everything is computed in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .pagetable import selected_token_mask

LN_EPS = 1e-5


# ----------------------------------------------------------------------------------------------
# 1. sparse paged decode attention
# ----------------------------------------------------------------------------------------------


def sparse_paged_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_start: torch.Tensor,
    page_len: torch.Tensor,
    page_idx: torch.Tensor,
    scale: float | None = None,
    num_splits: int | None = None,
    max_page_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one decode query per sequence over the selected pages of each KV head.

    q (B, Hq, D); k_cache, v_cache (B, Hkv, N, D); page_start, page_len (B, Hkv, P);
    page_idx (B, Hkv, S), -1 pads. Returns out (B, Hq, D) in q's dtype and lse (B, Hq) fp32
    (natural log-sum-exp of the scaled scores; -inf and out 0 for a head that reads nothing).
    `num_splits` and `max_page_len` (an upper bound of page_len, saving the kernel a device sync)
    only shape the Triton kernel's work; the result does not depend on them.
    """
    del num_splits, max_page_len
    B, Hq, D = q.shape
    Hkv, N = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    mask = selected_token_mask(page_start, page_len, page_idx, N)  # (B, Hkv, N)
    # read only the selected tokens: their indices first (stable), padded to the longest selection
    count = mask.sum(-1)  # (B, Hkv)
    width = int(count.max()) if count.numel() else 0
    valid = torch.arange(width, device=q.device) < count[..., None]
    if width == N and bool(valid.all()):  # every token is read: no gather
        k_sel, v_sel = k_cache.float(), v_cache.float()
    else:
        rows = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)[..., :width]  # (B, Hkv, width)
        flat = (rows + torch.arange(B * Hkv, device=q.device).view(B, Hkv, 1) * N).reshape(-1)
        k_sel = k_cache.reshape(B * Hkv * N, D).index_select(0, flat).view(B, Hkv, width, D).float()
        v_sel = v_cache.reshape(B * Hkv * N, D).index_select(0, flat).view(B, Hkv, width, D).float()
    qf = q.float().view(B, Hkv, G, D)
    s = torch.einsum("bhgd,bhnd->bhgn", qf, k_sel) * scale
    s = s.masked_fill(~valid[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, Hkv, G); -inf where nothing is read
    p = torch.exp(s - lse[..., None].clamp_min(torch.finfo(torch.float32).min))
    out = torch.einsum("bhgn,bhnd->bhgd", p, v_sel)
    return out.reshape(B, Hq, D).to(q.dtype), lse.reshape(B, Hq)


def merge_attention_ref(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges two partial attention results over disjoint token sets: out (..., D), lse (...)."""
    lse = torch.logaddexp(lse_a.float(), lse_b.float())
    safe = torch.where(torch.isinf(lse) & (lse < 0), torch.zeros_like(lse), lse)
    wa = torch.exp(lse_a.float() - safe)
    wb = torch.exp(lse_b.float() - safe)
    out = out_a.float() * wa[..., None] + out_b.float() * wb[..., None]
    return out.to(out_a.dtype), lse


# ----------------------------------------------------------------------------------------------
# 2. page scoring
# ----------------------------------------------------------------------------------------------


def combine_gqa_ref(raw: torch.Tensor) -> torch.Tensor:
    """raw (B, Hkv, G, P) per-query-head page scores, -inf for empty pages -> (B, Hkv, P):
    log of the softmax over pages averaged across the group's query heads (-inf for empty pages)."""
    raw = raw.float()
    m = raw.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(raw - m)
    z = e.sum(dim=-1, keepdim=True)
    prob = torch.where(z > 0, e / z.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(e))
    return torch.log(prob.mean(dim=2))


def page_raw_lowrank_ref(
    q: torch.Tensor,
    mu: torch.Tensor,
    basis: torch.Tensor,
    coef: torch.Tensor,
    page_len: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Per-query-head LOCKS/OVAL page scores (B, Hkv, G, P): logsumexp_i scale*(q.mu + (V^T q).c_i)."""
    B, Hq, D = q.shape
    Hkv, _, T = mu.shape[1], mu.shape[2], coef.shape[3]
    G = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    qf = q.float().view(B, Hkv, G, D)
    qmu = torch.einsum("bhgd,bhpd->bhgp", qf, mu.float())
    qv = torch.einsum("bhgd,bhpdr->bhgpr", qf, basis.float())
    qvc = torch.einsum("bhgpr,bhptr->bhgpt", qv, coef.float())
    s = (qmu[..., None] + qvc) * scale
    tok = torch.arange(T, device=q.device)
    valid = tok[None, None, None, :] < page_len[..., None].long()  # (B, Hkv, P, T)
    s = s.masked_fill(~valid[:, :, None], float("-inf"))
    return torch.logsumexp(s, dim=-1)


def page_score_lowrank_ref(
    q: torch.Tensor,
    mu: torch.Tensor,
    basis: torch.Tensor,
    coef: torch.Tensor,
    page_len: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """LOCKS / OVAL page scores combined over the GQA group: (B, Hkv, P) fp32, -inf for empty pages."""
    return combine_gqa_ref(page_raw_lowrank_ref(q, mu, basis, coef, page_len, scale))


def page_raw_quest_ref(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    page_len: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Per-query-head Quest bounds (B, Hkv, G, P): scale * sum_c max(q_c kmin_c, q_c kmax_c)."""
    B, Hq, D = q.shape
    Hkv = kmin.shape[1]
    scale = D**-0.5 if scale is None else scale
    qf = q.float().view(B, Hkv, Hq // Hkv, 1, D)
    lo = qf * kmin.float()[:, :, None]
    hi = qf * kmax.float()[:, :, None]
    s = torch.maximum(lo, hi).sum(dim=-1) * scale
    return s.masked_fill((page_len <= 0)[:, :, None], float("-inf"))


def page_score_quest_ref(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    page_len: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Quest page scores combined over the GQA group: (B, Hkv, P) fp32, -inf for empty pages."""
    return combine_gqa_ref(page_raw_quest_ref(q, kmin, kmax, page_len, scale))


# ----------------------------------------------------------------------------------------------
# 3. top-k page selection
# ----------------------------------------------------------------------------------------------


def select_pages_ref(scores: torch.Tensor, k: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """scores (B, Hkv, P); keep (B, Hkv, K0) always-taken pages (-1 pads) -> (B, Hkv, k) int32.

    Kept pages first (given order, duplicates and out-of-range entries dropped), then the best other
    pages by descending score (ties: lower index first), never a -inf (or NaN) page; -1 pads."""
    B, H, P = scores.shape
    dev = scores.device
    s = scores.float()
    s = s.masked_fill(torch.isnan(s), float("-inf"))
    out = torch.full((B, H, k + 1), -1, dtype=torch.int32, device=dev)  # last column: discard slot
    n_keep = torch.zeros((B, H), dtype=torch.long, device=dev)
    if keep is not None and keep.shape[-1] > 0:
        keep = keep.long()
        K0 = keep.shape[-1]
        valid = (keep >= 0) & (keep < P)
        eq = keep[..., :, None] == keep[..., None, :]
        earlier = torch.ones(K0, K0, dtype=torch.bool, device=dev).tril(-1)
        dup = (eq & earlier & valid[..., None, :]).any(dim=-1)
        first = valid & ~dup
        n_keep = first.sum(dim=-1)
        order = torch.argsort(torch.where(first, 0, K0) + torch.arange(K0, device=dev), dim=-1, stable=True)
        compact = torch.gather(torch.where(first, keep, -1), -1, order)
        out[..., :K0] = compact.to(torch.int32)
        taken = torch.zeros((B, H, P + 1), dtype=torch.bool, device=dev)
        taken.scatter_(-1, torch.where(first, keep, P), True)
        s = s.masked_fill(taken[..., :P], float("-inf"))
    kc = min(k, P)
    sorted_s, order = torch.sort(s, dim=-1, descending=True, stable=True)
    cand, cand_s = order[..., :kc], sorted_s[..., :kc]
    pos = n_keep[..., None] + torch.arange(kc, device=dev)
    ok = (pos < k) & torch.isfinite(cand_s)
    out.scatter_(-1, torch.where(ok, pos, k), torch.where(ok, cand, -1).to(torch.int32))
    return out[..., :k].contiguous()


# ----------------------------------------------------------------------------------------------
# 4. KVP agent scoring
# ----------------------------------------------------------------------------------------------


@dataclass
class KVPWeights:
    """The KVP agents of one layer, every tensor stacked over the layer's H KV heads; linear weights
    are (H, in, out). Layout table: docs/kernels.md."""

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

    def to(self, *args, **kwargs) -> KVPWeights:
        return KVPWeights(**{f.name: getattr(self, f.name).to(*args, **kwargs) for f in fields(self)})

    def contiguous(self) -> KVPWeights:
        return KVPWeights(**{f.name: getattr(self, f.name).contiguous() for f in fields(self)})

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
    ) -> KVPWeights:
        """Randomly initialised agents (Linear-like scales, LayerNorm weights near 1): for tests and
        benchmarks."""
        H, D, E, Ep, L, F = num_heads, head_dim, proj, pos_dim, pos_rows, hidden

        def r(*shape: int, std: float) -> torch.Tensor:
            return (torch.randn(*shape, generator=generator) * std).to(device)

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
            w1=r(H, 2 * E + Ep, F, std=(2 * E + Ep) ** -0.5),
            b1=r(H, F, std=0.1),
            ln1_w=1 + r(H, F, std=0.1),
            ln1_b=r(H, F, std=0.1),
            w2=r(H, F, std=F**-0.5),
            b2=r(H, std=0.1),
        )


def _layer_norm_heads(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """x (B, H, N, C), per-head w, b (H, C)."""
    mean = x.mean(dim=-1, keepdim=True)
    var = (x - mean).pow(2).mean(dim=-1, keepdim=True)
    return (x - mean) * torch.rsqrt(var + LN_EPS) * w[None, :, None, :] + b[None, :, None, :]


def kvp_score_ref(
    keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, weights: KVPWeights
) -> torch.Tensor:
    """keys, values (B, H, N, D); positions (B, N) -> agent scores (B, H, N) fp32 (higher = keep)."""
    w = weights
    L = w.pos_emb.shape[1]
    E = w.wk.shape[2]
    k = keys.float()
    v = values.float()
    ek = torch.einsum("bhnd,hde->bhne", k, w.wk.float()) + w.bk.float()[None, :, None]
    ek = _layer_norm_heads(ek, w.lnk_w.float(), w.lnk_b.float())
    ev = torch.einsum("bhnd,hde->bhne", v, w.wv.float()) + w.bv.float()[None, :, None]
    ev = _layer_norm_heads(ev, w.lnv_w.float(), w.lnv_b.float())
    idx = positions.long().clamp(0, L - 1)  # (B, N)
    H = w.num_heads
    ep = w.pos_emb.float()[
        torch.arange(H, device=idx.device)[None, :, None], idx[:, None, :]
    ]  # (B, H, N, Ep)
    ep = _layer_norm_heads(ep, w.lnp_w.float(), w.lnp_b.float())
    w1 = w.w1.float()
    z = (
        torch.einsum("bhne,hef->bhnf", ek, w1[:, :E])
        + torch.einsum("bhne,hef->bhnf", ev, w1[:, E : 2 * E])
        + torch.einsum("bhne,hef->bhnf", ep, w1[:, 2 * E :])
        + w.b1.float()[None, :, None]
    )
    z = torch.nn.functional.silu(_layer_norm_heads(z, w.ln1_w.float(), w.ln1_b.float()))
    return torch.einsum("bhnf,hf->bhn", z, w.w2.float()) + w.b2.float()[None, :, None]


# ----------------------------------------------------------------------------------------------
# 5. compaction
# ----------------------------------------------------------------------------------------------


def compact_kv_ref(
    k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, capacity: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v (B, H, N, D); index (B, H, M) token indices per head, -1 pads ->
    (B, H, capacity or M, D) each, the gathered tokens; slots past M or with -1 are 0."""
    B, H, _, D = k.shape
    M = index.shape[-1]
    C = M if capacity is None else capacity
    idx = index.long()
    ok = idx >= 0
    g = idx.clamp_min(0)[..., None].expand(B, H, M, D)
    outs = []
    for x in (k, v):
        y = torch.zeros((B, H, C, D), dtype=x.dtype, device=x.device)
        y[:, :, :M] = torch.where(ok[..., None], torch.gather(x, 2, g), torch.zeros((), dtype=x.dtype))
        outs.append(y)
    return outs[0], outs[1]
