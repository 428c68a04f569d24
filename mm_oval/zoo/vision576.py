"""The vision stage of the 576-token tiny LLaVA: a CLIP tower at LLaVA-1.5's geometry (336 px, patch 14,
24x24 patches, features from layer -2, CLS dropped) trained so that a linear read-out of every patch feature
gives what the projector needs: the colour and shape of the object the patch belongs to (or none), the
object's centre (column and row, in patch units), and the patch's own column and row.

Colour and shape are object properties: a patch inside a large circle looks like a patch inside a large
square, so the tower must look at the neighbouring patches of the same object (its attention learns to).

Training resumes from `OUT/vision_state.pt` (weights + optimiser, saved with safetensors-free
`torch.save` of tensors only and read back with `weights_only=True`).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..files import atomic_write_text
from .model import pixel_values
from .scenes import GRID, make_scene
from .vocab import COLORS, SHAPES

log = logging.getLogger(__name__)

N_PATCHES = GRID * GRID


def init_position_code(tower) -> None:
    """Position embeddings start from a row / column code (dims 0-23 one-hot row, 24-47 one-hot column,
    48-63 smooth sin/cos of row and column) that the patch embedding leaves free at the start."""
    emb = tower.embeddings
    with torch.no_grad():
        pe = emb.position_embedding.weight
        pe.zero_()
        for p in range(N_PATCHES):
            r, c = divmod(p, GRID)
            pe[1 + p, r] = 2.0
            pe[1 + p, GRID + c] = 2.0
            for k in range(4):
                f = math.pi * (k + 1) / GRID
                pe[1 + p, 48 + 4 * k] = math.sin(f * r)
                pe[1 + p, 49 + 4 * k] = math.cos(f * r)
                pe[1 + p, 50 + 4 * k] = math.sin(f * c)
                pe[1 + p, 51 + 4 * k] = math.cos(f * c)
        emb.patch_embedding.weight[:64] = 0.0


def patch_features(model, pixel: torch.Tensor) -> torch.Tensor:
    """The tower's patch features as LLaVA selects them (config.vision_feature_layer, CLS dropped). Runs
    only the layers the selected feature depends on (the same values as the full tower's hidden state)."""
    tower = model.model.vision_tower
    tower = getattr(tower, "vision_model", tower)
    layer = model.config.vision_feature_layer
    n = len(tower.encoder.layers)
    keep = layer % (n + 1)  # hidden_states[layer] is the output of `keep` encoder layers
    h = tower.pre_layrnorm(tower.embeddings(pixel))
    for blk in tower.encoder.layers[:keep]:
        out = blk(h, None)
        h = out[0] if isinstance(out, tuple) else out
    return h[:, 1:]


OFF_CENTRE = 1.5 * GRID  # the "centre" of a patch outside every object: far off the grid (below, right)


def targets(scenes) -> torch.Tensor:
    """(B, 576, 7): colour id, shape id, centre column, centre row (OFF_CENTRE off objects), own column,
    own row, member flag."""
    out = np.zeros((len(scenes), N_PATCHES, 7), np.float32)
    rc = np.arange(N_PATCHES)
    for i, s in enumerate(scenes):
        lab = s.patch_labels()
        out[i, :, :4] = lab[:, :4]
        out[i, lab[:, 0] == 0, 2:4] = OFF_CENTRE
        out[i, :, 4] = rc % GRID + 0.5
        out[i, :, 5] = rc // GRID + 0.5
        out[i, :, 6] = lab[:, 0] > 0
    return torch.from_numpy(out)


@dataclass(frozen=True)
class LossWeights:
    """The vision stage's loss: colour cross-entropy (every patch) + `shape` x shape cross-entropy (every
    patch, "none" off objects) + `member_shape` x shape cross-entropy on member patches only (most
    patches are empty) + `centre` x squared error of the object's centre + `own` x squared error of the
    patch's own position (positions normalised by the grid)."""

    shape: float = 1.0
    member_shape: float = 4.0
    centre: float = 100.0
    own: float = 100.0


class Readout(nn.Module):
    """Linear read-outs of a patch feature (training only): colour (9), shape (5), centre (2), own position (2)."""

    def __init__(self, dim: int):
        super().__init__()
        self.color = nn.Linear(dim, len(COLORS) + 1)
        self.shape = nn.Linear(dim, len(SHAPES) + 1)
        self.centre = nn.Linear(dim, 2)
        self.own = nn.Linear(dim, 2)

    def loss(
        self, feats: torch.Tensor, t: torch.Tensor, w: LossWeights | None = None
    ) -> tuple[torch.Tensor, dict]:
        w = w or LossWeights()
        col, shp = self.color(feats), self.shape(feats)
        lc = F.cross_entropy(col.flatten(0, 1), t[..., 0].long().flatten())
        mem = t[..., 6] > 0
        ls = w.shape * F.cross_entropy(shp.flatten(0, 1), t[..., 1].long().flatten())
        if w.member_shape:
            ls = ls + w.member_shape * F.cross_entropy(shp[mem], t[..., 1].long()[mem])
        cen, own = self.centre(feats), self.own(feats)
        lcen = ((cen - t[..., 2:4] / GRID) ** 2).sum(-1).mean() * w.centre
        lown = ((own - t[..., 4:6] / GRID) ** 2).sum(-1).mean() * w.own
        with torch.no_grad():
            stats = {
                "color_acc": float((col.argmax(-1) == t[..., 0]).float().mean()),
                "shape_acc_members": float((shp.argmax(-1) == t[..., 1])[mem].float().mean()),
                "centre_err_patches": float(((cen - t[..., 2:4] / GRID).abs() * GRID)[mem].mean()),
                "own_err_patches": float(((own - t[..., 4:6] / GRID).abs() * GRID).mean()),
            }
        return lc + ls + lcen + lown, stats


def scenes_for(seed: int, step: int, batch: int) -> list:
    return [
        make_scene(random.Random(seed * 1_000_003 + step * batch + i), min_objects=4) for i in range(batch)
    ]


def train_tower(
    model,
    out: str | Path,
    steps: int = 3000,
    batch: int = 16,
    lr: float = 1e-3,
    seed: int = 0,
    init_from: str | Path | None = None,
    weights: LossWeights | None = None,
    stop_at: int | None = None,
) -> dict:
    """Train `model`'s vision tower in place (resumable from OUT/vision_state.pt); returns the last step's
    statistics. `init_from`: start a new schedule from another run's tower (weights only); `stop_at`: end
    after that step (the schedule is still the `steps`-long one; a later call resumes)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tower = model.model.vision_tower
    dim = model.config.vision_config.hidden_size
    head = Readout(dim)
    params = list(tower.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    state_path = out / "vision_state.pt"
    start = 0
    if state_path.is_file():
        st = torch.load(state_path, weights_only=True)
        tower.load_state_dict(st["tower"])
        head.load_state_dict(st["head"])
        opt.load_state_dict(st["opt"])
        start = int(st["step"])
        log.info("resumed the vision stage at step %d", start)
    elif init_from is not None:
        tower.load_state_dict(torch.load(init_from, weights_only=True)["tower"])
        log.info("vision stage initialised from %s", init_from)
    else:
        init_position_code(tower)
    tower.train()
    stats: dict = {}
    t0 = time.time()
    end = min(steps, stop_at) if stop_at else steps
    for step in range(start, end):
        warm = min(1.0, (step + 1) / 100)
        for g in opt.param_groups:
            g["lr"] = lr * warm * 0.5 * (1 + math.cos(math.pi * step / steps))
        sc = scenes_for(seed, step, batch)
        pix = pixel_values([s.render() for s in sc])
        loss, stats = head.loss(patch_features(model, pix), targets(sc), weights)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 50 == 0 or step == end - 1:
            rec = {
                "stage": "vision",
                "step": step,
                "loss": float(loss),
                **stats,
                "elapsed_s": time.time() - t0,
            }
            log.info("%s", rec)
            with open(out / "vision_log.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
        if (step + 1) % 250 == 0 or step == end - 1:
            tmp = state_path.with_suffix(".tmp")
            torch.save(
                {
                    "tower": tower.state_dict(),
                    "head": head.state_dict(),
                    "opt": opt.state_dict(),
                    "step": step + 1,
                },
                tmp,
            )
            tmp.replace(state_path)
    tower.eval()
    atomic_write_text(out / "vision_done.json", json.dumps(stats))
    return stats
