"""Build the 576-token tiny LLaVA: `mm-oval zoo train576 --out DIR`.

1. Vision (trained, resumable): `vision576.train_tower` on fresh scenes every step.
2. Projector and language model (closed form): least squares from the tower's patch features to their
   code on scenes the tower never saw, then `circuit576.set_projector` / `set_language_model`.
3. Export: a plain `LlavaForConditionalGeneration` + processor in DIR/model (`save_pretrained`).
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import asdict
from pathlib import Path

import torch

from ..files import atomic_write_text
from . import circuit576
from .model import TinyLlavaSizes, build_tiny_llava, pixel_values
from .scenes import make_scene
from .vision576 import LossWeights, patch_features, targets, train_tower
from .vocab import vocabulary576

log = logging.getLogger(__name__)

SIZES576 = TinyLlavaSizes(
    image_size=336,
    patch_size=14,
    vision_hidden=128,
    vision_layers=4,
    vision_heads=4,
    vision_feature_layer=-2,
    text_hidden=circuit576.HIDDEN,
    text_layers=circuit576.LAYERS,
    text_heads=circuit576.HEADS,
    text_kv_heads=circuit576.KV_HEADS,
    text_intermediate=circuit576.INTERMEDIATE,
    text_head_dim=circuit576.HEAD_DIM,
    rope_theta=circuit576.ROPE_THETA,
    max_positions=2048,
)


def build576(seed: int = 0, attn_implementation: str = "sdpa"):
    """A randomly initialised 576-token tiny LLaVA and its processor (the 576-token vocabulary)."""
    return build_tiny_llava(seed, SIZES576, attn_implementation, words=vocabulary576())


@torch.no_grad()
def fit_code(model, scenes: int = 96, seed: int = 7, batch: int = 16) -> tuple[torch.Tensor, dict]:
    """Least squares from patch features to `circuit576.code_targets` on fresh scenes (not the tower's)."""
    feats, ts = [], []
    for i in range(0, scenes, batch):
        sc = [make_scene(random.Random(f"mm-oval-576-fit-{seed}-{i + j}")) for j in range(batch)]
        feats.append(patch_features(model, pixel_values([s.render() for s in sc])))
        ts.append(targets(sc))
    return circuit576.projector_code(torch.cat(feats), torch.cat(ts))


def colour_logits(state: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The tower's trained colour read-out (weight, bias) from a vision_state.pt state."""
    return state["head"]["color.weight"], state["head"]["color.bias"]


def write_circuit(model, processor, code: torch.Tensor, logits=None) -> None:
    circuit576.set_projector(model, code, colour_logits=logits)
    circuit576.set_language_model(model, processor.tokenizer)


def train576(
    out: str | Path,
    vision_steps: int = 3000,
    batch: int = 12,
    seed: int = 0,
    lr: float = 1e-3,
    init_from: str | Path | None = None,
    weights: LossWeights | None = None,
    stop_at: int | None = None,
) -> Path:
    """Train the tower (resumes; `init_from` starts a new schedule from another run's tower), fit the
    code on fresh scenes, write the circuit, export to OUT/model."""
    out = Path(out)
    model, processor = build576(seed)
    stats = train_tower(
        model, out, steps=vision_steps, batch=batch, lr=lr, seed=seed, init_from=init_from, weights=weights,
        stop_at=stop_at,
    )  # fmt: skip
    model.eval()
    code, report = fit_code(model)
    log.info("code fit: %s", report)
    state = torch.load(out / "vision_state.pt", weights_only=True)
    write_circuit(model, processor, code, colour_logits(state))
    path = out / "model"
    model.config.mm_oval_training = {
        "recipe": "576", "vision_steps": vision_steps, "batch": batch, "seed": seed, "lr": lr,
        "init_from": str(init_from) if init_from else None, "stop_at": stop_at,
        "loss_weights": asdict(weights or LossWeights()),
    }  # fmt: skip
    model.save_pretrained(path)
    processor.save_pretrained(path)
    atomic_write_text(out / "build_report.json", json.dumps({"vision": stats, "code_fit": report}, indent=1))
    return path
