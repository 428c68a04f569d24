"""Tiny random models of the LLaVA-style family beyond LLaVA-1.5, built from their config classes in-process
(seconds on a CPU, nothing downloaded), each with the processor its class uses:

- `build_tiny_llava_next`: LlavaNextForConditionalGeneration (CLIP tower, anyres tiling, an image-newline
  token after each row of the high-resolution view), LlavaNextProcessor;
- `build_tiny_llava_onevision`: LlavaOnevisionForConditionalGeneration (SigLIP tower without CLS, "full"
  feature selection, anyres-max downsampling, video frames), LlavaOnevisionProcessor;
- `build_tiny_qwen2_5_vl`: Qwen2_5_VLForConditionalGeneration (dynamic resolution, 2x2 patch merging,
  M-RoPE), Qwen2_5_VLProcessor.

The tokenizer is word-level over the bundled vocabulary plus each family's special tokens; each processor
has a chat template laid out as the real model's is. These models are what the tests of the family use
for mechanics (exactness at budget 1.0, kept bytes, retrieval, chat); they say nothing about quality.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedTokenizerFast

from .model import build_tokenizer
from .vocab import vocabulary

FAMILY_SPECIAL = [
    "<image>",
    "<video>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|im_start|>",
    "<|im_end|>",
    "[INST]",
    "[/INST]",
]
FAMILY_WORDS = ["user", "assistant", "system"]

# the real templates' layout: Mistral's [INST] for LLaVA-NeXT-Mistral, ChatML for OneVision and Qwen2.5-VL
NEXT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}[INST] "
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n{% endif %}{% endfor %}"
    "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %} [/INST]"
    "{% else %} {% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}"
    "</s>{% endif %}{% endfor %}"
)
ONEVISION_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n{% endif %}"
    "{% if c['type'] == 'video' %}<video>\n{% endif %}{% endfor %}"
    "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_family_tokenizer(
    chat_template: str, bos: bool = True, image_token: str = "<image>", video_token: str = "<video>"
) -> PreTrainedTokenizerFast:
    """A word-level fast tokenizer: the bundled vocabulary, the family's special tokens (each one id), left
    padding, `chat_template`. `bos`: prepend <s> (LLaVA-NeXT-Mistral does; ChatML models do not);
    `image_token`/`video_token`: the placeholders the processor expands."""
    words: list[str] = []
    for w in [*vocabulary(), *FAMILY_SPECIAL, *FAMILY_WORDS]:
        if w not in words:
            words.append(w)
    return build_tokenizer(
        words,
        bos=bos,
        eos="</s>" if bos else "<|im_end|>",
        special={"image_token": image_token, "video_token": video_token},
        additional=FAMILY_SPECIAL,
        chat_template=chat_template,
    )


def _text_kwargs(tok: PreTrainedTokenizerFast, layers: int, hidden: int, heads: int, kv_heads: int) -> dict:
    return dict(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )


def _finish(model: Any, tok: PreTrainedTokenizerFast) -> Any:
    model.eval()
    gen = model.generation_config
    gen.pad_token_id = tok.pad_token_id
    gen.eos_token_id = tok.eos_token_id
    gen.bos_token_id = tok.bos_token_id
    gen.do_sample = False
    return model


# the tiles: 32 px views of 8 px patches (4 x 4 tokens each); up to 2 x 2 views
PINPOINTS = [[32, 64], [64, 32], [64, 64]]


def build_tiny_llava_next(seed: int = 0, attn_implementation: str = "sdpa") -> tuple[Any, Any]:
    """A random tiny LLaVA-NeXT (CLIP 32 px / 8 px patches: 16 base tokens; anyres up to 2 x 2 views; Llama
    2 layers, 4 query / 2 KV heads) and its LlavaNextProcessor."""
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessor,
        LlavaNextProcessor,
    )

    tok = build_family_tokenizer(NEXT_TEMPLATE, bos=True)
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
        patch_size=8, projection_dim=32,
    )  # fmt: skip
    text = LlamaConfig(**_text_kwargs(tok, 2, 64, 4, 2), head_dim=16)
    cfg = LlavaNextConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        image_grid_pinpoints=PINPOINTS,
        image_seq_length=16,
        pad_token_id=tok.pad_token_id,
    )
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = _finish(LlavaNextForConditionalGeneration(cfg), tok)
    image_processor = LlavaNextImageProcessor(
        size={"shortest_edge": 32},
        crop_size={"height": 32, "width": 32},
        image_grid_pinpoints=PINPOINTS,
        do_center_crop=True,
    )
    processor = LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=NEXT_TEMPLATE,
    )
    return model, processor


def build_tiny_llava_onevision(
    seed: int = 0, attn_implementation: str = "sdpa", vision_aspect_ratio: str = "anyres_max_2"
) -> tuple[Any, Any]:
    """A random tiny LLaVA-OneVision (SigLIP 32 px / 8 px patches, no CLS: 16 base tokens with "full"
    selection; anyres up to 2 x 2 views, downsampled past `vision_aspect_ratio`; Qwen2 2 layers) and its
    LlavaOnevisionProcessor (images and videos)."""
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
        Qwen2Config,
        SiglipVisionConfig,
    )

    tok = build_family_tokenizer(ONEVISION_TEMPLATE, bos=False)
    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
        patch_size=8, vision_use_head=False,
    )  # fmt: skip
    text = Qwen2Config(**_text_kwargs(tok, 2, 64, 4, 2))
    cfg = LlavaOnevisionConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        video_token_index=tok.convert_tokens_to_ids("<video>"),
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        image_grid_pinpoints=PINPOINTS,
        vision_aspect_ratio=vision_aspect_ratio,
    )
    cfg.pad_token_id = tok.pad_token_id
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = _finish(LlavaOnevisionForConditionalGeneration(cfg), tok)
    image_processor = LlavaOnevisionImageProcessor(
        size={"height": 32, "width": 32}, image_grid_pinpoints=PINPOINTS
    )
    video_processor = LlavaOnevisionVideoProcessor(size={"height": 32, "width": 32})
    processor = LlavaOnevisionProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        video_processor=video_processor,
        num_image_tokens=16,
        vision_feature_select_strategy="full",
        chat_template=ONEVISION_TEMPLATE,
        vision_aspect_ratio=vision_aspect_ratio,
    )
    return model, processor


def _build_tiny_qwen(config_cls: Any, model_cls: Any, processor_cls: Any, vision: dict, seed: int,
                     attn_implementation: str) -> tuple[Any, Any]:  # fmt: skip
    """A random tiny Qwen-VL of `config_cls` (8 px patches merged 2 x 2: a 16 px cell per image token, any
    image size between 32 x 32 and 96 x 96 px; M-RoPE sections (2, 3, 3) over a 16-dim head; 2 layers)."""
    from transformers import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tok = build_family_tokenizer(
        QWEN_TEMPLATE, bos=False, image_token="<|image_pad|>", video_token="<|video_pad|>"
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in FAMILY_SPECIAL}
    text = _text_kwargs(tok, 2, 64, 4, 2)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    cfg = config_cls(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    cfg.pad_token_id = tok.pad_token_id
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = _finish(model_cls(cfg), tok)
    image_processor = Qwen2VLImageProcessor(
        patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32, max_pixels=96 * 96
    )
    video_processor = Qwen2VLVideoProcessor(
        patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32, max_pixels=64 * 64
    )
    processor = processor_cls(
        image_processor=image_processor,
        tokenizer=tok,
        video_processor=video_processor,
        chat_template=QWEN_TEMPLATE,
    )
    return model, processor


def build_tiny_qwen2_5_vl(seed: int = 0, attn_implementation: str = "sdpa") -> tuple[Any, Any]:
    """A random tiny Qwen2.5-VL (`_build_tiny_qwen`, with window attention) and its Qwen2_5_VLProcessor."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor

    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, spatial_merge_size=2,
        temporal_patch_size=2, window_size=32, out_hidden_size=64, fullatt_block_indexes=[1],
    )  # fmt: skip
    return _build_tiny_qwen(
        Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor, vision, seed,
        attn_implementation,
    )  # fmt: skip


def build_tiny_qwen2_vl(seed: int = 0, attn_implementation: str = "sdpa") -> tuple[Any, Any]:
    """A random tiny Qwen2-VL (the Qwen2.5-VL layout without window attention) and its Qwen2VLProcessor."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor

    vision = dict(
        depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, patch_size=8, spatial_merge_size=2,
        temporal_patch_size=2,
    )  # fmt: skip
    return _build_tiny_qwen(
        Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor, vision, seed, attn_implementation
    )


BUILDERS = {
    "llava_next": build_tiny_llava_next,
    "llava_onevision": build_tiny_llava_onevision,
    "qwen2_5_vl": build_tiny_qwen2_5_vl,
}


def random_image(height: int, width: int, seed: int = 0) -> Any:
    """A random RGB PIL image of `height` x `width` pixels (tests and examples)."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(height, width, 3, generator=g) * 255).to(torch.uint8).numpy())


def chat_text(processor: Any, question: str, n_images: int = 1) -> str:
    """One user turn of `n_images` images and `question`, through the processor's chat template."""
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": question}]
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)


def mixed_batch(processor: Any) -> Any:
    """A two-sample batch: two images of different sizes (wide 40 x 70, tall 64 x 48) in the first prompt,
    one square image and a longer question in the second; left padding where the lengths differ."""
    texts = [
        chat_text(processor, "what color is the circle ?", 2),
        chat_text(processor, "how many red objects are there in the picture ?", 1),
    ]
    images = [[random_image(40, 70, 1), random_image(64, 48, 2)], [random_image(50, 50, 3)]]
    return processor(images=images, text=texts, return_tensors="pt", padding=True)
