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

One request, top to bottom: `generate` (or `prefill`, or a caller's own forward) -> `new_request` (a cache
over the wrap's policies, then `_begin_request`) -> the prefill forward (`_pre_forward` prepares the cache;
each layer's attention evicts and pages; `_post_forward`) -> one forward per decode step (`_pre_forward`,
each layer's `attend`, `_post_forward`) -> the stats, once.

This module owns the model's wrap state (`WrapState`, on the model): `wrap` builds the policies once, and
every request's cache serves exactly those (`new_cache`). Everyone else asks through the public names:
`is_wrapped`, `wrap_info` (the configuration, the policies, the attention implementation),
`last_stats` (what `mm_oval.stats.get_stats` returns), `new_cache` / `new_request` / `prefill` (the one
request path: `generate`, `Chat`, the evaluation harness and the lmms-eval plugin all use it), and
`wrapped` (a wrap for the duration of a `with` block, the model restored on exit).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward as llama_eager_attention

from .allocation import check_policy, read_layer_weights
from .cache import PagedMultimodalCache, take_pending
from .config import OvalConfig
from .core import Rope
from .errors import ConfigError
from .geometry import GEOMETRY_INPUTS, THW, MRope, family_of, image_geometry, is_text_only, language_model
from .registry import make_eviction, make_retrieval
from .telemetry import cache_stats

logger = logging.getLogger(__name__)

PREFIX = "mm_oval_"


@dataclass
class WrapState:
    """The model's wrap state (`model._mm_oval`), read and written by this module only."""

    config: OvalConfig
    inner_attn: str
    eviction: Any
    retrieval: Any
    hooks: list = field(default_factory=list)
    last_stats: dict | None = None
    rope: Rope | None = None  # the language model's rotary embedding, handed to eviction policies


@dataclass(frozen=True)
class WrapInfo:
    """What a wrapped model serves its requests with (`wrap_info(model)`): its configuration, the eviction
    and retrieval policies `wrap` built (None for "full" / no retrieval; the very objects every request's
    cache uses) and `attn_implementation`, the model's own attention implementation that prefill runs
    (and `unwrap` restores)."""

    config: OvalConfig
    eviction: Any
    retrieval: Any
    attn_implementation: str


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
    """The prompt's input embeddings (image features merged in; a plain LM's token embeddings), for a
    retrieval policy that needs them."""
    cache = _cache_from_kwargs(kwargs)
    if not isinstance(cache, PagedMultimodalCache) or cache.retrieval is None:
        return
    if not cache.retrieval.needs_inputs_embeds or cache.get_seq_length() != 0:
        return
    embeds = kwargs.get("inputs_embeds")
    ids = kwargs.get("input_ids", args[0] if args else None)
    if embeds is None and ids is not None:  # a plain LM called with input_ids: its own token embeddings
        embeds = module.get_input_embeddings()(ids)
    if embeds is not None:
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
    """An empty cache for one request through the wrapped `model`, serving the wrap's own policies (the
    request begins when its prompt first runs through the model; `new_request` begins it at once)."""
    state: WrapState = _state(model)
    return PagedMultimodalCache(model.config.get_text_config(), state.config, state.eviction, state.retrieval)


def new_request(model: Any, cache: PagedMultimodalCache | None = None, **inputs: Any) -> PagedMultimodalCache:
    """Begin one request through the wrapped `model` and return its cache: a fresh one (`new_cache`), or
    `cache`, an empty one built so. Beginning checks the images against the prompt (`input_ids` with
    `pixel_values` and the model's other image inputs), starts the request's clock and runs the eviction
    policy's own pass over the prompt (KVzip's). Then run the prompt through the model with that cache:
    `model(**inputs, cache=cache, use_cache=True)` or `model.generate(**inputs, cache=cache, ...)`.
    `generate` and `prefill` begin their requests here; so do `Chat`, the evaluation harness and the
    lmms-eval plugin, through them or directly."""
    if cache is None:
        cache = new_cache(model)
    elif not isinstance(cache, PagedMultimodalCache):
        raise ConfigError("a wrapped model's request runs on mm-oval's cache: pass one from new_cache(model)")
    if cache.get_seq_length() != 0 or cache.request.started is not None:
        raise ConfigError("this cache already holds a request; build a new one (new_cache) per request")
    input_ids = inputs.get("input_ids")
    if not isinstance(input_ids, torch.Tensor):
        raise ConfigError("mm-oval needs input_ids (not inputs_embeds) to know which tokens are image tokens")
    _begin_request(model, cache, input_ids, inputs)
    return cache


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
        if (
            isinstance(input_ids, torch.Tensor)
            and cache.get_seq_length() == 0
            and cache.request.started is None
        ):
            _begin_request(model, cache, input_ids, kwargs)  # new_request's beginning (unless it ran)
        return model._mm_oval_generate(*args, **kwargs)
    finally:
        cache.request.run_by_generate = False
        if cache.info is not None:
            state.last_stats = cache_stats(cache)


def prefill(model: Any, **inputs: Any) -> PagedMultimodalCache:
    """Run the prompt once (e.g. the image and a system text) and return the compressed cache. Then ask
    several questions: `model.generate(input_ids=prompt+question, attention_mask=..., cache=cache.copy())`
    (the question is not part of the compressed prefill; pass no pixel_values again). The model computes
    the logits of the last prompt position only (`logits_to_keep=1`), not of every prompt token. A
    left-padded batch gets the positions `generate` gives it (each sample's count of its valid tokens), so
    its later tokens, read through `generate`, sit where they would without the split."""
    with torch.no_grad():
        has_ids = isinstance(inputs.get("input_ids"), torch.Tensor)
        mask = inputs.get("attention_mask")
        if (
            has_ids
            and isinstance(mask, torch.Tensor)
            and inputs.get("position_ids") is None
            and not bool(mask.all())
            and family_of(model) != THW  # M-RoPE: the model's own rope index reads the mask
        ):  # as GenerationMixin's prepare_inputs_for_generation, which a plain forward does not run
            inputs["position_ids"] = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
        cache = new_request(model, **inputs) if has_ids else new_cache(model)
        if "logits_to_keep" in inspect.signature(model.forward).parameters:
            inputs.setdefault("logits_to_keep", 1)
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
    policy = cache.eviction  # the wrap's own policy (new_cache), whose scores read what this pass returns
    if not policy_pass or policy is None or not cache.config.evicts or not policy.has_request_pass:
        return  # nothing to prepare (a delegating policy answers for its scorer)
    cache.request.prepared = policy.prepare_request(
        model, input_ids, kwargs.get("attention_mask"), pixel_values, chunk_size=cache.config.chunk_size
    )


def is_wrapped(model: Any) -> bool:
    """Whether `model` is wrapped by `mm_oval.wrap` now."""
    return getattr(model, "_mm_oval", None) is not None


def _state(model: Any) -> WrapState:
    state = getattr(model, "_mm_oval", None)
    if state is None:
        raise ConfigError("this model is not wrapped: call mm_oval.wrap(model, ...) first")
    return state


def wrap_info(model: Any) -> WrapInfo:
    """What the wrapped `model` serves with (`WrapInfo`); a ConfigError for a model that is not wrapped."""
    state = _state(model)
    return WrapInfo(state.config, state.eviction, state.retrieval, state.inner_attn)


def last_stats(model: Any) -> dict[str, Any]:
    """Stats of the last request served by the wrapped `model` (`mm_oval.stats.get_stats`)."""
    state = _state(model)
    if state.last_stats is None:
        raise ConfigError("no request has run through the wrapped model yet: call model.generate(...) first")
    return state.last_stats


def make_policies(
    model: Any, config: OvalConfig, eviction: Any = None, retrieval: Any = None
) -> tuple[Any, Any]:
    """(eviction, retrieval): the policies a wrap of `model` with `config` serves. Each is built from the
    configuration's method and options and checked against the model (learned parts, model-dependent
    options: the policy's `bind`), unless given: a given policy (e.g. one made by an earlier call, or a
    subclass that records what it sees) is used as it is, and the configuration must name a method of its
    kind (the stats report the configuration's names)."""
    if eviction is not None and config.method == "full":
        raise ConfigError(
            "an eviction policy was given but the configuration's method is 'full': name its method"
        )
    if retrieval is not None and not config.retrieval:
        raise ConfigError(
            "a retrieval policy was given but the configuration has no retrieval: name its method"
        )
    built = []
    if eviction is None and config.method != "full":
        eviction = make_eviction(config.method, **config.method_options)
        built.append(eviction)
    if retrieval is None and config.retrieval:
        retrieval = make_retrieval(config.retrieval, **config.retrieval_options)
        built.append(retrieval)
    for policy in built:  # learned parts and model-dependent options checked against the model
        getattr(policy, "bind", lambda m: None)(model)
    if config.unread_pages == "scored" and not getattr(retrieval, "estimates_page_mass", False):
        raise ConfigError(
            f"unread_pages='scored' needs a retrieval scorer whose page summaries estimate a page's attention "
            f"mass (oval, locks, or router2 over one of them); {config.retrieval!r} does not: use "
            "unread_pages='centroid' (the pages' key means)"
        )
    check_policy(eviction, config.head_budget)  # head_budget="shared" needs scores comparable across heads
    return eviction, retrieval


def wrap(
    model: Any,
    config: OvalConfig | None = None,
    *,
    eviction_policy: Any = None,
    retrieval_policy: Any = None,
    **overrides: Any,
) -> Any:
    """Wrap a LLaVA-style model in place and return it. `overrides` are OvalConfig fields
    (e.g. `method="snapkv", budget=0.25`). The policies are built here, once (`make_policies`), or taken as
    given (`eviction_policy=` / `retrieval_policy=`), and every request's cache serves them. Wrapping a
    wrapped model replaces its configuration; a wrap that fails leaves the model as it was."""
    lm = _language_model(model)
    family_of(model)  # a model whose image layout mm-oval cannot read is refused here, naming what is missing
    if config is not None and not isinstance(config, OvalConfig):
        raise ConfigError(f"config must be an OvalConfig, got {type(config).__name__}")
    config = (config or OvalConfig()).replace(**overrides) if overrides else (config or OvalConfig())
    if is_text_only(model):  # a plain LM: the budgets are over its context (text pages only)
        config = config.for_text_only()
    layers = getattr(lm.config, "num_hidden_layers", None)
    if layers is not None and config.dense_layers >= layers:
        raise ConfigError(
            f"dense_layers={config.dense_layers} reads every page in all {layers} layers of this model, so "
            f"retrieval would read nothing selectively: use dense_layers < {layers}, or no retrieval"
        )
    if layers is not None and config.retrieval is not None:
        read_layer_weights(config.read_layer_budget, layers)  # a division that does not fit is refused here
    eviction, retrieval = make_policies(model, config, eviction_policy, retrieval_policy)
    if is_wrapped(model):
        unwrap(model)
    inner = lm.config._attn_implementation or "eager"
    if inner.startswith(PREFIX):
        inner = inner[len(PREFIX) :]
    state = WrapState(config, inner, eviction, retrieval)
    rotary = getattr(lm, "rotary_emb", None)
    state.rope = Rope(rotary) if rotary is not None else None
    _install(model, lm, state)
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


def _install(model: Any, lm: Any, state: WrapState) -> None:
    """Put `state`'s wrap on the (unwrapped) model: the attention implementation, `generate`, the hooks."""
    lm.config._attn_implementation = _register(state.inner_attn)
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


def unwrap(model: Any) -> Any:
    """Undo `wrap`: the plain model again (in place; returned for convenience)."""
    state = getattr(model, "_mm_oval", None)
    if state is None:
        return model
    lm = _language_model(model)
    lm.config._attn_implementation = state.inner_attn
    for h in state.hooks:
        h.remove()
    state.hooks = []
    del model.generate  # the instance attribute; the class's generate shows again
    for attr in ("_mm_oval", "_mm_oval_generate"):
        delattr(model, attr)
    return model


@contextlib.contextmanager
def wrapped(
    model: Any,
    config: OvalConfig | None = None,
    *,
    eviction_policy: Any = None,
    retrieval_policy: Any = None,
    **overrides: Any,
) -> Iterator[Any]:
    """`with mm_oval.wrapped(model, method="snapkv", budget=0.25) as m:` the model wrapped (as `wrap` does,
    same arguments) inside the block; on leaving it, normally or by an exception, the model is as it was
    before: plain again (attention implementation, `generate`, no hooks), or, if it was wrapped already,
    wrapped again with that earlier wrap's configuration, policies and last stats."""
    before = getattr(model, "_mm_oval", None)
    wrap(model, config, eviction_policy=eviction_policy, retrieval_policy=retrieval_policy, **overrides)
    try:
        yield model
    finally:
        unwrap(model)
        if before is not None:
            _install(model, _language_model(model), before)
