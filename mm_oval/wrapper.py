"""`mm_oval.wrap(model, ...)`: put a `PagedMultimodalCache` under an unmodified LLaVA.

What wrapping changes, and `unwrap` restores:
- the language model's attention implementation becomes `mm_oval_<inner>` (e.g. `mm_oval_sdpa`): the
  model's own attention function (`inner`) during prefill, then eviction; the cache's exact attention over
  the kept (and, with retrieval, selected) slots at decode (the hand-off: `mm_oval.cache`'s docstring).
  The vision tower is untouched;
- `model.generate` becomes an instance attribute, `_generate` below, so that `model.generate(**inputs)`
  works unchanged for users: it refuses beam search and a cache of another kind, builds a fresh
  `PagedMultimodalCache` (unless one is passed as `cache=`), begins the request (`_begin_request`: the
  image check, the request's clock, the eviction policy's own pass over the prompt), calls the class's
  `generate` with `cache=` that cache, and records the request's stats when it returns or raises. (A
  generate cannot be given a fresh cache of its own kind otherwise: Hugging Face builds a DynamicCache.)
  `unwrap` deletes the attribute and the class's `generate` shows again;
- forward hooks, each finding the cache in the forward's own arguments (`cache=` / `past_key_values=`):
  on the model, one before each forward (`_pre_forward`: prepares the cache from `input_ids` at prefill,
  begins the step in `cache.step`: phase, clock, padding of the new tokens) and one after
  (`_post_forward`: the step's time; the stats of a request not run by `generate`); on the language
  model, one before (the prompt's `inputs_embeds`, when the retrieval policy needs them) and one after
  (the last token's final hidden state, when the retrieval policy needs it); on each attention module,
  one before (the layer's attention input during prefill, when the eviction policy reads hidden states).
Prefill time covers the vision tower and projector: Hugging Face's `generate` encodes the images before the
first forward, so the prefill clock starts when the request begins.

One request, top to bottom: `generate` (or `prefill`) -> `_begin_request` -> the prefill forward
(`_pre_forward` prepares the cache; each layer's attention evicts and pages; `_post_forward`) -> one
forward per decode step (`_pre_forward`, each layer's `attend`, `_post_forward`) -> the stats, once.
"""

from __future__ import annotations

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
from transformers.models.llama.modeling_llama import eager_attention_forward as llama_eager_attention

from .allocation import check_policy
from .cache import PagedMultimodalCache, take_pending
from .config import OvalConfig
from .core import Rope
from .errors import ConfigError
from .geometry import GEOMETRY_INPUTS, MRope, family_of, image_geometry, is_text_only, language_model
from .registry import make_eviction, make_retrieval
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
    rope: Rope | None = None  # the language model's rotary embedding, handed to eviction policies


def _language_model(model: Any) -> Any:
    return language_model(model)


def _eager_of(module: Any):
    mod = sys.modules.get(type(module).__module__)
    return getattr(mod, "eager_attention_forward", None) or llama_eager_attention


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
    """Before each forward through the cache: at prefill, prepare the cache for the prompt (beginning the
    request first when no `generate` / `prefill` did); then begin the step (phase, clock, padding)."""
    state: WrapState = model._mm_oval
    cache = _cache_from_kwargs(kwargs)
    if not isinstance(cache, PagedMultimodalCache):
        return
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    am = kwargs.get("attention_mask")
    if cache.get_seq_length() == 0:
        if input_ids is None:
            raise ConfigError(
                "mm-oval needs input_ids (not inputs_embeds) to know which tokens are image tokens"
            )
        if cache.request.started is None:  # a plain forward: the request begins here
            _begin_request(model, cache, input_ids, kwargs, policy_pass=False)
        geometry = cache.geometry  # read (and checked) once, when the request began
        cache.prepare(input_ids, am, geometry=geometry)
        if geometry.rope_positions is not None and state.rope is not None:  # M-RoPE, per request
            cache.rope = MRope.of(state.rope.rotary_emb, geometry, cache.info.positions)
        _sync(input_ids)
        cache.step.begin("prefill", cache.request.started)
        return
    # padding inside the new tokens (a batch of conversations whose next turns differ in length)
    new_valid = None
    if isinstance(am, torch.Tensor) and am.dim() == 2 and isinstance(input_ids, torch.Tensor):
        tail = am[:, -input_ids.shape[1] :].bool()
        new_valid = None if bool(tail.all()) else tail
    _sync(input_ids)
    cache.step.begin("decode", time.perf_counter(), new_valid)


def _post_forward(model: Any, args: tuple, kwargs: dict, output: Any) -> None:
    cache = _cache_from_kwargs(kwargs)
    if not isinstance(cache, PagedMultimodalCache) or cache.step.started is None:
        return
    _sync(getattr(output, "logits", None))
    step = cache.step
    dt = time.perf_counter() - step.started
    step.started = None
    if step.phase == "decode":
        cache.timings["decode_s"] += dt
        cache.timings["decode_steps"] += 1
        return
    cache.timings["prefill_s"] += dt
    if not cache.request.run_by_generate:  # generate records them once, when it ends
        model._mm_oval.last_stats = cache_stats(cache)


def _sync(t: Any) -> None:
    if isinstance(t, torch.Tensor) and t.is_cuda:
        torch.cuda.synchronize(t.device)


def _attn_pre_hook(module: Any, args: tuple, kwargs: dict) -> None:
    """Keeps a layer's attention input (the hidden states after its input norm) for the prefill's eviction
    policy when that policy reads hidden states; nothing otherwise."""
    cache = _cache_from_kwargs(kwargs)
    if not isinstance(cache, PagedMultimodalCache) or cache.eviction is None:
        return
    if not cache.eviction.needs_hidden_states:
        return
    if cache.layers[module.layer_idx].phase == "empty":  # this forward is the layer's prefill
        cache.step.attention_inputs[module.layer_idx] = kwargs.get("hidden_states", args[0] if args else None)


def _lm_pre_hook(module: Any, args: tuple, kwargs: dict) -> None:
    """The prompt's input embeddings (image features merged in), for a retrieval policy that needs them."""
    cache = _cache_from_kwargs(kwargs)
    if not isinstance(cache, PagedMultimodalCache) or cache.retrieval is None:
        return
    embeds = kwargs.get("inputs_embeds")
    if cache.retrieval.needs_inputs_embeds and embeds is not None and cache.get_seq_length() == 0:
        cache.request.inputs_embeds = embeds.detach()


def _lm_post_hook(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
    """The last token's final hidden state (after the last norm), read at the next decode step by a
    retrieval policy that needs it."""
    cache = _cache_from_kwargs(kwargs)
    if not isinstance(cache, PagedMultimodalCache) or cache.retrieval is None:
        return
    hidden = getattr(output, "last_hidden_state", None)
    if cache.retrieval.needs_last_hidden and isinstance(hidden, torch.Tensor):
        cache.step.last_hidden = hidden[:, -1].detach()


def new_cache(model: Any) -> PagedMultimodalCache:
    """A fresh cache for one request through the wrapped `model`."""
    state: WrapState = _state(model)
    return PagedMultimodalCache(model.config.get_text_config(), state.config, state.eviction, state.retrieval)


def _generate(model: Any, *args: Any, **kwargs: Any) -> Any:
    """The wrapped model's `generate` (see the module docstring): Hugging Face's, over a fresh cache."""
    state = _state(model)
    if kwargs.get("num_beams", 1) not in (None, 1):
        raise ConfigError("beam search is not supported by mm-oval's cache; use greedy or sampling")
    cache = _cache_from_kwargs(kwargs)
    if cache is None:
        cache = new_cache(model)
    elif not isinstance(cache, PagedMultimodalCache):
        raise ConfigError("a wrapped model generates with mm-oval's cache: do not pass another cache")
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    kwargs.pop("past_key_values", None)
    kwargs["cache"] = cache
    cache.request.run_by_generate = True
    try:
        if isinstance(input_ids, torch.Tensor) and cache.get_seq_length() == 0:
            _begin_request(model, cache, input_ids, kwargs)
        return model._mm_oval_generate(*args, **kwargs)
    finally:
        cache.request.run_by_generate = False
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
        if isinstance(inputs.get("input_ids"), torch.Tensor):
            _begin_request(model, cache, inputs["input_ids"], inputs)
        model(**inputs, cache=cache, use_cache=True)  # its stats: `_post_forward`, after this prefill
    return cache


def _begin_request(
    model: Any, cache: PagedMultimodalCache, input_ids: torch.Tensor, kwargs: dict, policy_pass: bool = True
) -> None:
    """Once per request, before its prefill forward: check the images against the prompt (the only check),
    start the request's clock and, with `policy_pass`, run the eviction policy's own pass over the prompt
    (KVzip's context reconstruction; its time counts as prefill time), kept in `cache.request.prepared`."""
    state = _state(model)
    pixel_values = kwargs.get("pixel_values")
    # the request's image geometry: where each image's tokens are and their (row, col); the only check of
    # the images against the prompt (a DataError when they do not match)
    cache.geometry = _geometry(model, input_ids, kwargs)
    _sync(input_ids)
    cache.request.started = time.perf_counter()
    cache.rope = state.rope
    policy = state.eviction
    if not policy_pass or policy is None or not state.config.evicts or not policy.has_request_pass:
        return  # nothing to prepare (a delegating policy answers for its scorer)
    cache.request.prepared = policy.prepare_request(
        model, input_ids, kwargs.get("attention_mask"), pixel_values, chunk_size=state.config.chunk_size
    )


def is_wrapped(model: Any) -> bool:
    """Whether `model` is wrapped by `mm_oval.wrap` now."""
    return getattr(model, "_mm_oval", None) is not None


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
    if is_text_only(model):  # a plain LM: the budgets are over its context (text pages only)
        config = config.for_text_only()
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
    state = WrapState(config, inner, eviction, retrieval)
    rotary = getattr(lm, "rotary_emb", None)
    state.rope = Rope(rotary) if rotary is not None else None
    lm.config._attn_implementation = _register(inner)
    model._mm_oval = state
    model._mm_oval_generate = model.generate
    model.generate = types.MethodType(_generate, model)
    state.hooks = [
        model.register_forward_pre_hook(_pre_forward, with_kwargs=True),
        model.register_forward_hook(_post_forward, with_kwargs=True),
        lm.register_forward_pre_hook(_lm_pre_hook, with_kwargs=True),
        lm.register_forward_hook(_lm_post_hook, with_kwargs=True),
    ]
    for layer in lm.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is not None and getattr(attn, "layer_idx", None) is not None:
            state.hooks.append(attn.register_forward_pre_hook(_attn_pre_hook, with_kwargs=True))
    # the policies' options with their defaults spelled out (rank, summary_format, weights, ...)
    resolved = config.resolved()
    logger.info(
        "wrapped %s: %s (method options %s, retrieval options %s)",
        type(model).__name__,
        config,
        resolved["method_options"],
        resolved["retrieval_options"],
    )
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
    for attr in ("_mm_oval", "_mm_oval_generate"):
        delattr(model, attr)
    return model
