"""The yardstick: what every retrieval method and router is judged by, defined once, and the one way to see
a model's queries and keys to measure it. The stats' retrieval monitor, the router trainers, the KVP trace
capture, KVzip's pre-pass, the benchmarks and the tests all use these.

Exact attention and the page attention mass:
- `exact_attention`: the attention probabilities of one query per query head over a KV head's slots;
- `page_mass`: the exact attention mass of each page, the sum of the attention on its tokens, per query
  head or, with `kv_heads`, combined per KV head as the kernels combine a group (the mean of the group's
  query heads' page distributions, `group_mean`);
- `exact_page_log_mass`: the same from the keys laid out in pages, as a log and unnormalised (what LOCKS,
  OVAL and Quest estimate: log sum_i exp(scaling q . k_i) per page);
- `read_tokens` and `attention_mass_captured`: which tokens a page selection reads, and the share of the
  exact attention mass they hold.

Queries and keys: `capture_qk(model)` is a context manager under which every attention layer of the model's
language model runs SDPA as before and hands its queries, keys and values (after RoPE) to the capture; the
model's attention implementation is restored on exit.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

NEG_INF = float("-inf")


# ---- exact attention and the page attention mass ----------------------------------------------------------


def exact_attention(
    query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Exact attention probabilities of one query per query head over the slots: query (B, Hq, D), keys
    (B, Hkv, L, D) (the Hq / Hkv query heads of a KV head share its keys), valid (B, Hkv, L) -> (B, Hq, L)
    fp32 (0 on invalid slots; a head with no valid slot is all 0)."""
    B, Hq, D = query.shape
    Hkv = keys.shape[1]
    q = query.float().view(B, Hkv, Hq // Hkv, D)
    logits = torch.einsum("bhgd,bhld->bhgl", q, keys.float()) * scaling
    logits = logits.masked_fill(~valid.unsqueeze(2), NEG_INF)
    return torch.softmax(logits, -1).nan_to_num(0.0).reshape(B, Hq, -1)


def group_mean(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(..., Hq, X) per query head -> (..., Hkv, X): the mean over the query heads of each KV head's group
    (the kernels' GQA combination of page distributions)."""
    *lead, hq, n = x.shape
    return x.view(*lead, kv_heads, hq // kv_heads, n).mean(-2)


def page_mass(
    attn: torch.Tensor, token_page: torch.Tensor, n_pages: int, kv_heads: int | None = None
) -> torch.Tensor:
    """The exact attention mass of each page: the sum of the attention on its tokens.

    attn (..., H, N) attention probabilities of one query per head over N tokens; token_page (N,) or
    (..., Hkv, N) long, the page of each token (-1: in no page, its attention counts for none), its head
    axis 1, H or a divisor of H (the Hkv KV heads whose H / Hkv query heads share the layout). Returns
    (..., H, n_pages) in attn's dtype; with `kv_heads`, the group mean of the query heads' masses,
    (..., kv_heads, n_pages)."""
    h = attn.shape[-2]
    if token_page.dim() > 1 and token_page.shape[-2] not in (1, h):
        token_page = token_page.repeat_interleave(h // token_page.shape[-2], dim=-2)
    index = token_page.clamp(min=0).expand_as(attn)
    mass = attn.new_zeros(*attn.shape[:-1], n_pages).scatter_add_(-1, index, attn * (token_page >= 0))
    return mass if kv_heads is None else group_mean(mass, kv_heads)


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


def read_tokens(token_page: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
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


# ---- the Q/K capture ------------------------------------------------------------------------------------

CAPTURE_ATTN = "mm_oval_capture"  # the attention implementation a capture switches the language model to


@dataclass
class LayerQK:
    """One attention layer's call as the capture saw it (detached)."""

    query: torch.Tensor  # (B, Hq, T, D), after RoPE
    key: torch.Tensor  # (B, Hkv, S, D): every key the layer attends over (the cache's, then the new ones)
    value: torch.Tensor  # (B, Hkv, S, D)
    scaling: float  # the attention's softmax scale
    module: Any  # the attention module (its layer_idx, its config)


@dataclass
class QKCapture:
    """What `capture_qk` yields: each layer's last call in `layers` (by layer index), or, with `on_layer`,
    each call handed to it and nothing kept."""

    on_layer: Callable[[LayerQK], None] | None = None
    layers: dict[int, LayerQK] = field(default_factory=dict)

    def see(self, qk: LayerQK) -> None:
        if self.on_layer is not None:
            self.on_layer(qk)
        else:
            self.layers[int(qk.module.layer_idx)] = qk


_ACTIVE: contextvars.ContextVar[QKCapture | None] = contextvars.ContextVar("mm_oval_capture", default=None)


def _capture_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """The capture's attention function: hands the layer's queries and keys to the active capture, then
    computes the layer's output with SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    capture = _ACTIVE.get()
    if capture is not None and getattr(module, "layer_idx", None) is not None:
        s = scaling if scaling is not None else query.shape[-1] ** -0.5
        capture.see(LayerQK(query.detach(), key.detach(), value.detach(), s, module))
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if CAPTURE_ATTN not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(CAPTURE_ATTN, _capture_attention)
    if CAPTURE_ATTN not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(CAPTURE_ATTN, sdpa_mask)


def _attention_config(model: Any) -> Any:
    """The config whose `_attn_implementation` the language model's attention layers read: a LLaVA-style
    model's text config, a language model's (or a decoder layer's) own config, or the config itself."""
    from transformers import PretrainedConfig

    config = model if isinstance(model, PretrainedConfig) else model.config
    text = getattr(config, "text_config", None)
    return config if text is None else text


@contextmanager
def capture_qk(model: Any, on_layer: Callable[[LayerQK], None] | None = None) -> Iterator[QKCapture]:
    """Within the block, every attention layer of `model` (a LLaVA-style model, its language model, or the
    config its attention layers read) computes its output with SDPA, as the model's own SDPA would, and
    hands its queries, keys, values and scale to the capture this yields: kept per layer in
    `capture.layers` (the layer's last call), or passed to `on_layer` as they come. The vision tower is
    untouched; the model's attention implementation is restored on exit, and captures nest."""
    _register()
    config = _attention_config(model)
    capture = QKCapture(on_layer)
    old = config._attn_implementation
    config._attn_implementation = CAPTURE_ATTN
    token = _ACTIVE.set(capture)
    try:
        yield capture
    finally:
        _ACTIVE.reset(token)
        config._attn_implementation = old
