"""The retrieval monitor (`monitor_retrieval`): each decode step's selection against exact attention, in
`stats["retrieval_monitor"]` and in the Prometheus text."""

import pytest
import torch

import mm_oval
from mm_oval.config import OvalConfig
from mm_oval.errors import ConfigError
from mm_oval.measures import exact_attention, exact_page_log_mass
from mm_oval.policies.base import IMAGE, DecodeContext, PageBatch, RetrievalPolicy, make_retrieval, topk_mask
from mm_oval.stats import RetrievalMonitor, get_stats, to_prometheus

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ["USER: <image>\nwhat color is the circle ? ASSISTANT:", "USER: <image>\nhow many ? ASSISTANT:"]


class RandomPages(RetrievalPolicy):
    """Selects pages at random (seeded): its picks are independent of the keys."""

    name = "random_pages_for_tests"

    def __init__(self, seed: int = 0):
        self.g = torch.Generator().manual_seed(seed)

    def summarize(self, pages):
        return {"n": torch.zeros(*pages.kind.shape, 1)}

    def score_pages(self, ctx):
        return torch.rand(ctx.candidates.shape, generator=self.g)


def _generate(model, processor, llava_batch, policy=None, n=12, **cfg):
    wrapped = mm_oval.wrap(
        model, OvalConfig(**cfg), retrieval_policy=policy
    )  # policy None: the configured one
    try:
        wrapped.generate(**llava_batch(TEXTS), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return get_stats(wrapped)
    finally:
        mm_oval.unwrap(wrapped)


@pytest.mark.parametrize("retrieval", ["quest", "oval"])
def test_reading_every_page_hits_every_true_top_page_and_recalls_all_the_mass(
    tiny_random_llava, llava_batch, retrieval
):
    model, processor = tiny_random_llava
    # 2x2 tiles: several candidate pages per head on the tiny model's 8x8 grid, so pairs of them exist
    s = _generate(
        model,
        processor,
        llava_batch,
        retrieval=retrieval,
        read_budget=1.0,
        monitor_retrieval=True,
        image_tile=2,
    )
    m = s["retrieval_monitor"]
    assert m["hit_rate"] == pytest.approx(1.0)
    assert m["attention_mass_recall"] == pytest.approx(1.0, abs=1e-6)
    assert m["layer_attention_mass_recall"] == pytest.approx(
        [1.0] * model.config.text_config.num_hidden_layers
    )
    assert m["page_utilisation"] == pytest.approx(1.0)
    assert m["co_read_density"] == pytest.approx(1.0)  # every pair of pages read at every step
    n_layers = model.config.text_config.num_hidden_layers
    assert m["layer_steps"] == n_layers * s["decode_steps"]
    assert m["pages_selected"] > 0
    assert 0 < m["select_ms_p50"] <= m["select_ms_p99"]
    assert m["select_ms_p50"] <= m["step_select_ms_p50"] <= m["step_select_ms_p99"]


def test_a_partial_read_budget_recalls_less_and_the_block_is_absent_when_not_asked(
    tiny_random_llava, llava_batch
):
    model, processor = tiny_random_llava
    # 2x2 tiles (as below): the tiny model's 8x8 grid has one 4x4 page that sinks and recent tokens leave free
    m = _generate(
        model,
        processor,
        llava_batch,
        retrieval="quest",
        read_budget=0.25,
        monitor_retrieval=True,
        image_tile=2,
    )
    exported = to_prometheus(m)
    m = m["retrieval_monitor"]
    assert f"mm_oval_retrieval_co_read_density {m['co_read_density']!r}" in exported
    assert 0.0 < m["attention_mass_recall"] < 1.0
    per_layer = m["layer_attention_mass_recall"]  # the pooled recall is their mean (each layer as many steps)
    assert sum(per_layer) / len(per_layer) == pytest.approx(m["attention_mass_recall"])
    assert min(per_layer) < 1.0
    dense0 = _generate(model, processor, llava_batch, retrieval="quest", read_budget=0.25,
                       monitor_retrieval=True, image_tile=2, dense_layers=1)["retrieval_monitor"]  # fmt: skip
    assert dense0["layer_attention_mass_recall"][0] is None  # layer 0 read densely: never measured
    assert len(dense0["layer_attention_mass_recall"]) == len(per_layer)
    assert all(0.0 < r < 1.0 for r in dense0["layer_attention_mass_recall"][1:])
    assert 0.0 < m["hit_rate"] <= 1.0 and 0.25 <= m["page_utilisation"] <= 1.0
    assert 0.0 < m["co_read_density"] < 1.0
    plain = _generate(model, processor, llava_batch, retrieval="quest", read_budget=0.25)
    assert "retrieval_monitor" not in plain
    assert "retrieval_hit_rate" not in to_prometheus(plain)


def test_random_selection_hits_about_k_over_p_of_the_true_top_pages(tiny_random_llava, llava_batch):
    model, processor = tiny_random_llava
    s = _generate(model, processor, llava_batch, policy=RandomPages(), n=20, retrieval="quest", read_budget=0.25,
                  monitor_retrieval=True, image_tile=2)  # fmt: skip
    # 2x2 tiles: 16 candidate image pages per head, 4 read: a random 4 of 16 holds 1/4 of the true top 4 on average
    # (about 300 head-steps: standard deviation ~0.011)
    assert s["retrieval_monitor"]["hit_rate"] == pytest.approx(0.25, abs=0.06)
    assert s["retrieval_monitor"]["page_utilisation"] > 0.5  # random picks spread over the pages
    # a pair of the 16 pages is read together at a step with chance 4/16 * 3/15 = 0.05; within a window of
    # the last w steps (w = 1..8, then 8) with chance 1 - 0.95^w: the mean over the 19 decode steps
    from mm_oval.stats import CO_READ_WINDOW

    steps = s["decode_steps"]
    want = sum(1 - 0.95 ** min(t, CO_READ_WINDOW) for t in range(1, steps + 1)) / steps
    assert s["retrieval_monitor"]["co_read_density"] == pytest.approx(want, abs=0.03)


def _pages(keys: torch.Tensor, page_len: int):
    """(B, Hkv, L, D) keys in pages of `page_len` consecutive slots: slot_page, page_start, page_len."""
    B, H, L, _ = keys.shape
    P = L // page_len
    slot_page = (torch.arange(L) // page_len).expand(B, H, L).contiguous()
    start = (torch.arange(P) * page_len).expand(B, H, P).contiguous()
    return slot_page, start, torch.full((B, H, P), page_len)


def test_random_picks_on_random_keys_hit_k_over_p_and_the_true_top_pages_hit_one():
    g = torch.Generator().manual_seed(0)
    B, H, G, P, T, D, k = 64, 4, 2, 16, 4, 16, 4
    keys = torch.randn(B, H, P * T, D, generator=g)
    query = torch.randn(B, H * G, D, generator=g)
    slot_page, _, _ = _pages(keys, T)
    valid = torch.ones(B, H, P * T, dtype=torch.bool)
    cand = torch.ones(B, H, P, dtype=torch.bool)
    rand = topk_mask(torch.rand(B, H, P, generator=g), cand, torch.full((B, H), k))
    mon = RetrievalMonitor()
    mon.record(0, 0, 1e-3, query, keys, valid, slot_page, 0.25, cand, rand, rand)
    assert mon.summary()["hit_rate"] == pytest.approx(k / P, abs=0.05)  # 256 head-rows: sd ~0.014
    # the true top pages (log mass averaged over the group as distributions), picked as a policy would
    log_mass = exact_page_log_mass(
        query, keys.view(B, H, P, T, D), torch.ones(B, H, P, T, dtype=torch.bool), 0.25
    )
    share = torch.softmax(log_mass, -1).view(B, H, G, P).mean(2)
    best = topk_mask(share, cand, torch.full((B, H), k))
    mon = RetrievalMonitor()
    mon.record(0, 0, 1e-3, query, keys, valid, slot_page, 0.25, cand, best, best)
    assert mon.summary()["hit_rate"] == pytest.approx(1.0)
    # the recall is attention_mass_captured of the read tokens: here the read pages' share of the mass
    attn = exact_attention(query, keys, valid, 0.25).view(B, H, G, P, T).sum(-1)
    expect = (attn * best.unsqueeze(2)).sum(-1).mean()
    assert mon.summary()["attention_mass_recall"] == pytest.approx(float(expect), rel=1e-5)


def test_quest_on_keys_where_one_page_holds_the_mass_hits_it():
    g = torch.Generator().manual_seed(1)
    B, H, P, T, D = 8, 2, 12, 4, 16
    query = torch.randn(B, H, D, generator=g)
    keys = 0.1 * torch.randn(B, H, P * T, D, generator=g)
    hot = torch.randint(P, (B, H), generator=g)  # the page of each head that holds the mass
    for b in range(B):
        for h in range(H):
            keys[b, h, hot[b, h] * T : (hot[b, h] + 1) * T] += 3.0 * query[b, h] / query[b, h].norm()
    slot_page, start, plen = _pages(keys, T)
    kind = torch.full((B, H, P), IMAGE, dtype=torch.int8)
    quest = make_retrieval("quest")
    pk = keys.view(B, H, P, T, D)
    summaries = quest.summarize(PageBatch(0, pk, pk, torch.ones(B, H, P, T, dtype=torch.bool), kind, 0))
    cand = torch.ones(B, H, P, dtype=torch.bool)
    ctx = DecodeContext(0, query.unsqueeze(2), summaries, start, plen, kind, cand, 1.0)
    chosen = quest.select(ctx, 1 / P)  # one page per head
    assert chosen.sum(-1).eq(1).all()
    mon = RetrievalMonitor()
    valid = torch.ones(B, H, P * T, dtype=torch.bool)
    mon.record(0, 0, 1e-3, query, keys, valid, slot_page, 1.0, cand, chosen, chosen)
    assert mon.summary()["hit_rate"] == 1.0
    assert mon.summary()["attention_mass_recall"] > 0.9
    assert mon.summary()["page_utilisation"] == pytest.approx(1 / P)


def test_the_prometheus_text_carries_the_monitors_gauges(tiny_random_llava, llava_batch):
    model, processor = tiny_random_llava
    s = _generate(
        model, processor, llava_batch, n=3, retrieval="quest", read_budget=0.5, monitor_retrieval=True
    )
    text = to_prometheus(s, labels={"model": "tiny"})
    m = s["retrieval_monitor"]
    assert f'mm_oval_retrieval_hit_rate{{model="tiny"}} {m["hit_rate"]!r}' in text
    for name in ("attention_mass_recall", "page_utilisation", "pages_selected"):
        assert f"mm_oval_retrieval_{name}{{" in text
    for per in ("layer", "step"):
        for q in ("0.5", "0.99"):
            assert f'mm_oval_retrieval_select_seconds{{model="tiny",per="{per}",quantile="{q}"}}' in text


def test_the_knob_is_checked_with_a_message():
    with pytest.raises(ConfigError, match="monitor_retrieval must be True or False"):
        OvalConfig(retrieval="quest", monitor_retrieval="yes")
    with pytest.raises(ConfigError, match="monitor_retrieval=True set without a retrieval method"):
        OvalConfig(monitor_retrieval=True)
    assert OvalConfig.from_spec("quest:monitor_retrieval=true", 0.25).monitor_retrieval is True


def test_a_runs_summary_gives_the_monitors_figures_per_layer_as_the_mean_over_its_requests():
    """With `monitor_retrieval`, the run summary (what `mm-oval eval` writes) carries the selection measured
    against exact attention: the mean over the requests measured of each figure and of each layer's recall
    (a layer never measured in a request is left out of that layer's mean); runs without it have none."""
    from mm_oval.eval.runner import summarize_kv

    base = {"kv_bytes_full": 10, "kv_bytes_kept": 10}
    rows = [
        {**base, "retrieval_monitor": {"hit_rate": 0.5, "attention_mass_recall": 0.8, "page_utilisation": 1.0,
                                       "layer_attention_mass_recall": [None, 0.6, 1.0]}},
        {**base, "retrieval_monitor": {"hit_rate": 0.7, "attention_mass_recall": 0.6, "page_utilisation": 0.5,
                                       "layer_attention_mass_recall": [None, 0.4, 0.8]}},
        base,  # a request that read no page by retrieval
    ]  # fmt: skip
    m = summarize_kv(rows)["retrieval_monitor"]
    assert m["requests"] == 2
    assert m["hit_rate"] == pytest.approx(0.6) and m["attention_mass_recall"] == pytest.approx(0.7)
    assert m["page_utilisation"] == pytest.approx(0.75)
    assert m["layer_attention_mass_recall"] == [None, pytest.approx(0.5), pytest.approx(0.9)]
    assert "retrieval_monitor" not in summarize_kv([base, base])
