"""Triton kernels for the hot paths, imported as mm_oval.kernels.

One folder per op, each with its Triton kernel (kernel.py), its PyTorch reference of the same
signature (naive.py) and the dispatching function (the folder's __init__): the Triton kernel for CUDA
tensors, the reference elsewhere; MM_OVAL_KERNELS=torch|triton forces one. What the ops share lives in
common/. Layouts and signatures: docs/kernels.md.
"""

# From a source checkout this directory is also importable as a top-level `kernels`, and transformers
# imports whatever `kernels` it finds to probe for the Hugging Face package of that name. Only the
# mm_oval.kernels import carries the package; the probe gets an empty module (no version: not used).
if __name__ == "mm_oval.kernels":
    from .common.dispatch import HAS_TRITON, INTERPRETED, backend
    from .common.pagetable import pad_selection, paginate, selected_token_count, selected_token_mask
    from .compact import compact_kv
    from .kvp import KVPWeights, kvp_score
    from .lowrank_score import page_score_lowrank, page_score_lowrank_compact
    from .quest_score import page_score_quest
    from .sparse_decode import merge_attention, sparse_paged_decode

    __all__ = [
        "HAS_TRITON",
        "INTERPRETED",
        "KVPWeights",
        "backend",
        "compact_kv",
        "kvp_score",
        "merge_attention",
        "pad_selection",
        "page_score_lowrank",
        "page_score_lowrank_compact",
        "page_score_quest",
        "paginate",
        "selected_token_count",
        "selected_token_mask",
        "sparse_paged_decode",
    ]
