"""PyramidKV and AdaKV: budgets over layers and over a layer's heads for any scorer. The schedule is
kvpress's; the totals are the uniform budget's exactly (per sample and modality, at batch 2 with left
padding); the choices differ from SnapKV's and KeyDiff's where the papers say they should."""

from __future__ import annotations

import math

import pytest
import torch
from PIL import Image

import mm_oval
from mm_oval.allocation import weighted_counts
from mm_oval.cache import choose_kept, request_info
from mm_oval.config import OvalConfig
from mm_oval.policies.base import (
    EVICTION_REGISTRY,
    IMAGE,
    PAD,
    TEXT,
    EvictionPolicy,
    PrefillContext,
    budget_count,
    make_eviction,
    register_eviction,
)
from mm_oval.policies.budgets import Allocation, pyramid_counts
from mm_oval.stats import get_stats
from mm_oval.wrapper import prefill

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- the schedule --------------------------------------------------------------------------------


def kvpress_layer_budget(layer: int, num_layers: int, q_len: int, kept: float, beta: float, window: int = 0):
    """kvpress's PyramidKVPress.get_layer_budget, transcribed (kept = q_len * (1 - compression_ratio))."""
    max_capacity_prompt = window + kept
    min_num = (max_capacity_prompt - window) / beta
    max_num = (max_capacity_prompt - window) * 2 - min_num
    if max_num >= q_len - window:
        max_num = q_len - window
        min_num = (max_capacity_prompt - window) * 2 - max_num
    if not (q_len >= max_num >= min_num >= window):
        return round(kept)
    steps = (max_num - min_num) / (num_layers - 1)
    return round(max_num - layer * steps)


def test_pyramid_schedule_is_kvpress_formula_on_hand_worked_numbers():
    def counts(c, d, L, beta):
        return pyramid_counts(torch.tensor([c]), torch.tensor([d]), L, beta)[0].tolist()

    # c = 10 of d = 40, 4 layers, beta 20: min 0.5, max 19.5, step 19/3 -> 19.5, 13.17, 6.83, 0.5
    assert counts(10, 40, 4, 20) == [20, 13, 7, 0]
    # c = 30 of 40: max 58.5 passes 40, so max = 40 and min = 60 - 40 = 20 -> 40, 30, 20
    assert counts(30, 40, 3, 20) == [40, 30, 20]
    # halves round to even, as Python's round: 4.5, 1.5 -> 4, 2
    assert counts(3, 10, 2, 2) == [4, 2]
    assert counts(5, 5, 4, 20) == [5, 5, 5, 5]  # keep-all stays keep-all
    assert counts(7, 9, 1, 20) == [7]  # one layer: the uniform count
    # LLaVA-1.5-7B's shape: 32 layers, 144 of 576 image tokens (25%), and other cases, term by term
    for c, d, L, beta in [
        (144, 576, 32, 20),
        (58, 576, 32, 20),
        (400, 576, 32, 5),
        (3, 60, 32, 1),
        (17, 23, 7, 3),
    ]:
        want = [kvpress_layer_budget(i, L, d, c, beta) for i in range(L)]
        assert counts(c, d, L, beta) == want, (c, d, L, beta)


def test_pyramid_schedule_totals_are_exact_and_fall_with_depth():
    g = torch.Generator().manual_seed(0)
    d = torch.randint(1, 700, (400,), generator=g)
    c = (torch.rand(400, generator=g) * (d + 1)).long().clamp(max=d)
    for L, beta in [(32, 20), (4, 1.5), (5, 7.3), (2, 1)]:
        out = pyramid_counts(c, d, L, beta)
        assert (out.sum(-1) == L * c).all()
        assert ((out >= 0) & (out <= d.unsqueeze(-1))).all()
        assert (out[:, :-1] >= out[:, 1:]).all()  # more tokens in lower layers
    # float rounding puts kvpress's per-layer round() one token off the total here; the schedule moves that
    # token back on the layer nearest a half, and stays within one token of kvpress's in that layer only
    for c, d, L, beta in [(558, 1697, 32, 20), (50, 652, 40, 20), (237, 489, 8, 2)]:
        theirs = torch.tensor([kvpress_layer_budget(i, L, d, c, beta) for i in range(L)])
        ours = pyramid_counts(torch.tensor([c]), torch.tensor([d]), L, beta)[0]
        assert int(theirs.sum()) != L * c and int(ours.sum()) == L * c
        assert int((ours - theirs).abs().sum()) == 1
    with pytest.raises(mm_oval.ConfigError, match="beta must be"):
        make_eviction("pyramidkv", beta=0.5)


def test_weighted_layer_counts_follow_the_weights_within_caps_and_keep_the_total():
    # hand-worked: weights 3, 1, 1, 0.5, 0.5 (sum 6) over 5 x 10 = 50 tokens, a layer holds at most 25: the
    # first layer's 25 fits; 8.33, 8.33, 4.17, 4.17 round down to 24 and the remainder goes to the largest
    # fraction (ties: the lower layer)
    w = (3.0, 1.0, 1.0, 0.5, 0.5)
    assert weighted_counts(torch.tensor([10]), torch.tensor([25]), w)[0].tolist() == [25, 9, 8, 4, 4]
    # caps: the first layer wants 60 of 100 but holds 22; layers 2-3 then want 26 each, hold 22; 34 left
    assert weighted_counts(torch.tensor([20]), torch.tensor([22]), w)[0].tolist() == [22, 22, 22, 17, 17]
    g = torch.Generator().manual_seed(0)
    d = torch.randint(1, 700, (300,), generator=g)
    c = (torch.rand(300, generator=g) * (d + 1)).long().clamp(max=d)
    for weights in [
        (1.0,) * 6,
        (4.0, 1.0, 0.2, 0.2, 0.3, 0.3),
        tuple(torch.rand(30, generator=g).add(0.05).tolist()),
    ]:
        out = weighted_counts(c, d, weights)
        assert (out.sum(-1) == len(weights) * c).all()
        assert ((out >= 0) & (out <= d.unsqueeze(-1))).all()
        if len(set(weights)) == 1:
            assert (out == c.unsqueeze(-1)).all()  # equal weights: the uniform budget


def test_kvp_layer_budget_divides_the_uniform_total_by_the_fitted_weights(
    tiny_random_llava, inputs, tmp_path
):
    """`kvp:layer_budget=true`: each layer keeps its weight times the uniform count beyond the protected
    tokens (the same total); a missing or malformed weights file, or a wrapper over it, is a clear error."""
    import json

    from mm_oval.policies.kvp import KVPAgentConfig, KVPAgents, save_agents

    model, _ = tiny_random_llava
    lm = model.model.language_model.config
    L, H = lm.num_hidden_layers, lm.num_key_value_heads
    save_agents(KVPAgents(KVPAgentConfig(num_layers=L, num_kv_heads=H, head_dim=lm.head_dim)), tmp_path, {})
    spec = f"kvp:agents={tmp_path},layer_budget=true"
    with pytest.raises(mm_oval.ConfigError, match="kvp_layer_budget.py"):
        make_eviction("kvp", agents=str(tmp_path), layer_budget=True)
    (tmp_path / "layer_budget.json").write_text(json.dumps({"weights": [1.0] * (L - 1)}))
    with pytest.raises(mm_oval.ConfigError, match=f"{L} positive numbers"):
        make_eviction("kvp", agents=str(tmp_path), layer_budget=True)
    weights = [2.5] + [0.5] * (L - 1)
    (tmp_path / "layer_budget.json").write_text(json.dumps({"weights": weights}))
    with pytest.raises(mm_oval.ConfigError, match="layer_budget=false"):
        make_eviction("pyramidkv", scorer="kvp", agents=str(tmp_path), layer_budget=True)
    kw = dict(budget=0.25, text_budget=0.5)
    counts, info, _ = _run(model, inputs, spec, **kw)
    per_head = _uniform_counts(info, **kw)  # (B, 2), protected inside
    prot = torch.stack([(info.protected & (info.modality == m)).sum(-1) for m in (IMAGE, TEXT)], -1)
    n = torch.stack([(info.modality == m).sum(-1) for m in (IMAGE, TEXT)], -1)
    want = prot + weighted_counts(per_head - prot, n - prot, tuple(weights)).movedim(-1, 0)  # (L, B, 2)
    assert (counts == want.unsqueeze(2)).all()  # (L, B, H, 2): every head of a layer keeps its count
    assert (counts[0] > counts[1]).any() and (counts.sum(0) == L * per_head.unsqueeze(1)).all()


def test_kvp_layerwise_false_ranks_every_layer_and_head_together(tiny_random_llava, inputs, tmp_path):
    """`kvp:layerwise=false`: per sample and modality, the tokens kept beyond the protected ones over every
    layer and KV head are exactly the top `layers x Hkv x (k - p)` of the agents' scores of all layers
    (scored layer by layer, chosen after the last), so the layers keep different counts at the uniform
    total; generation runs on it. With `layer_budget=true`, or under a budget wrapper, it is refused."""
    from mm_oval.policies.kvp import KVPAgentConfig, KVPAgents, KVPPolicy, save_agents

    model, _ = tiny_random_llava
    lm = model.model.language_model.config
    L, H = lm.num_hidden_layers, lm.num_key_value_heads
    torch.manual_seed(0)
    save_agents(KVPAgents(KVPAgentConfig(num_layers=L, num_kv_heads=H, head_dim=lm.head_dim)), tmp_path, {})
    with pytest.raises(mm_oval.ConfigError, match="choose one"):
        make_eviction("kvp", agents=str(tmp_path), layer_budget=True, layerwise=False)
    with pytest.raises(mm_oval.ConfigError, match="layerwise=true"):
        make_eviction("adakv", scorer="kvp", agents=str(tmp_path), layerwise=False)

    class Recording(KVPPolicy):
        seen: dict = {}

        def score(self, ctx):
            self.seen[ctx.layer_idx] = s = super().score(ctx)
            return s

    policy = Recording(agents=str(tmp_path), layerwise=False)
    kw = dict(budget=0.25, text_budget=0.5)
    mm_oval.wrap(model, OvalConfig.from_spec("kvp", **kw), eviction_policy=policy)
    try:
        cache = prefill(model, **inputs)
        info, N = cache.info, cache.info.modality.shape[1]
        kept = torch.zeros(info.modality.shape[0], L, H, N, dtype=torch.bool)  # (B, L, H, N) prompt indices
        for li, layer in enumerate(cache.layers):
            for b in range(kept.shape[0]):
                for h in range(H):
                    kept[b, li, h, layer.slot_src[b, h][layer.slot_valid[b, h]]] = True
        counts = _per_layer_counts(cache)  # (L, B, H, 2)
        # (B, L, H, N): the scores as this prefill ranked them (generate's own prefill records its own)
        scores = torch.stack([policy.seen[i] for i in range(L)], 1)
        out = model.generate(**inputs, max_new_tokens=2, do_sample=False)
        assert out.shape == (2, inputs["input_ids"].shape[1] + 2)
    finally:
        mm_oval.unwrap(model)
    per_head = _uniform_counts(info, **kw)  # (B, 2), protected inside
    assert (counts.sum((0, 2)) == L * H * per_head).all()  # the uniform total over layers and heads
    assert len(set(counts[:, 0, :, 0].flatten().tolist())) > 1  # the layers and heads keep different counts
    for b in range(kept.shape[0]):
        assert kept[b][:, :, info.protected[b]].all()  # the protected tokens, in every head of every layer
        for m, col in ((IMAGE, 0), (TEXT, 1)):
            free = (info.modality[b] == m) & ~info.protected[b]
            n = L * H * int(per_head[b, col] - (info.protected[b] & (info.modality[b] == m)).sum())
            top = scores[b].masked_fill(~free, float("-inf")).flatten().topk(n).indices
            want = torch.zeros(L * H * N, dtype=torch.bool)
            want[top] = True
            assert torch.equal(kept[b] & free, want.view(L, H, N))


def test_kvp_calibrated_scores_are_each_heads_log_shares_at_its_fitted_temperature(tmp_path):
    """`kvp:layerwise=false,calibrated=true`: a head's scores are `log_softmax(tau x raw)` with tau its
    temperature from `<agents>/temperature.json` (so the heads' shares are on the fitted scale when ranked
    together); the order within a head is the agents'. A missing or malformed file, or calibrated without
    layerwise=false (where it would change nothing), is a clear error."""
    import json

    from mm_oval.policies.kvp import KVPAgentConfig, KVPAgents, KVPPolicy, save_agents

    torch.manual_seed(1)
    save_agents(KVPAgents(KVPAgentConfig(num_layers=2, num_kv_heads=2, head_dim=2)), tmp_path, {})
    with pytest.raises(mm_oval.ConfigError, match="layerwise=false"):
        make_eviction("kvp", agents=str(tmp_path), calibrated=True)
    with pytest.raises(mm_oval.ConfigError, match="kvp_temperature.py"):
        make_eviction("kvp", agents=str(tmp_path), layerwise=False, calibrated=True)
    for bad in ([[1.0, 2.0]], [[1.0, -2.0], [1.0, 1.0]], [[True, 1.0], [1.0, 1.0]], "hot"):
        (tmp_path / "temperature.json").write_text(json.dumps({"temperatures": bad}))
        with pytest.raises(mm_oval.ConfigError, match="2 x 2 positive numbers"):
            make_eviction("kvp", agents=str(tmp_path), layerwise=False, calibrated=True)
    taus = [[0.5, 3.0], [2.0, 0.25]]
    (tmp_path / "temperature.json").write_text(json.dumps({"temperatures": taus}))
    cal = KVPPolicy(agents=str(tmp_path), layerwise=False, calibrated=True)
    plain = KVPPolicy(agents=str(tmp_path), layerwise=False)
    for layer in (0, 1):
        ctx, _ = _hand_ctx(layer)
        raw = plain.agents.score_layer(layer, ctx.keys, ctx.values, ctx.positions, ctx.modality, ctx.image_rc)
        want = torch.log_softmax(raw * torch.tensor(taus[layer]).view(1, 2, 1), -1)
        got = cal.score(ctx)
        torch.testing.assert_close(got, want)
        assert torch.equal(got.argsort(-1), plain.score(ctx).argsort(-1))  # the agents' order in each head
        assert not torch.allclose(got, plain.score(ctx))


# ---- hand-worked choices against SnapKV and KeyDiff --------------------------------------------------


def _hand_ctx(layer: int = 0) -> tuple[PrefillContext, object]:
    """Two KV heads, six text tokens. SnapKV with window 1 and kernel 1 scores a token by the last query's
    attention to it; the last query is (1, 0) and key j is (log w_j + 5, y_j), so attention is w_j / sum(w).
    Head 0: w = 1 1 1 1 1 6 (1/11 each, the window token kept); head 1: w = 3 2 2 2 1 1. Token 4's key points
    elsewhere (y = 8), which only KeyDiff sees."""
    w = torch.tensor([[1.0, 1, 1, 1, 1, 6], [3, 2, 2, 2, 1, 1]])
    keys = torch.zeros(1, 2, 6, 2)
    keys[0, :, :, 0] = w.log() + 5
    keys[0, :, 4, 1] = 8.0
    queries = torch.zeros(1, 2, 6, 2)
    queries[0, :, :, 0] = 1.0
    ids = torch.full((1, 6), 7)
    info = request_info(ids, None, image_token_id=99, tokens_per_image=16, sink_tokens=0, recent_tokens=0)
    ctx = PrefillContext(
        layer_idx=layer,
        keys=keys,
        values=torch.randn(1, 2, 6, 2),
        queries=queries,
        positions=info.positions,
        modality=info.modality,
        image_rc=info.image_rc,
        scaling=1.0,
    )
    return ctx, info


def _kept(spec: str, layer: int = 0, num_layers: int = 2) -> list[list[int]]:
    cfg = OvalConfig.from_spec(spec, text_budget=0.5, sink_tokens=0, recent_tokens=0)  # 3 of 6 per head
    pol = make_eviction(cfg.method, **cfg.method_options)
    ctx, info = _hand_ctx(layer)
    keep = choose_kept(pol.score(ctx), info, cfg, Allocation.of(pol, cfg.head_budget), layer, num_layers)
    return [keep[0, h].nonzero().flatten().tolist() for h in range(2)]


SNAP = "window=1,kernel=1"


def test_adakv_and_pyramidkv_choose_otherwise_than_snapkv_and_keydiff_on_a_hand_worked_case():
    snap = _kept(f"snapkv:{SNAP}")
    keydiff = _kept("keydiff")
    assert snap == [
        [0, 1, 5],
        [0, 1, 5],
    ]  # 3 per head: the window token, then the highest votes (ties: first)
    assert keydiff == [[0, 1, 4], [0, 1, 4]]  # token 4's key is the odd one out
    # AdaKV: 6 tokens for the two heads. The window tokens (inf), then 3/11, 2/11, 2/11, 2/11 of head 1 beat
    # head 0's 1/11s: head 0 keeps one token, head 1 five
    ada = _kept(f"adakv:alpha_safeguard=0,{SNAP}")
    assert ada == [[5], [0, 1, 2, 3, 5]]
    assert _kept(f"adakv:{SNAP}") == ada  # the default safeguard 0.2 guarantees floor(0.6) = 0 tokens
    # PyramidKV, 2 layers, beta 3: c = 3 of d = 6 -> min 1, max 5: layer 0 keeps 5 per head, layer 1 one
    assert _kept(f"pyramidkv:beta=3,{SNAP}", layer=0) == [[0, 1, 2, 3, 5]] * 2
    assert _kept(f"pyramidkv:beta=3,{SNAP}", layer=1) == [[5]] * 2
    # under KeyDiff the pyramid keeps KeyDiff's order
    assert _kept("pyramidkv:scorer=keydiff,beta=3", layer=1) == [[4]] * 2


def test_adakv_safeguard_keeps_each_head_its_share_and_the_better_head_the_rest():
    # alpha 0.7: each head keeps its top floor(0.7 * 3) = 2 first (head 0: the window token and token 0);
    # the remaining 2 of 6 go to head 1's 2/11s
    assert _kept(f"adakv:alpha_safeguard=0.7,{SNAP}") == [[0, 5], [0, 1, 2, 5]]
    assert _kept(f"adakv:alpha_safeguard=1.0,{SNAP}") == _kept(f"snapkv:{SNAP}")  # alpha 1 is uniform
    # head_budget=shared is AdaKV with alpha 0 over the configured method
    assert _kept(f"snapkv:head_budget=shared,{SNAP}") == _kept(f"adakv:alpha_safeguard=0,{SNAP}")
    # random scores: a head whose scores are all above the other's takes everything beyond the safeguard
    info = _toy_info()
    s = torch.rand(2, 3, 40, generator=torch.Generator().manual_seed(0))
    s[:, 2] += 10.0
    cfg = OvalConfig(method="adakv", budget=6, text_budget=0.5, sink_tokens=2, recent_tokens=3)
    for alpha in (0.0, 0.25, 0.5):
        keep = choose_kept(s, info, cfg, Allocation(share_heads=True, alpha_safeguard=alpha))
        img = (keep & (info.modality == IMAGE).unsqueeze(1)).sum(-1)  # (B, H)
        assert (img.sum(-1) == 3 * 6).all()
        safe = max(math.floor(alpha * 6), 2)  # the 2 sinks are image tokens here, kept in every head
        assert (img[:, :2] == safe).all() and (img[:, 2] == 18 - 2 * safe).all()


def _toy_info(B=2, N=40, n_img=16, pad=(0, 5), sink=2, recent=3):
    ids = torch.full((B, N), 7)
    mask = torch.ones(B, N, dtype=torch.long)
    for b in range(B):
        mask[b, : pad[b]] = 0
        ids[b, pad[b] : pad[b] + n_img] = 99
    return request_info(
        ids, mask, image_token_id=99, tokens_per_image=16, sink_tokens=sink, recent_tokens=recent
    )


# ---- the wrapped model: exact totals at batch 2 with left padding ------------------------------------


@pytest.fixture(scope="module")
def inputs(llava_batch):
    texts = [
        "USER: <image>\nwhat color is the circle ? ASSISTANT:",
        "USER: <image>\nhow many red objects are there in the picture now ? ASSISTANT:",
    ]
    out = llava_batch(texts, seed=5)
    assert out["attention_mask"][0, 0] == 0  # the shorter prompt is padded on the left
    return out


def _per_layer_counts(cache) -> torch.Tensor:
    """(L, B, H, 2) kept prompt tokens per layer, sample, head and modality (image, text)."""
    out = []
    for layer in cache.layers:
        ok, mod = layer.slot_valid, layer.slot_mod
        out.append(torch.stack([(ok & (mod == IMAGE)).sum(-1), (ok & (mod == TEXT)).sum(-1)], -1))
    return torch.stack(out)


def _run(model, inputs, spec, **kw):
    cfg = OvalConfig.from_spec(spec, **kw)
    mm_oval.wrap(model, cfg)
    try:
        cache = prefill(model, **inputs)
        info = cache.info
        for layer in cache.layers:  # never padding; sinks and the recent window in every head
            src = layer.slot_src
            assert not ((layer.slot_mod == PAD) & layer.slot_valid).any()
            for b in range(src.shape[0]):
                prot = info.protected[b].nonzero().flatten()
                for h in range(src.shape[1]):
                    assert set(prot.tolist()) <= set(src[b, h][layer.slot_valid[b, h]].tolist())
        counts = _per_layer_counts(cache)
        model.generate(**inputs, max_new_tokens=2, do_sample=False)
        return counts, info, get_stats(model)
    finally:
        mm_oval.unwrap(model)


def _uniform_counts(info, budget, text_budget, scope="image"):
    """The uniform budget's tokens per head, the rule of docs/wrap.md (protected inside): (B, 2) image and
    text, or (B, 1) with scope "all" (both budgets' counts ranked together)."""
    ks, ps = [], []
    for m, b in ((IMAGE, budget), (TEXT, text_budget)):
        ks.append(budget_count(b, (info.modality == m).sum(-1)))
        ps.append((info.protected & (info.modality == m)).sum(-1))
    if scope == "all":
        return torch.maximum(ks[0] + ks[1], ps[0] + ps[1]).unsqueeze(-1)
    return torch.stack([torch.maximum(k, p) for k, p in zip(ks, ps)], -1)


@pytest.mark.parametrize(
    "spec", ["pyramidkv", "pyramidkv:scorer=keydiff,beta=4", "pyramidkv:scorer=h2o,head_budget=shared"]
)
def test_pyramidkv_keeps_the_uniform_total_over_layers_per_sample_and_modality(
    tiny_random_llava, inputs, spec
):
    model, _ = tiny_random_llava
    kw = dict(budget=0.25, text_budget=0.5)
    counts, info, stats = _run(model, inputs, spec, **kw)
    uni_counts, _, uni_stats = _run(model, inputs, "snapkv", **kw)
    L, B, H, _ = counts.shape
    per_head = _uniform_counts(info, **kw)  # (B, 2)
    assert (uni_counts == per_head.view(1, B, 1, 2)).all()
    # over the layers: each sample, head and modality keeps L times the uniform count...
    if "head_budget=shared" in spec:  # ... summed over heads when the heads share
        assert (counts.sum((0, 2)) == L * H * per_head).all()
    else:
        assert (counts.sum(0) == L * per_head.view(B, 1, 2)).all()
    # ... divided on the schedule: lower layers keep more
    tot = counts.sum(2)  # (L, B, 2)
    assert (tot[:-1] >= tot[1:]).all() and (tot[0, :, 0] > tot[-1, :, 0]).all()
    # the stats report what was kept: per layer (mean over heads, summed over the batch) and in total
    for layer_stats, c in zip(stats["layers"], counts):
        assert layer_stats["image_tokens_kept"] == pytest.approx(c[..., 0].sum().item() / H)
        assert layer_stats["text_tokens_kept"] == pytest.approx(c[..., 1].sum().item() / H)
    assert stats["kv_bytes_kept"] == uni_stats["kv_bytes_kept"]
    assert stats["image_kv_fraction_kept"] == uni_stats["image_kv_fraction_kept"]
    assert stats["method"] == spec.split(":")[0]


@pytest.mark.parametrize(
    "spec", ["adakv", "adakv:scorer=tova,alpha_safeguard=0", "adakv:scorer=pyramidkv,beta=4"]
)
@pytest.mark.parametrize("scope", ["image", "all"])
def test_adakv_keeps_the_uniform_total_per_layer_over_heads(tiny_random_llava, inputs, spec, scope):
    model, _ = tiny_random_llava
    kw = dict(budget=0.25, text_budget=0.5, eviction_scope=scope)
    counts, info, stats = _run(model, inputs, spec, **kw)
    L, B, H, _ = counts.shape
    per_head = _uniform_counts(info, 0.25, 0.5, scope)  # (B, 2) or (B, 1)
    if scope == "all":
        counts = counts.sum(-1, keepdim=True)
    per_layer = counts.sum(2)  # (L, B, M): the heads' total
    if "pyramidkv" in spec:  # the layers follow the pyramid, the heads share each layer's count
        assert (per_layer.sum(0) == L * H * per_head).all()
        assert (per_layer[0, :, 0] > per_layer[-1, :, 0]).all()
    else:
        assert (per_layer == H * per_head).all()
    assert (
        counts[..., 0].amax(-1) > counts[..., 0].amin(-1)
    ).any()  # some layer's heads keep different counts
    if spec == "adakv" and scope == "image":  # the safeguard: each head at least floor(0.2 k) of its modality
        assert (counts >= torch.floor(0.2 * per_head.view(1, B, 1, -1))).all()
    kept_bytes = stats["kv_bytes_kept"]
    _, _, uni = _run(model, inputs, "snapkv", **kw)
    assert kept_bytes == uni["kv_bytes_kept"]


def test_pyramidkv_runs_its_schedule_over_the_layers_its_scorer_evicts(tiny_random_llava, inputs):
    model, _ = tiny_random_llava
    counts, info, _ = _run(
        model, inputs, "pyramidkv:scorer=fastv,layer=1,beta=4", budget=0.25, text_budget=1.0
    )
    n_img = (info.modality == IMAGE).sum(-1)
    per_head = _uniform_counts(info, 0.25, 1.0)
    assert (counts[:2, :, :, 0] == n_img.view(1, -1, 1)).all()  # FastV keeps layers 0 and 1 whole
    assert (counts[2:, :, :, 0].sum(0) == 2 * per_head[:, :1]).all()  # layers 2 and 3 share twice the budget
    assert (counts[2, :, :, 0] > counts[3, :, :, 0]).all()


# ---- delegation -------------------------------------------------------------------------------------


def test_the_wrappers_hand_the_cache_everything_their_scorer_asks_for(tiny_random_llava, inputs):
    calls: dict[str, int] = {}

    @register_eviction
    class Probe(EvictionPolicy):
        name = "probe_for_budgets"
        needs_queries = True
        needs_hidden_states = True
        comparable_across_heads = True

        def __init__(self, bias: float = 0.0):
            self.bias = bias
            self.table = torch.zeros(3)

        def prepare_request(
            self, model, input_ids, attention_mask=None, pixel_values=None, *, chunk_size=512
        ):
            calls["prepare"] = calls.get("prepare", 0) + 1
            return {"n": int(input_ids.shape[1])}

        def bind(self, model):
            calls["bind"] = calls.get("bind", 0) + 1

        def keep_layer_unchanged(self, layer_idx):
            return layer_idx == 0

        def score(self, ctx):
            assert ctx.queries is not None and ctx.hidden_states is not None
            assert ctx.request.prepared == {"n": ctx.keys.shape[2]}
            calls["score"] = calls.get("score", 0) + 1
            return ctx.keys.float().norm(dim=-1) + self.bias

        def extra_hook(self):
            return "probe"

    try:
        model, _ = tiny_random_llava
        for spec in (
            "pyramidkv:scorer=probe_for_budgets,bias=1.5",
            "adakv:scorer=probe_for_budgets,bias=1.5",
        ):
            calls.clear()
            cfg = OvalConfig.from_spec(spec, budget=0.25)
            pol = make_eviction(cfg.method, **cfg.method_options)
            assert pol.needs_queries and pol.needs_hidden_states and pol.comparable_across_heads
            assert pol.scorer.bias == 1.5 and pol.extra_hook() == "probe"
            assert [t.shape for t in pol.state_tensors()] == [torch.Size([3])]
            counts, _, _ = _run(model, inputs, spec, budget=0.25)
            assert calls == {"bind": 1, "prepare": 2, "score": 8}  # prefill + generate, 4 layers each
            n_img = int((inputs["input_ids"][0] == model.config.image_token_id).sum())
            assert (counts[0, :, :, 0] == n_img).all()  # layer 0 left whole, as the scorer asked
            assert (counts[1:, :, :, 0] < n_img).all()
    finally:
        EVICTION_REGISTRY.pop("probe_for_budgets", None)


@pytest.mark.parametrize(
    "spec",
    [
        "adakv:scorer=expected_attention",
        "pyramidkv:scorer=kvzip",
        "pyramidkv:scorer=kvzip,head_budget=shared",
    ],
)
def test_the_question_agnostic_scorers_work_underneath_with_the_image_compressed_first(
    tiny_random_llava, tiny_random_llava_dir, spec
):
    """compress=image: the template head and the image are prefilled (and compressed) alone, then each
    question is generated on a copy of that cache; at batch 2 the totals are the uniform budget's."""
    model, processor = tiny_random_llava
    g = torch.Generator().manual_seed(9)
    imgs = [
        Image.fromarray((torch.rand(128, 128, 3, generator=g) * 255).to(torch.uint8).numpy())
        for _ in range(2)
    ]
    head = processor(images=imgs, text=["USER: <image>\n"] * 2, return_tensors="pt")
    cfg = OvalConfig.from_spec(spec, budget=0.25)
    if "kvzip" in spec:
        cfg.method_options["tokenizer"] = str(tiny_random_llava_dir)
    mm_oval.wrap(model, cfg)
    try:
        cache = prefill(model, **head)
        counts = _per_layer_counts(cache)[..., 0]  # (L, B, H) image tokens kept
        L, B, H = counts.shape
        k = max(math.ceil(0.25 * 64), int((cache.info.protected & (cache.info.modality == IMAGE)).sum(-1)[0]))
        if "pyramidkv" in spec:  # over the layers; per head unless the heads share
            total, want = (counts.sum((0, 2)), L * H * k) if "shared" in spec else (counts.sum(0), L * k)
        else:
            total, want = counts.sum(-1), H * k
        assert (total == want).all()
        q = processor.tokenizer(
            ["what color is it ? ASSISTANT:"] * 2, add_special_tokens=False, return_tensors="pt"
        )
        ids = torch.cat([head["input_ids"], q.input_ids], 1)
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache.copy(), max_new_tokens=3
        )
        assert out.shape == (2, ids.shape[1] + 3)
    finally:
        mm_oval.unwrap(model)
