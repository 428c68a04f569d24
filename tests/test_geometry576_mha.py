"""LLaVA-1.5's image geometry with multi-head attention (LLaVA-1.5-7B has as many KV heads as query heads):
a random tiny model at 336 px / patch 14 (576 image tokens), 4 query heads and 4 KV heads, through the wrap's
eviction and retrieval paths: per KV head, the kept patches and the page reads land on the 24x24 grid."""

from __future__ import annotations

import pytest
import torch

from mm_oval.chat import Chat
from mm_oval.zoo.model import TinyLlavaSizes, build_tiny_llava
from mm_oval.zoo.scenes import make_scene

SIZES = TinyLlavaSizes(
    image_size=336, patch_size=14, vision_hidden=32, vision_layers=1, vision_heads=2, vision_feature_layer=-2,
    text_hidden=64, text_layers=2, text_heads=4, text_kv_heads=4, text_intermediate=64, text_head_dim=16,
)  # fmt: skip


@pytest.fixture(scope="module")
def mha():
    model, processor = build_tiny_llava(0, SIZES)
    return model, processor


def test_eviction_keeps_the_budget_of_each_kv_head_on_the_24x24_grid(mha):
    import random

    model, processor = mha
    assert model.config.text_config.num_key_value_heads == model.config.text_config.num_attention_heads
    image = make_scene(random.Random(0)).render()
    chat = Chat(
        model, processor, image, method="snapkv:sink_tokens=3,recent_tokens=0", budget=0.25, max_new_tokens=3
    )
    chat.ask("what color is the circle ?")
    kept = chat.kept_image_tokens()
    assert kept.shape == (2, 4, 24, 24)
    assert kept.sum((-1, -2)).eq(144).all()  # 25% of 576 for every layer and KV head


def test_retrieval_reads_pages_of_the_24x24_grid_for_each_kv_head(mha):
    import random

    model, processor = mha
    image = make_scene(random.Random(1)).render()
    chat = Chat(model, processor, image, method="full:retrieval=quest,read_budget=0.25", max_new_tokens=4,
                record_reads=True)  # fmt: skip
    chat.ask("what are the objects from left to right ?")
    reads = chat.page_reads()
    assert reads.shape == (2, 4, 24, 24)
    assert chat.decode_steps >= 1 and torch.isfinite(reads).all()
    frac = chat.stats()["page_read_fraction"]
    assert frac is not None and 0 < frac < 1
