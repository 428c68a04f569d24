"""Page summaries that let a page be scored without reading its keys: LOCKS (key PCA, eta = 0) and OVAL
(output-aware bases, eta > 0) low-rank bases, and Quest's per-channel key bounds. Scoring them is the
kernels' (mm_oval.kernels: page_score_lowrank, page_score_quest); the policies are in pagebases.py
(LOCKS, OVAL) and quest.py (Quest).

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
(..., P, T) marks the slots that hold a token (pages may be partly filled).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..kernels.common.quant import (  # noqa: F401 (the policies' and router's quantisers)
    INT4_LEVEL,
    INT8_LEVEL,
    dequantize_int4_columns,
    dequantize_int8,
    fp16_scale,
    int4_levels,
    quantize_int4_columns,
    quantize_int8,
    safe_scale,
)
from ..kernels.lowrank_score.record import (  # noqa: F401 (the compact LOCKS / OVAL record)
    compact_basis_bytes,
    compact_page_bases,
    expand_page_bases,
    scoring_operands,
)


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


def _metric_gram(y: torch.Tensor, metric: torch.Tensor) -> torch.Tensor:
    """Y G Y^T per page: y (..., P, T, D), metric G (..., 1, D, D) shared by a head's pages (or one per
    page, (..., P, D, D)) -> (..., P, T, T). A shared G multiplies the head's P * T rows at once: a
    broadcasting `y @ G` would expand G into one D x D copy per page."""
    if metric.dim() > 2 and metric.shape[-3] != 1:
        return y @ metric @ y.transpose(-1, -2)
    *lead, p, t, d = y.shape
    yg = (y.reshape(*lead, 1, p * t, d) @ metric).reshape(*lead, p, t, d)
    return yg @ y.transpose(-1, -2)


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
        basis = _oval_basis(x, gram, lam, u, inv_sqrt, values, token_mask, metric, eta, rank)
    r_eff = basis.shape[-1]
    if r_eff < rank:  # pages shorter than the rank: pad with zero directions
        basis = torch.nn.functional.pad(basis, (0, rank - r_eff))
    coeffs = x @ basis  # (..., P, T, r)
    return PageBasisSummary(mu.to(out_dtype), basis.to(out_dtype), coeffs.to(out_dtype), token_mask)


def _oval_basis(x: torch.Tensor, gram: torch.Tensor, lam: torch.Tensor, u: torch.Tensor, inv_sqrt: torch.Tensor,
                values: torch.Tensor, token_mask: torch.Tensor, metric: torch.Tensor, eta: float,
                rank: int) -> torch.Tensor:  # fmt: skip
    """OVAL's basis (..., P, D, r') from the centred keys `x` and their Gram eigensystem (`lam`, `u`,
    `inv_sqrt` with discarded directions at zero): the top directions of the blend of key energy (1 - eta)
    and output energy through the metric (eta), each normalised by its trace."""
    t = x.shape[-2]
    m = token_mask.unsqueeze(-1).float()
    v = values.float()
    y = (v - _masked_mean(v, token_mask).unsqueeze(-2)) * m
    ygyt = _metric_gram(y, metric.float())  # (..., P, T, T)
    tr_k = gram.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(1e-30)  # tr(X^T X)
    tr_o = (ygyt * gram).sum((-1, -2)).clamp_min(1e-30)  # tr(X^T Y G Y^T X)
    eye = torch.eye(t, device=x.device, dtype=x.dtype)
    a = ((1.0 - eta) / tr_k)[..., None, None] * eye + (eta / tr_o)[..., None, None] * ygyt
    s = lam.sqrt()
    c = s.unsqueeze(-1) * (u.transpose(-1, -2) @ a @ u) * s.unsqueeze(-2)
    c = 0.5 * (c + c.transpose(-1, -2))
    sig, q = torch.linalg.eigh(c)
    order = torch.arange(t - 1, max(t - 1 - rank, -1), -1, device=x.device)
    q_top = q[..., order]  # (..., P, T, r')
    # rows of Q on discarded (zero) eigen-directions of the Gram are zero by construction of C
    basis = x.transpose(-1, -2) @ (u @ (inv_sqrt.unsqueeze(-1) * q_top))
    # directions C has no energy on carry no information: zero them rather than keep noise
    basis = basis * (sig[..., order] > sig[..., -1:].clamp_min(0.0) * 1e-6).unsqueeze(-2).float()
    return basis


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


def key_bounds(keys: torch.Tensor, token_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quest's summary: the per-channel minimum and maximum of each page's keys, in fp32 (exactly the
    keys' values: the Quest policy stores them in the keys' dtype).
    keys (..., P, T, D), token_mask (..., P, T) -> kmin, kmax (..., P, D); 0 for pages without tokens."""
    m = token_mask.unsqueeze(-1)
    k = keys.float()
    kmin = k.masked_fill(~m, float("inf")).amin(-2)
    kmax = k.masked_fill(~m, float("-inf")).amax(-2)
    empty = ~token_mask.any(-1, keepdim=True)
    return kmin.masked_fill(empty, 0.0), kmax.masked_fill(empty, 0.0)


# ---- compact summaries: the records stored quantised ----------------------------------------------------
#
# The quantisers and the compact LOCKS / OVAL record are the kernels' storage formats
# (mm_oval.kernels.common.quant, mm_oval.kernels.lowrank_score.record); Quest's compact record is below.

SUMMARY_FORMATS = ("float", "compact")


def check_summary_format(method: str, value: object) -> str:
    """The `summary_format` retrieval option of LOCKS, OVAL and Quest: one of SUMMARY_FORMATS."""
    if value not in SUMMARY_FORMATS:
        choices = ", ".join(repr(f) for f in SUMMARY_FORMATS)
        raise ConfigError(
            f"{method}: retrieval option summary_format must be one of {choices}, got {value!r} "
            "(pass e.g. retrieval_options={'summary_format': 'compact'})"
        )
    return str(value)


def compact_key_bounds(kmin: torch.Tensor, kmax: torch.Tensor) -> dict[str, torch.Tensor]:
    """Quest's compact record: kmin, kmax (..., P, D) -> {kmin_q, kmax_q (..., P, D) int8, bound_scale
    (..., P) fp16}, one scale per page for both, rounded outward (kmin down, kmax up: dequantised,
    kmin_q s <= kmin and kmax_q s >= kmax exactly), so the bound scale * sum_c max(q_c kmin_c, q_c kmax_c)
    stays an upper bound of scale * q . k for every key of the page (for keys up to 65504 * 127 in
    magnitude). 2 D + 2 bytes per page."""
    lo, hi = kmin.float(), kmax.float()
    scale = fp16_scale(torch.maximum(lo.abs().amax(-1), hi.abs().amax(-1)), INT8_LEVEL)
    s = safe_scale(scale).unsqueeze(-1)
    qlo = torch.floor(lo / s)
    qlo = torch.where(qlo * s > lo, qlo - 1, qlo)  # a division rounded up: one level further out
    qhi = torch.ceil(hi / s)
    qhi = torch.where(qhi * s < hi, qhi + 1, qhi)
    zero = (scale == 0).unsqueeze(-1)
    qlo, qhi = qlo.masked_fill(zero, 0.0), qhi.masked_fill(zero, 0.0)
    return {
        "kmin_q": qlo.clamp(-128, 127).to(torch.int8),
        "kmax_q": qhi.clamp(-128, 127).to(torch.int8),
        "bound_scale": scale,
    }


def expand_key_bounds(record: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `compact_key_bounds`: (kmin, kmax) fp32, each at or beyond the stored bound."""
    s = record["bound_scale"]
    return dequantize_int8(record["kmin_q"], s), dequantize_int8(record["kmax_q"], s)
