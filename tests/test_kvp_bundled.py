"""The committed KVP agents on the bundled tiny LLaVA: they load against it and rank held-out tokens
better than every attention-free baseline."""

import pytest
import torch

from mm_oval.policies.base import IMAGE
from mm_oval.policies.kvp import KVPPolicy, bundled_agents_path, load_agents
from mm_oval.training.kvp import (
    agent_scorer,
    heldout_cost,
    keydiff_scorer,
    knorm_scorer,
    random_scorer,
    recency_scorer,
)
from mm_oval.training.traces import capture_traces, iter_traces, load_samples


@pytest.fixture(scope="module")
def bundled():
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from mm_oval.errors import ModelError
    from mm_oval.zoo import bundled_model_path

    try:
        path = bundled_model_path()
    except ModelError:
        pytest.skip("the bundled tiny LLaVA is not in this checkout")
    if not (bundled_agents_path() / "kvp_config.json").is_file():
        pytest.fail("the bundled tiny LLaVA ships without its KVP agents (mm_oval/zoo/tiny_llava_kvp)")
    model = LlavaForConditionalGeneration.from_pretrained(path).eval()
    return model, AutoProcessor.from_pretrained(path)


def image_cut_traces(model, processor, spec: str, out) -> list:
    """Held-out traces of `spec`'s prompts cut after the image, captured on one thread."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        samples = load_samples(spec, seed=123, followups=1)
        capture_traces(model, processor, samples, out, store_queries=False, compress="image")
    finally:
        torch.set_num_threads(n)
    return list(iter_traces(out))


def test_bundled_agents_load_for_the_bundled_model(bundled):
    model, _ = bundled
    KVPPolicy(model=model)  # raises ModelError if the agents were trained for other weights
    # the joint-heads agents (for the shared head budget) by name, for the same weights
    joint = KVPPolicy(agents="bundled-joint", model=model)
    assert joint.agents.config.joint_heads and not KVPPolicy().agents.config.joint_heads
    # the agents trained for the image compressed before the question is read, per head and joint
    for name, jointly in (("bundled-image", False), ("bundled-image-joint", True)):
        pol = KVPPolicy(agents=name, model=model)
        assert pol.agents.config.joint_heads == jointly == pol.comparable_across_heads
        assert pol.loaded.training["compress"] == "image"
        assert (pol.agents.config.sinks, pol.agents.config.recent) == (3, 0)


@pytest.mark.parametrize("name", ["bundled-image", "bundled-image-joint"])
def test_question_agnostic_agents_beat_every_scorer_on_question_agnostic_traces(bundled, tmp_path, name):
    """Held-out traces cut after the image (the question is future): the agents trained for that setting
    rank the image tokens better than every baseline the traces can score, and better than the agents
    trained on whole prompts."""
    model, processor = bundled
    held = image_cut_traces(model, processor, "zoo:heldout:24", tmp_path)
    agents = load_agents(bundled_agents_path(name=name)).agents
    c = agents.config
    kvp = heldout_cost(agent_scorer(agents), held, c.sinks, c.recent)
    whole = load_agents(bundled_agents_path(joint_heads=c.joint_heads)).agents
    others = [random_scorer(0), recency_scorer, knorm_scorer, keydiff_scorer, agent_scorer(whole)]
    for scorer in others:
        base = heldout_cost(scorer, held, c.sinks, c.recent)
        assert kvp.cost < base.cost
        assert kvp.evicted_image[0.1] < base.evicted_image[0.1]


def test_bundled_agents_beat_attention_free_baselines_on_heldout_traces(bundled, tmp_path):
    model, processor = bundled
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        samples = load_samples("zoo:heldout:24", seed=123, followups=1)  # scenes no agent trained on
        capture_traces(model, processor, samples, tmp_path, store_queries=False)
    finally:
        torch.set_num_threads(n)
    held = list(iter_traces(tmp_path))
    agents = load_agents(bundled_agents_path()).agents
    c = agents.config
    kvp = heldout_cost(agent_scorer(agents), held, c.sinks, c.recent)
    for scorer in (random_scorer(0), recency_scorer, knorm_scorer, keydiff_scorer):
        base = heldout_cost(scorer, held, c.sinks, c.recent)
        assert kvp.cost < base.cost
        assert kvp.evicted_image[0.25] < base.evicted_image[0.25]


def test_the_576_token_agents_load_for_their_model_and_beat_every_baseline(tmp_path):
    """The agents fitted to the 576-token tiny LLaVA (question-agnostic, 3 sinks, no recent window) load
    against it, are refused by the 64-token model, and rank held-out tokens better than every
    attention-free baseline on traces cut after the image."""
    from mm_oval.errors import ModelError
    from mm_oval.modelfiles import load_model

    model, processor = load_model("bundled576")
    pol = KVPPolicy(agents="bundled576-image", model=model)
    assert pol.loaded.training["compress"] == "image" and (
        pol.agents.config.sinks,
        pol.agents.config.recent,
    ) == (3, 0)
    small, _ = load_model("bundled")
    with pytest.raises(ModelError):
        KVPPolicy(agents="bundled576-image", model=small)
    # no agents named: each bundled model gets its own
    assert KVPPolicy(model=model).loaded.source == pol.loaded.source
    assert KVPPolicy(model=small).loaded.source == str(bundled_agents_path(name="bundled"))
    held = image_cut_traces(model, processor, "zoo576:heldout:8", tmp_path)
    c = pol.agents.config
    kvp = heldout_cost(agent_scorer(pol.agents), held, c.sinks, c.recent)
    for scorer in (random_scorer(0), recency_scorer, knorm_scorer, keydiff_scorer):
        assert kvp.cost < heldout_cost(scorer, held, c.sinks, c.recent).cost


def test_the_576_token_agents_select_so_that_a_small_budget_covers_every_object():
    """At 5% of the image KV (29 of 576 image tokens per head), the selection recorded with the 576-token
    agents keeps at least one patch of every object in the heads that read objects for the answer (layer
    2's retrieval heads, layer 3's nearest-object head), on held-out scenes; the agents' own order leaves
    objects with none, which is what costs accuracy at small budgets."""
    import math

    from mm_oval.modelfiles import load_model
    from mm_oval.training.kvp import policy_scorer
    from mm_oval.training.traces import ZOO_HELDOUT_SEED_OFFSET, capture_sample, zoo_samples
    from mm_oval.zoo.generate576 import TrainSampler576

    model, processor = load_model("bundled576")
    pol = KVPPolicy(agents="bundled576-image", model=model)
    assert pol.selection.active
    plain = KVPPolicy(agents="bundled576-image", model=model, redundancy=0)
    seed, n = 7, 4
    sampler = TrainSampler576(seed + ZOO_HELDOUT_SEED_OFFSET)
    samples = zoo_samples("heldout", n, seed, 0, 576)
    k = math.ceil(0.05 * 576)
    uncovered = {"selection": 0, "plain": 0}
    for i, sample in enumerate(samples):
        members = sampler.item(i, 1).scene.members
        trace = capture_sample(model, processor, sample, compress="image")
        img = (trace["modality"].long() == IMAGE).nonzero()[:, 0]
        for name, p in (("selection", pol), ("plain", plain)):
            score = policy_scorer(p)
            for layer, head in ((2, 0), (2, 1), (2, 2), (3, 0)):
                s = score(trace, layer)[head][img]
                kept = set(s.topk(k).indices.tolist())
                uncovered[name] += sum(not any(r * 24 + c in kept for r, c in mem) for mem in members)
    assert uncovered["selection"] == 0
    assert uncovered["plain"] > 0


def test_the_576_token_joint_heads_agents_rank_on_one_scale_and_are_used_with_a_shared_head_budget():
    """The joint-heads agents of the 576-token model load for it, score a layer's KV heads on one scale
    (so the shared head budget takes them, which per-head agents are refused), and record the same
    redundancy-aware selection as the per-head ones."""
    import mm_oval
    from mm_oval.errors import ConfigError
    from mm_oval.modelfiles import load_model

    model, _ = load_model("bundled576")
    pol = KVPPolicy(agents="bundled576-image-joint", model=model)
    assert pol.agents.config.joint_heads and pol.comparable_across_heads
    assert (pol.selection.redundancy, pol.selection.sigma) == (4.0, 3.0)
    assert pol.loaded.training["compress"] == "image"
    mm_oval.wrap(
        model, method="kvp", method_options={"agents": "bundled576-image-joint"}, head_budget="shared"
    )
    mm_oval.unwrap(model)
    with pytest.raises(ConfigError):
        mm_oval.wrap(model, method="kvp", method_options={"agents": "bundled576-image"}, head_budget="shared")
