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


def _model_dir(folder: str, what: str, how: str) -> Path:
    """A committed checkpoint folder of mm_oval.zoo, or a ModelError saying what is missing and `how` to
    get it."""
    path = Path(str(resources.files("mm_oval.zoo") / folder))
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise ModelError(f"{what} is missing from {path} (config.json / model.safetensors); reinstall mm-oval, or {how}")
    return path


def _data_dir(folder: str, what: str, command: str) -> Path:
    """A committed dev-set folder (eval/data/FOLDER, mm_oval.eval package data), or a DataError."""
    path = Path(str(resources.files("mm_oval.eval") / "data" / folder))
    if not path.is_dir():
        raise DataError(f"{what} are missing from {path}; reinstall mm-oval, or regenerate them with `{command}`")
    return path


def bundled_model_path() -> Path:
    """Directory of the committed tiny LLaVA checkpoint (config, safetensors, processor files)."""
    return _model_dir(
        "tiny_llava", "the bundled tiny LLaVA", "train it with `mm-oval zoo train --out DIR` and point --model at DIR"
    )


def bundled576_model_path() -> Path:
    """Directory of the committed 576-token tiny LLaVA (LLaVA-1.5's image geometry: 336 px, patch 14)."""
    return _model_dir(
        "tiny_llava576",
        "the bundled 576-token tiny LLaVA",
        "build it with `mm-oval zoo train576 --out DIR` and point --model at DIR/model",
    )


def bundled_data_dir() -> Path:
    """Directory of the committed synthetic dev sets (eval/data/synth, shipped as mm_oval.eval package data)."""
    return _data_dir("synth", "the bundled synthetic dev sets", "mm-oval zoo generate --out DIR")


def bundled576_data_dir() -> Path:
    """Directory of the committed 576-token dev sets (eval/data/synth576, shipped as mm_oval.eval package data)."""
    return _data_dir("synth576", "the bundled 576-token dev sets", "mm-oval zoo generate --geometry 576 --out DIR")
