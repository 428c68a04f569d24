"""Dispatch: the Triton kernel for CUDA tensors, the op's PyTorch reference (its naive.py) elsewhere.

`MM_OVAL_KERNELS=torch` forces the references everywhere; `MM_OVAL_KERNELS=triton` forces the Triton
kernels, which on CPU tensors means Triton's interpreter: valid only when TRITON_INTERPRET=1 was set
before this package was imported (Triton decides interpretation when a kernel is defined).
"""

from __future__ import annotations

import logging
import os

import torch

from mm_oval.errors import ConfigError

log = logging.getLogger(__name__)

try:  # Triton is a Linux dependency; elsewhere every call uses the references
    from . import triton_utils

    HAS_TRITON = True
    INTERPRETED = triton_utils.INTERPRETED
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


def check(cond: bool, message: str) -> None:
    """Raise the ConfigError `message` unless `cond` (the ops' argument checks)."""
    if not cond:
        raise ConfigError(message)


def check_gqa(q: torch.Tensor, num_kv_heads: int, what: str) -> None:
    """q is one decode query per sequence, (B, Hq, D), with Hq a multiple of the KV heads."""
    check(q.dim() == 3, f"{what}: q must be (B, Hq, D) (one decode token per sequence), got {tuple(q.shape)}")
    check(
        q.shape[1] % num_kv_heads == 0,
        f"{what}: {q.shape[1]} query heads is not a multiple of {num_kv_heads} KV heads",
    )


def check_page_scores(q: torch.Tensor, summary: torch.Tensor, page_len: torch.Tensor, what: str) -> None:
    """The arguments every page-scoring op shares: q (B, Hq, D), a (B, Hkv, P, D) summary, page_len
    (B, Hkv, P)."""
    check(summary.dim() == 4, f"{what}: page summaries must be (B, Hkv, P, D), got {tuple(summary.shape)}")
    B, Hkv, P, D = summary.shape
    check_gqa(q, Hkv, what)
    check(
        q.shape[0] == B and q.shape[2] == D,
        f"{what}: q {tuple(q.shape)} does not match the page summaries {tuple(summary.shape)}",
    )
    check(page_len.shape == (B, Hkv, P), f"{what}: page_len must be (B, Hkv, P) = ({B}, {Hkv}, {P})")
