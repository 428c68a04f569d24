"""LOCKS and OVAL inside the wrapped tiny LLaVA: reading every page changes nothing, a partial read
budget reads that share of the image pages and still generates."""

import pytest
import torch
from PIL import Image

import mm_oval
from mm_oval.config import OvalConfig
from mm_oval.stats import get_stats

pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs(processor):
    msgs = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "what color is the circle ?"}],
        }
    ]
    prompt = processor.apply_chat_template(msgs, add_generation_prompt=True)
    torch.manual_seed(0)
    img = Image.fromarray((torch.rand(128, 128, 3) * 255).to(torch.uint8).numpy())
    return processor(images=[img, img], text=[prompt, prompt], return_tensors="pt")


@pytest.mark.parametrize("retrieval,options", [("locks", {}), ("oval", {"eta": 0.5})])
def test_reading_every_page_equals_the_unwrapped_model_and_a_budget_reads_its_share(
    tiny_random_llava, retrieval, options
):
    model, processor = tiny_random_llava
    inputs = _inputs(processor)
    plain = model.generate(
        **inputs, max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True
    )
    cfg = OvalConfig(
        retrieval=retrieval, retrieval_options=options, read_budget=1.0, sink_tokens=0, recent_tokens=0
    )
    wrapped = mm_oval.wrap(model, cfg)
    try:
        out = wrapped.generate(
            **inputs, max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
        assert out.sequences.tolist() == plain.sequences.tolist()
        for a, b in zip(out.scores, plain.scores):
            assert torch.allclose(a, b, atol=1e-4)
        assert get_stats(wrapped)["page_read_fraction"] == pytest.approx(1.0)
    finally:
        model = mm_oval.unwrap(wrapped)
    cfg = OvalConfig(
        retrieval=retrieval, retrieval_options=options, read_budget=0.25, sink_tokens=0, recent_tokens=0
    )
    wrapped = mm_oval.wrap(model, cfg)
    try:
        out = wrapped.generate(**inputs, max_new_tokens=6, do_sample=False)
        assert out.shape == plain.sequences.shape
        # 64 image tokens in 2x2 tiles: 16 candidate image pages per head, a quarter of them read
        assert get_stats(wrapped)["page_read_fraction"] == pytest.approx(0.25)
    finally:
        mm_oval.unwrap(wrapped)


def test_oval_on_top_of_eviction_reads_its_share_of_the_kept_image_pages(tiny_random_llava):
    model, processor = tiny_random_llava
    inputs = _inputs(processor)
    # 2x2 tiles: the tiny model's 8x8 grid has 4 tiles of 4x4, too few to read a share of after eviction
    cfg = OvalConfig(
        method="snapkv",
        budget=0.5,
        retrieval="oval",
        read_budget=0.5,
        retrieval_options={"rank": 2},
        image_tile=2,
    )
    wrapped = mm_oval.wrap(model, cfg)
    try:
        out = wrapped.generate(**inputs, max_new_tokens=4, do_sample=False)
        stats = get_stats(wrapped)
    finally:
        mm_oval.unwrap(wrapped)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 4
    assert stats["image_kv_fraction_kept"] == pytest.approx(0.5, abs=0.1)
    # per head, ceil(half) of the image pages that survived eviction (pinned ones excluded) are read
    assert 0.5 <= stats["page_read_fraction"] < 0.75
