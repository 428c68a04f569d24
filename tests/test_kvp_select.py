"""The redundancy-aware selection over KVP scores: a small budget covers distinct image content before it
keeps a second copy of anything, text tokens keep the agents' order, and settings come from the agents'
config unless overridden."""

import json

import pytest
import torch

from mm_oval.core import topk_mask
from mm_oval.errors import ConfigError
from mm_oval.policies.base import IMAGE, PAD, TEXT
from mm_oval.policies.kvp import KVPPolicy
from mm_oval.policies.kvp_agents import KVPAgentConfig, KVPAgents
from mm_oval.policies.kvp_io import save_agents
from mm_oval.policies.kvp_select import RedundancySelection, redundancy_scores


def scene(groups: list[tuple[int, float]], text: int = 2, side: int = 8, d: int = 16):
    """One head: `text` text tokens, then image tokens in groups of identical keys (n tokens each, all scored
    `score` plus a tiny per-token tie-break), laid out along the patch raster."""
    torch.manual_seed(0)
    basis = torch.linalg.qr(torch.randn(d, d)).Q
    keys, scores, rc, mod, gid = [], [], [], [], []
    for t in range(text):
        keys.append(torch.randn(d))
        scores.append(-1.0 - t)
        rc.append([-1, -1, -1])
        mod.append(TEXT)
        gid.append(-1)
    p = 0
    for g, (n, s) in enumerate(groups):
        for i in range(n):
            keys.append(basis[g])
            scores.append(s - 1e-3 * i)
            rc.append([0, p // side, p % side])
            mod.append(IMAGE)
            gid.append(g)
            p += 1
    return (
        torch.tensor(scores)[None, None],
        torch.stack(keys)[None, None],
        torch.tensor(mod, dtype=torch.int8)[None],
        torch.tensor(rc)[None],
        torch.tensor(gid),
    )


def kept_groups(scores, mod, gid, k: int) -> list[int]:
    keep = topk_mask(scores, (mod == IMAGE)[:, None, :], torch.tensor([[k]]))[0, 0]
    return sorted(gid[keep].tolist())


def test_off_leaves_the_scores_alone():
    s, k, m, rc, _ = scene([(5, 0.0), (3, -1.0)])
    assert torch.equal(redundancy_scores(s, k, m, rc, RedundancySelection()), s)


def test_a_small_budget_covers_every_group_before_a_second_copy():
    # group 0: 12 identical tokens scored highest; groups 1 and 2 score lower
    s, k, m, rc, gid = scene([(12, 2.0), (4, 0.5), (4, 0.0)])
    assert kept_groups(s, m, gid, 3) == [0, 0, 0]  # the agents' own order spends the budget on group 0
    out = redundancy_scores(s, k, m, rc, RedundancySelection(redundancy=4.0))
    assert kept_groups(out, m, gid, 3) == [0, 1, 2]
    # once every group is covered, the agents' order decides again
    assert kept_groups(out, m, gid, 6) == [0, 0, 0, 0, 1, 2]
    # the image scores are the agents' own, reordered (same values up to the strict-order nudge)
    img = m[0] == IMAGE
    assert torch.allclose(out[0, 0, img].sort().values, s[0, 0, img].sort().values, atol=0.01)


def test_text_keeps_its_scores_and_padding_stays_last():
    s, k, m, rc, gid = scene([(6, 1.0), (2, 0.0)], text=3)
    m[0, 0] = PAD
    s[0, 0, 0] = float("-inf")
    out = redundancy_scores(s, k, m, rc, RedundancySelection(redundancy=2.0, sigma=2.0))
    txt = m[0] == TEXT
    assert torch.equal(out[0, 0, txt], s[0, 0, txt])
    assert out[0, 0, 0] == float("-inf")


def test_the_spatial_term_spreads_a_group_over_the_grid():
    # one group of 16 identical tokens on two rows of 8: with sigma, the second pick is far from the first
    s, k, m, rc, gid = scene([(16, 1.0)], text=0)
    out = redundancy_scores(s, k, m, rc, RedundancySelection(redundancy=4.0, sigma=2.0))
    top2 = out[0, 0].topk(2).indices
    assert float((rc[0, top2[0], 1:] - rc[0, top2[1], 1:]).float().norm()) >= 5
    plain = s[0, 0].topk(2).indices  # the agents' tie-break: neighbours
    assert abs(int(rc[0, plain[0], 2]) - int(rc[0, plain[1], 2])) == 1


def test_batched_rows_of_different_lengths_match_one_by_one():
    a = scene([(6, 1.0), (3, 0.0)])
    b = scene([(4, 0.5), (2, 0.2), (2, 0.0)])
    sel = RedundancySelection(redundancy=3.0, sigma=1.5)
    n = max(a[0].shape[-1], b[0].shape[-1])

    def pad(one):  # left padding, as the harness batches
        s, k, m, rc, _ = one
        w = n - s.shape[-1]
        return (
            torch.cat([torch.full((1, 1, w), float("-inf")), s], -1),
            torch.cat([torch.zeros(1, 1, w, k.shape[-1]), k], 2),
            torch.cat([torch.full((1, w), PAD, dtype=m.dtype), m], -1),
            torch.cat([torch.full((1, w, 3), -1, dtype=rc.dtype), rc], 1),
        )

    pa, pb = pad(a), pad(b)
    batch = [torch.cat([x, y], 0) for x, y in zip(pa, pb)]
    out = redundancy_scores(*batch, sel)
    for row, one in ((0, a), (1, b)):
        alone = redundancy_scores(*one[:4], sel)
        w = n - one[0].shape[-1]
        assert torch.equal(out[row, 0, w:].argsort(descending=True), alone[0, 0].argsort(descending=True))


def test_the_policy_reads_the_selection_from_the_agents_config(tmp_path):
    agents = KVPAgents(
        KVPAgentConfig(num_layers=1, num_kv_heads=1, head_dim=16, proj=8, hidden=8, pos_table=64)
    )
    save_agents(agents, tmp_path, {})
    assert not KVPPolicy(agents=tmp_path).selection.active
    cfg = json.loads((tmp_path / "kvp_config.json").read_text())
    cfg["selection"] = {"redundancy": 2.0, "sigma": 3.0}
    (tmp_path / "kvp_config.json").write_text(json.dumps(cfg))
    assert KVPPolicy(agents=tmp_path).selection == RedundancySelection(2.0, 3.0)
    assert KVPPolicy(agents=tmp_path, redundancy=0).selection == RedundancySelection(0.0, 3.0)
    cfg["selection"] = {"redundancy": -1}
    (tmp_path / "kvp_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"selection: KVP option redundancy must be a number >= 0"):
        KVPPolicy(agents=tmp_path)
    cfg["selection"] = {"lambda": 1}
    (tmp_path / "kvp_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unknown selection settings"):
        KVPPolicy(agents=tmp_path)


def test_a_row_with_fewer_image_tokens_keeps_its_order_when_the_first_token_is_an_image_token():
    # row 0: 6 image tokens from index 0 on; row 1: 10, so row 0 runs out of tokens 4 steps early
    a = scene([(4, 1.0), (2, 0.0)], text=0)
    b = scene([(8, 1.0), (2, 0.0)], text=0)
    n = b[0].shape[-1]
    w = n - a[0].shape[-1]
    s = torch.cat([torch.cat([a[0], torch.full((1, 1, w), float("-inf"))], -1), b[0]], 0)
    k = torch.cat([torch.cat([a[1], torch.zeros(1, 1, w, a[1].shape[-1])], 2), b[1]], 0)
    m = torch.cat([torch.cat([a[2], torch.full((1, w), PAD, dtype=a[2].dtype)], -1), b[2]], 0)
    rc = torch.cat([torch.cat([a[3], torch.full((1, w, 3), -1, dtype=a[3].dtype)], 1), b[3]], 0)
    sel = RedundancySelection(redundancy=3.0)
    out = redundancy_scores(s, k, m, rc, sel)
    alone = redundancy_scores(*a[:4], sel)
    assert torch.equal(
        out[0, 0, : a[0].shape[-1]].argsort(descending=True), alone[0, 0].argsort(descending=True)
    )


@pytest.mark.parametrize("k", [1, 7, 29, 64])
def test_a_walk_stopped_at_the_budget_keeps_what_the_whole_walk_keeps(k):
    """Stopping the greedy walk after the most tokens a head keeps (PrefillContext.image_keep) gives the
    same top-k image tokens per head as the whole walk, for any budget up to it; the tokens it did not
    reach keep finite scores below the picked ones."""
    g = torch.Generator().manual_seed(k)
    B, H, side, D = 2, 3, 8, 16
    n_img, n_txt = side * side, 5
    N = n_txt + n_img
    modality = torch.full((B, N), TEXT, dtype=torch.int8)
    modality[:, n_txt:] = IMAGE
    rc = torch.full((B, N, 3), -1, dtype=torch.long)
    r, c = torch.div(torch.arange(n_img), side, rounding_mode="floor"), torch.arange(n_img) % side
    rc[:, n_txt:, 0], rc[:, n_txt:, 1], rc[:, n_txt:, 2] = 0, r, c
    keys = torch.randn(B, H, N, D, generator=g)
    scores = torch.randn(B, H, N, generator=g)
    sel = RedundancySelection(redundancy=4.0, sigma=3.0)
    whole = redundancy_scores(scores, keys, modality, rc, sel)
    cut = redundancy_scores(scores, keys, modality, rc, sel, max_picks=k)
    img = slice(n_txt, N)
    for kk in {1, k // 2 or 1, k}:
        top_whole = whole[..., img].topk(kk, dim=-1).indices.sort(-1).values
        top_cut = cut[..., img].topk(kk, dim=-1).indices.sort(-1).values
        assert torch.equal(top_whole, top_cut)
    assert torch.isfinite(cut[..., img]).all()
    assert torch.equal(cut[..., :n_txt], scores[..., :n_txt].float())  # text keeps the agents' scores


@pytest.mark.parametrize("budget", [0.1, 0.25])
def test_the_cache_stops_the_walk_at_the_budget_and_keeps_the_same_tokens(budget, monkeypatch):
    """Through the cache, the walk stops at the layer's per-head image count (`image_keep`) and keeps the
    tokens the whole walk keeps; with a shared head budget the bound is the layer's heads' counts together
    (one head may keep them all), and the kept tokens are again the whole walk's."""
    from PIL import Image

    import mm_oval
    import mm_oval.cache.prefill as prefill_mod
    from mm_oval.allocation import Allocation
    from mm_oval.modelfiles import load_model
    from mm_oval.wrapper import prefill

    model, processor = load_model("bundled")
    g = torch.Generator().manual_seed(0)
    imgs = [
        Image.fromarray((torch.rand(128, 128, 3, generator=g) * 255).to(torch.uint8).numpy())
        for _ in range(2)
    ]
    inputs = processor(
        images=imgs, text=["USER: <image>\nwhat color is the circle ? ASSISTANT:"] * 2, return_tensors="pt"
    )
    spec = f"kvp:agents=bundled-image,redundancy=4,sigma=3,budget={budget},sink_tokens=3,recent_tokens=0"
    seen = []
    real = prefill_mod.image_keep
    monkeypatch.setattr(prefill_mod, "image_keep", lambda layer, p: seen.append(real(layer, p)) or seen[-1])
    mm_oval.wrap(model, mm_oval.OvalConfig.from_spec(spec))
    cut = [layer.store.p_src.clone() for layer in prefill(model, **inputs).layers]
    assert seen and all(k == -(-64 * budget // 1) for k in seen)  # 64 image tokens, the budget's count
    monkeypatch.setattr(prefill_mod, "image_keep", lambda layer, p: None)
    whole = [layer.store.p_src.clone() for layer in prefill(model, **inputs).layers]
    assert all(torch.equal(a.sort(-1).values, b.sort(-1).values) for a, b in zip(cut, whole))
    monkeypatch.setattr(prefill_mod, "image_keep", real)
    mm_oval.unwrap(model)
    shared = spec.replace("agents=bundled-image", "agents=bundled-image-joint") + ",head_budget=shared"
    mm_oval.wrap(model, mm_oval.OvalConfig.from_spec(shared))
    cache = prefill(model, **inputs)
    H = cache.layers[0].keys.shape[1]
    alloc = Allocation.of(cache.eviction, cache.config.head_budget)
    assert prefill_mod.image_keep(cache.layers[0], alloc) == min(64, H * -(-64 * budget // 1))
    cut = [layer.store.p_src.clone() for layer in cache.layers]
    monkeypatch.setattr(prefill_mod, "image_keep", lambda layer, p: None)
    whole = [layer.store.p_src.clone() for layer in prefill(model, **inputs).layers]
    assert all(torch.equal(a.sort(-1).values, b.sort(-1).values) for a, b in zip(cut, whole))
    mm_oval.unwrap(model)
