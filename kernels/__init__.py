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
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from typing import Any


def _hand_over_to_the_hub_package() -> None:
    """Imported as the top-level `kernels` (the checkout root first on sys.path, e.g. `python -m` or
    pytest from the checkout) while the Hugging Face Hub's `kernels` package is installed (lmms-eval's
    dependencies bring it): transformers then imports names of that package, so the installed one is
    loaded in this module's place. The name is the only way to tell the two imports of this folder apart."""
    here = Path(__file__).resolve().parent.parent
    path = [p for p in sys.path if Path(p or ".").resolve() != here]
    spec = importlib.machinery.PathFinder.find_spec("kernels", path)
    if spec is None or spec.loader is None:
        return  # not installed: this module stays, without a version (transformers then ignores it)
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module  # what the import statement that loaded this folder returns
    spec.loader.exec_module(module)


if __name__ == "kernels":
    _hand_over_to_the_hub_package()

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
    "page_log_mass_lowrank": "mm_oval.kernels.lowrank_score",
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
