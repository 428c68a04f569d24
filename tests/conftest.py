import os

# Triton kernels run on the CPU through the interpreter in tests; it must be set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_random_llava():
    """A randomly initialised tiny LLaVA (64 image tokens, 4 layers, 4 query / 2 KV heads) and its processor."""
    from mm_oval.zoo.model import build_tiny_llava

    return build_tiny_llava(seed=0)
