"""KVP: reward, Plackett-Luce / RLOO, the agents, trace capture, resumable training, the mismatch error,
and that trained agents beat random eviction on held-out traces."""

import itertools
import json

import pytest
import torch

from mm_oval.errors import ConfigError, DataError, ModelError, ResultsError
from mm_oval.policies.base import EVICTION_REGISTRY, IMAGE, PAD, TEXT, PrefillContext
from mm_oval.policies.kvp import (
    KVPAgentConfig,
    KVPAgents,
    KVPPolicy,
    load_agents,
    model_signature,
    save_agents,
)
from mm_oval.policies.kvp_features import EXTRA_FEATURES, extra_features
from mm_oval.training.kvp import (
    KVPTrainConfig,
    agent_scorer,
    heldout_cost,
    oracle_scorer,
    plackett_luce_logprob,
    random_scorer,
    ranking_reward,
    rloo_loss,
    train_agents,
)
from mm_oval.training.traces import capture_sample, capture_traces, iter_traces, load_samples, toy_samples

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------------
# reward and policy gradient


def test_optimal_ranking_scores_exactly_minus_one_and_worse_rankings_score_lower():
    g = torch.Generator().manual_seed(0)
    u = torch.rand(5, 40, generator=g) ** 3
    best = torch.argsort(u, dim=-1, descending=True)
    assert torch.equal(ranking_reward(best, u), torch.full((5,), -1.0))
    worst = best.flip(-1)
    rand = torch.stack([torch.randperm(40, generator=g) for _ in range(5)])
    r_worst, r_rand = ranking_reward(worst, u), ranking_reward(rand, u)
    assert (r_worst < -1).all() and (r_rand < -1).all()
    assert (r_worst < r_rand).all()  # the reversed ranking is the worst of all


def test_reward_counts_evicted_utility_over_every_budget():
    # u = (3, 1, 0): ranking (1, 0, 2) evicts more at budget 1 than the optimal (0, 1, 2)
    u = torch.tensor([3.0, 1.0, 0.0])
    opt = 1 * 3 + 2 * 1  # sum_j j * u_sigma(j)
    swapped = 1 * 1 + 2 * 3
    assert float(ranking_reward(torch.tensor([1, 0, 2]), u)) == pytest.approx(-swapped / opt)


def test_plackett_luce_probabilities_sum_to_one_over_all_rankings():
    scores = torch.tensor([[0.3, -1.2, 2.0, 0.5]])
    valid = torch.ones(1, 4, dtype=torch.bool)
    perms = torch.tensor(list(itertools.permutations(range(4))))[None]  # (1, 24, 4)
    total = plackett_luce_logprob(scores, perms, valid).exp().sum()
    assert float(total) == pytest.approx(1.0, abs=1e-5)


def test_rloo_gradient_raises_the_score_of_the_useful_token():
    # token 0 holds all the future attention: descending the loss must raise its score over the others
    scores = torch.zeros(1, 4, requires_grad=True)
    utility = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    valid = torch.ones(1, 4, dtype=torch.bool)
    loss, _ = rloo_loss(scores, utility, valid, k=256, generator=torch.Generator().manual_seed(0))
    loss.backward()
    grad = scores.grad[0]
    assert grad[0] < 0  # gradient descent increases s_0
    assert (grad[1:] > 0).all()


def test_rloo_ignores_tokens_outside_the_ranking():
    scores = torch.zeros(1, 5, requires_grad=True)
    utility = torch.tensor([[0.0, 1.0, 0.0, 5.0, 0.0]])
    valid = torch.tensor([[True, True, True, False, False]])  # e.g. recent-window tokens
    loss, reward = rloo_loss(scores, utility, valid, k=64, generator=torch.Generator().manual_seed(1))
    loss.backward()
    assert torch.all(scores.grad[0, 3:] == 0)
    assert float(reward) <= -1.0


# ------------------------------------------------------------------------------------------------
# the agents


def _perturbed(agents: KVPAgents) -> KVPAgents:
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for p in agents.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return agents


def test_agents_match_the_kernel_reference_layout():
    from mm_oval.kernels.kvp.naive import kvp_score_naive

    agents = _perturbed(KVPAgents(KVPAgentConfig(num_layers=2, num_kv_heads=2, head_dim=32)))
    k, v = torch.randn(2, 2, 30, 32), torch.randn(2, 2, 30, 32)
    pos = torch.arange(30)[None].expand(2, 30)
    mod = torch.full((2, 30), TEXT)
    rc = torch.full((2, 30, 3), -1)
    ours = agents.score_layer(1, k, v, pos, mod, rc)  # grad enabled: the module's autograd path
    ref = kvp_score_naive(k, v, pos, agents.layer_weights(1), extra_features(pos, mod, rc, EXTRA_FEATURES))
    assert torch.allclose(ours, ref, atol=1e-4)


def test_inference_position_table_equals_the_training_path_and_follows_weight_updates():
    """At inference the position term is looked up from a per-weights table; it must equal the path
    training differentiates, and a weight update must not leave a stale table behind."""
    agents = _perturbed(KVPAgents(KVPAgentConfig(num_layers=2, num_kv_heads=2, head_dim=16)))
    k, v = torch.randn(1, 2, 20, 16), torch.randn(1, 2, 20, 16)
    pos = torch.arange(3, 23)[None]
    mod, rc = torch.full((1, 20), TEXT), torch.full((1, 20, 3), -1)
    with torch.no_grad():
        looked_up = agents.score_layer(1, k, v, pos, mod, rc)
    trained = agents.score_layer(1, k, v, pos, mod, rc)  # grad enabled: the differentiable path
    assert trained.requires_grad
    torch.testing.assert_close(looked_up, trained.detach(), atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        agents.pos_emb.add_(torch.randn_like(agents.pos_emb))  # an optimiser step, in place
        after = agents.score_layer(1, k, v, pos, mod, rc)
    torch.testing.assert_close(
        after, agents.score_layer(1, k, v, pos, mod, rc).detach(), atol=1e-5, rtol=1e-5
    )
    assert not torch.allclose(after, looked_up)


def test_modality_and_grid_features_change_scores_only_when_enabled():
    k, v = torch.randn(1, 2, 10, 16), torch.randn(1, 2, 10, 16)
    pos = torch.arange(10)[None]
    rc = torch.full((1, 10, 3), -1)
    rc[0, 2:8] = torch.tensor([[0, r, c] for r in range(2) for c in range(3)])
    text = torch.full((1, 10), TEXT)
    img = text.clone()
    img[0, 2:8] = IMAGE
    for feats, differs in (((), False), (("modality", "grid"), True)):
        a = _perturbed(
            KVPAgents(KVPAgentConfig(num_layers=1, num_kv_heads=2, head_dim=16, extra_features=feats))
        )
        s_text = a.score_layer(0, k, v, pos, text, torch.full_like(rc, -1))
        s_img = a.score_layer(0, k, v, pos, img, rc)
        assert (not torch.allclose(s_text, s_img)) == differs


def test_shared_agent_scores_every_head_with_the_same_weights():
    a = _perturbed(KVPAgents(KVPAgentConfig(num_layers=2, num_kv_heads=2, head_dim=16, shared=True)))
    assert a.wk.shape[0] == 1
    kv = torch.randn(1, 1, 12, 16).expand(1, 2, 12, 16)
    pos = torch.arange(12)[None]
    mod, rc = torch.full((1, 12), TEXT), torch.full((1, 12, 3), -1)
    s0, s1 = a.score_layer(0, kv, kv, pos, mod, rc), a.score_layer(1, kv, kv, pos, mod, rc)
    assert torch.allclose(s0[:, 0], s0[:, 1]) and torch.allclose(s0, s1)


def test_policy_is_registered_and_returns_per_head_normalised_scores(tmp_path):
    cfg = KVPAgentConfig(num_layers=1, num_kv_heads=2, head_dim=16)
    agents = _perturbed(KVPAgents(cfg))
    policy = EVICTION_REGISTRY["kvp"](agents=agents)
    assert isinstance(policy, KVPPolicy)
    mod = torch.full((2, 9), TEXT)
    mod[1, :3] = PAD  # left padding
    ctx = PrefillContext(
        layer_idx=0,
        keys=torch.randn(2, 2, 9, 16),
        values=torch.randn(2, 2, 9, 16),
        queries=None,
        positions=torch.tensor([list(range(9)), [-1, -1, -1, *range(6)]]),
        modality=mod,
        image_rc=torch.full((2, 9, 3), -1),
        scaling=0.25,
    )
    s = policy.score(ctx)
    assert s.shape == (2, 2, 9)
    assert torch.isinf(s[1, :, :3]).all() and torch.isfinite(s[1, :, 3:]).all()
    assert torch.allclose(torch.logsumexp(s, dim=-1), torch.zeros(2, 2), atol=1e-5)
    raw = policy.raw_scores(ctx)
    assert torch.equal(s[0].argsort(-1), raw[0].argsort(-1))
    # decode tokens are scored on the prefill's scale
    new = policy.score_tokens(
        0, ctx.keys[:, :, -1:], ctx.values[:, :, -1:], ctx.positions[:, -1:], mod[:, -1:], request=ctx.request
    )
    assert new.shape == (2, 2, 1)


# ------------------------------------------------------------------------------------------------
# traces


def test_capture_records_the_cached_keys_and_the_answer_attention(tiny_random_llava):
    model, processor = tiny_random_llava
    sample = toy_samples(1, seed=5)[0]
    tr = capture_sample(model, processor, sample)
    L, Hkv, n, D = tr["keys"].shape
    assert (L, Hkv, D) == (4, 2, 32) and tr["queries"].shape == (4, 4, n, 32)
    assert int((tr["modality"] == IMAGE).sum()) == 64
    img = tr["image_rc"][tr["modality"] == IMAGE].long()
    assert img[:, 1:].max() == 7 and img[9].tolist() == [0, 1, 1]
    # the keys are what a plain prefill caches
    from mm_oval.training.traces import _conversation, _tokenise

    prompt = processor.apply_chat_template(_conversation(sample, None), add_generation_prompt=True)
    inputs = _tokenise(processor, sample, prompt)
    cache = model(**inputs, use_cache=True).past_key_values
    assert torch.allclose(tr["keys"][2].float(), cache.layers[2].keys[0].float(), atol=2e-3)
    # utility = attention from the answer tokens, summed, max over the group's query heads (eager check)
    conv = processor.apply_chat_template(_conversation(sample, sample.answer))
    full = _tokenise(processor, sample, conv)
    full["input_ids"] = full["input_ids"][:, :-1]  # the final </s> is never fed back
    full["attention_mask"] = full["attention_mask"][:, :-1]
    model.set_attn_implementation("eager")
    try:
        att = model(**full, output_attentions=True).attentions
    finally:
        model.set_attn_implementation("sdpa")
    for layer in (0, 3):
        a = att[layer][0, :, n:, :n].sum(1)  # (Hq, n)
        expect = a.view(Hkv, 2, n).amax(1)
        assert torch.allclose(tr["utility"][layer], expect, atol=1e-4)


def test_question_agnostic_capture_ends_the_prompt_at_the_image(tiny_random_llava):
    """compress='image': the trace's prompt is the template head and the image, as `eval --compress image`
    compresses it; the question's tokens are future queries, so their attention is part of the utility."""
    model, processor = tiny_random_llava
    sample = toy_samples(1, seed=5)[0]
    whole = capture_sample(model, processor, sample)
    qa = capture_sample(model, processor, sample, compress="image")
    img = (whole["modality"] == IMAGE).nonzero()
    n = int(img[-1]) + 1
    assert n < whole["keys"].shape[2] and qa["keys"].shape[2] == n and qa["utility"].shape[-1] == n
    assert qa["modality"][-1] == IMAGE and int((qa["modality"] == IMAGE).sum()) == 64
    assert torch.equal(qa["keys"], whole["keys"][:, :, :n])  # the same forward, cut at the image
    assert int(qa["future_len"]) == int(whole["future_len"]) + whole["keys"].shape[2] - n
    # more future queries, each attention non-negative: the utility grows, strictly for some token
    diff = qa["utility"] - whole["utility"][..., :n]
    assert bool((diff > -1e-5).all()) and float(diff.max()) > 1e-3
    with pytest.raises(ConfigError, match="compress must be one of"):
        capture_sample(model, processor, sample, compress="question")


def test_capture_resumes_after_an_interruption(tiny_random_llava, tmp_path):
    model, processor = tiny_random_llava
    samples = toy_samples(3, seed=1)
    seen = []

    def stop_after_three(i, n):
        seen.append(i)
        if i == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        capture_traces(
            model,
            processor,
            samples,
            tmp_path / "t",
            data_spec="toy",
            shard_size=2,
            progress=stop_after_three,
        )
    seen.clear()
    capture_traces(
        model,
        processor,
        samples,
        tmp_path / "t",
        data_spec="toy",
        shard_size=2,
        progress=lambda i, n: seen.append(i),
    )
    assert seen == [3]  # the first complete shard was not captured again
    resumed = list(iter_traces(tmp_path / "t"))
    capture_traces(model, processor, samples, tmp_path / "once", data_spec="toy", shard_size=2)
    once = list(iter_traces(tmp_path / "once"))
    assert [t["sample_id"] for t in resumed] == [s.sample_id for s in samples]
    for a, b in zip(resumed, once):
        assert torch.equal(a["keys"], b["keys"]) and torch.equal(a["utility"], b["utility"])
    with pytest.raises(ResultsError, match="another capture"):
        capture_traces(model, processor, samples, tmp_path / "t", data_spec="other data", shard_size=2)


def test_jsonl_data_errors_name_the_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(
        json.dumps({"question": "q", "answer": "a", "image": "x.png"})
        + "\n"
        + json.dumps({"question": "q"})
        + "\n"
    )
    with pytest.raises(DataError, match="line 1"):  # x.png is neither a file nor base64
        load_samples(str(p))
    p.write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(DataError, match=r"line 1: field 'answer'"):
        load_samples(str(p))


# ------------------------------------------------------------------------------------------------
# training, resume, the trained agents


@pytest.fixture(scope="module")
def random_model_traces(tiny_random_llava, tmp_path_factory):
    """Traces of the tiny random model on zoo prompts (one follow-up question each)."""
    model, processor = tiny_random_llava
    d = tmp_path_factory.mktemp("kvp_traces")
    train = load_samples("zoo:train:24", followups=1)
    held = load_samples("zoo:heldout:8", followups=1)
    capture_traces(model, processor, train, d / "train", shard_size=20, store_queries=False)
    capture_traces(model, processor, held, d / "held", shard_size=20, store_queries=False)
    return list(iter_traces(d / "train")), list(iter_traces(d / "held"))


def _cfg(**kw):
    return KVPAgentConfig(
        num_layers=4, num_kv_heads=2, head_dim=32, proj=32, hidden=32, pos_table=256, grid_side=8, **kw
    )


def test_training_resumes_to_the_same_weights(random_model_traces, tmp_path):
    train, _ = random_model_traces
    cfg = KVPTrainConfig(steps=6, batch_samples=4, rankings=4, warmup=2, checkpoint_every=2)
    whole = train_agents(train, _cfg(), cfg, out_dir=tmp_path / "a")

    def stop(step, rec):
        if step == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_agents(train, _cfg(), cfg, out_dir=tmp_path / "b", progress=stop)
    resumed = train_agents(train, _cfg(), cfg, out_dir=tmp_path / "b")
    for (name, p), q in zip(whole.agents.named_parameters(), resumed.agents.parameters()):
        assert torch.equal(p, q), name
    with pytest.raises(ResultsError, match="other settings"):
        train_agents(train, _cfg(), KVPTrainConfig(steps=7, batch_samples=4), out_dir=tmp_path / "b")


def test_trained_agents_beat_random_on_heldout_traces(random_model_traces):
    train, held = random_model_traces
    res = train_agents(
        train, _cfg(), KVPTrainConfig(steps=40, batch_samples=8, rankings=8, warmup=5, lr=3e-3)
    )
    kvp = heldout_cost(agent_scorer(res.agents), held, 4, 16)
    rnd = heldout_cost(random_scorer(0), held, 4, 16)
    opt = heldout_cost(oracle_scorer, held, 4, 16)
    assert opt.cost == pytest.approx(1.0)
    assert 1.0 <= kvp.cost < rnd.cost
    assert kvp.evicted[0.25] < rnd.evicted[0.25]


def test_agents_for_another_model_are_a_clear_error(tiny_random_llava, tmp_path):
    from mm_oval.zoo.model import TinyLlavaSizes, build_tiny_llava

    model, _ = tiny_random_llava
    sig = model_signature(model)
    save_agents(KVPAgents(_cfg()), tmp_path, sig, {"note": "test"})
    loaded = load_agents(tmp_path)
    assert loaded.model["fingerprint"] == sig["fingerprint"]
    KVPPolicy(agents=tmp_path, model=model)  # the right model: fine
    other_weights, _ = build_tiny_llava(seed=7)
    with pytest.raises(ModelError, match="fingerprint"):
        KVPPolicy(agents=tmp_path, model=other_weights)
    other_shape, _ = build_tiny_llava(seed=0, sizes=TinyLlavaSizes(text_kv_heads=4))
    with pytest.raises(ModelError, match="shape"):
        KVPPolicy(agents=tmp_path, model=other_shape)
    # without `model`, the first prefill of a layer checks the layer's own weights
    policy = KVPPolicy(agents=tmp_path)
    attn = other_weights.model.language_model.layers[0].self_attn
    ctx = PrefillContext(
        layer_idx=0,
        keys=torch.randn(1, 2, 8, 32),
        values=torch.randn(1, 2, 8, 32),
        queries=None,
        positions=torch.arange(8)[None],
        modality=torch.zeros(1, 8, dtype=torch.long),
        image_rc=torch.full((1, 8, 3), -1),
        scaling=32**-0.5,
        module=attn,
    )
    with pytest.raises(ModelError, match="train-kvp"):
        policy.score(ctx)
    with pytest.raises(ModelError, match="no KVP agents"):
        load_agents(tmp_path / "missing")


def test_train_kvp_command_smoke_run(tiny_random_llava, tmp_path, capsys):
    from mm_oval.cli import main

    model, processor = tiny_random_llava
    model.save_pretrained(tmp_path / "m")
    processor.save_pretrained(tmp_path / "m")
    out = tmp_path / "run"
    argv = ["train-kvp", "--model", str(tmp_path / "m"), "--data", "zoo:train:4", "--heldout-samples", "2"]
    argv += ["--out", str(out), "--steps", "2", "--batch", "4", "--device", "cpu"]
    assert main(argv) == 0
    loaded = load_agents(out)
    assert loaded.training["train_samples"] == 4 and loaded.training["heldout_samples"] == 2
    table = json.loads((out / "heldout.json").read_text())
    assert table["optimal"]["cost"] == pytest.approx(1.0)
    assert set(table) >= {"kvp", "random", "streamingllm", "knorm", "keydiff"}
    assert main(argv) == 0  # everything resumes: nothing is captured or trained twice
    assert not KVPPolicy(agents=out).selection.active
    # a selection over the scores is recorded beside the same agents (no weight changes) and read back
    assert main([*argv, "--redundancy", "2", "--sigma", "3"]) == 0
    assert load_agents(out).selection == {"redundancy": 2.0, "sigma": 3.0}
    assert (KVPPolicy(agents=out).selection.redundancy, KVPPolicy(agents=out).selection.sigma) == (2.0, 3.0)
    assert main([*argv, "--redundancy", "-1"]) != 0
    assert "redundancy must be a number >= 0" in capsys.readouterr().err


def test_the_pipeline_is_a_library_call_and_its_baselines_are_the_registered_policies(
    tiny_random_llava, tmp_path
):
    from mm_oval.policies.base import make_eviction
    from mm_oval.training.kvp import HELDOUT_BASELINES, PipelineConfig, heldout_table, policy_scorer, train
    from mm_oval.training.traces import load_traces

    model, processor = tiny_random_llava
    cfg = PipelineConfig(data="zoo:train:4", heldout_samples=2, store_queries=False)
    result = train(model, processor, tmp_path, cfg, KVPTrainConfig(steps=2, batch_samples=4))
    assert json.loads((tmp_path / "heldout.json").read_text()) == json.loads(json.dumps(result.heldout))
    assert load_agents(tmp_path).training["heldout_cost"]["kvp"] == result.heldout["kvp"]["cost"]
    held = load_traces([tmp_path / "traces" / "heldout"])
    assert set(result.heldout) == {"kvp", *HELDOUT_BASELINES, "optimal"}
    for name in HELDOUT_BASELINES:
        policy = make_eviction(name, **({"seed": cfg.seed} if name == "random" else {}))
        expect = heldout_cost(policy_scorer(policy), held, cfg.sinks, cfg.recent)
        assert result.heldout[name]["cost"] == pytest.approx(expect.cost, abs=0, rel=1e-12), name
    again = heldout_table(result.agents, held, cfg.seed)
    assert again["keydiff"] == result.heldout["keydiff"]


def test_keydiff_on_traces_is_the_policy_with_its_padding_mask():
    from mm_oval.training.kvp import keydiff_scorer, trace_context

    g = torch.Generator().manual_seed(0)
    n = 6
    trace = {
        "keys": torch.randn(1, 2, n, 8, generator=g),
        "values": torch.randn(1, 2, n, 8, generator=g),
        "utility": torch.rand(1, 2, n, generator=g),
        "positions": torch.arange(n),
        "modality": torch.tensor([TEXT, IMAGE, IMAGE, IMAGE, PAD, PAD]),
        "image_rc": torch.full((n, 3), -1),
    }
    scores = keydiff_scorer(trace, 0)
    # the anchor is the mean direction of the valid keys only: padded keys do not move it
    k = torch.nn.functional.normalize(trace["keys"][0, :, :4], dim=-1)
    anchor = torch.nn.functional.normalize(k.mean(1, keepdim=True), dim=-1)
    assert torch.allclose(scores[:, :4], -(k * anchor).sum(-1), atol=1e-6)
    assert trace_context(trace, 0).valid[0].tolist() == [True] * 4 + [False] * 2


def test_joint_heads_training_ranks_a_layers_heads_together_and_the_policy_keeps_its_scale():
    from mm_oval.training.kvp import TraceBatch, contexts

    L, H, B, N = 2, 2, 3, 5
    cfg = KVPAgentConfig(num_layers=L, num_kv_heads=H, head_dim=8, joint_heads=True)
    scores = torch.arange(L * H * B * N, dtype=torch.float).reshape(L * H, B, N)
    batch = TraceBatch(
        keys=torch.zeros(0),
        values=torch.zeros(0),
        positions=torch.zeros(0),
        extra=None,
        utility=scores.clone(),
        eligible=torch.ones(B, N, dtype=torch.bool),
        modality=torch.zeros(B, N),
    )
    s, u, v = contexts(scores, batch, cfg)
    assert s.shape == (L * B, H * N) and torch.equal(s, u) and v.all()
    # context (layer 1, sample 2) holds head 0 then head 1 of that layer and sample
    expect = torch.cat([scores[1 * H + 0, 2], scores[1 * H + 1, 2]])
    assert torch.equal(s[1 * B + 2], expect)
    agents = _perturbed(
        KVPAgents(KVPAgentConfig(num_layers=1, num_kv_heads=2, head_dim=16, joint_heads=True))
    )
    ctx = PrefillContext(
        layer_idx=0,
        keys=torch.randn(1, 2, 6, 16),
        values=torch.randn(1, 2, 6, 16),
        queries=None,
        positions=torch.arange(6)[None],
        modality=torch.full((1, 6), TEXT),
        image_rc=torch.full((1, 6, 3), -1),
        scaling=0.25,
    )
    policy = KVPPolicy(agents=agents)
    assert torch.equal(policy.score(ctx), policy.raw_scores(ctx))
