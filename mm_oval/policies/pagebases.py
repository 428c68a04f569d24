"""Page summaries that score a page without reading its keys: LOCKS (key PCA, eta = 0) and OVAL
(output-aware bases, eta > 0), plus the measures used to judge any page retrieval.

For one page of T tokens (per batch row and KV head), with keys K (T x D) and values V (T x D):

- centroid mu = mean of the page's keys, centred keys X = K - 1 mu^T, centred values Y = V - 1 mean(V)^T;
- LOCKS: the rank-r basis B (D x r) holds the top eigenvectors of X^T X (page-local PCA);
- OVAL:  the top eigenvectors of M_eta = (1 - eta) X^T X / tr(X^T X) + eta X^T Y G Y^T X / tr(X^T Y G Y^T X),
  with G = sum over the KV head's query heads g of W_g^T W_g and W_g the o_proj slice of head g;
- coefficients c_i = B^T (k_i - mu); the page score for a query q is the estimated log attention mass
  s(q) = logsumexp_i scaling * (q . mu + (B^T q) . c_i).

Both bases come from the T x T Gram matrix (T <= 32 here, D = 128 on LLaVA-1.5), never a D x D
eigendecomposition: M_eta = X^T A X with A = (1 - eta) I / tr + eta Y G Y^T / tr'. With X = U L^1/2 W^T
(K = X X^T = U L U^T), M_eta = W C W^T where C = L^1/2 U^T A U L^1/2 is T x T; the eigenvectors Q of C give
the basis W Q = X^T U L^-1/2 Q.

Tensor layout (the page-scoring kernel's contract, see docs/kernels.md): leading dims (..., P) index pages of
one (batch row, KV head); centroid (..., P, D), basis (..., P, D, r), coeffs (..., P, T, r), token_mask
(..., P, T) marks the slots that hold a token (pages may be partly filled). Scores are computed per query head
and combined over a GQA group by a softmax over pages averaged across the group's heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import ConfigError
from .base import DecodeContext, PageBatch, RetrievalPolicy, register_retrieval

NEG_INF = float("-inf")


@dataclass
class PageBasisSummary:
    """Per-page low-rank index of the keys (see the module docstring for shapes)."""

    centroid: torch.Tensor  # (..., P, D)
    basis: torch.Tensor  # (..., P, D, r)
    coeffs: torch.Tensor  # (..., P, T, r)
    token_mask: torch.Tensor  # (..., P, T) bool

    @property
    def rank(self) -> int:
        return self.basis.shape[-1]

    @property
    def num_pages(self) -> int:
        return self.centroid.shape[-2]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.centroid, self.basis, self.coeffs))


@dataclass
class QuestSummary:
    """Per-channel minimum and maximum of the page's keys (Quest)."""

    kmin: torch.Tensor  # (..., P, D)
    kmax: torch.Tensor  # (..., P, D)
    token_mask: torch.Tensor  # (..., P, T) bool

    @property
    def num_pages(self) -> int:
        return self.kmin.shape[-2]


def output_metric(o_proj_weight: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """G per KV head: sum over the group's query heads g of W_g^T W_g, with W_g = o_proj.weight[:, g*D:(g+1)*D].

    o_proj_weight (hidden, num_heads * D) -> (num_kv_heads, D, D). Computed once per layer."""
    hidden, width = o_proj_weight.shape
    if width % num_heads or num_heads % num_kv_heads:
        raise ConfigError(
            f"o_proj of width {width} cannot be split into {num_heads} query heads in {num_kv_heads} KV groups"
        )
    d = width // num_heads
    w = o_proj_weight.detach().float().reshape(hidden, num_heads, d).permute(1, 0, 2)  # (Hq, hidden, D)
    per_head = w.transpose(1, 2) @ w  # (Hq, D, D)
    return per_head.reshape(num_kv_heads, num_heads // num_kv_heads, d, d).sum(1)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.unsqueeze(-1).to(x.dtype)
    return (x * m).sum(-2) / m.sum(-2).clamp_min(1.0)


def page_bases(
    keys: torch.Tensor,
    token_mask: torch.Tensor | None = None,
    *,
    rank: int = 8,
    eta: float = 0.0,
    values: torch.Tensor | None = None,
    metric: torch.Tensor | None = None,
) -> PageBasisSummary:
    """LOCKS (eta = 0) or OVAL (eta > 0) summaries of pages.

    keys, values: (..., P, T, D); token_mask (..., P, T) (all True when None); metric: G, broadcastable to
    (..., P, D, D) (e.g. (B, Hkv, 1, D, D)); values and metric are needed only when eta > 0.
    Computed in float32 through the T x T Gram matrix; the summary is returned in the keys' dtype."""
    if not 0.0 <= eta <= 1.0:
        raise ConfigError(f"eta must lie in [0, 1], got {eta}")
    if rank < 1:
        raise ConfigError(f"the page basis rank must be >= 1, got {rank}")
    if eta > 0 and (values is None or metric is None):
        raise ConfigError("OVAL bases (eta > 0) need the page values and the layer's output metric G")
    out_dtype = keys.dtype
    k = keys.float()
    if token_mask is None:
        token_mask = torch.ones(k.shape[:-1], dtype=torch.bool, device=k.device)
    token_mask = token_mask.bool()
    m = token_mask.unsqueeze(-1).float()
    mu = _masked_mean(k, token_mask)  # (..., P, D)
    x = (k - mu.unsqueeze(-2)) * m  # padded slots are zero rows: they add nothing to any Gram matrix
    t = x.shape[-2]
    gram = x @ x.transpose(-1, -2)  # (..., P, T, T)
    lam, u = torch.linalg.eigh(gram)
    lam_max = lam[..., -1:].clamp_min(0.0)
    keep = lam > lam_max * (t * 1e-6) + 1e-30
    lam = torch.where(keep, lam, torch.zeros_like(lam))
    inv_sqrt = torch.where(keep, lam.clamp_min(1e-30).rsqrt(), torch.zeros_like(lam))
    if eta == 0.0:
        # eigenvectors of X^T X are X^T u / sqrt(lambda); eigh sorts ascending: take the last r
        order = torch.arange(t - 1, max(t - 1 - rank, -1), -1, device=k.device)
        basis = x.transpose(-1, -2) @ (u[..., order] * inv_sqrt[..., order].unsqueeze(-2))  # (..., P, D, r')
    else:
        v = values.float()
        y = (v - _masked_mean(v, token_mask).unsqueeze(-2)) * m
        ygyt = y @ metric.float() @ y.transpose(-1, -2)  # (..., P, T, T)
        tr_k = gram.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(1e-30)  # tr(X^T X)
        tr_o = (ygyt * gram).sum((-1, -2)).clamp_min(1e-30)  # tr(X^T Y G Y^T X)
        eye = torch.eye(t, device=k.device, dtype=k.dtype)
        a = ((1.0 - eta) / tr_k)[..., None, None] * eye + (eta / tr_o)[..., None, None] * ygyt
        s = lam.sqrt()
        c = s.unsqueeze(-1) * (u.transpose(-1, -2) @ a @ u) * s.unsqueeze(-2)
        c = 0.5 * (c + c.transpose(-1, -2))
        sig, q = torch.linalg.eigh(c)
        order = torch.arange(t - 1, max(t - 1 - rank, -1), -1, device=k.device)
        q_top = q[..., order]  # (..., P, T, r')
        # rows of Q on discarded (zero) eigen-directions of the Gram are zero by construction of C
        basis = x.transpose(-1, -2) @ (u @ (inv_sqrt.unsqueeze(-1) * q_top))
        # directions C has no energy on carry no information: zero them rather than keep noise
        basis = basis * (sig[..., order] > sig[..., -1:].clamp_min(0.0) * 1e-6).unsqueeze(-2).float()
    r_eff = basis.shape[-1]
    if r_eff < rank:  # pages shorter than the rank: pad with zero directions
        basis = torch.nn.functional.pad(basis, (0, rank - r_eff))
    coeffs = x @ basis  # (..., P, T, r)
    return PageBasisSummary(mu.to(out_dtype), basis.to(out_dtype), coeffs.to(out_dtype), token_mask)


def basis_scores(query: torch.Tensor, summary: PageBasisSummary, scaling: float) -> torch.Tensor:
    """Estimated log attention mass per page: query (B, Hq, D), summary with leading dims (B, Hkv) ->
    (B, Hq, P); -inf for pages without tokens."""
    b, hq, d = query.shape
    hkv = summary.centroid.shape[1]
    q = query.float().reshape(b, hkv, hq // hkv, d)
    mu = summary.centroid.float()
    qmu = torch.einsum("bhgd,bhpd->bhgp", q, mu)
    qb = torch.einsum("bhgd,bhpdr->bhgpr", q, summary.basis.float())
    logits = qmu.unsqueeze(-1) + torch.einsum("bhgpr,bhptr->bhgpt", qb, summary.coeffs.float())
    logits = logits.masked_fill(~summary.token_mask.unsqueeze(2), NEG_INF) * scaling
    return torch.logsumexp(logits, dim=-1).reshape(b, hq, -1)


def quest_summaries(keys: torch.Tensor, token_mask: torch.Tensor | None = None) -> QuestSummary:
    """Per-channel min and max of each page's keys: keys (..., P, T, D) -> (..., P, D) twice."""
    if token_mask is None:
        token_mask = torch.ones(keys.shape[:-1], dtype=torch.bool, device=keys.device)
    m = token_mask.bool().unsqueeze(-1)
    big = torch.finfo(keys.dtype).max
    kmin = keys.masked_fill(~m, big).amin(-2)
    kmax = keys.masked_fill(~m, -big).amax(-2)
    empty = ~token_mask.bool().any(-1, keepdim=True)
    return QuestSummary(kmin.masked_fill(empty, 0), kmax.masked_fill(empty, 0), token_mask.bool())


def quest_scores(query: torch.Tensor, summary: QuestSummary, scaling: float) -> torch.Tensor:
    """Quest's upper bound of q . k over the page: sum_c max(q_c min_c, q_c max_c), scaled; (B, Hq, P)."""
    b, hq, d = query.shape
    hkv = summary.kmin.shape[1]
    q = query.float().reshape(b, hkv, hq // hkv, 1, d)
    lo = q * summary.kmin.float().unsqueeze(2)
    hi = q * summary.kmax.float().unsqueeze(2)
    s = torch.maximum(lo, hi).sum(-1) * scaling
    empty = ~summary.token_mask.any(-1)  # (B, Hkv, P)
    return s.masked_fill(empty.unsqueeze(2), NEG_INF).reshape(b, hq, -1)


def exact_page_log_mass(
    query: torch.Tensor, keys: torch.Tensor, token_mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """The quantity LOCKS/OVAL estimate, from the keys themselves: query (B, Hq, D), keys (B, Hkv, P, T, D),
    token_mask (B, Hkv, P, T) -> log sum_i exp(scaling q . k_i) per page, (B, Hq, P)."""
    b, hq, d = query.shape
    hkv = keys.shape[1]
    q = query.float().reshape(b, hkv, hq // hkv, d)
    logits = torch.einsum("bhgd,bhptd->bhgpt", q, keys.float()) * scaling
    logits = logits.masked_fill(~token_mask.bool().unsqueeze(2), NEG_INF)
    return torch.logsumexp(logits, -1).reshape(b, hq, -1)


def combine_group(scores: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """GQA combination: log of the per-query-head softmax over pages, averaged across each KV head's group.
    scores (B, Hq, P) (log masses, -inf for empty pages) -> (B, Hkv, P); exp() of a row sums to 1 and
    empty pages score -inf (the contract of mm_oval.kernels' page scoring)."""
    b, hq, p = scores.shape
    probs = torch.softmax(scores.float(), dim=-1).nan_to_num(0.0)
    return probs.reshape(b, num_kv_heads, hq // num_kv_heads, p).mean(2).log()


def lowrank_page_scores(
    q: torch.Tensor,
    mu: torch.Tensor,
    basis: torch.Tensor,
    coef: torch.Tensor,
    page_len: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """LOCKS / OVAL page scores with the GQA combination, in the page-scoring kernel's signature:
    q (B, Hq, D), mu (B, Hkv, P, D), basis (B, Hkv, P, D, R), coef (B, Hkv, P, T, R), page_len (B, Hkv, P)
    -> (B, Hkv, P) fp32, log mean_g softmax_pages(s_gj)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    t = coef.shape[-2]
    mask = torch.arange(t, device=coef.device) < page_len.unsqueeze(-1)
    raw = basis_scores(q, PageBasisSummary(mu, basis, coef, mask), scale)
    return combine_group(raw, mu.shape[1])


def top_pages(
    page_scores: torch.Tensor,
    num_pages: int,
    valid: torch.Tensor | None = None,
    forced: torch.Tensor | None = None,
) -> torch.Tensor:
    """Indices of the best `num_pages` pages per row: page_scores (..., P) -> (..., num_pages), -1 for none.

    valid (..., P) bool excludes pages; forced (..., P) bool pages are always taken first (e.g. the last
    closed page). Indices come back sorted ascending with the -1 fill at the end."""
    s = page_scores.float().clone()
    p = s.shape[-1]
    if valid is not None:
        s = s.masked_fill(~valid, NEG_INF)
    if forced is not None:
        s = s.masked_fill(forced & (valid if valid is not None else True), math.inf)
    k = min(num_pages, p)
    if k <= 0:
        return torch.full((*s.shape[:-1], max(num_pages, 0)), -1, dtype=torch.long, device=s.device)
    val, idx = s.topk(k, dim=-1)
    idx = idx.masked_fill(val == NEG_INF, p)  # sorts to the end
    idx = idx.sort(-1).values
    idx = idx.masked_fill(idx == p, -1)
    if k < num_pages:
        idx = torch.nn.functional.pad(idx, (0, num_pages - k), value=-1)
    return idx


# ---------------------------------------------------------------------------------------------------------
# measures of a retrieval: how much of the exact attention the selected pages hold


def selected_token_mask(token_page: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """token_page (B, Hkv, N) page index of each cached token (-1 = in no closed page, e.g. the open page:
    always read); selected (B, Hkv, k) page indices (-1 = none) -> (B, Hkv, N) bool: the token is read."""
    hit = (token_page.unsqueeze(-1) == selected.unsqueeze(-2)) & (selected.unsqueeze(-2) >= 0)
    return hit.any(-1) | (token_page < 0)


def attention_mass_captured(attn: torch.Tensor, read: torch.Tensor, top: int | None = None) -> torch.Tensor:
    """Fraction of the exact attention mass that the read tokens hold, per query head.

    attn (B, Hq, N) exact attention probabilities of one decode query over the cache; read (B, Hkv, N) bool.
    With `top`, the fraction of the mass of the `top` highest-attention tokens that is read (OVAL's
    "true top-k attention mass captured"). Returns (B, Hq)."""
    b, hq, n = attn.shape
    hkv = read.shape[1]
    r = read.repeat_interleave(hq // hkv, dim=1).float()
    a = attn.float()
    if top is not None and top < n:
        val, idx = a.topk(top, dim=-1)
        return (val * r.gather(-1, idx)).sum(-1) / val.sum(-1).clamp_min(1e-30)
    return (a * r).sum(-1) / a.sum(-1).clamp_min(1e-30)


# ---------------------------------------------------------------------------------------------------------
# the retrieval policies (the cache's seam: summarize closed pages, score pages at each decode step)


def _kernel(name: str):
    """mm_oval.kernels' dispatching function `name` when it exists (Triton on CUDA, torch elsewhere)."""
    try:
        from .. import kernels
    except ImportError:  # pragma: no cover - the package always ships kernels/
        return None
    return getattr(kernels, name, None)


def mean_over_queries(per_query: list[torch.Tensor]) -> torch.Tensor:
    """Combine log page scores of several query rows (a later turn fed in at once) as log mean exp."""
    if len(per_query) == 1:
        return per_query[0]
    stacked = torch.stack(per_query, 0)
    return torch.logsumexp(stacked, 0) - math.log(len(per_query))


def layer_output_metric(module, cache: dict) -> torch.Tensor:
    """G = sum_g W_g^T W_g per KV head for an attention module (o_proj, head_dim, num_key_value_groups),
    cached per weight tensor and version (computed once per layer)."""
    weight = module.o_proj.weight
    key = (id(weight), weight._version, weight.device)
    if key not in cache:
        d = int(module.head_dim)
        hq = weight.shape[1] // d
        hkv = hq // int(module.num_key_value_groups)
        if len(cache) > 256:
            cache.clear()
        cache[key] = output_metric(weight, hq, hkv)
    return cache[key]


@dataclass
class _BasisRetrieval(RetrievalPolicy):
    """Shared body of LOCKS and OVAL: a rank-r page basis per page and KV head, scored without keys."""

    rank: int = 8
    eta: float = 0.0
    max_page_tokens: int = 32  # page capacity T of the stored coefficients (pages are padded to it)

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"{self.name}: rank must be an int >= 1, got {self.rank!r}")
        if not isinstance(self.eta, (int, float)) or not 0.0 <= float(self.eta) <= 1.0:
            raise ConfigError(f"{self.name}: eta must lie in [0, 1], got {self.eta!r}")
        if isinstance(self.max_page_tokens, bool) or not isinstance(self.max_page_tokens, int):
            raise ConfigError(f"{self.name}: max_page_tokens must be an int, got {self.max_page_tokens!r}")
        self.eta = float(self.eta)
        self._metrics: dict = {}

    def summarize(self, pages: PageBatch) -> dict[str, torch.Tensor]:
        t = pages.keys.shape[-2]
        if t > self.max_page_tokens:
            raise ConfigError(
                f"{self.name}: a page of {t} tokens exceeds max_page_tokens={self.max_page_tokens}; "
                f"pass retrieval_options={{'max_page_tokens': {t}}} or use smaller pages"
            )
        metric = None
        if self.eta > 0:
            if pages.module is None or not hasattr(pages.module, "o_proj"):
                raise ConfigError(f"{self.name}: eta > 0 needs the layer's attention module (its o_proj)")
            metric = layer_output_metric(pages.module, self._metrics).to(pages.keys.device)[None, :, None]
        s = page_bases(
            pages.keys, pages.mask, rank=self.rank, eta=self.eta, values=pages.values, metric=metric
        )
        coef = torch.nn.functional.pad(s.coeffs, (0, 0, 0, self.max_page_tokens - t))
        return {"mu": s.centroid, "basis": s.basis, "coef": coef}

    def score_pages(self, ctx: DecodeContext) -> torch.Tensor:
        fn = _kernel("page_score_lowrank") or lowrank_page_scores
        sm = ctx.summaries
        rows = [
            fn(ctx.query[:, :, i], sm["mu"], sm["basis"], sm["coef"], ctx.page_len, ctx.scaling)
            for i in range(ctx.query.shape[2])
        ]
        return mean_over_queries(rows)


@register_retrieval
@dataclass
class LocksRetrieval(_BasisRetrieval):
    """LOCKS: page-local key PCA (the eta = 0 case of OVAL). Options: rank (8), max_page_tokens (32)."""

    name: ClassVar[str] = "locks"

    def __post_init__(self) -> None:
        if self.eta != 0.0:
            raise ConfigError("locks is OVAL with eta = 0; use retrieval 'oval' with an eta option instead")
        super().__post_init__()


@register_retrieval
@dataclass
class OvalRetrieval(_BasisRetrieval):
    """OVAL: output-aware page bases. Options: eta (0.5; 0 = LOCKS, 1 = output-only), rank (8),
    max_page_tokens (32)."""

    name: ClassVar[str] = "oval"
    eta: float = 0.5
