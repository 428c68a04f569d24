"""`mm_oval.stats.to_prometheus`: a request's stats in the Prometheus text format, read back with the
client's own parser, carry the same figures as `get_stats`; what a request does not have is left out."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

import mm_oval
from mm_oval.errors import ConfigError
from mm_oval.stats import get_stats, to_prometheus


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_retrieval_requests_figures_are_exported_with_the_callers_labels(tiny_random_llava, llava_batch):
    model, _ = tiny_random_llava
    inputs = llava_batch(["USER: <image>\nwhat is it? ASSISTANT:"] * 2)
    # 2x2 tiles: on the tiny model's 8x8 grid, a quarter of the image leaves no 4x4 page to choose among
    mm_oval.wrap(model, method="snapkv", budget=0.25, retrieval="quest", read_budget=0.25, image_tile=2)
    try:
        model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        stats = get_stats(model)
    finally:
        mm_oval.unwrap(model)
    got = _samples(to_prometheus(stats, labels={"model": "tiny", "rank": "0"}))
    me = (("model", "tiny"), ("rank", "0"))

    def value(name: str, **labels: str) -> float:
        return got[(name, tuple(sorted((*me, *labels.items()))))]

    assert value("mm_oval_allocated_bytes", kind="total") == stats["allocated_bytes"]["total"]
    assert value("mm_oval_kv_fraction_kept", modality="image") == pytest.approx(
        stats["image_kv_fraction_kept"]
    )
    assert value("mm_oval_decode_steps") == stats["decode_steps"] >= 3
    br = stats["bytes_read"]
    assert (
        value("mm_oval_bytes_read", part="dense", modality="image", per="request")
        == br["total"]["image"]["dense"]
    )
    assert value("mm_oval_bytes_read", part="read", modality="all", per="step") == pytest.approx(
        br["per_step"]["read"]
    )
    assert value("mm_oval_read_vs_dense", modality="all") == pytest.approx(br["read_vs_dense"])
    assert value("mm_oval_page_read_fraction") == pytest.approx(stats["page_read_fraction"])
    info = value("mm_oval_config_info", method="snapkv", budget="0.25", retrieval="quest", read_budget="0.25",
                 text_budget="1.0", eviction_scope="image", read_scope="image", read_bytes_budget="None",
                 read_head_budget="uniform", read_chunks="retrieval", dense_layers="0", read_layer_budget="uniform",
                 unread_pages="skip")  # fmt: skip
    assert info == 1.0


def test_figures_a_request_does_not_have_are_left_out(tiny_random_llava, llava_batch):
    model, _ = tiny_random_llava
    mm_oval.wrap(model, method="snapkv", budget=0.5)
    try:
        model.generate(**llava_batch(["USER: <image>\nwhat? ASSISTANT:"]), max_new_tokens=2, do_sample=False)
        stats = get_stats(model)
    finally:
        mm_oval.unwrap(model)
    text = to_prometheus(stats)
    assert stats["page_read_fraction"] is None
    assert "mm_oval_page_read_fraction " not in text and "mm_oval_page_read_fraction{" not in text
    assert _samples(text)[("mm_oval_read_vs_dense", (("modality", "all"),))] == 1.0  # no retrieval: dense
    with pytest.raises(ConfigError, match="get_stats"):
        to_prometheus({"method": "snapkv"})
