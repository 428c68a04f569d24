"""Where the bundled assets are: the tiny LLaVAs' checkpoints (package data of mm_oval.zoo) and their
synthetic dev sets (package data of mm_oval.eval, under eval/data), found with importlib.resources, and
the `bundled` / `bundled576` names the CLI and the harness accept for them.

It imports nothing of the project but its errors, so the model loader (mm_oval.modelfiles), the
evaluation tasks (mm_oval.eval) and the zoo's builders (mm_oval.zoo) all read it without importing
each other."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from .errors import DataError, ModelError

__all__ = [
    "bundled576_data_dir",
    "bundled576_model_path",
    "bundled_data_dir",
    "bundled_model_path",
    "resolve_data",
    "resolve_model_path",
]


def _model_dir(folder: str, what: str, how: str) -> Path:
    """A committed checkpoint folder of mm_oval.zoo, or a ModelError saying what is missing and `how` to
    get it."""
    path = Path(str(resources.files("mm_oval.zoo") / folder))
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise ModelError(
            f"{what} is missing from {path} (config.json / model.safetensors); reinstall mm-oval, or {how}"
        )
    return path


def _data_dir(folder: str, what: str, command: str) -> Path:
    """A committed dev-set folder (eval/data/FOLDER, mm_oval.eval package data), or a DataError."""
    path = Path(str(resources.files("mm_oval.eval") / "data" / folder))
    if not path.is_dir():
        raise DataError(
            f"{what} are missing from {path}; reinstall mm-oval, or regenerate them with `{command}`"
        )
    return path


def bundled_model_path() -> Path:
    """Directory of the committed tiny LLaVA checkpoint (config, safetensors, processor files)."""
    return _model_dir(
        "tiny_llava",
        "the bundled tiny LLaVA",
        "train it with `mm-oval zoo train --out DIR` and point --model at DIR",
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
    return _data_dir(
        "synth576", "the bundled 576-token dev sets", "mm-oval zoo generate --geometry 576 --out DIR"
    )


def resolve_model_path(spec: str | Path) -> str:
    """`bundled` / `bundled576` -> the bundled tiny LLaVAs' folders (64 and 576 image tokens); anything else
    as given (a local path or a Hub id)."""
    if str(spec) == "bundled":
        return str(bundled_model_path())
    if str(spec) == "bundled576":
        return str(bundled576_model_path())
    return str(spec)


def resolve_data(data: str | Path) -> Path:
    """`bundled` -> the bundled synthetic dev sets, `bundled576` -> the 576-token ones; anything else must exist."""
    if str(data) == "bundled":
        return bundled_data_dir()
    if str(data) == "bundled576":
        return bundled576_data_dir()
    path = Path(data).expanduser()
    if not path.exists():
        raise DataError(f"data path not found: {path}")
    return path
