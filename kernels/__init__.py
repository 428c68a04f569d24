"""Triton kernels for the hot paths, each beside its PyTorch reference; imported as mm_oval.kernels.

Every function dispatches: the Triton kernel for CUDA tensors, the reference (kernels/reference.py)
elsewhere; MM_OVAL_KERNELS=torch|triton forces one. Layouts and signatures: docs/kernels.md.
"""

# From a source checkout this directory is also importable as a top-level `kernels`, and transformers
# imports whatever `kernels` it finds to probe for the Hugging Face package of that name. Only the
# mm_oval.kernels import carries the package; the probe gets an empty module (no version: not used).
if __name__ == "mm_oval.kernels":
    from .dispatch import (
        HAS_TRITON,
        INTERPRETED,
        backend,
        compact_kv,
        kvp_score,
        merge_attention,
        page_score_lowrank,
        page_score_quest,
        select_pages,
        sparse_paged_decode,
    )
    from .pagetable import pad_selection, paginate, selected_token_count, selected_token_mask
    from .reference import KVPWeights

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
        "page_score_quest",
        "paginate",
        "select_pages",
        "selected_token_count",
        "selected_token_mask",
        "sparse_paged_decode",
    ]
