"""The bundled tiny LLaVA: vocabulary, tokenizer/processor, model builder, data generator, trainer.

`bundled_model_path()` is the committed checkpoint (loads with `LlavaForConditionalGeneration.from_pretrained`
and `AutoProcessor.from_pretrained`); `bundled_data_dir()` is the committed synthetic dev sets
(MMBench TSV, VQAv2 JSON, POPE JSONL, images, targets.json); `bundled576_data_dir()` the 576-token
benchmark's (the same files plus the list task's list_dev.jsonl)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from ..errors import DataError, ModelError

__all__ = ["bundled576_data_dir", "bundled576_model_path", "bundled_data_dir", "bundled_model_path"]


def bundled_model_path() -> Path:
    """Directory of the committed tiny LLaVA checkpoint (config, safetensors, processor files)."""
    path = Path(str(resources.files("mm_oval.zoo") / "tiny_llava"))
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise ModelError(
            f"the bundled tiny LLaVA is missing from {path} (config.json / model.safetensors); "
            "reinstall mm-oval, or train it with `mm-oval zoo train --out DIR` and point --model at DIR"
        )
    return path


def bundled576_model_path() -> Path:
    """Directory of the committed 576-token tiny LLaVA (LLaVA-1.5's image geometry: 336 px, patch 14)."""
    path = Path(str(resources.files("mm_oval.zoo") / "tiny_llava576"))
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise ModelError(
            f"the bundled 576-token tiny LLaVA is missing from {path} (config.json / model.safetensors); "
            "reinstall mm-oval, or build it with `mm-oval zoo train576 --out DIR` and point --model at DIR/model"
        )
    return path


def bundled_data_dir() -> Path:
    """Directory of the committed synthetic dev sets (eval/data/synth, shipped as mm_oval.eval package data)."""
    path = Path(str(resources.files("mm_oval.eval") / "data" / "synth"))
    if not path.is_dir():
        raise DataError(
            f"the bundled synthetic dev sets are missing from {path}; reinstall mm-oval, or regenerate them "
            "with `mm-oval zoo generate --out DIR`"
        )
    return path


def bundled576_data_dir() -> Path:
    """Directory of the committed 576-token dev sets (eval/data/synth576, shipped as mm_oval.eval package data)."""
    path = Path(str(resources.files("mm_oval.eval") / "data" / "synth576"))
    if not path.is_dir():
        raise DataError(
            f"the bundled 576-token dev sets are missing from {path}; reinstall mm-oval, or regenerate them "
            "with `mm-oval zoo generate --geometry 576 --out DIR`"
        )
    return path
