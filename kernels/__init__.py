"""Triton kernels for the hot paths, imported as mm_oval.kernels.

One folder per op, each with its Triton kernel (kernel.py), its PyTorch reference of the same
signature (naive.py) and the dispatching function (the folder's __init__): the Triton kernel for CUDA
tensors, the reference elsewhere; MM_OVAL_KERNELS=torch|triton forces one. What the ops share lives in
common/. Layouts and signatures: docs/kernels.md.

The names below are loaded on first use. Importing this package runs no code of the ops: from a source
checkout the folder is also importable as a top-level `kernels` (the checkout root is on `sys.path` under
`python -m` and pytest), which is the name of the Hugging Face Hub's kernels library that transformers
probes for by importing it; that import finds a module without a version and nothing else.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> the module (absolute) that defines it. Helpers only the tests use (dispatch.INTERPRETED,
# pagetable.pad_selection) are imported from their modules, not offered here.
_EXPORTS = {
    "HAS_TRITON": "mm_oval.kernels.common.dispatch",
    "backend": "mm_oval.kernels.common.dispatch",
    "paginate": "mm_oval.kernels.common.pagetable",
    "selected_token_count": "mm_oval.kernels.common.pagetable",
    "selected_token_mask": "mm_oval.kernels.common.pagetable",
    "compact_kv": "mm_oval.kernels.compact",
    "KVPWeights": "mm_oval.kernels.kvp",
    "kvp_score": "mm_oval.kernels.kvp",
    "page_score_lowrank": "mm_oval.kernels.lowrank_score",
    "page_score_lowrank_compact": "mm_oval.kernels.lowrank_score",
    "page_score_quest": "mm_oval.kernels.quest_score",
    "merge_attention": "mm_oval.kernels.sparse_decode",
    "sparse_paged_decode": "mm_oval.kernels.sparse_decode",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
