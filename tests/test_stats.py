"""What `get_stats` says about memory: the bytes the cache and the method hold, by kind, beside the bytes
kept. Checked against an independent walk of every object the cache refers to."""

from __future__ import annotations

import gc
import json
import types

import pytest
import torch
from PIL import Image

import mm_oval
from mm_oval.policies.kvp import KVPAgentConfig, KVPAgents
from mm_oval.stats import ALLOCATED_KINDS, get_stats
from mm_oval.wrapper import new_cache

pytestmark = pytest.mark.usefixtures("one_thread")

NEW_TOKENS = 4


def _inputs(processor):
    texts = [
        "USER: <image>\nwhat color is the circle ? ASSISTANT:",
        "USER: <image>\nhow many red objects are there in the picture ? ASSISTANT:",
    ]
    g = torch.Generator().manual_seed(0)
    imgs = [
        Image.fromarray((torch.rand(128, 128, 3, generator=g) * 255).to(torch.uint8).numpy()) for _ in texts
    ]
    return processor(images=imgs, text=texts, return_tensors="pt", padding=True)


def _held_bytes(root, model) -> int:
    """Bytes of the distinct tensor storages reachable from `root` through any Python reference, the
    served model's own modules and weights excepted (the cache refers to its attention modules)."""
    skip = {id(m) for m in model.modules()} | {id(t) for t in model.state_dict(keep_vars=True).values()}
    opaque = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)
    seen, storages, stack, total = set(), set(), [root], 0
    while stack:
        o = stack.pop()
        if id(o) in seen or id(o) in skip or isinstance(o, opaque):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            s = o.untyped_storage()
            if (o.device, s.data_ptr()) not in storages:
                storages.add((o.device, s.data_ptr()))
                total += s.nbytes()
            continue
        stack.extend(gc.get_referents(o))
    return total


@pytest.fixture
def model_and_processor(tiny_random_llava):
    model, processor = tiny_random_llava
    yield model, processor
    mm_oval.unwrap(model)


def _run(model, processor, **cfg):
    mm_oval.wrap(model, **cfg)
    inputs = _inputs(processor)
    cache = new_cache(model)
    model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, cache=cache)
    return cache, inputs, get_stats(model)


def _kvp_agents(model) -> KVPAgents:
    t = model.config.text_config
    head_dim = t.hidden_size // t.num_attention_heads
    return KVPAgents(KVPAgentConfig(t.num_hidden_layers, t.num_key_value_heads, head_dim, pos_table=256))


CONFIGS = {
    "full": lambda model: {},
    "snapkv-25%": lambda model: {"method": "snapkv", "budget": 0.25},
    "quest": lambda model: {"retrieval": "quest", "read_budget": 0.5},
    "oval-after-eviction": lambda model: {"method": "knorm", "budget": 0.5, "retrieval": "oval"},
    "kvp-25%": lambda model: {
        "method": "kvp",
        "budget": 0.25,
        "method_options": {"agents": _kvp_agents(model)},
    },
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_allocated_bytes_are_every_tensor_the_cache_and_its_method_hold(model_and_processor, name):
    model, processor = model_and_processor
    cache, inputs, s = _run(model, processor, **CONFIGS[name](model))
    alloc = s["allocated_bytes"]
    assert set(alloc) == {*ALLOCATED_KINDS, "total"}
    assert alloc["total"] == sum(alloc[k] for k in ALLOCATED_KINDS)
    assert alloc["total"] == _held_bytes(cache, model)
    # KV: every layer's key and value buffers as allocated (longest head, decode slots used or not)
    layers = cache.layers
    assert alloc["kv"] == sum(2 * layer.store.k.numel() * layer.store.k.element_size() for layer in layers)
    assert [row["bytes_allocated"] for row in s["layers"]] == [2 * x.store.k.numel() * 4 for x in layers]
    # the plain cache of this request: every prompt position (padding included) and every token fed after it
    t = model.config.text_config
    B, N = inputs["input_ids"].shape
    fed = N + NEW_TOKENS - 1
    plain = (
        t.num_hidden_layers
        * 2
        * B
        * t.num_key_value_heads
        * fed
        * (t.hidden_size // t.num_attention_heads)
        * 4
    )
    assert s["plain_cache_bytes"] == plain
    assert s["allocated_vs_plain"] == pytest.approx(alloc["total"] / plain)
    json.dumps(s)


def test_eviction_reports_the_decode_slots_and_tables_it_allocates_beyond_what_it_keeps(model_and_processor):
    model, processor = model_and_processor
    cache, inputs, s = _run(model, processor, method="snapkv", budget=0.25)
    alloc = s["allocated_bytes"]
    t = model.config.text_config
    B = inputs["input_ids"].shape[0]
    per_slot = 2 * B * t.num_key_value_heads * (t.hidden_size // t.num_attention_heads) * 4  # K + V, fp32
    decode_slots = cache.layers[0].store.k.shape[2] - cache.layers[0].prompt_slots
    assert decode_slots >= 64  # room preallocated after prefill
    assert alloc["kv"] >= s["kv_bytes_kept"] + t.num_hidden_layers * decode_slots * per_slot
    assert alloc["metadata"] > 0 and alloc["summaries"] == 0 and alloc["method_state"] == 0
    assert s["allocated_vs_plain"] > s["kv_fraction_kept"]


@pytest.mark.parametrize("retrieval", ["quest", "router"])
def test_retrieval_reports_its_summaries_and_the_inputs_it_keeps(model_and_processor, retrieval):
    model, processor = model_and_processor
    options = {}
    if retrieval == "router":
        from mm_oval.training.router import new_router

        torch.manual_seed(0)
        options = {"router": new_router(model)}
    cache, inputs, s = _run(model, processor, retrieval=retrieval, retrieval_options=options)
    alloc = s["allocated_bytes"]
    assert s["kv_fraction_kept"] == 1.0  # nothing evicted ...
    assert s["allocated_vs_plain"] > 1.0  # ... yet more is held than the plain cache
    summaries = {
        (x.device, x.untyped_storage().data_ptr()): x for x in cache.layers for x in x.summaries.values()
    }
    assert alloc["summaries"] == sum(x.untyped_storage().nbytes() for x in summaries.values()) > 0
    B, N = inputs["input_ids"].shape
    embeds = B * N * model.config.text_config.hidden_size * 4
    if retrieval == "quest":  # Quest reads keys only: the wrapper keeps no embeddings or hidden states for it
        assert cache.request.inputs_embeds is None and cache.step.last_hidden is None
        assert alloc["method_state"] < embeds
        return
    assert cache.request.inputs_embeds.shape[:2] == (B, N)
    state = embeds + sum(p.numel() * p.element_size() for p in options["router"].parameters())
    assert alloc["method_state"] >= state


def test_kvp_reports_its_agents_and_their_cached_position_table(model_and_processor):
    model, processor = model_and_processor
    agents = _kvp_agents(model)
    cache, _, s = _run(model, processor, method="kvp", budget=0.25, method_options={"agents": agents})
    weights = sum(p.numel() * p.element_size() for p in agents.parameters())
    table = agents._pos_terms[1]  # LN_p(pos_emb) @ w1_p for every (agent, position), built on first use
    partition = sum(
        x.numel() * x.element_size() for x in cache.request.state_of(cache.eviction).log_partition.values()
    )
    assert s["allocated_bytes"]["method_state"] == weights + table.numel() * table.element_size() + partition
