"""`mm_oval.wrap(model, ...)`: put a `PagedMultimodalCache` under an unmodified LLaVA.

What wrapping changes, and `unwrap` restores:
- the language model's attention implementation becomes `mm_oval_<inner>` (e.g. `mm_oval_sdpa`): the
  model's own attention function (`inner`) during prefill, then eviction; the cache's exact attention over
  the kept (and, with retrieval, selected) slots at decode. The vision tower is untouched;
- `model.generate` builds a fresh cache per call and then calls Hugging Face's `generate`;
- forward hooks prepare the cache from `input_ids` (modality, positions, image rows/cols), time prefill
  and decode, and hand the last hidden state to retrieval policies. Prefill time covers the vision tower
  and projector: Hugging Face's `generate` encodes the images before the first forward, so for a
  `generate` call the prefill clock starts when the request starts.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import time
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .cache import PagedMultimodalCache, take_pending
from .config import OvalConfig
from .errors import ConfigError, ModelError
from .geometry import GEOMETRY_INPUTS, MRope, family_of, image_geometry, tokens_per_view
from .policies.base import Rope, make_eviction, make_retrieval
from .policies.budgets import check_policy
from .stats import cache_stats

logger = logging.getLogger(__name__)

PREFIX = "mm_oval_"


@dataclass
class WrapState:
    config: OvalConfig
    inner_attn: str
    eviction: Any
    retrieval: Any
    hooks: list = field(default_factory=list)
    last_stats: dict | None = None
    tokens_per_image: int = 0
    rope: Rope | None = None  # the language model's rotary embedding, handed to eviction policies


def _language_model(model: Any) -> Any:
    inner = getattr(model, "model", None)
    lm = getattr(inner, "language_model", None)
    if lm is None or not hasattr(lm, "layers") or getattr(model.config, "image_token_id", None) is None:
        raise ModelError(
            f"{type(model).__name__} is not a LLaVA-style model: mm_oval.wrap needs a "
            "LlavaForConditionalGeneration, LlavaNextForConditionalGeneration, "
            "LlavaOnevisionForConditionalGeneration or Qwen2_5_VLForConditionalGeneration "
            "(model.model.language_model.layers and config.image_token_id), "
            "e.g. llava-hf/llava-1.5-7b-hf or mm_oval.zoo's tiny model"
        )
    return lm


def _tokens_per_image(model: Any) -> int:
    """Tokens of one image_size view (LLaVA-1.5: of one image); 0 where every image has its own size
    (Qwen2-VL). The per-request count and layout come from mm_oval.geometry."""
    return tokens_per_view(model)


def _eager_of(module: Any):
    mod = sys.modules.get(type(module).__module__)
    fn = getattr(mod, "eager_attention_forward", None)
    if fn is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as fn
    return fn


def _make_attention(inner: str):
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        layer = take_pending(getattr(module, "layer_idx", None))
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        if layer is None or layer.phase == "prefill":
            fn = _eager_of(module) if inner == "eager" else ALL_ATTENTION_FUNCTIONS[inner]
            out = fn(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
            if layer is not None:
                layer.finish_prefill(query, module, scaling)
            return out
        return layer.attend(query, scaling), None

    attention.__name__ = f"{PREFIX}{inner}_attention"
    return attention


def _register(inner: str) -> str:
    name = f"{PREFIX}{inner}"
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _make_attention(inner))
    if name not in ALL_MASK_ATTENTION_FUNCTIONS and inner in ALL_MASK_ATTENTION_FUNCTIONS:
        # the model's own mask (causal + padding) during prefill; decode ignores it
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    return name


def _cache_from_kwargs(kwargs: dict) -> Any:
    for key in ("cache", "past_key_values"):
        if kwargs.get(key) is not None:
            return kwargs[key]
    return None


def _geometry(model: Any, input_ids: torch.Tensor, kwargs: dict) -> Any:
    """The request's image geometry (mm_oval.geometry): where each image's tokens are and their (row, col);
    a DataError when the tokens do not match what the model makes of the pixel inputs."""
    given = {k: kwargs.get(k) for k in GEOMETRY_INPUTS if kwargs.get(k) is not None}
    return image_geometry(model, input_ids, kwargs.get("attention_mask"), **given)


def _pre_forward(model: Any, args: tuple, kwargs: dict) -> None:
    state: WrapState = model._mm_oval
    cache = _cache_from_kwargs(kwargs)
    if not isinstance(cache, PagedMultimodalCache):
        return
    model._mm_oval_cache_box["cache"] = cache  # for the hooks inside this forward
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    if cache.get_seq_length() == 0:
        if input_ids is None:
            raise ConfigError(
                "mm-oval needs input_ids (not inputs_embeds) to know which tokens are image tokens"
            )
        geometry = _geometry(model, input_ids, kwargs)
        cache.prepare(input_ids, kwargs.get("attention_mask"), geometry=geometry)
        cache.rope = state.rope
        if geometry.rope_positions is not None and state.rope is not None:  # M-RoPE, per request
            cache.rope = MRope.of(state.rope.rotary_emb, geometry, cache.info.positions)
        cache._phase_now = "prefill"
    else:
        cache._phase_now = "decode"
        # padding inside the new tokens (a batch of conversations whose next turns differ in length)
        am = kwargs.get("attention_mask")
        new_valid = None
        if isinstance(am, torch.Tensor) and am.dim() == 2 and isinstance(input_ids, torch.Tensor):
            tail = am[:, -input_ids.shape[1] :].bool()
            new_valid = None if bool(tail.all()) else tail
        cache.new_valid = new_valid
    _sync(input_ids)
    started = cache.__dict__.pop("_t_request", None)  # set by generate: the images were encoded before
    cache._t0 = started if started is not None and cache._phase_now == "prefill" else time.perf_counter()


def _post_forward(model: Any, args: tuple, kwargs: dict, output: Any) -> None:
    cache = _cache_from_kwargs(kwargs)
    model._mm_oval_cache_box["cache"] = None
    if not isinstance(cache, PagedMultimodalCache) or getattr(cache, "_t0", None) is None:
        return
    _sync(getattr(output, "logits", None))
    dt = time.perf_counter() - cache._t0
    cache._t0 = None
    if cache._phase_now == "prefill":
        cache.timings["prefill_s"] += dt
    else:
        cache.timings["decode_s"] += dt
        cache.timings["decode_steps"] += 1
        return
    model._mm_oval.last_stats = cache_stats(cache)


def _sync(t: Any) -> None:
    if isinstance(t, torch.Tensor) and t.is_cuda:
        torch.cuda.synchronize(t.device)


def _norm_hook(cache_box: dict, module: Any, args: tuple, output: Any) -> None:
    cache = cache_box.get("cache")
    if cache is not None and cache.retrieval is not None and isinstance(output, torch.Tensor):
        cache.step_extra["last_hidden"] = output[:, -1].detach()


def _attn_pre_hook(module: Any, args: tuple, kwargs: dict) -> None:
    """Keeps a layer's attention input (the hidden states after its input norm) for the prefill's eviction
    policy when that policy reads hidden states; nothing otherwise."""
    cache = _cache_from_kwargs(kwargs)
    if not isinstance(cache, PagedMultimodalCache) or cache.eviction is None:
        return
    if not cache.eviction.needs_hidden_states:
        return
    layer = cache.layers[module.layer_idx]
    if layer.phase == "empty":  # this forward is the layer's prefill
        layer._prefill_hidden = kwargs.get("hidden_states", args[0] if args else None)


def _lm_pre_hook(cache_box: dict, module: Any, args: tuple, kwargs: dict) -> None:
    cache = cache_box.get("cache")
    embeds = kwargs.get("inputs_embeds")
    if (
        cache is not None
        and cache.retrieval is not None
        and embeds is not None
        and cache.get_seq_length() == 0
    ):
        cache.extra["inputs_embeds"] = embeds.detach()


def new_cache(model: Any) -> PagedMultimodalCache:
    """A fresh cache for one request through the wrapped `model`."""
    state: WrapState = _state(model)
    return PagedMultimodalCache(model.config.text_config, state.config, state.eviction, state.retrieval)


def _generate(model: Any, *args: Any, **kwargs: Any) -> Any:
    state = _state(model)
    if kwargs.get("num_beams", 1) not in (None, 1):
        raise ConfigError("beam search is not supported by mm-oval's cache; use greedy or sampling")
    cache = _cache_from_kwargs(kwargs)
    if cache is None:
        cache = new_cache(model)
    elif not isinstance(cache, PagedMultimodalCache):
        raise ConfigError("a wrapped model generates with mm-oval's cache: do not pass another cache")
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(input_ids, torch.Tensor) and cache.get_seq_length() == 0:
        _geometry(model, input_ids, kwargs)  # a clear error before generate encodes the images
    kwargs.pop("past_key_values", None)
    kwargs["cache"] = cache
    if cache.get_seq_length() == 0:
        # the prefill clock starts here: generate runs the vision tower and projector before the forward
        _sync(input_ids)
        cache._t_request = time.perf_counter()
    try:
        if cache.get_seq_length() == 0:
            _prepare_request(model, cache, input_ids, kwargs)
        return model._mm_oval_generate(*args, **kwargs)
    finally:
        cache.__dict__.pop("_t_request", None)
        if cache.info is not None:
            state.last_stats = cache_stats(cache)


def prefill(model: Any, **inputs: Any) -> PagedMultimodalCache:
    """Run the prompt once (e.g. the image and a system text) and return the compressed cache. Then ask
    several questions: `model.generate(input_ids=prompt+question, attention_mask=..., cache=cache.copy())`
    (the question is not part of the compressed prefill; pass no pixel_values again). The model computes
    the logits of the last prompt position only (`logits_to_keep=1`), not of every prompt token."""
    cache = new_cache(model)
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        inputs.setdefault("logits_to_keep", 1)
    with torch.no_grad():
        _prepare_request(model, cache, inputs.get("input_ids"), inputs)
        model(**inputs, cache=cache, use_cache=True)
    return cache


def _prepare_request(model: Any, cache: PagedMultimodalCache, input_ids: Any, kwargs: dict) -> None:
    """Once per request, before the prefill forward: the eviction policy's own pass over the prompt (KVzip's
    context reconstruction), kept in `cache.request_state`. Its time counts as prefill time."""
    state = _state(model)
    policy = state.eviction
    if policy is None or not state.config.evicts or not isinstance(input_ids, torch.Tensor):
        return
    if not policy.has_request_pass:  # nothing to prepare (a delegating policy answers for its scorer)
        return
    pixel_values = kwargs.get("pixel_values")
    _geometry(model, input_ids, kwargs)
    if "_t_request" not in cache.__dict__:
        _sync(input_ids)
        cache._t_request = time.perf_counter()
    cache.request_state = policy.prepare_request(
        model,
        input_ids,
        kwargs.get("attention_mask"),
        pixel_values,
        chunk_size=state.config.chunk_size,
    )


def _state(model: Any) -> WrapState:
    state = getattr(model, "_mm_oval", None)
    if state is None:
        raise ConfigError("this model is not wrapped: call mm_oval.wrap(model, ...) first")
    return state


def wrap(model: Any, config: OvalConfig | None = None, **overrides: Any) -> Any:
    """Wrap a LLaVA-style model in place and return it. `overrides` are OvalConfig fields
    (e.g. `method="snapkv", budget=0.25`). Wrapping a wrapped model replaces its configuration."""
    lm = _language_model(model)
    family_of(model)  # a model whose image layout mm-oval cannot read is refused here, naming what is missing
    if config is not None and not isinstance(config, OvalConfig):
        raise ConfigError(f"config must be an OvalConfig, got {type(config).__name__}")
    config = (config or OvalConfig()).replace(**overrides) if overrides else (config or OvalConfig())
    eviction = make_eviction(config.method, **config.method_options) if config.method != "full" else None
    retrieval = make_retrieval(config.retrieval, **config.retrieval_options) if config.retrieval else None
    for policy in (
        eviction,
        retrieval,
    ):  # learned parts and model-dependent options checked against the model
        getattr(policy, "bind", lambda m: None)(model)
    check_policy(eviction, config.head_budget)  # head_budget="shared" needs scores comparable across heads
    if getattr(model, "_mm_oval", None) is not None:
        unwrap(model)
    inner = lm.config._attn_implementation or "eager"
    if inner.startswith(PREFIX):
        inner = inner[len(PREFIX) :]
    state = WrapState(config, inner, eviction, retrieval, tokens_per_image=_tokens_per_image(model))
    rotary = getattr(lm, "rotary_emb", None)
    state.rope = Rope(rotary) if rotary is not None else None
    lm.config._attn_implementation = _register(inner)
    model._mm_oval = state
    model._mm_oval_cache_box = {"cache": None}
    model._mm_oval_generate = model.generate
    model.generate = types.MethodType(_generate, model)
    state.hooks = [
        model.register_forward_pre_hook(_pre_forward, with_kwargs=True),
        model.register_forward_hook(_post_forward, with_kwargs=True),
    ]
    state.hooks.append(
        lm.register_forward_pre_hook(
            functools.partial(_lm_pre_hook, model._mm_oval_cache_box), with_kwargs=True
        )
    )
    for layer in lm.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is not None and getattr(attn, "layer_idx", None) is not None:
            state.hooks.append(attn.register_forward_pre_hook(_attn_pre_hook, with_kwargs=True))
    norm = getattr(lm, "norm", None)
    if norm is not None:
        state.hooks.append(
            norm.register_forward_hook(functools.partial(_norm_hook, model._mm_oval_cache_box))
        )
    logger.info("wrapped %s: %s", type(model).__name__, config)
    return model


def unwrap(model: Any) -> Any:
    """Undo `wrap`: the plain model again (in place; returned for convenience)."""
    state = getattr(model, "_mm_oval", None)
    if state is None:
        return model
    lm = _language_model(model)
    lm.config._attn_implementation = state.inner_attn
    for h in state.hooks:
        h.remove()
    del model.generate  # the instance attribute; the class's generate shows again
    for attr in ("_mm_oval", "_mm_oval_cache_box", "_mm_oval_generate"):
        delattr(model, attr)
    return model
