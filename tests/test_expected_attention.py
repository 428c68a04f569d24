"""Expected Attention: hand-worked cases where it keeps what SnapKV and KeyDiff do not, the formula against
a direct computation, padding, budgets in the wrapped tiny LLaVA (both compress settings), and the seam
that hands a policy the layer's hidden states, attention module and RoPE."""

from __future__ import annotations

import math

import pytest
import torch
from PIL import Image

import mm_oval
from mm_oval.config import OvalConfig
from mm_oval.policies.base import IMAGE, PAD, TEXT, PrefillContext, Rope, make_eviction
from mm_oval.policies.expected import ExpectedAttention
from mm_oval.stats import get_stats
from mm_oval.wrapper import prefill, wrap_info

pytestmark = pytest.mark.usefixtures("one_thread")


def _angle_rope(inv_freq: torch.Tensor) -> Rope:
    """A rotary embedding in transformers' convention (angles p * inv_freq, the halves repeated)."""

    def rotary(x, position_ids):
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    return Rope(rotary)


IDENTITY = _angle_rope(torch.zeros(1))  # D = 2, no rotation at any position


def _ctx(queries, keys, values=None, positions=None, rope=IDENTITY, scaling=1.0, chunk=512) -> PrefillContext:
    """B=1, one head, all text, from lists of vectors."""
    q = torch.tensor(queries, dtype=torch.float32)[None, None]
    k = torch.tensor(keys, dtype=torch.float32)[None, None]
    v = torch.ones_like(k) if values is None else torch.tensor(values, dtype=torch.float32)[None, None]
    N = k.shape[2]
    return PrefillContext(
        layer_idx=0,
        keys=k,
        values=v,
        queries=q,
        positions=torch.arange(N)[None] if positions is None else positions,
        modality=torch.full((1, N), TEXT, dtype=torch.int8),
        image_rc=torch.full((1, N, 3), -1),
        scaling=scaling,
        chunk_size=chunk,
        rope=rope,
    )


# Four queries: three point along e1, the last along e2. Mean (1.5, 0.5); covariance
# 1/4 * (3 * (0.5, -0.5)(0.5, -0.5)^T + (-1.5, 1.5)(-1.5, 1.5)^T) = 0.75 * [[1, -1], [-1, 1]].
QUERIES = [[2.0, 0.0], [2.0, 0.0], [2.0, 0.0], [0.0, 2.0]]


def test_hand_worked_it_keeps_the_key_typical_queries_read_where_snapkv_and_keydiff_keep_others():
    keys = [[1.0, 0.0], [0.0, 1.0], [-1.0, 0.2], [1.0, 0.0]]
    ctx = _ctx(QUERIES, keys)
    ea = make_eviction("expected_attention", n_sink=0, use_vnorm=False).score(ctx)[0, 0]
    # logits mu.k + k^T S k / 2: k0 1.5 + 0.375, k1 0.5 + 0.375, k2 -1.4 + 0.54, k3 as k0
    torch.testing.assert_close(ea, torch.softmax(torch.tensor([1.875, 0.875, -0.86, 1.875]), 0))
    snap = make_eviction("snapkv", window=1, kernel=1).score(ctx)[0, 0]  # the last query (0, 2) votes
    kd = make_eviction("keydiff").score(ctx)[0, 0]  # k2 points away from the mean key direction
    assert int(ea[:3].argmax()) == 0  # the key the typical (mean) query reads
    assert int(snap[:3].argmax()) == 1  # the key the last query reads
    assert int(kd[:3].argmax()) == 2  # the outlier key
    # value norms weight the scores: (a + epsilon) * |v|
    vals = [[1.0, 0.0], [0.0, 3.0], [1.0, 0.0], [0.0, 1.0]]
    weighted = make_eviction("expected_attention", n_sink=0, epsilon=0.1).score(_ctx(QUERIES, keys, vals))
    torch.testing.assert_close(weighted[0, 0], (ea + 0.1) * torch.tensor([1.0, 3.0, 1.0, 1.0]))


def test_hand_worked_the_covariance_term_favours_keys_along_the_queries_spread():
    # k1 = (1, -1) lies along the queries' high-variance direction (variance 1.5): mu.k = 1.0 but
    # k^T S k / 2 = 1.5, so with the covariance it outranks k0 = (1, 0) (1.5 + 0.375); without, it does not
    ctx = _ctx(QUERIES, [[1.0, 0.0], [1.0, -1.0], [0.0, 1.0], [1.0, 0.0]])
    with_cov = make_eviction("expected_attention", n_sink=0, use_vnorm=False).score(ctx)[0, 0]
    mean_only = make_eviction("expected_attention", n_sink=0, use_vnorm=False, use_covariance=False)
    mean_only = mean_only.score(ctx)[0, 0]
    torch.testing.assert_close(with_cov, torch.softmax(torch.tensor([1.875, 2.5, 0.875, 1.875]), 0))
    torch.testing.assert_close(mean_only, torch.softmax(torch.tensor([1.5, 1.0, 0.5, 1.5]), 0))
    assert int(with_cov[:3].argmax()) == 1 and int(mean_only[:3].argmax()) == 0


def test_hand_worked_the_mean_query_is_moved_to_the_positions_after_the_prompt():
    # RoPE of 90 degrees per position. Every query is (2, 0) before RoPE (so no covariance); as cached the
    # four are rotated by 0, 90, 180, 270 degrees. The next two positions (4, 5) rotate by 360 and 450
    # degrees: their mean rotation takes (2, 0) to ((2, 0) + (0, 2)) / 2 = (1, 1).
    rope = _angle_rope(torch.tensor([math.pi / 2]))
    queries = [[2.0, 0.0], [0.0, 2.0], [-2.0, 0.0], [0.0, -2.0]]
    keys = [[1.0, 0.0], [0.0, 1.0], [-1.0, 1.0], [2.0, 2.0]]
    ctx = _ctx(queries, keys, rope=rope, chunk=3)
    two = make_eviction("expected_attention", n_sink=0, use_vnorm=False, n_future_positions=2).score(ctx)
    torch.testing.assert_close(two[0, 0], torch.softmax(torch.tensor([1.0, 1.0, 0.0, 4.0]), 0))
    one = make_eviction("expected_attention", n_sink=0, use_vnorm=False, n_future_positions=1).score(ctx)
    torch.testing.assert_close(one[0, 0], torch.softmax(torch.tensor([2.0, 0.0, -2.0, 4.0]), 0))  # (2, 0)


def _rotation(angles: torch.Tensor) -> torch.Tensor:
    """(D/2,) angles -> the (D, D) RoPE matrix: channel pairs (i, i + D/2) rotated by angles[i]."""
    h = angles.shape[0]
    R = torch.zeros(2 * h, 2 * h, dtype=torch.float64)
    for i, a in enumerate(angles.double().tolist()):
        c, s = math.cos(a), math.sin(a)
        R[i, i], R[i, i + h], R[i + h, i], R[i + h, i + h] = c, -s, s, c
    return R


def _direct(pre_q, keys, values, positions, valid, inv_freq, scaling, n_future, n_sink, cov_on, vnorm, eps):
    """Expected Attention written out per sample, head and key, in float64, from the queries before RoPE
    (B, Hq, N, D) and the keys as cached (B, Hkv, N, D): kvpress's formula with explicit rotation matrices."""
    B, Hq, N, D = pre_q.shape
    Hkv = keys.shape[1]
    G = Hq // Hkv
    out = torch.zeros(B, Hkv, N, dtype=torch.float64)
    for b in range(B):
        ok = [n for n in range(N) if valid[b, n]]
        stat = [n for n in ok if positions[b, n] >= n_sink]
        nxt = int(positions[b].max()) + 1
        Rbar = sum(_rotation(p * inv_freq) for p in range(nxt, nxt + n_future)) / n_future
        for h in range(Hkv):
            probs = torch.zeros(G, N, dtype=torch.float64)
            for g in range(G):
                x = pre_q[b, h * G + g, stat].double()  # (n, D)
                mu = Rbar @ x.mean(0)
                S = Rbar @ torch.cov(x.T, correction=0) @ Rbar.T
                logit = {}
                for n in stat:
                    k = keys[b, h, n].double()
                    logit[n] = scaling * mu @ k + (0.5 * scaling**2 * k @ S @ k if cov_on else 0.0)
                z = torch.tensor(list(logit.values()))
                for n, p in zip(logit, torch.softmax(z, 0)):
                    probs[g, n] = p
            a = probs.mean(0)
            if vnorm:
                a = (a + eps) * values[b, h].double().norm(dim=-1)
            for n in range(N):
                out[b, h, n] = a[n] if n in stat else 0.0
        top = out[b].max() + 1
        for n in ok:
            if positions[b, n] < n_sink:
                out[b, :, n] = top
    return out


def _random_ctx(rope, B=2, Hkv=2, G=2, N=23, D=8, pad=(0, 4), seed=0, chunk=5):
    g = torch.Generator().manual_seed(seed)
    modality = torch.full((B, N), TEXT, dtype=torch.int8)
    modality[:, 6:14] = IMAGE
    positions = torch.arange(N).repeat(B, 1)
    for b, p in enumerate(pad):
        modality[b, :p] = PAD
        positions[b] = torch.arange(N) - p
        positions[b, :p] = -1
    pre_q = torch.randn(B, Hkv * G, N, D, generator=g) + torch.randn(1, Hkv * G, 1, D, generator=g)
    queries = rope.rotate(pre_q, positions)
    keys = torch.randn(B, Hkv, N, D, generator=g)
    values = torch.randn(B, Hkv, N, D, generator=g)
    for b, p in enumerate(pad):  # padding holds garbage: it must not count
        queries[b, :, :p] = 1e4
        keys[b, :, :p] = -1e4
        values[b, :, :p] = 1e4
    ctx = PrefillContext(
        layer_idx=0, keys=keys, values=values, queries=queries, positions=positions, modality=modality,
        image_rc=torch.full((B, N, 3), -1), scaling=D**-0.5, chunk_size=chunk, rope=rope,
    )  # fmt: skip
    return ctx, pre_q


INV_FREQ = 1.0 / (10.0 ** (torch.arange(0, 8, 2).float() / 8))  # RoPE base 10, head dim 8: visible turns


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"use_covariance": False},
        {"use_vnorm": False, "n_sink": 0},
        {"epsilon": 0.05, "n_sink": 7, "n_future_positions": 3},
    ],
)
def test_scores_equal_the_formula_computed_directly(options):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10.0
    )
    rope = Rope(LlamaRotaryEmbedding(cfg))
    torch.testing.assert_close(rope.cos_sin(torch.tensor([[5]]))[0][0, 0, :4], (5 * INV_FREQ).cos())
    ctx, pre_q = _random_ctx(rope)
    pol = ExpectedAttention(**{"n_future_positions": 16, **options})
    got = pol.score(ctx)
    want = _direct(
        pre_q, ctx.keys, ctx.values, ctx.positions, ctx.valid, INV_FREQ, ctx.scaling,
        pol.n_future_positions, pol.n_sink, pol.use_covariance, pol.use_vnorm, pol.epsilon,
    )  # fmt: skip
    v = ctx.valid[:, None, :].expand_as(got)
    torch.testing.assert_close(got[v].double(), want[v], atol=1e-5, rtol=1e-4)
    sinks = ctx.valid & (ctx.positions < pol.n_sink)
    if pol.n_sink:  # the sinks rank above every other token of their sample
        for b in range(2):
            assert (got[b][:, sinks[b]].amin() > got[b][:, ~sinks[b] & ctx.valid[b]].amax()).item()


def test_left_padding_and_batch_mates_do_not_change_a_samples_scores():
    rope = _angle_rope(INV_FREQ)
    ctx, _ = _random_ctx(rope, pad=(0, 6), seed=1)
    pol = make_eviction("expected_attention", n_future_positions=8, epsilon=0.01)
    both = pol.score(ctx)
    for b, p in ((0, 0), (1, 6)):
        alone = PrefillContext(
            layer_idx=0, keys=ctx.keys[b : b + 1, :, p:], values=ctx.values[b : b + 1, :, p:],
            queries=ctx.queries[b : b + 1, :, p:], positions=ctx.positions[b : b + 1, p:],
            modality=ctx.modality[b : b + 1, p:], image_rc=ctx.image_rc[b : b + 1, p:], scaling=ctx.scaling,
            chunk_size=4, rope=rope,
        )  # fmt: skip
        torch.testing.assert_close(both[b : b + 1, :, p:], pol.score(alone), atol=1e-6, rtol=1e-5)


def test_options_come_through_the_method_spec_and_bad_ones_are_refused():
    cfg = OvalConfig.from_spec("expected_attention:n_future_positions=64,use_covariance=false,epsilon=0")
    pol = make_eviction(cfg.method, **cfg.method_options)
    assert (pol.n_future_positions, pol.use_covariance, pol.use_vnorm, pol.epsilon) == (64, False, True, 0.0)
    assert ExpectedAttention() == ExpectedAttention(512, 4, True, True, 0.0)  # kvpress's defaults
    assert ExpectedAttention.comparable_across_heads
    for bad, match in (
        ({"n_future_positions": 0}, "n_future_positions must be an int >= 1"),
        ({"n_sink": -1}, "n_sink must be an int >= 0"),
        ({"use_vnorm": "yes"}, "use_vnorm must be true or false"),
        ({"epsilon": -0.1}, "epsilon must be a number >= 0"),
        ({"window": 8}, "bad options"),
    ):
        with pytest.raises(mm_oval.ConfigError, match=match):
            make_eviction("expected_attention", **bad)


# ---- in the wrapped tiny LLaVA ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def inputs(llava_batch):
    texts = [
        "USER: <image>\nwhat color is the circle ? ASSISTANT:",
        "USER: <image>\nhow many objects ? ASSISTANT:",
    ]
    enc = llava_batch(texts, seed=3)
    assert not bool(enc["attention_mask"][1].all())  # the second prompt is left-padded
    return enc


@pytest.mark.parametrize(
    "scope, head_budget", [("image", "uniform"), ("all", "uniform"), ("image", "shared")]
)
def test_it_keeps_exactly_its_budget_in_the_wrapped_model(tiny_random_llava, inputs, scope, head_budget):
    model, _ = tiny_random_llava
    try:
        mm_oval.wrap(
            model, method="expected_attention", budget=0.25, eviction_scope=scope, head_budget=head_budget,
            sink_tokens=0, recent_tokens=0,
        )  # fmt: skip
        assert wrap_info(model).attn_implementation == "sdpa"
        cache = prefill(model, **inputs)
        n_img = int((inputs["input_ids"][0] == model.config.image_token_id).sum())
        n_valid = inputs["attention_mask"].sum(-1)
        for layer in cache.layers:
            kept = layer.slot_valid.sum(-1)  # (B, Hkv)
            img = ((layer.slot_mod == IMAGE) & layer.slot_valid).sum(-1)
            if head_budget == "shared":  # the layer's heads share 2 x 16 image slots
                assert (img.sum(-1) == 32).all() and (kept.sum(-1) == 2 * (n_valid - n_img + 16)).all()
                continue
            assert (kept == (n_valid - n_img + 16).view(-1, 1)).all()  # 25% of 64 image tokens, same total
            if scope == "image":
                assert img.eq(16).all()
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        assert out.shape == (2, inputs["input_ids"].shape[1] + 3)
        assert get_stats(model)["method"] == "expected_attention"
    finally:
        mm_oval.unwrap(model)


class _Probe(ExpectedAttention):
    """Expected Attention that also asks for hidden states and records what each layer handed it."""

    needs_hidden_states = True

    def __init__(self, **kw):
        super().__init__(**kw)
        self.seen: list[PrefillContext] = []

    def score(self, ctx):
        self.seen.append(ctx)
        return super().score(ctx)


class _PlainProbe(_Probe):
    needs_hidden_states = False


def test_the_seam_hands_hidden_states_module_and_rope_and_the_scores_match_kvpress_route(
    tiny_random_llava, inputs
):
    """A policy with needs_hidden_states gets each layer's attention input, the attention module and the
    model's RoPE; queries formed from them (kvpress's route: q_proj of the hidden states) equal the cached
    queries with RoPE undone, and Expected Attention's scores equal the formula computed from them."""
    model, _ = tiny_random_llava
    lm = model.model.language_model
    attn_inputs: dict[int, tuple] = {}

    def record(module, args, kwargs):
        attn_inputs.setdefault(module.layer_idx, (kwargs["hidden_states"], kwargs["position_embeddings"]))

    hooks = [layer.self_attn.register_forward_pre_hook(record, with_kwargs=True) for layer in lm.layers]
    try:
        probe = _Probe(n_future_positions=32)
        mm_oval.wrap(model, method="expected_attention", budget=0.25, eviction_policy=probe)
        model.generate(**inputs, max_new_tokens=1, do_sample=False)  # positions from the attention mask
        assert len(probe.seen) == len(lm.layers)
        inv_freq = lm.rotary_emb.inv_freq
        for ctx in probe.seen:
            hidden, (cos, sin) = attn_inputs[ctx.layer_idx]
            assert ctx.module is lm.layers[ctx.layer_idx].self_attn
            assert ctx.hidden_states is hidden
            v = ctx.valid
            got_cos, got_sin = ctx.rope.cos_sin(ctx.positions)
            torch.testing.assert_close(got_cos[v], cos[v].float())
            torch.testing.assert_close(got_sin[v], sin[v].float())
            pre_q = ctx.prerope_queries()  # (B, Hq, N, D), from the hidden states
            undone = ctx.rope.rotate(ctx.queries, ctx.positions, inverse=True)
            vq = v[:, None, :].expand(pre_q.shape[:3])
            torch.testing.assert_close(pre_q[vq], undone[vq], atol=1e-5, rtol=1e-5)
            want = _direct(
                pre_q.detach(), ctx.keys, ctx.values, ctx.positions, v, inv_freq, ctx.scaling,
                32, probe.n_sink, True, True, 0.0,
            )  # fmt: skip
            got = ExpectedAttention(n_future_positions=32).score(ctx)
            vk = v[:, None, :].expand_as(got)
            torch.testing.assert_close(got[vk].double(), want[vk], atol=1e-5, rtol=1e-4)
        # a method that does not ask for hidden states gets none, and no layer keeps them
        plain = _PlainProbe()
        mm_oval.wrap(model, method="expected_attention", budget=0.25, eviction_policy=plain)
        cache = prefill(model, **inputs)
        assert all(ctx.hidden_states is None for ctx in plain.seen)
        assert cache.step.attention_inputs == {}
    finally:
        for h in hooks:
            h.remove()
        mm_oval.unwrap(model)


def test_it_compresses_right_after_the_image_and_answers_on_a_copy(tiny_random_llava):
    """compress='image': the prompt head (up to the image) is prefilled and compressed alone, then the
    question is read through a copy of that cache (eval's generate_image_first does this)."""
    model, processor = tiny_random_llava
    g = torch.Generator().manual_seed(5)
    imgs = [
        Image.fromarray((torch.rand(128, 128, 3, generator=g) * 255).to(torch.uint8).numpy()) for _ in "ab"
    ]
    texts = ["USER: <image>\nwhat color ? ASSISTANT:", "USER: <image>\nwhat shape ? ASSISTANT:"]
    enc = processor(images=imgs, text=texts, return_tensors="pt", padding=True)
    ids = enc["input_ids"]
    is_img = ids == model.config.image_token_id
    end = int(torch.arange(ids.shape[1]).masked_fill(~is_img[0], -1).max()) + 1
    head = {"input_ids": ids[:, :end], "attention_mask": torch.ones_like(ids[:, :end])}
    try:
        probe = _Probe(n_future_positions=8)
        mm_oval.wrap(
            model,
            method="expected_attention",
            budget=0.25,
            sink_tokens=0,
            recent_tokens=0,
            eviction_policy=probe,
        )
        with torch.inference_mode():
            cache = prefill(model, **head, pixel_values=enc["pixel_values"])
            for layer in cache.layers:
                img = ((layer.slot_mod == IMAGE) & layer.slot_valid).sum(-1)
                assert img.eq(16).all() and layer.slot_valid.sum(-1).eq(end - 64 + 16).all()
            # the future the statistics were moved to starts where the question will
            assert all(int(ctx.positions.amax()) == end - 1 for ctx in probe.seen)
            seq = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache.copy(), max_new_tokens=2,
                do_sample=False,
            )  # fmt: skip
        assert seq.shape == (2, ids.shape[1] + 2)
        assert cache.layers[0].n_decode == 0  # the copy answered; the compressed image is reusable
    finally:
        mm_oval.unwrap(model)
