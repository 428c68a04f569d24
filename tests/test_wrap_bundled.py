"""The bundled trained tiny LLaVA: wrapped at budget 1.0 it answers exactly as the plain model (batch 1
and a left-padded batch of 3); skipped only while the checkpoint is not in the package."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

import mm_oval
from mm_oval.errors import ModelError


@pytest.fixture(scope="module")
def bundled():
    from mm_oval.zoo import bundled_model_path

    try:
        path = bundled_model_path()
    except ModelError as e:
        pytest.skip(f"bundled model not built yet: {e}")
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(path).eval()
    return model, AutoProcessor.from_pretrained(path)


def _images(n: int) -> list[Image.Image]:
    g = torch.Generator().manual_seed(11)
    return [
        Image.fromarray((torch.rand(128, 128, 3, generator=g) * 255).to(torch.uint8).numpy())
        for _ in range(n)
    ]


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("spec", ["full", "snapkv"])
def test_bundled_model_at_budget_one_answers_as_the_plain_model(bundled, n, spec):
    model, processor = bundled
    questions = [
        "what color is the circle ?",
        "how many red objects are there ?",
        "what shape is the blue object ?",
    ]
    texts = [f"USER: <image>\n{q} ASSISTANT:" for q in questions[:n]]
    inputs = processor(images=_images(n), text=texts, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    plain = model.generate(**inputs, **kw)
    try:
        mm_oval.wrap(model, method=spec, budget=1.0)
        out = model.generate(**inputs, **kw)
    finally:
        mm_oval.unwrap(model)
    assert out.sequences.tolist() == plain.sequences.tolist()
    for a, b in zip(out.scores, plain.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
