"""What `get_stats(model)["bytes_read"]` says a decode step reads (summaries scanned, selected pages' KV,
always-read KV, against dense attention over the resident cache), checked against a count made from
the pages each selection saw; and the bytes budget that turns a fraction of dense bytes into pages."""

from __future__ import annotations

import json

import pytest
import torch
from mm_oval.eval.runner import summarize_kv
from mm_oval.eval.sweep import markdown_table

import mm_oval
from mm_oval.config import OvalConfig, budget_field
from mm_oval.errors import ConfigError
from mm_oval.policies.base import IMAGE, SharedHeads, select_by_score
from mm_oval.stats import get_stats
from mm_oval.wrapper import new_cache, wrap_info

pytestmark = pytest.mark.usefixtures("one_thread")

NEW_TOKENS = 4  # the prefill gives the first token: NEW_TOKENS - 1 decode steps
TEXTS = ["USER: <image>\nwhat color is the circle ? ASSISTANT:", "USER: <image>\nhow many ? ASSISTANT:"]


@pytest.fixture
def model(tiny_random_llava):
    model, _ = tiny_random_llava
    yield model
    mm_oval.unwrap(model)


def _run(model, inputs, **cfg):
    """Generate through the wrapped model; every selection the retrieval policy makes is logged."""
    mm_oval.wrap(model, **cfg)
    log = []
    policy = wrap_info(model).retrieval
    if policy is not None:
        select = policy.select

        def logged(ctx, budget):
            chosen = select(ctx, budget)
            log.append(
                {
                    "cand": ctx.candidates,
                    "chosen": chosen & ctx.candidates,
                    "plen": ctx.page_len,
                    "kind": ctx.page_kind,
                    "budget": budget,
                    "scores": policy.score_pages(ctx),
                    "summaries": ctx.summaries,
                }
            )
            return chosen

        policy.select = logged
    cache = new_cache(model)
    model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, cache=cache)
    return cache, log, get_stats(model)["bytes_read"]


def _dense(model, inputs, per_token):
    """Dense bytes of every decode step: all prompt tokens (nothing evicted) and the tokens fed so far."""
    t = model.config.text_config
    n_valid = inputs["attention_mask"].sum(-1)
    n_image = int((inputs["input_ids"] == model.config.image_token_index).sum())
    steps = range(1, NEW_TOKENS)
    per_layer = t.num_key_value_heads * per_token
    total = t.num_hidden_layers * per_layer * sum(int((n_valid + i).sum()) for i in steps)
    image = t.num_hidden_layers * per_layer * n_image * len(steps)
    return total, image


def _summary_bytes(name, plen, summaries):
    """Bytes of each page's summary that scoring reads: Quest two fp32 keys per page; OVAL the
    centroid, the rank-r basis and r coefficients per token of the page, in the summaries' dtype, or, for
    its compact record (the default), each stored tensor's bytes per page, with the coefficient rows of the
    page's own tokens only."""
    if name == "quest":
        d = summaries["kmin"].shape[-1]
        return torch.full_like(plen, 2 * d * 4)
    if "basis_q" in summaries:
        per_page = sum(
            summaries[k][0, 0, 0].numel() * summaries[k].element_size()
            for k in ("mu_q", "mu_scale", "basis_q", "basis_scale", "coef_scale")
        )
        r = summaries["coef_q"].shape[-1]
        return per_page + plen * r * summaries["coef_q"].element_size()
    d, r = summaries["basis"].shape[-2:]
    return (d + d * r + plen * r) * summaries["basis"].element_size()


def _expected(name, log, per_token, dense, dense_image):
    summ = sel = cand_kv = summ_image = 0
    for e in log:
        cand, plen = e["cand"], e["plen"]
        sb = _summary_bytes(name, plen, e["summaries"])
        summ += int(sb[cand].sum())
        summ_image += int(sb[cand & (e["kind"] == IMAGE)].sum())
        sel += int(plen[e["chosen"]].sum()) * per_token
        cand_kv += int(plen[cand].sum()) * per_token
    return {
        "summaries": summ,
        "selected": sel,
        "always_read": dense - cand_kv,
        "dense": dense,
        "image_summaries": summ_image,
    }


@pytest.mark.parametrize("name,options", [("quest", {}), ("oval", {}), ("oval", {"summary_format": "float"})])
def test_bytes_read_are_the_summaries_scanned_the_pages_selected_and_the_pages_always_read(
    model, llava_batch, name, options
):
    inputs = llava_batch(TEXTS)
    cache, log, br = _run(model, inputs, retrieval=name, read_budget=0.25, retrieval_options=options)
    per_token = 2 * cache.layers[0].keys.shape[-1] * cache.layers[0].keys.element_size()
    dense, dense_image = _dense(model, inputs, per_token)
    exp = _expected(name, log, per_token, dense, dense_image)
    total = br["total"]
    assert br["decode_steps"] == NEW_TOKENS - 1
    assert len(log) == (NEW_TOKENS - 1) * model.config.text_config.num_hidden_layers
    for k in ("summaries", "selected", "always_read", "dense"):
        assert total[k] == exp[k], k
    assert total["read"] == exp["summaries"] + exp["selected"] + exp["always_read"]
    assert br["read_vs_dense"] == pytest.approx(total["read"] / dense)
    assert 0 < total["selected"] < total["image"]["dense"]  # a quarter of the image pages, not all
    # by modality: every candidate is an image page (read_scope "image"); text is always read
    assert total["image"]["dense"] == dense_image and total["text"]["dense"] == dense - dense_image
    assert total["image"]["summaries"] == exp["image_summaries"] == total["summaries"]
    assert total["text"]["selected"] == 0 and total["text"]["always_read"] == dense - dense_image
    per_step = br["per_step"]
    assert per_step["read"] == pytest.approx(total["read"] / (NEW_TOKENS - 1))
    assert per_step["image"]["dense"] == pytest.approx(dense_image / (NEW_TOKENS - 1))
    json.dumps(br)


def test_full_attention_reads_exactly_dense(model, llava_batch):
    inputs = llava_batch(TEXTS)
    cache, _, br = _run(model, inputs)
    per_token = 2 * cache.layers[0].keys.shape[-1] * cache.layers[0].keys.element_size()
    dense, dense_image = _dense(model, inputs, per_token)
    total = br["total"]
    assert total["dense"] == total["read"] == total["always_read"] == dense
    assert total["summaries"] == total["selected"] == 0
    assert br["read_vs_dense"] == br["image_read_vs_dense"] == 1.0
    assert total["image"]["dense"] == dense_image


def test_a_read_budget_of_one_reads_dense_plus_the_summaries(model, llava_batch):
    """Reading every page reads dense attention's bytes and the summaries scanned on top: more than dense."""
    inputs = llava_batch(TEXTS)
    _, _, br = _run(model, inputs, retrieval="oval", read_budget=1.0)
    total = br["total"]
    assert total["selected"] + total["always_read"] == total["dense"]
    assert total["read"] == total["dense"] + total["summaries"]
    assert br["read_vs_dense"] > 1.0


def _rows(model, inputs, cache, log, name):
    """Each logged selection, per batch row: (the log entry, the row, its dense bytes at that decode step,
    each page's summary bytes, the KV bytes per token)."""
    per_token = 2 * cache.layers[0].keys.shape[-1] * cache.layers[0].keys.element_size()
    n_valid = inputs["attention_mask"].sum(-1)
    n_layers = model.config.text_config.num_hidden_layers
    for i, e in enumerate(log):
        step = i // n_layers + 1
        sb = _summary_bytes(name, e["plen"], e["summaries"])
        for b in range(e["cand"].shape[0]):
            yield e, b, int(n_valid[b] + step) * per_token, sb, per_token


def _fill(ranked, left):
    """The pages a bytes budget reads: `ranked` (-score, page, bytes), best first (ties: the lower page), read
    while their bytes fit `left`; the first that does not fit ends it. -> (pages, bytes used)."""
    expect, used = set(), 0
    for _, j, size in sorted(ranked):
        if used + size > left:
            break
        expect.add(j)
        used += size
    return expect, used


@pytest.mark.parametrize("fraction", [0.7, 0.9])
def test_a_bytes_budget_reads_the_best_pages_while_they_fit(model, llava_batch, fraction):
    inputs = llava_batch(TEXTS)
    # 2x2 tiles: on the tiny model's 8x8 grid a 4x4 page's KV outweighs what a budget leaves after the
    # always-read text and the summaries, so no page would be a choice
    cache, log, br = _run(model, inputs, retrieval="quest", read_bytes_budget=fraction, image_tile=2)
    some_read = False
    for e, b, dense, sb, per_token in _rows(model, inputs, cache, log, "quest"):
        cand, plen, chosen, scores = e["cand"], e["plen"], e["chosen"], e["scores"]
        for h in range(cand.shape[1]):
            c = cand[b, h]
            kv = plen[b, h] * per_token
            always = dense - int(kv[c].sum())
            left = fraction * dense - always - int(sb[b, h][c].sum())
            ranked = [(-float(scores[b, h, j]), j, int(kv[j])) for j in c.nonzero().flatten().tolist()]
            expect, _ = _fill(ranked, left)
            assert set(chosen[b, h].nonzero().flatten().tolist()) == expect
            read = always + int(sb[b, h][c].sum()) + int(kv[chosen[b, h]].sum())
            assert read <= fraction * dense
            some_read |= bool(expect)
    assert some_read and br["over_budget"] == 0
    assert br["read_vs_dense"] <= fraction


@pytest.mark.parametrize("name", ["quest", "oval"])
def test_a_shared_bytes_budget_reads_the_best_pages_of_any_head_within_the_heads_bytes(
    model, llava_batch, name
):
    """read_head_budget="shared": per sample and layer, one ranking of every KV head's pages, read best first
    while their bytes fit the heads' budgets summed; the layer reads no more than the heads would alone,
    and the heads no longer read as many pages each."""
    inputs = llava_batch(TEXTS)
    fraction = 0.7
    cache, log, br = _run(model, inputs, retrieval=name, read_bytes_budget=fraction, image_tile=2,
                          read_head_budget="shared")  # fmt: skip
    uneven = False
    for e, b, dense, sb, per_token in _rows(model, inputs, cache, log, name):
        cand, plen, chosen, scores = e["cand"], e["plen"], e["chosen"], e["scores"]
        H, P = cand.shape[1:]
        left, ranked, fixed = 0.0, [], 0
        for h in range(H):
            c = cand[b, h]
            always = dense - int((plen[b, h] * per_token)[c].sum())
            fixed += always + int(sb[b, h][c].sum())
            left += fraction * dense - always - int(sb[b, h][c].sum())
            ranked += [
                (-float(scores[b, h, j]), h * P + j, int(plen[b, h, j]) * per_token)
                for j in c.nonzero().flatten().tolist()
            ]
        # one ranking of (head, page): ties the lower head, then the lower page, first
        expect, used = _fill(ranked, left)
        assert set(chosen[b].flatten().nonzero().flatten().tolist()) == expect
        assert fixed + used <= fraction * dense * H
        counts = chosen[b].sum(-1)
        uneven |= bool(counts.max() > counts.min())
    assert uneven  # a head with its attention on few pages leaves bytes to another
    assert br["read_vs_dense"] <= fraction and get_stats(model)["read_head_budget"] == "shared"


def test_a_shared_page_budget_reads_the_heads_page_counts_summed():
    scores = torch.tensor([[[5.0, 4.0, 3.0, 2.0], [9.0, 8.0, 7.0, 0.0]]])  # (B=1, Hkv=2, P=4)
    cand = torch.ones_like(scores, dtype=torch.bool)
    assert select_by_score(scores, cand, 0.5).sum(-1).tolist() == [[2, 2]]  # each head its own 2 pages
    shared = select_by_score(scores, cand, SharedHeads(0.5))  # 4 pages between them: 9, 8, 7 and 5
    assert shared.tolist() == [[[True, False, False, False], [True, True, True, False]]]
    counts = torch.tensor([[1, 2]])
    assert select_by_score(scores, cand, SharedHeads(counts)).tolist() == [
        [[False, False, False, False], [True, True, True, False]]
    ]


@pytest.mark.parametrize(
    "kw, match",
    [
        (
            {"retrieval": "oval", "read_bytes_budget": 0.25, "read_head_budget": "pooled"},
            "read_head_budget='pooled'",
        ),
        ({"read_head_budget": "shared"}, "without a retrieval method"),
        (
            {"retrieval": "router", "read_bytes_budget": 0.25, "read_head_budget": "shared"},
            "one scale across heads",
        ),
    ],
)
def test_a_shared_read_budget_is_checked_with_a_message(kw, match):
    with pytest.raises(ConfigError, match=match):
        OvalConfig(**kw)


def test_a_spec_shares_the_read_budget():
    cfg = OvalConfig.from_spec("oval:read_bytes_budget,read_head_budget=shared", 0.25)
    assert cfg.read_head_budget == "shared" and cfg.read_bytes_budget == 0.25 and cfg.retrieval == "oval"


def test_a_bytes_budget_below_the_always_read_pages_reads_no_optional_page_and_says_so(model, llava_batch):
    inputs = llava_batch(TEXTS)
    _, _, br = _run(model, inputs, retrieval="quest", read_bytes_budget=0.05)
    t = model.config.text_config
    assert br["total"]["selected"] == 0
    assert br["over_budget"] == (NEW_TOKENS - 1) * t.num_hidden_layers * 2 * t.num_key_value_heads
    assert br["read_vs_dense"] > 0.05  # what is always read cannot be skipped


def test_a_larger_bytes_budget_reads_more(model, llava_batch):
    inputs = llava_batch(TEXTS)
    low = _run(model, inputs, retrieval="quest", read_bytes_budget=0.7, image_tile=2)[2]["total"]["selected"]
    high = _run(model, inputs, retrieval="quest", read_bytes_budget=1.0, image_tile=2)[2]["total"]["selected"]
    assert 0 < low < high


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"retrieval": "oval", "read_bytes_budget": 0.0}, "read_bytes_budget=0.0 must be a fraction"),
        ({"retrieval": "oval", "read_bytes_budget": 1.5}, "read_bytes_budget=1.5 must be a fraction"),
        ({"retrieval": "oval", "read_bytes_budget": True}, "read_bytes_budget=True"),
        ({"retrieval": "oval", "read_budget": 0.5, "read_bytes_budget": 0.5}, "give one of them"),
        ({"read_bytes_budget": 0.5}, "without a retrieval method"),
    ],
)
def test_a_bytes_budget_is_checked_with_a_message(kw, match):
    with pytest.raises(ConfigError, match=match):
        OvalConfig(**kw)


def test_a_spec_sets_the_bytes_budget():
    cfg = OvalConfig.from_spec("oval:read_bytes_budget=0.25")
    assert cfg.retrieval == "oval" and cfg.read_bytes_budget == 0.25 and cfg.read_budget == 1.0


def test_a_sweeps_budget_axis_is_a_bytes_budget_for_a_spec_with_the_bare_key():
    assert budget_field("oval:read_bytes_budget") == "read_bytes_budget"
    assert budget_field("oval:rank=4") == "read_budget" and budget_field("snapkv") == "budget"
    cfg = OvalConfig.from_spec("oval:read_bytes_budget,rank=4", 0.1)
    assert cfg.read_bytes_budget == 0.1 and cfg.read_budget == 1.0 and cfg.retrieval_options == {"rank": 4}
    for spec, budget in (("oval:read_bytes_budget", None), ("snapkv:read_bytes_budget", 0.25)):
        with pytest.raises(ConfigError, match="bare key read_bytes_budget"):
            OvalConfig.from_spec(spec, budget)


def test_the_run_summary_and_the_sweep_table_give_the_bytes_read_of_retrieval_rows():
    rows = [{"kv_bytes_full": 10, "kv_bytes_kept": 10, "bytes_read": {"total": {"read": r, "dense": 100}}}
            for r in (50, 150)]  # fmt: skip
    kv = summarize_kv(rows)
    assert kv["bytes_read"] == 200 and kv["bytes_dense"] == 200 and kv["read_vs_dense"] == 1.0
    assert "read_vs_dense" not in summarize_kv([{"kv_bytes_full": 10, "kv_bytes_kept": 10}])
    methods = ["snapkv", "oval", "quest:read_bytes_budget"]
    cells = [{"method": m, "budget": 0.25, "primary": 90.0, "kv_fraction_kept": k, "read_vs_dense": x}
             for m, k, x in zip(methods, (0.25, 1.0, 1.0), (1.0, 1.714, 0.25))]  # fmt: skip
    summary = {"task": "vqav2", "primary_metric": "overall", "budgets": [0.25], "full_ran": False,
               "methods": methods, "cells": cells}  # fmt: skip
    table = markdown_table(summary)
    assert "| snapkv | 90.00 (25%) |" in table  # eviction rows as before
    assert "| oval | 90.00 (100%) read 1.71x |" in table
    assert "| quest:read_bytes_budget | 90.00 (100%) read 0.25x |" in table
    assert "the budget is `read_bytes_budget`" in table
    assert "a token)" not in table  # no forward of several tokens: one figure
    # the question read densely after a compressed context: both figures, and what the second one is
    cells.append({"method": "oval:read_bytes_budget,read_chunks=dense", "budget": 0.25, "primary": 90.0,
                  "kv_fraction_kept": 1.0, "read_vs_dense": 0.284, "one_token_read_vs_dense": 0.2496})  # fmt: skip
    summary["methods"].append(cells[-1]["method"])
    table = markdown_table(summary)
    assert "| oval:read_bytes_budget,read_chunks=dense | 90.00 (100%) read 0.28x (0.25x a token) |" in table
    assert "`(Nx a token)`: the same over the steps that feed one token only" in table


def test_dense_counts_the_resident_slots_when_a_later_turns_tokens_hold_padding(model, llava_batch):
    """A batch of conversations whose next turns differ in length feeds padding inside the new tokens:
    those slots are not resident, and each step's dense bytes are exactly the valid slots of the table."""
    inputs = llava_batch(TEXTS)
    mm_oval.wrap(model, method="snapkv", budget=0.5)
    cache = new_cache(model)
    seq = model.generate(**inputs, max_new_tokens=2, min_new_tokens=2, do_sample=False, cache=cache)
    tail = torch.tensor([[5, 6, 7], [0, 0, 7]])  # the second conversation's next turn is one token
    tail_mask = torch.tensor([[1, 1, 1], [0, 0, 1]])
    ids = torch.cat([seq, tail], 1)
    mask = torch.cat([inputs["attention_mask"], torch.ones(2, seq.shape[1] - inputs["input_ids"].shape[1],
                                                            dtype=torch.long), tail_mask], 1)  # fmt: skip
    steps = []
    for layer in cache.layers:
        count = layer.telemetry.count_read

        def counted(store, always, chosen, summary, several=False, layer=layer, count=count):
            steps.append(int(layer.slot_valid.sum()))  # the slot table's resident slots at this step
            count(store, always, chosen, summary, several=several)

        layer.telemetry.count_read = counted
    before = get_stats(model)["bytes_read"]["total"]["dense"]
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2, do_sample=False,
                   cache=cache)  # fmt: skip
    per_token = 2 * cache.layers[0].keys.shape[-1] * cache.layers[0].keys.element_size()
    assert cache.layers[0].all_valid is False  # the padding went into the table
    assert get_stats(model)["bytes_read"]["total"]["dense"] - before == sum(steps) * per_token


def test_read_chunks_dense_reads_a_later_turn_densely_and_decode_steps_by_retrieval(model, llava_batch):
    """`read_chunks="dense"` (Quest's rule: retrieval at one new token only): the question read after a
    compressed image gives the logits dense attention gives over the same cache, the decode steps after it
    still read a quarter of the image pages, and the stats count the chunk as read densely. The default reads
    the chunk by retrieval too, which changes those logits. (2x2 image pages: 16 candidates, 4 read.)"""
    from mm_oval.wrapper import prefill

    full = llava_batch(TEXTS[:1])
    ids = full["input_ids"]
    split = int((ids[0] == model.config.image_token_index).nonzero().max()) + 2  # the image and one token
    head = {"input_ids": ids[:, :split], "attention_mask": full["attention_mask"][:, :split],
            "pixel_values": full["pixel_values"]}  # fmt: skip
    logits, stats = {}, {}
    for name, cfg in (
        ("full", {}),
        ("dense", {"retrieval": "oval", "read_budget": 0.25, "read_chunks": "dense", "image_tile": 2}),
        ("retrieval", {"retrieval": "oval", "read_budget": 0.25, "image_tile": 2}),
    ):
        mm_oval.wrap(model, **cfg)
        cache = prefill(model, **head)
        out = model.generate(input_ids=ids, attention_mask=full["attention_mask"], cache=cache, max_new_tokens=3,
                             min_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True)  # fmt: skip
        logits[name], stats[name] = out.logits, get_stats(model)
    torch.testing.assert_close(logits["dense"][0], logits["full"][0], rtol=1e-5, atol=1e-5)  # the chunk's
    assert not torch.allclose(logits["retrieval"][0], logits["full"][0], rtol=1e-2, atol=1e-2)
    assert not torch.allclose(logits["dense"][1], logits["full"][1], rtol=1e-2, atol=1e-2)  # a decode step's
    layers = model.config.text_config.num_hidden_layers
    dense, default = stats["dense"], stats["retrieval"]
    assert dense["read_chunks"] == "dense" and dense["dense_chunk_reads"] == layers
    assert default["read_chunks"] == "retrieval" and default["dense_chunk_reads"] == 0
    # the two decode steps after the chunk read by retrieval: a quarter of the candidate image pages
    assert 0 < dense["page_read_fraction"] <= 0.3
    br = dense["bytes_read"]
    assert br["total"]["read"] < br["total"]["dense"]
    # the chunk read every resident slot once; the steps of one token read less than their dense bytes
    assert br["chunks"]["read"] == br["chunks"]["dense"] > 0
    one = (br["total"]["read"] - br["chunks"]["read"]) / (br["total"]["dense"] - br["chunks"]["dense"])
    assert br["one_token_read_vs_dense"] == pytest.approx(one) and one < br["read_vs_dense"] < 1
    assert default["bytes_read"]["chunks"]["read"] < default["bytes_read"]["chunks"]["dense"]
    kv = summarize_kv([dense, dense])
    assert kv["one_token_read_vs_dense"] == pytest.approx(one) and kv["read_vs_dense"] == pytest.approx(
        br["read_vs_dense"]
    )
    old_rows = [dense | {"bytes_read": {k: v for k, v in br.items() if k != "chunks"}}]
    assert "one_token_read_vs_dense" not in summarize_kv(old_rows)  # rows saved before it was counted
    with pytest.raises(ConfigError, match="read_chunks='sparse' is not one of"):
        OvalConfig(retrieval="oval", read_chunks="sparse")
    with pytest.raises(ConfigError, match="read_chunks='dense' set without a retrieval method"):
        OvalConfig(read_chunks="dense")


def test_dense_layers_read_every_page_in_the_first_layers_only(tiny_lm, monkeypatch):
    """`dense_layers` (Quest's evaluation code reads its first two layers densely): the first layers read every
    page at every decode step, the others still by retrieval; their bytes count as dense reads, so the model
    reads more than with none; as many dense layers as the model has is refused (nothing left to retrieve)."""
    from mm_oval.cache import decode

    chosen, seen = decode.read_pages, []

    def spy(layer, query, scaling):
        out = chosen(layer, query, scaling)
        if query.shape[2] == 1:
            seen.append((layer.layer_idx, out is None))
        return out

    monkeypatch.setattr(decode, "read_pages", spy)
    ids = torch.randint(1, 300, (1, 400), generator=torch.Generator().manual_seed(0))
    layers = tiny_lm.config.num_hidden_layers
    reads, by_layer = {}, {}
    for n in (0, 1):
        seen.clear()
        with mm_oval.wrapped(tiny_lm, retrieval="oval", read_budget=0.25, dense_layers=n):
            tiny_lm.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
            stats = get_stats(tiny_lm)
        assert stats["dense_layers"] == n
        reads[n] = stats["bytes_read"]["total"]["read"]
        by_layer[n] = {i: {d for j, d in seen if j == i} for i in range(layers)}
    assert by_layer[0] == {i: {False} for i in range(layers)}  # every layer selects its pages
    assert by_layer[1] == {0: {True}, **{i: {False} for i in range(1, layers)}}  # layer 0 reads them all
    assert reads[1] > reads[0]
    with pytest.raises(ConfigError, match=f"dense_layers={layers} reads every page in all {layers} layers"):
        mm_oval.wrap(tiny_lm, retrieval="oval", read_budget=0.25, dense_layers=layers)
    assert not mm_oval.is_wrapped(tiny_lm)
    with pytest.raises(ConfigError, match="dense_layers must be a whole number >= 0"):
        OvalConfig(retrieval="oval", dense_layers=-1)
    with pytest.raises(ConfigError, match="dense_layers=2 set without a retrieval method"):
        OvalConfig(dense_layers=2)


def test_read_layer_budget_divides_the_bytes_over_the_layers_and_keeps_the_total(
    tiny_lm, tmp_path, monkeypatch
):
    """`read_layer_budget` (a per-layer division of the read budget, fitted for one model): layer l reads
    within weight_l x the bytes budget, so a layer weighted up reads more pages and one weighted down fewer,
    the model's total within the same budget; the monitor's recall per layer shows the effect. A division
    that does not fit the model, does not average 1, or names nothing is refused with what to do."""
    from mm_oval.allocation import layer_fractions
    from mm_oval.cache import decode

    chosen, pages = decode.read_pages, {}

    def spy(layer, query, scaling):
        out = chosen(layer, query, scaling)
        if query.shape[2] == 1 and out is not None:
            pages[layer.layer_idx] = pages.get(layer.layer_idx, 0) + int(out.sum())
        return out

    monkeypatch.setattr(decode, "read_pages", spy)
    division = tmp_path / "division.json"
    division.write_text(json.dumps({"weights": [1.8, 0.6, 0.6]}))
    ids = torch.randint(1, 300, (1, 600), generator=torch.Generator().manual_seed(0))
    read, recall = {}, {}
    for name in ("uniform", str(division)):
        pages.clear()
        with mm_oval.wrapped(tiny_lm, retrieval="oval", read_bytes_budget=0.3, read_layer_budget=name,
                             monitor_retrieval=True):  # fmt: skip
            tiny_lm.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
            stats = get_stats(tiny_lm)
        assert stats["read_layer_budget"] == name
        read[name] = (dict(pages), stats["bytes_read"]["one_token_read_vs_dense"])
        recall[name] = stats["retrieval_monitor"]["layer_attention_mass_recall"]
    (uni, uni_total), (div, div_total) = read["uniform"], read[str(division)]
    assert div[0] > uni[0] and div[1] < uni[1] and div[2] < uni[2]
    assert div_total <= 0.3 + 1e-6 and uni_total <= 0.3 + 1e-6
    assert div_total == pytest.approx(uni_total, abs=0.03)
    assert len(recall["uniform"]) == 3 and recall[str(division)][0] > recall["uniform"][0]
    # what a layer capped at every page cannot use goes to the others; the mean stays the budget
    assert layer_fractions((3.0, 0.5, 0.5), 0.5) == pytest.approx((1.0, 0.25, 0.25))
    division.write_text(json.dumps({"weights": [1.0, 1.0]}))
    with pytest.raises(ConfigError, match=r"must hold \"weights\": 3 positive numbers"):
        mm_oval.wrap(tiny_lm, retrieval="oval", read_bytes_budget=0.3, read_layer_budget=str(division))
    division.write_text(json.dumps({"weights": [2.0, 1.0, 1.0]}))
    with pytest.raises(ConfigError, match="they average 1.3333"):
        mm_oval.wrap(tiny_lm, retrieval="oval", read_bytes_budget=0.3, read_layer_budget=str(division))
    with pytest.raises(ConfigError, match="read_layer_budget='no-such.json' is not a file"):
        mm_oval.wrap(tiny_lm, retrieval="oval", read_bytes_budget=0.3, read_layer_budget="no-such.json")
    assert not mm_oval.is_wrapped(tiny_lm)
    with pytest.raises(ConfigError, match="read_layer_budget='d.json' set without a retrieval method"):
        OvalConfig(read_layer_budget="d.json")


def _dense_attention(store, query, scaling):
    """(B, Hq, D): exact attention of the newest query row over every valid slot of `store`."""
    B, H, _, D = store.keys.shape
    Hq = query.shape[1]
    logits = torch.einsum("bhgd,bhld->bhgl", query[:, :, 0].reshape(B, H, Hq // H, D), store.keys) * scaling
    logits = logits.masked_fill(~store.slot_valid.unsqueeze(2), float("-inf"))
    return torch.einsum("bhgl,bhld->bhgd", logits.softmax(-1), store.values).reshape(B, Hq, D)


def _means_bytes_over_skip(model, ids, retrieval, unread):
    """A 4-token generate with `unread_pages=unread` and with "skip": (the extra summary bytes read, the
    candidate pages scanned), after checking both scanned the same candidates and the stats name the knob."""
    summaries, candidates = {}, {}
    for u in ("skip", unread):
        with mm_oval.wrapped(model, retrieval=retrieval, read_budget=0.25, unread_pages=u):
            cache = new_cache(model)
            model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, cache=cache)
            s = get_stats(model)
        assert s["unread_pages"] == u
        summaries[u] = s["bytes_read"]["total"]["summaries"]
        candidates[u] = int(cache.counters["candidate_pages"])
    assert candidates["skip"] == candidates[unread] > 0
    return summaries[unread] - summaries["skip"], candidates[unread]


def test_unread_pages_centroid_adds_each_unread_page_as_its_means_and_counts_their_bytes(tiny_lm):
    """`unread_pages="centroid"`: a decode step attends over the pages it reads plus one token per unread
    candidate page (its keys' mean, weighted by its token count, and its values' mean). Where every page's
    keys and values are constant over its tokens that estimate is exact: the step's output is dense
    attention's over every slot, though it reads a quarter of the pages; without it, it is not. The keys'
    mean is the retrieval record's own where it holds one (OVAL's centroid: only the values' mean is kept
    beside it); Quest's bounds hold none, so both are kept. What is kept is read as part of the summaries:
    per candidate page and step, an int8 vector of head_dim and its fp16 scale for each mean kept."""
    from mm_oval.cache.summaries import page_mean
    from mm_oval.wrapper import prefill

    ids = torch.randint(1, 300, (1, 300), generator=torch.Generator().manual_seed(0))
    for retrieval, kept in (("oval", ["v", "v_scale"]), ("quest", ["k", "k_scale", "v", "v_scale"])):
        mm_oval.wrap(tiny_lm, retrieval=retrieval, read_budget=0.25, unread_pages="centroid")
        try:
            cache = prefill(tiny_lm, input_ids=ids)
            layer = cache.layers[0]
            st = layer.store
            B, H, L, D = st.keys.shape
            P = st.page_len.shape[-1]
            assert sorted(layer.page_means) == kept
            # the means at prefill: each closed page's keys' and values' means, to int8 rounding
            P_s = layer.page_means["v"].shape[2]
            member = torch.nn.functional.one_hot(st.slot_page.clamp(min=0), P).float()
            member = member * st.slot_valid.unsqueeze(-1)
            count = member.sum(2).clamp(min=1).unsqueeze(-1)[:, :, :P_s]
            for name, x in (("k", st.keys), ("v", st.values)):
                true = torch.einsum("bhlp,bhld->bhpd", member, x)[:, :, :P_s] / count
                torch.testing.assert_close(
                    page_mean(layer, name)[:, :, :P_s], true, rtol=0, atol=float(true.abs().max()) / 127
                )
            g = torch.Generator().manual_seed(1)
            # page-constant keys and values on the int8 grid the means are stored on (scale 2^-6, one entry 127)
            ints = [torch.randint(-127, 128, (B, H, P, D), generator=g) for _ in range(2)]
            for t in ints:
                t[..., 0] = 127
            kp, vp = (t.float() * 2**-6 for t in ints)
            idx = st.slot_page.clamp(min=0).unsqueeze(-1).expand(B, H, L, D)
            st.keys.copy_(kp.gather(2, idx))
            st.values.copy_(vp.gather(2, idx))
            scale = torch.full((B, H, P_s), 2**-6, dtype=torch.float16)
            means = {"k": ints[0][:, :, :P_s].to(torch.int8), "v": ints[1][:, :, :P_s].to(torch.int8)}
            if retrieval == "oval":  # the key mean is the record's centroid
                layer.summaries["mu_q"], layer.summaries["mu_scale"] = means.pop("k"), scale.clone()
            layer.page_means = {**means, **{f"{k}_scale": scale.clone() for k in means}}
            Hq, scaling = tiny_lm.config.num_attention_heads, D**-0.5
            query = torch.randn(B, Hq, 1, D, generator=g)
            out = layer.attend(query, scaling)[:, 0]  # (B, Hq, D)
            pages = layer.read_pages(query, scaling)
            skipped = cache.decode_backend(query).attend(layer, query, pages, scaling)[:, 0]
        finally:
            mm_oval.unwrap(tiny_lm)
        cand = (st.page_len[..., :P_s] > 0) & ~st.page_pinned[..., :P_s]
        assert 0 < int((pages[..., :P_s] & cand).sum()) < int(cand.sum())  # some candidate pages unread
        dense = _dense_attention(st, query, scaling)
        torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(skipped, dense, rtol=1e-2, atol=1e-2)
        extra, candidates = _means_bytes_over_skip(tiny_lm, ids, retrieval, "centroid")
        per_page = len(kept) // 2 * (D + 2)  # an int8 mean and an fp16 scale for each mean kept
        assert extra == candidates * per_page
    # a later forward of several tokens read by retrieval (no estimate there) and the steps after it
    with mm_oval.wrapped(tiny_lm, retrieval="oval", read_budget=0.25, unread_pages="centroid"):
        cache = prefill(tiny_lm, input_ids=ids[:, :250])
        seq = tiny_lm.generate(
            input_ids=ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, cache=cache
        )
    assert seq.shape == (1, 303)
    with pytest.raises(ConfigError, match="unread_pages='mean' is not one of"):
        OvalConfig(retrieval="oval", unread_pages="mean")
    with pytest.raises(ConfigError, match="unread_pages='centroid' set without a retrieval method"):
        OvalConfig(unread_pages="centroid")


def test_unread_pages_scored_weights_each_unread_page_by_the_scorers_mass_estimate(tiny_lm):
    """`unread_pages="scored"`: each unread candidate page enters a decode step as its values' mean with the
    log attention mass its retrieval summary estimates. A float LOCKS record of rank 16 spans a 16-token
    page's centred keys exactly, so with values constant over each page the step's output is dense
    attention's over every slot, though the keys are the model's own and a quarter of the pages are read
    (the key-mean estimate of "centroid" is not exact there). Only the values' means are kept and read:
    head_dim int8 entries and an fp16 scale per candidate page and step. A scorer with no mass estimate
    (Quest's bounds) is refused at wrap."""
    from mm_oval.cache.summaries import page_mean
    from mm_oval.wrapper import prefill

    ids = torch.randint(1, 300, (1, 300), generator=torch.Generator().manual_seed(0))
    locks = {"rank": 16, "summary_format": "float"}
    outs = {}
    for unread in ("scored", "centroid"):
        mm_oval.wrap(
            tiny_lm, retrieval="locks", retrieval_options=locks, read_budget=0.25, unread_pages=unread
        )
        try:
            cache = prefill(tiny_lm, input_ids=ids)
            layer = cache.layers[1]
            st = layer.store
            B, H, L, D = st.keys.shape
            P = st.page_len.shape[-1]
            P_s = layer.page_means["v"].shape[2]
            assert sorted(layer.page_means) == ["v", "v_scale"]  # the key mean: the record's centroid
            g = torch.Generator().manual_seed(1)
            ints = torch.randint(-127, 128, (B, H, P, D), generator=g)
            ints[..., 0] = 127  # page-constant values on the int8 grid of the means (scale 2^-6)
            idx = st.slot_page.clamp(min=0).unsqueeze(-1).expand(B, H, L, D)
            st.values.copy_((ints.float() * 2**-6).gather(2, idx))
            layer.page_means["v"] = ints[:, :, :P_s].to(torch.int8)
            layer.page_means["v_scale"] = torch.full((B, H, P_s), 2**-6, dtype=torch.float16)
            torch.testing.assert_close(page_mean(layer, "v"), ints[:, :, :P_s].float() * 2**-6)
            Hq, scaling = tiny_lm.config.num_attention_heads, D**-0.5
            query = 3 * torch.randn(B, Hq, 1, D, generator=g)  # peaked attention within pages
            outs[unread] = layer.attend(query, scaling)[:, 0]
            pages = layer.read_pages(query, scaling)
        finally:
            mm_oval.unwrap(tiny_lm)
        cand = (st.page_len[..., :P_s] > 0) & ~st.page_pinned[..., :P_s]
        assert 0 < int((pages[..., :P_s] & cand).sum()) < int(cand.sum())
    dense = _dense_attention(st, query, scaling)
    torch.testing.assert_close(outs["scored"], dense, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(outs["centroid"], dense, rtol=1e-2, atol=1e-2)
    extra, candidates = _means_bytes_over_skip(tiny_lm, ids, "oval", "scored")
    assert extra == candidates * (D + 2)
    with pytest.raises(ConfigError, match="unread_pages='scored' needs a retrieval scorer"):
        mm_oval.wrap(tiny_lm, retrieval="quest", read_budget=0.25, unread_pages="scored")
    assert not mm_oval.is_wrapped(tiny_lm)  # a wrap that fails leaves the model as it was


def test_every_decode_backend_returns_the_log_sum_exp_of_the_slots_it_reads(tiny_lm, monkeypatch):
    """The unread pages' estimate is merged with the exact attention over the pages read by the latter's
    log-sum-exp, which each decode backend returns with its output (`attend_lse`): the masked attention,
    the gathered one (pages read gathered) and the sparse decode kernel (its PyTorch twin here) give the
    output `attend` gives and the log-sum-exp of the step's logits over exactly the slots read."""
    import mm_oval.cache.decode as decode
    from mm_oval.wrapper import prefill

    ids = torch.randint(1, 300, (1, 300), generator=torch.Generator().manual_seed(0))
    with mm_oval.wrapped(tiny_lm, retrieval="oval", read_budget=0.25):
        cache = prefill(tiny_lm, input_ids=ids)
        layer = cache.layers[2]
        st = layer.store
        B, H, _, D = st.keys.shape
        Hq, scaling = tiny_lm.config.num_attention_heads, D**-0.5
        query = torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(1))
        pages = layer.read_pages(query, scaling)
        monkeypatch.setattr(decode, "GATHER_SHARE", 1.0)  # gather whatever share is read
        got = {
            b.name: b.attend_lse(layer, query, pages, scaling)
            for b in (decode.MaskedDecode(), decode.GatheredDecode(), decode.KernelDecode())
        }
        want_out = decode.MaskedDecode().attend(layer, query, pages, scaling)
    slots = st.slot_valid & pages.gather(-1, st.slot_page.clamp(min=0))
    assert 0 < int(slots.sum()) < int(st.slot_valid.sum())
    logits = torch.einsum("bhgd,bhld->bhgl", query[:, :, 0].reshape(B, H, Hq // H, D), st.keys) * scaling
    want_lse = logits.masked_fill(~slots.unsqueeze(2), float("-inf")).logsumexp(-1)
    for name, (out, lse) in got.items():
        torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5, msg=name)


def test_scored_weighs_each_pages_values_by_the_prompts_last_queries_attention(tiny_lm):
    """With `unread_pages="scored"` a page's values' mean is weighted by the attention the prompt's last
    VALUE_WINDOW queries pay its tokens (softmax within the page, averaged over the window and the KV head's
    query heads): equal keys give the plain mean, a query that singles out one token gives its value, and
    the means kept at prefill are those of the model's own last queries (to int8 rounding)."""
    from mm_oval.cache.summaries import VALUE_WINDOW, attended_value_means, page_mean
    from mm_oval.wrapper import prefill

    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 1, 2, 4, 8, generator=g)
    values = torch.randn(1, 1, 2, 4, 8, generator=g)
    keys[0, 0, 0] = keys[0, 0, 0, :1]  # page 0: equal keys
    mask = torch.ones(1, 1, 2, 4, dtype=torch.bool)
    mask[0, 0, 1, 3] = False  # page 1 one token short
    query = torch.zeros(1, 2, 3, 8)
    query[..., :] = 50 * keys[0, 0, 1, 2]  # every reference query singles out page 1's third token
    got = attended_value_means(values, keys, mask, query)
    torch.testing.assert_close(got[0, 0, 0], values[0, 0, 0].mean(0))
    torch.testing.assert_close(got[0, 0, 1], values[0, 0, 1, 2], rtol=1e-3, atol=1e-3)

    ids = torch.randint(1, 300, (1, 300), generator=torch.Generator().manual_seed(0))
    with mm_oval.wrapped(tiny_lm, retrieval="oval", read_budget=0.25, unread_pages="scored"):
        cache = prefill(tiny_lm, input_ids=ids)
        layer = cache.layers[2]
        st = layer.store
        B, H, L, D = st.keys.shape
        Hq = tiny_lm.config.num_attention_heads
        assert layer.value_query.shape == (B, Hq, VALUE_WINDOW, D)
        P_s = layer.page_means["v"].shape[2]
        kept = page_mean(layer, "v")
    q = layer.value_query.reshape(B, H, -1, D)
    for p in range(P_s):
        for h in range(H):
            slots = (st.slot_page[0, h] == p) & st.slot_valid[0, h]
            if not bool(slots.any()):
                continue
            w = torch.softmax(q[0, h] @ st.keys[0, h, slots].T, -1).mean(0)
            want = w @ st.values[0, h, slots]
            torch.testing.assert_close(kept[0, h, p], want, rtol=0, atol=float(want.abs().max()) / 120)
