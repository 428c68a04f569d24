"""The public kernel functions: argument checks, then the Triton kernel on CUDA tensors and the
PyTorch reference elsewhere.

`MM_OVAL_KERNELS=torch` forces the references everywhere; `MM_OVAL_KERNELS=triton` forces the Triton
kernels, which on CPU tensors means Triton's interpreter: valid only when TRITON_INTERPRET=1 was set
before this package was imported (Triton decides interpretation when a kernel is defined).
"""

from __future__ import annotations

import logging
import os

import torch

from ..errors import ConfigError
from . import reference as ref
from .reference import KVPWeights

log = logging.getLogger(__name__)

try:  # Triton is a Linux dependency; elsewhere every call uses the references
    from . import compact as _compact
    from . import kvp_score as _kvp
    from . import page_score as _page
    from . import sparse_decode as _decode
    from . import topk as _topk

    HAS_TRITON = True
    INTERPRETED = type(_decode._sparse_decode_kernel).__name__ == "InterpretedFunction"
except ImportError as exc:  # pragma: no cover - depends on the platform
    HAS_TRITON, INTERPRETED = False, False
    log.info("triton is not importable (%s): mm_oval.kernels uses the PyTorch references", exc)

ENV = "MM_OVAL_KERNELS"


def backend(*tensors: torch.Tensor) -> str:
    """'triton' or 'torch' for a call on these tensors (see the module doc for MM_OVAL_KERNELS)."""
    forced = os.environ.get(ENV, "").strip().lower()
    if forced not in ("", "auto", "torch", "triton"):
        raise ConfigError(f"{ENV}={forced!r} is not understood; use 'torch', 'triton' or leave it unset")
    if forced == "torch":
        return "torch"
    on_cuda = all(t.is_cuda for t in tensors)
    if forced == "triton":
        if not HAS_TRITON:
            raise ConfigError(f"{ENV}=triton but triton is not importable; install triton or unset {ENV}")
        if not on_cuda and not INTERPRETED:
            raise ConfigError(
                f"{ENV}=triton on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 before "
                f"importing mm_oval.kernels, or unset {ENV} to use the PyTorch reference on CPU"
            )
        return "triton"
    if on_cuda and HAS_TRITON and not INTERPRETED:
        return "triton"
    return "torch"


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _check_gqa(q: torch.Tensor, num_kv_heads: int, what: str) -> None:
    _check(
        q.dim() == 3, f"{what}: q must be (B, Hq, D) (one decode token per sequence), got {tuple(q.shape)}"
    )
    _check(
        q.shape[1] % num_kv_heads == 0,
        f"{what}: {q.shape[1]} query heads is not a multiple of {num_kv_heads} KV heads",
    )


def sparse_paged_decode(
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
    """Decode attention over the selected pages of each KV head -> (out (B, Hq, D), lse (B, Hq) fp32).
    Layout: docs/kernels.md. `page_idx` entries of a head must be distinct (select_pages ensures it).
    Pass `max_page_len` (>= every page_len, e.g. the cache's page capacity) to spare a device sync."""
    what = "sparse_paged_decode"
    _check(
        k_cache.dim() == 4 and v_cache.shape == k_cache.shape,
        f"{what}: k_cache and v_cache must both be (B, Hkv, N, D)",
    )
    _check_gqa(q, k_cache.shape[1], what)
    B, Hkv = k_cache.shape[:2]
    _check(
        q.shape[0] == B and q.shape[2] == k_cache.shape[3],
        f"{what}: q {tuple(q.shape)} does not match the cache {tuple(k_cache.shape)}",
    )
    _check(
        page_start.shape == page_len.shape and page_start.shape[:2] == (B, Hkv),
        f"{what}: page_start and page_len must both be (B, Hkv, P) = ({B}, {Hkv}, P)",
    )
    _check(page_idx.dim() == 3 and page_idx.shape[:2] == (B, Hkv), f"{what}: page_idx must be (B, Hkv, S)")
    _check(num_splits is None or num_splits >= 1, f"{what}: num_splits must be >= 1")
    fn = (
        _decode.sparse_paged_decode_triton if backend(q, k_cache) == "triton" else ref.sparse_paged_decode_ref
    )
    return fn(q, k_cache, v_cache, page_start, page_len, page_idx, scale, num_splits, max_page_len)


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint tokens (a few element-wise ops: torch on every
    device)."""
    _check(
        out_a.shape == out_b.shape and lse_a.shape == lse_b.shape,
        "merge_attention: shapes of the two parts differ",
    )
    return ref.merge_attention_ref(out_a, lse_a, out_b, lse_b)


def page_score_lowrank(
    q: torch.Tensor,
    mu: torch.Tensor,
    basis: torch.Tensor,
    coef: torch.Tensor,
    page_len: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """LOCKS / OVAL page scores, GQA-combined: (B, Hkv, P) fp32 = log(mean_g softmax_pages(s_g))."""
    what = "page_score_lowrank"
    _check(mu.dim() == 4, f"{what}: mu must be (B, Hkv, P, D), got {tuple(mu.shape)}")
    B, Hkv, P, D = mu.shape
    _check_gqa(q, Hkv, what)
    _check(
        basis.dim() == 5 and basis.shape[:4] == (B, Hkv, P, D),
        f"{what}: basis must be (B, Hkv, P, D, R) = ({B}, {Hkv}, {P}, {D}, R)",
    )
    R = basis.shape[4]
    _check(
        coef.dim() == 5 and coef.shape[:3] == (B, Hkv, P) and coef.shape[4] == R,
        f"{what}: coef must be (B, Hkv, P, T, R) with R = {R}",
    )
    _check(page_len.shape == (B, Hkv, P), f"{what}: page_len must be (B, Hkv, P) = ({B}, {Hkv}, {P})")
    _check(
        q.shape[0] == B and q.shape[2] == D, f"{what}: q {tuple(q.shape)} does not match mu {tuple(mu.shape)}"
    )
    fn = _page.page_score_lowrank_triton if backend(q, mu) == "triton" else ref.page_score_lowrank_ref
    return fn(q, mu, basis, coef, page_len, scale)


def page_score_quest(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    page_len: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Quest bound page scores, GQA-combined: (B, Hkv, P) fp32."""
    what = "page_score_quest"
    _check(kmin.dim() == 4 and kmax.shape == kmin.shape, f"{what}: kmin and kmax must both be (B, Hkv, P, D)")
    B, Hkv, P, D = kmin.shape
    _check_gqa(q, Hkv, what)
    _check(
        q.shape[0] == B and q.shape[2] == D,
        f"{what}: q {tuple(q.shape)} does not match kmin {tuple(kmin.shape)}",
    )
    _check(page_len.shape == (B, Hkv, P), f"{what}: page_len must be (B, Hkv, P) = ({B}, {Hkv}, {P})")
    fn = _page.page_score_quest_triton if backend(q, kmin) == "triton" else ref.page_score_quest_ref
    return fn(q, kmin, kmax, page_len, scale)


def select_pages(scores: torch.Tensor, k: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Top-k pages per (batch, KV head), the `keep` pages first -> (B, Hkv, k) int32, -1 pads."""
    what = "select_pages"
    _check(scores.dim() == 3, f"{what}: scores must be (B, Hkv, P), got {tuple(scores.shape)}")
    _check(k >= 0, f"{what}: k must be >= 0, got {k}")
    if keep is not None:
        _check(keep.dim() == 3 and keep.shape[:2] == scores.shape[:2], f"{what}: keep must be (B, Hkv, K0)")
        _check(
            keep.shape[-1] <= k,
            f"{what}: {keep.shape[-1]} always-kept pages do not fit a budget of {k} pages; raise the page budget",
        )
    fn = _topk.select_pages_triton if backend(scores) == "triton" else ref.select_pages_ref
    return fn(scores, k, keep)


def kvp_score(
    keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, weights: KVPWeights
) -> torch.Tensor:
    """Scores of the KVP agents of one layer: keys, values (B, H, N, D), positions (B, N) -> (B, H, N)."""
    what = "kvp_score"
    _check(
        keys.dim() == 4 and values.shape == keys.shape, f"{what}: keys and values must both be (B, H, N, D)"
    )
    B, H, N, D = keys.shape
    _check(
        positions.shape == (B, N),
        f"{what}: positions must be (B, N) = ({B}, {N}), got {tuple(positions.shape)}",
    )
    _check(
        weights.num_heads == H and weights.head_dim == D,
        f"{what}: the agents are for {weights.num_heads} heads of dim {weights.head_dim}, the layer has {H} of dim {D}",
    )
    fn = _kvp.kvp_score_triton if backend(keys) == "triton" else ref.kvp_score_ref
    return fn(keys, values, positions, weights)


def compact_kv(
    k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, capacity: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather the kept tokens of each head: index (B, H, M), -1 pads -> (B, H, capacity or M, D) each."""
    what = "compact_kv"
    _check(k.dim() == 4 and v.shape == k.shape, f"{what}: k and v must both be (B, H, N, D)")
    _check(index.dim() == 3 and index.shape[:2] == k.shape[:2], f"{what}: index must be (B, H, M)")
    _check(
        capacity is None or capacity >= index.shape[-1],
        f"{what}: capacity {capacity} < {index.shape[-1]} kept tokens",
    )
    fn = _compact.compact_kv_triton if backend(k) == "triton" else ref.compact_kv_ref
    return fn(k, v, index, capacity)


__all__ = [
    "HAS_TRITON",
    "INTERPRETED",
    "KVPWeights",
    "backend",
    "compact_kv",
    "kvp_score",
    "merge_attention",
    "page_score_lowrank",
    "page_score_quest",
    "select_pages",
    "sparse_paged_decode",
]
