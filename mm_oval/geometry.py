"""Where each image's tokens are in a request, how many there are, and their (row, column) on the image's
own grid: read from the inputs and the model's configuration, never assumed. This is the one definition of
tokens-per-image and (row, col) in mm-oval; the wrapper and the cache call `image_geometry`.

How each supported class lays an image out in the prompt (the model's own feature code, mirrored on
shapes only; nothing runs the vision tower):

- LLaVA-1.5 (`llava`): one grid per image, (image_size / patch_size)^2 tokens; "full" feature selection
  with a CLS token adds one token, and the grid is then one row.
- LLaVA-NeXT (`llava_next`): anyres. The base view (one image_size tile of the whole image) is a grid of
  side image_size / patch_size; then the high-resolution view: the tiles chosen from
  `image_grid_pinpoints` for `image_sizes` stitched into one grid, with the padding the resize added cut
  off (the model's `unpad_image`), each row followed by an image-newline token. An image of one tile only
  is its base grid plus one newline.
- LLaVA-OneVision (`llava_onevision`): as LLaVA-NeXT (SigLIP has no CLS token: "full" selection keeps every
  patch), the high-resolution grid downsampled when it exceeds `vision_aspect_ratio` ("anyres_max_9"), and
  with several images in one sample (`batch_num_images`) each image is its base grid plus a newline. A
  video: each frame a grid pooled to half the side (rounded up), one newline after the last frame.
- Qwen2-VL / Qwen2.5-VL (`qwen2_vl`, `qwen2_5_vl`): each image (or video) of `image_grid_thw`
  (`video_grid_thw`) (t, h, w) patches makes t grids of (h / m) x (w / m) tokens (m: spatial_merge_size).
  Positions are M-RoPE: three ids per token (time, row, column), from the model's `get_rope_index`.

A grid is one 2-D view: an image's base view, its high-resolution view, one video frame. `image_rc`
numbers the grids of each sample in prompt order (field 0), with the token's row and column on that grid;
`grid_image` says which image (or video) of the sample each grid belongs to. Image-newline tokens are text
(modality TEXT, rc -1): they carry no patch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .core import Rope
from .errors import ConfigError, DataError, ModelError

# model_type -> how its images are laid out; TEXT: a plain decoder-only language model (no images)
FIXED, ANYRES, ANYRES_MAX, THW, TEXT_ONLY = "fixed", "anyres", "anyres_max", "thw", "text"
FAMILIES = {
    "llava": FIXED,
    "llava_next": ANYRES,
    "llava_onevision": ANYRES_MAX,
    "qwen2_vl": THW,
    "qwen2_5_vl": THW,
}
# the decoder-only language models LLaVA-style models are built on, wrapped on their own (text pages only)
TEXT_FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_CLASSES = {
    "llava": "LlavaForConditionalGeneration",
    "llava_next": "LlavaNextForConditionalGeneration",
    "llava_onevision": "LlavaOnevisionForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}


# the processor outputs (besides input_ids and attention_mask) the geometry reads, and the position ids
GEOMETRY_INPUTS = (
    "pixel_values",
    "image_sizes",
    "batch_num_images",
    "pixel_values_videos",
    "image_grid_thw",
    "video_grid_thw",
    "mm_token_type_ids",
    "second_per_grid_ts",
    "position_ids",
)


@dataclass(frozen=True)
class Part:
    """One run of an image's tokens: a `rows` x `cols` grid, each row followed by a newline token when
    `row_newline`, then `tail_newlines` newline tokens. kind: base, highres, frame, image."""

    kind: str
    rows: int
    cols: int
    row_newline: bool = False
    tail_newlines: int = 0

    @property
    def n_tokens(self) -> int:
        return self.rows * (self.cols + int(self.row_newline)) + self.tail_newlines


@dataclass(frozen=True)
class Grid:
    """One grid of one sample: which image (or video) it belongs to, its shape and kind, and the prompt
    index of its first token."""

    image: int
    kind: str
    rows: int
    cols: int
    start: int
    video: bool = False


@dataclass
class Geometry:
    """The image tokens of one request (B samples, N tokens)."""

    is_image: torch.Tensor  # (B, N) bool: image (or video) feature tokens (newlines excluded)
    is_newline: torch.Tensor  # (B, N) bool: image-newline tokens (placeholders that carry no patch)
    image_rc: torch.Tensor  # (B, N, 3) long: (grid, row, col) of image tokens, -1 elsewhere
    grids: list[list[Grid]] = field(default_factory=list)  # per sample, in prompt order
    rope_positions: torch.Tensor | None = None  # (3, B, N) M-RoPE ids (Qwen2-VL family); None: 1-D RoPE
    rope_deltas: torch.Tensor | None = None  # (B,) decode position = text position + delta (M-RoPE)

    image_tokens: list[list[int]] = field(default_factory=list)  # per sample: each image's tokens
    # (newlines included), images then videos, each in prompt order


# ---- the model --------------------------------------------------------------------------------------------
def is_text_only(model: Any) -> bool:
    """A plain decoder-only language model of a family mm-oval wraps (`TEXT_FAMILIES`): no vision tower,
    no image tokens, its decoder at `model.model.layers`."""
    cfg = getattr(model, "config", None)
    return (
        getattr(cfg, "model_type", None) in TEXT_FAMILIES
        and getattr(cfg, "vision_config", None) is None
        and hasattr(getattr(model, "model", None), "layers")
    )


def language_model(model: Any) -> Any:
    """The decoder (with `.layers` and `.rotary_emb`) of a LLaVA-style model (`model.model.language_model`)
    or of a plain decoder-only LM (`model.model`); a ModelError saying what mm-oval wraps otherwise."""
    if is_text_only(model):
        return model.model
    inner = getattr(model, "model", None)
    lm = getattr(inner, "language_model", None)
    if lm is None or not hasattr(lm, "layers") or getattr(model.config, "image_token_id", None) is None:
        raise ModelError(
            f"{type(model).__name__} is not a LLaVA-style model nor a plain decoder-only language model "
            "mm-oval wraps: mm_oval.wrap needs a LlavaForConditionalGeneration, "
            "LlavaNextForConditionalGeneration, LlavaOnevisionForConditionalGeneration or "
            "Qwen2_5_VLForConditionalGeneration (model.model.language_model.layers and config.image_token_id), "
            f"e.g. llava-hf/llava-1.5-7b-hf or mm_oval.zoo's tiny model, or one of {', '.join(TEXT_FAMILIES.values())}"
        )
    return lm


def family_of(model: Any) -> str:
    """The layout family of `model` (FIXED, ANYRES, ANYRES_MAX, THW, or TEXT_ONLY for a plain decoder-only
    LM); a ModelError naming what is missing for a model mm-oval does not support."""
    if is_text_only(model):
        return TEXT_ONLY
    cfg = model.config
    mt = getattr(cfg, "model_type", None)
    fam = FAMILIES.get(mt)
    supported = ", ".join(f"{c} ({t})" for t, c in SUPPORTED_CLASSES.items())
    if fam is None:
        raise ModelError(
            f"{type(model).__name__} (model_type {mt!r}) is not a model family mm-oval knows the image layout of: "
            f"it reads how many tokens each image takes, and their rows and columns, for {supported}; "
            f"plain language models: {', '.join(TEXT_FAMILIES.values())}"
        )
    if getattr(cfg, "image_token_id", None) is None:
        raise ModelError(
            f"{type(model).__name__}'s config has no image_token_id: mm-oval cannot find the image tokens"
        )
    vc = getattr(cfg, "vision_config", None)
    need = ["spatial_merge_size"] if fam == THW else ["image_size", "patch_size"]
    missing = [k for k in need if not getattr(vc, k, None)]
    if fam in (ANYRES, ANYRES_MAX) and not getattr(cfg, "image_grid_pinpoints", None):
        missing.append("image_grid_pinpoints (config)")
    if missing:
        raise ModelError(
            f"cannot tell how many tokens one image takes for {type(model).__name__}: its vision_config lacks "
            f"{', '.join(missing)}"
        )
    return fam


def _view_tokens(model: Any) -> int:
    """Feature tokens of one image_size view: the tower's patches (+ CLS where it has one), minus the CLS
    when the feature selection is "default" (the model drops the first token)."""
    cfg = model.config
    vc = cfg.vision_config
    side = vc.image_size // vc.patch_size
    n = side * side
    tower = getattr(getattr(model, "model", None), "vision_tower", None)
    emb = getattr(tower, "embeddings", None) if tower is not None else None
    if emb is not None and hasattr(emb, "num_positions"):
        n = int(emb.num_positions)  # CLIP: patches + CLS; SigLIP: patches
    elif emb is not None and hasattr(emb, "class_embedding"):
        n += 1
    if getattr(cfg, "vision_feature_select_strategy", "default") == "default":
        n -= 1
    return n


def _base_part(model: Any) -> Part:
    vc = model.config.vision_config
    side = vc.image_size // vc.patch_size
    n = _view_tokens(model)
    return Part("base", side, side) if n == side * side else Part("base", 1, n)


def tokens_per_view(model: Any) -> int:
    """Feature tokens of one image_size view (a LLaVA-1.5 image): the fixed count where a family has one,
    e.g. for `Chat`'s grid; 0 for Qwen2-VL (every image its own size) and for a plain LM (no images)."""
    if family_of(model) in (THW, TEXT_ONLY):
        return 0
    return _view_tokens(model)


def _anyres_parts(model: Any, image_size: Any, patching: bool, max_style: bool) -> list[Part]:
    """The parts of one LLaVA-NeXT / OneVision image of `image_size` (height, width)."""
    if max_style:
        from transformers.models.llava_onevision.modeling_llava_onevision import (
            get_anyres_image_grid_shape,
            image_size_to_num_patches,
            unpad_image,
        )
    else:
        from transformers.models.llava_next.modeling_llava_next import (
            get_anyres_image_grid_shape,
            image_size_to_num_patches,
            unpad_image,
        )
    cfg = model.config
    vc = cfg.vision_config
    base = _base_part(model)
    size = [int(x) for x in image_size]
    n_views = image_size_to_num_patches(size, cfg.image_grid_pinpoints, vc.image_size) if patching else 1
    if n_views <= 1:
        return [base, Part("newline", 0, 0, tail_newlines=1)]
    side = vc.image_size // vc.patch_size
    nph, npw = get_anyres_image_grid_shape(size, cfg.image_grid_pinpoints, vc.image_size)
    h, w = unpad_image(torch.empty(1, nph * side, npw * side), size).shape[1:]
    if max_style:
        max_views = int(str(getattr(cfg, "vision_aspect_ratio", "anyres_max_9")).removeprefix("anyres_max_"))
        ratio = math.sqrt(h * w / (max_views * side**2))
        if ratio > 1.1:
            h, w = int(h // ratio), int(w // ratio)
    return [base, Part("highres", int(h), int(w), row_newline=True)]


def _image_parts(model: Any, fam: str, inputs: dict) -> tuple[list[list[Part]], list[list[Part]]]:
    """(per image, per video) the parts each makes, in the order the model scatters their features."""
    cfg = model.config
    images: list[list[Part]] = []
    videos: list[list[Part]] = []
    pv = inputs.get("pixel_values")
    if fam == FIXED:
        if pv is not None:
            n = int(pv.shape[0]) if pv.dim() == 4 else int(pv.shape[:2].numel())
            images = [[_base_part(model)] for _ in range(n)]
        return images, videos
    if fam in (ANYRES, ANYRES_MAX):
        if pv is not None:
            sizes = inputs.get("image_sizes")
            if sizes is None:
                raise DataError(
                    f"{type(model).__name__} needs image_sizes with pixel_values (the processor returns both): "
                    "pass every tensor the processor returned"
                )
            sizes = torch.as_tensor(sizes).view(-1, 2).tolist()
            patching = [True] * len(sizes)
            bni = inputs.get("batch_num_images")
            if fam == ANYRES_MAX and bni is not None:
                patching = [
                    int(n) == 1 for n in torch.as_tensor(bni).view(-1).tolist() for _ in range(int(n))
                ]
                if len(patching) != len(sizes):
                    raise DataError(
                        f"batch_num_images sums to {len(patching)} images but image_sizes holds {len(sizes)}: "
                        "pass the processor's outputs unchanged"
                    )
            images = [_anyres_parts(model, s, p, fam == ANYRES_MAX) for s, p in zip(sizes, patching)]
        pvv = inputs.get("pixel_values_videos")
        if fam == ANYRES_MAX and pvv is not None:
            side = cfg.vision_config.image_size // cfg.vision_config.patch_size
            pooled = math.ceil(side / 2)
            n_videos, frames = int(pvv.shape[0]), int(pvv.shape[1])
            one = [Part("frame", pooled, pooled) for _ in range(frames)] + [
                Part("newline", 0, 0, tail_newlines=1)
            ]
            videos = [list(one) for _ in range(n_videos)]
        return images, videos
    m = int(cfg.vision_config.spatial_merge_size)
    for key, out, kind in (("image_grid_thw", images, "image"), ("video_grid_thw", videos, "frame")):
        thw = inputs.get(key)
        if thw is None:
            continue
        for t, h, w in torch.as_tensor(thw).view(-1, 3).tolist():
            out.append([Part(kind, h // m, w // m) for _ in range(t)])
    if pv is not None and inputs.get("image_grid_thw") is None:
        raise DataError(
            f"{type(model).__name__} needs image_grid_thw with pixel_values (the processor returns both): pass "
            "every tensor the processor returned"
        )
    return images, videos


def _part_tokens(p: Part) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, cols, is_newline) of the part's tokens in order."""
    width = p.cols + int(p.row_newline)
    r = torch.arange(p.rows).repeat_interleave(width)
    c = torch.arange(width).repeat(p.rows)
    nl = c == p.cols
    if p.tail_newlines:
        r = torch.cat([r, torch.full((p.tail_newlines,), -1)])
        c = torch.cat([c, torch.full((p.tail_newlines,), -1)])
        nl = torch.cat([nl, torch.ones(p.tail_newlines, dtype=torch.bool)])
    return r, c, nl


def image_geometry(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **inputs: Any
) -> Geometry:
    """The image geometry of one request: `inputs` are the other tensors the processor returned
    (pixel_values, image_sizes, batch_num_images, pixel_values_videos, image_grid_thw, video_grid_thw,
    mm_token_type_ids, second_per_grid_ts) and, when the caller has them, the position_ids the model will
    use. Placeholders given without pixel values are image tokens on grids of one row (one per run of
    consecutive placeholders; LLaVA-1.5's still come per image when their count allows). A count that
    does not match what the model makes of the inputs is a DataError."""
    fam = family_of(model)
    cfg = model.config
    B, N = input_ids.shape
    device = input_ids.device
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ConfigError(
            "mm-oval reads padding from a 2-D attention_mask (batch, tokens); a prepared 4-D mask is not supported"
        )
    if fam == TEXT_ONLY:  # a plain LM: every token is text
        return _text_only_geometry(model, B, N, device, inputs)
    valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    is_image = torch.zeros(B, N, dtype=torch.bool, device=device)
    is_newline = torch.zeros(B, N, dtype=torch.bool, device=device)
    rc = torch.full((B, N, 3), -1, dtype=torch.long, device=device)
    images, videos = _image_parts(model, fam, inputs)
    if fam == FIXED and not images:  # no pixel values: LLaVA-1.5's placeholders still come per image
        per, n_tok = _view_tokens(model), int(((input_ids == cfg.image_token_id) & valid).sum())
        if n_tok and per > 0 and n_tok % per == 0:
            images = [[_base_part(model)] for _ in range(n_tok // per)]
    streams = [(cfg.image_token_id, images, False, "pixel_values")]
    vid = getattr(cfg, "video_token_id", None)
    if vid is not None:
        streams.append((vid, videos, True, "pixel_values_videos"))
    records, counts, grids_extra = _match_parts(model, input_ids, valid, streams, is_image, rc)
    grids = _place_grids(records, grids_extra, counts, is_image, is_newline, rc)
    geo = Geometry(is_image, is_newline, rc, grids, image_tokens=counts)
    if fam == THW:
        geo.rope_positions, geo.rope_deltas = _mrope(model, input_ids, valid, inputs)
    return geo


def _text_only_geometry(model: Any, B: int, N: int, device: torch.device, inputs: dict) -> Geometry:
    """A plain LM's request: every token is text; pixel inputs are refused."""
    if any(inputs.get(k) is not None for k in GEOMETRY_INPUTS if k != "position_ids"):
        raise ConfigError(
            f"{type(model).__name__} is a language model without a vision tower: pass input_ids only, "
            "no pixel values"
        )
    none = torch.zeros(B, N, dtype=torch.bool, device=device)
    return Geometry(
        none,
        none.clone(),
        torch.full((B, N, 3), -1, dtype=torch.long, device=device),
        [[] for _ in range(B)],
        image_tokens=[[] for _ in range(B)],
    )


def _match_parts(model: Any, input_ids: torch.Tensor, valid: torch.Tensor, streams: list, is_image: torch.Tensor,
                 rc: torch.Tensor) -> tuple[list, list[list[int]], list[tuple[int, int, int, bool]]]:  # fmt: skip
    """The placeholders of each stream (image, video) matched to the parts its pixel inputs make, in the
    model's scatter order: one record per part (sample, first index, video?, image number in the request,
    part, its (M, 2) indices), the image token counts per sample, and the (sample, start, length, video) of
    pixel-less runs (marked as one-row grids in `is_image`/`rc` by `_runs_as_rows`)."""
    B = input_ids.shape[0]
    records: list[tuple[int, int, bool, int, Part, torch.Tensor]] = []
    counts: list[list[int]] = [[] for _ in range(B)]
    grids_extra: list[tuple[int, int, int, bool]] = []
    for token_id, per_image, is_video, what in streams:
        where = ((input_ids == token_id) & valid).nonzero()  # (M, 2), row-major: the model's scatter order
        if not per_image:  # placeholders without pixels (the model embeds them as they are)
            _runs_as_rows(where, is_image, rc, grids_extra, is_video)
            continue
        expected = sum(p.n_tokens for parts in per_image for p in parts)
        if where.shape[0] != expected:
            name = "video" if is_video else "image"
            raise DataError(
                f"the prompt holds {where.shape[0]} {name} tokens but {len(per_image)} {name}(s) were given, "
                f"which make {expected} for {type(model).__name__} ({_describe(per_image)}): build the prompt and "
                f"{what} with the model's processor in one call, one placeholder per {name}"
            )
        k = 0
        for i, parts in enumerate(per_image):
            n_img = sum(p.n_tokens for p in parts)
            span = where[k : k + n_img]
            if n_img:
                counts[int(span[0, 0])].append(n_img)
            if n_img and bool((span[:, 0] != span[0, 0]).any()):
                raise DataError(
                    f"{'video' if is_video else 'image'} {i} of the request spans two samples of the batch: each "
                    "sample's prompt must hold exactly the placeholders of its own images"
                )
            for p in parts:
                idx = where[k : k + p.n_tokens]
                if p.n_tokens:
                    records.append((int(idx[0, 0]), int(idx[0, 1]), is_video, i, p, idx))
                k += p.n_tokens
    return records, counts, grids_extra


def _place_grids(records: list, grids_extra: list, counts: list[list[int]], is_image: torch.Tensor,
                 is_newline: torch.Tensor, rc: torch.Tensor) -> list[list[Grid]]:  # fmt: skip
    """Each part's grid placed on the prompt (`is_image`, `is_newline`, `rc` = (grid, row, col)): grids
    numbered per sample in prompt order, images (and videos) numbered per sample too; pixel-less runs
    become one-row placeholder grids after them."""
    device = rc.device
    grids: list[list[Grid]] = [[] for _ in range(len(counts))]
    image_no: dict[tuple[int, bool, int], int] = {}
    for b, start, is_video, i, p, idx in sorted(records, key=lambda r: (r[0], r[1])):
        local = image_no.setdefault(
            (b, is_video, i), sum(1 for key in image_no if key[0] == b and key[1] == is_video)
        )
        r, c, nl = (t.to(device) for t in _part_tokens(p))
        rows, cols = idx[:, 0], idx[:, 1]
        is_newline[rows[nl], cols[nl]] = True
        if p.rows and p.cols:
            g = len(grids[b])
            grids[b].append(Grid(local, p.kind, p.rows, p.cols, start, is_video))
            cell = ~nl
            is_image[rows[cell], cols[cell]] = True
            rc[rows[cell], cols[cell]] = torch.stack([torch.full_like(r[cell], g), r[cell], c[cell]], dim=-1)
    for b, start, length, is_video in sorted(grids_extra):
        g = len(grids[b])
        grids[b].append(Grid(g, "placeholder", 1, length, start, is_video))
        rc[b, start : start + length, 0] = g
        counts[b].append(length)
    return grids


def _runs_as_rows(
    where: torch.Tensor, is_image: torch.Tensor, rc: torch.Tensor, out: list, is_video: bool
) -> None:
    """Image placeholders with no pixel values: each run of consecutive ones is a grid of one row (the
    grid index is set once all grids are numbered)."""
    if not where.shape[0]:
        return
    b, j = where[:, 0], where[:, 1]
    is_image[b, j] = True
    new_run = torch.ones_like(b, dtype=torch.bool)
    new_run[1:] = (b[1:] != b[:-1]) | (j[1:] != j[:-1] + 1)
    starts = new_run.nonzero().flatten().tolist() + [int(b.shape[0])]
    for s0, s1 in zip(starts[:-1], starts[1:]):
        bb, jj = int(b[s0]), int(j[s0])
        rc[bb, jj : jj + s1 - s0, 1] = 0
        rc[bb, jj : jj + s1 - s0, 2] = torch.arange(s1 - s0, device=rc.device)
        out.append((bb, jj, s1 - s0, is_video))


def grid_shape(tokens: int) -> tuple[int, int]:
    """(rows, cols) of an image of `tokens` patches when only the count is known: square when it is a
    square (LLaVA-1.5: 24 x 24), else one row."""
    side = math.isqrt(max(int(tokens), 1))
    return (side, side) if side * side == tokens else (1, max(int(tokens), 1))


def fixed_grid_rc(is_img: torch.Tensor, tokens_per_image: int) -> torch.Tensor:
    """(B, N, 3) (image, row, col) of image tokens that come `tokens_per_image` per image, each image on
    `grid_shape(tokens_per_image)`, -1 elsewhere: the layout of LLaVA-1.5 when only the count is known
    (the cache's `request_info` without a Geometry)."""
    side = grid_shape(tokens_per_image)[1]
    ordinal = is_img.long().cumsum(-1) - 1
    rc = torch.stack(
        [ordinal // tokens_per_image, (ordinal % tokens_per_image) // side, ordinal % side], dim=-1
    )
    return torch.where(is_img.unsqueeze(-1), rc, torch.full_like(rc, -1))


def _describe(per_image: list[list[Part]]) -> str:
    shown = []
    for parts in per_image[:3]:
        shown.append(
            " + ".join(
                f"{p.rows}x{p.cols}{' with a newline per row' if p.row_newline else ''}"
                if p.rows
                else f"{p.tail_newlines} newline"
                for p in parts
            )
        )
    return "; ".join(shown) + (" ..." if len(per_image) > 3 else "")


# ---- M-RoPE -------------------------------------------------------------------------------------------------
def _mrope(
    model: Any, input_ids: torch.Tensor, valid: torch.Tensor, inputs: dict
) -> tuple[torch.Tensor, torch.Tensor]:
    """(3, B, N) M-RoPE ids of the prompt and (B,) deltas: the position_ids the caller passed (what the model
    will use), else the model's own `get_rope_index`, else text positions on all three axes (what the model
    does without mm_token_type_ids)."""
    text = (valid.long().cumsum(-1) - 1).masked_fill(~valid, 0)
    pos = inputs.get("position_ids")
    if isinstance(pos, torch.Tensor) and pos.dim() == 3 and pos.shape[-1] == input_ids.shape[1]:
        pos3 = pos[-3:]
    elif inputs.get("mm_token_type_ids") is not None and (
        inputs.get("image_grid_thw") is not None or inputs.get("video_grid_thw") is not None
    ):
        kw = {k: inputs.get(k) for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")}
        pos3, _ = model.model.get_rope_index(
            input_ids, mm_token_type_ids=inputs["mm_token_type_ids"], attention_mask=valid.long(), **kw
        )
    else:
        pos3 = text.unsqueeze(0).expand(3, -1, -1)
    pos3 = pos3.to(input_ids.device).long()
    top = pos3.masked_fill(~valid.unsqueeze(0), -1).amax(dim=(0, 2))
    deltas = top + 1 - valid.sum(-1)
    return pos3, deltas


def mrope_table(geometry: Geometry, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(3, B, P) lookup from a token's 1-D text position (`positions`, (B, N), -1 for padding) to its M-RoPE
    ids, and the (B,) text length past which positions continue as text position + delta."""
    pos3 = geometry.rope_positions
    B, N = positions.shape
    P = max(int(positions.max()) + 1, 1)
    lut = torch.zeros(3, B, P, dtype=torch.long, device=positions.device)
    ok = positions >= 0
    b = torch.arange(B, device=positions.device).view(B, 1).expand(B, N)
    for a in range(3):
        lut[a][b[ok], positions[ok]] = pos3[a][ok]
    return lut, ok.sum(-1)


@dataclass(frozen=True)
class MRope(Rope):
    """The RoPE of a Qwen2-VL-family text model for one request, addressed by 1-D text positions as the rest
    of mm-oval addresses tokens (`RequestInfo.positions`): a prompt token's text position maps to its own
    M-RoPE ids (time, row, column), a later one (decode) to text position + the sample's delta on all three
    axes, as the model continues them. Policies call `cos_sin` / `rotate` unchanged."""

    lut: torch.Tensor | None = None  # (3, B, P) M-RoPE ids by text position
    n_text: torch.Tensor | None = None  # (B,) prompt length (text positions below it are in `lut`)
    deltas: torch.Tensor | None = None  # (B,)

    @classmethod
    def of(cls, rotary_emb: Any, geometry: Geometry, positions: torch.Tensor) -> MRope:
        lut, n_text = mrope_table(geometry, positions)
        return cls(rotary_emb, lut, n_text, geometry.rope_deltas.to(positions.device))

    def ids(self, positions: torch.Tensor) -> torch.Tensor:
        """(B, M) text positions -> (3, B, M) M-RoPE ids."""
        p = positions.clamp(min=0).long()
        B = p.shape[0]
        inside = p < self.n_text[:B].view(B, 1)
        idx = p.clamp(max=self.lut.shape[-1] - 1)
        prompt = self.lut[:, :B].gather(2, idx.unsqueeze(0).expand(3, -1, -1))
        later = (p + self.deltas[:B].view(B, 1)).unsqueeze(0).expand(3, -1, -1)
        return torch.where(inside.unsqueeze(0), prompt, later)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.zeros(1, dtype=torch.float32, device=positions.device)
        cos, sin = self.rotary_emb(x, self.ids(positions))
        return cos.float(), sin.float()
