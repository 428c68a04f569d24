"""What the router's page record costs: at LLaVA-1.5-7B's ratio of widths (hidden = KV heads x head dim, head
dim 128) in bf16, its summaries hold at most 15% of the KV bytes they index, and building them holds at
most one layer's KV bytes of temporaries at any time (no fp32 copy of the prompt's embeddings)."""

import weakref

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import mm_oval
from mm_oval.cache import PagedLayer
from mm_oval.cache import summaries as summaries_mod
from mm_oval.config import OvalConfig
from mm_oval.policies.router import HybridRouter, RouterConfig, save_router
from mm_oval.stats import cache_stats
from mm_oval.wrapper import prefill
from mm_oval.zoo.model import TinyLlavaSizes, build_tiny_llava

pytestmark = pytest.mark.usefixtures("one_thread")


class PeakLiveBytes(TorchDispatchMode):
    """The most bytes that tensors allocated inside the mode held at once: each op output with storage of
    its own counts until the last tensor on that storage is freed (views of the op's inputs are not new)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.refs: dict[int, int] = {}  # storage address -> tensors alive on it
        self.size: dict[int, int] = {}

    def _release(self, ptr: int) -> None:
        self.refs[ptr] -= 1
        if self.refs[ptr] == 0:
            self.live -= self.size.pop(ptr)
            del self.refs[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        outs = pytree.tree_leaves(out)
        for t in outs:
            if not isinstance(t, torch.Tensor) or any(t is a for a in pytree.tree_leaves((args, kwargs))):
                continue  # not a tensor, or an in-place op's own argument
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in self.refs:
                if ptr in inputs or st.nbytes() == 0:
                    continue  # a view of a tensor made before
                self.refs[ptr], self.size[ptr] = 0, st.nbytes()
                self.live += st.nbytes()
                self.peak = max(self.peak, self.live)
            self.refs[ptr] += 1
            weakref.finalize(t, self._release, ptr)
        return out


def test_peak_live_bytes_sees_a_temporary_copy_and_forgets_what_is_freed():
    x = torch.zeros(1000, dtype=torch.bfloat16)
    with PeakLiveBytes() as m:
        y = x.float()  # 4000 bytes
        z = y[:10]  # a view: nothing new
        del y, z
        w = x.float()
    assert m.peak == 4000 and m.live == 4000
    del w
    assert m.live == 0


def _wide_model():
    sizes = TinyLlavaSizes(
        text_hidden=256, text_heads=2, text_kv_heads=2, text_layers=1, text_intermediate=256
    )
    model, processor = build_tiny_llava(seed=0, sizes=sizes)
    return model.to(torch.bfloat16), processor


def test_router_summaries_and_their_build_fit_the_memory_bar(tmp_path, monkeypatch):
    from PIL import Image

    # the bar is the share of the layer's KV; this tiny layer's KV is far below the floor that spares a
    # short prompt its per-page calls, so the floor is lifted to measure the share
    monkeypatch.setattr(summaries_mod, "SUMMARY_TEMP_FLOOR", 0)

    model, processor = _wide_model()
    text = model.config.text_config
    torch.manual_seed(0)
    router = HybridRouter(RouterConfig(text.hidden_size, text.num_hidden_layers, text.num_key_value_heads))
    weights = str(save_router(router, tmp_path))
    g = torch.Generator().manual_seed(1)
    imgs = [
        Image.fromarray((torch.rand(128, 128, 3, generator=g) * 255).to(torch.uint8).numpy())
        for _ in range(4)
    ]
    prompt = "USER: <image>\n<image>\nwhat color is the circle ? ASSISTANT:"
    inputs = processor(images=imgs, text=[prompt, prompt], return_tensors="pt", padding=True)
    inputs["pixel_values"] = inputs["pixel_values"].to(torch.bfloat16)
    wrapped = mm_oval.wrap(model, OvalConfig(retrieval="router", retrieval_options={"weights": weights}))
    peaks: list[tuple[int, int]] = []  # (peak temporaries, the layer's KV bytes) per build
    real = PagedLayer._summarize

    def measured(layer, first, stop):
        b, h, n, d = layer.keys.shape
        with PeakLiveBytes() as m:
            real(layer, first, stop)
        peaks.append((m.peak, 2 * b * h * int(layer.page_len.sum(-1).max()) * d * layer.keys.element_size()))

    try:
        PagedLayer._summarize = measured
        with torch.no_grad():
            cache = prefill(wrapped, **inputs)
    finally:
        PagedLayer._summarize = real
        mm_oval.unwrap(wrapped)
    layer = cache.layers[0]
    record = layer.summaries["route_emb"]
    assert list(layer.summaries) == ["route_emb"] and record.dtype == torch.bfloat16
    assert record.shape[-1] == router.config.route_dim
    # the record against the KV of the pages it indexes: 64 bf16 entries per page and head, a 2x2 image
    # page's KV 2 x 4 x 128 bf16
    page_kv = 2 * int(layer.page_len.sum()) * layer.keys.shape[-1] * layer.keys.element_size()
    assert record.numel() * record.element_size() <= 0.15 * page_kv
    a = cache_stats(cache)["allocated_bytes"]
    assert a["summaries"] <= 0.15 * a["kv"]
    assert peaks and all(peak <= kv for peak, kv in peaks), peaks
