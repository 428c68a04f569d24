"""Distil the hybrid page router from full attention.

1. Capture (`capture_router_data`): the unmodified model answers each prompt with exact (eager) attention.
   For every routed query (the last `prompt_queries` prompt positions and every decode step) and every
   layer and KV head, the teacher is the attention mass full attention puts on each page (mean over the
   group's query heads), pages laid out exactly as the cache lays them out (mm_oval.pages, nothing evicted).
   The router's input for a query at position i is the final hidden state (output of the LM's last norm)
   at position i - 1, what the wrapped model hands a retrieval policy at decode.
2. Initialise the page projection from the model's own CLIP features (principal directions of the page
   contents), or fit it to an open_clip checkpoint's joint image-text space when one is given.
3. Train with a focal loss over the candidate pages against the teacher's soft targets (the page-mass
   distribution over candidates), AdamW, and report on held-out prompts the share of candidate attention
   mass that the router's top pages hold next to the oracle's.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from ..cache import request_info
from ..config import DEFAULT_IMAGE_TILE
from ..errors import ConfigError, DataError, ModelError
from ..geometry import GEOMETRY_INPUTS, image_geometry, language_model
from ..measures import capture_qk, group_mean, page_mass
from ..pages import layout_pages
from ..policies.base import IMAGE, PAD
from ..policies.router import HybridRouter, RouterConfig, model_signature, pool_page_content
from ..zoo.generate import TrainSampler
from ..zoo.generate576 import TrainSampler576
from .traces import load_samples

log = logging.getLogger(__name__)


@dataclass
class RouterSample:
    """One prompt's routing data. P pages (the same for every KV head: nothing is evicted), S routed queries."""

    content: torch.Tensor  # (P, hidden) mean input embedding of each page
    kind: torch.Tensor  # (P,) int8 TEXT / IMAGE
    candidate: torch.Tensor  # (P,) bool: pages a read budget applies to (image, not pinned)
    page_index: torch.Tensor  # (P,) long: order of the page in the table (for locality)
    last_hidden: torch.Tensor  # (S, hidden): final hidden state of the token before each routed query
    mass: torch.Tensor  # (S, L, Hkv, P): full attention mass per page (group mean)
    tiles: list | None = None  # (P,) PIL crops / text of each page, for open_clip initialisation


@dataclass
class Prompt:
    image: Any  # PIL image (None for a text prompt)
    text: str  # user text after the image (a text prompt: the question after the context)
    context: str | None = None  # a text prompt's document, read before the question (eval/longtext.py)


def zoo_prompts(n: int, seed: int, geometry: int = 64) -> list[Prompt]:
    """Prompts from the bundled scene generator's train split (never the dev sets); `geometry=576`: the
    576-token benchmark's."""

    sampler = TrainSampler576(seed=seed) if geometry == 576 else TrainSampler(seed=seed)
    out = []
    for i in range(n):
        item = sampler.item(i, 1)
        if not item.questions:
            continue
        q = item.questions[0]
        out.append(Prompt(item.image, q.mmbench_prompt() if q.options else q.vqa_prompt()))
    return out


def load_prompts(spec: str, seed: int = 0) -> list[Prompt]:
    """`zoo:N` (the bundled generator's train split; `zoo576:N` the 576-token one's), `toy:N`, an MMBench TSV,
    a JSONL of {image, question}, or `longtext:train:N[:lengths[:kinds]]` (text prompts: a generated
    document, then its question; never the dev set's seeds)."""
    if spec.startswith("zoo"):
        n = int(spec.split(":", 1)[1]) if ":" in spec else 256
        return zoo_prompts(n, seed, 576 if spec.split(":", 1)[0] == "zoo576" else 64)

    samples = load_samples(spec, seed=seed)
    out = [Prompt(s.images[0], s.question) for s in samples if s.images]
    out += [Prompt(None, s.question, context=s.context) for s in samples if not s.images and s.context]
    if not out:
        raise DataError(f"router data {spec!r}: no sample with an image or a text context")
    return out


def hidden_and_embeds_hooks(lm: Any, box: dict[str, Any]) -> list:
    """Hooks on a language model that keep, in `box`, its final hidden states ("hidden": the output of its
    last norm) and its input embeddings ("embeds") of the latest forward; remove them when done."""

    def embeds(module: Any, args: tuple, kwargs: dict) -> None:
        x = kwargs.get("inputs_embeds")
        if x is None:  # a plain LM called with input_ids: its own token embeddings
            x = module.embed_tokens(kwargs["input_ids"] if "input_ids" in kwargs else args[0])
        box["embeds"] = x.detach()

    return [
        lm.norm.register_forward_hook(lambda m, a, o: box.__setitem__("hidden", o.detach())),
        lm.register_forward_pre_hook(embeds, with_kwargs=True),
    ]


@contextmanager
def hooked(model: Any, hooks: list) -> Iterator[None]:
    """Around a capture: on the way out (normally or not) the hooks are removed and the model's attention
    implementation is the one it had on the way in, whatever the capture switched it to."""
    previous = model.config._attn_implementation
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        model.set_attn_implementation(previous)


def _lm(model: Any) -> Any:
    lm = getattr(getattr(model, "model", None), "language_model", None)
    if lm is None or getattr(model.config, "image_token_id", None) is None:
        raise ModelError(
            f"{type(model).__name__} is not a LLaVA-style model (model.model.language_model and "
            "config.image_token_id are needed)"
        )
    return lm


@torch.no_grad()
def capture_router_data(
    model: Any,
    processor: Any,
    prompts: list[Prompt],
    *,
    max_new_tokens: int = 4,
    prompt_queries: int = 4,
    image_tile: int = DEFAULT_IMAGE_TILE,
    text_page_size: int = 16,
    sink_tokens: int = 4,
    recent_tokens: int = 16,
    keep_tiles: bool = False,
) -> list[RouterSample]:
    """Run the plain model with eager attention over each prompt and record the routing targets."""

    lm = _lm(model)
    cfg = model.config
    text = cfg.text_config
    hkv = text.num_key_value_heads
    box: dict[str, list] = {"hidden": [], "embeds": []}

    def norm_hook(module, args, output):
        box["hidden"].append(output.detach())

    def pre_hook(module, args, kwargs):
        if kwargs.get("inputs_embeds") is not None and not box["embeds"]:
            box["embeds"].append(kwargs["inputs_embeds"].detach())

    hooks = [
        lm.norm.register_forward_hook(norm_hook),
        lm.register_forward_pre_hook(pre_hook, with_kwargs=True),
    ]
    out: list[RouterSample] = []
    with hooked(model, hooks):
        model.set_attn_implementation("eager")
        for prompt in prompts:
            box["hidden"].clear()
            box["embeds"].clear()
            inputs, info, _ = _prompt_inputs(model, processor, prompt, sink_tokens, recent_tokens)
            ids = inputs["input_ids"]
            n = ids.shape[1]
            gen = model.generate(
                **inputs,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                output_attentions=True,
                return_dict_in_generate=True,
            )
            keep = (info.modality != PAD).unsqueeze(1).expand(1, hkv, n)
            lay = layout_pages(
                keep, info.modality, info.positions, info.image_rc, info.protected, image_tile, text_page_size
            )
            page_len, kind = lay.page_len[0, 0], lay.page_kind[0, 0]
            valid = page_len > 0
            p = int(valid.sum())
            tok_page = torch.full((n,), -1, dtype=torch.long, device=ids.device)
            slot_ok = lay.src[0, 0] >= 0
            tok_page[lay.src[0, 0][slot_ok]] = lay.slot_page[0, 0][slot_ok]
            # prompt index of every page token, as the cache hands it to a policy
            t = int(page_len.max())
            offs = torch.arange(t, device=ids.device)
            token_index = torch.where(
                offs < page_len[:p, None],
                lay.src[0, 0]
                .gather(0, (lay.page_start[0, 0, :p, None] + offs).clamp(max=lay.src.shape[-1] - 1).flatten())
                .view(p, t),
                -1,
            )
            content, _ = pool_page_content(box["embeds"][0], token_index[None, None])
            candidate = (kind[:p] == IMAGE) & ~lay.page_pinned[0, 0, :p]
            # routed queries: the last prompt positions (first answer token) and every decode step
            atts = gen.attentions  # per forward call: per layer (1, Hq, q, kv)
            hid = box["hidden"]
            lasts, masses = [], []
            first_q = max(n - prompt_queries, int(info.image_rc[0, :, 0].ge(0).nonzero().max()) + 2)
            for i in range(first_q, n):  # prompt rows: query i, router input = hidden at i - 1
                lasts.append(hid[0][0, i - 1])
                masses.append(torch.stack([a[0, :, i, :n] for a in atts[0]]))  # (L, Hq, n)
            for s in range(1, len(atts)):
                lasts.append(hid[s - 1][0, -1])
                masses.append(torch.stack([a[0, :, -1, :n] for a in atts[s]]))
            if not lasts:
                continue
            a = torch.stack(masses).float()  # (S, L, Hq, n)
            mass = page_mass(group_mean(a, hkv), tok_page, p)  # (S, L, Hkv, P)
            tiles = _page_tiles(prompt.image, processor, lay, info, p, tok_page, ids) if keep_tiles else None
            out.append(
                RouterSample(
                    content=content[0, 0].cpu(),
                    kind=kind[:p].cpu(),
                    candidate=candidate.cpu(),
                    page_index=torch.arange(p),
                    last_hidden=torch.stack(lasts).float().cpu(),
                    mass=mass.cpu(),
                    tiles=tiles,
                )
            )
    if not out:
        raise DataError("no routed query was captured: the prompts produced no decode step")
    return out


def _page_tiles(image, processor, lay, info, p, tok_page, ids) -> list:
    """What each page shows, for an open_clip encoder: the image crop of an image tile, the words of a text page."""
    size = processor.image_processor.crop_size
    img = image.convert("RGB").resize((size["width"], size["height"]))
    rc = info.image_rc[0]
    grid = int(rc[:, 1].max()) + 1
    cell_w, cell_h = img.width / grid, img.height / grid
    words = processor.tokenizer.convert_ids_to_tokens(ids[0])
    tiles: list = []
    for j in range(p):
        toks = (tok_page == j).nonzero().flatten()
        if lay.page_kind[0, 0, j] == IMAGE:
            r = rc[toks, 1]
            c = rc[toks, 2]
            box = (
                int(c.min() * cell_w),
                int(r.min() * cell_h),
                int((c.max() + 1) * cell_w),
                int((r.max() + 1) * cell_h),
            )
            tiles.append(img.crop(box))
        else:
            tiles.append(" ".join(words[i] for i in toks.tolist()))
    return tiles


# ---------------------------------------------------------------------------------------------------------
# initialisation of the page projection


def pca_page_init(router: HybridRouter, samples: list[RouterSample]) -> None:
    """W_page = the top principal directions of the (normalised) page contents: the model's own CLIP
    features for image pages and token embeddings for text pages, kept in one space."""
    w = pca_directions(
        router.content_norm(torch.cat([s.content for s in samples]).float()), router.config.route_dim
    )
    with torch.no_grad():
        router.page_proj.weight.copy_(w)
    router.config.page_init = "pca"


def pca_directions(x: torch.Tensor, r: int) -> torch.Tensor:
    """(r, hidden): the top principal directions of the rows of x, scaled so projections have O(1) entries
    (random directions fill up when x has fewer than r)."""
    x = x - x.mean(0, keepdim=True)
    _, _, vh = torch.linalg.svd(x, full_matrices=False)
    k = min(r, vh.shape[0])
    w = torch.zeros(r, x.shape[1])
    w[:k] = vh[:k] * math.sqrt(r) / math.sqrt(k)  # orthonormal rows, scaled so embeddings have O(1) entries
    if k < r:
        w[k:] = torch.randn(r - k, x.shape[1]) / math.sqrt(x.shape[1])
    return w


def clip_page_init(router: HybridRouter, samples: list[RouterSample], encoder: Any, name: str) -> None:
    """Fit W_page by least squares so that W_page LN(content_j) matches the open_clip embedding of page j
    (image crop or page words), i.e. the router's page space starts as that CLIP's joint space.
    The router's route_dim must equal the CLIP embedding width."""
    contents, targets = [], []
    for s in samples:
        if s.tiles is None:
            raise ConfigError("open_clip initialisation needs the page tiles: capture with keep_tiles=True")
        imgs = [(j, t) for j, t in enumerate(s.tiles) if not isinstance(t, str)]
        txts = [(j, t) for j, t in enumerate(s.tiles) if isinstance(t, str)]
        emb = torch.zeros(len(s.tiles), encoder.dim)
        if imgs:
            emb[[j for j, _ in imgs]] = encoder.encode_images([t for _, t in imgs])
        if txts:
            emb[[j for j, _ in txts]] = encoder.encode_texts([t for _, t in txts])
        contents.append(s.content)
        targets.append(emb)
    x = router.content_norm(torch.cat(contents).float())
    y = torch.cat(targets)
    if y.shape[1] != router.config.route_dim:
        raise ConfigError(
            f"the CLIP model embeds into {y.shape[1]} dims but the router's route_dim is {router.config.route_dim}"
        )
    w = torch.linalg.lstsq(x, y, driver="gelsd").solution  # (hidden, E)
    with torch.no_grad():
        router.page_proj.weight.copy_(w.T * math.sqrt(y.shape[1]))
    router.config.page_init = f"open_clip:{name}"


# ---------------------------------------------------------------------------------------------------------
# training


def focal_loss(
    logits: torch.Tensor, target: torch.Tensor, candidate: torch.Tensor, gamma: float = 2.0
) -> torch.Tensor:
    """Soft-target focal loss over candidate pages: -sum_j t_j (1 - p_j)^gamma log p_j, with p the softmax
    of the logits over the candidates and t the teacher's page-mass distribution over them.
    logits/target (..., P), candidate (..., P) bool -> mean over rows that have teacher mass."""
    logits = logits.masked_fill(~candidate, float("-inf"))
    logp = torch.log_softmax(logits, -1)
    t = target * candidate
    total = t.sum(-1, keepdim=True)
    rows = total.squeeze(-1) > 0
    t = t / total.clamp_min(1e-12)
    p = logp.exp()
    per = -(t * (1 - p).pow(gamma) * logp.masked_fill(~candidate, 0.0)).sum(-1)
    return per[rows].mean() if bool(rows.any()) else logits.new_zeros(())


@dataclass
class RouterBatch:
    """Routed queries of several samples, padded to the same page count. R rows (one per routed query)."""

    content: torch.Tensor  # (R, P, hidden)
    kind: torch.Tensor  # (R, P) int8
    valid: torch.Tensor  # (R, P) bool
    candidate: torch.Tensor  # (R, P) bool
    last_hidden: torch.Tensor  # (R, hidden)
    mass: torch.Tensor  # (R, L, Hkv, P)


def collate_router(samples: list[RouterSample]) -> RouterBatch:
    p = max(s.content.shape[0] for s in samples)
    rows = []
    for s in samples:
        n, pad = s.last_hidden.shape[0], p - s.content.shape[0]
        rows.append(
            (
                F.pad(s.content, (0, 0, 0, pad)).expand(n, p, -1),
                F.pad(s.kind, (0, pad), value=PAD).expand(n, p),
                F.pad(torch.ones_like(s.candidate), (0, pad)).expand(n, p),
                F.pad(s.candidate, (0, pad)).expand(n, p),
                s.last_hidden,
                F.pad(s.mass, (0, pad)),
            )
        )
    return RouterBatch(*(torch.cat(parts) for parts in zip(*rows)))


def batch_logits(router: HybridRouter, b: RouterBatch, layer: int) -> torch.Tensor:
    """(R, Hkv, P) router logits of every routed query for one layer."""
    hkv = b.mass.shape[2]
    emb = router.embed_pages(b.content, b.kind)  # (R, P, E)
    r, p = b.kind.shape
    return router(
        b.last_hidden,
        emb.unsqueeze(1).expand(r, hkv, p, -1),
        b.kind.unsqueeze(1).expand(r, hkv, p),
        b.valid.unsqueeze(1).expand(r, hkv, p),
        layer,
    )


MIN_CAPTURE_MASS = 1e-4  # a head with less attention than this on the candidate image pages is left out


@torch.no_grad()
def evaluate_capture(
    router: HybridRouter, samples: list[RouterSample], read_budget: float = 0.25
) -> dict[str, float]:
    """Share of the candidate pages' attention mass held by the top ceil(read_budget * candidates) pages
    (per routed query, layer and KV head, averaged): the router's pick, the oracle's (the best possible at
    that budget) and a random pick (its expected share). A (query, layer, head) with (almost) no mass on the
    candidate pages has no share to capture and is left out for all three. The `focused_*` figures average
    over the heads whose oracle pick at this budget holds at least half of the mass (where the choice
    matters; an even spread holds about the budget's share)."""
    sums = dict.fromkeys(
        ("router", "oracle", "random", "focused_router", "focused_oracle", "focused_random"), 0.0
    )
    rows = focused_rows = 0
    for start in range(0, len(samples), 64):
        b = collate_router(samples[start : start + 64])
        n_cand = b.candidate.sum(-1)  # (R,)
        k_row = torch.ceil(n_cand.double() * read_budget - 1e-9).long().clamp(min=1)
        for layer in range(b.mass.shape[1]):
            m = b.mass[:, layer] * b.candidate.unsqueeze(1)  # (R, Hkv, P)
            looks = (n_cand > 0).unsqueeze(1) & (m.sum(-1) > MIN_CAPTURE_MASS)  # (R, Hkv)
            tot = m.sum(-1).clamp_min(1e-12)
            logits = batch_logits(router, b, layer).masked_fill(~b.candidate.unsqueeze(1), float("-inf"))
            rank_r = logits.argsort(-1, descending=True).argsort(-1)
            rank_o = m.argsort(-1, descending=True).argsort(-1)
            k = k_row.view(-1, 1, 1)
            share = {
                "router": (m * (rank_r < k)).sum(-1) / tot,
                "oracle": (m * (rank_o < k)).sum(-1) / tot,
                "random": (k_row.double() / n_cand.clamp(min=1)).unsqueeze(1).expand_as(tot).float(),
            }
            focused = looks & (share["oracle"] >= 0.5)
            for name, v in share.items():
                sums[name] += float(v[looks].sum())
                sums["focused_" + name] += float(v[focused].sum())
            rows += int(looks.sum())
            focused_rows += int(focused.sum())
    out = {n: v / max(focused_rows if n.startswith("focused") else rows, 1) for n, v in sums.items()}
    return out | {"rows": rows, "focused_rows": focused_rows}


@dataclass
class TrainOptions:
    epochs: int = 30
    lr: float = 3e-3
    weight_decay: float = 1e-4
    gamma: float = 2.0
    batch: int = 16
    lora_only: bool = False  # fine-tune only the output layer's LoRA (adapting a trained router)
    seed: int = 0
    read_budget: float = 0.25  # the budget the held-out capture is reported at


def train_router(
    router: HybridRouter,
    train: list[RouterSample],
    val: list[RouterSample] | None = None,
    options: TrainOptions | None = None,
    progress: Any = None,
) -> list[dict[str, float]]:
    """Distil the router on captured samples; returns one dict per epoch (loss, held-out capture)."""
    o = options or TrainOptions()
    if not train:
        raise DataError("no training sample for the router")
    torch.manual_seed(o.seed)
    rng = random.Random(o.seed)
    if o.lora_only:
        for name, p in router.named_parameters():
            p.requires_grad_(name.startswith("out.lora_"))
    params = [p for p in router.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay)
    steps = o.epochs * math.ceil(len(train) / o.batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=o.lr, total_steps=max(steps, 1), pct_start=0.1)
    history = []
    router.train()
    num_layers = train[0].mass.shape[1]
    for epoch in range(o.epochs):
        order = list(range(len(train)))
        rng.shuffle(order)
        total, count = 0.0, 0
        for start in range(0, len(order), o.batch):
            b = collate_router([train[i] for i in order[start : start + o.batch]])
            cand = b.candidate.unsqueeze(1).expand(-1, b.mass.shape[2], -1)
            loss = (
                sum(
                    focal_loss(batch_logits(router, b, layer), b.mass[:, layer], cand, o.gamma)
                    for layer in range(num_layers)
                )
                / num_layers
            )
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            total += loss.item()
            count += 1
        row = {"epoch": epoch + 1, "loss": total / max(count, 1)}
        if val:
            router.eval()
            row.update({f"val_{k}": v for k, v in evaluate_capture(router, val, o.read_budget).items()})
            router.train()
        history.append(row)
        log.info(
            "router epoch %d: %s",
            epoch + 1,
            ", ".join(f"{k}={v:.4f}" for k, v in row.items() if k != "epoch"),
        )
        if progress is not None:
            progress(row)
    router.eval()
    for p in router.parameters():
        p.requires_grad_(True)
    return history


def new_router(model: Any, **sizes: Any) -> HybridRouter:
    """A fresh router shaped for `model` (its config records the model's signature)."""
    text = model.config.text_config
    cfg = RouterConfig(
        hidden_size=int(text.hidden_size),
        num_layers=int(text.num_hidden_layers),
        num_kv_heads=int(text.num_key_value_heads),
        model=model_signature(model),
        **sizes,
    )
    return HybridRouter(cfg)


# ---------------------------------------------------------------------------------------------------------
# open_clip: a user-supplied CLIP checkpoint that embeds image crops and text into one space


OPEN_CLIP_INSTALL = "pip install 'mm-oval[router-train]'"


def import_open_clip():
    """The open_clip module, an optional dependency (the `router-train` extra), or a ConfigError that says
    how to install it."""
    try:
        import open_clip
    except ImportError as e:
        raise ConfigError(
            "initialising router page embeddings from a CLIP checkpoint (--clip-model) needs open_clip, an "
            f"optional dependency: {OPEN_CLIP_INSTALL} (or pip install open_clip_torch); without "
            "--clip-model the router is initialised from the model's own features"
        ) from e
    return open_clip


class OpenClipPageEncoder:
    """Embeds page image crops and page text with an open_clip model. `pretrained=None` builds the
    architecture with random weights (tests); a tag or a local checkpoint path loads real weights, and one
    that cannot be loaded offline raises ModelError."""

    def __init__(self, model_name: str, pretrained: str | None = None, device: str = "cpu"):
        open_clip = import_open_clip()
        if model_name not in open_clip.list_models():
            raise ConfigError(
                f"unknown open_clip model {model_name!r}; known e.g. ViT-B-32, RN50 (open_clip.list_models())"
            )
        try:
            model, _, preprocess = open_clip.create_model_and_transforms(
                model_name, pretrained=pretrained, device=device
            )
        except Exception as e:  # noqa: BLE001 - open_clip raises several types when weights are unreachable
            raise ModelError(
                f"cannot load open_clip weights {pretrained!r} for {model_name}: {e}. Offline, pass a local "
                "checkpoint file with --clip-pretrained /path/to/open_clip_model.bin (or .safetensors)"
            ) from e
        self.model = model.eval()
        self.preprocess = preprocess
        self.tokenizer = open_clip.get_tokenizer(model_name)
        self.device = device
        with torch.no_grad():
            self.dim = int(self.encode_texts(["a"]).shape[-1])

    @torch.no_grad()
    def encode_images(self, images: list) -> torch.Tensor:
        x = torch.stack([self.preprocess(im) for im in images]).to(self.device)
        return F.normalize(self.model.encode_image(x).float(), dim=-1).cpu()

    @torch.no_grad()
    def encode_texts(self, texts: list[str]) -> torch.Tensor:
        tok = self.tokenizer(texts).to(self.device)
        return F.normalize(self.model.encode_text(tok).float(), dim=-1).cpu()


# ---------------------------------------------------------------------------------------------------------
# router v2: the base scorer's scores are captured with the teacher


@dataclass
class Router2Sample:
    """One prompt's data for router v2. P pages (the same for every KV head: nothing is evicted), S routed
    queries, L layers."""

    content: torch.Tensor  # (P, hidden): the mean over the page's tokens of LN(input embedding)
    kind: torch.Tensor  # (P,) int8
    candidate: torch.Tensor  # (P,) bool
    last_hidden: torch.Tensor  # (S, hidden): the final hidden state before each routed query
    mass: torch.Tensor  # (S, L, Hkv, P): full attention's page mass (group mean), the teacher
    base: torch.Tensor  # (S, L, Hkv, P): the base scorer's page scores for the query (floored)
    base_prev: torch.Tensor  # (S, L, Hkv, P): the same from the previous position's query (predict-ahead)


@torch.no_grad()
def capture_router2_data(
    model: Any,
    processor: Any,
    prompts: list[Prompt],
    base: Any,
    *,
    max_new_tokens: int = 4,
    prompt_queries: int = 4,
    image_tile: int = DEFAULT_IMAGE_TILE,
    text_page_size: int = 16,
    sink_tokens: int = 4,
    recent_tokens: int = 16,
    teacher: str = "mass",
) -> list[Router2Sample]:
    """The model answers each prompt greedily; one teacher-forced forward over prompt + answer records every
    layer's queries and keys. Per routed query (the last prompt positions and every answer position), layer
    and KV head: the teacher's weight on each page and the base scorer's score of each page (`base`, a
    RetrievalPolicy: its own summarize / score_pages over the cache's page layout), from this query and from
    the previous position's. `teacher`:
    - "mass": the page's attention mass (exact softmax over the prefix, group mean);
    - "error": what reading the page exactly changes in the step's output when the pages not read enter as
      the base's estimate of their log-mass with their values' plain mean (the first version of
      `unread_pages="scored"`; the one served now weighs the values by the prompt's last queries'
      attention): the norm of the page's exact contribution to the output minus that estimate's, both over
      the exact normaliser, group mean. The base must estimate page masses (OVAL, LOCKS)."""
    if teacher not in TEACHERS:
        raise ConfigError(f"router2 capture: teacher must be one of {TEACHERS}, got {teacher!r}")
    if teacher == "error" and not base.estimates_page_mass:
        raise ConfigError(
            f"router2 capture: teacher 'error' needs a base that estimates page masses (oval, locks), not "
            f"{base.name!r}"
        )
    from ..core import DecodeContext, PageBatch, RequestState
    from ..policies.router2 import BASE_FLOOR
    from ..prompts import tokenizer_of

    lm = language_model(model)
    text = model.config.get_text_config()
    hkv = text.num_key_value_heads
    group = text.num_attention_heads // hkv
    box: dict[str, Any] = {}
    hooks = hidden_and_embeds_hooks(lm, box)
    out: list[Router2Sample] = []
    with hooked(model, hooks):
        for prompt in prompts:
            inputs, info, n_content = _prompt_inputs(model, processor, prompt, sink_tokens, recent_tokens)
            ids = inputs["input_ids"]
            n = ids.shape[1]
            model.set_attn_implementation("sdpa")
            pad = getattr(tokenizer_of(processor), "pad_token_id", None)
            seq = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
            extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
            with capture_qk(lm) as cap:
                model(input_ids=seq, attention_mask=torch.ones_like(seq), **extra)
            keep = (info.modality != PAD).unsqueeze(1).expand(1, hkv, n)
            lay = layout_pages(
                keep, info.modality, info.positions, info.image_rc, info.protected, image_tile, text_page_size
            )
            p = int((lay.page_len[0, 0] > 0).sum())
            page_len, kind = lay.page_len[..., :p], lay.page_kind[..., :p]
            # the pages a read budget applies to, as the cache's read_scope makes them: image pages of an
            # image prompt, every page of a text prompt (pinned sink and recent pages are always read)
            cand = ~lay.page_pinned[..., :p] & (page_len > 0)
            if prompt.context is None:
                cand &= kind == IMAGE
            t = int(page_len.max())
            offs = torch.arange(t, device=ids.device)
            slot = (lay.page_start[..., :p, None] + offs).clamp(max=lay.src.shape[-1] - 1)
            tok_idx = torch.where(
                offs < page_len[..., None], lay.src.gather(-1, slot.flatten(2)).view(1, hkv, p, t), -1
            )
            tok_page = torch.full((n,), -1, dtype=torch.long, device=ids.device)
            ok = lay.src[0, 0] >= 0
            tok_page[lay.src[0, 0][ok]] = lay.slot_page[0, 0][ok]
            embeds = box["embeds"]
            normed = F.layer_norm(embeds[:, :n_content].float(), embeds.shape[-1:])
            content = pool_page_content(normed, tok_idx[:, :1])[0][0, 0]  # (P, hidden)
            img = (info.modality[0] == IMAGE).nonzero()
            total = seq.shape[1]
            rows = list(range(max(n - prompt_queries, int(img.max()) + 2 if img.numel() else 1), total))
            if not rows:
                continue
            mass = torch.zeros(len(rows), len(cap.layers), hkv, p)
            base_now = torch.zeros_like(mass)
            base_prev = torch.zeros_like(mass)
            mask = tok_idx >= 0
            for layer, qk in sorted(cap.layers.items()):
                q, k, v, scale, module = qk.query, qk.key, qk.value, qk.scaling, qk.module
                d = k.shape[-1]
                gather = tok_idx.clamp(min=0).flatten(2).unsqueeze(-1).expand(-1, -1, -1, d)
                gk = k[:, :, :n].gather(2, gather).view(1, hkv, p, t, d) * mask.unsqueeze(-1)
                gv = v[:, :, :n].gather(2, gather).view(1, hkv, p, t, d) * mask.unsqueeze(-1)
                batch = PageBatch(
                    layer, gk, gv, mask, kind, 0, module, token_index=tok_idx,
                    request=RequestState(inputs_embeds=embeds),
                )  # fmt: skip
                summaries = base.summarize(batch)
                kk = k[0].repeat_interleave(group, dim=0).float()  # (Hq, total, D)
                for r, i in enumerate(rows):
                    logits = torch.einsum("hd,htd->ht", q[0, :, i].float(), kk[:, : i + 1]) * scale
                    att = torch.softmax(logits, -1)
                    att = F.pad(att[:, :n], (0, max(0, n - i - 1)))
                    for target, row in ((base_now, i), (base_prev, i - 1)):
                        ctx = DecodeContext(
                            layer, q[:, :, row : row + 1], summaries, lay.page_start[..., :p], page_len, kind,
                            cand, scale, module,
                        )  # fmt: skip
                        target[r, layer] = base.score_pages(ctx)[0].float().clamp(min=BASE_FLOOR).cpu()
                        if row == i and teacher == "error":
                            log_mass = base.page_log_mass(ctx)[0]  # (Hkv, G, P)
                            mass[r, layer] = estimate_error(
                                att, logits.logsumexp(-1), log_mass, tok_idx[0], gv[0]
                            )
                    if teacher == "mass":
                        mass[r, layer] = page_mass(att, tok_page, p, kv_heads=hkv).cpu()
            out.append(
                Router2Sample(
                    content=content.cpu(),
                    kind=kind[0, 0].cpu(),
                    candidate=cand[0, 0].cpu(),
                    last_hidden=box["hidden"][0, [i - 1 for i in rows]].float().cpu(),
                    mass=mass,
                    base=base_now,
                    base_prev=base_prev,
                )
            )
    if not out:
        raise DataError("no routed query was captured: the prompts produced no decode step")
    return out


TEACHERS = ("mass", "error")


def estimate_error(
    att: torch.Tensor, lse: torch.Tensor, log_mass: torch.Tensor, tok_idx: torch.Tensor, values: torch.Tensor
) -> torch.Tensor:
    """The "error" teacher for one query: att (Hq, n) its exact attention over the prompt's tokens, lse (Hq,)
    the log-sum-exp of its logits over the whole prefix, log_mass (Hkv, G, P) the base's estimate of each
    page's log-mass, tok_idx (Hkv, P, T) each page's token positions (-1 past its end), values (Hkv, P, T, D)
    the page's values (zero past its end) -> (Hkv, P): || sum_t a_t v_t - exp(log_mass - lse) mean_t v_t ||
    per query head, averaged over the KV head's G query heads."""
    hkv, P, T = tok_idx.shape
    G = att.shape[0] // hkv
    mask = tok_idx >= 0
    idx = tok_idx.clamp(min=0).reshape(hkv, 1, P * T).expand(hkv, G, P * T)
    a = att.reshape(hkv, G, -1).gather(-1, idx).view(hkv, G, P, T) * mask.unsqueeze(1)
    exact = torch.einsum("hgpt,hptd->hgpd", a, values.float())
    v_mean = values.float().sum(2) / mask.sum(-1, keepdim=True).clamp(min=1)
    share = torch.exp(log_mass.float() - lse.view(hkv, G, 1)).nan_to_num(0.0)
    return (exact - share.unsqueeze(-1) * v_mean.unsqueeze(1)).norm(dim=-1).mean(1).cpu()


def _prompt_inputs(
    model: Any, processor: Any, prompt: Prompt, sink_tokens: int, recent_tokens: int
) -> tuple[dict[str, torch.Tensor], Any, int]:
    """One prompt's model inputs, its tokens' request info (modality, positions, pinned tokens) as the cache
    makes it, and how many leading tokens' input embeddings the page contents pool: every prompt token of an
    image prompt; the context's tokens of a text prompt (the harness prefills the context first, and the
    wrapper keeps the input embeddings of a request's first forward only)."""
    device = next(model.parameters()).device
    if prompt.context is not None:
        from ..eval.textgen import split_prompt
        from ..prompts import tokenizer_of

        asked = SimpleNamespace(context=prompt.context, prompt=prompt.text)
        head, tail = split_prompt(tokenizer_of(processor), asked, device)
        ids = torch.cat([head, tail], dim=1)
        info = request_info(
            ids, None, None, 0, sink_tokens, recent_tokens, geometry=image_geometry(model, ids)
        )
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, info, head.shape[1]
    if prompt.image is None:
        raise DataError(f"router prompt {prompt.text[:40]!r} has neither an image nor a text context")
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt.text}]}]
    chat = processor.apply_chat_template(msgs, add_generation_prompt=True)
    inputs = processor(images=[prompt.image], text=[chat], return_tensors="pt").to(device)
    ids = inputs["input_ids"]
    geo = image_geometry(model, ids, None, **{k: v for k, v in inputs.items() if k in GEOMETRY_INPUTS})
    info = request_info(ids, None, None, 0, sink_tokens, recent_tokens, geometry=geo)
    return dict(inputs), info, ids.shape[1]


_R2_FIELDS = ("content", "kind", "candidate", "last_hidden", "mass", "base", "base_prev")


def save_router2_capture(samples: list[Router2Sample], path: str | Path, options: dict | None = None) -> None:
    """The captured samples as one safetensors file (each field concatenated, with per-sample lengths);
    `options`, what the capture was made with (JSON), in its metadata, so that a run reusing it can check them
    (`capture_options`)."""
    from safetensors.torch import save

    from ..files import atomic_write_bytes

    tensors = {f: torch.cat([getattr(s, f).flatten() for s in samples]).contiguous() for f in _R2_FIELDS}
    tensors["pages"] = torch.tensor([s.content.shape[0] for s in samples])
    tensors["rows"] = torch.tensor([s.last_hidden.shape[0] for s in samples])
    tensors["dims"] = torch.tensor(
        [*samples[0].mass.shape[1:3], samples[0].content.shape[1]]
    )  # L, Hkv, hidden
    meta = {"options": json.dumps(options, sort_keys=True)} if options is not None else None
    atomic_write_bytes(Path(path), save(tensors, metadata=meta))


def capture_options(path: str | Path) -> dict | None:
    """The options a router v2 capture was made with (`save_router2_capture`), None if it records none."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        return json.loads(meta["options"]) if "options" in meta else None
    except (SafetensorError, OSError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: not a router v2 capture ({e}); delete it to capture again") from e


def load_router2_capture(path: str | Path) -> list[Router2Sample]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        t = load_file(str(path))
        pages, rows = t["pages"].tolist(), t["rows"].tolist()
        layers, heads, hidden = t["dims"].tolist()
        shapes = {
            "content": lambda p, r: (p, hidden),
            "kind": lambda p, r: (p,),
            "candidate": lambda p, r: (p,),
            "last_hidden": lambda p, r: (r, hidden),
            **{f: (lambda p, r: (r, layers, heads, p)) for f in ("mass", "base", "base_prev")},
        }
        offsets = dict.fromkeys(_R2_FIELDS, 0)
        out = []
        for p, r in zip(pages, rows):
            parts = {}
            for f in _R2_FIELDS:
                shape = shapes[f](p, r)
                size = math.prod(shape)
                parts[f] = t[f][offsets[f] : offsets[f] + size].view(shape)
                offsets[f] += size
            out.append(Router2Sample(**parts))
    except (SafetensorError, OSError, KeyError, RuntimeError) as e:
        raise DataError(f"{path}: not a router v2 capture ({e}); delete it to capture again") from e
    return out


@dataclass
class Router2Batch:
    content: torch.Tensor  # (R, P, hidden)
    kind: torch.Tensor  # (R, P)
    valid: torch.Tensor  # (R, P)
    candidate: torch.Tensor  # (R, P)
    last_hidden: torch.Tensor  # (R, hidden)
    mass: torch.Tensor  # (R, L, Hkv, P)
    base: torch.Tensor  # (R, L, Hkv, P)
    base_prev: torch.Tensor  # (R, L, Hkv, P)
    history: torch.Tensor  # (R, L, Hkv, W, P) bool: the base scorer's picks at the sample's previous rows


def collate_router2(
    samples: list[Router2Sample], window: int = 0, history_budget: float = 0.25
) -> Router2Batch:
    from ..policies.router2 import BASE_FLOOR

    p = max(s.content.shape[0] for s in samples)
    parts = []
    for s in samples:
        n, pad = s.last_hidden.shape[0], p - s.content.shape[0]
        base = F.pad(s.base, (0, pad), value=BASE_FLOOR)
        cand = F.pad(s.candidate, (0, pad))
        hist = torch.zeros(n, *s.base.shape[1:3], window, p, dtype=torch.bool)
        if window:
            k = max(1, math.ceil(int(cand.sum()) * history_budget - 1e-9))
            picks = base.masked_fill(~cand, float("-inf")).topk(k, -1).indices  # (S, L, H, k)
            read = torch.zeros_like(base, dtype=torch.bool).scatter_(-1, picks, True) & cand
            for r in range(n):
                prev = read[max(0, r - window) : r].permute(1, 2, 0, 3)  # (L, H, w, P)
                hist[r, :, :, window - prev.shape[2] :] = prev
        parts.append(
            (
                F.pad(s.content, (0, 0, 0, pad)).expand(n, p, -1),
                F.pad(s.kind, (0, pad), value=PAD).expand(n, p),
                F.pad(torch.ones_like(s.candidate), (0, pad)).expand(n, p),
                cand.expand(n, p),
                s.last_hidden,
                F.pad(s.mass, (0, pad)),
                base,
                F.pad(s.base_prev, (0, pad), value=BASE_FLOOR),
                hist,
            )
        )
    return Router2Batch(*(torch.cat(x) for x in zip(*parts)))


def router2_logits(net: Any, b: Router2Batch, layer: int, base: torch.Tensor | None = None) -> torch.Tensor:
    """(R, Hkv, P) = base + correction for one layer (`base`: other base scores, e.g. the previous query's)."""
    hkv = b.mass.shape[2]
    r, p = b.kind.shape
    emb = net.page_embeddings(b.content, b.kind).unsqueeze(1).expand(r, hkv, p, -1)
    base = b.base[:, layer] if base is None else base
    corr = net.correction(
        net.text_state(b.last_hidden),
        emb,
        b.kind.unsqueeze(1).expand(r, hkv, p),
        b.valid.unsqueeze(1).expand(r, hkv, p),
        base,
        layer,
        b.history[:, layer] if net.config.gcn else None,
    )
    return base + corr


def gumbel_topk_loss(
    logits: torch.Tensor, target: torch.Tensor, candidate: torch.Tensor, k: torch.Tensor, tau: float = 0.5
) -> torch.Tensor:
    """1 - the teacher mass held by a relaxed top-k of Gumbel-perturbed logits (k successive softmaxes, each
    discounting what the earlier ones took), averaged over rows with teacher mass. k (...) long."""
    t = target * candidate
    total = t.sum(-1, keepdim=True)
    rows = total.squeeze(-1) > 0
    t = t / total.clamp_min(1e-12)
    g = -torch.log(-torch.log(torch.rand_like(logits).clamp(1e-9, 1 - 1e-9)))
    s = (logits + g).masked_fill(~candidate, float("-inf"))
    khot = torch.zeros_like(s)
    onehot = torch.zeros_like(s)
    for i in range(int(k.max())):
        s = s + torch.log((1 - onehot).clamp_min(1e-20))
        onehot = torch.softmax(s / tau, -1)
        khot = khot + onehot * (i < k).unsqueeze(-1)
    per = 1 - (khot.clamp(max=1) * t).sum(-1)
    return per[rows].mean() if bool(rows.any()) else logits.new_zeros(())


@dataclass
class Train2Options:
    epochs: int = 6
    lr: float = 3e-3
    weight_decay: float = 1e-4
    gamma: float = 2.0
    batch: int = 8
    objective: str = "focal"  # or "gumbel": the relaxed top-k of Gumbel-perturbed logits
    gumbel_budget: float = 0.25
    seed: int = 0
    read_budgets: tuple[float, ...] = (0.10, 0.25)  # held-out capture is reported at these
    # keep the weights with the best held-out capture (mean over read_budgets), the starting ones included:
    # a router v2 trained from zero then never selects worse than its base scorer on the held-out prompts
    keep_best: bool = True


def train_router2(
    net: Any,
    train: list[Router2Sample],
    val: list[Router2Sample] | None = None,
    options: Train2Options | None = None,
    progress: Any = None,
    start_epoch: int = 0,
    checkpoint: Any = None,
) -> list[dict[str, float]]:
    """Distil full attention's page mass into base + correction; one dict per epoch (loss, held-out capture).
    `checkpoint(epoch, history)` is called after each epoch (to save and resume from `start_epoch`)."""
    o = options or Train2Options()
    if o.objective not in ("focal", "gumbel"):
        raise ConfigError(f"router2 training: objective must be 'focal' or 'gumbel', got {o.objective!r}")
    if not train:
        raise DataError("no training sample for the router")
    torch.manual_seed(o.seed + start_epoch)
    rng = random.Random(o.seed + start_epoch)
    window = net.config.gcn_window if net.config.gcn else 0
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay)
    steps = (o.epochs - start_epoch) * math.ceil(len(train) / o.batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=o.lr, total_steps=max(steps, 1), pct_start=0.1)
    history: list[dict[str, float]] = []
    num_layers = train[0].mass.shape[1]
    best: tuple[float, dict[str, torch.Tensor]] | None = None
    if val and o.keep_best:  # the weights to beat: these (the base scorer alone for a fresh router)
        best = (_held_out_score(net, val, o.read_budgets), copy.deepcopy(net.state_dict()))
    for epoch in range(start_epoch, o.epochs):
        net.train()
        order = list(range(len(train)))
        rng.shuffle(order)
        total, count = 0.0, 0
        for start in range(0, len(order), o.batch):
            b = collate_router2([train[i] for i in order[start : start + o.batch]], window)
            cand = b.candidate.unsqueeze(1).expand(-1, b.mass.shape[2], -1)
            k = torch.ceil(cand.sum(-1).double() * o.gumbel_budget - 1e-9).long().clamp(min=1)
            loss = 0.0
            for layer in range(num_layers):
                logits = router2_logits(net, b, layer)
                if o.objective == "focal":
                    loss = loss + focal_loss(logits, b.mass[:, layer], cand, o.gamma)
                else:
                    loss = loss + gumbel_topk_loss(logits, b.mass[:, layer], cand, k)
            loss = loss / num_layers
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            total += float(loss.detach())
            count += 1
        row: dict[str, float] = {"epoch": epoch + 1, "loss": total / max(count, 1)}
        if val:
            for rb in o.read_budgets:
                row |= {f"val{int(rb * 100)}_{k}": v for k, v in evaluate_router2(net, val, rb).items()}
        net.eval()
        if best is not None:
            score = sum(row[f"val{int(rb * 100)}_router2"] for rb in o.read_budgets) / len(o.read_budgets)
            if score > best[0]:
                best = (score, copy.deepcopy(net.state_dict()))
            row["kept"] = float(score >= best[0])
        history.append(row)
        log.info("router2 epoch %d: %s", epoch + 1, ", ".join(f"{k}={v:.4f}" for k, v in row.items()))
        if progress is not None:
            progress(row)
        if checkpoint is not None:
            checkpoint(epoch + 1, history)
    if best is not None:  # the held-out best, which is never below the weights training started from
        net.load_state_dict(best[1])
        if checkpoint is not None:
            checkpoint(o.epochs, history)
    net.eval()
    return history


def _held_out_score(net: Any, val: list[Router2Sample], budgets: tuple[float, ...]) -> float:
    return sum(evaluate_router2(net, val, rb)["router2"] for rb in budgets) / len(budgets)


@torch.no_grad()
def evaluate_router2(
    net: Any, samples: list[Router2Sample], read_budget: float = 0.25, read_pages: int | None = None
) -> dict[str, float]:
    """Share of the candidate pages' attention mass held by the top ceil(read_budget * candidates) pages
    (`read_pages`: that many pages instead, at most the candidates), per
    routed query, layer and KV head (those with mass on the candidates), averaged: `base` (the base scorer
    alone), `router2` (base + correction), `oracle`; `*_ahead`: the same from the previous position's query
    (predict-ahead), and `hit_*`: the share of the exact pick the predict-ahead pick holds."""
    net.eval()
    window = net.config.gcn_window if net.config.gcn else 0
    keys = ("base", "router2", "oracle", "base_ahead", "router2_ahead", "hit_base", "hit_router2")
    sums = dict.fromkeys(keys, 0.0)
    rows = 0
    for start in range(0, len(samples), 32):
        b = collate_router2(samples[start : start + 32], window)
        n_cand = b.candidate.sum(-1)
        if read_pages is None:
            k = torch.ceil(n_cand.double() * read_budget - 1e-9).long().clamp(min=1).view(-1, 1, 1)
        else:
            k = n_cand.clamp(max=int(read_pages)).clamp(min=1).view(-1, 1, 1)
        cand = b.candidate.unsqueeze(1)
        for layer in range(b.mass.shape[1]):
            m = b.mass[:, layer] * cand
            tot = m.sum(-1)
            looks = (n_cand > 0).unsqueeze(1) & (tot > MIN_CAPTURE_MASS)

            def pick(scores: torch.Tensor, cand: torch.Tensor = cand, k: torch.Tensor = k) -> torch.Tensor:
                rank = scores.masked_fill(~cand, float("-inf")).argsort(dim=-1, descending=True, stable=True)
                return rank.argsort(-1) < k

            picks = {
                "base": pick(b.base[:, layer]),
                "router2": pick(router2_logits(net, b, layer)),
                "oracle": pick(m),
                "base_ahead": pick(b.base_prev[:, layer]),
                "router2_ahead": pick(router2_logits(net, b, layer, b.base_prev[:, layer])),
            }
            for name, sel in picks.items():
                sums[name] += float(((m * sel).sum(-1) / tot.clamp_min(1e-12))[looks].sum())
            for name in ("base", "router2"):
                hit = (picks[name] & picks[name + "_ahead"]).sum(-1) / picks[name].sum(-1).clamp(min=1)
                sums["hit_" + name] += float(hit[looks].sum())
            rows += int(looks.sum())
    return {name: v / max(rows, 1) for name, v in sums.items()} | {"rows": rows}


def fit_min_read_pages(
    net: Any, val: list[Router2Sample], max_share: float = 0.5
) -> tuple[int, list[dict[str, float]]]:
    """The fewest pages a step must read for the correction to be used (`Router2Config.min_read_pages`):
    the smallest k such that, on the held-out samples, base + correction holds at least the base's share of
    the attention mass at every read of k .. ceil(max_share * candidates) pages. A router that only helps
    when it reads several pages thus falls back to its base below that, rather than choosing worse (the
    read counts where it is behind are in the returned rows: pages, base, router2)."""
    n_cand = max(int(s.candidate.sum()) for s in val)
    top = max(1, math.ceil(n_cand * max_share - 1e-9))
    rows = []
    for k in range(1, top + 1):
        r = evaluate_router2(net, val, read_pages=k)
        rows.append({"pages": k, "base": r["base"], "router2": r["router2"]})
    floor = top + 1
    for row in reversed(rows):  # the longest run of reads, up from the top, where the router is not behind
        if row["router2"] < row["base"]:
            break
        floor = row["pages"]
    return floor, rows


def new_router2(model: Any, base: str = "quest", **sizes: Any) -> Any:
    """A fresh (zero-correction) router v2 shaped for `model`, its config naming the model."""
    from ..policies.router2 import Router2Config, Router2Net

    text = model.config.get_text_config()
    cfg = Router2Config(
        hidden_size=int(text.hidden_size),
        num_layers=int(text.num_hidden_layers),
        num_kv_heads=int(text.num_key_value_heads),
        base=base,
        model=model_signature(model),
        **sizes,
    )
    return Router2Net(cfg)


def pca_page_init2(net: Any, samples: list[Router2Sample]) -> None:
    """W_page of a router v2 from the principal directions of its page contents (as `pca_page_init`)."""
    w = pca_directions(torch.cat([s.content for s in samples]).float(), net.config.route_dim)
    with torch.no_grad():
        net.page_proj.weight.copy_(w)
    net.config.page_init = "pca"
