"""Build the bundled tiny LLaVA: a plain `LlavaForConditionalGeneration` (tiny CLIP vision tower +
tiny Llama with grouped-query attention) and a plain `LlavaProcessor` (word-level fast tokenizer with
LLaVA-1.5's chat template, CLIP image processor). Saved with `save_pretrained`, both load with
`from_pretrained` exactly as `llava-hf/llava-1.5-7b-hf` does."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
)

from .vocab import vocabulary

# CLIPImageProcessor's normalisation (OpenAI CLIP's), as the bundled processors apply it
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def pixel_values(images: list) -> torch.Tensor:
    """What the bundled CLIPImageProcessor gives for RGB images already at its size (the scenes are drawn
    at the model's image size: no resize or crop needed): scale to [0, 1] and normalise, (B, 3, H, W)."""
    arr = np.stack([np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0 for im in images])
    x = torch.from_numpy(arr).permute(0, 3, 1, 2)
    mean = torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD).view(1, 3, 1, 1)
    return (x - mean) / std


# LLaVA-1.5's template (as llava-hf ships it): "USER: <image>\n{text} ASSISTANT: {answer}</s>..."
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' ' }}{% endfor %}"
    "{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '</s>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


@dataclass
class TinyLlavaSizes:
    """Shapes of the tiny model. Defaults: 128 px images, 16 px patches -> 8x8 = 64 image tokens."""

    image_size: int = 128
    patch_size: int = 16
    vision_hidden: int = 96
    vision_layers: int = 2
    vision_heads: int = 4
    text_hidden: int = 128
    text_layers: int = 4
    text_heads: int = 4
    text_kv_heads: int = 2
    text_intermediate: int = 384
    max_positions: int = 1024
    vision_feature_layer: int = -1
    text_head_dim: int | None = None  # None: text_hidden // text_heads
    rope_theta: float = 10000.0

    @property
    def image_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def build_tokenizer(
    words: list[str] | None = None,
    *,
    bos: bool = True,
    eos: str = "</s>",
    special: dict[str, str] | None = None,
    additional: list[str] | None = None,
    chat_template: str = CHAT_TEMPLATE,
) -> PreTrainedTokenizerFast:
    """A word-level fast tokenizer over `words` (default: the bundled vocabulary) with left padding. `bos`:
    prepend <s>; `special`: the named special tokens the processor looks up (default: the image
    placeholder); `additional`: the tokens kept whole, one id each (default: the image placeholder)."""
    words = words or vocabulary()
    special = special if special is not None else {"image_token": "<image>"}
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token=eos,
        padding_side="left",
        extra_special_tokens=special,
    )
    fast.add_special_tokens({"additional_special_tokens": additional or ["<image>"]})
    fast.chat_template = chat_template
    return fast


def build_processor(sizes: TinyLlavaSizes | None = None, words: list[str] | None = None) -> LlavaProcessor:
    """The processor: CLIP image processor at the model's size, the word-level tokenizer over `words`
    (default: the 64-token benchmark's vocabulary)."""
    sizes = sizes or TinyLlavaSizes()
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": sizes.image_size},
        crop_size={"height": sizes.image_size, "width": sizes.image_size},
        do_center_crop=True,
        do_convert_rgb=True,
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=build_tokenizer(words),
        patch_size=sizes.patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )


def tiny_llava_config(
    sizes: TinyLlavaSizes | None = None, vocab_size: int | None = None, words: list[str] | None = None
) -> LlavaConfig:
    sizes = sizes or TinyLlavaSizes()
    tok = build_tokenizer(words)
    vision = CLIPVisionConfig(
        hidden_size=sizes.vision_hidden,
        intermediate_size=4 * sizes.vision_hidden,
        num_hidden_layers=sizes.vision_layers,
        num_attention_heads=sizes.vision_heads,
        image_size=sizes.image_size,
        patch_size=sizes.patch_size,
        projection_dim=sizes.vision_hidden,
    )
    text = LlamaConfig(
        vocab_size=vocab_size or len(tok),
        hidden_size=sizes.text_hidden,
        intermediate_size=sizes.text_intermediate,
        num_hidden_layers=sizes.text_layers,
        num_attention_heads=sizes.text_heads,
        num_key_value_heads=sizes.text_kv_heads,
        max_position_embeddings=sizes.max_positions,
        head_dim=sizes.text_head_dim or sizes.text_hidden // sizes.text_heads,
        rope_parameters={"rope_type": "default", "rope_theta": sizes.rope_theta},
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=sizes.vision_feature_layer,
        image_seq_length=sizes.image_tokens,
        pad_token_id=tok.pad_token_id,
    )
    cfg.mm_oval_tiny_sizes = asdict(sizes)
    return cfg


def build_tiny_llava(
    seed: int = 0,
    sizes: TinyLlavaSizes | None = None,
    attn_implementation: str = "sdpa",
    words: list[str] | None = None,
) -> tuple[LlavaForConditionalGeneration, LlavaProcessor]:
    """A randomly initialised tiny LLaVA and its processor (seconds on a CPU): what tests use for mechanics.
    `words`: the tokenizer's vocabulary (default: the 64-token benchmark's)."""
    sizes = sizes or TinyLlavaSizes()
    torch.manual_seed(seed)
    cfg = tiny_llava_config(sizes, words=words)
    cfg._attn_implementation = attn_implementation
    model = LlavaForConditionalGeneration(cfg).eval()
    gen = model.generation_config
    gen.pad_token_id = cfg.pad_token_id
    gen.eos_token_id = cfg.text_config.eos_token_id
    gen.bos_token_id = cfg.text_config.bos_token_id
    gen.do_sample = False
    return model, build_processor(sizes, words)
