"""mm_oval.geometry on tiny random LLaVA-NeXT, LLaVA-OneVision and Qwen2.5-VL models: the image tokens it
finds are those the model fills with image features (counts per image from the model's own feature code),
newline tokens where the model puts its image_newline, (row, col) that agree with Qwen's M-RoPE ids, and
clear errors for prompts that do not match their pixels and for families mm-oval cannot read."""

from __future__ import annotations

import pytest
import torch

from mm_oval.errors import DataError, ModelError
from mm_oval.geometry import GEOMETRY_INPUTS, family_of, image_geometry
from mm_oval.zoo.family import BUILDERS, chat_text, mixed_batch, random_image

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def family(request):
    model, processor = BUILDERS[request.param]()
    return request.param, model, processor


def _geometry(model, inputs):
    kw = {k: inputs[k] for k in GEOMETRY_INPUTS if k in inputs}
    return image_geometry(model, inputs["input_ids"], inputs.get("attention_mask"), **kw)


def _feature_lengths(name, model, inputs) -> list[int]:
    """Tokens per image as the model's own get_image_features makes them (the vision tower runs)."""
    with torch.no_grad():
        if name == "qwen2_5_vl":
            out = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        else:
            kw = {"batch_num_images": inputs["batch_num_images"]} if "batch_num_images" in inputs else {}
            out = model.model.get_image_features(inputs["pixel_values"], inputs["image_sizes"], **kw)
    return [int(f.shape[0]) for f in out.pooler_output]


def test_tokens_per_image_are_the_models_own_counts(family):
    name, model, processor = family
    inputs = mixed_batch(processor)
    geo = _geometry(model, inputs)
    found = [n for per_sample in geo.image_tokens for n in per_sample]
    assert found == _feature_lengths(name, model, inputs)
    assert len(geo.image_tokens[0]) == 2 and len(geo.image_tokens[1]) == 1
    if name == "llava_next":  # anyres: the wide and the tall image differ in size and token count
        assert found[0] != found[1]
    if name == "llava_onevision":  # several images in a sample: each its base view and a newline
        assert found[:2] == [17, 17] and found[2] > 17
    # every placeholder is an image token or a newline, nothing else is
    placeholder = inputs["input_ids"] == model.config.image_token_id
    assert torch.equal(geo.is_image | geo.is_newline, placeholder & inputs["attention_mask"].bool())
    assert not bool((geo.is_image & geo.is_newline).any())


def test_each_grid_is_a_full_rectangle_in_row_major_order(family):
    name, model, processor = family
    inputs = mixed_batch(processor)
    geo = _geometry(model, inputs)
    for b, grids in enumerate(geo.grids):
        for g, grid in enumerate(grids):
            mine = (geo.image_rc[b, :, 0] == g).nonzero().flatten()
            assert mine.numel() == grid.rows * grid.cols
            rc = geo.image_rc[b, mine, 1:]
            expect = torch.stack(
                torch.meshgrid(torch.arange(grid.rows), torch.arange(grid.cols), indexing="ij"), -1
            ).view(-1, 2)
            assert torch.equal(rc, expect)  # in prompt order, row by row
            assert int(mine[0]) == grid.start
    kinds = [g.kind for g in geo.grids[0]]
    if name == "qwen2_5_vl":
        assert kinds == ["image", "image"]
    elif name == "llava_next":  # anyres: each image is its base view and its high-resolution view
        assert kinds == ["base", "highres", "base", "highres"]
        assert [g.image for g in geo.grids[0]] == [0, 0, 1, 1]
    else:  # OneVision: several images in one sample are their base views only; one image is tiled
        assert kinds == ["base", "base"] and [g.kind for g in geo.grids[1]] == ["base", "highres"]
    if name != "qwen2_5_vl":
        assert (geo.grids[0][0].rows, geo.grids[0][0].cols) == (4, 4)  # 32 px / 8 px, no CLS left


def test_newline_tokens_are_where_the_model_puts_its_image_newline(family):
    name, model, processor = family
    if name == "qwen2_5_vl":
        pytest.skip("Qwen2.5-VL has no image-newline token")
    inputs = mixed_batch(processor)
    geo = _geometry(model, inputs)
    with torch.no_grad():
        kw = {"batch_num_images": inputs["batch_num_images"]} if "batch_num_images" in inputs else {}
        feats = torch.cat(
            model.model.get_image_features(inputs["pixel_values"], inputs["image_sizes"], **kw).pooler_output
        )
    where = (inputs["input_ids"] == model.config.image_token_id).nonzero()
    newline_rows = (feats == model.model.image_newline.to(feats)).all(-1)
    assert torch.equal(newline_rows, geo.is_newline[where[:, 0], where[:, 1]])
    # a high-resolution view has one newline after each of its rows
    for b, grids in enumerate(geo.grids):
        for g in grids:
            if g.kind == "highres":
                end = g.start + g.rows * (g.cols + 1)
                assert int(geo.is_newline[b, g.start : end].sum()) == g.rows


def test_qwen_rows_and_columns_agree_with_m_rope():
    model, processor = BUILDERS["qwen2_5_vl"]()
    inputs = mixed_batch(processor)
    geo = _geometry(model, inputs)
    pos, deltas = model.model.get_rope_index(
        inputs["input_ids"],
        mm_token_type_ids=inputs["mm_token_type_ids"],
        image_grid_thw=inputs["image_grid_thw"],
        attention_mask=inputs["attention_mask"],
    )
    assert torch.equal(geo.rope_positions, pos) and torch.equal(geo.rope_deltas, deltas.view(-1))
    for b, grids in enumerate(geo.grids):
        for g, grid in enumerate(grids):
            mine = geo.image_rc[b, :, 0] == g
            first = pos[1, b, grid.start]
            assert torch.equal(pos[1, b][mine] - first, geo.image_rc[b, mine, 1])
            assert torch.equal(pos[2, b][mine] - pos[2, b, grid.start], geo.image_rc[b, mine, 2])
    (a, b), (c, d) = [(g.rows, g.cols) for g in geo.grids[0]]
    assert (a, b) != (c, d) and a * b != c * d  # two images of different sizes: grids of their own


def test_onevision_base_view_has_no_cls_token_and_large_images_are_downsampled():
    model, processor = BUILDERS["llava_onevision"]()
    one = processor(
        images=[random_image(64, 64, 0)], text=[chat_text(processor, "what ?")], return_tensors="pt"
    )
    geo = _geometry(model, one)
    base, high = geo.grids[0]
    assert base.rows * base.cols == 16  # SigLIP: every patch, no CLS ("full" selection added one before)
    # 2 x 2 views of 4 x 4 = 8 x 8, past anyres_max_2 (32 tokens): downsampled to 5 x 5
    assert (high.rows, high.cols) == (5, 5)
    assert geo.image_tokens == [_feature_lengths("llava_onevision", model, one)]


def test_onevision_video_frames_are_grids():
    import numpy as np

    model, processor = BUILDERS["llava_onevision"]()
    frames = (np.random.default_rng(0).random((4, 32, 32, 3)) * 255).astype("uint8")
    content = [{"type": "video"}, {"type": "text", "text": "what color is the circle ?"}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    inputs = processor(videos=[frames], text=[text], return_tensors="pt")
    geo = _geometry(model, inputs)
    assert [(g.kind, g.rows, g.cols, g.video) for g in geo.grids[0]] == [("frame", 2, 2, True)] * 4
    with torch.no_grad():
        n = model.model.get_video_features(inputs["pixel_values_videos"]).pooler_output.shape[1]
    assert geo.image_tokens == [[n]] and int(geo.is_newline.sum()) == 1


def test_a_prompt_that_does_not_match_its_pixels_is_a_data_error(family):
    name, model, processor = family
    inputs = dict(mixed_batch(processor))
    ids = inputs["input_ids"].clone()
    first = int((ids[0] == model.config.image_token_id).nonzero()[0])
    ids[0, first] = processor.tokenizer.convert_tokens_to_ids("the")  # one placeholder less
    inputs["input_ids"] = ids
    with pytest.raises(DataError, match=r"holds \d+ image tokens but 3 image\(s\) were given.*processor"):
        _geometry(model, inputs)
    if name != "qwen2_5_vl":
        inputs = dict(mixed_batch(processor))
        del inputs["image_sizes"]
        with pytest.raises(DataError, match="needs image_sizes"):
            _geometry(model, inputs)


def test_a_family_whose_image_layout_is_unreadable_is_refused_naming_what_is_missing():
    from transformers import (
        GemmaConfig,
        PaliGemmaConfig,
        PaliGemmaForConditionalGeneration,
        SiglipVisionConfig,
    )

    import mm_oval

    vision = SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
        patch_size=8,
    )  # fmt: skip
    text = GemmaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8,
    )  # fmt: skip
    pali = PaliGemmaForConditionalGeneration(
        PaliGemmaConfig(vision_config=vision, text_config=text, image_token_index=63)
    )
    with pytest.raises(ModelError, match=r"model_type 'paligemma'.*LlavaNextForConditionalGeneration"):
        mm_oval.wrap(pali)
    assert not mm_oval.is_wrapped(pali)
    model, _ = BUILDERS["qwen2_5_vl"]()
    model.config.vision_config.__dict__["spatial_merge_size"] = None
    with pytest.raises(ModelError, match="lacks spatial_merge_size"):
        family_of(model)


def test_qwen_video_slices_are_grids_and_generate_exactly():
    import numpy as np

    import mm_oval

    model, processor = BUILDERS["qwen2_5_vl"]()
    frames = (np.random.default_rng(0).random((4, 32, 48, 3)) * 255).astype("uint8")
    content = [{"type": "video"}, {"type": "text", "text": "what color is the circle ?"}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    inputs = processor(
        videos=[frames], text=[text], return_tensors="pt", do_sample_frames=False, cap_pixels_per_frame=False
    )
    geo = _geometry(model, inputs)
    t, h, w = inputs["video_grid_thw"][0].tolist()  # 4 frames -> 2 temporal slices of 2 x 3 merged cells
    assert [(g.kind, g.rows, g.cols, g.video) for g in geo.grids[0]] == [("frame", h // 2, w // 2, True)] * t
    assert geo.image_tokens == [[t * (h // 2) * (w // 2)]]
    plain = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    mm_oval.wrap(model, method="snapkv", budget=1.0)
    try:
        assert model.generate(**inputs, max_new_tokens=3, do_sample=False).tolist() == plain.tolist()
    finally:
        mm_oval.unwrap(model)
