"""Router v2: an untrained one selects exactly what its base scorer selects, its weights load only for their
model, training on captured full attention lowers the loss, its summary bytes count its own page record, and predict-ahead hits every page when the query stays."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import mm_oval
from mm_oval.errors import ConfigError, ModelError
from mm_oval.policies.base import (
    IMAGE,
    TEXT,
    DecodeContext,
    PageBatch,
    RequestState,
    SharedHeads,
    StepState,
    make_retrieval,
    select_by_score,
)
from mm_oval.policies.page_summaries import quantize_int8
from mm_oval.policies.router import pool_page_content
from mm_oval.policies.router2 import (
    Router2Config,
    Router2Net,
    Router2Retrieval,
    load_router2,
    on_base_scale,
    pool_token_embeddings,
    predict_ahead_hit_rate,
    save_router2,
)
from mm_oval.stats import get_stats
from mm_oval.training.router import (
    Train2Options,
    capture_router2_data,
    evaluate_router2,
    load_router2_capture,
    new_router2,
    pca_page_init2,
    save_router2_capture,
    train_router2,
    zoo_prompts,
)
from mm_oval.wrapper import wrap_info

pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs(processor, prompt):
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt.text}]}]
    chat = processor.apply_chat_template(msgs, add_generation_prompt=True)
    return processor(images=[prompt.image], text=[chat], return_tensors="pt")


def _run(model, inputs, name, options, new_tokens=5, **budget):
    """Generate with retrieval `name`; (model, output ids, the chosen pages of every select call, bytes read
    per step, the policy)."""
    wrapped = mm_oval.wrap(model, retrieval=name, retrieval_options=options, **budget)
    policy = wrap_info(wrapped).retrieval
    seen = []
    inner = policy.select

    def select(ctx, b):
        out = inner(ctx, b)
        seen.append(out.clone())
        return out

    policy.select = select
    try:
        out = wrapped.generate(
            **inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
        )
        read = get_stats(wrapped)["bytes_read"]["per_step"]
    finally:
        model = mm_oval.unwrap(wrapped)
    return model, out, seen, read, policy


def _randomise_correction(net: Router2Net, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


@pytest.mark.parametrize("base", ["quest", "oval"])
@pytest.mark.parametrize("budget", [{"read_budget": 0.25}, {"read_bytes_budget": 0.5}])
def test_an_untrained_router2_selects_exactly_what_its_base_scorer_selects(tiny_random_llava, base, budget):
    model, processor = tiny_random_llava
    net = new_router2(model, base=base, locality=True, gcn=True)  # every part on: each starts at exactly zero
    prompts = zoo_prompts(2, seed=3)
    for prompt in prompts:
        inputs = _inputs(processor, prompt)
        model, out_b, seen_b, _, _ = _run(model, inputs, base, {}, **budget)
        model, out_r, seen_r, _, _ = _run(
            model, inputs, "router2", {"net": net, "skip_zero": False}, **budget
        )
        assert torch.equal(out_b, out_r)
        assert len(seen_b) == len(seen_r) > 0
        assert all(torch.equal(a, b) for a, b in zip(seen_b, seen_r))
        assert any(bool((~a).any()) for a in seen_b)  # the budget left pages out: the choice was real
    # a router whose correction is not zero chooses otherwise somewhere (the test above can fail)
    _randomise_correction(net)
    inputs = _inputs(processor, prompts[0])
    model, _, seen_b, _, _ = _run(model, inputs, base, {}, 3, read_budget=0.25)
    model, _, seen_r, _, _ = _run(model, inputs, "router2", {"net": net}, 3, read_budget=0.25)
    assert len(seen_b) == len(seen_r) > 0
    assert any(not torch.equal(a, b) for a, b in zip(seen_b, seen_r))


def test_save_load_round_trip_and_weights_for_another_model_are_refused(tiny_random_llava, tmp_path):
    from mm_oval.zoo.model import build_tiny_llava

    model, _ = tiny_random_llava
    net = new_router2(model, base="oval", route_dim=8, locality=False)
    _randomise_correction(net, 1)
    d = save_router2(net, tmp_path / "r2")
    back = load_router2(d, model)
    assert back.config == net.config
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), back.state_dict().values()))
    policy = make_retrieval("router2", weights=str(d))
    assert policy.base_name == "oval" and policy.net.config.route_dim == 8
    with pytest.raises(ConfigError, match="trained on base='oval'"):
        make_retrieval("router2", weights=str(d), base="quest")
    other, _ = build_tiny_llava(seed=1)  # same shapes, other weights
    with pytest.raises(ModelError, match="another model"):
        load_router2(d, other)
    with pytest.raises(ModelError, match="another model"):
        mm_oval.wrap(other, retrieval="router2", retrieval_options={"weights": str(d)}, read_budget=0.25)


def test_pages_pooled_at_decode_match_the_contents_training_captures():
    torch.manual_seed(0)
    net = Router2Net(Router2Config(hidden_size=24, num_layers=2, num_kv_heads=2, route_dim=8))
    _randomise_correction(net)
    x = torch.randn(1, 30, 24)
    idx = torch.randint(-1, 30, (1, 2, 7, 4))
    at_decode = pool_token_embeddings(net.token_embeddings(x), idx)  # (.., R): gathers route_dim entries only
    content, has = pool_page_content(F.layer_norm(x, (24,)), idx)  # what the capture records per page
    kind = torch.full((1, 2, 7), TEXT, dtype=torch.int8)
    in_training = net.page_embeddings(content, kind) - net.kind_emb(torch.zeros_like(kind).long())
    assert torch.allclose(at_decode[has], in_training[has], atol=1e-5)


def test_training_on_captured_attention_lowers_the_loss(tiny_random_llava, tmp_path):
    model, processor = tiny_random_llava
    base = make_retrieval("quest")
    samples = capture_router2_data(model, processor, zoo_prompts(6, seed=11), base, max_new_tokens=3)
    s = samples[0]
    assert s.mass.shape == s.base.shape == s.base_prev.shape
    assert s.mass.shape[1:3] == (model.config.text_config.num_hidden_layers, 2)
    assert torch.allclose(s.mass.sum(-1) <= 1 + 1e-5, torch.tensor(True))
    save_router2_capture(samples, tmp_path / "cap.safetensors")
    again = load_router2_capture(tmp_path / "cap.safetensors")
    assert all(
        torch.equal(a.base, b.base) and torch.equal(a.content, b.content) for a, b in zip(samples, again)
    )
    net = new_router2(model)
    pca_page_init2(net, samples)
    before = evaluate_router2(net, samples, 0.25)
    assert before["router2"] == pytest.approx(before["base"])  # zero correction: the base's pick
    history = train_router2(net, samples, None, Train2Options(epochs=8, lr=1e-2, batch=2))
    assert history[-1]["loss"] < history[0]["loss"]
    after = evaluate_router2(net, samples, 0.25)
    assert after["base"] == before["base"] and after["router2"] != before["router2"]  # the correction moved


def test_summary_bytes_count_the_router_record(tiny_random_llava):
    model, processor = tiny_random_llava
    net = new_router2(model, route_dim=16)
    inputs = _inputs(processor, zoo_prompts(1, seed=5)[0])
    model, _, _, quest, _ = _run(model, inputs, "quest", {}, 3, read_budget=0.25)
    opts = {"net": net, "skip_zero": False}
    model, _, _, router2, policy = _run(model, inputs, "router2", opts, 3, read_budget=0.25)
    assert router2["selected"] == quest["selected"]  # the same pages (zero correction)
    kmin = torch.zeros(1, 2, 3, 32)
    page_len = torch.full((1, 2, 3), 4)
    sums = {"kmin": kmin, "kmax": kmin, "r2_emb": torch.zeros(1, 2, 3, 16)}
    quest_bytes = make_retrieval("quest").summary_bytes({"kmin": kmin, "kmax": kmin}, page_len)
    assert torch.equal(policy.summary_bytes(sums, page_len), quest_bytes + 16 * 4)
    # per step, the router reads 16 fp32 entries more per candidate page, layer and KV head
    text = model.config.text_config
    per_page_quest = 2 * text.head_dim * 4
    pages = quest["summaries"] / per_page_quest
    assert router2["summaries"] == pytest.approx(quest["summaries"] + pages * 64)
    # a correction that is exactly zero is dropped by default: the base alone, no record read
    model, _, _, zero, policy = _run(model, inputs, "router2", {"net": net}, 3, read_budget=0.25)
    assert policy.net is None and zero == quest


def _ctx(query, summaries, p=6):
    page_len = torch.full((1, 2, p), 4)
    kind = torch.full((1, 2, p), IMAGE, dtype=torch.int8)
    return DecodeContext(
        layer_idx=0,
        query=query,
        summaries=summaries,
        page_start=torch.arange(p).mul(4).expand(1, 2, p),
        page_len=page_len,
        page_kind=kind,
        candidates=torch.ones(1, 2, p, dtype=torch.bool),
        scaling=0.25,
        step=StepState(last_hidden=torch.randn(1, 24)),
    )


def test_predict_ahead_hits_every_page_when_the_query_stays_and_uses_the_previous_query():
    torch.manual_seed(0)
    keys = torch.randn(1, 2, 6, 4, 16)
    token_index = torch.arange(24).view(1, 1, 6, 4).expand(1, 2, 6, 4)
    batch = PageBatch(
        0, keys, keys, torch.ones(1, 2, 6, 4, dtype=torch.bool), torch.full((1, 2, 6), IMAGE, dtype=torch.int8), 0,
        token_index=token_index, request=RequestState(inputs_embeds=torch.randn(1, 24, 24)),
    )  # fmt: skip
    net = Router2Net(Router2Config(hidden_size=24, num_layers=1, num_kv_heads=2, route_dim=8))
    for policy in (make_retrieval("quest"), Router2Retrieval(weights="none"), Router2Retrieval(net=net)):
        sums = policy.summarize(batch)
        if "r2_emb" in sums:
            sums["r2_emb"] = torch.randn(1, 2, 6, 8)
        q = torch.randn(1, 4, 1, 16)
        ctx = _ctx(q, sums)
        assert torch.equal(predict_ahead_hit_rate(policy, ctx, q, 0.34), torch.ones(1, 2, dtype=torch.double))
        rates = [predict_ahead_hit_rate(policy, ctx, torch.randn(1, 4, 1, 16), 0.34) for _ in range(8)]
        assert min(float(r.min()) for r in rates) < 1.0  # another query moves the pick somewhere
    ahead = Router2Retrieval(weights="none", predict_ahead="step")
    exact = Router2Retrieval(weights="none")
    sums = ahead.summarize(batch)
    q1, q2 = torch.randn(1, 4, 1, 16), torch.randn(1, 4, 1, 16)
    first = _ctx(q1, sums)
    assert torch.equal(ahead.score_pages(first), exact.score_pages(first))  # no previous step: its own query
    second = dataclasses.replace(first, query=q2)  # the same request (StepState), the next step
    assert torch.equal(ahead.score_pages(second), exact.score_pages(first))
    other_request = dataclasses.replace(first, query=q2, step=StepState(), request=RequestState())
    assert torch.equal(ahead.score_pages(other_request), exact.score_pages(other_request))


def test_layer_ahead_scores_each_layer_with_the_query_of_the_layer_before_in_the_same_step():
    """predict_ahead="layer": layer l's pages come from layer l-1's query of this step (so they can be
    fetched while layer l-1 runs); layer 0, and a layer whose predecessor did not run in this step, use
    their own query; a bad mode is refused by name."""
    torch.manual_seed(1)
    keys = torch.randn(1, 2, 6, 4, 16)
    batch = PageBatch(
        0, keys, keys, torch.ones(1, 2, 6, 4, dtype=torch.bool), torch.full((1, 2, 6), IMAGE, dtype=torch.int8), 0
    )  # fmt: skip
    ahead = Router2Retrieval(weights="none", predict_ahead="layer")
    exact = Router2Retrieval(weights="none")
    sums = ahead.summarize(batch)
    q0, q1, q2 = (torch.randn(1, 4, 1, 16) for _ in range(3))
    layer0 = _ctx(q0, sums)
    layer1 = dataclasses.replace(layer0, layer_idx=1, query=q1)
    layer2 = dataclasses.replace(layer0, layer_idx=2, query=q2)
    assert torch.equal(ahead.score_pages(layer0), exact.score_pages(layer0))  # layer 0: its own query
    assert torch.equal(ahead.score_pages(layer1), exact.score_pages(layer0))  # layer 1: layer 0's
    assert torch.equal(ahead.score_pages(layer2), exact.score_pages(layer1))  # layer 2: layer 1's
    assert not torch.equal(exact.score_pages(layer1), exact.score_pages(layer0))  # the queries differ
    # the next step starts again at layer 0 with its own query; layer 2 right after it has no layer 1 yet
    assert torch.equal(ahead.score_pages(layer0), exact.score_pages(layer0))
    assert torch.equal(ahead.score_pages(layer2), exact.score_pages(layer2))
    other_request = dataclasses.replace(layer1, step=StepState(), request=RequestState())  # another request
    assert torch.equal(ahead.score_pages(other_request), exact.score_pages(other_request))
    with pytest.raises(ConfigError, match="'off', 'step' or 'layer'"):
        Router2Retrieval(weights="none", predict_ahead="ahead")


def test_training_keeps_the_held_out_best_which_never_selects_worse_than_the_base(tiny_random_llava):
    model, processor = tiny_random_llava
    base = make_retrieval("quest")
    train = capture_router2_data(model, processor, zoo_prompts(4, seed=21), base, max_new_tokens=2)
    val = capture_router2_data(model, processor, zoo_prompts(3, seed=22), base, max_new_tokens=2)
    net = new_router2(model)
    pca_page_init2(net, train)
    budgets = (0.10, 0.25)
    start = [evaluate_router2(net, val, b)["base"] for b in budgets]
    history = train_router2(net, train, val, Train2Options(epochs=3, lr=3e-2, batch=2, read_budgets=budgets))
    end = [evaluate_router2(net, val, b)["router2"] for b in budgets]
    assert sum(end) >= sum(start) - 1e-9
    assert len(history) == 3 and all("kept" in row for row in history)


def test_the_bundled_router2_serves_the_576_token_model_only(tiny_random_llava):
    from transformers import LlavaForConditionalGeneration

    from mm_oval.policies.router2 import bundled_router2_path
    from mm_oval.zoo import bundled576_model_path

    net = load_router2(bundled_router2_path())
    assert net.config.base == "quest" and net.config.route_dim == 16
    model576 = LlavaForConditionalGeneration.from_pretrained(bundled576_model_path()).eval()
    Router2Retrieval(model=model576)  # checks against the model it was trained for: no error
    with pytest.raises(ModelError, match="another model"):
        mm_oval.wrap(tiny_random_llava[0], retrieval="router2", read_budget=0.25)  # the default weights
    compact = load_router2(bundled_router2_path("bundled576-quest4c"))  # over compact Quest on 4x4 tiles
    assert compact.config.base == "quest" and compact.config.base_options == {"summary_format": "compact"}
    Router2Retrieval(weights="bundled576-quest4c", model=model576)
    oval = load_router2(bundled_router2_path("bundled576-oval4c"))  # over compact OVAL on 4x4 tiles
    assert oval.config.base == "oval" and oval.config.base_options == {"summary_format": "compact"}
    Router2Retrieval(weights="bundled576-oval4c", model=model576)
    with pytest.raises(ConfigError, match="unknown bundled weights 'bundled576-nope'; known: bundled576, "):
        bundled_router2_path("bundled576-nope")


def test_train_router_version_2_saves_each_epoch_resumes_and_serves(tiny_random_llava_dir, tmp_path):
    import json

    from mm_oval.cli import main

    out = tmp_path / "r2"
    argv = ["train-router", "--version", "2", "--model", str(tiny_random_llava_dir), "--out", str(out)]
    argv += ["--data", "zoo:3", "--val", "zoo:2", "--max-new-tokens", "2", "--batch", "4", "--threads", "1"]
    assert main([*argv, "--epochs", "1"]) == 0
    assert (out / "capture_train.safetensors").is_file() and (out / "capture_val.safetensors").is_file()
    assert len(json.loads((out / "history.json").read_text())["history"]) == 1
    assert main([*argv, "--epochs", "2", "--resume"]) == 0  # reuses the captures, runs epoch 2 only
    assert [r["epoch"] for r in json.loads((out / "history.json").read_text())["history"]] == [1, 2]
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(tiny_random_llava_dir).eval()
    mm_oval.wrap(model, retrieval="router2", retrieval_options={"weights": str(out)}, read_budget=0.25)
    mm_oval.unwrap(model)
    assert main([*argv, "--base-options", "[1]"]) == 2  # a user error: one line, exit status 2


def test_train_router_version_2_refuses_a_capture_made_with_other_pinned_tokens(
    tiny_random_llava_dir, tmp_path, capsys
):
    """The captures in --out are reused only for the options they were made with: captured with 4 sinks,
    a run for 0 sinks (another set of candidate pages) is refused, naming the option, before it trains."""
    import json

    from mm_oval.cli import main

    out = tmp_path / "r2"
    argv = ["train-router", "--version", "2", "--model", str(tiny_random_llava_dir), "--out", str(out)]
    argv += ["--data", "zoo:2", "--val", "", "--max-new-tokens", "2", "--batch", "4", "--threads", "1"]
    assert main([*argv, "--epochs", "1"]) == 0
    made = json.loads((out / "history.json").read_text())
    assert main([*argv, "--epochs", "2", "--resume", "--sink-tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert (
        "capture_train.safetensors was captured with other options" in err
        and "sink_tokens: 4 there, 0 now" in err
    )
    assert json.loads((out / "history.json").read_text()) == made  # nothing trained
    assert main([*argv, "--recent-tokens", "-1"]) == 2


def test_pinned_tokens_while_capturing_decide_which_image_pages_are_candidates(tiny_random_llava):
    """Captured with no pinned tokens every image page is a candidate; with sinks reaching into the image
    (4 by default, more than the tokens before it) its first page is pinned, as the serving cache pins it."""
    model, processor = tiny_random_llava
    prompts = zoo_prompts(1, seed=11)
    cand = {}
    for sinks in (0, 64):
        (s,) = capture_router2_data(
            model, processor, prompts, make_retrieval("quest"), max_new_tokens=1, sink_tokens=sinks,
            recent_tokens=0,
        )  # fmt: skip
        cand[sinks] = s.candidate & (s.kind == IMAGE)
    images = int((s.kind == IMAGE).sum())
    assert int(cand[0].sum()) == images
    assert int(cand[64].sum()) < images and not bool(cand[64][(s.kind == IMAGE).nonzero()[0]])


def test_over_a_compact_base_the_router_record_is_int8_and_scores_what_the_float_record_scores(
    tiny_random_llava,
):
    """record_format 'auto' follows the base: over compact OVAL the page embedding is int8 with an fp16 scale
    per page (route_dim + 2 bytes, counted), and the correction it gives is the float record's to within
    the int8 rounding."""
    model, processor = tiny_random_llava
    net = new_router2(model, route_dim=16, base="oval", base_options={"summary_format": "compact"})
    _randomise_correction(net, seed=3)
    inputs = _inputs(processor, zoo_prompts(1, seed=7)[0])
    reads, policies = {}, {}
    for fmt in ("auto", "float"):
        opts = {"net": net, "record_format": fmt}
        model, _, _, reads[fmt], policies[fmt] = _run(model, inputs, "router2", opts, 3, read_budget=0.25)
    assert policies["auto"].record_format == "compact" and policies["float"].record_format == "float"
    assert reads["auto"]["summaries"] < reads["float"]["summaries"]
    # the same page embeddings in either record: the corrections agree to the rounding
    small = Router2Net(Router2Config(hidden_size=24, num_layers=1, num_kv_heads=2, route_dim=8))
    _randomise_correction(small, seed=4)
    emb = torch.randn(1, 2, 6, 8)
    q, scale = quantize_int8(emb, 1)
    kmin = torch.randn(1, 2, 6, 16)
    one = _ctx(torch.randn(1, 4, 1, 16), {"kmin": kmin, "kmax": kmin + 1.0})  # one query and hidden state
    ctxs = {}
    for fmt, record in (("float", {"r2_emb": emb}), ("compact", {"r2_emb_q": q, "r2_emb_scale": scale})):
        pol = Router2Retrieval(net=small, record_format=fmt)
        ctxs[fmt] = (pol, dataclasses.replace(one, summaries=one.summaries | record))
    base = ctxs["float"][0].base_scores(ctxs["float"][1])
    corr = {fmt: pol.score_pages(ctx) - base for fmt, (pol, ctx) in ctxs.items()}
    spread = float(corr["float"].max() - corr["float"].min())
    assert spread > 0 and float((corr["compact"] - corr["float"]).abs().max()) <= 0.02 * spread
    page_len = torch.full((1, 2, 3), 4)
    quest = Router2Retrieval(weights="none", base="quest", base_options={"summary_format": "compact"})
    assert quest.record_format == "compact"
    bounds = torch.zeros(1, 2, 3, 32, dtype=torch.int8)
    base = {"kmin_q": bounds, "kmax_q": bounds, "bound_scale": torch.zeros(1, 2, 3, dtype=torch.float16)}
    record = {"r2_emb_q": torch.zeros(1, 2, 3, 16, dtype=torch.int8), "r2_emb_scale": torch.zeros(1, 2, 3)}
    assert torch.equal(
        quest.summary_bytes(base | record, page_len), quest.base.summary_bytes(base, page_len) + 18
    )
    with pytest.raises(ConfigError, match="record_format must be"):
        Router2Retrieval(weights="none", record_format="int4")


def _small_router_and_step():
    """A router v2 over Quest with a random correction (2 KV heads) and one decode step of 6 candidate pages."""
    torch.manual_seed(0)
    small = Router2Net(Router2Config(hidden_size=24, num_layers=1, num_kv_heads=2, route_dim=8))
    _randomise_correction(small, seed=5)
    kmin = torch.randn(1, 2, 6, 16)
    ctx = _ctx(
        torch.randn(1, 4, 1, 16), {"kmin": kmin, "kmax": kmin + 1.0, "r2_emb": torch.randn(1, 2, 6, 8)}
    )
    return small, ctx


def test_below_min_read_pages_a_head_reads_what_its_base_chooses():
    small, ctx = _small_router_and_step()
    base = select_by_score(Router2Retrieval(weights="none").score_pages(ctx), ctx.candidates, 0.5)
    gated = {}
    for floor in (1, 3, 4):
        small.config.min_read_pages = floor
        gated[floor] = Router2Retrieval(net=small).select(ctx, 0.5)  # 3 of 6 pages per head
    assert not torch.equal(gated[1], base)  # the correction moves the choice ...
    assert torch.equal(gated[3], gated[1])  # ... where a head reads at least min_read_pages ...
    assert torch.equal(gated[4], base)  # ... and below it the base chooses


def test_min_read_pages_is_where_the_correction_stops_being_behind_on_held_out_prompts(monkeypatch):
    import mm_oval.training.router as tr

    class Sample:
        candidate = torch.ones(10, dtype=torch.bool)

    def fake(table):
        return lambda net, val, read_budget=0.25, read_pages=None: {"base": 0.5, "router2": table[read_pages]}

    cases = [
        ({1: 0.4, 2: 0.45, 3: 0.5, 4: 0.6, 5: 0.6}, 3),  # behind at 1-2 pages: the base below 3
        ({1: 0.6, 2: 0.6, 3: 0.6, 4: 0.4, 5: 0.6}, 5),  # behind at 4: only the reads above it
        ({k: 0.6 for k in range(1, 6)}, 1),  # never behind: always on
    ]
    for table, want in cases:
        monkeypatch.setattr(tr, "evaluate_router2", fake(table))
        floor, rows = tr.fit_min_read_pages(None, [Sample()], max_share=0.5)
        assert floor == want and [r["pages"] for r in rows] == [1, 2, 3, 4, 5]


def test_router2_scores_keep_its_ranking_per_head_on_its_base_scale_and_its_heads_may_share_a_budget():
    """The correction redistributes, over the candidate pages, the share of a head's attention the base
    estimates on them: each head ranks as the logits do (what it reads alone is unchanged), and the scores'
    mass over the candidates is the base's, so a layer's heads can share their read budget."""
    small, ctx = _small_router_and_step()
    base, logits = torch.randn(2, 3, 6), torch.randn(2, 3, 6) * 4
    cand = torch.rand(2, 3, 6) > 0.3
    cand[1, 2] = False  # a head without a candidate keeps its logits
    out = on_base_scale(base, logits, cand)
    shift = out - logits
    assert torch.allclose(shift, shift[..., :1].expand_as(shift))  # one shift per head: the same ranking
    lse = lambda t: torch.logsumexp(t.masked_fill(~cand, float("-inf")), -1)  # noqa: E731
    has = cand.any(-1)
    assert torch.allclose(lse(out)[has], lse(base)[has], atol=1e-5) and torch.equal(out[1, 2], logits[1, 2])
    policy = Router2Retrieval(net=small)
    alone = policy.select(ctx, 0.5)
    assert torch.equal(alone, select_by_score(policy.score_pages(ctx), ctx.candidates, 0.5))
    shared = policy.select(ctx, SharedHeads(0.5))
    assert shared.sum() == 6 and shared.sum(-1).tolist() != [[3, 3]]  # 3 pages a head, moved between them
    small.config.min_read_pages = 2
    with pytest.raises(ConfigError, match="min_read_pages=2"):
        Router2Retrieval(net=small).select(ctx, SharedHeads(0.5))
    assert mm_oval.OvalConfig(retrieval="router2", read_bytes_budget=0.25, read_head_budget="shared")
