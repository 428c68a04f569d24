"""The hybrid image-text page router: a small learned head that picks the pages each KV head reads at a
decode step from the text state alone, without touching keys.

For one decode step, layer l and KV head h (pages j of that head's table):

- page embedding e_j = W_page LN(content_j) + kind_j, with content_j the mean of the LM input embeddings
  of the page's tokens: for image tokens that is the model's own CLIP vision feature of the patch
  through the LLaVA projector, for text tokens the LM token embedding, so image and text pages start in
  one space (W_page is initialised from the principal directions of such contents, or, when a user
  supplies an open_clip checkpoint, fitted to map contents onto that CLIP's joint image-text space);
- text state t = W_text LN(last hidden state of the previous token);
- hybrid fusion: t attends over the head's image pages (one cross-attention), f = CrossAttn(t, e_image);
- a 2-layer MLP (hidden 64, GELU) over [t, f] and an output layer with LoRA (r 4, alpha 8) give one
  routing vector u_{l,h} per layer and KV head;
- logit_j = (u_{l,h} . e_j) / temperature - d_j / 32, temperature learned, d_j the page-index distance
  to the newest page (the exp(-d/32) locality decay, in log space); the top pages are read.

Trained by distillation from full attention (mm_oval.training.router, `mm-oval train-router`). Weights are
safetensors plus a JSON config naming the model they were trained for; loading them for another model is
a ModelError.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save
from torch import nn
from torch.nn import functional as F

from ..errors import ConfigError, DataError, ModelError
from ..files import atomic_write_bytes, atomic_write_json
from . import signature
from .base import IMAGE, DecodeContext, PageBatch, RetrievalPolicy, register_retrieval

log = logging.getLogger(__name__)

WEIGHTS_FILE = "router.safetensors"
CONFIG_FILE = "router.json"


@dataclass
class RouterConfig:
    """Shapes of a router and the model it belongs to."""

    hidden_size: int  # the LM's hidden size (input embeddings and hidden states)
    num_layers: int
    num_kv_heads: int
    route_dim: int = 64
    mlp_hidden: int = 64
    lora_rank: int = 4
    lora_alpha: float = 8.0
    locality_tau: float = 32.0
    model: dict[str, Any] = field(default_factory=dict)  # model_signature() of the model it was trained for
    page_init: str = (
        "pca"  # how W_page was initialised: "pca" (the model's own CLIP features) or "open_clip:..."
    )

    def validate(self) -> None:
        for name in ("hidden_size", "num_layers", "num_kv_heads", "route_dim", "mlp_hidden", "lora_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"router config: {name} must be an int >= 1, got {v!r}")
        if self.locality_tau <= 0:
            raise ConfigError(f"router config: locality_tau must be > 0, got {self.locality_tau}")


_HINT = "train a router for this model with `mm-oval train-router --model <model> --out <dir>`"
# the shapes a router depends on: its output rows (layers x KV heads) and its input width
SHAPE_KEYS = (*signature.SHAPE_KEYS, "hidden_size")


def model_signature(model: Any) -> dict[str, Any]:
    """What identifies the model a router was trained for: the KVP agents' signature (shapes and the per-layer
    k_proj / v_proj fingerprint, `mm_oval.policies.signature.model_signature`) plus the model type and vocabulary."""
    cfg = model.config
    text = signature.text_config_of(model)
    return {
        **signature.model_signature(model),
        "model_type": str(getattr(cfg, "model_type", "")),
        "vocab_size": int(text.vocab_size),
    }


def _legacy_signature(model: Any) -> dict[str, Any]:
    """The signature routers saved before the fingerprint: shapes and an exact digest of the embeddings."""
    cfg = model.config
    text = getattr(cfg, "text_config", cfg)
    emb = model.get_input_embeddings().weight.detach()
    return {
        "model_type": str(getattr(cfg, "model_type", "")),
        "hidden_size": int(text.hidden_size),
        "num_layers": int(text.num_hidden_layers),
        "num_heads": int(text.num_attention_heads),
        "num_kv_heads": int(getattr(text, "num_key_value_heads", text.num_attention_heads)),
        "vocab_size": int(text.vocab_size),
        "embedding_digest": hashlib.sha256(emb.float().cpu().contiguous().numpy().tobytes()).hexdigest()[:16],
    }


def check_signature(saved: dict[str, Any], model: Any, where: str, check_weights: bool = True) -> None:
    """Raise ModelError (naming both signatures) when a router saved for `saved` meets another model: the
    same check as KVP agents get (`mm_oval.policies.signature.check_signature`)."""
    if "probe" not in saved:  # a router saved before the fingerprint: its own shapes and embedding digest
        now = _legacy_signature(model)
        diff = [k for k in saved if k in now and saved[k] != now[k]]
        if not check_weights and "embedding_digest" in diff:
            diff.remove("embedding_digest")
        if diff:
            detail = ", ".join(f"{k}: router {saved[k]!r} vs model {now[k]!r}" for k in diff)
            raise ModelError(
                f"the router in {where} was trained for another model ({saved.get('name') or 'unnamed'}; "
                f"{detail}): {_HINT}"
            )
        return
    signature.check_signature(
        saved,
        model_signature(model),
        f"in {where}",
        what="the router",
        hint=f"it belongs to another model; {_HINT}",
        keys=SHAPE_KEYS,
        check_weights=check_weights,
    )


class LoRALinear(nn.Module):
    """y = x W^T + b + (alpha / r) x A^T B^T, with B initialised to zero (the LoRA update starts at 0)."""

    def __init__(self, d_in: int, d_out: int, rank: int, alpha: float):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.lora_a = nn.Parameter(torch.randn(rank, d_in) / math.sqrt(d_in))
        self.lora_b = nn.Parameter(torch.zeros(d_out, rank))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * (x @ self.lora_a.T) @ self.lora_b.T


class HybridRouter(nn.Module):
    """The router network (see the module docstring). Inputs are plain tensors, so training and the
    cache share it: `embed_pages` once per page, `forward` per decode step and layer."""

    def __init__(self, config: RouterConfig):
        super().__init__()
        config.validate()
        self.config = config
        c = config
        self.content_norm = nn.LayerNorm(c.hidden_size, elementwise_affine=False)
        self.page_proj = nn.Linear(c.hidden_size, c.route_dim, bias=False)
        self.kind_emb = nn.Embedding(2, c.route_dim)  # TEXT, IMAGE
        nn.init.zeros_(self.kind_emb.weight)
        self.text_norm = nn.LayerNorm(c.hidden_size)
        self.text_proj = nn.Linear(c.hidden_size, c.route_dim)
        self.xq = nn.Linear(c.route_dim, c.route_dim)
        self.xk = nn.Linear(c.route_dim, c.route_dim)
        self.xv = nn.Linear(c.route_dim, c.route_dim)
        self.xo = nn.Linear(c.route_dim, c.route_dim)
        self.mlp = nn.Sequential(nn.Linear(2 * c.route_dim, c.mlp_hidden), nn.GELU())
        self.out = LoRALinear(
            c.mlp_hidden, c.num_layers * c.num_kv_heads * c.route_dim, c.lora_rank, c.lora_alpha
        )
        self.log_temperature = nn.Parameter(torch.tensor(math.log(math.sqrt(c.route_dim))))

    # pages ------------------------------------------------------------------------------------------
    def embed_pages(self, content: torch.Tensor, kind: torch.Tensor) -> torch.Tensor:
        """content (..., hidden) pooled input embeddings of each page, kind (...) TEXT/IMAGE/PAD ->
        (..., route_dim)."""
        e = self.page_proj(self.content_norm(content.float()))
        return e + self.kind_emb((kind == IMAGE).long())

    # one step ---------------------------------------------------------------------------------------
    def routing_vectors(
        self,
        last_hidden: torch.Tensor,
        page_emb: torch.Tensor,
        image_pages: torch.Tensor,
        layer_idx: int,
        text_state: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """last_hidden (B, hidden), page_emb (B, Hkv, P, R), image_pages (B, Hkv, P) bool -> u (B, Hkv, R).
        `text_state`: `text_state(last_hidden)` computed once per decode step (computed here if absent).
        Only layer `layer_idx`'s rows of the output layer are computed.

        The cross-attention's keys and values are linear in the page embeddings, so they are folded into
        the query and the pooled embedding instead of being kept per page: q . (W_k e_j + b_k) =
        (q W_k) . e_j + q . b_k, the last term the same for every page (the softmax drops it), and
        sum_j w_j (W_v e_j + b_v) = W_v (sum_j w_j e_j) + b_v sum_j w_j."""
        c = self.config
        page_emb = page_emb.float()
        b, hkv, p, r = page_emb.shape
        t = self.text_state(last_hidden) if text_state is None else text_state  # (B, R)
        qk = self.xq(t) @ self.xk.weight  # (B, R)
        att = torch.einsum("br,bhpr->bhp", qk, page_emb) / math.sqrt(r)  # (B, Hkv, P)
        att = att.masked_fill(~image_pages, float("-inf"))
        w = torch.softmax(att, -1).nan_to_num(0.0)  # no image page: no fused term
        pooled = torch.einsum("bhp,bhpr->bhr", w, page_emb)  # (B, Hkv, R)
        fused = self.xo(F.linear(pooled, self.xv.weight) + self.xv.bias * w.sum(-1, keepdim=True))
        z = self.mlp(torch.cat([t.unsqueeze(1).expand(b, hkv, r), fused], -1))  # (B, Hkv, M)
        # only the output layer's rows of (layer_idx, head h) for head h: W z + bias + scale * B (A z)
        L, H = c.num_layers, c.num_kv_heads
        w_out = self.out.base.weight.view(L, H, r, -1)[layer_idx, :hkv]  # (Hkv, R, M), a view
        b_out = self.out.base.bias.view(L, H, r)[layer_idx, :hkv]  # (Hkv, R)
        lora_b = self.out.lora_b.view(L, H, r, -1)[layer_idx, :hkv]  # (Hkv, R, rank)
        u = torch.einsum("bhm,hrm->bhr", z, w_out) + b_out
        return u + self.out.scale * torch.einsum("bhk,hrk->bhr", z @ self.out.lora_a.T, lora_b)

    def text_state(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """(B, hidden) -> (B, R): the previous token's state, the same for every layer of a decode step."""
        return self.text_proj(self.text_norm(last_hidden.float()))

    def forward(
        self,
        last_hidden: torch.Tensor,
        page_emb: torch.Tensor,
        page_kind: torch.Tensor,
        page_valid: torch.Tensor,
        layer_idx: int,
        text_state: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Page logits (B, Hkv, P); -inf for pages that are not valid. `page_emb` may be in the model's
        dtype (the cache's page record); the logits are computed in fp32."""
        image = page_valid & (page_kind == IMAGE)
        u = self.routing_vectors(last_hidden, page_emb, image, layer_idx, text_state)
        logits = torch.einsum("bhr,bhpr->bhp", u, page_emb.float()) / self.log_temperature.exp()
        p = page_emb.shape[-2]
        # locality: distance in pages to the newest valid page of the head
        idx = torch.arange(p, device=logits.device)
        newest = torch.where(page_valid, idx, -1).amax(-1, keepdim=True)
        dist = (newest - idx).clamp(min=0).float()
        logits = logits - dist / self.config.locality_tau
        return logits.masked_fill(~page_valid, float("-inf"))


# ---------------------------------------------------------------------------------------------------------
# saving and loading


def save_weights_dir(
    net: nn.Module,
    out_dir: str | Path,
    fmt: str,
    config_file: str = CONFIG_FILE,
    weights_file: str = WEIGHTS_FILE,
) -> Path:
    """Write a learned router's weights (safetensors) and its config (JSON, `{"format": fmt, ...}`) into
    out_dir, each atomically: what `load_weights_dir` reads."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}
    atomic_write_bytes(out / weights_file, save(state))
    atomic_write_json(out / config_file, {"format": fmt, **asdict(net.config)})
    return out


def save_router(router: HybridRouter, out_dir: str | Path) -> Path:
    """Write router.safetensors and router.json into out_dir (each atomically)."""
    return save_weights_dir(router, out_dir, "mm-oval-router-1")


def load_weights_dir(
    path: str | Path,
    config_cls: Any,
    build: Any,
    what: str,
    hint: str,
    model: Any = None,
    config_file: str = CONFIG_FILE,
    weights_file: str = WEIGHTS_FILE,
) -> Any:
    """A learned router's directory (`config_file` JSON + `weights_file` safetensors) -> `build(config)`
    with its weights, in eval mode; with `model`, checked against the model it was trained for. Missing,
    malformed or mismatched files are DataErrors naming the file (ModelError for another model)."""
    d = Path(path)
    cfg_path, w_path = d / config_file, d / weights_file
    if not cfg_path.is_file() or not w_path.is_file():
        raise DataError(f"{d}: not a {what} directory (needs {config_file} and {weights_file}); {hint}")
    try:
        raw = json.loads(cfg_path.read_text())
        raw.pop("format", None)
        config = config_cls(**raw)
    except (json.JSONDecodeError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise DataError(f"{cfg_path}: not a valid {what} config ({e}); retrain or restore the router") from e
    net = build(config)
    try:
        state = load_file(str(w_path))
    except (SafetensorError, OSError) as e:
        raise DataError(f"{w_path} is truncated or corrupt ({e}); retrain or restore the router") from e
    try:
        net.load_state_dict(state)
    except RuntimeError as e:
        raise DataError(
            f"{w_path}: weights do not match {cfg_path} ({e}); retrain or restore the router"
        ) from e
    if model is not None:
        check_signature(config.model, model, str(d))
    return net.eval()


def load_router(path: str | Path, model: Any = None) -> HybridRouter:
    """Load a router directory; with `model`, check it was trained for that model (ModelError otherwise)."""
    return load_weights_dir(
        path, RouterConfig, HybridRouter, "router", "train one with `mm-oval train-router`", model
    )


def bundled_router_path() -> Path:
    """The router trained for the bundled tiny LLaVA (package data)."""
    path = Path(str(resources.files("mm_oval.policies") / "router_tiny"))
    if not (path / CONFIG_FILE).is_file():
        raise ModelError(
            f"no bundled router in {path}; train one with `mm-oval train-router` and pass retrieval_options="
            "{'weights': DIR}"
        )
    return path


# ---------------------------------------------------------------------------------------------------------
# page contents


def pool_page_content(
    inputs_embeds: torch.Tensor, token_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean input embedding of each page's tokens.

    inputs_embeds (B, N, hidden) of the prompt; token_index (B, Hkv, P, T) the prompt index of each page
    token (-1 = empty slot or a generated token). Returns content (B, Hkv, P, hidden) fp32 and has_content
    (B, Hkv, P) bool (False for pages without a prompt token). Only the page tokens' rows are gathered
    and then widened to fp32 (no fp32 copy of the whole prompt): the same sums as widening first."""
    b, n, hid = inputs_embeds.shape
    ok = (token_index >= 0) & (token_index < n)
    flat = token_index.clamp(0, n - 1).reshape(b, -1)  # (B, Hkv*P*T)
    gathered = inputs_embeds.gather(1, flat.unsqueeze(-1).expand(-1, -1, hid)).float()
    gathered = gathered.view(*token_index.shape, hid).masked_fill_(~ok.unsqueeze(-1), 0.0)
    count = ok.sum(-1, keepdim=True)
    content = gathered.sum(-2) / count.clamp_min(1)
    return content, count.squeeze(-1) > 0


# ---------------------------------------------------------------------------------------------------------
# the retrieval policy


@dataclass
class TextStateScratch:
    """What the layers of one decode step share: the router's text state of the step's `last_hidden`
    (computed by the first layer that scores, reused by the others)."""

    hidden: torch.Tensor | None = None  # the `last_hidden` it was computed from
    text_state: torch.Tensor | None = None

    def of(self, hidden: torch.Tensor, compute: Any) -> torch.Tensor:
        """The text state of `hidden`: `compute(hidden)` once per step."""
        if self.text_state is None or self.hidden is not hidden:
            self.hidden, self.text_state = hidden, compute(hidden)
        return self.text_state


@register_retrieval
class RouterRetrieval(RetrievalPolicy):
    """Learned page retrieval. Options: `weights` (a router directory; default: the bundled tiny LLaVA's).

    Needs from the cache: `PageBatch.token_index` and the prompt's `inputs_embeds` in `PageBatch.request`
    (page contents), and `DecodeContext.step.last_hidden` (the previous token's final hidden state)."""

    name: ClassVar[str] = "router"
    needs_inputs_embeds: ClassVar[bool] = True  # page contents pool the prompt's input embeddings
    needs_last_hidden: ClassVar[bool] = True  # the previous token's final hidden state routes
    StepScratch: ClassVar[type] = TextStateScratch

    def __init__(
        self,
        weights: str | Path | None = None,
        router: HybridRouter | None = None,
        model: Any = None,
        check_weights: bool = True,
    ):
        self.source = str(weights or bundled_router_path()) if router is None else "<in-memory>"
        self.router = router if router is not None else load_router(self.source)
        self.router.eval()
        self.check_weights = check_weights
        self._checked: set[int] = set()
        if model is not None:
            self.bind(model)

    def bind(self, model: Any) -> None:
        """Check the router against `model` at once, as KVP agents are (`mm_oval.wrap` calls this):
        a ModelError naming both signatures for a model of other shapes or (unless `check_weights=False`)
        other weights."""
        if self.router.config.model:
            check_signature(self.router.config.model, model, self.source, self.check_weights)
        self._checked = set(range(self.router.config.num_layers))

    def _check_layer(self, pages: PageBatch) -> None:
        """Without `bind`, each layer is checked when its pages first close (its number, and its k_proj /
        v_proj fingerprint when the router's signature has one)."""
        i = pages.layer_idx
        if i in self._checked:
            return
        c = self.router.config
        if not 0 <= i < c.num_layers:
            raise ModelError(
                f"the router in {self.source} covers {c.num_layers} layers, this model has a layer {i}: "
                f"it belongs to another model; {_HINT}"
            )
        probe = (c.model or {}).get("probe") or []
        if self.check_weights and pages.module is not None and i < len(probe):
            got = signature.probe_from_attention(pages.module)
            if got and not signature.probe_matches(probe[i], got):
                raise ModelError(
                    f"the router in {self.source}: trained for model {c.model.get('name_or_path') or '?'} "
                    f"(fingerprint {c.model.get('fingerprint')}); layer {i} of this model has other weights: "
                    f"{_HINT}"
                )
        self._checked.add(i)

    def summarize(self, pages: PageBatch) -> dict[str, torch.Tensor]:
        self._check_layer(pages)
        token_index = getattr(pages, "token_index", None)
        embeds = pages.request.inputs_embeds
        kind = pages.kind
        if embeds is None or token_index is None:
            if bool((kind == IMAGE).any()):  # image pages always come from the prompt: they need content
                raise ConfigError(
                    "the router needs page contents: PageBatch.token_index and request.inputs_embeds "
                    "(the prompt's input embeddings); this cache does not provide them"
                )
            content = torch.zeros(*kind.shape, self.router.config.hidden_size, device=pages.keys.device)
        else:
            content, _ = pool_page_content(embeds, token_index)
        with torch.no_grad():
            emb = self.router.to(content.device).embed_pages(content, kind)
        del content
        # the page record: route_dim entries per page and KV head, in the model's dtype
        return {"route_emb": emb.to(pages.keys.dtype)}

    def score_pages(self, ctx: DecodeContext) -> torch.Tensor:
        hidden = ctx.step.last_hidden
        if hidden is None:
            raise ConfigError(
                "the router needs DecodeContext.step.last_hidden (the previous token's hidden state)"
            )
        emb = ctx.summaries["route_emb"]
        if hidden.shape[-1] != self.router.config.hidden_size:
            raise ModelError(
                f"the router expects hidden size {self.router.config.hidden_size}, the model has {hidden.shape[-1]}: "
                "it was trained for another model; train one with `mm-oval train-router`"
            )
        with torch.no_grad():
            # the text state depends on the step only: the first layer computes it, the others reuse it
            text_state = ctx.step.state_of(self).of(hidden, self.router.text_state)
            return self.router(hidden, emb, ctx.page_kind, ctx.page_len > 0, ctx.layer_idx, text_state)
