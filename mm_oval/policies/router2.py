"""Router v2: a hybrid page router that starts as a training-free key-summary scorer and learns a correction.

For one decode step, layer l and KV head h, page j's logit is

    logit_j = base_j + correction_j

- base_j: the configured training-free scorer's own score of the page for the current query (`base="quest"`
  or `"oval"`: that policy object's `summarize` / `score_pages`, nothing copied), a log page probability;
- correction_j = u_{l,h} . e_j                      (content: text state x page content)
               + w_{l,h} (-d_j / tau)               (locality: distance decay, learned weight)
               + g_{l,h} . GCN(co-read graph)_j      (optional: pages read together over the last steps)

  with e_j = mean over the page's tokens of W_page LN(x_t) + kind_j (x_t the LM input embedding: the model's
  own CLIP feature through the projector for image tokens, the token embedding for text; W_page initialised
  from the principal directions of such contents), u_{l,h} from the text state t = W_text LN(h_prev) (the
  previous token's final hidden state) fused with the image pages by one cross-attention, a 2-layer MLP and
  an output layer with LoRA. The output layer, w and g start at exactly zero, so an untrained router v2
  selects exactly what its base scorer selects; training (mm_oval.training.router, `mm-oval train-router
  --version 2`) distils full attention's page mass into base + correction.

Per page the router reads its own record, e_j (route_dim entries in the model's dtype; over a compact base,
int8 with one fp16 scale per page: `record_format`), besides the base scorer's summary: `summary_bytes`
counts both. Page embeddings are projected per token to route_dim before
pooling, so no (pages x tokens x hidden) gather is ever made.

`predict_ahead="step"` scores step t+1's pages from step t's state: the base scorer gets the previous step's
query of the same layer (the correction already routes from the previous token's hidden state), so a
serving system can fetch the pages before the query exists. `predict_ahead_hit_rate` measures how many of
the pages the exact scores choose the predicted ones hold.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from ..errors import ConfigError, ModelError
from .base import (
    IMAGE,
    BytesBudget,
    DecodeContext,
    PageBatch,
    RetrievalPolicy,
    SharedHeads,
    make_retrieval,
    register_retrieval,
    select_by_score,
)
from .page_summaries import SUMMARY_FORMATS, dequantize_int8, quantize_int8
from .router import (
    LoRALinear,
    TextStateScratch,
    check_signature,
    load_weights_dir,
    pool_page_content,
    save_weights_dir,
)

# steps of page reads the co-read graph holds by default; the retrieval monitor's co-read density
# (mm_oval.stats) uses the same window, so it measures the graph this router would see
CO_READ_WINDOW = 8
logger = logging.getLogger(__name__)
WEIGHTS_FILE = "router2.safetensors"
CONFIG_FILE = "router2.json"
BASES = ("quest", "oval")
BASE_FLOOR = -1e4  # an empty-probability page's base score (-inf) is floored here: finite for training
_HINT = "train one for this model with `mm-oval train-router --version 2 --model <model> --out <dir>`"


@dataclass
class Router2Config:
    """Shapes of a router v2, its base scorer and its parts, and the model it belongs to."""

    hidden_size: int
    num_layers: int
    num_kv_heads: int
    base: str = "quest"
    base_options: dict[str, Any] = field(default_factory=dict)
    route_dim: int = 16
    mlp_hidden: int = 64
    lora_rank: int = 4
    lora_alpha: float = 8.0
    locality_tau: float = 32.0
    content: bool = True  # the content x text-state term
    locality: bool = False  # the distance-decay term (off by default: it added nothing over content)
    gcn: bool = False  # the co-read graph term
    gcn_window: int = CO_READ_WINDOW  # steps of page reads the co-read graph holds
    model: dict[str, Any] = field(default_factory=dict)
    page_init: str = "pca"
    # a KV head whose step reads fewer pages than this uses its base's choice: below it, the correction
    # chose worse than the base on the held-out prompts (`training.router.fit_min_read_pages`)
    min_read_pages: int = 1

    def validate(self) -> None:
        for name in (
            "hidden_size",
            "num_layers",
            "num_kv_heads",
            "route_dim",
            "mlp_hidden",
            "lora_rank",
            "gcn_window",
            "min_read_pages",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"router2 config: {name} must be an int >= 1, got {v!r}")
        if self.base not in BASES:
            raise ConfigError(f"router2: base must be one of {', '.join(BASES)}, got {self.base!r}")
        if not isinstance(self.base_options, dict):
            raise ConfigError(f"router2: base_options must be a dict, got {self.base_options!r}")
        if self.locality_tau <= 0:
            raise ConfigError(f"router2 config: locality_tau must be > 0, got {self.locality_tau}")


class Router2Net(nn.Module):
    """The correction network. Inputs are plain tensors, so training and the cache share it."""

    def __init__(self, config: Router2Config):
        super().__init__()
        config.validate()
        self.config = c = config
        r = c.route_dim
        self.content_norm = nn.LayerNorm(c.hidden_size, elementwise_affine=False)
        self.page_proj = nn.Linear(c.hidden_size, r, bias=False)
        self.kind_emb = nn.Embedding(2, r)  # TEXT, IMAGE
        nn.init.zeros_(self.kind_emb.weight)
        self.text_norm = nn.LayerNorm(c.hidden_size)
        self.text_proj = nn.Linear(c.hidden_size, r)
        self.xq = nn.Linear(r, r)
        self.xk = nn.Linear(r, r)
        self.xv = nn.Linear(r, r)
        self.xo = nn.Linear(r, r)
        self.mlp = nn.Sequential(nn.Linear(2 * r, c.mlp_hidden), nn.GELU())
        self.out = LoRALinear(c.mlp_hidden, c.num_layers * c.num_kv_heads * r, c.lora_rank, c.lora_alpha)
        nn.init.zeros_(self.out.base.weight)  # the content term starts at exactly zero
        nn.init.zeros_(self.out.base.bias)
        self.locality_weight = nn.Parameter(torch.zeros(c.num_layers, c.num_kv_heads))
        self.gcn_in = nn.Linear(r + 1, r)
        self.gcn_weight = nn.Parameter(torch.zeros(c.num_layers, c.num_kv_heads, r))

    def correction_is_zero(self) -> bool:
        """True when every term's output weights are zero (a fresh router, or training kept its start): the
        correction is then exactly 0 whatever the inputs."""
        c = self.config
        zero = [self.out.base.weight, self.out.base.bias, self.out.lora_b] if c.content else []
        zero += [self.locality_weight] if c.locality else []
        zero += [self.gcn_weight] if c.gcn else []
        return all(not bool(t.any()) for t in zero)

    # pages ------------------------------------------------------------------------------------------
    def token_embeddings(self, inputs_embeds: torch.Tensor, chunk: int = 256) -> torch.Tensor:
        """(B, N, hidden) LM input embeddings -> (B, N, route_dim): W_page LN(x), per token, `chunk` tokens at
        a time (the fp32 normalised copy is never the whole prompt's)."""
        parts = [self.page_proj(self.content_norm(x.float())) for x in inputs_embeds.split(chunk, dim=-2)]
        return torch.cat(parts, -2)

    def page_embeddings(self, content: torch.Tensor, kind: torch.Tensor) -> torch.Tensor:
        """content (..., hidden) = the mean of LN(x) over each page's tokens (what training captures) -> (..., R).
        The same as pooling `token_embeddings` (W_page is linear)."""
        return self.page_proj(content.float()) + self.kind_emb((kind == IMAGE).long())

    def text_state(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """(B, hidden) -> (B, R): the previous token's state, the same for every layer of a step."""
        return self.text_proj(self.text_norm(last_hidden.float()))

    # one step ---------------------------------------------------------------------------------------
    def correction(
        self,
        text_state: torch.Tensor,
        page_emb: torch.Tensor,
        page_kind: torch.Tensor,
        page_valid: torch.Tensor,
        base: torch.Tensor,
        layer_idx: int,
        history: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """text_state (B, R), page_emb (B, Hkv, P, R), page_kind/page_valid (B, Hkv, P), base (B, Hkv, P) the
        floored base scores, history (B, Hkv, W, P) bool pages read at the last W steps (GCN) -> (B, Hkv, P)."""
        c = self.config
        b, hkv, p, r = page_emb.shape
        out = page_emb.new_zeros(b, hkv, p)
        if c.content:
            # cross-attention of the text state over the image pages; xk and xv are folded into the query
            # and the pooled page, so a step touches each page embedding only twice (the key bias adds the
            # same to every page and drops out of the softmax)
            q = self.xq(text_state) @ self.xk.weight  # (B, R)
            att = torch.einsum("br,bhpr->bhp", q, page_emb) / math.sqrt(r)
            att = att.masked_fill(~(page_valid & (page_kind == IMAGE)), float("-inf"))
            w = torch.softmax(att, -1).nan_to_num(0.0)  # no image page: no fused term
            pooled = torch.einsum("bhp,bhpr->bhr", w, page_emb)
            fused = self.xo(pooled @ self.xv.weight.T + self.xv.bias * w.sum(-1, keepdim=True))  # (B, Hkv, R)
            z = self.mlp(torch.cat([text_state.unsqueeze(1).expand(b, hkv, r), fused], -1))  # (B, Hkv, M)
            L, H = c.num_layers, c.num_kv_heads
            w_out = self.out.base.weight.view(L, H, r, -1)[layer_idx, :hkv]  # only this layer's rows
            b_out = self.out.base.bias.view(L, H, r)[layer_idx, :hkv]
            lora_b = self.out.lora_b.view(L, H, r, -1)[layer_idx, :hkv]
            u = torch.einsum("bhm,hrm->bhr", z, w_out) + b_out
            u = u + self.out.scale * torch.einsum("bhk,hrk->bhr", z @ self.out.lora_a.T, lora_b)
            out = out + torch.einsum("bhr,bhpr->bhp", u, page_emb)
        if c.locality:
            idx = torch.arange(p, device=page_emb.device)
            newest = torch.where(page_valid, idx, -1).amax(-1, keepdim=True)
            dist = (newest - idx).clamp(min=0).float()
            out = out - self.locality_weight[layer_idx, :hkv, None] * dist / c.locality_tau
        if c.gcn and history is not None and history.shape[-2] > 0:
            out = out + (
                self.gcn_features(page_emb, base, page_valid, history)
                * self.gcn_weight[layer_idx, :hkv, None]
            ).sum(-1)
        return out

    def gcn_features(
        self, page_emb: torch.Tensor, base: torch.Tensor, page_valid: torch.Tensor, history: torch.Tensor
    ) -> torch.Tensor:
        """One GCN layer over the co-read graph A = S^T S + I (S: the last W steps' page reads, (.., W, P)),
        row-normalised, on node features [e_j, standardised base_j]; computed as S^T (S x) without forming A."""
        s = history.float() * page_valid.unsqueeze(-2)
        bz = base.masked_fill(~page_valid, 0.0)
        n = page_valid.sum(-1, keepdim=True).clamp(min=1)
        mean = bz.sum(-1, keepdim=True) / n
        std = (((bz - mean) * page_valid).pow(2).sum(-1, keepdim=True) / n).sqrt().clamp_min(1e-3)
        x = torch.cat([page_emb, (((bz - mean) / std) * page_valid).unsqueeze(-1)], -1)  # (B, Hkv, P, R+1)
        agg = torch.einsum("bhwp,bhwf->bhpf", s, torch.einsum("bhwp,bhpf->bhwf", s, x)) + x
        deg = torch.einsum("bhwp,bhw->bhp", s, s.sum(-1)) + 1.0
        return torch.nn.functional.gelu(self.gcn_in(agg / deg.unsqueeze(-1)))


# ---------------------------------------------------------------------------------------------------------
# saving and loading


def save_router2(net: Router2Net, out_dir: str | Path) -> Path:
    """Write router2.safetensors and router2.json into out_dir (each atomically)."""
    return save_weights_dir(net, out_dir, "mm-oval-router2-1", CONFIG_FILE, WEIGHTS_FILE)


def load_router2(path: str | Path, model: Any = None) -> Router2Net:
    """Load a router v2 directory; with `model`, check it was trained for that model (ModelError otherwise)."""
    return load_weights_dir(
        path, Router2Config, Router2Net, "router v2", _HINT, model, CONFIG_FILE, WEIGHTS_FILE
    )


# weights=NAME -> mm_oval.zoo package data folder: the 576-token model's router v2 over Quest on 2x2 tiles
# (float bounds), over compact Quest on 4x4 tiles (`image_tile=4`, what fits a 25% bytes budget), and over
# compact OVAL on 4x4 tiles (`image_tile=4`), rank 8 and rank 2. The default is the last: it was trained on
# the default pages (4x4 tiles) over compact OVAL rank 2, the base that scores best in the bytes it reads
# (docs/results/bundled576.md, "Retrieval at equal bytes"); weights trained on 2x2 tiles ("bundled576") want `image_tile=2`.
DEFAULT_WEIGHTS = "bundled576-oval4c-r2"
# weights left unset: the first of these trained for the wrapped model (DEFAULT_WEIGHTS when none is)
DEFAULT_FOR_MODELS = (DEFAULT_WEIGHTS, "smollm2-oval2")
BUNDLED = {
    "bundled576": "tiny_llava576_router2",
    "bundled576-quest4c": "tiny_llava576_router2_quest4c",
    "bundled576-oval4c": "tiny_llava576_router2_oval4c",
    "bundled576-oval4c-r2": "tiny_llava576_router2_oval4c_r2",
    # SmolLM2-135M-Instruct (--model smollm2): over compact OVAL rank 2 on 16-token text pages, trained on
    # question-agnostic long-context prompts (docs/results/smollm2.md)
    "smollm2-oval2": "smollm2_router2_oval2",
}


def bundled_router2_path(name: str = "bundled576") -> Path:
    """The router v2 trained for a bundled model (package data beside it)."""
    if name not in BUNDLED:
        raise ConfigError(
            f"router2: unknown bundled weights {name!r}; known: {', '.join(BUNDLED)}, or a directory"
        )
    path = Path(str(resources.files("mm_oval.zoo") / BUNDLED[name]))
    if not (path / CONFIG_FILE).is_file():
        raise ModelError(
            f"no bundled router v2 in {path}; {_HINT} and pass retrieval_options={{'weights': DIR}}"
        )
    return path


# ---------------------------------------------------------------------------------------------------------
# the retrieval policy


@dataclass
class Router2State:
    """Router v2's memory of one request's decode steps (fresh per request, copied with it)."""

    # layer -> the newest query row of the layer at the previous step (predict_ahead="step")
    previous_query: dict[int, torch.Tensor] = field(default_factory=dict)
    # (layer, its newest query row) of the layer just run in this step (predict_ahead="layer")
    layer_query: tuple[int, torch.Tensor] | None = None
    # layer -> (B, Hkv, steps, P) bool: the pages each recent step read, the co-read graph's window
    history: dict[int, torch.Tensor] = field(default_factory=dict)

    def query_ahead(self, ctx: DecodeContext, mode: str) -> torch.Tensor | None:
        """The query `mode` predicts this layer's pages from (None: none yet), then this step's kept for the
        next: the same layer's at the previous step ("step"), the layer before's in this step ("layer")."""
        now = ctx.query[:, :, -1:].detach()
        if mode == "step":
            prev = self.previous_query.get(ctx.layer_idx)
            self.previous_query[ctx.layer_idx] = now
        else:
            item = self.layer_query
            prev = item[1] if item is not None and item[0] == ctx.layer_idx - 1 else None
            self.layer_query = (ctx.layer_idx, now)
        return prev


# "step": step t+1's pages from step t's query of the same layer; "layer": layer l+1's pages from layer l's
# query of the same step (the first decode step, or layer 0, uses its own)
PREDICT_AHEAD = ("off", "step", "layer")


def predicted_context(ctx: DecodeContext, previous_query: torch.Tensor | None) -> DecodeContext:
    """The context a predict-ahead scorer sees: the query it predicts from (the newest row of the previous
    step's, or of the layer before's) in place of this step's; this step's own when there is none (the first
    decode step, layer 0)."""
    if previous_query is None:
        return ctx
    return dataclasses.replace(ctx, query=previous_query)


RECORD_KEYS = ("r2_emb", "r2_emb_q", "r2_emb_scale")  # the router's own page record, either format


@register_retrieval
class Router2Retrieval(RetrievalPolicy):
    """Router v2 (module docstring). Options: `weights` (a router2 directory, a bundled name (`BUNDLED`;
    default "auto": the bundled weights trained for the wrapped model, the first of `DEFAULT_FOR_MODELS`
    that is ("bundled576-oval4c-r2" for the 576-token tiny LLaVA, "smollm2-oval2" for SmolLM2; the first
    when no model is bound)), or "none": no correction, the base scorer alone; weights whose
    correction is exactly zero act as "none"), `base` ("quest" or "oval"; with trained
    weights, the one they were trained on), `base_options` (the base scorer's options), `predict_ahead`
    ("off"; "step": from the previous step's query of the layer; "layer": from the layer before's query of
    this step), `gcn_budget` (the share of candidates a step counts as read in the co-read graph),
    `record_format` ("auto": the base's summary_format; "float": the page embedding in the model's dtype;
    "compact": int8 with one fp16 scale per page, route_dim + 2 bytes)."""

    name: ClassVar[str] = "router2"
    # its scores are the base's estimate of the head's attention on the candidate pages, redistributed over
    # them by the router (`on_base_scale`): one scale for every head when the base's is (OVAL, LOCKS, Quest)
    comparable_across_heads: ClassVar[bool] = True
    needs_inputs_embeds: ClassVar[bool] = True
    needs_last_hidden: ClassVar[bool] = True
    State: ClassVar[type] = Router2State
    StepScratch: ClassVar[type] = TextStateScratch

    def __init__(
        self,
        weights: str | Path | None = "auto",
        base: str | None = None,
        base_options: dict[str, Any] | None = None,
        predict_ahead: str = "off",
        net: Router2Net | None = None,
        model: Any = None,
        check_weights: bool = True,
        gcn_budget: float = 0.25,
        skip_zero: bool = True,
        record_format: str = "auto",
    ):
        # no weights named: the bundled weights of the model this policy is bound to (`bind`), if it has some
        self.chosen_by_default = weights == "auto" and net is None
        if weights == "auto":
            weights = DEFAULT_WEIGHTS
        self._options = dict(base=base, base_options=base_options, predict_ahead=predict_ahead,
                             check_weights=check_weights, gcn_budget=gcn_budget, skip_zero=skip_zero,
                             record_format=record_format)  # fmt: skip
        if predict_ahead not in PREDICT_AHEAD:
            raise ConfigError(
                f"router2: predict_ahead must be 'off', 'step' or 'layer', got {predict_ahead!r}"
            )
        if net is None and weights not in (None, "none"):
            w = str(weights)
            self.source = str(bundled_router2_path(w)) if w in BUNDLED else w
            net = load_router2(self.source)
        else:
            self.source = "<in-memory>" if net is not None else "<none>"
        trained = net.config if net is not None else None
        # a correction that is exactly zero changes no choice: the base alone, reading no page record
        # (`skip_zero=False` keeps it, to run the correction's arithmetic)
        self.net = net.eval() if net is not None and not (skip_zero and net.correction_is_zero()) else None
        if trained is not None and base is not None and base != trained.base:
            raise ConfigError(
                f"router2: the weights in {self.source} were trained on base={trained.base!r}, not {base!r}; "
                f"drop the base option or {_HINT}"
            )
        self.base_name = trained.base if trained is not None else (base or "quest")
        if self.base_name not in BASES:
            raise ConfigError(f"router2: base must be one of {', '.join(BASES)}, got {self.base_name!r}")
        opts = dict(trained.base_options if trained is not None else {}) | dict(base_options or {})
        self.base = make_retrieval(self.base_name, **opts)
        # unread_pages uses the base's mass estimates ("scored") and key means ("centroid") where it has them
        self.estimates_page_mass = bool(self.base.estimates_page_mass)
        self.keeps_key_means = bool(self.base.keeps_key_means)
        if record_format not in ("auto", *SUMMARY_FORMATS):
            raise ConfigError(
                f"router2: record_format must be 'auto', 'float' or 'compact', got {record_format!r}"
            )
        base_format = getattr(self.base, "summary_format", "float")
        self.record_format = base_format if record_format == "auto" else record_format
        self.predict_ahead = predict_ahead
        self.check_weights = check_weights
        self.gcn_budget = float(gcn_budget)
        if model is not None:
            self.bind(model)

    def bind(self, model: Any) -> None:
        """Check the weights against `model` (`mm_oval.wrap` calls this): a ModelError for another model.
        With no weights named, the first of DEFAULT_FOR_MODELS trained for `model` is used (SmolLM2 gets its
        own); a model with none of its own is refused as before."""
        if self.chosen_by_default:
            self._pick_bundled_for(model)
        if self.net is not None and self.net.config.model:
            check_signature(self.net.config.model, model, self.source, self.check_weights)
        getattr(self.base, "bind", lambda m: None)(model)

    def _pick_bundled_for(self, model: Any) -> None:
        for name in DEFAULT_FOR_MODELS:
            net = load_router2(bundled_router2_path(name))
            try:
                check_signature(net.config.model, model, name, self.check_weights)
            except ModelError:
                continue
            if str(bundled_router2_path(name)) != self.source:
                logger.info("router2: no weights named; using the bundled %r, trained for this model", name)
                self.__init__(
                    weights=name, **self._options
                )  # the base and records those weights were trained on
            return

    # summaries --------------------------------------------------------------------------------------
    def summarize(self, pages: PageBatch) -> dict[str, torch.Tensor]:
        out = dict(self.base.summarize(pages))
        if self.net is None:
            return out
        c = self.net.config
        if not 0 <= pages.layer_idx < c.num_layers:
            raise ModelError(
                f"the router v2 in {self.source} covers {c.num_layers} layers, this model has a layer "
                f"{pages.layer_idx}: it belongs to another model; {_HINT}"
            )
        embeds, token_index = pages.request.inputs_embeds, pages.token_index
        dtype = pages.keys.dtype
        with torch.no_grad():
            net = self.net.to(pages.keys.device)
            if embeds is None or token_index is None:
                if bool((pages.kind == IMAGE).any()):
                    raise ConfigError(
                        "router2 needs page contents: PageBatch.token_index and request.inputs_embeds "
                        "(the prompt's input embeddings); this cache does not provide them"
                    )
                emb = net.kind_emb((pages.kind == IMAGE).long())
            else:
                emb = pool_token_embeddings(net.token_embeddings(embeds), token_index)
                emb = emb + net.kind_emb((pages.kind == IMAGE).long())
        if self.record_format == "compact":  # int8, one fp16 scale per page
            out["r2_emb_q"], out["r2_emb_scale"] = quantize_int8(emb, 1)
        else:
            out["r2_emb"] = emb.to(dtype)  # (B, Hkv, P, R): the router's own per-page record
        return out

    def _base_summaries(self, summaries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v for k, v in summaries.items() if k not in RECORD_KEYS}

    @staticmethod
    def page_embeddings(summaries: dict[str, torch.Tensor]) -> torch.Tensor:
        """The router's page record as fp32 (B, Hkv, P, R), from either format."""
        if "r2_emb_q" in summaries:
            return dequantize_int8(summaries["r2_emb_q"], summaries["r2_emb_scale"])
        return summaries["r2_emb"].float()

    def summary_bytes(self, summaries: dict[str, torch.Tensor], page_len: torch.Tensor) -> torch.Tensor:
        """The base scorer's summary bytes plus the router's page embedding (route_dim entries in its dtype,
        or route_dim int8 entries and a 2-byte scale)."""
        own = self.base.summary_bytes(self._base_summaries(summaries), page_len)
        if "r2_emb_q" in summaries:
            own = own + summaries["r2_emb_q"].shape[-1] + 2
        elif "r2_emb" in summaries:
            e = summaries["r2_emb"]
            own = own + e.shape[-1] * e.element_size()
        return own

    # scores -----------------------------------------------------------------------------------------
    def base_scores(self, ctx: DecodeContext) -> torch.Tensor:
        """The base scorer's page scores (floored at BASE_FLOOR), from this step's query or, predicting
        ahead, the previous step's query of this layer ("step") or this step's query of the layer before
        ("layer")."""
        if self.predict_ahead != "off":
            prev = ctx.request.state_of(self).query_ahead(ctx, self.predict_ahead)
            if prev is not None and prev.shape != ctx.query[:, :, -1:].shape:
                prev = None
            ctx = predicted_context(ctx, prev)
        sub = dataclasses.replace(ctx, summaries=self._base_summaries(ctx.summaries))
        return self.base.score_pages(sub).float().clamp(min=BASE_FLOOR)

    def score_pages(self, ctx: DecodeContext) -> torch.Tensor:
        return self._scores(ctx)[1]

    def page_key_means(self, summaries: dict[str, torch.Tensor]) -> torch.Tensor | None:
        return self.base.page_key_means(self._base_summaries(summaries))

    def page_log_mass(self, ctx: DecodeContext) -> torch.Tensor | None:
        """The base's estimate of each page's log attention mass (OVAL / LOCKS: its low-rank record; the
        router's logits rank pages and are no such estimate), for the query itself, not predicted ahead."""
        return self.base.page_log_mass(
            dataclasses.replace(ctx, summaries=self._base_summaries(ctx.summaries))
        )

    def _scores(self, ctx: DecodeContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(base scores, base + correction) of this step (the base asked once: predict-ahead keeps state)."""
        base = self.base_scores(ctx)
        if self.net is None:
            return base, base
        hidden = ctx.step.last_hidden
        if hidden is None:
            raise ConfigError(
                "router2 needs DecodeContext.step.last_hidden (the previous token's hidden state)"
            )
        if hidden.shape[-1] != self.net.config.hidden_size:
            raise ModelError(
                f"the router v2 expects hidden size {self.net.config.hidden_size}, the model has "
                f"{hidden.shape[-1]}: it was trained for another model; {_HINT}"
            )
        with torch.no_grad():
            text_state = ctx.step.state_of(self).of(hidden, self.net.text_state)  # once per step
            history = self._gcn_history(ctx) if self.net.config.gcn else None
            corr = self.net.correction(
                text_state,
                self.page_embeddings(ctx.summaries),
                ctx.page_kind,
                ctx.page_len > 0,
                base,
                ctx.layer_idx,
                history,
            )
        return base, on_base_scale(base, base + corr, ctx.candidates)

    def _gcn_history(self, ctx: DecodeContext) -> torch.Tensor:
        h = ctx.request.state_of(self).history.get(ctx.layer_idx)
        p = ctx.page_len.shape[-1]
        if h is None:
            return ctx.candidates.new_zeros(*ctx.candidates.shape[:2], 0, p)
        return torch.nn.functional.pad(h, (0, p - h.shape[-1])) if h.shape[-1] < p else h[..., :p]

    def select(
        self, ctx: DecodeContext, read_budget: float | torch.Tensor | BytesBudget | SharedHeads
    ) -> torch.Tensor:
        base_scores, scores = self._scores(ctx)
        chosen = select_by_score(scores, ctx.candidates, read_budget)
        floor = self.net.config.min_read_pages if self.net is not None else 1
        if floor > 1 and isinstance(read_budget, SharedHeads):
            raise ConfigError(
                f"router2: these weights read their base's pages where a KV head reads fewer than "
                f"min_read_pages={floor}, a rule per head that heads sharing their read budget cannot keep: use "
                "read_head_budget='uniform' with them, or weights trained with min_read_pages=1"
            )
        if floor > 1:  # where a head reads fewer pages than that, its base chooses them
            base = select_by_score(base_scores, ctx.candidates, read_budget)
            chosen = torch.where((base.sum(-1) < floor).unsqueeze(-1), base, chosen)
        if self.net is not None and self.net.config.gcn:  # what the co-read graph of later steps holds
            read = select_by_score(scores, ctx.candidates, self.gcn_budget)
            h = torch.cat([self._gcn_history(ctx), read.unsqueeze(-2)], -2)
            ctx.request.state_of(self).history[ctx.layer_idx] = h[..., -self.net.config.gcn_window :, :]
        return chosen

    def state_tensors(self) -> list[torch.Tensor]:
        """The router's weights and the base scorer's own state."""
        return [*(self.net.parameters() if self.net is not None else []), *self.base.state_tensors()]


def pool_token_embeddings(tok: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
    """tok (B, N, R) per-token embeddings of the prompt, token_index (B, Hkv, P, T) the prompt index of each
    page token (-1: none) -> (B, Hkv, P, R), the mean over each page's prompt tokens (0 for none). Gathers
    route_dim entries per token, never the hidden size: the first router's `pool_page_content` over them."""
    return pool_page_content(tok, token_index)[0]


def on_base_scale(base: torch.Tensor, logits: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """The router's page logits (B, Hkv, P) shifted, per KV head, onto the base scorer's scale: softmax over
    the candidate pages of the logits (the router's distribution, trained over the candidates), times the
    base's estimated share of the head's attention on all of them (exp of the base scores' logsumexp over the
    candidates), as a log. A per-head shift, so a head's ranking, and what it reads in its own budget, are
    the logits'; heads without a candidate keep the logits."""
    neg = torch.finfo(logits.dtype).min
    has = candidates.any(-1, keepdim=True)
    shift = torch.logsumexp(base.masked_fill(~candidates, neg), -1, keepdim=True) - torch.logsumexp(
        logits.masked_fill(~candidates, neg), -1, keepdim=True
    )
    return logits + torch.where(has, shift, torch.zeros_like(shift))


def predict_ahead_hit_rate(
    policy: RetrievalPolicy,
    ctx: DecodeContext,
    previous_query: torch.Tensor,
    read_budget: float | torch.Tensor,
) -> torch.Tensor:
    """(B, Hkv): of the pages `policy` chooses at this step from the exact scores (`ctx.query`), the share the
    pages it chooses from the previous step's query (`previous_query`) hold. 1 where nothing is chosen.
    A router v2 is asked for its base scores by query (its correction does not depend on the query)."""

    def pick(c: DecodeContext) -> torch.Tensor:
        if isinstance(policy, Router2Retrieval):  # its scores by query alone: no memory of earlier steps
            mode, policy.predict_ahead = policy.predict_ahead, "off"
            try:
                scores = policy.score_pages(c)
            finally:
                policy.predict_ahead = mode
            return select_by_score(scores, c.candidates, read_budget)
        return policy.select(c, read_budget)

    exact = pick(ctx)
    ahead = pick(predicted_context(ctx, previous_query))
    n = exact.sum(-1)
    hit = (exact & ahead).sum(-1)
    return torch.where(n > 0, hit.double() / n.clamp(min=1), torch.ones_like(n, dtype=torch.double))
