"""Saving and loading KVP agents: kvp_agents.safetensors (the weights) + kvp_config.json (the model they
were trained for, their shape, how they were trained), and the bundled agents of the tiny LLaVA
(package data). No pickle: weights load through safetensors."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from ..errors import ModelError
from ..files import atomic_write_bytes
from .kvp_agents import KVPAgentConfig, KVPAgents

CONFIG_NAME = "kvp_config.json"
WEIGHTS_NAME = "kvp_agents.safetensors"
FORMAT = "mm-oval-kvp"
FORMAT_VERSION = 1


def save_agents(
    agents: KVPAgents,
    directory: str | Path,
    model_sig: dict,
    training: dict | None = None,
    selection: dict | None = None,
) -> Path:
    """Write kvp_agents.safetensors + kvp_config.json (model shape, fingerprint, agent shape, training, and
    the selection over the scores when there is one: `policies.kvp_select.RedundancySelection` fields)."""
    directory = Path(directory)
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in agents.state_dict().items()}
    atomic_write_bytes(directory / WEIGHTS_NAME, save(tensors))
    cfg = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "model": model_sig,
        "agent": asdict(agents.config),
        "training": training or {},
    }
    if selection:
        cfg["selection"] = dict(selection)
    atomic_write_bytes(directory / CONFIG_NAME, json.dumps(cfg, indent=1).encode())
    return directory


@dataclass
class LoadedAgents:
    agents: KVPAgents
    model: dict
    training: dict = field(default_factory=dict)
    source: str = ""
    selection: dict = field(default_factory=dict)  # how the scores become a selection (kvp_select)


def load_agents(directory: str | Path, device: str | torch.device | None = None) -> LoadedAgents:
    directory = Path(directory)
    cfg_path = directory / CONFIG_NAME
    if not cfg_path.is_file() or not (directory / WEIGHTS_NAME).is_file():
        raise ModelError(
            f"{directory} holds no KVP agents (expected {CONFIG_NAME} and {WEIGHTS_NAME}); "
            "train them with `mm-oval train-kvp --model ... --data ... --out DIR`"
        )
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"{cfg_path} is not valid JSON ({e}); retrain or restore the agents") from e
    if (
        not isinstance(cfg, dict)
        or cfg.get("format") != FORMAT
        or int(cfg.get("version", -1)) > FORMAT_VERSION
    ):
        fmt = cfg.get("format") if isinstance(cfg, dict) else type(cfg).__name__
        raise ModelError(f"{cfg_path} is not a KVP agents config this mm-oval can read ({fmt!r})")
    try:
        acfg = KVPAgentConfig(**cfg["agent"])
        if not isinstance(cfg["model"], dict):
            raise TypeError("'model' is not a dict")
    except (KeyError, TypeError) as e:
        raise ModelError(f"{cfg_path} is incomplete ({e}); retrain or restore the agents") from e
    agents = KVPAgents(acfg)
    weights = directory / WEIGHTS_NAME
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as e:
        raise ModelError(f"{weights} is truncated or corrupt ({e}); retrain or restore the agents") from e
    missing = set(agents.state_dict()) - set(state)
    if missing:
        raise ModelError(f"{weights} lacks {sorted(missing)}; the agents file is incomplete")
    try:
        agents.load_state_dict(state)
    except RuntimeError as e:
        raise ModelError(f"{weights} does not match {cfg_path} ({e}); retrain or restore the agents") from e
    agents.eval().requires_grad_(False)
    if device is not None:
        agents.to(device)
    selection = cfg.get("selection", {})
    if not isinstance(selection, dict):
        raise ModelError(f"{cfg_path}: 'selection' must be an object (redundancy, sigma); fix or retrain")
    return LoadedAgents(agents, cfg["model"], cfg.get("training", {}), str(directory), selection)


# names `agents` may take instead of a directory -> the package-data folder of the bundled tiny LLaVA's agents:
# traces of whole prompts (compressed after the question, `--compress prompt`) or of prompts cut after the
# image (`--compress image`, the question-agnostic setting; trained with 3 sinks and no recent window, as
# the sweeps run it); per-head rankings, or one ranking over each layer's heads for `head_budget="shared"`
BUNDLED_AGENTS = {
    "bundled": "tiny_llava_kvp",
    "bundled-joint": "tiny_llava_kvp_joint",
    "bundled-image": "tiny_llava_kvp_image",
    "bundled-image-joint": "tiny_llava_kvp_image_joint",
    # the 576-token tiny LLaVA's (`--model bundled576`), question-agnostic setting, per-head rankings, with
    # the redundancy-aware selection (policies.kvp_select) recorded in their config
    "bundled576-image": "tiny_llava576_kvp_image",
    # the same, joint-heads rankings (one scale for a layer's KV heads: `head_budget="shared"`)
    "bundled576-image-joint": "tiny_llava576_kvp_image_joint",
    # SmolLM2-135M-Instruct (`--model smollm2`), question-agnostic on long-context text (`--compress
    # context`), per-head rankings: traces of 168 generated contexts of 512 and 1k tokens (every kind of
    # eval/longtext.py, seeds apart from the dev set's), 250 steps
    "smollm2-context": "smollm2_kvp_context",
    # bundled-smol, the LLaVA on SmolLM2 (`--model bundled-smol`, its shipped parts), question-agnostic setting
    # (`--compress image`), per-head rankings with the redundancy-aware selection: traces of 600 training scenes
    # of the 576-token generator, 600 steps
    "bundled-smol-image": "bundled_smol_kvp_image",
}
# `agents` left unset: the first of these trained for the wrapped model (their recorded signature matches);
# the first one when no model is bound. The per-head agents of each bundled model's own setting.
DEFAULT_AGENTS = ("bundled", "bundled576-image", "smollm2-context", "bundled-smol-image")


def bundled_agents_path(joint_heads: bool = False, name: str | None = None) -> Path:
    """The agents trained for the bundled tiny LLaVA (package data): `name` one of BUNDLED_AGENTS, or by
    default the per-head agents of whole prompts (`joint_heads`: their joint-heads twin)."""
    name = name or ("bundled-joint" if joint_heads else "bundled")
    return Path(str(resources.files("mm_oval.zoo").joinpath(BUNDLED_AGENTS[name])))
