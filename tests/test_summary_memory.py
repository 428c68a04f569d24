"""Building page summaries without large temporaries: the cache summarises a layer in chunks of pages whose
summaries are those of one call over all the pages."""

import pytest
import torch

import mm_oval
from mm_oval.cache import summaries as cache_mod
from mm_oval.config import OvalConfig
from mm_oval.wrapper import prefill, wrap_info

pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs(processor, n: int = 2):
    from PIL import Image

    g = torch.Generator().manual_seed(5)
    imgs = [
        Image.fromarray((torch.rand(128, 128, 3, generator=g) * 255).to(torch.uint8).numpy())
        for _ in range(n)
    ]
    texts = ["USER: <image>\nwhat color is the circle ? ASSISTANT:", "USER: <image>\nhow many ? ASSISTANT:"][
        :n
    ]
    return processor(images=imgs, text=texts, return_tensors="pt", padding=True)


@pytest.mark.parametrize(
    "retrieval,options,method",
    [
        ("oval", {"eta": 0.5, "summary_format": "float"}, "full"),
        ("locks", {}, "snapkv"),  # the compact record (the default)
        ("quest", {}, "full"),
        ("router", None, "full"),
    ],
)
def test_summaries_built_in_chunks_of_pages_equal_those_built_at_once(
    tiny_random_llava, monkeypatch, tmp_path, retrieval, options, method
):
    model, processor = tiny_random_llava
    if options is None:  # a router of the model's shapes (random weights)
        from mm_oval.policies.router import HybridRouter, RouterConfig, save_router

        text = model.config.text_config
        torch.manual_seed(0)
        shapes = RouterConfig(text.hidden_size, text.num_hidden_layers, text.num_key_value_heads)
        options = {"weights": str(save_router(HybridRouter(shapes), tmp_path))}
    inputs = _inputs(processor)
    budget = {"budget": 0.5} if method != "full" else {}
    cfg = OvalConfig(method=method, retrieval=retrieval, retrieval_options=options, **budget)
    wrapped = mm_oval.wrap(model, cfg)
    calls: list[int] = []
    policy = wrap_info(wrapped).retrieval
    real = policy.summarize

    def counting(pages):
        calls.append(pages.keys.shape[2])
        return real(pages)

    try:
        monkeypatch.setattr(policy, "summarize", counting)
        monkeypatch.setattr(cache_mod, "SUMMARY_TEMP_SHARE", 1e9)  # every page in one call
        once = prefill(wrapped, **inputs)
        n_once = len(calls)
        calls.clear()
        monkeypatch.setattr(cache_mod, "SUMMARY_TEMP_SHARE", 1e-9)  # one page per call
        monkeypatch.setattr(cache_mod, "SUMMARY_TEMP_FLOOR", 0)
        chunked = prefill(wrapped, **inputs)
    finally:
        mm_oval.unwrap(wrapped)
    n_layers = len(once.layers)
    assert n_once == n_layers  # one call per layer
    assert calls and set(calls) == {1}
    for a, b in zip(once.layers, chunked.layers):
        assert len(calls) >= a.prompt_pages
        assert a.summaries.keys() == b.summaries.keys()
        if "basis_q" in a.summaries:  # compact: the same records up to a level where rounding tied
            _same_compact_records(a.summaries, b.summaries)
            continue
        for name in a.summaries:
            x, y = a.summaries[name], b.summaries[name]
            if retrieval == "quest":  # min and max of the keys: exact
                assert torch.equal(x, y), name
            else:  # batched products and eigh over fewer pages may round the last bit otherwise
                assert torch.allclose(x, y, rtol=1e-5, atol=1e-6), name


def _same_compact_records(a: dict, b: dict) -> None:
    """Two compact LOCKS / OVAL records of the same pages, their float bases computed in batches of other
    sizes. What a record stands for is each token's approximate key, centroid + coefficients x basis (a
    page left with fewer tokens than the rank after eviction has basis columns that no coefficient uses,
    and eigh may return any of them); those agree up to the quantisation's rounding of last-bit ties."""
    from mm_oval.policies.page_summaries import expand_page_bases

    (mu_a, basis_a, coef_a), (mu_b, basis_b, coef_b) = expand_page_bases(a), expand_page_bases(b)
    keys_a = mu_a.unsqueeze(-2) + coef_a @ basis_a.transpose(-1, -2)
    keys_b = mu_b.unsqueeze(-2) + coef_b @ basis_b.transpose(-1, -2)
    used = coef_a.abs().sum(-1, keepdim=True) > 0  # the rows of real tokens (padding rows are zero)
    spread = keys_a.abs().amax()
    assert torch.allclose(mu_a, mu_b, atol=float(mu_a.abs().amax()) / 100)
    err = ((keys_a - keys_b).abs() * used).amax()
    assert err <= 0.01 * spread, float(err / spread)


def _first_layer_chunk(tiny_random_llava):
    """The first layer of an OVAL cache after prefill: (layer, its KV shape, the prompt pages' width, the
    pages `summarize` takes per call)."""
    model, processor = tiny_random_llava
    wrapped = mm_oval.wrap(model, OvalConfig(retrieval="oval"))
    try:
        cache = prefill(wrapped, **_inputs(processor))
    finally:
        mm_oval.unwrap(wrapped)
    layer = cache.layers[0]
    T = cache_mod.page_width(layer, 0, layer.prompt_pages)
    return layer, layer.keys.shape, T, cache_mod.summary_chunk(layer, T)


def test_the_chunk_keeps_its_temporaries_within_the_share_of_the_layers_kv(tiny_random_llava, monkeypatch):
    monkeypatch.setattr(cache_mod, "SUMMARY_TEMP_FLOOR", 0)  # the tiny model's KV is far below the floor
    layer, (B, H, L, D), T, step = _first_layer_chunk(tiny_random_llava)
    kv = 2 * layer.keys.numel() * layer.keys.element_size()
    padded_fp32 = 2 * B * H * step * T * D * 4  # the chunk's keys and values in fp32 alone
    assert step >= 1 and padded_fp32 <= cache_mod.SUMMARY_TEMP_SHARE * kv


def test_a_short_prompt_is_summarised_in_one_call_per_layer_under_the_floor(tiny_random_llava):
    """A layer whose KV is small is not cut into calls of a page or two: the floor lets its summaries be
    built at once, while the temporaries stay within the floor."""
    layer, (B, H, L, D), T, step = _first_layer_chunk(tiny_random_llava)
    assert step >= layer.prompt_pages
    assert 2 * B * H * layer.prompt_pages * T * D * 4 <= cache_mod.SUMMARY_TEMP_FLOOR
