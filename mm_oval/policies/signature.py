"""What a learned part (KVP agents, the router) was trained for: the model's shape and a fingerprint of
its weights (a few raw k_proj / v_proj entries per layer), recorded in the part's JSON config and checked
against the model it is used with."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from ..errors import ModelError


def text_config_of(model_or_config: Any) -> Any:
    cfg = getattr(model_or_config, "config", model_or_config)
    return getattr(cfg, "text_config", None) or cfg


def decoder_layers(model: Any) -> Any:
    """The language model's decoder layers of a LLaVA-style (or plain causal) model."""
    for path in ("model.language_model.layers", "language_model.model.layers", "model.layers"):
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        return obj
    raise ModelError(
        f"cannot find the decoder layers of {type(model).__name__}; KVP supports LLaVA-style models whose "
        "language model is a Llama/Mistral/Qwen2-like decoder (model.model.language_model.layers)"
    )


def probe_from_attention(attn: Any) -> list[float]:
    """A few raw weights of one attention module: cheap, dtype-robust evidence of which model this is."""
    vals: list[float] = []
    for name in ("k_proj", "v_proj"):
        lin = getattr(attn, name, None)
        if lin is None or not hasattr(lin, "weight"):
            return []
        vals.extend(float(x) for x in lin.weight.detach()[0, :4].float().cpu())
    return vals


def model_signature(model: Any) -> dict:
    """Shape and weight fingerprint of a model, as recorded in a KVP checkpoint's JSON config."""
    tc = text_config_of(model)
    num_heads = int(tc.num_attention_heads)
    head_dim = int(getattr(tc, "head_dim", None) or tc.hidden_size // num_heads)
    layers = decoder_layers(model)
    probe = [probe_from_attention(layer.self_attn) for layer in layers]
    cfg = model.config
    sig = {
        "num_layers": int(tc.num_hidden_layers),
        "num_kv_heads": int(getattr(tc, "num_key_value_heads", None) or num_heads),
        "num_heads": num_heads,
        "head_dim": head_dim,
        "hidden_size": int(tc.hidden_size),
        "max_positions": int(getattr(tc, "max_position_embeddings", 4096)),
        "image_token_id": getattr(cfg, "image_token_id", None),
        "image_seq_length": getattr(cfg, "image_seq_length", None),
        "name_or_path": str(getattr(cfg, "_name_or_path", "") or ""),
        "probe": probe,
    }
    sig["fingerprint"] = fingerprint_digest(probe)
    return sig


def fingerprint_digest(probe: list[list[float]]) -> str:
    rounded = [[float(f"{x:.2g}") for x in row] for row in probe]
    return hashlib.sha256(json.dumps(rounded).encode()).hexdigest()[:16]


def probe_matches(a: list[float], b: list[float]) -> bool:
    if len(a) != len(b):
        return False
    if not a:
        return True
    ta, tb = torch.tensor(a), torch.tensor(b)
    return bool(torch.allclose(ta, tb, rtol=2e-2, atol=1e-3))


SHAPE_KEYS = ("num_layers", "num_kv_heads", "head_dim", "num_heads")
KVP_HINT = (
    "these agents belong to another model; train agents for this one with "
    "`mm-oval train-kvp --model <model> --data <data> --out <dir>` and pass agents=<dir>"
)


def check_signature(
    trained_for: dict,
    actual: dict,
    source: str = "",
    what: str = "KVP agents",
    hint: str = KVP_HINT,
    keys: tuple[str, ...] = SHAPE_KEYS,
    check_weights: bool = True,
) -> None:
    """Raise ModelError when `what` (KVP agents, a router) trained for a model with signature `trained_for`
    is used on a model with signature `actual` (both `model_signature` dicts): other shapes (`keys`) or, with
    `check_weights`, other weights (the per-layer k_proj / v_proj probe). The message names both."""
    shape_a = {k: trained_for.get(k) for k in keys}
    shape_b = {k: actual.get(k) for k in keys}
    if shape_a != shape_b:
        raise ModelError(
            f"{what} {source}: trained for a model of shape {shape_a}, this model has shape {shape_b}: {hint}"
        )
    pa, pb = trained_for.get("probe") or [], actual.get("probe") or []
    if check_weights and pa and pb and not all(probe_matches(a, b) for a, b in zip(pa, pb)):
        raise ModelError(
            f"{what} {source}: trained for model {trained_for.get('name_or_path') or '?'} "
            f"(fingerprint {trained_for.get('fingerprint')}), this model's weights differ "
            f"(fingerprint {actual.get('fingerprint')}): {hint}"
        )
