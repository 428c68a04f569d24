"""The router inside the wrapped tiny LLaVA, `mm-oval train-router` end to end, and the open_clip path."""

import json
import sys

import pytest
import torch
from PIL import Image

import mm_oval
from mm_oval.config import OvalConfig
from mm_oval.errors import ConfigError, ModelError
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
    img2 = Image.fromarray((torch.rand(128, 128, 3) * 255).to(torch.uint8).numpy())
    return processor(images=[img, img2], text=[prompt, prompt], return_tensors="pt")


def test_router_with_every_page_equals_the_unwrapped_model_and_a_budget_reads_its_share(
    tiny_random_llava, tmp_path
):
    from mm_oval.policies.router import save_router
    from mm_oval.training.router import new_router

    model, processor = tiny_random_llava
    torch.manual_seed(0)
    save_router(new_router(model), tmp_path)
    inputs = _inputs(processor)
    plain = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    opts = {"weights": str(tmp_path)}
    wrapped = mm_oval.wrap(model, OvalConfig(retrieval="router", retrieval_options=opts, read_budget=1.0))
    try:
        assert wrapped.generate(**inputs, max_new_tokens=5, do_sample=False).tolist() == plain.tolist()
    finally:
        model = mm_oval.unwrap(wrapped)
    cfg = OvalConfig(
        retrieval="router", retrieval_options=opts, read_budget=0.25, sink_tokens=0, recent_tokens=0
    )
    wrapped = mm_oval.wrap(model, cfg)
    try:
        out = wrapped.generate(**inputs, max_new_tokens=5, do_sample=False)
        assert out.shape == plain.shape
        assert get_stats(wrapped)["page_read_fraction"] == pytest.approx(0.25)
    finally:
        mm_oval.unwrap(wrapped)


def test_router_policy_reports_what_the_cache_must_provide(tiny_random_llava, tmp_path):
    from mm_oval.policies.base import IMAGE, PageBatch, make_retrieval
    from mm_oval.policies.router import save_router
    from mm_oval.training.router import new_router

    model, _ = tiny_random_llava
    save_router(new_router(model), tmp_path)
    policy = make_retrieval("router", weights=str(tmp_path))
    k = torch.randn(1, 2, 3, 4, 32)
    pages = PageBatch(
        0, k, k, torch.ones(1, 2, 3, 4, dtype=torch.bool), torch.full((1, 2, 3), IMAGE, dtype=torch.int8), 0
    )
    with pytest.raises(ConfigError, match="inputs_embeds"):
        policy.summarize(pages)


def test_train_router_command_writes_a_loadable_router_for_that_model(tiny_random_llava, tmp_path):
    from mm_oval.cli import main
    from mm_oval.policies.router import load_router

    model, processor = tiny_random_llava
    model.save_pretrained(tmp_path / "model")
    processor.save_pretrained(tmp_path / "model")
    out = tmp_path / "router"
    rc = main(
        ["train-router", "--model", str(tmp_path / "model"), "--data", "zoo:3", "--val", "zoo:2"]
        + ["--epochs", "2", "--max-new-tokens", "2", "--out", str(out)]
    )
    assert rc == 0
    history = json.loads((out / "history.json").read_text())["history"]
    assert len(history) == 2 and 0.0 <= history[-1]["val_router"] <= history[-1]["val_oracle"] + 1e-6
    router = load_router(out, model)
    assert router.config.page_init == "pca"
    assert main(["train-router", "--out", str(out), "--lora-only"]) == 2  # needs --init: a clear error


TINY_CLIP = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 16, "head_width": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


@pytest.fixture(scope="module")
def tiny_clip_name(tmp_path_factory):
    import open_clip

    d = tmp_path_factory.mktemp("clipcfg")
    (d / "mm-oval-test-tiny-clip.json").write_text(json.dumps(TINY_CLIP))
    open_clip.add_model_config(d)
    return "mm-oval-test-tiny-clip"


def test_open_clip_encoder_embeds_crops_and_text_into_one_space_and_fits_the_page_projection(
    tiny_clip_name, tiny_random_llava
):
    from mm_oval.training.router import (
        OpenClipPageEncoder,
        capture_router_data,
        clip_page_init,
        new_router,
        zoo_prompts,
    )

    enc = OpenClipPageEncoder(tiny_clip_name, pretrained=None)  # random weights, nothing downloaded
    assert enc.dim == 16
    img = enc.encode_images([Image.new("RGB", (40, 40), "red"), Image.new("RGB", (40, 40), "blue")])
    txt = enc.encode_texts(["red circle", "what color is the square ?"])
    assert img.shape == txt.shape == (2, 16)
    assert torch.allclose(img.norm(dim=-1), torch.ones(2), atol=1e-5)
    model, processor = tiny_random_llava
    samples = capture_router_data(
        model, processor, zoo_prompts(2, 7), max_new_tokens=1, keep_tiles=True, image_tile=2
    )
    tiles = samples[0].tiles
    assert len(tiles) == samples[0].content.shape[0]
    kinds = samples[0].kind.tolist()
    assert all(isinstance(t, str) == (k == 0) for t, k in zip(tiles, kinds))
    assert sum(not isinstance(t, str) for t in tiles) == 16  # 8x8 patches in 2x2 tiles
    router = new_router(model, route_dim=enc.dim)
    clip_page_init(router, samples, enc, tiny_clip_name)
    assert router.config.page_init == f"open_clip:{tiny_clip_name}"
    with pytest.raises(ConfigError, match="route_dim"):
        clip_page_init(new_router(model, route_dim=8), samples, enc, tiny_clip_name)


def test_open_clip_missing_is_a_clear_error_naming_the_extra(monkeypatch):
    from mm_oval.training.router import OpenClipPageEncoder

    monkeypatch.setitem(sys.modules, "open_clip", None)  # what `import open_clip` meets when not installed
    with pytest.raises(ConfigError, match=r"pip install 'mm-oval\[router-train\]'"):
        OpenClipPageEncoder("ViT-B-32")


def test_open_clip_weights_that_cannot_be_loaded_offline_are_a_clear_error(tiny_clip_name, tmp_path):
    from mm_oval.training.router import OpenClipPageEncoder

    with pytest.raises(ModelError, match="--clip-pretrained"):
        OpenClipPageEncoder(tiny_clip_name, pretrained=str(tmp_path / "no-such-checkpoint.bin"))
    with pytest.raises(ModelError, match="cannot load"):
        OpenClipPageEncoder(tiny_clip_name, pretrained="laion2b_s34b_b79k")  # no such tag for this model
    with pytest.raises(ConfigError, match="unknown open_clip model"):
        OpenClipPageEncoder("no-such-clip")
